"""The CUDA edge softmax's tiers side by side: one RGAT layer (jaxdata bench tensor-cores' graph,
bfloat16, 4 heads) timed forward-only and forward + backward, once per setting of the softmax's
constants in jaxdata.hector.codegen.cuda (SOFTMAX_GROUP, SOFTMAX_UNROLL, SOFTMAX_BLOCK_DEGREE).
The softmax is the only kernel that changes between rows, so differences are the softmax's.

Usage (on the GPU machine, after `bash .ci/gpu build`): python3 .ci/probe_softmax.py [dim [1]]
(with 1, run it under `ncu --profile-from-start off` for each setting's kernel times)
"""
import ctypes
import sys

import jax

from jaxdata.bench import rgnn_attention
from jaxdata.bench import rgnn_peers as peers
from jaxdata.hector.codegen import cuda
from jaxdata.timing import median_seconds

#: (SOFTMAX_GROUP, SOFTMAX_UNROLL, SOFTMAX_BLOCK_DEGREE, SOFTMAX_THREADS)
SETTINGS = [(8, 1, 256, 256), (8, 4, 256, 256), (8, 4, 256, 1024), (8, 8, 256, 1024),
            (16, 4, 256, 1024), (8, 4, 1024, 1024)]


def main(dim: int = 64, profile: int = 0) -> None:
  """`profile` 1: also one forward per setting between cuProfilerStart and cuProfilerStop."""
  cuda_lib = ctypes.CDLL("libcuda.so.1") if profile else None
  case, why = rgnn_attention.load_case("rgat", "synthetic", data_dir=None, quick=False)
  assert case is not None, why
  arrays = rgnn_attention.graph_arrays(case)
  x, w, ct = jax.device_put(rgnn_attention.case_arrays("rgat", case, dim, 4), jax.devices()[0])
  x, w = jax.tree.map(lambda a: a.astype("bfloat16"), (x, w))
  print(f"rgat synthetic dim {dim} bfloat16: group unroll block_degree threads  forward ms  "
        "fwd+bwd ms")
  for setting in SETTINGS:
    (cuda.SOFTMAX_GROUP, cuda.SOFTMAX_UNROLL, cuda.SOFTMAX_BLOCK_DEGREE,
     cuda.SOFTMAX_THREADS) = setting
    jax.clear_caches()
    times = []
    for mode in ("inference", "train"):
      form = rgnn_attention.rgat_jaxdata_formulation(arrays, None)
      step = peers.compile_step(form, x, w, ct, mode=mode)
      times.append(median_seconds(step.run, warmup=3, repeats=9, queued=20) * 1e3)
    print("  {:5d} {:6d} {:12d} {:7d}".format(*setting), f" {times[0]:10.3f}  {times[1]:10.3f}",
          flush=True)
    if profile:  # one forward for Nsight Compute (run under ncu --profile-from-start off)
      step = peers.compile_step(rgnn_attention.rgat_jaxdata_formulation(arrays, None), x, w, ct,
                                mode="inference")
      jax.block_until_ready(step.run())
      cuda_lib.cuProfilerStart()
      jax.block_until_ready(step.run())
      cuda_lib.cuProfilerStop()


if __name__ == "__main__":
  main(*map(int, sys.argv[1:]))
