"""GraphSAGE step time on one vs two devices, all-in-GPU and GPU-centric (a 1M-node graph)."""

import numpy as np

from jaxdata.data import powerlaw_graph
from jaxdata.host import HostGraph, HostTable
from jaxdata.train.sage import SageConfig, train

t = HostTable.empty((1_000_000, 256), np.float32)
ds = powerlaw_graph(
  num_nodes=1_000_000, num_edges=20_000_000, feature_dim=256, features_out=t.as_numpy()
)
with HostGraph(ds.indptr, ds.indices, features=t) as g:
  for pipe in ("device", "host"):
    for ndev in (1, 2):
      r = train(
        ds,
        SageConfig(pipeline=pipe, devices=ndev, epochs=2, max_batches=60, evaluate=False),
        graph=g,
      )
      h = r.history[-1]
      print(pipe, ndev, f"{1e3 * h['seconds'] / h['batches']:.2f} ms/batch", flush=True)
