"""Lowering: a shaped program becomes a list of kernel instances of three templates.

* `Gemm`: per-relation dense products over edge rows. Rows come in gathered from a node array
  (``x[src[e]]``) or from a materialized edge array; the weight is the edge's relation's,
  optionally transposed; per-edge scalars scale the result; rows go out scattered (summed into
  ``out[dst[e]]``) or stored per edge.
* `WeightGrad`: the GEMM template's weight-gradient mode, ``dW[r] = sum_e left[e]^T right[e]``
  over each relation's edges.
* `Traversal`: an edge-parallel loop computing an elementwise expression per edge row (gathers,
  weight rows, graph scalars, +, *, unary functions) and summing it into nodes, into weight rows,
  or storing it.
* `Dense`: what is left on nodes or weights (adding two gradients, say) runs as XLA ops.

A value is *materialized* (a kernel writes it to memory) when it is an output, lives on nodes or
weights, feeds several consumers and is not cheap, or is a relation product that cannot be fused
into its consumer. Cheap values (gathers, weight rows, graph scalars, their products with edge
scalars) are recomputed inside each consumer, so the backward pass never stores the scaled,
gathered cotangent rows it reads twice.
"""
from __future__ import annotations

import dataclasses
from typing import Union

from jaxdata.hector.ir import Program, Value, is_edge_scalar
from jaxdata.hector.passes import is_cheap


# ----------------------------------------------------------------------------- expressions
@dataclasses.dataclass(frozen=True)
class Load:
  """A row (or scalar) an instance reads per edge.

  kind: "node" (slot's node array at the edge's `end`), "edge" (slot's edge array),
  "weight_row" (slot's weight at [etype, end-node]), "norm" (the graph's normalizer).
  """
  kind: str
  slot: int = -1
  end: str = ""
  width: int = 0  # 0: a scalar per edge

  def __str__(self):
    where = {"node": f"[{self.end}[e]]", "edge": "[e]", "weight_row": f"[etype[e], {self.end}[e]]",
             "norm": "[e]"}[self.kind]
    return ("norm" if self.kind == "norm" else f"in{self.slot}") + where


@dataclasses.dataclass(frozen=True)
class Op:
  """An elementwise operation on expressions: mul, add, unary (fn), unary_grad (fn; x, g)."""
  op: str
  args: tuple["Expr", ...]
  fn: str = ""
  width: int = 0

  def __str__(self):
    if self.op in ("mul", "add"):
      return f"({self.args[0]} {'*' if self.op == 'mul' else '+'} {self.args[1]})"
    if self.op == "unary":
      return f"{self.fn}({self.args[0]})"
    return f"{self.fn}_grad({self.args[0]}, {self.args[1]})"


Expr = Union[Load, Op]


# ----------------------------------------------------------------------------- instances
@dataclasses.dataclass(frozen=True)
class Gemm:
  rows: Load          # "node" (gathered) or "edge"
  weight: int         # slot of the relation weight
  transpose: bool
  k: int
  n: int
  scales: tuple[Load, ...]
  out: str            # "src" / "dst" (scatter-add into nodes) or "edge" (store per edge)
  template = "gemm"

  def __str__(self):
    w = f"in{self.weight}[etype[e]]" + (".T" if self.transpose else "")
    scale = "".join(f" * {s}" for s in self.scales)
    to = "out[e]" if self.out == "edge" else f"out[{self.out}[e]] +="
    return f"{to} {self.rows} @ {w}{scale}  ({self.k}x{self.n})"


@dataclasses.dataclass(frozen=True)
class WeightGrad:
  left: Load
  right: Load
  k: int
  n: int
  scales: tuple[Load, ...]
  template = "weight_grad"

  def __str__(self):
    scale = "".join(f" * {s}" for s in self.scales)
    return f"out[etype[e]] += outer({self.left}, {self.right}){scale}  ({self.k}x{self.n})"


@dataclasses.dataclass(frozen=True)
class Traversal:
  expr: Expr
  width: int
  sink: str           # "aggregate", "scatter_weight_row" or "store"
  end: str = ""       # for aggregate / scatter_weight_row
  template = "traversal"

  def __str__(self):
    to = {"aggregate": f"out[{self.end}[e]] +=", "store": "out[e] =",
          "scatter_weight_row": f"out[etype[e], {self.end}[e]] +="}[self.sink]
    return f"{to} {self.expr}"


@dataclasses.dataclass(frozen=True)
class Dense:
  op: str
  fn: str = ""
  template = "dense"

  def __str__(self):
    return f"{self.op}{'.' + self.fn if self.fn else ''}(in0, in1) on XLA"


Template = Union[Gemm, WeightGrad, Traversal, Dense]


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
def materialized(program: Program) -> set[int]:
  """Ids of the values kernels write to memory (see the module docstring)."""
  users = program.users()
  values = program.values
  roots = {v.id for v in program.outputs.values()}
  for v in values:
    if v.op in ("input", "weight"):
      continue
    if v.domain in ("node", "weight"):
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
  # A product's row input must be something a kernel can load: a gathered node array or a
  # materialized edge array (after peeling off edge-scalar factors).
  for v in values:
    if v.op == "linear":
      row_inputs = [v.args[0]]
    elif v.op == "weight_grad":
      row_inputs = list(v.args)
    else:
      continue
    for r in row_inputs:
      core, _ = _peel_scales(r, roots)
      if not (core.op == "gather" or core.id in roots):
        roots.add(core.id)
  return roots


def _peel_chain(v: Value) -> tuple[list[Value], Value]:
  """Follows muls by edge scalars down to their non-scalar factor: (the muls, the factor)."""
  chain = []
  while v.op == "mul" and v.domain == "edge" and v.shape != ():
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
  while v.id not in roots and v.op == "mul" and v.domain == "edge" and v.shape != ():
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


def lower(program: Program) -> list[Instance]:
  """The program's kernel instances, in an order that respects their dependencies."""
  roots = materialized(program)
  instances = []
  for v in program.values:
    if v.id in roots and v.op not in ("input", "weight"):
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
    width = v.shape[0] if v.shape else 0
    if v.op == "input" and v.attrs.get("field") == "norm":
      return Load("norm")
    if v.id in self.roots and v.domain == "edge":
      return Load("edge", self.slot(v), width=width)
    if v.op == "gather":
      (x,) = v.args
      if not (x.op == "input" or x.id in self.roots):
        raise AssertionError(f"hector: gathered {x.label} is not materialized")
      return Load("node", self.slot(x), v.attrs["end"], width)
    if v.op == "weight_row":
      return Load("weight_row", self.slot(v.args[0]), v.attrs["end"], width)
    return None

  def expr(self, v: Value) -> Expr:
    load = self.load(v)
    if load is not None:
      return load
    width = v.shape[0] if v.shape else 0
    if v.op in ("mul", "add", "unary_grad"):
      return Op(v.op, tuple(self.expr(a) for a in v.args), v.attrs.get("fn", ""), width)
    if v.op == "unary":
      return Op("unary", (self.expr(v.args[0]),), v.attrs["fn"], width)
    raise AssertionError(f"hector: cannot fuse {v!r} into an edge loop")

  def operand(self, v: Value) -> tuple[Load, list[Load]]:
    core, scales = _peel_scales(v, self.roots)
    load = self.load(core)
    assert load is not None and load.kind in ("node", "edge"), core
    return load, [self.load(s) for s in scales]

  def build(self, v: Value) -> Instance:
    kernel = self._build(v)
    return Instance(kernel, self.inputs, v)

  def _build(self, v: Value) -> Template:
    if v.op == "aggregate":
      chain, core = _peel_chain(v.args[0])
      if core.op == "linear" and core.id not in self.roots:
        return self._gemm(core, [s for c in chain for s in c.args if is_edge_scalar(s)],
                          v.attrs["end"])
      return Traversal(self.expr(v.args[0]), v.shape[0], "aggregate", v.attrs["end"])
    if v.op == "weight_grad":
      (left, ls), (right, rs) = self.operand(v.args[0]), self.operand(v.args[1])
      return WeightGrad(left, right, v.shape[1], v.shape[2], tuple(ls + rs))
    if v.op == "scatter_weight_row":
      return Traversal(self.expr(v.args[0]), v.shape[2], "scatter_weight_row", v.attrs["end"])
    if v.domain in ("node", "weight"):
      for a in v.args:
        self.slot(a)
      return Dense(v.op, v.attrs.get("fn", ""))
    # a materialized edge value
    if v.op == "linear":
      return self._gemm(v, [], "edge")
    self.roots = self.roots - {v.id}  # compute it, do not load it
    try:
      return Traversal(self.expr(v), v.shape[0] if v.shape else 0, "store")
    finally:
      self.roots = self.roots | {v.id}

  def _gemm(self, lin: Value, scales: list[Value], out: str) -> Gemm:
    rows, row_scales = self.operand(lin.args[0])
    w = lin.args[1]
    t = lin.attrs["transpose"]
    k, n = (w.shape[2], w.shape[1]) if t else (w.shape[1], w.shape[2])
    extra = [self.load(s) for s in scales]
    if any(e is None for e in extra):
      raise AssertionError("hector: a scale of a fused product is not loadable")
    return Gemm(rows, self.slot(w), t, k, n, tuple(row_scales + extra), out)
