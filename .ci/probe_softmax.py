"""The CUDA edge softmax's tiers side by side: one RGAT layer (jaxdata bench tensor-cores' graph,
bfloat16, 4 heads) timed forward-only and forward + backward, once per setting of the softmax's
constants in jaxdata.hector.codegen.cuda (SOFTMAX_GROUP, SOFTMAX_BLOCK_DEGREE,
SOFTMAX_THREADS).
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

#: (SOFTMAX_GROUP, SOFTMAX_BLOCK_DEGREE, SOFTMAX_THREADS)
SETTINGS = [(8, 256, 256), (4, 256, 256), (16, 256, 256), (32, 256, 256), (8, 64, 256),
            (8, 1024, 256), (8, 256, 1024)]


def main(dim: int = 64, profile: int = 0) -> None:
  """`profile` 1: also one forward per setting between cuProfilerStart and cuProfilerStop."""
  cuda_lib = ctypes.CDLL("libcuda.so.1") if profile else None
  case, why = rgnn_attention.load_case("rgat", "synthetic", data_dir=None, quick=False)
  assert case is not None, why
  arrays = rgnn_attention.graph_arrays(case)
  x, w, ct = jax.device_put(rgnn_attention.case_arrays("rgat", case, dim, 4), jax.devices()[0])
  x, w = jax.tree.map(lambda a: a.astype("bfloat16"), (x, w))
  print(f"rgat synthetic dim {dim} bfloat16: group block_degree threads  forward ms  fwd+bwd ms")
  for setting in SETTINGS:
    cuda.SOFTMAX_GROUP, cuda.SOFTMAX_BLOCK_DEGREE, cuda.SOFTMAX_THREADS = setting
    jax.clear_caches()
    steps = {mode: peers.compile_step(rgnn_attention.rgat_jaxdata_formulation(arrays, None),
                                      x, w, ct, mode=mode) for mode in ("inference", "train")}
    times = [median_seconds(s.run, warmup=3, repeats=9, queued=20) * 1e3 for s in steps.values()]
    print("  {:5d} {:12d} {:7d}".format(*setting), f" {times[0]:10.3f}  {times[1]:10.3f}",
          flush=True)
    if profile:  # one forward for Nsight Compute (run under ncu --profile-from-start off)
      cuda_lib.cuProfilerStart()
      jax.block_until_ready(steps["inference"].run())
      cuda_lib.cuProfilerStop()


if __name__ == "__main__":
  main(*map(int, sys.argv[1:]))
