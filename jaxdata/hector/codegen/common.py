"""What the CPU and CUDA generators share: the fixed source files, the operand pointers a
kernel declares (from `operands`), the edge-range guard and the printing of IR expressions,
loads and weight elements as C expressions (the same text compiles as C++ and as CUDA)."""

from __future__ import annotations

import functools
import math
import re
from importlib import resources

from jaxdata.hector import operands
from jaxdata.hector.lowering import Expr, Gemm, Load, WeightGrad

_CTYPES = {"float32": "float", "bfloat16": "unsigned short"}


@functools.cache
def template(name: str) -> str:
  """The text of a fixed source file in jaxdata/hector/templates/ (read once)."""
  return resources.files("jaxdata.hector").joinpath("templates").joinpath(name).read_text()


def pointers(body: str, dtypes: tuple[str, ...], ptr, scalar, out_dtype: str = "float32") -> str:
  """The declarations of the operands `body` uses, as `operands` lays them out: the graph
  arrays and the inputs (`dtypes`: each input slot's dtype) as typed pointers, the output
  (`out_dtype`; only a kernel that stores its rows writes bfloat16, through `stf`) and the
  scalars. `ptr(i)` / `scalar(i)` is the C expression of buffer / scalar i."""
  used = lambda name: re.search(rf"\b{name}\b", body) is not None  # noqa: E731
  lines = []
  for op in operands.GRAPH:
    if used(op.name):
      i = operands.index(op.name)
      lines.append(f"  const {op.ctype}* __restrict__ {op.name} = (const {op.ctype}*){ptr(i)};")
  n = len(dtypes)
  for s, dt in enumerate(dtypes):
    name, t = f"in{s}", _CTYPES[dt]
    if used(name):
      lines.append(
        f"  const {t}* __restrict__ {name} = (const {t}*){ptr(operands.index(name, n))};"
      )
  t = _CTYPES[out_dtype]
  lines.append(f"  {t}* __restrict__ out = ({t}*){ptr(operands.index('out', n))};")
  for name in operands.SCALAR_NAMES:
    if used(name):
      lines.append(f"  const int64_t {name} = {scalar(operands.scalar_index(name))};")
  return "\n".join(lines) + "\n"


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
LOWEST = "-3.402823466e+38f"


#: 1: the kernels that visit rows out of order (`reads_valid`) read ok(e) from the `valid` operand
#: (`operands.valid_rows`: its ids checked once per call); 0: every kernel loads and checks the
#: row's ids itself (`row_ok`, as the original kernels did). RGAT, 2M edges, dim 64, fwd+bwd on
#: the H200 with checks and with none at all: 7.57 -> 5.17 ms at "highest", 4.56 -> 3.79 ms TF32
#: (probe_constants.py).
VALID_MASK = 1


#: a GEMM that scatters into nodes over at most this many input features (and one head) runs as
#: a grouped sum through the CSC or CSR view (`cuda._thin_gemm`), not in tiles (0: never)
GEMM_THIN_K = 4


def thin(k) -> bool:
  """Whether instance `k` is a GEMM that `cuda._thin_gemm` generates (`GEMM_THIN_K`)."""
  return (
    isinstance(k, Gemm)
    and k.k <= GEMM_THIN_K
    and k.heads == 1
    and k.out in ("src", "dst")
    and k.domain == "edge"
  )


def reads_valid(k, kind: str = "fma") -> bool:
  """Whether kernel `k`, generated as GEMM kind `kind` (`cuda.math`), has its ok(e) read the
  `valid` operand (under `VALID_MASK`): every kernel but the tiled GEMMs and weight gradients on
  tensor cores ("tf32", "bf16"), which check each row's ids themselves. Those visit rows in
  order, one relation's tile at a time, so the ids are a few coalesced loads that the tensor-core
  kernels hide; and a program of such kernels alone (an RGCN forward at default precision)
  computes no mask: one kernel fewer for the host to launch (MUTAG RGCN forward on the H200:
  63 -> 58 us, probe_inference.py). The CUDA-core ("fma") GEMMs pay for the inline checks (RGCN
  fwd+bwd on 2M edges at "highest": 10-21% slower, docs/benchmarks/tensor_cores.md), so they read
  the mask. Decided from the instance, its dtypes and its precision, the same on every target:
  which operands a call passes is fixed before it is lowered for one."""
  return bool(VALID_MASK) and not (tiled(k) and kind != "fma")


def cpu_reads_valid(k) -> bool:
  """Whether the CPU kernel of `k` reads `valid`: as on CUDA cores, except the tiled GEMMs,
  which check their rows' ids themselves at every precision (so a CPU kernel's source does not
  depend on the precision; the mask a call passes for its CUDA kernel goes unread here)."""
  return bool(VALID_MASK) and not tiled(k)


def tiled(k) -> bool:
  """Whether instance `k` is a GEMM or weight gradient that runs over row tiles (not `thin`)."""
  return isinstance(k, (Gemm, WeightGrad)) and not thin(k)


def guard(k, reads: bool) -> str:
  """`ok(e)`: whether row e of the domain may be used: a row whose ids are out of range
  contributes nothing (docs/hector.md). With `reads` it reads valid[e] (which the call passes
  where `reads_valid`), else it checks the ids with `row_ok` (templates/common.h; on the edges,
  the edge's pair too). Offsets read from the graph are clamped with `span(x, lo, hi)`."""
  if reads:
    return (
      "  // a row whose ids are out of range contributes nothing (operands.valid_rows)\n"
      "  auto ok = [&](int64_t e) -> bool {\n"
      "    return (unsigned long long)e < (unsigned long long)E && valid[e];\n"
      "  };\n"
    )
  pair = ", pair, P" if k.domain != "compact" else ""
  return (
    "  // a row whose ids are out of range contributes nothing\n"
    "  auto ok = [&](int64_t e) -> bool {\n"
    f"    return row_ok(e, E, N, R, src, dst, etype{pair});\n"
    "  };\n"
  )


def row_pointer(ld: Load, idx: str = "") -> str:
  """The address of element `idx` (the row's start if "") of the row load `ld` reads for edge
  e."""
  if ld.kind == "weight_row":
    start = f"((int64_t)etype[e] * N + {ld.end}[e]) * {max(ld.width, 1)}"
  else:
    start = row(ld)
  return f"in{ld.slot} + {start}" + (f" + {idx}" if idx else "")


def load(ld: Load, f: str) -> str:
  if ld.kind == "norm":
    return "norm[e]"
  return f"ldf({row_pointer(ld, f if ld.width else '')})"


def index(f: str, outer: int, inner: int) -> str:
  """The index into an argument `inner` wide of feature `f` of an expression `outer` wide: the
  same feature, the row's only value, or (a per-head argument) f's head."""
  if inner == outer:
    return f
  if inner == 0:
    return "0"
  return f"({f}) / {outer // inner}"


def expr(x: Expr, f: str, depth: int = 0) -> str:
  """C expression for feature `f` of `x` (CPU and CUDA alike); `depth` names the loop variables
  of nested dot products."""
  if isinstance(x, Load):
    return load(x, f if x.width else "0")
  if x.op == "dot":  # per head: the sum over the head's d features
    d = x.args[0].width // max(x.width, 1)
    if all(isinstance(y, Load) and y.width for y in x.args):
      return _dot_rows(x.args, d, f"({f}) * {d}" if x.width else "0")
    q, acc = f"dq{depth}", f"dacc{depth}"  # otherwise as an inlined lambda
    at = f"({f}) * {d} + {q}" if x.width else q
    a, b = (expr(y, at, depth + 1) for y in x.args)
    return (
      f"[&]() {{ float {acc} = 0.0f; for (int {q} = 0; {q} < {d}; ++{q}) "
      f"{acc} += {a} * {b}; return {acc}; }}()"
    )
  a = [expr(y, index(f, x.width, y.width), depth) for y in x.args]
  if x.op == "mul":
    return f"({a[0]} * {a[1]})"
  if x.op == "add":
    return f"({a[0]} + {a[1]})"
  p = f"{x.param!r}f"
  if x.op == "unary":
    return _UNARY[x.fn].format(x=a[0], p=p)
  return _UNARY_GRAD[x.fn].format(x=a[0], g=a[1], p=p)


#: the most elements a `dot_rows` pointer is said to be aligned to (1: one element per load)
DOT_ALIGN = 16


def _dot_rows(loads, d: int, at: str) -> str:
  """`dot_rows<D, ALIGN_A, ALIGN_B>(a, b)`: the sum over i < d of a[i] * b[i] in order, a and b
  the two loads' rows from element `at` (templates/cpu.h, templates/cuda.cuh). ALIGN: the
  elements the pointer is a whole multiple of from its buffer's start (every row and every head
  starts there): the CUDA helper reads that many at once, up to 16 bytes (XLA's buffers are
  16-byte aligned at least)."""
  a, b = (math.gcd(ld.width, d, DOT_ALIGN) for ld in loads)
  return f"dot_rows<{d}, {a}, {b}>({row_pointer(loads[0], at)}, {row_pointer(loads[1], at)})"


def scale(scales: tuple[Load, ...]) -> str:
  return " * ".join([load(s, "0") for s in scales]) or "1.0f"


def weight_offset(g: Gemm, k: str, n: str) -> str:
  """The element offset of (k, n) in the edge's relation's weight (head `h`'s block, per head)."""
  block = g.k * g.n
  of_head = f" + (int64_t)h * {block}" if g.heads > 1 else ""
  inner = f"({n}) * {g.k} + ({k})" if g.transpose else f"({k}) * {g.n} + ({n})"
  return f"(int64_t)r * {g.heads * block}{of_head} + {inner}"


def weight(g: Gemm, k: str, n: str) -> str:
  """Element (k, n) of the edge's relation's weight (of head `h`'s block, per head)."""
  return f"ldf(in{g.weight} + {weight_offset(g, k, n)})"


def head(heads: int, width: int) -> str:
  """The offset of head h's features in a row of `heads` heads of `width` ("" for one head)."""
  return f"h * {width} + " if heads > 1 else ""


def plus_head(heads: int, width: int) -> str:
  return f" + h * {width}" if heads > 1 else ""


def row_ids(ld: Load) -> str | None:
  """The ids whose entry e is the row a node, pair or vector load reads for edge e (None: an
  edge load reads row e)."""
  return {"node": ld.end, "pair": "pair", "vector": "etype"}.get(ld.kind)


def row(ld: Load) -> str:
  """Element offset of the row a node, edge, pair or vector load reads for edge e."""
  w = max(ld.width, 1)
  ids = row_ids(ld)
  return f"(int64_t){ids}[e] * {w}" if ids else f"e * {w}"


def groups(end: str) -> tuple[str, str]:
  """(offsets, edge ids) of the graph view that groups edges by their `end` node."""
  return ("csc_offsets", "csc_edges") if end == "dst" else ("csr_offsets", "csr_edges")
