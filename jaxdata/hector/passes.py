"""Passes on the IR: specialization to shapes, shape inference, differentiation.

Each pass takes a program and returns a new one (values are never shared between specializations),
so a layer traced once can be compiled for many shapes.
"""
from __future__ import annotations

from jaxdata.hector.ir import Program, Value, is_edge_scalar


def clone(program: Program) -> Program:
  """A deep copy of the program's values (shapes included)."""
  copies: dict[int, Value] = {}
  for v in program.values + list(program.inputs.values()):
    if v.id not in copies:
      copies[v.id] = Value(v.op, tuple(copies[a.id] for a in v.args), dict(v.attrs), v.domain,
                           v.shape, v.name)
  return Program({k: copies[v.id] for k, v in program.inputs.items()},
                 {k: copies[v.id] for k, v in program.outputs.items()}, program.name)


def infer_shapes(program: Program, shapes: dict[str, tuple[int, ...]], num_nodes: int,
                 num_relations: int) -> Program:
  """Fills in every value's shape from the inputs' array shapes; raises ValueError on a mismatch.

  `shapes` maps each input name to its full array shape (``[N, d]`` for node inputs, the weight's
  shape for weights).
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
      if len(s) != 3 or s[0] != num_relations:
        raise ValueError(f"hector: weight {k!r} must be [num_relations={num_relations}, a, b], "
                         f"got {s}")
      v.shape = s
  for v in program.values:
    v.shape = _shape(v, num_nodes, num_relations) if v.op not in ("input", "weight") else v.shape
  return program


def _shape(v: Value, n: int, r: int) -> tuple[int, ...]:
  a = [x.shape for x in v.args]
  if v.op in ("gather", "aggregate", "unary"):
    return a[0]
  if v.op == "unary_grad":
    return a[1]
  if v.op == "linear":
    w = a[1]
    k, m = (w[2], w[1]) if v.attrs["transpose"] else (w[1], w[2])
    if a[0] != (k,):
      raise ValueError(f"hector: {v.label}: rows of shape {a[0]} times a weight {w}"
                       + (" (transposed)" if v.attrs["transpose"] else ""))
    return (m,)
  if v.op == "weight_row":
    if a[0][1] != n:
      raise ValueError(f"hector: weight_row needs a [R, num_nodes={n}, d] weight, got {a[0]}")
    return (a[0][2],)
  if v.op in ("mul", "add"):
    if a[0] == a[1] or a[1] == ():
      return a[0]
    if a[0] == ():
      return a[1]
    raise ValueError(f"hector: {v.op} of shapes {a[0]} and {a[1]}")
  if v.op == "weight_grad":
    return (r, a[0][0], a[1][0])
  if v.op == "scatter_weight_row":
    return (r, n, a[0][0])
  raise ValueError(f"hector: no shape rule for {v.op}")


def differentiate(program: Program) -> Program:
  """The backward program: cotangents of the differentiable inputs from those of the outputs.

  Its inputs are the forward inputs plus ``ct_<output>`` (node arrays); its outputs are
  ``<input>`` for every node input and weight that an output depends on. Forward values the
  backward needs are referenced, not stored: the lowering recomputes them (fused into the backward
  kernels where they are cheap, as gathers and scalings are).
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
  outputs = {k: cts[v.id] for k, v in program.inputs.items()
             if v.id in cts and v.attrs.get("field") is None}
  return Program(inputs, outputs, f"{program.name}_backward")


def _accumulate(cts: dict[int, Value], v: Value, ct: Value):
  if v.op == "input" and v.attrs.get("field") is not None:
    return  # graph data (the normalizer) is constant
  prev = cts.get(v.id)
  cts[v.id] = ct if prev is None else Value("add", (prev, ct), domain=ct.domain, shape=ct.shape)


def _vjp(v: Value, ct: Value) -> list[tuple[Value, Value]]:
  """[(argument, its cotangent contribution)] for one value given its cotangent."""
  a = v.args
  if v.op == "aggregate":
    return [(a[0], Value("gather", (ct,), {"end": v.attrs["end"]}, "edge", a[0].shape))]
  if v.op == "gather":
    return [(a[0], Value("aggregate", (ct,), {"end": v.attrs["end"]}, "node", a[0].shape))]
  if v.op == "linear":
    rows, w = a
    t = v.attrs["transpose"]
    d_rows = Value("linear", (ct, w), {"transpose": not t}, "edge", rows.shape)
    d_w = Value("weight_grad", (ct, rows) if t else (rows, ct), {}, "weight", w.shape)
    return [(rows, d_rows), (w, d_w)]
  if v.op == "weight_row":
    return [(a[0], Value("scatter_weight_row", (ct,), {"end": v.attrs["end"]}, "weight",
                         a[0].shape))]
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
      if this.op == "input" and this.attrs.get("field") is not None:
        continue  # constant graph data
      if this.shape != ct.shape:
        raise NotImplementedError(
            "hector: the gradient of a per-edge scalar that scales rows is not supported yet")
      out.append((this, Value("mul", (ct, other), {}, ct.domain, ct.shape)))
    return out
  if v.op == "unary":
    return [(a[0], Value("unary_grad", (a[0], ct), {"fn": v.attrs["fn"]}, ct.domain, ct.shape))]
  raise NotImplementedError(f"hector: no derivative rule for {v.op}")


def is_cheap(v: Value) -> bool:
  """Whether a value is recomputed inside each consumer rather than materialized: gathers,
  weight rows, graph scalars and their products with edge scalars cost a load, not a kernel."""
  if v.op in ("gather", "weight_row"):
    return True
  if v.op == "input" and v.domain == "edge":
    return True
  if v.op == "mul" and v.domain == "edge":
    x, y = v.args
    return (is_edge_scalar(x) and is_cheap(x) and is_cheap(y)) or (
        is_edge_scalar(y) and is_cheap(y) and is_cheap(x))
  return False
