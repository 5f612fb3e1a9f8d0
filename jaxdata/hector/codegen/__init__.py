"""Code generation: C++ (CPU, `codegen.cpu`) and CUDA (`codegen.cuda`) source for one kernel
instance, from the fixed files in jaxdata/hector/templates/ and what varies per instance.

Every generated kernel has the same interface, `jaxdata.hector.operands`: the graph's arrays
(`operands.GRAPH`, in that order), then the instance's inputs (``in0``, ``in1``, ...), then its
one output (float32, or bfloat16 where it stores rather than sums its rows:
`compiled.out_dtype`); and the scalars ``E`` (rows of the domain), ``N`` (nodes), ``R``
(relations), ``T`` (row tiles, GPU GEMMs) and ``P`` (unique (src, relation) pairs).

An instance over the compact domain gets the pairs in place of the edges (``src``, ``etype``,
``rel_offsets``, the CSR view and ``E`` describe pairs; ``dst`` and the CSC view are not
meaningful there); ``pair``, ``pair_offsets`` and ``pair_edges`` link edges to pairs.

Feature widths are compile-time constants, so every loop over features has a known trip count.
The IR's expressions print as C the same way for both targets (`codegen.common`).
"""

from __future__ import annotations

from jaxdata.hector.codegen import cpu, cuda
from jaxdata.hector.codegen.cuda import (
  GEMM_TILE_ROWS,
  MATHS,
  SOFTMAX_BLOCK_DEGREE,
  SOFTMAX_GROUP,
  SOFTMAX_MAX_WIDTH,
  WGRAD_TILE_ROWS,
  Tile,
  launch,
  math,
  tilings,
)
from jaxdata.hector.lowering import Gemm, Traversal, WeightGrad

__all__ = [
  "generate",
  "launch",
  "math",
  "tile_rows",
  "tilings",
  "zero_output",
  "Tile",
  "GEMM_TILE_ROWS",
  "WGRAD_TILE_ROWS",
  "SOFTMAX_BLOCK_DEGREE",
  "SOFTMAX_GROUP",
  "SOFTMAX_MAX_WIDTH",
  "MATHS",
]


def tile_rows(k, kind: str = "fma") -> int:
  """Edges per row tile of a CUDA GEMM or weight-gradient kernel of `math` kind `kind` (0: the
  kernel has no tiles). Read from `cuda` at each call, so that a probe setting them there
  (probe_constants.py) moves the tiles and the kernels together."""
  if isinstance(k, Gemm):
    return 0 if cuda.thin(k) else cuda.GEMM_TILE_ROWS
  if isinstance(k, WeightGrad):
    return cuda.WGRAD_TILE_ROWS if kind == "fma" else cuda.MMA_WGRAD_TILE_ROWS
  return 0


def zero_output(k) -> bool:
  """Whether the launcher zeroes the output first (the kernel sums into it)."""
  if isinstance(k, Gemm):
    return k.out != "edge"
  if isinstance(k, Traversal):
    return k.sink != "store"  # the softmax leaves the edges it skips at 0
  return True


def generate(
  k,
  dtypes: tuple[str, ...],
  target: str,
  label: str = "",
  precision: str = "default",
  out_dtype: str = "float32",
  tile: Tile | None = None,
) -> str:
  """The source of one kernel instance for "cpu" or "cuda"; `dtypes` gives each input slot's
  dtype ("float32" or "bfloat16") and `out_dtype` the output's (bfloat16 only where
  `zero_output(k)` is false: summed rows stay float32); `label` goes into the first comment
  line; `precision` (a level of `jaxdata.hector.precision`) chooses a CUDA GEMM's `math` (CPU
  kernels are always float32-exact, as `jnp.dot` is on the CPU); `tile` a CUDA tensor-core
  instance's tiling (`tilings`; by default its first)."""
  if out_dtype != "float32" and zero_output(k):
    raise ValueError(
      f"hector: {k.template} sums into its output, which must be float32, not {out_dtype}"
    )
  if target == "cpu":
    body = cpu.generate(k, dtypes, out_dtype)
  elif target == "cuda":
    body = cuda.generate(k, dtypes, precision, out_dtype, tile)
  else:
    raise ValueError(f"hector: target must be 'cpu' or 'cuda', got {target!r}")
  return f"// jaxdata.hector {k.template}: {label or k}\n" + body
