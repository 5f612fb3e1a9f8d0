"""`jaxdata bench minibatch`: the pipelines train alike on the same samples, and `--breakdown`
splits the GPU-centric step into parts whose device times add up (on the CPU: XLA's
operations), with a link bound from the batch's distinct rows."""

import jax
import numpy as np
import pytest
from bench_checks import breakdown_cells

from benchmarks import minibatch
from jaxdata import cli
from jaxdata.data.powerlaw import powerlaw_graph
from jaxdata.host import HostGraph, sample_neighbors


def test_bench_minibatch_pipelines_and_breakdown(tmp_path):
  out = tmp_path / "minibatch.md"
  code = cli.main(
    [
      "bench",
      "minibatch",
      "--quick",
      "--nodes",
      "3000",
      "--edges",
      "30000",
      "--features",
      "16",
      "--batches",
      "3",
      "--batch-size",
      "64",
      "--fanouts",
      "5,3",
      "--pipelines",
      "host,device",
      "--device-counts",
      "1",
      "--breakdown",
      "--write",
      str(out),
    ]
  )
  assert code == 0
  text = out.read_text()
  pipelines = text.split("## Where")[0]  # the first table: a row per pipeline and GPU count
  rows = {
    line.split("|")[1].strip(): line.split("|")
    for line in pipelines.splitlines()
    if "| 1 |" in line
  }
  assert set(rows) == {"all-in-GPU", "GPU-centric (jaxdata)"}
  assert rows["all-in-GPU"][-2] == rows["GPU-centric (jaxdata)"][-2]  # the same loss
  cells = breakdown_cells(text)
  assert cells["sampling"] > 0 and cells["feature gathers"] > 0
  assert cells["forward"] > 0 and cells["backward"] > 0 and cells["optimizer (Adam)"] > 0
  assert cells["deduplication"] == cells["block building"] == 0  # a tree: neither
  link = list(cells.values())[-1]
  assert link > 0


def test_breakdown_link_bound_counts_distinct_rows():
  """`stages`' link bound reads each distinct sampled node's row once (NumPy's unique count)."""
  ds = powerlaw_graph(num_nodes=500, num_edges=4000, feature_dim=8)
  with HostGraph(ds.indptr, ds.indices, features=ds.features) as g:
    b = minibatch.stages(ds, g, (4, 2), 32, 2, 0)
    rows = minibatch.seed_batches(ds.train_nodes, 32, np.random.default_rng(0), None)[:7]
    counts = []
    for i, seeds in enumerate(rows[:7]):
      t = sample_neighbors(g, seeds, (4, 2), jax.random.key(i))
      counts.append(
        len(
          np.unique(
            np.concatenate([np.asarray(n)[np.asarray(m)] for n, m in zip(t.nodes, t.masks)])
          )
        )
      )
  assert b.feature_bytes == pytest.approx(np.mean(counts) * 8 * 4)
  assert b.memcpy_gbps > 0 and b.link_ms == pytest.approx(
    1e3 * b.feature_bytes / (b.memcpy_gbps * 1e9)
  )
