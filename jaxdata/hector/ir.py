"""Hector's inter-operator IR: values over typed graph domains, and the programs they form.

A program is a DAG of `Value`s in topological order. Every value lives on a *domain*:

* ``node``: one row per node, ``[N, *feature]``;
* ``edge``: one row per edge, ``[E, *feature]`` (edges are sorted by relation, so "per edge" and
  "per relation segment" are the same loop);
* ``weight``: a parameter tensor, typed by relation when ``by == "relation"``.

The feature shape of a node or edge value is ``()`` for a scalar per row and ``(d,)`` for a
vector. Operators (the ``op`` field) are few and typed:

=====================  =====================================================================
``input``              a node feature array, or an edge scalar the graph provides (``norm``)
``weight``             a relation-typed weight: ``[R, d_in, d_out]`` (``linear``) or
                       ``[R, N, d_out]`` (``weight_row``, a featureless embedding per relation)
``gather``             node -> edge: the row of the edge's ``src`` or ``dst`` node
``linear``             edge rows times the edge's relation weight (optionally transposed)
``weight_row``         the row ``W[etype[e], src[e]]`` (one-hot input times a typed weight)
``mul`` / ``add``      elementwise; an edge scalar broadcasts over an edge row
``unary``              elementwise function (``relu``, ``exp``, ...)
``unary_grad``         ``g * f'(x)`` for a unary ``f`` (made by differentiation)
``aggregate``          edge -> node: sum of the rows of the edges at each ``dst`` (or ``src``)
``weight_grad``        sum over each relation's edges of ``outer(left, right)`` -> ``[R, a, b]``
``scatter_weight_row`` edge rows summed into ``[R, N, d]`` at ``(etype, src|dst)``
=====================  =====================================================================

`print(program)` shows the program one value per line; `jaxdata.hector.show` prints it before and
after each pass and the generated source.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any

DOMAINS = ("node", "edge", "weight")
ENDS = ("src", "dst")
UNARY = ("relu", "exp", "tanh", "sigmoid", "neg")

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
    lines = [f"program {self.name}("
             + ", ".join(f"{k}: {v.domain}" for k, v in self.inputs.items()) + ")"]
    lines += [f"  {v!r}" for v in self.values if v.op not in ("input", "weight")]
    lines.append("  return " + ", ".join(f"{k}={v.label}" for k, v in self.outputs.items()))
    return "\n".join(lines)


def is_edge_scalar(v: Value) -> bool:
  return v.domain == "edge" and v.shape == ()
