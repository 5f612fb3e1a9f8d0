"""The front end: write a relational layer as a Python function over graph domains.

    from jaxdata import hector

    @hector.layer(x=hector.NODE, W=hector.RELATION_WEIGHT)
    def rgcn(g, x, W):
      # every edge's message is its source's row times its relation's weight, scaled by the
      # per-relation mean normalizer; each node sums the messages of its incoming edges
      return g.aggregate(g.norm * (g.src(x) @ W))

The function runs once, on symbols, and records an IR `Program` (`rgcn.program`); calling
`rgcn(graph, x=..., W=...)` compiles it (once per shape) and runs the generated kernels.

Attention layers use per-head values: a relation vector ``a`` (`RELATION_VECTOR`, ``[R, H, d]``)
splits an edge row of ``H * d`` features into H heads, ``rows.dot(a)`` gives one score per head
``[E, H]``, `g.edge_softmax` normalizes the scores over each node's incoming edges, and
``alpha * rows`` scales each head's d features by that head's weight:

    @hector.layer(x=hector.NODE, W=hector.RELATION_WEIGHT, a_src=hector.RELATION_VECTOR,
                  a_dst=hector.RELATION_VECTOR)
    def rgat(g, x, W, a_src, a_dst):
      h = g.src(x) @ W
      score = (h.dot(a_src) + (g.dst(x) @ W).dot(a_dst)).leaky_relu(0.2)
      return g.aggregate(g.edge_softmax(score, at="dst") * h)

A relation weight of rank 4, ``[R, H, a, b]``, is per head: ``rows @ W`` multiplies head h's a
features by ``W[r, h]`` (HGT's attention and message matrices), and ``heads=W`` in a dot of two
edge rows means W's H (see `jaxdata.hector.hgt`):

    key = g.src(k) @ W_att
    score = key.dot(g.dst(q), heads=W_att) * g.vector_row(mu)
"""

from __future__ import annotations

from collections.abc import Callable

from jaxdata.hector.compiled import Layer
from jaxdata.hector.ir import ENDS, UNARY, Program, Value

NODE = "node"  #: a node feature array [N, d]
#: a weight per relation [R, d_in, d_out] or [R, N, d_out], or per relation and head
#: [R, H, d_in, d_out] (``rows @ W`` multiplies head h's d_in features by W[r, h])
RELATION_WEIGHT = "relation_weight"
RELATION_VECTOR = "relation_vector"  #: a vector per relation and head [R, H, d] (for `dot`)
KINDS = (NODE, RELATION_WEIGHT, RELATION_VECTOR)


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
    if self.value.domain != "edge" or weight.value.domain != "weight" or _is_vector(weight.value):
      raise TypeError(
        "hector: `rows @ W` needs edge rows and a relation weight (use "
        "`rows.dot(a)` for a relation vector)"
      )
    return Sym(Value("linear", (self.value, weight.value), {"transpose": False}, domain="edge"))

  def dot(self, other, heads: int | Sym | None = None) -> Sym:
    """Per-head dot products of edge rows: one value per edge and head, ``[E, H]``.

    With a relation vector ``a`` (``[R, H, d]``), ``rows.dot(a)[e, h]`` is the dot product of
    head h of the row (its features ``h*d .. h*d+d-1``) with ``a[etype[e], h]``. With other edge
    rows of the same width, `heads` says how many heads the rows hold (None: one scalar per
    edge): a number, or a per-head weight ``[R, H, a, b]`` or relation vector ``[R, H, d]``
    input whose H is meant (read at shape inference, so one traced layer serves any H).
    """
    other = self._lift(other)
    if self.value.domain != "edge":
      raise TypeError("hector: `rows.dot(...)` needs edge rows")
    if other.value.domain == "weight":
      if not _is_vector(other.value):
        raise TypeError("hector: `rows.dot(a)` needs a relation vector (hector.RELATION_VECTOR)")
      if heads is not None:
        raise TypeError("hector: the relation vector's shape [R, H, d] gives the heads")
      return Sym(Value("dot", (self.value, other.value), domain="edge"))
    if other.value.domain != "edge":
      raise TypeError("hector: `rows.dot(other)` needs a relation vector or edge rows")
    if isinstance(heads, Sym):
      if heads.value.op != "weight" or heads.value.name is None:
        raise TypeError("hector: `heads=` takes a number or a weight / relation vector input")
      count: int | str = heads.value.name  # the input whose H is meant, read at shape inference
    else:
      count = int(heads or 0)
    return Sym(Value("dot", (self.value, other.value), {"heads": count}, domain="edge"))

  def _unary(self, fn: str, **attrs) -> Sym:
    return Sym(Value("unary", (self.value,), {"fn": fn, **attrs}, domain=self.value.domain))

  def leaky_relu(self, negative_slope: float = 0.2):
    """``x`` where ``x > 0``, else ``negative_slope * x``."""
    return self._unary("leaky_relu", slope=float(negative_slope))

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
    raise TypeError(
      f"hector: elementwise op mixes {da} and {db} values; gather nodes onto edges "
      "first (g.src(x) / g.dst(x))"
    )
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

  def vector_row(self, vector: Sym) -> Sym:
    """a[etype[e]]: each edge's relation's vector ``[R, H, d]`` as ``H * d`` values per edge (a
    per-(relation, head) scalar when d is 1, e.g. HGT's prior ``mu``)."""
    if not isinstance(vector, Sym) or not _is_vector(vector.value):
      raise TypeError("hector: g.vector_row(a) needs a relation vector (hector.RELATION_VECTOR)")
    return Sym(Value("vector_row", (vector.value,), domain="edge"))

  def aggregate(self, rows: Sym, at: str = "dst") -> Sym:
    """Per node, the sum of the rows of its incoming (`at="dst"`) or outgoing edges."""
    if at not in ENDS:
      raise ValueError(f"at must be one of {ENDS}, got {at!r}")
    if not isinstance(rows, Sym) or rows.value.domain != "edge":
      raise TypeError("hector: g.aggregate needs edge rows")
    return Sym(Value("aggregate", (rows.value,), {"end": at}, domain="node"))

  def edge_softmax(self, scores: Sym, at: str = "dst") -> Sym:
    """Per head, the softmax of edge scores over the edges into each node (`at="dst"`) or out of
    it (`at="src"`): ``exp(s[e]) / sum of exp(s) over the edges sharing e's node``."""
    if at not in ENDS:
      raise ValueError(f"at must be one of {ENDS}, got {at!r}")
    if not isinstance(scores, Sym) or scores.value.domain != "edge":
      raise TypeError("hector: g.edge_softmax needs edge scores")
    return Sym(Value("edge_softmax", (scores.value,), {"end": at}, domain="edge"))


def _is_vector(v: Value) -> bool:
  return v.op == "weight" and v.attrs.get("kind") == "vector"


def trace(fn: Callable, kinds: dict[str, str], name: str | None = None) -> Program:
  """Runs `fn(graph, **symbols)` on symbols and returns the recorded program."""
  for k, kind in kinds.items():
    if kind not in KINDS:
      raise ValueError(f"input {k!r}: kind must be one of {KINDS}, got {kind!r}")
  attrs = {
    NODE: {},
    RELATION_WEIGHT: {"by": "relation"},
    RELATION_VECTOR: {"by": "relation", "kind": "vector"},
  }
  inputs = {
    k: Value(
      "input" if kind == NODE else "weight",
      (),
      dict(attrs[kind]),
      domain="node" if kind == NODE else "weight",
      name=k,
    )
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

  def wrap(fn: Callable) -> Layer:
    return Layer(trace(fn, kinds), kinds)

  return wrap


__all__ = ["NODE", "RELATION_WEIGHT", "RELATION_VECTOR", "Graph", "Sym", "layer", "trace", "UNARY"]
