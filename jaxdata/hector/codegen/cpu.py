"""C++ for the CPU: one kernel instance as a shared library's ``jaxdata_hector_kernel``.

The source is templates/cpu.h and templates/common.h, then the kernel: its signature, the
operand pointers (`common.pointers`, laid out by `operands`) and the instance's loops. Kernels
are node-parallel over the rows they write (each thread owns its output rows through the
graph's CSR/CSC views, the pairs' edge lists or relation ranges): no atomics, deterministic sums.
"""

from __future__ import annotations

from jaxdata.hector.codegen.common import (
  LOWEST,
  cpu_reads_valid,
  expr,
  groups,
  guard,
  head,
  plus_head,
  pointers,
  row_pointer,
  scale,
  template,
  weight,
)
from jaxdata.hector.lowering import Gemm, Traversal, WeightGrad

_SIGNATURE = """\
extern "C" int jaxdata_hector_kernel(void* const* buf, const int64_t* scal,
                                     const jaxdata_cpu_runtime* rt) {
  if (rt->abi_version != JAXDATA_CPU_ABI_VERSION) return 1;
"""


def generate(k, dtypes: tuple[str, ...], out_dtype: str = "float32") -> str:
  """The C++ source of instance `k` (`dtypes`: each input slot's dtype; `out_dtype`: its
  output's), without its label: the same at every precision. Its tiled GEMMs check their rows'
  ids themselves (whether or not the call passes `valid`, which the CUDA kernels of the same
  call read on CUDA cores: `common.reads_valid`); the other kernels read `valid`."""
  kernel = {Gemm: _gemm, WeightGrad: _wgrad, Traversal: _traversal}[type(k)]
  body = guard(k, cpu_reads_valid(k)) + kernel(k)
  return (
    template("cpu.h")
    + template("common.h")
    + _SIGNATURE
    + pointers(body, dtypes, lambda i: f"buf[{i}]", lambda i: f"scal[{i}]", out_dtype)
    + body
  )


def _gemm(g: Gemm) -> str:
  rows = g.rows
  width = g.heads * g.n  # output features per row
  madd = (
    f"      for (int k = 0; k < {g.k}; ++k) {{\n"
    f"        const float ak = ldf(a + {head(g.heads, g.k)}k) * sc;\n"
    f"        for (int n = 0; n < {g.n}; ++n) acc[{head(g.heads, g.n)}n] += ak * "
    f"{weight(g, 'k', 'n')};\n"
    f"      }}\n"
  )
  if g.heads > 1:
    madd = f"      for (int h = 0; h < {g.heads}; ++h)\n" + madd
  if g.out == "edge":
    return (
      f"  parallel_for(rt, E, 256, [&](int64_t lo, int64_t hi) {{\n"
      f"    for (int64_t e = lo; e < hi; ++e) {{\n"
      f"      float acc[{width}] = {{0}};\n"
      f"      if (ok(e)) {{\n"
      f"      const int64_t r = etype[e];\n"
      f"      const float sc = {scale(g.scales)};\n"
      f"      const auto a = {row_pointer(rows)};\n"
      f"{madd}"
      f"      }}\n"
      f"      for (int n = 0; n < {width}; ++n) stf(out + e * {width} + n, acc[n]);\n"
      f"    }}\n  }});\n  return 0;\n}}\n"
    )
  off, eids = groups(g.out)
  return (
    f"  parallel_for(rt, N, 64, [&](int64_t lo, int64_t hi) {{\n"
    f"    for (int64_t i = lo; i < hi; ++i) {{\n"
    f"      float acc[{width}] = {{0}};\n"
    f"      const int64_t q0 = span({off}[i], 0, E), q1 = span({off}[i + 1], q0, E);\n"
    f"      for (int64_t q = q0; q < q1; ++q) {{\n"
    f"      const int64_t e = {eids}[q];\n"
    f"      if (!ok(e)) continue;\n"
    f"      const int64_t r = etype[e];\n"
    f"      const float sc = {scale(g.scales)};\n"
    f"      const auto a = {row_pointer(rows)};\n"
    f"{madd}"
    f"      }}\n"
    f"      for (int n = 0; n < {width}; ++n) out[i * {width} + n] = acc[n];\n"
    f"    }}\n  }});\n  return 0;\n}}\n"
  )


def _wgrad(w: WeightGrad) -> str:
  """One task per relation, head and block of 16 rows of dW, walking the relation's edges."""
  kb = 16
  blocks = (w.k + kb - 1) // kb
  tasks = w.heads * blocks
  if w.heads > 1:
    where = (
      f"      const int64_t r = task / {tasks};\n"
      f"      const int h = int(task / {blocks}) % {w.heads};\n"
      f"      float* __restrict__ o = out + (r * {w.heads} + h) * {w.k * w.n};\n"
    )
  else:
    where = (
      f"      const int64_t r = task / {blocks};\n"
      f"      float* __restrict__ o = out + r * {w.k * w.n};\n"
    )
  return (
    f"  parallel_for(rt, R * {tasks}, 1, [&](int64_t lo, int64_t hi) {{\n"
    f"    for (int64_t task = lo; task < hi; ++task) {{\n"
    f"{where}"
    f"      const int k0 = int(task % {blocks}) * {kb};\n"
    f"      const int k1 = min_of(k0 + {kb}, {w.k});\n"
    f"      const int64_t e0 = span(rel_offsets[r], 0, E);\n"
    f"      const int64_t e1 = span(rel_offsets[r + 1], e0, E);\n"
    f"      for (int64_t e = e0; e < e1; ++e) {{\n"
    f"        if (!ok(e)) continue;\n"
    f"        const float sc = {scale(w.scales)};\n"
    f"        const auto l = {row_pointer(w.left)}{plus_head(w.heads, w.k)};\n"
    f"        const auto rr = {row_pointer(w.right)}{plus_head(w.heads, w.n)};\n"
    f"        float right[{w.n}];\n"
    f"        for (int n = 0; n < {w.n}; ++n) right[n] = ldf(rr + n) * sc;\n"
    f"        for (int k = k0; k < k1; ++k) {{\n"
    f"          const float lk = ldf(l + k);\n"
    f"          for (int n = 0; n < {w.n}; ++n) o[k * {w.n} + n] += lk * right[n];\n"
    f"        }}\n"
    f"      }}\n"
    f"    }}\n  }});\n  return 0;\n}}\n"
  )


def _traversal(t: Traversal) -> str:
  w = max(t.width, 1)
  value = expr(t.expr, "f")
  if t.sink == "store":
    return (
      f"  parallel_for(rt, E, 1024, [&](int64_t lo, int64_t hi) {{\n"
      f"    for (int64_t e = lo; e < hi; ++e) {{\n"
      f"      const bool use = ok(e);\n"
      f"      for (int f = 0; f < {w}; ++f) stf(out + e * {w} + f, use ? {value} : 0.0f);\n"
      f"    }}\n"
      f"  }});\n  return 0;\n}}\n"
    )
  if t.sink == "softmax":
    return _softmax(t, w, value)
  if t.sink == "relation":
    return _relation_sum(w, value)
  if t.sink == "pair":  # each pair's row sums the rows of its edges
    off, eids, count = "pair_offsets", "pair_edges", "P"
    target = f"out + i * {w}"
  else:
    (off, eids), count = groups(t.end), "N"
    target = (
      f"out + i * {w}" if t.sink == "aggregate" else f"out + ((int64_t)etype[e] * N + i) * {w}"
    )
  return (
    f"  parallel_for(rt, {count}, 64, [&](int64_t lo, int64_t hi) {{\n"
    f"    for (int64_t i = lo; i < hi; ++i) {{\n"
    f"      const int64_t q0 = span({off}[i], 0, E), q1 = span({off}[i + 1], q0, E);\n"
    f"      for (int64_t q = q0; q < q1; ++q) {{\n"
    f"        const int64_t e = {eids}[q];\n"
    f"        if (!ok(e)) continue;\n"
    f"        float* __restrict__ o = {target};\n"
    f"        for (int f = 0; f < {w}; ++f) o[f] += {value};\n"
    f"      }}\n"
    f"    }}\n  }});\n  return 0;\n}}\n"
  )


def _softmax(t: Traversal, w: int, value: str) -> str:
  """Per node (its edges grouped at `end`) and head: the maximum score, then exp(score - max)
  stored per edge and summed, then the stored values divided by the sum."""
  off, eids = groups(t.end)
  return (
    f"  parallel_for(rt, N, 64, [&](int64_t lo, int64_t hi) {{\n"
    f"    for (int64_t i = lo; i < hi; ++i) {{\n"
    f"      const int64_t q0 = span({off}[i], 0, E), q1 = span({off}[i + 1], q0, E);\n"
    f"      for (int f = 0; f < {w}; ++f) {{\n"
    f"        float m = {LOWEST};\n"
    f"        for (int64_t q = q0; q < q1; ++q) {{\n"
    f"          const int64_t e = {eids}[q];\n"
    f"          if (!ok(e)) continue;\n"
    f"          m = max_of(m, {value});\n"
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
    f"    }}\n  }});\n  return 0;\n}}\n"
  )


def _relation_sum(w: int, value: str) -> str:
  """out[r] sums the rows of relation r's edges: one task per relation and block of features."""
  fb = 16
  blocks = (w + fb - 1) // fb
  return (
    f"  parallel_for(rt, R * {blocks}, 1, [&](int64_t lo, int64_t hi) {{\n"
    f"    for (int64_t task = lo; task < hi; ++task) {{\n"
    f"      const int64_t r = task / {blocks};\n"
    f"      const int f0 = int(task % {blocks}) * {fb}, f1 = min_of(f0 + {fb}, {w});\n"
    f"      float* __restrict__ o = out + r * {w};\n"
    f"      const int64_t e0 = span(rel_offsets[r], 0, E);\n"
    f"      const int64_t e1 = span(rel_offsets[r + 1], e0, E);\n"
    f"      for (int64_t e = e0; e < e1; ++e)\n"
    f"        if (ok(e))\n"
    f"          for (int f = f0; f < f1; ++f) o[f] += {value};\n"
    f"    }}\n  }});\n  return 0;\n}}\n"
  )
