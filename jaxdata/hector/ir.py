"""Hector's inter-operator IR: values over typed graph domains, and the programs they form.

A program is a DAG of `Value`s in topological order. Every value lives on a *domain*:

* ``node``: one row per node, ``[N, *feature]``;
* ``edge``: one row per edge, ``[E, *feature]`` (edges are sorted by relation, so "per edge" and
  "per relation segment" are the same loop);
* ``compact``: one row per unique (source node, relation) pair, ``[P, *feature]``: where compact
  materialization puts edge values that depend only on the edge's source and relation;
* ``weight``: a parameter tensor, typed by relation when ``by == "relation"``.

The feature shape of a node, edge or compact value is ``()`` for a scalar per row and ``(d,)``
for a vector. Attention has several heads: a row of ``H * d`` features is H heads of d features
whenever it meets a per-head value of shape ``(H,)`` (``mul`` broadcasts each head's scalar over
its d features; ``dot`` sums each head's d products). Operators (the ``op`` field) are few and
typed:

=====================  =====================================================================
``input``              a node feature array, or an edge scalar the graph provides (``norm``)
``weight``             a relation-typed weight: ``[R, d_in, d_out]`` (``linear``), a per-head
                       one ``[R, H, d_in, d_out]`` (``linear`` head by head: a block-diagonal
                       product never formed), ``[R, N, d_out]`` (``weight_row``, a featureless
                       embedding per relation), or a relation vector ``[R, H, d]``
                       (``kind="vector"``, for ``dot`` and ``vector_row``)
``gather``             node -> edge: the row of the edge's ``src`` or ``dst`` node
``linear``             edge rows times the edge's relation weight (optionally transposed); with
                       a per-head weight, head h's features times ``W[r, h]``
``weight_row``         the row ``W[etype[e], src[e]]`` (one-hot input times a typed weight)
``vector_row``         the edge's relation's vector ``a[etype[e]]``, flattened to ``H * d``
``mul`` / ``add``      elementwise; an edge scalar broadcasts over an edge row, a per-head
                       value over its head's features
``dot``                per-head dot product: rows ``(H*d,)`` with the edge's relation vector
                       ``[R, H, d]`` or with other rows (``heads`` attribute: H, or the name of
                       a per-head weight or vector input whose H shape inference reads) -> ``(H,)``
``unary``              elementwise function (``relu``, ``exp``, ``leaky_relu`` with ``slope``...)
``unary_grad``         ``g * f'(x)`` for a unary ``f`` (made by differentiation)
``edge_softmax``       per head, softmax over the edges that share a ``dst`` (or ``src``) node
``aggregate``          edge -> node: sum of the rows of the edges at each ``dst`` (or ``src``)
``weight_grad``        sum over each relation's edges of ``outer(left, right)`` -> ``[R, a, b]``
``scatter_weight_row`` edge rows summed into ``[R, N, d]`` at ``(etype, src|dst)``
``relation_sum``       edge rows summed per relation -> a relation vector's shape ``[R, H, d]``
``expand``             compact -> edge: the row of the edge's (src, relation) pair
``compact_sum``        edge -> compact: per pair, the sum of the rows of its edges
``fold``               ``W[R, k, H*d]`` and ``a[R, H, d]`` -> ``(W a)[R, k, H]`` (reordering)
``fold_grad_weight``   the fold's gradients (made by differentiation): ``ct[R, k, H]``, ``a`` ->
``fold_grad_vector``   ``W``'s shape; ``ct``, ``W`` -> ``a``'s shape
``head_scale``         a per-head ``W[R, H, a, b]`` times ``m[R, H, 1]``, block by block: a
                       per-(relation, head) scale folded into the weight (reordering)
``head_scale_grad``    its gradient in ``m`` (made by differentiation): ``ct``, ``W`` -> ``m``'s
                       shape
=====================  =====================================================================

`print(program)` shows the program one value per line; `jaxdata.hector.show` prints it before and
after each pass and the generated source.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

DOMAINS = ("node", "edge", "compact", "weight")
ROWS = ("edge", "compact")  #: domains whose values kernels compute row by row in edge loops
ENDS = ("src", "dst")
UNARY = ("relu", "exp", "tanh", "sigmoid", "neg", "leaky_relu")

_ids = itertools.count()


@dataclasses.dataclass(eq=False)
class Value:
  """One IR value: an operator applied to earlier values.

  `shape` is the feature shape for node and edge values and the full shape for weights; it is
  None until shape inference fills it in.
  """

  op: str
  args: tuple[Value, ...] = ()
  attrs: dict[str, Any] = dataclasses.field(default_factory=dict)
  domain: str = "edge"
  shape: tuple[int, ...] | None = None
  name: str | None = None
  id: int = dataclasses.field(default_factory=lambda: next(_ids))

  def __post_init__(self):
    if self.domain not in DOMAINS:
      raise ValueError(f"domain must be one of {DOMAINS}, got {self.domain!r}")

  @property
  def label(self) -> str:
    return self.name or f"%{self.id}"

  @property
  def known_shape(self) -> tuple[int, ...]:
    """`shape`, for code that runs after shape inference (which gives every value one)."""
    assert self.shape is not None, f"hector: {self.label} read before shape inference"
    return self.shape

  def __repr__(self) -> str:
    attrs = "".join(f", {k}={v}" for k, v in sorted(self.attrs.items()))
    args = ", ".join(a.label for a in self.args)
    shape = "?" if self.shape is None else "x".join(map(str, self.shape)) or "scalar"
    return f"{self.label}: {self.domain}[{shape}] = {self.op}({args}{attrs})"


@dataclasses.dataclass(eq=False)
class Program:
  """A DAG of values with named inputs and outputs, in topological order."""

  inputs: dict[str, Value]
  outputs: dict[str, Value]
  name: str = "program"

  @property
  def values(self) -> list[Value]:
    """Every value the outputs depend on, each after its arguments."""
    order, seen = [], set()

    def visit(v: Value):
      stack = [(v, False)]
      while stack:
        node, done = stack.pop()
        if done:
          order.append(node)
          continue
        if node.id in seen:
          continue
        seen.add(node.id)
        stack.append((node, True))
        stack.extend((a, False) for a in reversed(node.args) if a.id not in seen)

    for v in self.outputs.values():
      visit(v)
    return order

  def users(self) -> dict[int, list[Value]]:
    """{value id: the values that take it as an argument}."""
    out: dict[int, list[Value]] = {}
    for v in self.values:
      for a in v.args:
        out.setdefault(a.id, []).append(v)
    return out

  def __str__(self) -> str:
    lines = [
      f"program {self.name}(" + ", ".join(f"{k}: {v.domain}" for k, v in self.inputs.items()) + ")"
    ]
    lines += [f"  {v!r}" for v in self.values if v.op not in ("input", "weight")]
    lines.append("  return " + ", ".join(f"{k}={v.label}" for k, v in self.outputs.items()))
    return "\n".join(lines)


def is_edge_scalar(v: Value) -> bool:
  return v.domain in ROWS and v.shape == ()


def width(v: Value) -> int:
  """Features per row of a node, edge or compact value (0: a scalar per row)."""
  return v.shape[0] if v.shape else 0


def is_constant(v: Value) -> bool:
  """Graph data (the normalizer): an input no gradient flows to."""
  return v.op == "input" and v.attrs.get("field") is not None


def is_cheap(v: Value) -> bool:
  """Whether a value is recomputed inside each consumer rather than materialized: gathers,
  weight and vector rows, rows of a compact value, graph scalars and their products with edge
  scalars cost a load, not a kernel."""
  if v.op in ("gather", "weight_row", "vector_row", "expand"):
    return True
  if v.op == "input" and v.domain == "edge":
    return True
  if v.op == "mul" and v.domain in ROWS:
    x, y = v.args
    return (is_edge_scalar(x) and is_cheap(x) and is_cheap(y)) or (
      is_edge_scalar(y) and is_cheap(y) and is_cheap(x)
    )
  return False
