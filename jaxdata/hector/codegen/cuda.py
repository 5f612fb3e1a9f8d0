"""CUDA: one kernel instance as a ``__global__ jaxdata_hector_kernel(const Params p)``.

The source is templates/cuda.cuh (for a GEMM or weight gradient, templates/gemm.cuh or, on
tensor cores, templates/mma.cuh: the fixed bodies of those kernels as function templates),
templates/common.h (for an edge softmax or a relation sum, templates/traversal.cuh), then the
kernel: the `Params` struct (every buffer pointer, then the scalars, as `operands` lays them
out; the launcher in xla_ffi/hector/launch_cuda.cc packs them in that order), the signature,
the operand pointers and the instance's body (where a template holds the body: the few
functors it takes and one call). Kernels are edge-parallel and sum into their outputs with
atomics (once per run of equal targets inside a tile), except the edge softmax, which gives
each node a warp (a node of many edges the whole block) and no atomics.

GEMM and weight-gradient instances come in three kinds (`math`): "fma" (float32 FMAs on CUDA
cores: float32-exact products), "tf32" (tensor cores, operands rounded to TF32, float32 sums)
and "bf16" (tensor cores on bfloat16 operands, exact products, float32 sums). The kind follows
the operands' dtypes and the matmul precision (`jaxdata.hector.precision`), as `jnp.dot` on an
NVIDIA GPU: bfloat16 operands always take the tensor cores; float32 operands take TF32 unless
the precision is "highest".
"""

from __future__ import annotations

import dataclasses
import os

from jaxdata.hector import operands
from jaxdata.hector.codegen.common import (
  GEMM_THIN_K,  # noqa: F401  (also read here as cuda.GEMM_THIN_K)
  expr,
  groups,
  guard,
  pointers,
  reads_valid,
  row_ids,
  row_pointer,
  scale,
  template,
  thin,
  weight,
  weight_offset,
)
from jaxdata.hector.lowering import Gemm, Traversal, WeightGrad

#: the kinds of GEMM a CUDA GEMM or weight-gradient instance can be generated as
MATHS = ("fma", "tf32", "bf16")

#: Tensor-core kernels ("tf32", "bf16") run unless this environment variable is "0" (then every
#: precision runs the float32 CUDA-core "fma" kernels, float32-exact). On the H200 they make
#: RGCN forward + backward 2.2-3.5x faster in TF32 and 2.5-4.6x in bfloat16 than the CUDA-core
#: kernels (dims 64-128, 2M edges; docs/benchmarks/tensor_cores.md).
TENSOR_CORES_ENV = "JAXDATA_HECTOR_TENSOR_CORES"


def tensor_cores_enabled() -> bool:
  """Whether GEMM instances may run on tensor cores (unless `TENSOR_CORES_ENV` is "0")."""
  return os.environ.get(TENSOR_CORES_ENV, "1") != "0"


def math(k, dtypes: tuple[str, ...], precision: str = "default") -> str:
  """The kind of GEMM (one of `MATHS`) instance `k` runs as: "bf16" when both operands are
  bfloat16 (and, for a weight gradient, no edge scale multiplies them: a scaled bfloat16 row is
  no longer a bfloat16 value), else "fma" at precision "highest" and "tf32" otherwise.
  Traversals are always "fma", and so is everything unless `tensor_cores_enabled()`."""
  if not tensor_cores_enabled() or thin(k):
    return "fma"
  if isinstance(k, Gemm):
    slots, scaled = (k.rows.slot, k.weight), False
  elif isinstance(k, WeightGrad):
    slots, scaled = (k.left.slot, k.right.slot), bool(k.scales)
  else:
    return "fma"
  if not _chunkable(k, dtypes):
    return "fma"
  if not scaled and all(dtypes[s] == "bfloat16" for s in slots):
    return "bf16"
  return "fma" if precision == "highest" else "tf32"


def _chunkable(k, dtypes: tuple[str, ...]) -> bool:
  """Whether every operand row of GEMM or weight-gradient `k` can be copied to shared memory in
  pieces of 4 bytes or more (cp.async's smallest): its extent (the features one row gives) and
  its stride (its row width) are whole multiples of 4 bytes (`chunk` in templates/mma.cuh)."""
  size = lambda slot: 2 if dtypes[slot] == "bfloat16" else 4  # noqa: E731
  if isinstance(k, Gemm):
    rows = [
      (k.rows.slot, k.k, max(k.rows.width, 1)),
      (k.weight, k.k if k.transpose else k.n, k.k if k.transpose else k.n),
    ]
  else:
    rows = [(k.left.slot, k.k, max(k.left.width, 1)), (k.right.slot, k.n, max(k.right.width, 1))]
  return all((extent | stride) * size(s) % 4 == 0 for s, extent, stride in rows)


def generate(
  k,
  dtypes: tuple[str, ...],
  precision: str = "default",
  out_dtype: str = "float32",
  tile: Tile | None = None,
) -> str:
  """The CUDA source of instance `k` (`dtypes`: each input slot's dtype; `precision`: the
  matmul level of a GEMM; `out_dtype`: its output's; `tile`: a tensor-core instance's tiling,
  one of `tilings(k, kind)`, by default the first), without its label."""
  kind = math(k, dtypes, precision)
  tile = tile or tilings(k, kind)[0]
  ok = guard(k, reads_valid(k, kind))
  if thin(k):
    body = ok + _thin_gemm(k)
  elif kind == "fma":
    body = ok + {Gemm: _gemm, WeightGrad: _wgrad, Traversal: _traversal}[type(k)](k)
  else:
    body = ok + {Gemm: _gemm_mma, WeightGrad: _wgrad_mma}[type(k)](k, kind, tile)
  nbuf, nscal = operands.num_buffers(len(dtypes)), len(operands.SCALARS)
  signature = (
    f"struct Params {{ const void* buf[{nbuf}]; int64_t scal[{nscal}]; }};\n"
    f'extern "C" __global__ void __launch_bounds__({_bounds(k, tile)})'
    f"{_cluster(k)}\n"
    "jaxdata_hector_kernel(const Params p) {\n"
  )
  walks = isinstance(k, Traversal) or thin(k)
  prelude = ""
  if _softmax_kernel(k) and SOFTMAX_HUB_CLUSTER > 1:
    prelude += f"#define JAXDATA_HUB_CLUSTER {SOFTMAX_HUB_CLUSTER}\n"
  if walks and PLAIN_LOADS:
    prelude += "#define JAXDATA_PLAIN_LOADS 1\n"
  prelude += template("cuda.cuh")
  if isinstance(k, (Gemm, WeightGrad)) and not thin(k):
    if kind != "fma":
      prelude += f"#define JAXDATA_MMA_STAGES {MMA_STAGES}\n"
    prelude += template("gemm.cuh" if kind == "fma" else "mma.cuh")
  prelude += template("common.h")
  if isinstance(k, Traversal) or thin(k):
    prelude += template("traversal.cuh")  # after common.h: it uses span()
  return (
    prelude
    + signature
    + pointers(
      body,
      dtypes,
      _buffer if walks and OPERAND_ALIGN else lambda i: f"p.buf[{i}]",
      lambda i: f"p.scal[{i}]",
      out_dtype,
    )
    + body
  )


#: 1: traversals load through plain loads (which the compiler merges), not __ldg
PLAIN_LOADS = 1
#: bytes a traversal's operand pointers are declared aligned to (0: not declared); XLA's buffers
#: are aligned to 16 bytes at least
OPERAND_ALIGN = 16


def _buffer(i: int) -> str:
  return f"__builtin_assume_aligned(p.buf[{i}], {OPERAND_ALIGN})"


#: rows per tile of the CUDA GEMM (edges) and of the weight-gradient GEMM (edges per block; on
#: tensor cores MMA_WGRAD_TILE_ROWS: a block adds its tile of dW to the output with one atomic
#: per element, so more edges per block are fewer atomics)
GEMM_TILE_ROWS = 64
WGRAD_TILE_ROWS = 256
MMA_WGRAD_TILE_ROWS = 512
#: k-steps a tensor-core kernel keeps in flight, at most (JAXDATA_MMA_STAGES in
#: templates/mma.cuh: fewer where 48 KB of shared memory does not hold them)
MMA_STAGES = 3


def _gemm_tile(n: int) -> int:
  """Output columns per block: the smallest of 16, 32, 64, 128 that covers n (128 beyond)."""
  return 16 if n <= 16 else 32 if n <= 32 else 64 if n <= 64 else 128


def _micro(bn: int) -> int:
  """Output columns per thread (each thread computes 4 rows by this many columns)."""
  return 8 if bn == 128 else 4


def _threads(k, tile: Tile | None = None) -> int:
  """Threads per block of instance `k` (`tile`: its tiling on tensor cores, else None)."""
  if isinstance(k, (Gemm, WeightGrad)) and not thin(k):
    if tile is not None:  # on tensor cores
      return _mma_threads(tile.columns)
    bn = _gemm_tile(k.n)
    return 16 * (bn // _micro(bn))
  return SOFTMAX_THREADS if _softmax_kernel(k) else 256


def _softmax_kernel(k) -> bool:
  return isinstance(k, Traversal) and k.sink == "softmax"


def _cluster(k) -> str:
  """The edge softmax's cluster attribute (templates/traversal.cuh: empty before sm_90)."""
  return " JAXDATA_CLUSTER_DIMS" if _softmax_kernel(k) and SOFTMAX_HUB_CLUSTER > 1 else ""


def _bounds(k, tile: Tile | None) -> str:
  """`__launch_bounds__`'s arguments: the block's threads, and the blocks per SM it must fit
  (which caps its registers), if any: SOFTMAX_MIN_BLOCKS for an edge softmax,
  TRAVERSAL_MIN_BLOCKS for another traversal, the tiling's for a tensor-core instance."""
  threads = _threads(k, tile)
  blocks = (
    SOFTMAX_MIN_BLOCKS
    if _softmax_kernel(k)
    else TRAVERSAL_MIN_BLOCKS
    if isinstance(k, Traversal)
    else tile.min_blocks
    if tile is not None
    else 0
  )
  return f"{threads}, {blocks}" if blocks else str(threads)


#: edges each thread of a CUDA relation sum walks (it adds its partial sums once per relation)
RELATION_RUN = 32


def launch(
  k, num_tiles: int, num_edges: int, num_nodes: int = 0, kind: str = "fma", tile: Tile | None = None
) -> tuple[int, int]:
  """(blocks, threads) for a CUDA kernel instance (`num_tiles`: an upper bound; `num_edges`:
  the rows of the instance's domain; `kind`: its `math`; `tile`: its tiling, as in
  `generate`)."""
  tile = tile or tilings(k, kind)[0]
  threads = _threads(k, tile)
  if thin(k):  # a grouped sum (`_thin_gemm`)
    return _walk_blocks(num_edges, k.n, True, threads), threads
  if isinstance(k, (Gemm, WeightGrad)):  # a block per row tile, head and column block
    blocks = num_tiles * k.heads * -(-k.n // (tile.columns if tile else _gemm_tile(k.n)))
    return blocks * (-(-k.k // 64) if isinstance(k, WeightGrad) else 1), threads
  w = max(k.width, 1)
  if k.sink == "softmax":  # SOFTMAX_GROUP lanes per node, in whole clusters of blocks
    team = max(SOFTMAX_HUB_CLUSTER, 1)
    blocks = min(-(-num_nodes * SOFTMAX_GROUP // threads), 132 * 16)
    return -(-blocks // team) * team, threads
  if k.sink == "relation":  # at least one thread per feature, each walking RELATION_RUN edges
    if num_edges == 0:
      return 0, threads
    chunks, lanes = -(-num_edges // RELATION_RUN), w // relation_features(w)
    return max(-(-lanes // threads), min(-(-chunks * lanes // threads), 132 * 16)), threads
  return _walk_blocks(num_edges, w, _grouped(k), threads), threads


def _walk_blocks(num_edges: int, width: int, grouped: bool, threads: int) -> int:
  """Blocks of `edge_map` (a thread per edge and lane) or `grouped_sum` (per GROUP_RUN
  positions and lane) over rows of `width`, at most 132 * 16."""
  lanes = width // features_per_thread(width)
  work = (-(-num_edges // GROUP_RUN) if grouped else num_edges) * lanes
  return max(0, min(-(-work // threads), 132 * 16))


def _gemm(g: Gemm) -> str:
  """Rows of one relation in tiles of 64 edges x up to 128 output columns; 4 x (4|8) outputs per
  thread; per head (`heads` > 1), one block per tile, head and column block, reading the head's
  k features and writing its n. Scattered outputs are summed per run of equal targets inside the
  tile first (edges are sorted by destination within a relation, so a hub's rows are adjacent)
  and then added with one atomic per run and column: hubs do not serialize on atomics. The body
  is `gemm_simt` (templates/gemm.cuh); only its functors and arguments are generated here."""
  bn = _gemm_tile(g.n)
  rows, ids = _rows(g.rows)
  return (
    _scale(g.scales) + "  auto weight = [&](int64_t r, int h, int k, int n) -> float {\n"
    f"    return {weight(g, 'k', 'n')};\n  }};\n"
    f"  gemm_simt<{GEMM_TILE_ROWS}, 16, {bn}, {_micro(bn)}, {g.k}, {g.n}, {g.heads}, "
    f"{_bool(g.transpose)}, {_bool(g.out != 'edge')}, {rows}, {_bool(g.scales)}>(\n"
    f"      tiles, rel_offsets, R, E, in{g.rows.slot}, {ids}, {_target(g)}, out, ok, "
    "weight, scale);\n}\n"
  )


def _thin_gemm(g: Gemm) -> str:
  """A scatter GEMM of a few input features (RGAT's attention scores times W a, k = heads) as a
  grouped sum, like an aggregation: out[end(e)][n] += sum over k of row[e][k] * W[r][k][n],
  visiting the edges grouped by their target (the CSC or CSR view), one atomic per run of equal
  targets rather than, in a GEMM's tiles of one relation's edges, one per edge. Products and
  sums in float32 on CUDA cores (as the "fma" kind)."""
  terms = " + ".join(
    f"ldf({row_pointer(g.rows, str(i))}) * {weight(g, str(i), 'f')}" for i in range(g.k)
  )
  scaled = f" * ({scale(g.scales)})" if g.scales else ""
  return (
    f"  auto value = [&](int64_t e, int f) -> float {{\n"
    f"    const int64_t r = etype[e];\n    return ({terms}){scaled};\n  }};\n"
    f"  auto target = [&](int64_t e) -> int64_t {{ return {g.out}[e]; }};\n"
    f"  grouped_sum<{g.n}, {features_per_thread(g.n)}, {GROUP_RUN}>(E, {groups(g.out)[1]}, "
    "out, ok, target, value);\n}\n"
  )


def _bool(x) -> str:
  """A C++ bool literal of `x`'s truth."""
  return "true" if x else "false"


def _rows(ld) -> tuple[str, str]:
  """How a GEMM template reads the rows of `ld` (templates/gemm.cuh): its template arguments
  GATHER and W, and its ids argument (`nullptr` for the edge's own row)."""
  ids = row_ids(ld)
  return f"{_bool(ids)}, {max(ld.width, 1)}", ids or "nullptr"


def _target(g: Gemm) -> str:
  """The ids a scattering GEMM adds its rows to (`nullptr` where it stores rows per edge)."""
  return "nullptr" if g.out == "edge" else g.out


def _scale(scales) -> str:
  """`scale(e)`, the product of row e's scales (templates call it only if there are any)."""
  return f"  auto scale = [&](int64_t e) -> float {{ return {scale(scales)}; }};\n"


def _wgrad(w: WeightGrad) -> str:
  """dW per relation (and head): `wgrad_simt` (templates/gemm.cuh) over tiles of 256 edges,
  64 rows x up to 128 columns of dW per block; only its arguments are generated here."""
  bn = _gemm_tile(w.n)
  tile = f"{WGRAD_TILE_ROWS}, 16, 64, {bn}, {_micro(bn)}"
  return _scale(w.scales) + _wgrad_call("wgrad_simt", tile, w)


def _wgrad_call(name: str, tile: str, w: WeightGrad) -> str:
  """The call of weight-gradient template `name` with tile arguments `tile`."""
  (lrows, lids), (rrows, rids) = _rows(w.left), _rows(w.right)
  return (
    f"  {name}<{tile}, {w.k}, {w.n}, {w.heads}, {lrows}, {rrows}, {_bool(w.scales)}>(\n"
    f"      tiles, rel_offsets, R, E, in{w.left.slot}, {lids}, in{w.right.slot}, {rids}, "
    "out, ok, scale);\n}\n"
  )


# ----------------------------------------------------------------------------- tensor cores
#: warps along the rows of a tensor-core tile (each MMA_TILES_M m16 tiles: 64 rows in all)
_MMA_WARPS_M, _MMA_TILES_M = 2, 2
# the templates derive their warps (and so the `_threads` count) from the tile's rows
assert _MMA_WARPS_M * _MMA_TILES_M * 16 == GEMM_TILE_ROWS
#: the tensor-core operand types of templates/mma.cuh, by `math` kind
_MMA = {"tf32": "MmaTF32", "bf16": "MmaBF16"}


def _mma_warps_n(bn: int) -> int:
  """Warps along the columns of a tensor-core tile of `bn` columns (4 for 128, else 2)."""
  return 4 if bn == 128 else 2


def _mma_threads(bn: int) -> int:
  return 32 * _MMA_WARPS_M * _mma_warps_n(bn)


@dataclasses.dataclass(frozen=True)
class Tile:
  """How a tensor-core GEMM or weight-gradient instance is tiled beyond its rows per tile
  (which its row-tile operand depends on, so they are fixed: GEMM_TILE_ROWS,
  MMA_WGRAD_TILE_ROWS): `columns` output columns per block (of dW for a weight gradient) and
  `min_blocks`, the blocks per SM it is compiled to fit (0: no bound; more caps its
  registers). Any of `tilings` computes the same result from the same operands."""

  columns: int
  min_blocks: int = 0

  def __str__(self):
    return f"{self.columns} columns" + (f", {self.min_blocks} blocks/SM" if self.min_blocks else "")


#: threads per SM a tensor-core tiling with a register cap is compiled to keep resident
#: (32 warps: 64 registers each)
MMA_RESIDENT_THREADS = 1024


def tilings(k, kind: str) -> list[Tile | None]:
  """The tilings instance `k` of `math` kind `kind` can take, its default first: for a
  tensor-core GEMM or weight gradient, the widest column tile (`_gemm_tile`) and, from 64
  columns, half of it, each without and with a register cap for MMA_RESIDENT_THREADS
  threads per SM (jaxdata.hector.tuning times them on the first call's operands and keeps the
  fastest). Anything else has one way: [None]."""
  if kind == "fma" or thin(k) or not isinstance(k, (Gemm, WeightGrad)):
    return [None]
  widest = _gemm_tile(k.n)
  columns = [widest, widest // 2] if widest >= 64 else [widest]
  return [Tile(c, b) for c in columns for b in (0, MMA_RESIDENT_THREADS // _mma_threads(c))]


def _gemm_mma(g: Gemm, kind: str, tile: Tile) -> str:
  """`_gemm` on tensor cores: `gemm_mma` (templates/mma.cuh), the same tiles of 64 edges (x
  `tile.columns` columns) and the same outputs; only its functors and arguments are generated
  here (`w_at`: the address of a weight element, loaded as TF32 or raw bfloat16 bits)."""
  bn = tile.columns
  rows, ids = _rows(g.rows)
  return (
    _scale(g.scales) + "  auto w_at = [&](int64_t r, int h, int k, int n) {\n"
    f"    return in{g.weight} + {weight_offset(g, 'k', 'n')};\n  }};\n"
    f"  gemm_mma<{_MMA[kind]}, {GEMM_TILE_ROWS}, {bn}, {_MMA_TILES_M}, {_mma_warps_n(bn)}, "
    f"{g.k}, {g.n}, {g.heads}, {_bool(g.transpose)}, {_bool(g.out != 'edge')}, {rows}, "
    f"{_bool(g.scales)}>(\n"
    f"      tiles, rel_offsets, R, E, in{g.rows.slot}, {ids}, {_target(g)}, out, ok, "
    "w_at, scale);\n}\n"
  )


def _wgrad_mma(w: WeightGrad, kind: str, tile: Tile) -> str:
  """`_wgrad` on tensor cores: `wgrad_mma` (templates/mma.cuh), dW's tile of 64 x
  `tile.columns` as left^T times right, the edge scales on the right rows (so a scaled
  instance is never "bf16"); only its arguments are generated here."""
  assert kind == "tf32" or not w.scales
  bn = tile.columns
  shape = f"{_MMA[kind]}, {MMA_WGRAD_TILE_ROWS}, 64, {bn}, {_MMA_TILES_M}, {_mma_warps_n(bn)}"
  return _scale(w.scales) + _wgrad_call("wgrad_mma", shape, w)


def _traversal(t: Traversal) -> str:
  w = max(t.width, 1)
  value = expr(t.expr, "f")
  if t.sink == "softmax":
    return _softmax(t, w, value)
  if t.sink == "relation":
    return _relation_sum(w, value)
  if _grouped(t):
    order = "pair_edges" if t.sink == "pair" else groups(t.end)[1]
    target = "pair[e]" if t.sink == "pair" else f"{t.end}[e]"
    return (
      f"  auto value = [&](int64_t e, int f) -> float {{ return {value}; }};\n"
      f"  auto target = [&](int64_t e) -> int64_t {{ return {target}; }};\n"
      f"  grouped_sum<{w}, {features_per_thread(w)}, {GROUP_RUN}>(E, {order}, out, ok, "
      "target, value);\n}\n"
    )
  if t.sink == "store":
    write, skip = f"stf(out + e * {w} + f, v);", f"stf(out + e * {w} + f, 0.0f);"
  elif t.sink == "pair":  # on the compact domain (not `_grouped`)
    write = f"atomicAdd(out + (int64_t)pair[e] * {w} + f, v);"
  else:
    write = f"atomicAdd(out + ((int64_t)etype[e] * N + {t.end}[e]) * {w} + f, v);"
  if t.sink != "store":
    skip = ""
  return (
    f"  auto value = [&](int64_t e, int f) -> float {{ return {value}; }};\n"
    f"  auto write = [&](int64_t e, int f, float v) {{ {write} }};\n"
    f"  auto skip = [&](int64_t e, int f) {{ {skip} }};\n"
    f"  edge_map<{w}, {features_per_thread(w)}>(E, ok, value, write, skip);\n}}\n"
  )


#: positions of the grouped view each thread of a CUDA grouped sum walks (one atomic per run of
#: equal targets among them)
GROUP_RUN = 16
#: features of a row each thread of a CUDA per-edge traversal or grouped sum owns, at most (the
#: largest power of two up to this that divides the width), for rows of at least 32 features:
#: an edge's id loads and row_ok checks are shared by a thread's features rather than repeated
#: per feature. Narrower rows keep one feature per thread (two measured slower on the H200).
TRAVERSAL_FEATURES = 4


def features_per_thread(width: int) -> int:
  """Features of a `width`-wide row one thread of `edge_map` / `grouped_sum` takes."""
  return _features(width, TRAVERSAL_FEATURES)


def _features(width: int, most: int) -> int:
  """The largest power of two up to `most` that divides `width`; 1 below 32 features."""
  v = most if width >= 32 else 1
  while width % v:
    v //= 2
  return v


def _grouped(t: Traversal) -> bool:
  """Whether traversal `t` sums over a grouped view (`grouped_sum` in templates/traversal.cuh):
  into nodes, through the CSC or CSR view; into pairs, through pair_edges (edges only: on the
  compact domain the rows are the pairs themselves)."""
  return t.sink == "aggregate" or (t.sink == "pair" and t.domain == "edge")


#: in-degree above which the CUDA edge softmax gives a node a whole block rather than a warp
SOFTMAX_BLOCK_DEGREE = 256
#: lanes per node of the CUDA edge softmax's light tier: nodes of at most this many edges take
#: one edge per lane in a group of this many lanes (most nodes: in-degree median 5 in the
#: benchmark's graph), heavier ones a warp, hubs the block
SOFTMAX_GROUP = 8
#: threads per block of the CUDA edge softmax (the lanes a hub's edges are spread over). 1024
#: measured slower on the H200 (RGAT, 2M edges: 0.75-0.87 ms against 0.63 ms; probe_softmax.py,
#: since probe_constants.py)
SOFTMAX_THREADS = 256
#: blocks of one thread block cluster that walk each hub of the CUDA edge softmax together, on
#: as many SMs (sm_90; 1: a block per hub). RGAT, 2M edges, dim 64: one 25K-edge hub on one SM
#: took 240 of the softmax's 400 us, whatever the block's threads (probe_constants.py)
SOFTMAX_HUB_CLUSTER = 8
#: scores per edge (heads) the CUDA edge softmax keeps in registers (a maximum and a sum each)
SOFTMAX_MAX_WIDTH = 64
#: blocks per SM the CUDA edge softmax is compiled to fit (0: no bound beyond its threads)
#: (4: 64 registers, where the hub teams' code takes 80 and 3 blocks; RGAT bf16 dim 64 2.96 ->
#: 2.91 ms fwd+bwd with SOFTMAX_HUB_CLUSTER = 8, spilling 36 bytes)
SOFTMAX_MIN_BLOCKS = 4
#: the same for every other traversal
TRAVERSAL_MIN_BLOCKS = 8


def _softmax(t: Traversal, w: int, value: str) -> str:
  """Tiers by in-degree: SOFTMAX_GROUP lanes per node of at most that many edges and a warp per
  node of at most 32 (one edge per lane, its scores kept in registers: one pass), a warp per
  node of at most SOFTMAX_BLOCK_DEGREE edges, and the whole block per hub; the last two take an
  online softmax (running maximum and rescaled sum) in two passes over the node's edges (grouped
  at `end` by the CSC or CSR view). Maxima and sums are reduced by shuffles (and, for a block,
  through shared memory); each block takes SOFTMAX_THREADS / SOFTMAX_GROUP consecutive nodes.
  No atomics: `edge_softmax` in templates/traversal.cuh."""
  if w > SOFTMAX_MAX_WIDTH:
    raise NotImplementedError(
      f"hector: a CUDA edge softmax over {w} scores per edge (at most "
      f"{SOFTMAX_MAX_WIDTH}: one maximum and one sum per score are kept "
      "in registers)"
    )
  off, eids = groups(t.end)
  return (
    f"  auto score = [&](int64_t e, int f) {{ return {value}; }};\n"
    f"  float m[{w}], s[{w}], x[{w}];\n"
    f"  edge_softmax<{w}, {_threads(t)}, {SOFTMAX_BLOCK_DEGREE}, {SOFTMAX_GROUP}>(N, E, "
    f"{off}, {eids}, out, ok, score, m, s, x);\n}}\n"
  )


def _relation_sum(w: int, value: str) -> str:
  """Each thread owns `relation_features(w)` features and a run of consecutive edges; edges are
  sorted by relation, so it sums while the relation stays the same and adds one atomic per
  relation it crosses (rather than one per edge into the same R * width outputs):
  `relation_sum` in templates/traversal.cuh."""
  return (
    f"  auto value = [&](int64_t e, int f) -> float {{ return {value}; }};\n"
    f"  relation_sum<{w}, {relation_features(w)}>(E, etype, out, ok, value);\n}}\n"
  )


#: features of a row each thread of a CUDA relation sum owns, at most (as TRAVERSAL_FEATURES)
RELATION_FEATURES = 4


def relation_features(width: int) -> int:
  """Features of a `width`-wide row one thread of `relation_sum` takes."""
  return _features(width, RELATION_FEATURES)
