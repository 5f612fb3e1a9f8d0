"""CUDA: one kernel instance as a ``__global__ jaxdata_hector_kernel(const Params p)``.

The source is templates/cuda.cuh (and templates/mma.cuh for a tensor-core GEMM) and
templates/common.h, then the kernel: the `Params` struct (every buffer pointer, then the
scalars, as `operands` lays them out; the launcher in xla_ffi/hector/launch_cuda.cc packs them
in that order), the signature, the operand pointers and the instance's body. Kernels are
edge-parallel and sum into their outputs with atomics (once per run of equal targets inside a
tile), except the edge softmax, which gives each node a warp (a node of many edges the whole
block) and no atomics.

GEMM and weight-gradient instances come in three kinds (`math`): "fma" (float32 FMAs on CUDA
cores: float32-exact products), "tf32" (tensor cores, operands rounded to TF32, float32 sums)
and "bf16" (tensor cores on bfloat16 operands, exact products, float32 sums). The kind follows
the operands' dtypes and the matmul precision (`jaxdata.hector.precision`), as `jnp.dot` on an
NVIDIA GPU: bfloat16 operands always take the tensor cores; float32 operands take TF32 unless
the precision is "highest".
"""
from __future__ import annotations

import os
import textwrap

from jaxdata.hector import operands
from jaxdata.hector.codegen.common import (LOWEST, expr, groups, guard, head, plus_head, pointers,
                                           row, scale, template, weight, weight_offset)
from jaxdata.hector.lowering import Gemm, Traversal, WeightGrad

#: the kinds of GEMM a CUDA GEMM or weight-gradient instance can be generated as
MATHS = ("fma", "tf32", "bf16")

#: Tensor-core kernels ("tf32", "bf16") are generated only where this environment variable is
#: "1". On the H200 (session 12, docs/benchmarks/tensor_cores.md) they are correct (TF32 and
#: bf16 errors) but 0.80-1.09x the CUDA-core kernels' speed on the 2M-edge graph, so by default
#: every precision runs the float32 CUDA-core ("fma") kernels, float32-exact, as before issue 19.
TENSOR_CORES_ENV = "JAXDATA_HECTOR_TENSOR_CORES"


def tensor_cores_enabled() -> bool:
  """Whether GEMM instances may run on tensor cores (`TENSOR_CORES_ENV` is "1")."""
  return os.environ.get(TENSOR_CORES_ENV) == "1"


def math(k, dtypes: tuple[str, ...], precision: str = "default") -> str:
  """The kind of GEMM (one of `MATHS`) instance `k` runs as: "bf16" when both operands are
  bfloat16 (and, for a weight gradient, no edge scale multiplies them: a scaled bfloat16 row is
  no longer a bfloat16 value), else "fma" at precision "highest" and "tf32" otherwise.
  Traversals are always "fma", and so is everything unless `tensor_cores_enabled()`."""
  if not tensor_cores_enabled():
    return "fma"
  if isinstance(k, Gemm):
    slots, scaled = (k.rows.slot, k.weight), False
  elif isinstance(k, WeightGrad):
    slots, scaled = (k.left.slot, k.right.slot), bool(k.scales)
  else:
    return "fma"
  if not scaled and all(dtypes[s] == "bfloat16" for s in slots):
    return "bf16"
  return "fma" if precision == "highest" else "tf32"


def generate(k, dtypes: tuple[str, ...], precision: str = "default") -> str:
  """The CUDA source of instance `k` (`dtypes`: each input slot's dtype; `precision`: the
  matmul level of a GEMM), without its label."""
  kind = math(k, dtypes, precision)
  if kind == "fma":
    body = guard(k) + {Gemm: _gemm, WeightGrad: _wgrad, Traversal: _traversal}[type(k)](k)
  else:
    body = guard(k) + {Gemm: _gemm_mma, WeightGrad: _wgrad_mma}[type(k)](k, kind)
  nbuf, nscal = operands.num_buffers(len(dtypes)), len(operands.SCALARS)
  signature = (f"struct Params {{ const void* buf[{nbuf}]; int64_t scal[{nscal}]; }};\n"
               f'extern "C" __global__ void __launch_bounds__({_threads(k, kind)})\n'
               "jaxdata_hector_kernel(const Params p) {\n")
  prelude = template("cuda.cuh")
  if isinstance(k, (Gemm, WeightGrad)):
    prelude += template("gemm.cuh") + (template("mma.cuh") if kind != "fma" else "")
  return (prelude + template("common.h") + signature +
          pointers(body, dtypes, lambda i: f"p.buf[{i}]", lambda i: f"p.scal[{i}]") + body)


#: rows per tile of the CUDA GEMM (edges) and of the weight-gradient GEMM (edges per block)
GEMM_TILE_ROWS = 64
WGRAD_TILE_ROWS = 256


def _gemm_tile(n: int) -> int:
  """Output columns per block: the smallest of 16, 32, 64, 128 that covers n (128 beyond)."""
  return 16 if n <= 16 else 32 if n <= 32 else 64 if n <= 64 else 128


def _micro(bn: int) -> int:
  """Output columns per thread (each thread computes 4 rows by this many columns)."""
  return 8 if bn == 128 else 4


def _threads(k, kind: str = "fma") -> int:
  if isinstance(k, (Gemm, WeightGrad)):
    bn = _gemm_tile(k.n)
    if kind != "fma":
      return 32 * _MMA_WARPS_M * _mma_warps_n(bn)
    return 16 * (bn // _micro(bn))
  return 256


#: edges each thread of a CUDA relation sum walks (it adds its partial sums once per relation)
RELATION_RUN = 32


def launch(k, num_tiles: int, num_edges: int, num_nodes: int = 0,
           kind: str = "fma") -> tuple[int, int]:
  """(blocks, threads) for a CUDA kernel instance (`num_tiles`: an upper bound; `num_edges`:
  the rows of the instance's domain; `kind`: its `math`)."""
  threads = _threads(k, kind)
  if isinstance(k, Gemm):
    return num_tiles * k.heads * -(-k.n // _gemm_tile(k.n)), threads
  if isinstance(k, WeightGrad):
    return num_tiles * k.heads * -(-k.k // 64) * -(-k.n // _gemm_tile(k.n)), threads
  w = max(k.width, 1)
  if k.sink == "softmax":  # a warp per node
    work = num_nodes * 32
  elif k.sink == "relation":  # at least one thread per feature, each walking RELATION_RUN edges
    if num_edges == 0:
      return 0, threads
    chunks = -(-num_edges // RELATION_RUN)
    return max(-(-w // threads), min(-(-chunks * w // threads), 132 * 16)), threads
  else:
    work = num_edges * w
  return max(0, min(-(-work // threads), 132 * 16)), threads


def _gemm(g: Gemm) -> str:
  """Rows of one relation in tiles of 64 edges x up to 128 output columns; 4 x (4|8) outputs per
  thread; per head (`heads` > 1), one block per tile, head and column block, reading the head's
  k features and writing its n. Scattered outputs are summed per run of equal targets inside the
  tile first (edges are sorted by destination within a relation, so a hub's rows are adjacent)
  and then added with one atomic per run and column: hubs do not serialize on atomics. The body
  is `gemm_simt` (templates/gemm.cuh); only its functors are generated here."""
  bn = _gemm_tile(g.n)
  scatter = g.out != "edge"
  return (_functors(g) +
          f"  gemm_simt<{GEMM_TILE_ROWS}, 16, {bn}, {_micro(bn)}, {g.k}, {g.n}, {g.heads}, "
          f"{_bool(g.transpose)}, {_bool(scatter)}>(\n"
          f"      tiles, rel_offsets, R, E, in{g.rows.slot}, {g.out if scatter else 'nullptr'}, "
          "out, ok, a_row, weight, scale);\n}\n")


def _bool(x: bool) -> str:
  return "true" if x else "false"


def _functors(g: Gemm) -> str:
  """The functors a GEMM body (templates/gemm.cuh) takes besides `ok`: `a_row(e)`, the element
  offset of row e; `weight(r, h, k, n)`, an element of the relation's weight; `scale(e)`."""
  return (f"  auto a_row = [&](int64_t e) -> int64_t {{ return {row(g.rows)}; }};\n"
          f"  auto weight = [&](int64_t r, int h, int k, int n) -> float {{\n"
          f"    return {weight(g, 'k', 'n')};\n  }};\n"
          f"  auto scale = [&](int64_t e) -> float {{ return {scale(g.scales)}; }};\n")


def _wgrad(w: WeightGrad) -> str:
  """dW per relation (and head): `wgrad_simt` (templates/gemm.cuh) over tiles of 256 edges,
  64 rows x up to 128 columns of dW per block; only its functors are generated here."""
  bn = _gemm_tile(w.n)
  return (_wgrad_functors(w) +
          f"  wgrad_simt<{WGRAD_TILE_ROWS}, 16, 64, {bn}, {_micro(bn)}, {w.k}, {w.n}, {w.heads}>(\n"
          f"      tiles, rel_offsets, R, E, in{w.left.slot}, in{w.right.slot}, out, ok, l_row, "
          "r_row, scale);\n}\n")


def _wgrad_functors(w: WeightGrad) -> str:
  """The functors a weight-gradient body takes besides `ok`: `l_row(e)` and `r_row(e)`, the
  element offsets of edge e's left and right rows, and `scale(e)`, its scale."""
  return (f"  auto l_row = [&](int64_t e) -> int64_t {{ return {row(w.left)}; }};\n"
          f"  auto r_row = [&](int64_t e) -> int64_t {{ return {row(w.right)}; }};\n"
          f"  auto scale = [&](int64_t e) -> float {{ return {scale(w.scales)}; }};\n")


# ----------------------------------------------------------------------------- tensor cores
#: warps along the rows of a tensor-core tile (each MMA_TILES_M m16 tiles: 64 rows in all)
_MMA_WARPS_M, _MMA_TILES_M = 2, 2


def _mma_warps_n(bn: int) -> int:
  """Warps along the columns of a tensor-core tile of `bn` columns (4 for 128, else 2)."""
  return 4 if bn == 128 else 2


def _mma_setup(kind: str, bn: int) -> dict:
  """The fixed numbers of a tensor-core tile of 64 x `bn` (`kind` "tf32" or "bf16")."""
  wn = _mma_warps_n(bn)
  nt = bn // (8 * wn)
  assert _MMA_WARPS_M * _MMA_TILES_M * 16 == GEMM_TILE_ROWS and wn * nt * 8 == bn
  return dict(M="MmaTF32" if kind == "tf32" else "MmaBF16", bk=16 if kind == "tf32" else 32,
              wn=wn, nt=nt, threads=32 * _MMA_WARPS_M * wn,
              # padding in elements: k-major rows of BK + 4 words, other rows of x + 8 words
              kpad=4 if kind == "tf32" else 8, xpad=8 if kind == "tf32" else 16,
              elem=4 if kind == "tf32" else 2)


def _operand(kind: str, ptr: str) -> str:
  """A shared-memory element from a global one: TF32 bits of a float (or bfloat16) value, or the
  raw bits of a bfloat16 value."""
  return f"to_tf32(ldf({ptr}))" if kind == "tf32" else f"__ldg({ptr})"


def _warp_prologue(bn: int, m: dict) -> str:
  return f"""\
  const int warp = tid >> 5, lane = tid & 31;
  const int m0 = (warp / {m['wn']}) * {_MMA_TILES_M * 16}, n0 = (warp % {m['wn']}) * {m['nt'] * 8};
  float acc[{_MMA_TILES_M}][{m['nt']}][4];
#pragma unroll
  for (int i = 0; i < {_MMA_TILES_M}; ++i)
#pragma unroll
    for (int j = 0; j < {m['nt']}; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.0f;
"""


def _gemm_mma(g: Gemm, kind: str) -> str:
  """`_gemm` on tensor cores (templates/mma.cuh): the same tiles of 64 edges x up to 128
  columns and the same epilogues. A (the gathered rows) is staged k-major, B (the weight)
  k-major when transposed (its rows are the weight's contiguous rows) and n-major otherwise;
  global loads for the next k-step are in flight (in registers) while the warps run the
  current one. The scaled tile goes through shared memory to the epilogue."""
  m = _mma_setup(kind, _gemm_tile(g.n))
  bm, bk, bn, threads = GEMM_TILE_ROWS, m["bk"], _gemm_tile(g.n), m["threads"]
  assert (bm * bk) % threads == 0 and (bk * bn) % threads == 0 and threads % bn == 0
  ncb = -(-g.n // bn)
  rows = g.rows
  width = g.heads * g.n
  hk, hn = head(g.heads, g.k), head(g.heads, g.n)
  lda = bk + m["kpad"]
  if g.transpose:  # Bs[n][k]: consecutive threads walk k along a row of W[r] (n x k)
    ldb, bkm = bk + m["kpad"], "true"
    b_idx = f"const int kk = idx % {bk}, nn = idx / {bk};"
    b_at = f"nn * {ldb} + kk"
    b_elems = bn * ldb
  else:  # Bs[k][n]: consecutive threads walk n along a row of W[r] (k x n)
    ldb, bkm = bn + m["xpad"], "false"
    b_idx = f"const int kk = idx / {bn}, nn = idx % {bn};"
    b_at = f"kk * {ldb} + nn"
    b_elems = bk * ldb
  ab_bytes = (bm * lda + b_elems) * m["elem"]
  ldc = bn + 4
  c_bytes = bm * ldc * 4
  na, nb = bm * bk // threads, bk * bn // threads
  if g.out == "edge":
    epilogue = f"""\
  for (int idx = tid; idx < {bm * bn}; idx += {threads}) {{
    const int row = idx / {bn}, col = idx % {bn};
    const int64_t e = e0 + row;
    const int n = cb * {bn} + col;
    if (e < e1 && n < {g.n}) out[e * {width} + {hn}n] = Cs[row * {ldc} + col] * rscale[row];
  }}
"""
  else:
    per = bm // (threads // bn)
    epilogue = f"""\
  // each thread walks {per} rows of one column, one atomic per run of equal targets
  {{
    const int col = tid % {bn}, seg = tid / {bn};
    const int n = cb * {bn} + col;
    if (n < {g.n}) {{
      int64_t run = -1;
      float sum = 0.0f;
      for (int row = seg * {per}; row < (seg + 1) * {per}; ++row) {{
        const int64_t t = arow[row] >= 0 ? (int64_t){g.out}[e0 + row] : -1;
        if (t != run) {{
          if (run >= 0) atomicAdd(out + run * {width} + {hn}n, sum);
          run = t;
          sum = 0.0f;
        }}
        sum += Cs[row * {ldc} + col] * rscale[row];
      }}
      if (run >= 0) atomicAdd(out + run * {width} + {hn}n, sum);
    }}
  }}
"""
  pick_head = (f"  const int h = int(blockIdx.x / {ncb}) % {g.heads};\n" if g.heads > 1 else "")
  return f"""\
  typedef {m['M']} Mma;
  typedef Mma::Elem Elem;
  const int64_t tile = blockIdx.x / {ncb * g.heads};
{pick_head}\
  const int cb = blockIdx.x % {ncb};
  if (tile >= tiles[R]) return;
  const int64_t r = find_relation(tiles, R, tile);
  const int64_t e0 = rel_offsets[r] + (tile - tiles[r]) * {bm};
  const int64_t e1 = min((int64_t)rel_offsets[r + 1], E);
  __shared__ __align__(16) unsigned char smem[{max(ab_bytes, c_bytes)}];
  Elem* As = reinterpret_cast<Elem*>(smem);               // [{bm}][{lda}]: (m, k) k-major
  Elem* Bs = As + {bm * lda};                            // (n, k) {'k-major' if g.transpose else 'n-major'}
  __shared__ int64_t arow[{bm}];
  __shared__ float rscale[{bm}];
  const int tid = threadIdx.x;
  for (int i = tid; i < {bm}; i += {threads}) {{
    const int64_t e = e0 + i;
    const bool use = e < e1 && ok(e);
    arow[i] = use ? {row(rows)} : -1;
    rscale[i] = use ? {scale(g.scales)} : 0.0f;
  }}
{_warp_prologue(bn, m)}\
  __syncthreads();
  Elem ra[{na}], rb[{nb}];
  auto fetch = [&](int k0) {{
#pragma unroll
    for (int t = 0; t < {na}; ++t) {{
      const int idx = tid + t * {threads}, i = idx / {bk}, k = k0 + idx % {bk};
      ra[t] = (arow[i] >= 0 && k < {g.k}) ? {_operand(kind, f"in{rows.slot} + arow[i] + {hk}k")}
                                       : Elem(0);
    }}
#pragma unroll
    for (int t = 0; t < {nb}; ++t) {{
      const int idx = tid + t * {threads};
      {b_idx}
      const int k = k0 + kk, n = cb * {bn} + nn;
      rb[t] = (k < {g.k} && n < {g.n}) ? {_operand(kind, f"in{g.weight} + " + weight_offset(g, "k", "n"))}
                                  : Elem(0);
    }}
  }};
  fetch(0);
  for (int k0 = 0; k0 < {g.k}; k0 += {bk}) {{
#pragma unroll
    for (int t = 0; t < {na}; ++t) {{
      const int idx = tid + t * {threads};
      As[(idx / {bk}) * {lda} + idx % {bk}] = ra[t];
    }}
#pragma unroll
    for (int t = 0; t < {nb}; ++t) {{
      const int idx = tid + t * {threads};
      {b_idx}
      Bs[{b_at}] = rb[t];
    }}
    __syncthreads();
    if (k0 + {bk} < {g.k}) fetch(k0 + {bk});
    warp_mma<Mma, {_MMA_TILES_M}, {m['nt']}, {bk}, true, {lda}, {bkm}, {ldb}>(acc, As, Bs, m0, n0, lane);
    __syncthreads();
  }}
  // the tile into shared memory (over the A/B tiles, no longer needed), then out
  float* Cs = reinterpret_cast<float*>(smem);         // [{bm}][{ldc}]
  store_acc<{_MMA_TILES_M}, {m['nt']}, {ldc}>(Cs, acc, m0, n0, lane);
  __syncthreads();
{epilogue}\
}}
"""


def _wgrad_mma(w: WeightGrad, kind: str) -> str:
  """`_wgrad` on tensor cores: dW's tile of 64 x up to 128 is A = left^T (64 features by the
  edges) times B = right (edges by the columns), each staged edge-major as the rows arrive
  (consecutive threads read consecutive features); the edge scales multiply the right rows
  (so a scaled instance is never "bf16"). Accumulators go to dW with one atomic each."""
  bn = _gemm_tile(w.n)
  m = _mma_setup(kind, bn)
  be, bk, bm, threads = WGRAD_TILE_ROWS, m["bk"], 64, m["threads"]
  assert (bk * bm) % threads == 0 and (bk * bn) % threads == 0 and be % bk == 0
  nkb, nnb = -(-w.k // bm), -(-w.n // bn)
  lrow = row(w.left) + plus_head(w.heads, w.k)
  rrow = row(w.right) + plus_head(w.heads, w.n)
  lda, ldb = bm + m["xpad"], bn + m["xpad"]
  nl, nr = bk * bm // threads, bk * bn // threads
  pick_head = (f"  const int h = int(blockIdx.x / {nkb * nnb}) % {w.heads};\n"
               if w.heads > 1 else "")
  block = f"(r * {w.heads} + h)" if w.heads > 1 else "r"
  if kind == "tf32":
    right = f"to_tf32(ldf(in{w.right.slot} + {rrow} + n) * ({scale(w.scales)}))"
  else:
    assert not w.scales
    right = _operand(kind, f"in{w.right.slot} + {rrow} + n")
  return f"""\
  typedef {m['M']} Mma;
  typedef Mma::Elem Elem;
  const int64_t tile = blockIdx.x / {nkb * nnb * w.heads};
{pick_head}\
  const int kb = (blockIdx.x / {nnb}) % {nkb}, nb = blockIdx.x % {nnb};
  if (tile >= tiles[R]) return;
  const int64_t r = find_relation(tiles, R, tile);
  const int64_t e0 = rel_offsets[r] + (tile - tiles[r]) * {be};
  const int64_t e1 = min(min(e0 + {be}, (int64_t)rel_offsets[r + 1]), E);
  __shared__ __align__(16) Elem Ls[{bk * lda}];  // (m, edge) edge-major: [{bk}][{lda}]
  __shared__ __align__(16) Elem Rs[{bk * ldb}];  // (n, edge) edge-major: [{bk}][{ldb}]
  const int tid = threadIdx.x;
{_warp_prologue(bn, m)}\
  Elem rl[{nl}], rr[{nr}];
  auto fetch = [&](int64_t c) {{
#pragma unroll
    for (int t = 0; t < {nl}; ++t) {{
      const int idx = tid + t * {threads}, k = kb * {bm} + idx % {bm};
      const int64_t e = c + idx / {bm};
      rl[t] = (e < e1 && k < {w.k} && ok(e)) ? {_operand(kind, f"in{w.left.slot} + {lrow} + k")}
                                        : Elem(0);
    }}
#pragma unroll
    for (int t = 0; t < {nr}; ++t) {{
      const int idx = tid + t * {threads}, n = nb * {bn} + idx % {bn};
      const int64_t e = c + idx / {bn};
      rr[t] = (e < e1 && n < {w.n} && ok(e)) ? {right} : Elem(0);
    }}
  }};
  fetch(e0);
  for (int64_t c = e0; c < e1; c += {bk}) {{
#pragma unroll
    for (int t = 0; t < {nl}; ++t) {{
      const int idx = tid + t * {threads};
      Ls[(idx / {bm}) * {lda} + idx % {bm}] = rl[t];
    }}
#pragma unroll
    for (int t = 0; t < {nr}; ++t) {{
      const int idx = tid + t * {threads};
      Rs[(idx / {bn}) * {ldb} + idx % {bn}] = rr[t];
    }}
    __syncthreads();
    if (c + {bk} < e1) fetch(c + {bk});
    warp_mma<Mma, {_MMA_TILES_M}, {m['nt']}, {bk}, false, {lda}, false, {ldb}>(acc, Ls, Rs, m0, n0, lane);
    __syncthreads();
  }}
  float* o = out + {block} * {w.k * w.n};
#pragma unroll
  for (int mt = 0; mt < {_MMA_TILES_M}; ++mt)
#pragma unroll
    for (int nt = 0; nt < {m['nt']}; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {{
        const int k = kb * {bm} + acc_row(m0, mt, i, lane);
        const int n = nb * {bn} + acc_col(n0, nt, i, lane);
        if (k < {w.k} && n < {w.n}) atomicAdd(o + k * {w.n} + n, acc[mt][nt][i]);
      }}
}}
"""


def _traversal(t: Traversal) -> str:
  w = max(t.width, 1)
  value = expr(t.expr, "f")
  if t.sink == "softmax":
    return _softmax(t, w, value)
  if t.sink == "relation":
    return _relation_sum(w, value)
  if t.sink == "store":
    write = f"out[e * {w} + f] = v;"
    skip = f"{{ out[e * {w} + f] = 0.0f; continue; }}"
  elif t.sink == "aggregate":
    write = f"atomicAdd(out + (int64_t){t.end}[e] * {w} + f, v);"
  elif t.sink == "pair":
    write = f"atomicAdd(out + (int64_t)pair[e] * {w} + f, v);"
  else:
    write = f"atomicAdd(out + ((int64_t)etype[e] * N + {t.end}[e]) * {w} + f, v);"
  if t.sink != "store":
    skip = "continue;"
  return f"""\
  const int64_t total = E * {w};
  for (int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; t < total;
       t += (int64_t)gridDim.x * blockDim.x) {{
    const int64_t e = t / {w};
    const int f = int(t % {w});
    (void)f;
    if (!ok(e)) {skip}
    const float v = {value};
    {write}
  }}
}}
"""


#: in-degree above which the CUDA edge softmax gives a node a whole block rather than a warp
SOFTMAX_BLOCK_DEGREE = 256
#: scores per edge (heads) the CUDA edge softmax keeps in registers (a maximum and a sum each)
SOFTMAX_MAX_WIDTH = 64


def _softmax(t: Traversal, w: int, value: str) -> str:
  """A warp per node, or the whole block for a node of more than SOFTMAX_BLOCK_DEGREE edges
  (hubs): the lanes stride over the node's edges (grouped at `end` by the CSC or CSR view)
  three times, every head at once: the maximum, exp(score - max) stored and summed, the
  division; maxima and sums are reduced by warp shuffles (and, for a block, through shared
  memory). Each block takes as many consecutive nodes as it has warps: its warps take the light
  ones, then the block takes each heavy one in turn. No atomics."""
  if w > SOFTMAX_MAX_WIDTH:
    raise NotImplementedError(f"hector: a CUDA edge softmax over {w} scores per edge (at most "
                              f"{SOFTMAX_MAX_WIDTH}: one maximum and one sum per score are kept "
                              "in registers)")
  off, eids = groups(t.end)
  threads = _threads(t)
  warps = threads // 32
  each = lambda body: f"for (int f = 0; f < {w}; ++f) {body}"  # noqa: E731

  def walk(first: str, step: str, reduce: str) -> str:
    """The three passes over a node's edges q0 <= q < q1, lanes from `first` by `step`."""
    loop = (f"for (int64_t q = q0 + {first}; q < q1; q += {step}) {{\n"
            f"  const int64_t e = {eids}[q];\n  if (!ok(e)) continue;")
    return f"""\
{each(f"{{ m[f] = {LOWEST}; s[f] = 0.0f; }}")}
{loop}
  {each("m[f] = fmaxf(m[f], score(e, f));")}
}}
{reduce.format(v="m", op="fmaxf(a, b)")}
{loop}
  {each(f"{{ const float x = expf(score(e, f) - m[f]); out[e * {w} + f] = x; s[f] += x; }}")}
}}
{reduce.format(v="s", op="a + b")}
{loop}
  {each(f"out[e * {w} + f] /= s[f];")}
}}
"""

  # reductions (templates over {v}: m or s, {op}: of a and b) across a warp's lanes by shuffles,
  # and across the block's warps through shared memory
  combine = "{{ const float a = {v}[f], b = %s; {v}[f] = {op}; }}"
  warp_reduce = "for (int o = 16; o > 0; o >>= 1) " + each(
      combine % "__shfl_xor_sync(0xffffffffu, a, o)")
  block_reduce = f"""{warp_reduce}
if (lane == 0) {each("red[warp][f] = {v}[f];")}
__syncthreads();
{each("{v}[f] = red[0][f];")}
for (int j = 1; j < {warps}; ++j) {each(combine % "red[j][f]")}
__syncthreads();  // every warp has read red before the next node writes it"""
  return f"""\
  // the score of edge e for head f
  auto score = [&](int64_t e, int f) {{ return {value}; }};
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __shared__ float red[{warps}][{w}];
  float m[{w}], s[{w}];
  for (int64_t base = blockIdx.x * {warps}ll; base < N; base += gridDim.x * {warps}ll) {{
    if (base + warp < N) {{  // a warp per light node
      const int64_t i = base + warp;
      const int64_t q0 = span({off}[i], 0, E), q1 = span({off}[i + 1], q0, E);
      if (q1 - q0 <= {SOFTMAX_BLOCK_DEGREE}) {{
{textwrap.indent(walk("lane", "32", warp_reduce), " " * 8)}\
      }}
    }}
    for (int64_t i = base; i < base + {warps} && i < N; ++i) {{  // the block per heavy node
      const int64_t q0 = span({off}[i], 0, E), q1 = span({off}[i + 1], q0, E);
      if (q1 - q0 <= {SOFTMAX_BLOCK_DEGREE}) continue;
{textwrap.indent(walk("threadIdx.x", str(threads), block_reduce), " " * 6)}\
    }}
  }}
}}
"""


def _relation_sum(w: int, value: str) -> str:
  """Each thread owns one feature and a run of consecutive edges; edges are sorted by relation,
  so it sums while the relation stays the same and adds one atomic per relation it crosses
  (rather than one per edge into the same R * width outputs)."""
  return f"""\
  const int64_t threads = (int64_t)gridDim.x * blockDim.x;
  const int64_t tid = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  const int64_t chunks = threads / {w};
  if (tid >= chunks * {w}) return;
  const int f = int(tid % {w});
  const int64_t per = (E + chunks - 1) / chunks;
  const int64_t lo = (tid / {w}) * per, hi = min(E, lo + per);
  int64_t run = -1;
  float sum = 0.0f;
  for (int64_t e = lo; e < hi; ++e) {{
    if (!ok(e)) continue;
    const int64_t r = etype[e];
    if (r != run) {{
      if (run >= 0) atomicAdd(out + run * {w} + f, sum);
      run = r;
      sum = 0.0f;
    }}
    sum += {value};
  }}
  if (run >= 0) atomicAdd(out + run * {w} + f, sum);
}}
"""
