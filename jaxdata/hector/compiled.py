"""A compiled relational layer: specialization per shape, kernels, and a custom VJP.

`Layer(program)(graph, **inputs)` specializes the traced program to the inputs' shapes, runs the
passes (shape inference, linear-operator reordering, compact materialization, differentiation),
lowers both directions to kernel instances, and runs the forward kernels; `jax.grad` runs the
backward kernels that differentiation produced, reusing the arrays the forward kernels
materialized. Plans are cached per shape, choice of passes and whether the graph compacts its
fused products (`passes.compacts_fused_products`), kernels per source (in memory and on disk).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jaxdata.hector import codegen, passes
from jaxdata.hector import precision as precision_lib
from jaxdata.hector.ir import Program, Value, width
from jaxdata.hector.lowering import Dense, Instance, lower
from jaxdata.hector.passes import compacts_fused_products
from jaxdata.hector.passes import select as passes_select
from jaxdata.hector.runtime import GraphArrays, KernelSpec, run_kernel, source

_KERNEL_DTYPES = {jnp.dtype(jnp.float32): "float32", jnp.dtype(jnp.bfloat16): "bfloat16"}


#: The checkpoint name (`jax.ad_checkpoint.checkpoint_name`) of every array a generated layer's
#: forward kernels keep for its backward kernels.
SAVED_NAME = "hector_saved"

_PASS_TITLES = {
  "reorder": "after linear-operator reordering",
  "compact": "after compact materialization",
}


@dataclasses.dataclass(eq=False)
class Plan:
  """A program specialized to shapes: its passes' results and kernel instances.

  `stages` holds the forward program after each pass, `(title, program text)`; `saved` the ids
  of arrays the forward kernels made that the backward kernels read (kept as residuals, not
  recomputed).
  """

  traced: Program
  forward: Program
  backward: Program
  forward_kernels: list[Instance]
  backward_kernels: list[Instance]
  stages: tuple[tuple[str, str], ...] = ()
  saved: frozenset[int] = frozenset()

  def __str__(self):
    parts = [
      ("traced", str(self.traced)),
      *self.stages,
      ("after differentiation (backward program)", str(self.backward)),
      ("forward kernels", "\n".join(map(str, self.forward_kernels))),
      ("backward kernels", "\n".join(map(str, self.backward_kernels)) + self._kept()),
    ]
    return "\n\n".join(f"== {title} ==\n{body}" for title, body in parts)

  def _kept(self) -> str:
    kept = [k.output.label for k in self.forward_kernels if k.output.id in self.saved]
    return f"\nkept from the forward pass: {', '.join(kept)}" if kept else ""


def make_plan(
  program: Program,
  shapes: dict[str, tuple[int, ...]],
  num_nodes: int,
  num_relations: int,
  chosen: tuple[str, ...] = passes.PASSES,
  fused_products: bool = False,
) -> Plan:
  """Runs the passes on a traced program for these input shapes and lowers both directions
  (`fused_products`: the graph has many edges per pair, `passes.compacts_fused_products`)."""
  forward = passes.infer_shapes(passes.clone(program), shapes, num_nodes, num_relations)
  stages = [("after shape inference", str(forward))]
  run = {
    "reorder": passes.reorder,
    "compact": functools.partial(passes.compact, fused_products=fused_products),
  }
  for name in passes.PASSES:
    if name in chosen:
      forward = run[name](forward)
      stages.append((_PASS_TITLES[name], str(forward)))
    else:
      stages.append((_PASS_TITLES[name], "(switched off)"))
  backward = passes.differentiate(forward)
  fwd = lower(forward)
  made = frozenset(k.output.id for k in fwd)
  bwd = lower(backward, made)
  saved = {v.id for k in bwd for v in k.inputs if v.id in made}
  return Plan(program, forward, backward, fwd, bwd, tuple(stages), frozenset(saved))


class Layer:
  """A relational layer written with `hector.layer`; call it with a `GraphArrays` and arrays.

  `passes` chooses the optimizing passes (names from `hector.PASSES`; None: all of them), here
  as the layer's default or per call: ``layer(graph, passes=(), **inputs)`` runs none of them,
  ``layer.with_passes(["compact"])`` is a layer that runs only compaction (useful under
  `jax.jit`, where the call's keyword arguments must be arrays).

  `precision` sets the matmul precision of the layer's GEMM and weight-gradient kernels as
  `jnp.dot`'s does (None: ``jax.default_matmul_precision``; see `jaxdata.hector.precision`):
  the default runs them on tensor cores on a GPU (TF32 for float32 operands), "highest" keeps
  float32-exact products. The backward kernels run at the forward call's precision.
  """

  def __init__(self, program: Program, kinds: dict[str, str], passes=None):
    self.program = program
    self.kinds = dict(kinds)
    self.passes = passes_select(passes)
    self._plans: dict[tuple, Plan] = {}

  def __repr__(self):
    return f"hector.Layer({self.program.name}: {', '.join(self.kinds)})"

  def with_passes(self, passes) -> Layer:
    """This layer with another default choice of passes (it shares the traced program)."""
    return Layer(self.program, self.kinds, passes)

  def plan(self, graph: GraphArrays, passes=None, **inputs) -> Plan:
    """The specialized plan for these inputs' shapes (`print` it to see every pass)."""
    self._check(graph, inputs)
    chosen = self.passes if passes is None else passes_select(passes)
    shapes = {k: tuple(np.shape(v)) for k, v in inputs.items()}
    fused = compacts_fused_products(graph.num_edges, graph.num_pairs)
    key = (tuple(sorted(shapes.items())), graph.num_nodes, graph.num_relations, chosen, fused)
    if key not in self._plans:
      self._plans[key] = make_plan(
        self.program, shapes, graph.num_nodes, graph.num_relations, chosen, fused
      )
    return self._plans[key]

  def sources(
    self,
    graph: GraphArrays,
    target: str = "cpu",
    passes=None,
    precision=None,
    tilings: bool = False,
    **inputs,
  ) -> str:
    """The generated source of every kernel of the plan for `target` ("cpu" or "cuda"), at
    `precision` (as in `__call__`); with `tilings`, a CUDA tensor-core kernel's in each of its
    tilings (`jaxdata.hector.tuning`), not only its default one."""
    level = precision_lib.resolve(precision, f"{self.program.name}.sources")
    plan = self.plan(graph, passes, **inputs)
    dt = {k: _kernel_dtype(v) for k, v in inputs.items()}
    compute = _kernel_dtype(jnp.result_type(*inputs.values()))
    dt.update({f"ct_{k}": compute for k in self.program.outputs})  # cotangents: as the outputs
    made = {}  # value id -> its dtype, for the values the instances make (as `execute`)

    def dtype_of(v: Value) -> str:
      if v.op in ("input", "weight"):
        assert v.name is not None  # inputs and weights are named
        return dt.get(v.name, "float32")
      return made.get(v.id, "float32")

    out = []
    for direction, kernels in (
      ("forward", plan.forward_kernels),
      ("backward", plan.backward_kernels),
    ):
      for inst in kernels:
        ins = [dtype_of(v) for v in inst.inputs]
        if isinstance(inst.kernel, Dense):
          made[inst.output.id] = _dense_dtype(ins)
          continue
        made[inst.output.id] = out_dtype(inst, compute)
        spec = _spec(inst, ins, graph, level, made[inst.output.id])
        tiles = [None]
        if tilings and target == "cuda":
          kind = codegen.math(spec.kernel, spec.dtypes, spec.precision)
          tiles = codegen.tilings(spec.kernel, kind)
        for tile in tiles:
          name = inst.output.label + (f" ({tile})" if tile is not None and len(tiles) > 1 else "")
          out.append(f"// ---- {direction}: {name}\n{source(spec, target, tile)}")
    return "\n".join(out)

  def __call__(self, graph: GraphArrays, passes=None, precision=None, **inputs) -> Any:
    # Any: the one output array, or a dict of them by name; which one, the program says
    level = precision_lib.resolve(precision, self.program.name)
    plan = self.plan(graph, passes, **inputs)
    names = tuple(self.program.inputs)
    # custom_vjp through functools.partial loses `_apply`'s return type
    outs = cast(
      dict[str, jax.Array], _apply(plan, names, level, graph, tuple(inputs[k] for k in names))
    )
    return outs if len(outs) > 1 else next(iter(outs.values()))

  def _check(self, graph, inputs):
    if not isinstance(graph, GraphArrays):
      raise TypeError(f"graph must be a hector.GraphArrays, got {type(graph).__name__}")
    graph.check_structure()
    missing = set(self.kinds) - set(inputs)
    extra = set(inputs) - set(self.kinds)
    if missing or extra:
      raise TypeError(
        f"{self.program.name}: expected inputs {sorted(self.kinds)}; "
        f"missing {sorted(missing)}, unexpected {sorted(extra)}"
      )
    for k, v in inputs.items():
      dt = jnp.result_type(v)
      if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(f"{self.program.name}: input {k!r} must be floating point, got {dt}")


def _kernel_dtype(x) -> str:
  return _KERNEL_DTYPES.get(jnp.result_type(x), "float32")


#: the fewest features of a stored row that a bfloat16 layer keeps in bfloat16 (`out_dtype`)
BF16_MIN_WIDTH = 16


def out_dtype(inst: Instance, compute: str) -> str:
  """The dtype of instance `inst`'s output in a layer whose inputs promote to `compute`
  ("float32" or "bfloat16").

  A kernel that stores rows of at least `BF16_MIN_WIDTH` features (per-edge or per-pair
  features, a GEMM's rows per edge) writes them in the layer's dtype, as `jnp` would hold that
  intermediate: a bfloat16 layer reads and writes half the bytes between its kernels, and its
  GEMMs over those rows run on bfloat16 tensor cores. Float32 stays for a kernel that sums into
  its rows (atomics on a GPU; the edge softmax too) and for narrower rows: those are per-head
  scalars (attention scores and their gradients), whose rounding the softmax's exp amplifies
  (RGAT's gradients of the attention vectors: up to 4.9e-2 of their largest in bfloat16
  against 6.8e-3 in float32, tests/test_hector_precision.py's cases), and whose bytes are few.
  """
  if compute == "float32" or codegen.zero_output(inst.kernel):
    return "float32"
  return compute if width(inst.output) >= BF16_MIN_WIDTH else "float32"


def _dense_dtype(dtypes: list[str]) -> str:
  """The dtype of an XLA-side (`Dense`) value of operands of these kernel dtypes: bfloat16 where
  they all are (as `jnp` promotes), else float32."""
  return "bfloat16" if set(dtypes) == {"bfloat16"} else "float32"


def _spec(
  inst: Instance, dtypes: list[str], graph: GraphArrays, precision: str, out: str = "float32"
) -> KernelSpec:
  return KernelSpec(
    inst.kernel,
    tuple(dtypes),
    _full_shape(inst.output, graph),
    codegen.zero_output(inst.kernel),
    str(inst),
    precision,
    out,
  )


def _full_shape(v: Value, graph: GraphArrays) -> tuple[int, ...]:
  if v.domain == "weight":
    return v.known_shape
  rows = {"node": graph.num_nodes, "edge": graph.num_edges, "compact": graph.num_pairs}
  return (rows[v.domain],) + v.known_shape


def execute(
  kernels: list[Instance],
  graph: GraphArrays,
  env: dict[int, jax.Array],
  precision: str | None = None,
  dtype=jnp.float32,
):
  """Runs instances in order; `env` maps value ids to arrays and receives every output (an
  instance whose output is already there, kept from the forward pass, is skipped); GEMMs run
  at `precision` (as `Layer.__call__` takes it; None: ``jax.default_matmul_precision``); the
  rows a kernel stores are of `dtype` (the layer's inputs' promoted dtype: `out_dtype`), an
  XLA-side (`Dense`) value of its operands' promoted dtype: ``fold(W, a)`` of bfloat16 weights
  is a bfloat16 weight, as in `jnp`, and the GEMM that reads it runs on bfloat16 tensor cores."""
  precision = precision_lib.resolve(precision, "hector.execute")
  compute = _KERNEL_DTYPES.get(jnp.dtype(dtype), "float32")
  for inst in kernels:
    if inst.output.id in env:
      continue
    args = [env[v.id] for v in inst.inputs]
    if isinstance(inst.kernel, Dense):  # float32 math, rounded to its operands' dtype (as jnp)
      env[inst.output.id] = _dense(inst.kernel, args).astype(
        _dense_dtype([_kernel_dtype(a) for a in args])
      )
      continue
    args = [
      a if jnp.result_type(a) in _KERNEL_DTYPES else jnp.asarray(a, jnp.float32) for a in args
    ]
    spec = _spec(inst, [_kernel_dtype(a) for a in args], graph, precision, out_dtype(inst, compute))
    env[inst.output.id] = run_kernel(spec, graph, args)


_UNARY = {
  "relu": jax.nn.relu,
  "exp": jnp.exp,
  "tanh": jnp.tanh,
  "sigmoid": jax.nn.sigmoid,
  "neg": jnp.negative,
}
_HI = jax.lax.Precision.HIGHEST


def _unary(k: Dense):
  if k.fn == "leaky_relu":
    return functools.partial(jax.nn.leaky_relu, negative_slope=k.param)
  return _UNARY[k.fn]


def _heads(w, vec):
  """W [R, k, H*d] as [R, k, H, d], for vec [R, H, d]."""
  return w.reshape(w.shape[0], w.shape[1], vec.shape[1], vec.shape[2])


def _dense(k: Dense, args):
  f32 = [a.astype(jnp.float32) for a in args]
  if k.op == "add":
    return f32[0] + f32[1]
  if k.op == "mul":
    return f32[0] * f32[1]
  if k.op == "unary":
    return _unary(k)(f32[0])
  if k.op == "unary_grad":
    x, g = f32
    return jax.vjp(_unary(k), x)[1](g)[0]
  if k.op == "fold":  # (W a)[r, k, h] = sum_d W[r, k, h*d + d'] a[r, h, d']
    w, vec = f32
    return jnp.einsum("rkhd,rhd->rkh", _heads(w, vec), vec, precision=_HI)
  if k.op == "fold_grad_weight":
    ct, vec = f32
    out = jnp.einsum("rkh,rhd->rkhd", ct, vec, precision=_HI)
    return out.reshape(out.shape[0], out.shape[1], -1)
  if k.op == "fold_grad_vector":
    ct, w = f32
    h = ct.shape[2]
    w4 = w.reshape(w.shape[0], w.shape[1], h, w.shape[2] // h)
    return jnp.einsum("rkh,rkhd->rhd", ct, w4, precision=_HI)
  if k.op == "head_scale":  # W[r, h] * m[r, h, 0]
    w, m = f32
    return w * m[..., None]
  if k.op == "head_scale_grad":  # per (r, h): the sum of ct * W over the head's block
    ct, w = f32
    return jnp.sum(ct * w, axis=(2, 3))[..., None]
  raise NotImplementedError(f"hector: dense {k.op}")


def _zero_cotangent(x):
  x = jnp.asarray(x)
  if jnp.issubdtype(x.dtype, jnp.floating):
    return jnp.zeros_like(x)
  return np.zeros(x.shape, jax.dtypes.float0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _apply(
  plan: Plan, names: tuple[str, ...], precision: str, graph: GraphArrays, arrays: tuple
) -> dict[str, jax.Array]:
  return _forward(plan, names, precision, graph, arrays)


def _run_forward(plan, names, precision, graph, arrays):
  env = {plan.forward.inputs[k].id: a for k, a in zip(names, arrays)}
  dtype = jnp.result_type(*arrays)
  execute(plan.forward_kernels, graph, env, precision, dtype)
  return {k: env[v.id].astype(dtype) for k, v in plan.forward.outputs.items()}, env


def _forward(plan, names, precision, graph, arrays):
  return _run_forward(plan, names, precision, graph, arrays)[0]


def _apply_fwd(plan, names, precision, graph, arrays):
  outs, env = _run_forward(plan, names, precision, graph, arrays)
  # Named, so that a remat policy can keep (or offload) what the backward kernels read instead
  # of running the forward kernels again (`save_only_these_names(SAVED_NAME)`).
  return outs, (graph, arrays, {i: checkpoint_name(env[i], SAVED_NAME) for i in plan.saved})


def _apply_bwd(plan, names, precision, residuals, cts):
  graph, arrays, saved = residuals
  env = {plan.forward.inputs[k].id: a for k, a in zip(names, arrays)}
  env.update(saved)
  for k, ct in cts.items():
    env[plan.backward.inputs[f"ct_{k}"].id] = ct
  execute(plan.backward_kernels, graph, env, precision, jnp.result_type(*arrays))
  grads = tuple(
    env[plan.backward.outputs[k].id].astype(a.dtype)
    if k in plan.backward.outputs
    else jnp.zeros_like(a)
    for k, a in zip(names, arrays)
  )
  return jax.tree_util.tree_map(_zero_cotangent, graph), grads


_apply.defvjp(_apply_fwd, _apply_bwd)
