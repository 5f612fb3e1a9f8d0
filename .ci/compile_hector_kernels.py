"""Compiles the CUDA source of hector's GEMM and weight-gradient kernels over a grid of shapes,
without running anything (the tensor-core templates must compile for every instance).

For RGCN (dims 16 to 256), RGAT and HGT (1 and 4 heads), float32 and bfloat16 inputs, at
precision "default" (tensor cores) and "highest": the forward and backward kernels of each
layer (scatter and per-edge/per-pair store epilogues, transposed weights in the backward GEMMs,
weight gradients, per-head GEMMs), deduplicated by source. Each is compiled to a cubin by
``nvcc -arch=sm_<arch> -cubin`` (works without a GPU), or with ``--nvrtc`` by NVRTC as the
runtime does (jaxdata.hector.compiler, on the GPU machine).

    python3 .ci/compile_hector_kernels.py [--arch 90] [--nvrtc] [--jobs 2] [--quick]
        [--all-kernels] [--keep DIR]

Exits 1 if any kernel fails to compile, printing its source path and the compiler's log.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import os
import subprocess
import sys
import tempfile
import time

# the tensor-core kernels are what this script is for (JAXDATA_HECTOR_TENSOR_CORES=0 turns them off)
os.environ.setdefault("JAXDATA_HECTOR_TENSOR_CORES", "1")

import jax  # noqa: E402
import jax.numpy as jnp
import numpy as np

from jaxdata import hector
from jaxdata.data import HeteroGraph


def small_graph(n=40, e=300, r=5):
  rng = np.random.default_rng(0)
  return HeteroGraph.from_edges(
    rng.integers(0, n, e), rng.integers(0, n, e), rng.integers(0, r, e), num_nodes=n
  )


def sources(quick: bool, all_kernels: bool) -> dict[str, str]:
  """{name: source} of every distinct CUDA kernel of the grid."""
  g = small_graph()
  ga = hector.GraphArrays.from_graph(g)
  n, r = g.num_nodes, g.num_relations
  out: dict[str, str] = {}
  dims = (16, 64, 128) if quick else (16, 32, 64, 128, 256)
  heads_list = (1, 4)

  def add(name: str, text: str):
    for i, part in enumerate(text.split("// ---- ")[1:]):
      body = part.split("\n", 1)[1]
      if not all_kernels and (
        "jaxdata.hector gemm" not in body[:200] and "jaxdata.hector weight_grad" not in body[:200]
      ):
        continue
      key = hashlib.sha256(body.split("\n", 1)[1].encode()).hexdigest()[:12]
      out.setdefault(key, body)
      print(f"  {name} #{i}: {key}", file=sys.stderr) if os.environ.get("VERBOSE") else None

  for dt in (jnp.float32, jnp.bfloat16):
    for prec in ("default", "highest"):
      for d in dims:
        x = jnp.zeros((n, d), dt)
        add(
          f"rgcn d={d} {dt.__name__} {prec}",
          hector.rgcn_layer.sources(
            ga, "cuda", precision=prec, x=x, W=jnp.zeros((r, d, d if d < 256 else 96), dt)
          ),
        )
        for heads in heads_list:
          hd = max(d // heads, 8)
          add(
            f"rgat d={d} heads={heads} {dt.__name__} {prec}",
            hector.rgat_layer.sources(
              ga,
              "cuda",
              precision=prec,
              x=x,
              W=jnp.zeros((r, d, heads * hd), dt),
              a_src=jnp.zeros((r, heads, hd), dt),
              a_dst=jnp.zeros((r, heads, hd), dt),
            ),
          )
          f = heads * hd
          kq = jnp.zeros((n, f), dt)
          add(
            f"hgt d={d} heads={heads} {dt.__name__} {prec}",
            hector.hgt_layer.sources(
              ga,
              "cuda",
              precision=prec,
              k=kq,
              q=kq,
              v=kq,
              W_att=jnp.zeros((r, heads, hd, hd), dt),
              W_msg=jnp.zeros((r, heads, hd, hd), dt),
              mu=jnp.zeros((r, heads, 1), dt),
            ),
          )
  return out


def nvcc_compile(src_path: str, arch: int) -> tuple[bool, str]:
  cmd = [
    "nvcc",
    "-cubin",
    f"-arch=sm_{arch}",
    "-std=c++17",
    "-O3",
    "-x",
    "cu",
    src_path,
    "-o",
    src_path + ".cubin",
  ]
  p = subprocess.run(cmd, capture_output=True, text=True)
  return p.returncode == 0, p.stderr[-4000:]


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--arch", type=int, default=90)
  ap.add_argument("--nvrtc", action="store_true", help="compile with NVRTC (the runtime's way)")
  ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
  ap.add_argument("--quick", action="store_true", help="dims 16, 64, 128 only")
  ap.add_argument("--all-kernels", action="store_true", help="traversals too, not only GEMMs")
  ap.add_argument("--keep", help="write the sources here (default: a temporary directory)")
  args = ap.parse_args(argv)
  jax.config.update("jax_platforms", "cpu")
  srcs = sources(args.quick, args.all_kernels)
  tc = sum("mma.sync" in s for s in srcs.values())
  print(
    f"{len(srcs)} distinct kernels ({tc} on tensor cores), sm_{args.arch}, "
    f"{'NVRTC' if args.nvrtc else 'nvcc'}",
    flush=True,
  )
  tmp = args.keep or tempfile.mkdtemp(prefix="hector-kernels-")
  os.makedirs(tmp, exist_ok=True)
  paths = {}
  for key, text in srcs.items():
    paths[key] = os.path.join(tmp, f"{key}.cu")
    with open(paths[key], "w") as f:
      f.write(text)
  start, failed = time.perf_counter(), []
  if args.nvrtc:
    from pathlib import Path

    from jaxdata.hector import compiler

    lib = compiler.nvrtc()
    if lib is None:
      print("NVRTC not found", file=sys.stderr)
      return 1
    build = compiler._nvrtc_build(lib, args.arch)
    for path in paths.values():
      try:
        build(Path(path), Path(path + ".cubin"))
      except compiler.CompileError as e:
        failed.append((path, str(e)))
  else:
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
      futs = {pool.submit(nvcc_compile, p, args.arch): p for p in paths.values()}
      for fut in concurrent.futures.as_completed(futs):
        ok, log = fut.result()
        if not ok:
          failed.append((futs[fut], log))
  for path, log in failed:
    print(f"FAILED {path}\n{log}\n", file=sys.stderr)
  print(
    f"{len(paths) - len(failed)} of {len(paths)} compiled in "
    f"{time.perf_counter() - start:.0f} s; sources in {tmp}"
  )
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
