"""Lowering: a shaped program becomes a list of kernel instances of three templates.

* `Gemm`: per-relation dense products over edge rows. Rows come in gathered from a node array
  (``x[src[e]]``) or from a materialized edge array; the weight is the edge's relation's (or,
  per head, one block per relation and head: a batched product, never a block-diagonal one),
  optionally transposed; per-edge scalars scale the result; rows go out scattered (summed into
  ``out[dst[e]]``) or stored per edge.
* `WeightGrad`: the GEMM template's weight-gradient mode, ``dW[r] = sum_e left[e]^T right[e]``
  over each relation's edges.
* `Traversal`: an edge-parallel loop computing an elementwise expression per edge row (gathers,
  weight and vector rows, rows of compact values, graph scalars, +, *, per-head dot products,
  unary functions) and summing it into nodes, weight rows, relations or (src, relation) pairs,
  storing it, or storing its softmax over each node's edges (``sink="softmax"``).
* `Dense`: what is left on nodes or weights (adding two gradients, folding a weight with a
  vector or a per-head scale) runs as XLA ops.

Every GEMM, weight-gradient and traversal instance runs over a *domain*: the graph's edges, or
(``domain="compact"``) its unique (source node, relation) pairs, which the runtime presents to
the kernel as a graph whose edges are the pairs (``src``, ``etype``, relation offsets and a CSR
view of their own), so the same templates serve both.

A value is *materialized* (a kernel writes it to memory) when it is an output, lives on nodes or
weights, feeds several consumers and is not cheap, is a relation product that cannot be fused
into its consumer, is read through the pair map (a compact value under ``expand``), or is a
softmax or a per-pair sum (their own loops). Cheap values (gathers, weight and vector rows, graph
scalars, their products with edge scalars, rows of compact values) are recomputed inside each
consumer, so the backward pass never stores the scaled, gathered cotangent rows it reads twice.
"""

from __future__ import annotations

import dataclasses

from jaxdata.hector.ir import ROWS, Program, Value, is_cheap, is_edge_scalar, width


# ----------------------------------------------------------------------------- expressions
@dataclasses.dataclass(frozen=True)
class Load:
  """A row (or scalar) an instance reads per edge.

  kind: "node" (slot's node array at the edge's `end`), "edge" (slot's array of the kernel's
  domain), "pair" (slot's compact array at the edge's pair), "weight_row" (slot's weight at
  [etype, end-node]), "vector" (slot's relation vector at etype, flattened), "norm" (the graph's
  normalizer).
  """

  kind: str
  slot: int = -1
  end: str = ""
  width: int = 0  # 0: a scalar per edge

  def __str__(self):
    where = {
      "node": f"[{self.end}[e]]",
      "edge": "[e]",
      "pair": "[pair[e]]",
      "weight_row": f"[etype[e], {self.end}[e]]",
      "vector": "[etype[e]]",
      "norm": "[e]",
    }[self.kind]
    return ("norm" if self.kind == "norm" else f"in{self.slot}") + where


@dataclasses.dataclass(frozen=True)
class Op:
  """An operation on expressions: mul, add, unary (fn), unary_grad (fn; x, g), all elementwise
  (a narrower argument broadcasts per head), and dot (per-head sums of products; width H, or 0
  for one sum over the whole row). `param` is a unary's parameter (leaky_relu's slope)."""

  op: str
  args: tuple[Expr, ...]
  fn: str = ""
  width: int = 0
  param: float = 0.0

  def __str__(self):
    fn = f"{self.fn}[{self.param:g}]" if self.fn == "leaky_relu" else self.fn
    if self.op in ("mul", "add"):
      return f"({self.args[0]} {'*' if self.op == 'mul' else '+'} {self.args[1]})"
    if self.op == "dot":
      return f"dot{self.width or ''}({self.args[0]}, {self.args[1]})"
    if self.op == "unary":
      return f"{fn}({self.args[0]})"
    return f"{fn}_grad({self.args[0]}, {self.args[1]})"


Expr = Load | Op


# ----------------------------------------------------------------------------- instances
def _over(domain: str) -> str:
  return "  over (src, relation) pairs" if domain == "compact" else ""


def _dims(heads: int, k: int, n: int) -> str:
  return f"{heads} heads x {k}x{n}" if heads > 1 else f"{k}x{n}"


@dataclasses.dataclass(frozen=True)
class Gemm:
  """Rows times the edge's relation weight. With `heads` > 1 the weight is per head,
  ``[R, H, k, n]`` (``[R, H, n, k]`` transposed): head h's k features of the row times its own
  block, ``H * k`` features in and ``H * n`` out; `k` and `n` are per head."""

  rows: Load  # "node" (gathered), "edge" or "pair"
  weight: int  # slot of the relation weight
  transpose: bool
  k: int
  n: int
  scales: tuple[Load, ...]
  out: str  # "src" / "dst" (scatter-add into nodes) or "edge" (store per edge)
  domain: str = "edge"
  heads: int = 1
  template = "gemm"

  def __str__(self):
    w = f"in{self.weight}[etype[e]]" + (".T" if self.transpose else "")
    scale = "".join(f" * {s}" for s in self.scales)
    to = "out[e] =" if self.out == "edge" else f"out[{self.out}[e]] +="
    return (
      f"{to} {self.rows} @ {w}{scale}  ({_dims(self.heads, self.k, self.n)}){_over(self.domain)}"
    )


@dataclasses.dataclass(frozen=True)
class WeightGrad:
  """``dW[r] = sum_e outer(left[e], right[e])`` over relation r's edges; with `heads` > 1 one
  ``[k, n]`` block per head from head h's features of each side."""

  left: Load
  right: Load
  k: int
  n: int
  scales: tuple[Load, ...]
  domain: str = "edge"
  heads: int = 1
  template = "weight_grad"

  def __str__(self):
    scale = "".join(f" * {s}" for s in self.scales)
    return (
      f"out[etype[e]] += outer({self.left}, {self.right}){scale}  "
      f"({_dims(self.heads, self.k, self.n)}){_over(self.domain)}"
    )


SINKS = ("aggregate", "scatter_weight_row", "store", "softmax", "relation", "pair")


@dataclasses.dataclass(frozen=True)
class Traversal:
  """An edge loop over `expr` (`width` features per edge; 0: a scalar) into one of `SINKS`:
  summed into nodes at `end` (aggregate), into ``[R, N, width]`` weight rows, into ``[R, width]``
  relation rows, into the edge's pair's row; stored per edge; or, per feature (head), the
  softmax over the edges that share a node at `end` stored per edge."""

  expr: Expr
  width: int
  sink: str
  end: str = ""  # for aggregate / scatter_weight_row / softmax
  domain: str = "edge"
  template = "traversal"

  def __str__(self):
    to = {
      "aggregate": f"out[{self.end}[e]] +=",
      "store": "out[e] =",
      "scatter_weight_row": f"out[etype[e], {self.end}[e]] +=",
      "softmax": f"out[e] = softmax over {self.end}[e] of",
      "relation": "out[etype[e]] +=",
      "pair": "out[pair[e]] +=",
    }[self.sink]
    return f"{to} {self.expr}{_over(self.domain)}"


@dataclasses.dataclass(frozen=True)
class Dense:
  """Node or weight arrays combined by XLA ops (an unfused fallback: no kernel is generated)."""

  op: str
  fn: str = ""
  param: float = 0.0
  template = "dense"

  def __str__(self):
    return f"{self.op}{'.' + self.fn if self.fn else ''}(in0, in1) on XLA"


Template = Gemm | WeightGrad | Traversal | Dense


@dataclasses.dataclass(eq=False)
class Instance:
  """One kernel to run: a template instance, the values it reads (its slots), what it makes."""

  kernel: Template
  inputs: list[Value]
  output: Value

  def __str__(self):
    ins = ", ".join(f"in{i}={v.label}" for i, v in enumerate(self.inputs))
    return f"{self.output.label} <- {self.kernel.template}: {self.kernel}   [{ins}]"


# ----------------------------------------------------------------------------- lowering
def _active(program: Program, available: frozenset[int]) -> list[Value]:
  """The values the outputs need, in order, stopping at `available` ones (computed elsewhere:
  by the forward pass, for a backward program); those are listed but not their arguments."""
  keep, stack = set(), list(program.outputs.values())
  while stack:
    v = stack.pop()
    if v.id not in keep:
      keep.add(v.id)
      if v.id not in available:
        stack.extend(v.args)
  return [v for v in program.values if v.id in keep]


def materialized(program: Program, available: frozenset[int] = frozenset()) -> set[int]:
  """Ids of the values kernels write to memory (see the module docstring); `available` values
  are in memory already."""
  listed = _active(program, available)
  values = [v for v in listed if v.id not in available]
  users: dict[int, list[Value]] = {}
  for v in values:
    for a in v.args:
      users.setdefault(a.id, []).append(v)
  roots = {v.id for v in program.outputs.values()} | {v.id for v in listed if v.id in available}
  for v in values:
    if v.op in ("input", "weight"):
      continue
    if v.domain in ("node", "weight") or v.op in ("edge_softmax", "compact_sum"):
      roots.add(v.id)
    elif not is_cheap(v) and len(users.get(v.id, ())) > 1:
      roots.add(v.id)
    elif v.op == "linear":
      roots.add(v.id)  # unless fused into an aggregate below
  for v in values:
    if v.op == "aggregate":
      chain, core = _peel_chain(v.args[0])
      if core.op == "linear" and all(len(users[c.id]) == 1 for c in chain + [core]):
        roots.discard(core.id)
        roots.difference_update(c.id for c in chain)
  for v in values:
    if v.op == "expand":
      roots.add(v.args[0].id)
  # A product's row input must be something a kernel can load: a gathered node array, rows of a
  # compact array, or a materialized edge array (after peeling off edge-scalar factors).
  for v in values:
    if v.op == "linear":
      row_inputs = [v.args[0]]
    elif v.op == "weight_grad":
      row_inputs = list(v.args)
    else:
      continue
    for r in row_inputs:
      core, _ = _peel_scales(r, roots)
      if not (core.op in ("gather", "expand") or core.id in roots):
        roots.add(core.id)
  return roots


def _peel_chain(v: Value) -> tuple[list[Value], Value]:
  """Follows muls by edge scalars down to their non-scalar factor: (the muls, the factor)."""
  chain = []
  while v.op == "mul" and v.domain in ROWS and v.shape != ():
    x, y = v.args
    if is_edge_scalar(y):
      chain.append(v)
      v = x
    elif is_edge_scalar(x):
      chain.append(v)
      v = y
    else:
      break
  return chain, v


def _peel_scales(v: Value, roots: set[int]) -> tuple[Value, list[Value]]:
  """(non-scalar factor, cheap edge-scalar factors) of a product not materialized in between."""
  scales = []
  while v.id not in roots and v.op == "mul" and v.domain in ROWS and v.shape != ():
    x, y = v.args
    if is_edge_scalar(y) and is_cheap(y):
      scales.append(y)
      v = x
    elif is_edge_scalar(x) and is_cheap(x):
      scales.append(x)
      v = y
    else:
      break
  return v, scales


def lower(program: Program, available: frozenset[int] = frozenset()) -> list[Instance]:
  """The program's kernel instances, in an order that respects their dependencies; values in
  `available` (ids of arrays the caller provides) are read, not computed."""
  roots = materialized(program, available)
  instances = []
  for v in _active(program, available):
    if v.id in roots and v.op not in ("input", "weight") and v.id not in available:
      instances.append(_Builder(roots).build(v))
  return instances


class _Builder:
  def __init__(self, roots: set[int]):
    self.roots = roots
    self.inputs: list[Value] = []

  def slot(self, v: Value) -> int:
    for i, x in enumerate(self.inputs):
      if x is v:
        return i
    self.inputs.append(v)
    return len(self.inputs) - 1

  def load(self, v: Value) -> Load | None:
    """A Load for v if a kernel reads it directly, else None."""
    w = width(v)
    if v.op == "input" and v.attrs.get("field") == "norm":
      return Load("norm")
    if v.id in self.roots and v.domain in ROWS:
      return Load("edge", self.slot(v), width=w)
    if v.op == "gather":
      (x,) = v.args
      if not (x.op == "input" or x.id in self.roots):
        raise AssertionError(f"hector: gathered {x.label} is not materialized")
      return Load("node", self.slot(x), v.attrs["end"], w)
    if v.op == "weight_row":
      return Load("weight_row", self.slot(v.args[0]), v.attrs["end"], w)
    if v.op == "vector_row":
      return Load("vector", self.slot(v.args[0]), width=w)
    if v.op == "expand":
      (c,) = v.args
      if c.id not in self.roots:
        raise AssertionError(f"hector: compact {c.label} is not materialized")
      return Load("pair", self.slot(c), width=w)
    return None

  def expr(self, v: Value) -> Expr:
    load = self.load(v)
    if load is not None:
      return load
    w = width(v)
    if v.op in ("mul", "add", "unary_grad", "unary"):
      return Op(
        v.op,
        tuple(self.expr(a) for a in v.args),
        v.attrs.get("fn", ""),
        w,
        v.attrs.get("slope", 0.0),
      )
    if v.op == "dot":
      rows, other = v.args
      right = (
        Load("vector", self.slot(other), width=width(rows))
        if other.domain == "weight"
        else self.expr(other)
      )
      return Op("dot", (self.expr(rows), right), width=w)
    raise AssertionError(f"hector: cannot fuse {v!r} into an edge loop")

  def operand(self, v: Value) -> tuple[Load, list[Load]]:
    core, scales = _peel_scales(v, self.roots)
    load = self.load(core)
    assert load is not None and load.kind in ("node", "edge", "pair"), core
    return load, self.scale_loads(scales)

  def scale_loads(self, scales) -> list[Load]:
    """The loads of a fused product's edge scales, each of which must be loadable."""
    loads = []
    for s in scales:
      load = self.load(s)
      if load is None:
        raise AssertionError("hector: a scale of a fused product is not loadable")
      loads.append(load)
    return loads

  def build(self, v: Value) -> Instance:
    kernel = self._build(v)
    return Instance(kernel, self.inputs, v)

  def _build(self, v: Value) -> Template:
    if v.op == "aggregate":
      rows = v.args[0]
      chain, core = _peel_chain(rows)
      if core.op == "linear" and core.id not in self.roots:
        return self._gemm(
          core, [s for c in chain for s in c.args if is_edge_scalar(s)], v.attrs["end"]
        )
      return Traversal(self.expr(rows), width(v), "aggregate", v.attrs["end"], rows.domain)
    if v.op == "weight_grad":
      (left, ls), (right, rs) = self.operand(v.args[0]), self.operand(v.args[1])
      heads, k, n = v.known_shape[1:] if len(v.known_shape) == 4 else (1, *v.known_shape[1:])
      return WeightGrad(left, right, k, n, tuple(ls + rs), v.args[0].domain, heads)
    if v.op == "scatter_weight_row":
      rows = v.args[0]
      return Traversal(
        self.expr(rows), v.known_shape[2], "scatter_weight_row", v.attrs["end"], rows.domain
      )
    if v.op == "relation_sum":
      rows = v.args[0]
      return Traversal(self.expr(rows), width(rows), "relation", "", rows.domain)
    if v.op == "compact_sum":
      return Traversal(self.expr(v.args[0]), width(v), "pair")
    if v.op == "edge_softmax":
      scores = v.args[0]
      return Traversal(self.expr(scores), width(v), "softmax", v.attrs["end"], scores.domain)
    if v.domain in ("node", "weight"):
      for a in v.args:
        self.slot(a)
      return Dense(v.op, v.attrs.get("fn", ""), v.attrs.get("slope", 0.0))
    # a materialized edge (or compact) value
    if v.op == "linear":
      return self._gemm(v, [], "edge")
    self.roots = self.roots - {v.id}  # compute it, do not load it
    try:
      return Traversal(self.expr(v), width(v), "store", "", v.domain)
    finally:
      self.roots = self.roots | {v.id}

  def _gemm(self, lin: Value, scales: list[Value], out: str) -> Gemm:
    rows, row_scales = self.operand(lin.args[0])
    w = lin.args[1]
    t = lin.attrs["transpose"]
    heads, a, b = w.known_shape[1:] if len(w.known_shape) == 4 else (1, *w.known_shape[1:])
    k, n = (b, a) if t else (a, b)
    extra = self.scale_loads(scales)
    return Gemm(rows, self.slot(w), t, k, n, tuple(row_scales + extra), out, lin.domain, heads)
