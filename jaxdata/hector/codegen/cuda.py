"""CUDA: one kernel instance as a ``__global__ jaxdata_hector_kernel(const Params p)``.

The source is templates/cuda.cuh and templates/common.h, then the kernel: the `Params` struct
(every buffer pointer, then the scalars, as `operands` lays them out; the launcher in
xla_ffi/hector/launch_cuda.cc packs them in that order), the signature, the operand pointers
and the instance's body. Kernels are edge-parallel and sum into their outputs with atomics
(once per run of equal targets inside a tile), except the edge softmax, which gives each node a
warp (a node of many edges the whole block) and no atomics.
"""
from __future__ import annotations

import textwrap

from jaxdata.hector import operands
from jaxdata.hector.codegen.common import (LOWEST, expr, groups, guard, head, plus_head, pointers,
                                           row, scale, template, weight)
from jaxdata.hector.lowering import Gemm, Traversal, WeightGrad

#: rows per tile of the CUDA GEMM (edges) and of the weight-gradient GEMM (edges per block)
GEMM_TILE_ROWS = 64
WGRAD_TILE_ROWS = 256


def generate(k, dtypes: tuple[str, ...]) -> str:
  """The CUDA source of instance `k` (`dtypes`: each input slot's dtype), without its label."""
  body = guard(k) + {Gemm: _gemm, WeightGrad: _wgrad, Traversal: _traversal}[
      type(k)](k)
  nbuf, nscal = operands.num_buffers(len(dtypes)), len(operands.SCALARS)
  signature = (f"struct Params {{ const void* buf[{nbuf}]; int64_t scal[{nscal}]; }};\n"
               f'extern "C" __global__ void __launch_bounds__({_threads(k)})\n'
               "jaxdata_hector_kernel(const Params p) {\n")
  return (template("cuda.cuh") + template("common.h") + signature +
          pointers(body, dtypes, lambda i: f"p.buf[{i}]", lambda i: f"p.scal[{i}]") + body)


def _gemm_tile(n: int) -> int:
  """Output columns per block: the smallest of 16, 32, 64, 128 that covers n (128 beyond)."""
  return 16 if n <= 16 else 32 if n <= 32 else 64 if n <= 64 else 128


def _micro(bn: int) -> int:
  """Output columns per thread (each thread computes 4 rows by this many columns)."""
  return 8 if bn == 128 else 4


def _threads(k) -> int:
  if isinstance(k, (Gemm, WeightGrad)):
    bn = _gemm_tile(k.n)
    return 16 * (bn // _micro(bn))
  return 256


#: edges each thread of a CUDA relation sum walks (it adds its partial sums once per relation)
RELATION_RUN = 32


def launch(k, num_tiles: int, num_edges: int, num_nodes: int = 0) -> tuple[int, int]:
  """(blocks, threads) for a CUDA kernel instance (`num_tiles`: an upper bound; `num_edges`:
  the rows of the instance's domain)."""
  threads = _threads(k)
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
  and then added with one atomic per run and column: hubs do not serialize on atomics."""
  bm, bk, bn = GEMM_TILE_ROWS, 16, _gemm_tile(g.n)
  tn = _micro(bn)
  threads = 16 * (bn // tn)
  assert (bm * bk) % threads == 0 and (bk * bn) % threads == 0
  ncb = -(-g.n // bn)
  rows = g.rows
  a_base = row(rows)
  width = g.heads * g.n  # output features per row
  hk, hn = head(g.heads, g.k), head(g.heads, g.n)
  if g.transpose:  # B[k][n] = W[r][n][k]: let consecutive threads walk k
    b_idx = f"const int kk = idx % {bk}, nn = idx / {bk};"
  else:
    b_idx = f"const int kk = idx / {bn}, nn = idx % {bn};"
  ab_floats = bk * (bm + 4) + bk * (bn + 4)
  c_floats = bm * (bn + 1)
  if g.out == "edge":
    epilogue = f"""\
#pragma unroll
  for (int i = 0; i < 4; ++i) {{
    const int64_t e = e0 + ty * 4 + i;
    if (e < 0 || e >= e1) continue;
    const float sc = arow[ty * 4 + i] >= 0 ? {scale(g.scales)} : 0.0f;
#pragma unroll
    for (int j = 0; j < {tn}; ++j) {{
      const int n = cb * {bn} + tx * {tn} + j;
      if (n < {g.n}) out[e * {width} + {hn}n] = acc[i][j] * sc;
    }}
  }}
"""
  else:
    segs = threads // bn
    per = bm // segs
    epilogue = f"""\
  // the tile's scaled rows into shared memory (over the A/B tiles, no longer needed) ...
  float (*Cs)[{bn} + 1] = reinterpret_cast<float (*)[{bn} + 1]>(smem);
#pragma unroll
  for (int i = 0; i < 4; ++i) {{
    const int row = ty * 4 + i;
    const int64_t e = e0 + row;
    const float sc = arow[row] >= 0 ? {scale(g.scales)} : 0.0f;
#pragma unroll
    for (int j = 0; j < {tn}; ++j) Cs[row][tx * {tn} + j] = acc[i][j] * sc;
  }}
  __syncthreads();
  // ... then each thread walks {per} rows of one column, one atomic per run of equal targets
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
        sum += Cs[row][col];
      }}
      if (run >= 0) atomicAdd(out + run * {width} + {hn}n, sum);
    }}
  }}
"""
  pick_head = (f"  const int h = int(blockIdx.x / {ncb}) % {g.heads};\n" if g.heads > 1 else "")
  return f"""\
  const int64_t tile = blockIdx.x / {ncb * g.heads};
{pick_head}\
  const int cb = blockIdx.x % {ncb};
  if (tile >= tiles[R]) return;
  const int64_t r = find_relation(tiles, R, tile);
  const int64_t e0 = rel_offsets[r] + (tile - tiles[r]) * {bm};
  const int64_t e1 = min((int64_t)rel_offsets[r + 1], E);
  __shared__ __align__(16) float smem[{max(ab_floats, c_floats)}];
  float (*As)[{bm} + 4] = reinterpret_cast<float (*)[{bm} + 4]>(smem);
  float (*Bs)[{bn} + 4] = reinterpret_cast<float (*)[{bn} + 4]>(smem + {bk * (bm + 4)});
  __shared__ int64_t arow[{bm}];
  const int tid = threadIdx.x;
  for (int i = tid; i < {bm}; i += {threads}) {{
    const int64_t e = e0 + i;
    arow[i] = e < e1 && ok(e) ? {a_base} : -1;
  }}
  const int ty = tid / {bn // tn}, tx = tid % {bn // tn};
  float acc[4][{tn}] = {{{{0}}}};
  __syncthreads();
  // register-staged pipeline: step k0's tiles go from registers to shared memory, then the
  // next step's global loads are issued before the FMAs, so they are in flight while they run
  float ra[{bm * bk // threads}], rb[{bk * bn // threads}];
  auto fetch = [&](int k0) {{
#pragma unroll
    for (int t = 0; t < {bm * bk // threads}; ++t) {{
      const int idx = tid + t * {threads}, i = idx / {bk}, k = k0 + idx % {bk};
      ra[t] = (arow[i] >= 0 && k < {g.k}) ? ldf(in{rows.slot} + arow[i] + {hk}k) : 0.0f;
    }}
#pragma unroll
    for (int t = 0; t < {bk * bn // threads}; ++t) {{
      const int idx = tid + t * {threads};
      {b_idx}
      const int k = k0 + kk, n = cb * {bn} + nn;
      rb[t] = (k < {g.k} && n < {g.n}) ? {weight(g, 'k', 'n')} : 0.0f;
    }}
  }};
  fetch(0);
  for (int k0 = 0; k0 < {g.k}; k0 += {bk}) {{
#pragma unroll
    for (int t = 0; t < {bm * bk // threads}; ++t) {{
      const int idx = tid + t * {threads};
      As[idx % {bk}][idx / {bk}] = ra[t];
    }}
#pragma unroll
    for (int t = 0; t < {bk * bn // threads}; ++t) {{
      const int idx = tid + t * {threads};
      {b_idx}
      Bs[kk][nn] = rb[t];
    }}
    __syncthreads();
    if (k0 + {bk} < {g.k}) fetch(k0 + {bk});
    micro_fma<{bk}, {tn}>(acc, As, Bs, ty, tx);
    __syncthreads();
  }}
{epilogue}\
}}
"""


def _wgrad(w: WeightGrad) -> str:
  be, bk, bm, bn = WGRAD_TILE_ROWS, 16, 64, _gemm_tile(w.n)  # bk: edges per step; bm: rows of dW
  tn = _micro(bn)
  threads = 16 * (bn // tn)
  assert (bk * bm) % threads == 0 and (bk * bn) % threads == 0
  nkb, nnb = -(-w.k // bm), -(-w.n // bn)
  lrow = row(w.left) + plus_head(w.heads, w.k)
  rrow = row(w.right) + plus_head(w.heads, w.n)
  pick_head = (f"  const int h = int(blockIdx.x / {nkb * nnb}) % {w.heads};\n"
               if w.heads > 1 else "")
  block = f"(r * {w.heads} + h)" if w.heads > 1 else "r"  # dW's block: relation (and head)
  return f"""\
  const int64_t tile = blockIdx.x / {nkb * nnb * w.heads};
{pick_head}\
  const int kb = (blockIdx.x / {nnb}) % {nkb}, nb = blockIdx.x % {nnb};
  if (tile >= tiles[R]) return;
  const int64_t r = find_relation(tiles, R, tile);
  const int64_t e0 = rel_offsets[r] + (tile - tiles[r]) * {be};
  const int64_t e1 = min(min(e0 + {be}, (int64_t)rel_offsets[r + 1]), E);
  __shared__ float Ls[{bk}][{bm} + 4];
  __shared__ float Rs[{bk}][{bn} + 4];
  const int tid = threadIdx.x;
  const int ty = tid / {bn // tn}, tx = tid % {bn // tn};
  float acc[4][{tn}] = {{{{0}}}};
  // register-staged pipeline, as in the GEMM: the next edges' rows load during the FMAs
  float rl[{bk * bm // threads}], rr[{bk * bn // threads}];
  auto fetch = [&](int64_t c) {{
#pragma unroll
    for (int t = 0; t < {bk * bm // threads}; ++t) {{
      const int idx = tid + t * {threads}, k = kb * {bm} + idx % {bm};
      const int64_t e = c + idx / {bm};
      rl[t] = (e < e1 && k < {w.k} && ok(e)) ? ldf(in{w.left.slot} + {lrow} + k) : 0.0f;
    }}
#pragma unroll
    for (int t = 0; t < {bk * bn // threads}; ++t) {{
      const int idx = tid + t * {threads}, n = nb * {bn} + idx % {bn};
      const int64_t e = c + idx / {bn};
      rr[t] = (e < e1 && n < {w.n} && ok(e))
          ? ldf(in{w.right.slot} + {rrow} + n) * ({scale(w.scales)}) : 0.0f;
    }}
  }};
  fetch(e0);
  for (int64_t c = e0; c < e1; c += {bk}) {{
#pragma unroll
    for (int t = 0; t < {bk * bm // threads}; ++t) {{
      const int idx = tid + t * {threads};
      Ls[idx / {bm}][idx % {bm}] = rl[t];
    }}
#pragma unroll
    for (int t = 0; t < {bk * bn // threads}; ++t) {{
      const int idx = tid + t * {threads};
      Rs[idx / {bn}][idx % {bn}] = rr[t];
    }}
    __syncthreads();
    if (c + {bk} < e1) fetch(c + {bk});
    micro_fma<{bk}, {tn}>(acc, Ls, Rs, ty, tx);
    __syncthreads();
  }}
  float* o = out + {block} * {w.k * w.n};
#pragma unroll
  for (int i = 0; i < 4; ++i) {{
    const int k = kb * {bm} + ty * 4 + i;
    if (k >= {w.k}) continue;
#pragma unroll
    for (int j = 0; j < {tn}; ++j) {{
      const int n = nb * {bn} + tx * {tn} + j;
      if (n < {w.n}) atomicAdd(o + k * {w.n} + n, acc[i][j]);
    }}
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
