"""The front end: write a relational layer as a Python function over graph domains.

    from jaxdata import hector

    @hector.layer(x=hector.NODE, W=hector.RELATION_WEIGHT)
    def rgcn(g, x, W):
      # every edge's message is its source's row times its relation's weight, scaled by the
      # per-relation mean normalizer; each node sums the messages of its incoming edges
      return g.aggregate(g.norm * (g.src(x) @ W))

The function runs once, on symbols, and records an IR `Program` (`rgcn.program`); calling
`rgcn(graph, x=..., W=...)` compiles it (once per shape) and runs the generated kernels.
"""
from __future__ import annotations

from typing import Callable

from jaxdata.hector.ir import ENDS, UNARY, Program, Value

NODE = "node"                      #: a node feature array [N, d]
RELATION_WEIGHT = "relation_weight"  #: a weight per relation [R, d_in, d_out] or [R, N, d_out]
KINDS = (NODE, RELATION_WEIGHT)


class Sym:
  """A symbolic value while a layer function is traced (wraps an IR `Value`)."""

  def __init__(self, value: Value):
    self.value = value

  def _lift(self, other) -> Sym:
    if not isinstance(other, Sym):
      raise TypeError(f"hector: cannot combine a symbolic value with {type(other).__name__}")
    return other

  def __mul__(self, other):
    return Sym(Value("mul", (self.value, self._lift(other).value), domain=_join(self, other)))

  __rmul__ = __mul__

  def __add__(self, other):
    return Sym(Value("add", (self.value, self._lift(other).value), domain=_join(self, other)))

  __radd__ = __add__

  def __matmul__(self, weight):
    weight = self._lift(weight)
    if self.value.domain != "edge" or weight.value.domain != "weight":
      raise TypeError("hector: `rows @ W` needs edge rows and a relation weight")
    return Sym(Value("linear", (self.value, weight.value), {"transpose": False}, domain="edge"))

  def _unary(self, fn: str) -> Sym:
    return Sym(Value("unary", (self.value,), {"fn": fn}, domain=self.value.domain))

  def relu(self):
    return self._unary("relu")

  def exp(self):
    return self._unary("exp")

  def tanh(self):
    return self._unary("tanh")

  def sigmoid(self):
    return self._unary("sigmoid")

  def __neg__(self):
    return self._unary("neg")


def _join(a: Sym, b) -> str:
  if not isinstance(b, Sym):
    raise TypeError(f"hector: cannot combine a symbolic value with {type(b).__name__}")
  da, db = a.value.domain, b.value.domain
  if da != db:
    raise TypeError(f"hector: elementwise op mixes {da} and {db} values; gather nodes onto edges "
                    "first (g.src(x) / g.dst(x))")
  return da


class Graph:
  """The graph handle a layer function receives: gathers, the normalizer, aggregation."""

  def __init__(self):
    self._norm = Value("input", (), {"field": "norm"}, domain="edge", shape=(), name="norm")

  @property
  def norm(self) -> Sym:
    """Per edge, 1 / (edges of the same relation into the same node): the RGCN mean."""
    return Sym(self._norm)

  def src(self, x: Sym) -> Sym:
    """Each edge's source-node row of x."""
    return self._gather(x, "src")

  def dst(self, x: Sym) -> Sym:
    """Each edge's destination-node row of x."""
    return self._gather(x, "dst")

  def _gather(self, x: Sym, end: str) -> Sym:
    if not isinstance(x, Sym) or x.value.domain != "node":
      raise TypeError(f"hector: g.{end}(x) needs a node value")
    return Sym(Value("gather", (x.value,), {"end": end}, domain="edge"))

  def weight_row(self, weight: Sym, end: str = "src") -> Sym:
    """W[etype[e], src[e]]: a featureless input (one-hot node ids) times a relation weight."""
    if end not in ENDS:
      raise ValueError(f"end must be one of {ENDS}, got {end!r}")
    if not isinstance(weight, Sym) or weight.value.domain != "weight":
      raise TypeError("hector: g.weight_row(W) needs a relation weight")
    return Sym(Value("weight_row", (weight.value,), {"end": end}, domain="edge"))

  def aggregate(self, rows: Sym, at: str = "dst") -> Sym:
    """Per node, the sum of the rows of its incoming (`at="dst"`) or outgoing edges."""
    if at not in ENDS:
      raise ValueError(f"at must be one of {ENDS}, got {at!r}")
    if not isinstance(rows, Sym) or rows.value.domain != "edge":
      raise TypeError("hector: g.aggregate needs edge rows")
    return Sym(Value("aggregate", (rows.value,), {"end": at}, domain="node"))


def trace(fn: Callable, kinds: dict[str, str], name: str | None = None) -> Program:
  """Runs `fn(graph, **symbols)` on symbols and returns the recorded program."""
  for k, kind in kinds.items():
    if kind not in KINDS:
      raise ValueError(f"input {k!r}: kind must be one of {KINDS}, got {kind!r}")
  inputs = {
      k: Value("input" if kind == NODE else "weight", (), {"by": "relation"} if kind != NODE else {},
               domain="node" if kind == NODE else "weight", name=k)
      for k, kind in kinds.items()
  }
  result = fn(Graph(), **{k: Sym(v) for k, v in inputs.items()})
  outs = result if isinstance(result, dict) else {"out": result}
  for k, s in outs.items():
    if not isinstance(s, Sym):
      raise TypeError(f"hector: output {k!r} is {type(s).__name__}, not a symbolic value")
    if s.value.domain != "node":
      raise TypeError(f"hector: output {k!r} must be a node value (aggregate the edge rows)")
  return Program(inputs, {k: s.value for k, s in outs.items()}, name or fn.__name__)


def layer(**kinds: str):
  """Decorator: turns a layer function into a compiled, differentiable `hector.Layer`."""
  from jaxdata.hector.compiled import Layer  # the runtime; the front end itself needs no JAX

  def wrap(fn: Callable) -> Layer:
    return Layer(trace(fn, kinds), kinds)

  return wrap


__all__ = ["NODE", "RELATION_WEIGHT", "Graph", "Sym", "layer", "trace", "UNARY"]
