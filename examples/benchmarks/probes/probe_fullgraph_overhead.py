"""Full-graph RGCN on one device: the single-device path against the partitioned path run
with one part (jaxdata.train.partitioned, K = 1), steady epoch times and losses.

`jaxdata train rgcn --devices 1` in one process takes the single-device path; this measures
what the partitioned code would cost there (shard_map over one device, the padding node,
the slices). Usage: python3 probe_fullgraph_overhead.py [aifb.tgz] [epochs]
"""

import dataclasses
import sys

import numpy as np

from jaxdata.tasks import rgcn
from jaxdata.train import attention, partitioned

epochs = int(sys.argv[2]) if len(sys.argv) > 2 else 20
datas = [{"source": "synthetic", "nodes": 20_000, "edges": 200_000, "relations": 50, "seed": 0}]
if len(sys.argv) > 1:
  datas.insert(0, {"source": "rdf", "path": sys.argv[1]})
for data in datas:
  dataset, setup = rgcn.load_dataset(data)
  setup = {k: v for k, v in setup.items() if k in ("num_bases", "l2", "val_fraction", "bias")}
  config = rgcn.TrainConfig(epochs=epochs, **setup)
  one = attention.train(dataset, config)
  part = partitioned.train_rgcn(dataset, dataclasses.replace(config, devices=1))
  steady = lambda r: np.median([h["seconds"] for h in r.history[2:]]) * 1e3  # noqa: E731
  loss_gap = max(
    abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in zip(one.history, part.history)
  )
  print(
    f"{dataset.name}: single-device path {steady(one):.2f} ms/epoch, partitioned K=1 "
    f"{steady(part):.2f} ms/epoch; largest relative loss gap {loss_gap:.2e}; test acc "
    f"{one.test_accuracy:.4f} / {part.test_accuracy:.4f}",
    flush=True,
  )
