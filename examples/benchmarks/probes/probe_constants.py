"""Settings of the CUDA generator's constants side by side: hector layers timed forward-only and
forward + backward, once per setting of constants in jaxdata.hector.codegen.cuda (the edge
softmax's SOFTMAX_GROUP, SOFTMAX_BLOCK_DEGREE, SOFTMAX_THREADS; the grouped sums' GROUP_RUN;
the tensor-core templates' MMA_WGRAD_TILE_ROWS and MMA_STAGES),
in one process: each setting's kernels differ in source, so they compile anew. A name not in
jaxdata.hector.codegen.cuda is looked up in jaxdata.hector.codegen.common (DOT_ALIGN).

Usage (on the GPU machine, after `bash .ci/gpu build`):
  python3 probe_constants.py CASES NAME=v1,v2,... [NAME=...] [--profile]
CASES: model:graph:dim:dtype[:precision], comma-separated (the cases of profile_hector.py;
precision "default" unless given). Settings are the cartesian product of the NAME lists, the
first value of each being the baseline row. With --profile, one forward per setting runs between
cuProfilerStart and cuProfilerStop (run under ncu --profile-from-start off).
Example (session 16's softmax tiers): rgat:synthetic:64:bfloat16 SOFTMAX_GROUP=8,4,16,32
"""

import ctypes
import itertools
import sys

import jax
from profile_hector import build_step

from jaxdata.hector.codegen import common, cuda
from jaxdata.timing import median_seconds


def main(cases: str, settings: list[str], profile: bool = False) -> None:
  names = [s.split("=")[0] for s in settings]
  values = [[int(v) for v in s.split("=")[1].split(",")] for s in settings]
  modules = {}
  for name in names:
    modules[name] = next(
      (m for m in (cuda, common) if isinstance(getattr(m, name, None), int)), None
    )
    if modules[name] is None:
      raise SystemExit(f"{name}: not an integer constant of jaxdata.hector.codegen.cuda or .common")
  cuda_lib = ctypes.CDLL("libcuda.so.1") if profile else None
  for case in cases.split(","):
    model, graph, dim, dtype, *rest = case.split(":")
    precision = rest[0] if rest else "default"
    print(
      f"{model} {graph} dim {dim} {dtype} {precision}: {' '.join(names)}  forward ms  fwd+bwd ms",
      flush=True,
    )
    for setting in itertools.product(*values):
      for name, v in zip(names, setting):
        setattr(modules[name], name, v)
      jax.clear_caches()
      steps = {
        mode: build_step(model, graph, int(dim), precision, dtype, mode)
        for mode in ("inference", "train")
      }
      times = [median_seconds(s.run, warmup=3, repeats=9, queued=20) * 1e3 for s in steps.values()]
      print(
        "  " + " ".join(f"{v:>{len(n)}d}" for n, v in zip(names, setting)),
        f" {times[0]:10.3f}  {times[1]:10.3f}",
        flush=True,
      )
      if profile:
        cuda_lib.cuProfilerStart()
        jax.block_until_ready(steps["inference"].run())
        cuda_lib.cuProfilerStop()


if __name__ == "__main__":
  args = [a for a in sys.argv[1:] if a != "--profile"]
  main(args[0], args[1:], profile="--profile" in sys.argv)
