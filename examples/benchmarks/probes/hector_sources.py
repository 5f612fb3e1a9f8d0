"""Dumps the generated CUDA source of every hector kernel instance of a grid, under stable names,
to check that a change to the CUDA generator (jaxdata.hector.codegen.cuda and its templates)
leaves the kernels the same: run it before and after, then compare the two directories
(``diff -r``; for sources that differ, compile both with ``nvcc -cubin`` and compare
their machine code: see ``--compare``).

The grid: RGCN, RGAT and HGT (1 and 4 heads) at dims 16, 64 and 128 (``--full``: 16 to 256),
float32 and bfloat16 inputs, precision "default" and "highest", with all passes and with none;
every kernel of ``layer.sources(graph, "cuda", ...)`` (GEMMs, weight gradients, traversals,
softmaxes, relation sums), forward and backward. Tensor-core instances are generated
(JAXDATA_HECTOR_TENSOR_CORES=1) unless ``--no-tensor-cores``.

    python3 hector_sources.py DIR [--full] [--no-tensor-cores]
    python3 hector_sources.py --compare BEFORE AFTER [--arch 90] [--jobs 2]

The dump writes DIR/<layer>-<config>-<passes>-<i>.cu, one file per kernel instance. ``--compare``
reports the byte-identical files, and compiles each differing pair (each distinct source once) with
nvcc, comparing the cubins' machine code (.text sections) and kernel info; it exits 1 if any pair
fails to compile or differs in those sections.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import os
import struct
import subprocess
import sys
import tempfile


def dump(out_dir: str, full: bool) -> int:
  """Writes every kernel instance of the grid to `out_dir`; returns how many."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jaxdata import hector
  from jaxdata.data import HeteroGraph

  jax.config.update("jax_platforms", "cpu")
  rng = np.random.default_rng(0)
  n, e, r = 40, 300, 5
  g = HeteroGraph.from_edges(
    rng.integers(0, n, e), rng.integers(0, n, e), rng.integers(0, r, e), num_nodes=n
  )
  ga = hector.GraphArrays.from_graph(g)
  os.makedirs(out_dir, exist_ok=True)
  count = 0

  def add(name: str, text: str):
    nonlocal count
    for i, part in enumerate(text.split("// ---- ")[1:]):
      with open(os.path.join(out_dir, f"{name}-{i}.cu"), "w") as f:
        f.write(part.split("\n", 1)[1])
      count += 1

  dims = (16, 32, 64, 128, 256) if full else (16, 64, 128)
  for passes, pname in ((None, "all"), ((), "none")):
    for dt in (jnp.float32, jnp.bfloat16):
      for prec in ("default", "highest"):
        for d in dims:
          tag = f"d{d}-{dt.__name__}-{prec}-{pname}"
          x = jnp.zeros((n, d), dt)
          add(
            f"rgcn-{tag}",
            hector.rgcn_layer.sources(
              ga,
              "cuda",
              passes=passes,
              precision=prec,
              x=x,
              W=jnp.zeros((r, d, d if d < 256 else 96), dt),
            ),
          )
          for heads in (1, 4):
            hd = max(d // heads, 8)
            add(
              f"rgat-h{heads}-{tag}",
              hector.rgat_layer.sources(
                ga,
                "cuda",
                passes=passes,
                precision=prec,
                x=x,
                W=jnp.zeros((r, d, heads * hd), dt),
                a_src=jnp.zeros((r, heads, hd), dt),
                a_dst=jnp.zeros((r, heads, hd), dt),
              ),
            )
            kq = jnp.zeros((n, heads * hd), dt)
            add(
              f"hgt-h{heads}-{tag}",
              hector.hgt_layer.sources(
                ga,
                "cuda",
                passes=passes,
                precision=prec,
                k=kq,
                q=kq,
                v=kq,
                W_att=jnp.zeros((r, heads, hd, hd), dt),
                W_msg=jnp.zeros((r, heads, hd, hd), dt),
                mu=jnp.zeros((r, heads, 1), dt),
              ),
            )
  return count


def _sass(src: str, work: str, arch: int) -> tuple[str | None, str]:
  """(normalized SASS or None, compiler log) of CUDA source `src`."""
  key = hashlib.sha256(src.encode()).hexdigest()[:16]
  cu, cubin = os.path.join(work, key + ".cu"), os.path.join(work, key + ".cubin")
  with open(cu, "w") as f:
    f.write(src)
  p = subprocess.run(
    ["nvcc", "-cubin", f"-arch=sm_{arch}", "-std=c++17", "-O3", "-x", "cu", cu, "-o", cubin],
    capture_output=True,
    text=True,
  )
  if p.returncode:
    return None, p.stderr[-3000:]
  return _code(open(cubin, "rb").read()), ""


def _code(elf: bytes) -> str:
  """The machine code of a cubin (an ELF64 file): every .text* section, by name, as hex (nvcc
  without -lineinfo embeds no source names; cuobjdump is not needed)."""
  (shoff,) = struct.unpack_from("<Q", elf, 0x28)
  shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
  secs = [struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize) for i in range(shnum)]
  strtab = secs[shstrndx]
  names = elf[strtab[4] : strtab[4] + strtab[5]]
  out = []
  for name_off, kind, _, _, off, size in secs:
    name = names[name_off : names.index(b"\0", name_off)].decode()
    if name.startswith((".text", ".nv.shared", ".nv.constant0", ".nv.info.")):
      data = elf[off : off + size] if kind != 8 else b""  # 8: SHT_NOBITS (size only)
      out.append(f"{name} {size} {data.hex()}")
  return "\n".join(sorted(out))


def compare(before: str, after: str, arch: int, jobs: int) -> int:
  names = sorted(os.listdir(before))
  if sorted(os.listdir(after)) != names:
    print("the two dumps hold different instance names", file=sys.stderr)
    return 1
  text = {}
  differ = []
  for name in names:
    a, b = (open(os.path.join(d, name)).read() for d in (before, after))
    if a != b:
      differ.append(name)
      text[name] = (a, b)
  print(
    f"{len(names) - len(differ)} of {len(names)} instances byte-identical; {len(differ)} differ",
    flush=True,
  )
  distinct = {}
  for a, b in text.values():
    distinct.setdefault(a, set()).add(b)
  pairs = [(a, b) for a, bs in distinct.items() for b in bs]
  srcs = {s for p in pairs for s in p}
  print(f"{len(pairs)} distinct before/after pairs, {len(srcs)} sources to compile", flush=True)
  work = tempfile.mkdtemp(prefix="hector-sass-")
  with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
    sass = dict(zip(srcs, pool.map(lambda s: _sass(s, work, arch), srcs)))
  bad = 0
  for a, b in pairs:
    (sa, la), (sb, lb) = sass[a], sass[b]
    names_ = sorted(n for n, (x, y) in text.items() if x == a and y == b)
    if sa is None or sb is None:
      bad += 1
      print(f"COMPILE FAILED {names_[0]}: {la or lb}", file=sys.stderr)
    elif sa != sb:
      bad += 1
      print(f"SASS DIFFERS {names_[0]} (+{len(names_) - 1} more)", file=sys.stderr)
  print(
    f"{len(pairs) - bad} of {len(pairs)} differing pairs compile to identical SASS "
    f"(sources in {work})"
  )
  return 1 if bad else 0


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("dir", nargs="?")
  ap.add_argument("--full", action="store_true", help="dims 16, 32, 64, 128, 256")
  ap.add_argument("--no-tensor-cores", action="store_true")
  ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
  ap.add_argument("--arch", type=int, default=90)
  ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
  args = ap.parse_args(argv)
  if args.compare:
    return compare(*args.compare, args.arch, args.jobs)
  if not args.dir:
    ap.error("give DIR, or --compare BEFORE AFTER")
  os.environ["JAXDATA_HECTOR_TENSOR_CORES"] = "0" if args.no_tensor_cores else "1"
  print(f"{dump(args.dir, args.full)} kernel instances written to {args.dir}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
