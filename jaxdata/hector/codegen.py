"""Code generation: C++ (CPU) and CUDA source for one kernel instance.

Every generated kernel has the same interface, which `xla_ffi/hector/` launches:

* buffers: the graph's arrays (`GRAPH_FIELDS`, in that order), then the instance's inputs
  (``in0``, ``in1``, ...), then its one output (float32);
* scalars: ``E`` (edges), ``N`` (nodes), ``R`` (relations), ``T`` (row tiles, GPU GEMMs),
  ``P`` (unique (src, relation) pairs).

An instance over the compact domain gets the pairs in place of the edges (``src``, ``etype``,
``rel_offsets``, the CSR view and ``E`` describe pairs; ``dst`` and the CSC view are not
meaningful there); ``pair``, ``pair_offsets`` and ``pair_edges`` link edges to pairs.

Feature widths are compile-time constants, so every loop over features has a known trip count.
CPU kernels are node-parallel over the rows they write (each thread owns its output rows through
the graph's CSR/CSC views, the pairs' edge lists or relation ranges: no atomics, deterministic
sums); CUDA kernels are edge-parallel and sum into their outputs with atomics, except the edge
softmax, which gives each node a warp (a node of many edges the whole block) and no atomics.
"""
from __future__ import annotations

import re
import textwrap

from jaxdata.hector.lowering import Expr, Gemm, Load, Traversal, WeightGrad

GRAPH_FIELDS = ("src", "dst", "etype", "norm", "rel_offsets", "csr_offsets", "csr_edges",
                "csc_offsets", "csc_edges", "tiles", "pair", "pair_offsets", "pair_edges")
SCALARS = ("E", "N", "R", "T", "P")

#: rows per tile of the CUDA GEMM (edges) and of the weight-gradient GEMM (edges per block)
GEMM_TILE_ROWS = 64
WGRAD_TILE_ROWS = 256

_UNARY = {
    "relu": "fmaxf({x}, 0.0f)",
    "exp": "expf({x})",
    "tanh": "tanhf({x})",
    "sigmoid": "(1.0f / (1.0f + expf(-({x}))))",
    "neg": "(-({x}))",
    "leaky_relu": "leaky_relu({x}, {p})",
}
_UNARY_GRAD = {
    "relu": "(({x}) > 0.0f ? ({g}) : 0.0f)",
    "exp": "(({g}) * expf({x}))",
    "tanh": "(({g}) * (1.0f - tanhf({x}) * tanhf({x})))",
    "sigmoid": "(({g}) * (1.0f / (1.0f + expf(-({x})))) * (1.0f - 1.0f / (1.0f + expf(-({x})))))",
    "neg": "(-({g}))",
    "leaky_relu": "leaky_relu_grad({x}, {g}, {p})",
}
#: below every score (the softmax's running maximum starts here; scores are finite)
_LOWEST = "-3.402823466e+38f"


def tile_rows(k) -> int:
  """Edges per row tile of a CUDA GEMM or weight-gradient kernel (0: the kernel has no tiles)."""
  return GEMM_TILE_ROWS if isinstance(k, Gemm) else WGRAD_TILE_ROWS if isinstance(
      k, WeightGrad) else 0


def zero_output(k) -> bool:
  """Whether the launcher zeroes the output first (the kernel sums into it)."""
  if isinstance(k, Gemm):
    return k.out != "edge"
  if isinstance(k, Traversal):
    return k.sink != "store"  # the softmax leaves the edges it skips at 0
  return True


def generate(k, dtypes: tuple[str, ...], target: str, label: str = "") -> str:
  """The source of one kernel instance for "cpu" or "cuda"; `dtypes` gives each input slot's
  dtype ("float32" or "bfloat16"); `label` goes into the first comment line."""
  gen = {("cpu", Gemm): _cpu_gemm, ("cpu", WeightGrad): _cpu_wgrad,
         ("cpu", Traversal): _cpu_traversal, ("cuda", Gemm): _cuda_gemm,
         ("cuda", WeightGrad): _cuda_wgrad, ("cuda", Traversal): _cuda_traversal}
  body = _guard(k) + gen[(target, type(k))](k)
  head = _prologue(k, dtypes, target, body)
  return f"// jaxdata.hector {k.template}: {label or k}\n" + head + body


# ----------------------------------------------------------------------------- shared pieces
def _prologue(k, dtypes: tuple[str, ...], target: str, body: str) -> str:
  ctype = {"float32": "float", "bfloat16": "unsigned short"}
  nslot = len(dtypes)
  lines = []
  if target == "cpu":
    lines += [
        "#include <math.h>", "#include <cstdint>", "#include <cstring>", "#include <algorithm>",
        'extern "C" {',
        "struct jaxdata_cpu_runtime { int64_t abi_version; void* pool;",
        "  void (*parallel_for)(void*, int64_t, int64_t, void (*)(void*, int64_t, int64_t), void*); };",
        "}",
        "static inline float ldf(const float* p) { return *p; }",
        "static inline float ldf(const unsigned short* p) {",
        "  uint32_t bits = uint32_t(*p) << 16; float f; std::memcpy(&f, &bits, 4); return f; }",
        "static inline float leaky_relu(float x, float s) { return x > 0.0f ? x : s * x; }",
        "static inline int64_t span(int64_t x, int64_t lo, int64_t hi) {",
        "  return x < lo ? lo : x > hi ? hi : x; }",
        "static inline float leaky_relu_grad(float x, float g, float s) {",
        "  return x > 0.0f ? g : s * g; }",
        "template <class F> static void parallel_for(const jaxdata_cpu_runtime* rt, int64_t n,",
        "                                            int64_t grain, F f) {",
        "  rt->parallel_for(rt->pool, n, grain, [](void* a, int64_t b, int64_t e) {",
        "    (*static_cast<F*>(a))(b, e); }, &f);",
        "}",
        'extern "C" int jaxdata_hector_kernel(void* const* buf, const int64_t* scal,',
        "                                     const jaxdata_cpu_runtime* rt) {",
        "  if (rt->abi_version != 1) return 1;",
    ]
    ptr = lambda i: f"buf[{i}]"  # noqa: E731
    scalar = lambda i: f"scal[{i}]"  # noqa: E731
    restrict = "__restrict__"
  else:
    nbuf = len(GRAPH_FIELDS) + nslot + 1
    lines += [
        "#ifdef __CUDACC_RTC__", "typedef int int32_t; typedef long long int64_t;", "#else",
        "#include <cstdint>", "#endif",
        "__device__ __forceinline__ float ldf(const float* p) { return __ldg(p); }",
        "__device__ __forceinline__ float ldf(const unsigned short* p) {",
        "  return __uint_as_float(((unsigned)__ldg(p)) << 16); }",
        "__device__ __forceinline__ int64_t span(int64_t x, int64_t lo, int64_t hi) {",
        "  return x < lo ? lo : x > hi ? hi : x; }",
        "__device__ __forceinline__ float leaky_relu(float x, float s) {",
        "  return x > 0.0f ? x : s * x; }",
        "__device__ __forceinline__ float leaky_relu_grad(float x, float g, float s) {",
        "  return x > 0.0f ? g : s * g; }",
        f"struct Params {{ const void* buf[{nbuf}]; int64_t scal[{len(SCALARS)}]; }};",
        f'extern "C" __global__ void __launch_bounds__({_cuda_threads(k)})',
        "jaxdata_hector_kernel(const Params p) {",
    ]
    ptr = lambda i: f"p.buf[{i}]"  # noqa: E731
    scalar = lambda i: f"p.scal[{i}]"  # noqa: E731
    restrict = "__restrict__"
  types = ("int32_t", "int32_t", "int32_t", "float") + ("int32_t",) * (len(GRAPH_FIELDS) - 4)
  used = lambda name: re.search(rf"\b{name}\b", body) is not None  # noqa: E731
  for i, (name, t) in enumerate(zip(GRAPH_FIELDS, types)):
    if used(name):
      lines.append(f"  const {t}* {restrict} {name} = (const {t}*){ptr(i)};")
  for s, dt in enumerate(dtypes):
    t = ctype[dt]
    if not used(f"in{s}"):
      continue
    lines.append(f"  const {t}* {restrict} in{s} = (const {t}*){ptr(len(GRAPH_FIELDS) + s)};")
  lines.append(f"  float* {restrict} out = (float*){ptr(len(GRAPH_FIELDS) + nslot)};")
  for i, name in enumerate(SCALARS):
    if used(name):
      lines.append(f"  const int64_t {name} = {scalar(i)};")
  return "\n".join(lines) + "\n"


def _guard(k) -> str:
  """`ok(e)`: whether row e of the domain may be used. Out-of-range ids cannot be told apart
  from real ones before the kernel runs (they may be computed under jit), so every kernel skips
  a row whose ids are out of range: it contributes nothing (docs/hector.md, "Ids out of
  range"). On the pairs, `src`/`dst` are the pair's source and `etype` its relation; on the
  edges, the edge's pair must be in range too. Offsets read from the graph are clamped with
  `span(x, lo, hi)`."""
  u = "(unsigned long long)"
  pair = f" && {u}pair[e] < {u}P" if k.domain != "compact" else ""
  return (f"  // a row whose ids are out of range contributes nothing\n"
          f"  auto ok = [&](int64_t e) -> bool {{\n"
          f"    return {u}e < {u}E && {u}src[e] < {u}N && {u}dst[e] < {u}N &&\n"
          f"           {u}etype[e] < {u}R{pair};\n"
          f"  }};\n")


def _load(ld: Load, f: str) -> str:
  if ld.kind == "norm":
    return "norm[e]"
  idx = f" + {f}" if ld.width else ""
  w = max(ld.width, 1)
  if ld.kind == "weight_row":
    return f"ldf(in{ld.slot} + ((int64_t)etype[e] * N + {ld.end}[e]) * {w}{idx})"
  return f"ldf(in{ld.slot} + {_row(ld)}{idx})"


def _index(f: str, outer: int, inner: int) -> str:
  """The index into an argument `inner` wide of feature `f` of an expression `outer` wide: the
  same feature, the row's only value, or (a per-head argument) f's head."""
  if inner == outer:
    return f
  if inner == 0:
    return "0"
  return f"({f}) / {outer // inner}"


def _expr(x: Expr, f: str, depth: int = 0) -> str:
  """C expression for feature `f` of `x` (CPU and CUDA alike); `depth` names the loop variables
  of nested dot products."""
  if isinstance(x, Load):
    return _load(x, f if x.width else "0")
  if x.op == "dot":  # per head: the sum over the head's d features, as an inlined lambda
    d = x.args[0].width // max(x.width, 1)
    q, acc = f"dq{depth}", f"dacc{depth}"
    at = f"({f}) * {d} + {q}" if x.width else q
    a, b = (_expr(y, at, depth + 1) for y in x.args)
    return (f"[&]() {{ float {acc} = 0.0f; for (int {q} = 0; {q} < {d}; ++{q}) "
            f"{acc} += {a} * {b}; return {acc}; }}()")
  a = [_expr(y, _index(f, x.width, y.width), depth) for y in x.args]
  if x.op == "mul":
    return f"({a[0]} * {a[1]})"
  if x.op == "add":
    return f"({a[0]} + {a[1]})"
  p = f"{x.param!r}f"
  if x.op == "unary":
    return _UNARY[x.fn].format(x=a[0], p=p)
  return _UNARY_GRAD[x.fn].format(x=a[0], g=a[1], p=p)


def _scale(scales: tuple[Load, ...]) -> str:
  return " * ".join([_load(s, "0") for s in scales]) or "1.0f"


def _weight(g: Gemm, k: str, n: str) -> str:
  """Element (k, n) of the edge's relation's weight (of head `h`'s block, per head)."""
  block = g.k * g.n
  head = f" + (int64_t)h * {block}" if g.heads > 1 else ""
  inner = f"({n}) * {g.k} + ({k})" if g.transpose else f"({k}) * {g.n} + ({n})"
  return f"ldf(in{g.weight} + (int64_t)r * {g.heads * block}{head} + {inner})"


def _head(heads: int, width: int) -> str:
  """The offset of head h's features in a row of `heads` heads of `width` ("" for one head)."""
  return f"h * {width} + " if heads > 1 else ""


def _plus_head(heads: int, width: int) -> str:
  return f" + h * {width}" if heads > 1 else ""


def _row(ld: Load) -> str:
  """Element offset of the row a node, edge, pair or vector load reads for edge e."""
  w = max(ld.width, 1)
  where = {"node": f"{ld.end}[e]", "pair": "pair[e]", "vector": "etype[e]"}.get(ld.kind)
  return f"(int64_t){where} * {w}" if where else f"e * {w}"


def _groups(end: str) -> tuple[str, str]:
  """(offsets, edge ids) of the graph view that groups edges by their `end` node."""
  return ("csc_offsets", "csc_edges") if end == "dst" else ("csr_offsets", "csr_edges")


# ----------------------------------------------------------------------------- CPU templates
def _cpu_gemm(g: Gemm) -> str:
  rows = g.rows
  width = g.heads * g.n  # output features per row
  madd = (f"      for (int k = 0; k < {g.k}; ++k) {{\n"
          f"        const float ak = ldf(a + {_head(g.heads, g.k)}k) * sc;\n"
          f"        for (int n = 0; n < {g.n}; ++n) acc[{_head(g.heads, g.n)}n] += ak * "
          f"{_weight(g, 'k', 'n')};\n"
          f"      }}\n")
  if g.heads > 1:
    madd = f"      for (int h = 0; h < {g.heads}; ++h)\n" + madd
  if g.out == "edge":
    return (f"  parallel_for(rt, E, 256, [&](int64_t lo, int64_t hi) {{\n"
            f"    for (int64_t e = lo; e < hi; ++e) {{\n"
            f"      float acc[{width}] = {{0}};\n"
            f"      if (ok(e)) {{\n"
            f"      const int64_t r = etype[e];\n"
            f"      const float sc = {_scale(g.scales)};\n"
            f"      const auto a = in{rows.slot} + {_row(rows)};\n"
            f"{madd}"
            f"      }}\n"
            f"      for (int n = 0; n < {width}; ++n) out[e * {width} + n] = acc[n];\n"
            f"    }}\n  }});\n  return 0;\n}}\n")
  off, eids = _groups(g.out)
  return (f"  parallel_for(rt, N, 64, [&](int64_t lo, int64_t hi) {{\n"
          f"    for (int64_t i = lo; i < hi; ++i) {{\n"
          f"      float acc[{width}] = {{0}};\n"
          f"      const int64_t q0 = span({off}[i], 0, E), q1 = span({off}[i + 1], q0, E);\n"
          f"      for (int64_t q = q0; q < q1; ++q) {{\n"
          f"      const int64_t e = {eids}[q];\n"
          f"      if (!ok(e)) continue;\n"
          f"      const int64_t r = etype[e];\n"
          f"      const float sc = {_scale(g.scales)};\n"
          f"      const auto a = in{rows.slot} + {_row(rows)};\n"
          f"{madd}"
          f"      }}\n"
          f"      for (int n = 0; n < {width}; ++n) out[i * {width} + n] = acc[n];\n"
          f"    }}\n  }});\n  return 0;\n}}\n")


def _cpu_wgrad(w: WeightGrad) -> str:
  """One task per relation, head and block of 16 rows of dW, walking the relation's edges."""
  kb = 16
  blocks = (w.k + kb - 1) // kb
  tasks = w.heads * blocks
  if w.heads > 1:
    where = (f"      const int64_t r = task / {tasks};\n"
             f"      const int h = int(task / {blocks}) % {w.heads};\n"
             f"      float* __restrict__ o = out + (r * {w.heads} + h) * {w.k * w.n};\n")
  else:
    where = (f"      const int64_t r = task / {blocks};\n"
             f"      float* __restrict__ o = out + r * {w.k * w.n};\n")
  return (f"  parallel_for(rt, R * {tasks}, 1, [&](int64_t lo, int64_t hi) {{\n"
          f"    for (int64_t task = lo; task < hi; ++task) {{\n"
          f"{where}"
          f"      const int k0 = int(task % {blocks}) * {kb};\n"
          f"      const int k1 = std::min(k0 + {kb}, {w.k});\n"
          f"      const int64_t e0 = span(rel_offsets[r], 0, E);\n"
          f"      const int64_t e1 = span(rel_offsets[r + 1], e0, E);\n"
          f"      for (int64_t e = e0; e < e1; ++e) {{\n"
          f"        if (!ok(e)) continue;\n"
          f"        const float sc = {_scale(w.scales)};\n"
          f"        const auto l = in{w.left.slot} + {_row(w.left)}{_plus_head(w.heads, w.k)};\n"
          f"        const auto rr = in{w.right.slot} + {_row(w.right)}{_plus_head(w.heads, w.n)};\n"
          f"        float right[{w.n}];\n"
          f"        for (int n = 0; n < {w.n}; ++n) right[n] = ldf(rr + n) * sc;\n"
          f"        for (int k = k0; k < k1; ++k) {{\n"
          f"          const float lk = ldf(l + k);\n"
          f"          for (int n = 0; n < {w.n}; ++n) o[k * {w.n} + n] += lk * right[n];\n"
          f"        }}\n"
          f"      }}\n"
          f"    }}\n  }});\n  return 0;\n}}\n")


def _cpu_traversal(t: Traversal) -> str:
  w = max(t.width, 1)
  value = _expr(t.expr, "f")
  if t.sink == "store":
    return (f"  parallel_for(rt, E, 1024, [&](int64_t lo, int64_t hi) {{\n"
            f"    for (int64_t e = lo; e < hi; ++e) {{\n"
            f"      const bool use = ok(e);\n"
            f"      for (int f = 0; f < {w}; ++f) out[e * {w} + f] = use ? {value} : 0.0f;\n"
            f"    }}\n"
            f"  }});\n  return 0;\n}}\n")
  if t.sink == "softmax":
    return _cpu_softmax(t, w, value)
  if t.sink == "relation":
    return _cpu_relation_sum(w, value)
  if t.sink == "pair":  # each pair's row sums the rows of its edges
    off, eids, count = "pair_offsets", "pair_edges", "P"
    target = f"out + i * {w}"
  else:
    (off, eids), count = _groups(t.end), "N"
    target = (f"out + i * {w}" if t.sink == "aggregate" else
              f"out + ((int64_t)etype[e] * N + i) * {w}")
  return (f"  parallel_for(rt, {count}, 64, [&](int64_t lo, int64_t hi) {{\n"
          f"    for (int64_t i = lo; i < hi; ++i) {{\n"
          f"      const int64_t q0 = span({off}[i], 0, E), q1 = span({off}[i + 1], q0, E);\n"
          f"      for (int64_t q = q0; q < q1; ++q) {{\n"
          f"        const int64_t e = {eids}[q];\n"
          f"        if (!ok(e)) continue;\n"
          f"        float* __restrict__ o = {target};\n"
          f"        for (int f = 0; f < {w}; ++f) o[f] += {value};\n"
          f"      }}\n"
          f"    }}\n  }});\n  return 0;\n}}\n")


def _cpu_softmax(t: Traversal, w: int, value: str) -> str:
  """Per node (its edges grouped at `end`) and head: the maximum score, then exp(score - max)
  stored per edge and summed, then the stored values divided by the sum."""
  off, eids = _groups(t.end)
  return (f"  parallel_for(rt, N, 64, [&](int64_t lo, int64_t hi) {{\n"
          f"    for (int64_t i = lo; i < hi; ++i) {{\n"
          f"      const int64_t q0 = span({off}[i], 0, E), q1 = span({off}[i + 1], q0, E);\n"
          f"      for (int f = 0; f < {w}; ++f) {{\n"
          f"        float m = {_LOWEST};\n"
          f"        for (int64_t q = q0; q < q1; ++q) {{\n"
          f"          const int64_t e = {eids}[q];\n"
          f"          if (!ok(e)) continue;\n"
          f"          m = std::max(m, {value});\n"
          f"        }}\n"
          f"        float sum = 0.0f;\n"
          f"        for (int64_t q = q0; q < q1; ++q) {{\n"
          f"          const int64_t e = {eids}[q];\n"
          f"          if (!ok(e)) continue;\n"
          f"          const float x = expf({value} - m);\n"
          f"          out[e * {w} + f] = x;\n"
          f"          sum += x;\n"
          f"        }}\n"
          f"        for (int64_t q = q0; q < q1; ++q)\n"
          f"          if (ok({eids}[q])) out[(int64_t){eids}[q] * {w} + f] /= sum;\n"
          f"      }}\n"
          f"    }}\n  }});\n  return 0;\n}}\n")


def _cpu_relation_sum(w: int, value: str) -> str:
  """out[r] sums the rows of relation r's edges: one task per relation and block of features."""
  fb = 16
  blocks = (w + fb - 1) // fb
  return (f"  parallel_for(rt, R * {blocks}, 1, [&](int64_t lo, int64_t hi) {{\n"
          f"    for (int64_t task = lo; task < hi; ++task) {{\n"
          f"      const int64_t r = task / {blocks};\n"
          f"      const int f0 = int(task % {blocks}) * {fb}, f1 = std::min(f0 + {fb}, {w});\n"
          f"      float* __restrict__ o = out + r * {w};\n"
          f"      const int64_t e0 = span(rel_offsets[r], 0, E);\n"
          f"      const int64_t e1 = span(rel_offsets[r + 1], e0, E);\n"
          f"      for (int64_t e = e0; e < e1; ++e)\n"
          f"        if (ok(e))\n"
          f"          for (int f = f0; f < f1; ++f) o[f] += {value};\n"
          f"    }}\n  }});\n  return 0;\n}}\n")


# ----------------------------------------------------------------------------- CUDA templates
def _gemm_tile(n: int) -> int:
  """Output columns per block: the smallest of 16, 32, 64, 128 that covers n (128 beyond)."""
  return 16 if n <= 16 else 32 if n <= 32 else 64 if n <= 64 else 128


def _micro(bn: int) -> int:
  """Output columns per thread (each thread computes 4 rows by this many columns)."""
  return 8 if bn == 128 else 4


def _cuda_threads(k) -> int:
  if isinstance(k, (Gemm, WeightGrad)):
    bn = _gemm_tile(k.n)
    return 16 * (bn // _micro(bn))
  return 256


#: edges each thread of a CUDA relation sum walks (it adds its partial sums once per relation)
RELATION_RUN = 32


def launch(k, num_tiles: int, num_edges: int, num_nodes: int = 0) -> tuple[int, int]:
  """(blocks, threads) for a CUDA kernel instance (`num_tiles`: an upper bound; `num_edges`:
  the rows of the instance's domain)."""
  threads = _cuda_threads(k)
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


_FIND_RELATION = """\
  // the relation of this tile: the last r with tiles[r] <= tile
  __shared__ int64_t s_r;
  if (threadIdx.x == 0) {
    int64_t lo = 0, hi = R;
    while (hi - lo > 1) { int64_t mid = (lo + hi) / 2; if (tiles[mid] <= tile) lo = mid; else hi = mid; }
    s_r = lo;
  }
  __syncthreads();
  const int64_t r = s_r;
"""

_MICRO_FMA = """\
#pragma unroll
    for (int kk = 0; kk < {bk}; ++kk) {{
      float a[4], b[{tn}];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = {A}[kk][ty * 4 + i];
#pragma unroll
      for (int j = 0; j < {tn}; ++j) b[j] = {B}[kk][tx * {tn} + j];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < {tn}; ++j) acc[i][j] += a[i] * b[j];
    }}
"""


def _cuda_gemm(g: Gemm) -> str:
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
  a_base = _row(rows)
  width = g.heads * g.n  # output features per row
  hk, hn = _head(g.heads, g.k), _head(g.heads, g.n)
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
    const float sc = arow[ty * 4 + i] >= 0 ? {_scale(g.scales)} : 0.0f;
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
    const float sc = arow[row] >= 0 ? {_scale(g.scales)} : 0.0f;
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
  head = (f"  const int h = int(blockIdx.x / {ncb}) % {g.heads};\n" if g.heads > 1 else "")
  return f"""\
  const int64_t tile = blockIdx.x / {ncb * g.heads};
{head}\
  const int cb = blockIdx.x % {ncb};
  if (tile >= tiles[R]) return;
{_FIND_RELATION}\
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
      rb[t] = (k < {g.k} && n < {g.n}) ? {_weight(g, 'k', 'n')} : 0.0f;
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
{_MICRO_FMA.format(bk=bk, tn=tn, A="As", B="Bs")}\
    __syncthreads();
  }}
{epilogue}\
}}
"""


def _cuda_wgrad(w: WeightGrad) -> str:
  be, bk, bm, bn = WGRAD_TILE_ROWS, 16, 64, _gemm_tile(w.n)  # bk: edges per step; bm: rows of dW
  tn = _micro(bn)
  threads = 16 * (bn // tn)
  assert (bk * bm) % threads == 0 and (bk * bn) % threads == 0
  nkb, nnb = -(-w.k // bm), -(-w.n // bn)
  lrow = _row(w.left) + _plus_head(w.heads, w.k)
  rrow = _row(w.right) + _plus_head(w.heads, w.n)
  head = (f"  const int h = int(blockIdx.x / {nkb * nnb}) % {w.heads};\n" if w.heads > 1 else "")
  block = f"(r * {w.heads} + h)" if w.heads > 1 else "r"  # dW's block: relation (and head)
  return f"""\
  const int64_t tile = blockIdx.x / {nkb * nnb * w.heads};
{head}\
  const int kb = (blockIdx.x / {nnb}) % {nkb}, nb = blockIdx.x % {nnb};
  if (tile >= tiles[R]) return;
{_FIND_RELATION}\
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
          ? ldf(in{w.right.slot} + {rrow} + n) * ({_scale(w.scales)}) : 0.0f;
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
{_MICRO_FMA.format(bk=bk, tn=tn, A="Ls", B="Rs")}\
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


def _cuda_traversal(t: Traversal) -> str:
  w = max(t.width, 1)
  value = _expr(t.expr, "f")
  if t.sink == "softmax":
    return _cuda_softmax(t, w, value)
  if t.sink == "relation":
    return _cuda_relation_sum(w, value)
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


def _cuda_softmax(t: Traversal, w: int, value: str) -> str:
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
  off, eids = _groups(t.end)
  threads = _cuda_threads(t)
  warps = threads // 32
  each = lambda body: f"for (int f = 0; f < {w}; ++f) {body}"  # noqa: E731

  def walk(first: str, step: str, reduce: str) -> str:
    """The three passes over a node's edges q0 <= q < q1, lanes from `first` by `step`."""
    loop = (f"for (int64_t q = q0 + {first}; q < q1; q += {step}) {{\n"
            f"  const int64_t e = {eids}[q];\n  if (!ok(e)) continue;")
    return f"""\
{each(f"{{ m[f] = {_LOWEST}; s[f] = 0.0f; }}")}
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


def _cuda_relation_sum(w: int, value: str) -> str:
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
