"""Passes on the IR: specialization to shapes, shape inference, linear-operator reordering,
compact materialization, differentiation.

Each pass takes a program and returns a new one (values are never shared between specializations),
so a layer traced once can be compiled for many shapes. The two optimizing passes can be switched
off (`PASSES`, the ``passes=`` argument of a layer), so their effect can be measured:

* ``"reorder"`` (linear-operator reordering): a per-head dot product of a relation product with a
  relation vector, ``a_r . (x @ W_r)``, becomes ``x @ (W_r a_r)`` when the product is used only
  there: the ``[R, k, H]`` weight-vector product is folded first, so the edge loop reads H
  values per edge instead of materializing ``H * d``. A product dotted with other edge rows
  moves to the source side (``q[dst] . (k[src] W_r)``, which compaction shares per pair) and a
  per-(relation, head) scale of that dot folds into the weight (HGT's prior).
* ``"compact"`` (compact materialization): an edge value that depends only on the edge's
  (source node, relation) pair and costs more than a load (``x[src] @ W_r``, ``a_r . that``) is
  computed once per unique pair, on the ``compact`` domain, and edges read it through the
  graph's edge -> pair map (``expand``).

Reordering runs before compaction, and both before differentiation, so the backward program is
derived from the optimized forward one (its weight gradients, too, run over unique pairs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from jaxdata.hector.ir import ROWS, Program, Value, is_cheap, is_constant, width
from jaxdata.hector.lowering import materialized

PASSES = ("reorder", "compact")  #: the passes that can be switched off, in the order they run

__all__ = [
  "PASSES",
  "select",
  "clone",
  "infer_shapes",
  "reorder",
  "compact",
  "compacts_fused_products",
  "differentiate",
  "rewrite",
  "is_cheap",
]


def select(passes: Iterable[str] | None) -> tuple[str, ...]:
  """The optimizing passes to run, validated, in `PASSES` order (None: all of them)."""
  if passes is None:
    return PASSES
  if isinstance(passes, str):
    passes = (passes,)
  chosen = set(passes)
  unknown = chosen - set(PASSES)
  if unknown:
    raise ValueError(f"hector: unknown passes {sorted(unknown)}; choose from {PASSES}")
  return tuple(p for p in PASSES if p in chosen)


def clone(program: Program) -> Program:
  """A deep copy of the program's values (shapes included)."""
  copies: dict[int, Value] = {}
  for v in program.values + list(program.inputs.values()):
    if v.id not in copies:
      copies[v.id] = Value(
        v.op, tuple(copies[a.id] for a in v.args), dict(v.attrs), v.domain, v.shape, v.name
      )
  return Program(
    {k: copies[v.id] for k, v in program.inputs.items()},
    {k: copies[v.id] for k, v in program.outputs.items()},
    program.name,
  )


def rewrite(program: Program, fn: Callable[[Value, Value], Value]) -> Program:
  """A new program: every value that is not an input is rebuilt from its rewritten arguments and
  handed to ``fn(new, old)``, which returns it or its replacement (`old` is the value in
  `program`, for looking up facts computed on it)."""
  new: dict[int, Value] = {}
  for v in program.values:
    if v.op in ("input", "weight"):
      new[v.id] = v
      continue
    copy = Value(v.op, tuple(new[a.id] for a in v.args), dict(v.attrs), v.domain, v.shape, v.name)
    new[v.id] = fn(copy, v)
  return Program(program.inputs, {k: new[v.id] for k, v in program.outputs.items()}, program.name)


# ----------------------------------------------------------------------------- shapes
def infer_shapes(
  program: Program, shapes: dict[str, tuple[int, ...]], num_nodes: int, num_relations: int
) -> Program:
  """Fills in every value's shape from the inputs' array shapes; raises ValueError on a mismatch.

  `shapes` maps each input name to its full array shape (``[N, d]`` for node inputs, the weight's
  shape for weights, ``[R, H, d]`` for relation vectors).
  """
  for k, v in program.inputs.items():
    if k not in shapes:
      raise ValueError(f"hector: no value given for input {k!r}")
    s = tuple(shapes[k])
    if v.domain == "node":
      if len(s) != 2 or s[0] != num_nodes:
        raise ValueError(f"hector: input {k!r} must be [num_nodes={num_nodes}, d], got {s}")
      v.shape = s[1:]
    else:
      what = "vector" if v.attrs.get("kind") == "vector" else "weight"
      dims = "H, d" if what == "vector" else "a, b] or [..., H, a, b"
      ranks = (3,) if what == "vector" else (3, 4)
      if len(s) not in ranks or s[0] != num_relations:
        raise ValueError(
          f"hector: {what} {k!r} must be [num_relations={num_relations}, {dims}], got {s}"
        )
      v.shape = s
  for v in program.values:
    if v.op == "dot" and isinstance(v.attrs.get("heads"), str):
      v.attrs["heads"] = _heads_of(program.inputs[v.attrs["heads"]])
    v.shape = _shape(v, num_nodes, num_relations) if v.op not in ("input", "weight") else v.shape
  return program


def _heads_of(w: Value) -> int:
  """H of a per-head weight [R, H, a, b] or a relation vector [R, H, d] (`dot`'s heads=W)."""
  if len(w.known_shape) == 4 or w.attrs.get("kind") == "vector":
    return w.known_shape[1]
  raise ValueError(
    f"hector: heads={w.name} needs a per-head weight [R, H, a, b] or a relation "
    f"vector [R, H, d], got a weight of shape {w.shape}"
  )


def per_head(w: Value) -> bool:
  """Whether a relation weight is per head, [R, H, a, b]."""
  return len(w.known_shape) == 4


def _broadcast(v: Value, a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
  """The shape of an elementwise op: equal shapes, a scalar per row, or a per-head value (H,)
  against rows of H * d features."""
  if a == b or b == ():
    return a
  if a == ():
    return b
  if len(a) == len(b) == 1 and max(a[0], b[0]) % min(a[0], b[0]) == 0:
    return (max(a[0], b[0]),)
  raise ValueError(
    f"hector: {v.label}: {v.op} of shapes {a} and {b} (a per-head value of H "
    "entries combines with rows of H * d features)"
  )


def _input_of(v: Value) -> str | None:
  """The name of the input whose rows `v` carries unchanged in width (through gathers to edges
  and the like), or None."""
  while v.op in ("gather", "expand", "aggregate", "compact_sum"):
    v = v.args[0]
  return v.name if v.op in ("input", "weight") else None


def _shape(v: Value, n: int, r: int) -> tuple[int, ...]:
  a = [x.known_shape for x in v.args]
  if v.op in ("gather", "aggregate", "unary", "expand", "compact_sum"):
    return a[0]
  if v.op == "edge_softmax":
    if len(a[0]) > 1:
      raise ValueError(f"hector: edge_softmax needs one score per edge or per head, got {a[0]}")
    return a[0]
  if v.op == "unary_grad":
    return a[1]
  if v.op == "linear":
    w = a[1]
    heads, w2 = (w[1], w[2:]) if len(w) == 4 else (1, w[1:])
    k, m = (w2[1], w2[0]) if v.attrs["transpose"] else (w2[0], w2[1])
    if a[0] != (heads * k,):
      source, weight = _input_of(v.args[0]), _input_of(v.args[1])
      if source is not None:  # name the arguments the user passed, not IR values
        raise ValueError(
          f"hector: input {source!r} has rows of shape {a[0]}, but weight "
          f"{weight or v.args[1].label!r} of shape {w} needs rows of {heads * k} features"
        )
      raise ValueError(
        f"hector: {v.label}: rows of shape {a[0]} times a weight {w}"
        + (" (transposed)" if v.attrs["transpose"] else "")
        + (f" (per head: rows of {heads} x {k} features)" if len(w) == 4 else "")
      )
    return (heads * m,)
  if v.op == "head_scale":
    w, m = a
    if len(w) != 4 or m[1:] != (w[1], 1):
      raise ValueError(
        f"hector: head_scale of a weight {w} by {m} (needs [R, H, a, b] and [R, H, 1])"
      )
    return w
  if v.op == "weight_row":
    if len(a[0]) != 3:
      raise ValueError(f"hector: weight_row needs a [R, N, d] weight, got {a[0]}")
    if a[0][1] != n:
      raise ValueError(f"hector: weight_row needs a [R, num_nodes={n}, d] weight, got {a[0]}")
    return (a[0][2],)
  if v.op == "vector_row":
    return (a[0][1] * a[0][2],)
  if v.op in ("mul", "add"):
    return _broadcast(v, a[0], a[1])
  if v.op == "dot":
    if v.args[1].domain == "weight":
      vec = a[1]
      if a[0] != (vec[1] * vec[2],):
        raise ValueError(
          f"hector: {v.label}: rows of shape {a[0]} dotted with a relation vector "
          f"{vec} (a vector [R, H, d] needs rows of H * d features)"
        )
      return (vec[1],)
    heads = v.attrs.get("heads", 0)
    if a[0] != a[1] or len(a[0]) != 1 or (heads and a[0][0] % heads):
      raise ValueError(f"hector: {v.label}: dot of rows {a[0]} and {a[1]} in {heads} heads")
    return (heads,) if heads else ()
  if v.op == "fold":
    w, vec = a
    if len(w) != 3 or w[2] != vec[1] * vec[2]:
      raise ValueError(f"hector: fold of a weight {w} with a relation vector {vec}")
    return (r, w[1], vec[1])
  if v.op == "weight_grad":
    if v.shape is not None:
      return v.shape  # made by differentiation: the weight's shape (per head or not)
    return (r, a[0][0], a[1][0])
  if v.op == "scatter_weight_row":
    return (r, n, a[0][0])
  if (
    v.op in ("relation_sum", "fold_grad_weight", "fold_grad_vector", "head_scale_grad")
    and v.shape is not None
  ):
    return v.shape  # made by differentiation, which knows the shape
  raise ValueError(f"hector: no shape rule for {v.op}")


# ----------------------------------------------------------------------------- reordering
def reorder(program: Program) -> Program:
  """Linear-operator reordering: three rewrites of relation products inside dot products.

  * **fold a relation vector** (RGAT): ``dot(rows @ W, a)`` -> ``rows @ fold(W, a)``. Per head
    h, ``a[r, h] . (x @ W[r])[h*d : h*d+d] = x @ (W[r][:, h*d : h*d+d] a[r, h])``: each row is
    multiplied by a ``[k, H]`` matrix folded once per relation instead of materializing the
    ``[E, H * d]`` product. Applied where the product feeds only that dot (when it is also
    needed on its own, computing it once and dotting it is cheaper).
  * **move a product to the source side** (``dot(x[dst] @ W, y[src])`` ->
    ``dot(x[dst], y[src] @ W.T)``, per head for a per-head weight): both cost one GEMM row per
    edge, but the source-side product depends only on the edge's (source, relation), so compact
    materialization then computes it once per unique pair. HGT's ``(k W_att) . q`` is already
    written that way; ``k . (q W_att.T)`` becomes it.
  * **fold a per-(relation, head) scale into the weight** (HGT's prior):
    ``dot(rows @ W, other, heads=H) * a[etype]`` with ``a`` ``[R, H, 1]`` ->
    ``dot(rows @ head_scale(W, a), other)``: ``R * H`` weight blocks scaled once on XLA instead
    of a multiply per edge and head, and the scale's gradient is a weight-level reduction
    instead of a sum over every edge.
  """
  users = program.users()
  olds: dict[int, Value] = {}  # a rewritten value's id -> the value it stands for

  def single_use(v: Value) -> bool:
    old = olds.get(v.id)
    return old is None or len(users.get(old.id, ())) == 1  # values made here have one user

  def fn(new: Value, old: Value) -> Value:
    out = (
      _fold_vector(new, old, users)
      or _to_source(new, single_use)
      or _fold_scale(new, single_use)
      or new
    )
    olds[out.id] = old
    return out

  return rewrite(program, fn)


def _fold_vector(new: Value, old: Value, users) -> Value | None:
  if new.op != "dot" or new.args[1].domain != "weight":
    return None
  lin, vec = new.args
  if lin.op != "linear" or lin.attrs["transpose"] or len(users[old.args[0].id]) != 1:
    return None
  rows, w = lin.args
  if per_head(w):
    return None
  folded = Value(
    "fold", (w, vec), {}, "weight", (w.known_shape[0], w.known_shape[1], vec.known_shape[1])
  )
  return Value("linear", (rows, folded), {"transpose": False}, new.domain, new.shape)


def _source_side(v: Value) -> bool:
  """Whether an edge value depends only on the edge's source and relation (before compaction:
  no `expand` yet)."""
  if v.domain == "weight":
    return True
  if v.domain != "edge":
    return False
  if v.op in ("gather", "weight_row"):
    return v.attrs["end"] == "src"
  if v.op == "vector_row":
    return True
  if v.op in ("linear", "dot", "unary", "mul", "add"):
    return all(_source_side(a) for a in v.args)
  return False


def _to_source(new: Value, single_use) -> Value | None:
  if new.op != "dot" or new.args[1].domain == "weight":
    return None
  heads = new.attrs.get("heads", 0)
  for lin, other in (new.args, new.args[::-1]):
    if lin.op != "linear" or other.op == "linear" or not single_use(lin):
      continue
    rows, w = lin.args
    if _source_side(rows) or not _source_side(other):
      continue
    if not (w.known_shape[1] == heads if per_head(w) else heads <= 1):
      continue  # a product of whole rows under a per-head dot does not move head by head
    moved = Value(
      "linear", (other, w), {"transpose": not lin.attrs["transpose"]}, other.domain, rows.shape
    )
    return Value("dot", (rows, moved), dict(new.attrs), new.domain, new.shape)
  return None


def _fold_scale(new: Value, single_use) -> Value | None:
  if new.op != "mul" or new.domain not in ROWS:
    return None
  for dot, scale in (new.args, new.args[::-1]):
    if dot.op != "dot" or dot.args[1].domain == "weight" or scale.op != "vector_row":
      continue
    (m,) = scale.args
    heads = dot.attrs.get("heads", 0)
    if not heads or m.known_shape[1:] != (heads, 1) or not single_use(dot):
      continue
    for i, lin in enumerate(dot.args):
      if lin.op != "linear" or not single_use(lin):
        continue
      w = lin.args[1]
      if not per_head(w) or w.known_shape[1] != heads:
        continue
      scaled = Value("head_scale", (w, m), {}, "weight", w.shape)
      args = list(dot.args)
      args[i] = Value("linear", (lin.args[0], scaled), dict(lin.attrs), lin.domain, lin.shape)
      return Value("dot", tuple(args), dict(dot.attrs), new.domain, new.shape)
  return None


# ----------------------------------------------------------------------------- compaction
def _pairwise(v: Value, known: dict[int, bool]) -> bool:
  """Whether an edge value depends only on its edge's (source node, relation)."""
  if v.domain != "edge":
    return False
  if v.op == "gather" or v.op == "weight_row":
    return v.attrs["end"] == "src"
  if v.op in ("vector_row", "expand"):
    return True
  if v.op in ("linear", "dot", "unary", "unary_grad", "mul", "add"):
    return all(known[a.id] if a.domain in ROWS else a.domain == "weight" for a in v.args)
  return False


#: A graph with at least this many edges per unique (source, relation) pair compacts the
#: relation products that a GEMM would otherwise sum straight into nodes (`compact`).
FUSED_PRODUCT_EDGES_PER_PAIR = 4.0


def compacts_fused_products(num_edges: int, num_pairs: int) -> bool:
  """Whether `compact` moves fused relation products (RGCN's) onto pairs for this graph.

  Fused, the product costs a GEMM row per edge in one kernel; compacted, a GEMM row per pair,
  the pairs' rows written and read back, and a second kernel: an edge loop that sums them into
  nodes (a load per feature, no multiply). Hub sources (power-law graphs: a few nodes own most
  edges) give many edges per pair; the bench's zipf-1.8 graph has 6.7, and fused, its hub rows
  are read by every CTA at once (compacted, its RGCN step ran 5.5x faster at dim 64 on an
  H200). A uniform graph has about one (the bench's 1.15), the RDF graphs about two (AIFB 2.2,
  MUTAG 1.9): there the rows saved would hardly pay for the second kernel and its round trip,
  so they stay fused. The threshold between is a choice, not yet placed by a sweep. Mini-batch
  blocks (`hector.block`) pad their pairs to one per edge and never compact; destination
  partitions (`hector.partition`) decide from their padded sizes, the largest part's edges over
  the largest part's pairs."""
  return num_pairs > 0 and num_edges >= FUSED_PRODUCT_EDGES_PER_PAIR * num_pairs


def compact(program: Program, fused_products: bool = False) -> Program:
  """Compact materialization: pairwise edge values are computed once per (src, relation) pair.

  A value is compacted when it depends only on its edge's (source node, relation), costs more
  than a load, and would be materialized or feeds a value that is not pairwise (it is where the
  pairwise part of the program ends). A relation product that a GEMM sums straight into nodes
  (RGCN's) is not materialized, unless `fused_products` (the graph has many edges per pair:
  `compacts_fused_products`) computes it per pair. The compacted value's pairwise arguments are
  copied onto the ``compact`` domain with it, and its users read ``expand(compact value)``: row
  ``pair[e]``.
  """
  users = program.users()
  roots = materialized(program)
  pairwise: dict[int, bool] = {}
  for v in program.values:
    pairwise[v.id] = _pairwise(v, pairwise)

  def boundary(old: Value) -> bool:
    if not pairwise[old.id] or is_cheap(old):
      return False
    if old.id in roots:
      return True
    if old.op == "linear" and not fused_products:
      return False  # fused into the GEMM that aggregates it
    return any(not pairwise[u.id] for u in users.get(old.id, ()))

  copies: dict[int, Value] = {}

  def on_pairs(v: Value) -> Value:
    if v.op == "expand":
      return v.args[0]
    if v.domain != "edge":
      return v  # node arrays, weights
    if v.id not in copies:
      copies[v.id] = Value(
        v.op, tuple(on_pairs(a) for a in v.args), dict(v.attrs), "compact", v.shape
      )
    return copies[v.id]

  def fn(new: Value, old: Value) -> Value:
    if boundary(old):
      return Value("expand", (on_pairs(new),), {}, "edge", new.shape)
    return new

  return rewrite(program, fn)


# ----------------------------------------------------------------------------- differentiation
def differentiate(program: Program) -> Program:
  """The backward program: cotangents of the differentiable inputs from those of the outputs.

  Its inputs are the forward inputs plus ``ct_<output>`` (node arrays); its outputs are
  ``<input>`` for every node input, weight and relation vector that an output depends on. Forward
  values the backward needs are referenced: values the forward kernels materialized are kept
  from the forward pass, others (gathers, scalings) are recomputed inside the backward kernels.
  """
  cts: dict[int, Value] = {}
  inputs = dict(program.inputs)
  for k, out in program.outputs.items():
    ct = Value("input", (), {}, domain="node", shape=out.shape, name=f"ct_{k}")
    inputs[f"ct_{k}"] = ct
    _accumulate(cts, out, ct)
  for v in reversed(program.values):
    ct = cts.get(v.id)
    if ct is None or v.op in ("input", "weight"):
      continue
    for arg, contribution in _vjp(v, ct):
      _accumulate(cts, arg, contribution)
  outputs = {
    k: cts[v.id] for k, v in program.inputs.items() if v.id in cts and v.attrs.get("field") is None
  }
  return Program(inputs, outputs, f"{program.name}_backward")


def _accumulate(cts: dict[int, Value], v: Value, ct: Value):
  if is_constant(v):
    return  # graph data (the normalizer) is constant
  prev = cts.get(v.id)
  cts[v.id] = ct if prev is None else Value("add", (prev, ct), domain=ct.domain, shape=ct.shape)


def _vjp(v: Value, ct: Value) -> list[tuple[Value, Value]]:
  """[(argument, its cotangent contribution)] for one value given its cotangent."""
  a = v.args
  if v.op == "aggregate":
    return [(a[0], Value("gather", (ct,), {"end": v.attrs["end"]}, a[0].domain, a[0].shape))]
  if v.op == "gather":
    return [(a[0], Value("aggregate", (ct,), {"end": v.attrs["end"]}, "node", a[0].shape))]
  if v.op == "expand":
    return [(a[0], Value("compact_sum", (ct,), {}, "compact", a[0].shape))]
  if v.op == "compact_sum":
    return [(a[0], Value("expand", (ct,), {}, "edge", a[0].shape))]
  if v.op == "linear":
    rows, w = a
    t = v.attrs["transpose"]
    d_rows = Value("linear", (ct, w), {"transpose": not t}, rows.domain, rows.shape)
    d_w = Value("weight_grad", (ct, rows) if t else (rows, ct), {}, "weight", w.shape)
    return [(rows, d_rows), (w, d_w)]
  if v.op == "weight_row":
    return [
      (a[0], Value("scatter_weight_row", (ct,), {"end": v.attrs["end"]}, "weight", a[0].shape))
    ]
  if v.op == "vector_row":
    return [(a[0], Value("relation_sum", (ct,), {}, "weight", a[0].shape))]
  if v.op == "add":
    out = []
    for arg in a:
      if arg.shape != ct.shape:
        raise NotImplementedError("hector: the gradient of a broadcasting add is not supported")
      out.append((arg, ct))
    return out
  if v.op == "mul":
    x, y = a
    out = []
    for this, other in ((x, y), (y, x)):
      if is_constant(this):
        continue
      if this.shape == ct.shape:
        out.append((this, Value("mul", (ct, other), {}, ct.domain, ct.shape)))
      else:  # a per-edge or per-head scale: the dot of its head's features with the cotangent
        out.append((this, Value("dot", (ct, other), {"heads": width(this)}, ct.domain, this.shape)))
    return out
  if v.op == "dot":
    x, y = a
    if y.domain == "weight":  # a relation vector
      d_x = Value(
        "mul", (ct, Value("vector_row", (y,), {}, x.domain, x.shape)), {}, x.domain, x.shape
      )
      d_y = Value(
        "relation_sum", (Value("mul", (ct, x), {}, x.domain, x.shape),), {}, "weight", y.shape
      )
    else:
      d_x = Value("mul", (ct, y), {}, x.domain, x.shape)
      d_y = Value("mul", (ct, x), {}, y.domain, y.shape)
    return [(x, d_x), (y, d_y)]
  if v.op == "unary":
    return [(a[0], Value("unary_grad", (a[0], ct), dict(v.attrs), ct.domain, ct.shape))]
  if v.op == "edge_softmax":
    # d s[e] = alpha[e] * (g[e] - sum over e's group of alpha * g), per head
    end, alpha = v.attrs["end"], v
    weighted = Value("mul", (alpha, ct), {}, ct.domain, ct.shape)
    total = Value("aggregate", (weighted,), {"end": end}, "node", ct.shape)
    back = Value("gather", (total,), {"end": end}, ct.domain, ct.shape)
    centered = Value(
      "add",
      (ct, Value("unary", (back,), {"fn": "neg"}, ct.domain, ct.shape)),
      {},
      ct.domain,
      ct.shape,
    )
    return [(a[0], Value("mul", (alpha, centered), {}, ct.domain, ct.shape))]
  if v.op == "head_scale":
    w, m = a
    return [
      (w, Value("head_scale", (ct, m), {}, "weight", w.shape)),
      (m, Value("head_scale_grad", (ct, w), {}, "weight", m.shape)),
    ]
  if v.op == "fold":
    w, vec = a
    return [
      (w, Value("fold_grad_weight", (ct, vec), {}, "weight", w.shape)),
      (vec, Value("fold_grad_vector", (ct, w), {}, "weight", vec.shape)),
    ]
  raise NotImplementedError(f"hector: no derivative rule for {v.op}")
