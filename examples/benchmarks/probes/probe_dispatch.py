"""Where a small graph's inference time goes: the device's kernels or JAX's dispatch.

Usage (GPU machine, after `bash .ci/gpu build`): python3 probe_dispatch.py [graph [dim]]

Times, as `jaxdata bench rgnn --mode inference` does (20 calls queued back to back, waited for
once; the median of rounds), jaxdata's RGCN forward at precision "default" on the graph
(default aifb) against jitted functions that launch next to nothing but take the same
arguments: what a call costs before any kernel runs. If the floor is near the forward's time,
the forward is bound by dispatch, not by its kernels.
"""

import os
import sys

import jax

from benchmarks import rgnn
from benchmarks import rgnn_peers as peers
from jaxdata.timing import median_seconds


def main(graph: str = "aifb", dim: int = 32) -> None:
  g, why = rgnn.load_graph(graph, data_dir=os.environ.get("JAXDATA_DATA_DIR"), quick=False)
  assert g is not None, why
  x, w, ct = jax.device_put(rgnn.case_arrays(g, dim), jax.devices()[0])
  form = peers.jaxdata_formulation(g.hetero, precision=jax.lax.Precision.DEFAULT)
  args = form.graph_args
  leaves = len(jax.tree.leaves(args))
  double_with_args = jax.jit(lambda x, w, g: x * 2).lower(x, w, args).compile()
  double = jax.jit(lambda x: x * 2).lower(x).compile()
  identity = jax.jit(lambda x: x).lower(x).compile()
  cases = {
    "jaxdata forward": peers.compile_step(form, x, w, ct, mode="inference").run,
    f"x * 2 with the same arguments ({leaves} graph arrays)": lambda: double_with_args(x, w, args),
    "x * 2 alone": lambda: double(x),
    "x alone, no kernel (identity)": lambda: identity(x),
  }
  for name, run in cases.items():
    queued = median_seconds(run, warmup=3, repeats=15, queued=20)
    alone = median_seconds(run, warmup=3, repeats=15)
    print(
      f"{graph} dim {dim}  {name:<52} queued {queued * 1e6:8.1f} us   alone {alone * 1e6:8.1f} us",
      flush=True,
    )


if __name__ == "__main__":
  main(*(sys.argv[1:2]), *(int(a) for a in sys.argv[2:3]))
