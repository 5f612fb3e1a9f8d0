"""A compiled relational layer: specialization per shape, kernels, and a custom VJP.

`Layer(program)(graph, **inputs)` specializes the traced program to the inputs' shapes, runs the
passes (shape inference, differentiation), lowers both directions to kernel instances, and runs
the forward kernels; `jax.grad` runs the backward kernels that differentiation produced. Plans are
cached per shape, kernels per source (in memory and on disk).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxdata.hector import codegen, passes
from jaxdata.hector.ir import Program, Value
from jaxdata.hector.lowering import Dense, Instance, lower
from jaxdata.hector.runtime import GraphArrays, KernelSpec, run_kernel, source

_KERNEL_DTYPES = {jnp.dtype(jnp.float32): "float32", jnp.dtype(jnp.bfloat16): "bfloat16"}


@dataclasses.dataclass(eq=False)
class Plan:
  """A program specialized to shapes: its passes' results and kernel instances."""
  traced: Program
  forward: Program
  backward: Program
  forward_kernels: list[Instance]
  backward_kernels: list[Instance]

  def __str__(self):
    parts = [("traced", str(self.traced)), ("after shape inference", str(self.forward)),
             ("after differentiation (backward program)", str(self.backward)),
             ("forward kernels", "\n".join(map(str, self.forward_kernels))),
             ("backward kernels", "\n".join(map(str, self.backward_kernels)))]
    return "\n\n".join(f"== {title} ==\n{body}" for title, body in parts)


class Layer:
  """A relational layer written with `hector.layer`; call it with a `GraphArrays` and arrays."""

  def __init__(self, program: Program, kinds: dict[str, str]):
    self.program = program
    self.kinds = dict(kinds)
    self._plans: dict[tuple, Plan] = {}

  def __repr__(self):
    return f"hector.Layer({self.program.name}: {', '.join(self.kinds)})"

  def plan(self, graph: GraphArrays, **inputs) -> Plan:
    """The specialized plan for these inputs' shapes (`print` it to see every pass)."""
    self._check(graph, inputs)
    shapes = {k: tuple(np.shape(v)) for k, v in inputs.items()}
    key = (tuple(sorted(shapes.items())), graph.num_nodes, graph.num_relations)
    if key not in self._plans:
      forward = passes.infer_shapes(passes.clone(self.program), shapes, graph.num_nodes,
                                    graph.num_relations)
      backward = passes.differentiate(forward)
      self._plans[key] = Plan(self.program, forward, backward, lower(forward), lower(backward))
    return self._plans[key]

  def sources(self, graph: GraphArrays, target: str = "cpu", **inputs) -> str:
    """The generated source of every kernel of the plan for `target` ("cpu" or "cuda")."""
    plan = self.plan(graph, **inputs)
    dt = {k: _kernel_dtype(v) for k, v in inputs.items()}
    out = []
    for direction, kernels in (("forward", plan.forward_kernels),
                               ("backward", plan.backward_kernels)):
      for inst in kernels:
        if isinstance(inst.kernel, Dense):
          continue
        spec = _spec(inst, [dt.get(v.name, "float32") if v.op in ("input", "weight") else
                            "float32" for v in inst.inputs], graph)
        out.append(f"// ---- {direction}: {inst.output.label}\n{source(spec, target)}")
    return "\n".join(out)

  def __call__(self, graph: GraphArrays, **inputs):
    plan = self.plan(graph, **inputs)
    names = tuple(self.program.inputs)
    outs = _apply(plan, names, graph, tuple(inputs[k] for k in names))
    return outs if len(outs) > 1 else next(iter(outs.values()))

  def _check(self, graph, inputs):
    if not isinstance(graph, GraphArrays):
      raise TypeError(f"graph must be a hector.GraphArrays, got {type(graph).__name__}")
    missing = set(self.kinds) - set(inputs)
    extra = set(inputs) - set(self.kinds)
    if missing or extra:
      raise TypeError(f"{self.program.name}: expected inputs {sorted(self.kinds)}; "
                      f"missing {sorted(missing)}, unexpected {sorted(extra)}")
    for k, v in inputs.items():
      dt = jnp.result_type(v)
      if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(f"{self.program.name}: input {k!r} must be floating point, got {dt}")


def _kernel_dtype(x) -> str:
  return _KERNEL_DTYPES.get(jnp.result_type(x), "float32")


def _spec(inst: Instance, dtypes: list[str], graph: GraphArrays) -> KernelSpec:
  return KernelSpec(inst.kernel, tuple(dtypes), _full_shape(inst.output, graph),
                    codegen.zero_output(inst.kernel), str(inst))


def _full_shape(v: Value, graph: GraphArrays) -> tuple[int, ...]:
  if v.domain == "weight":
    return v.shape
  rows = graph.num_nodes if v.domain == "node" else graph.num_edges
  return (rows,) + tuple(v.shape)


def execute(kernels: list[Instance], graph: GraphArrays, env: dict[int, jax.Array]):
  """Runs instances in order; `env` maps value ids to arrays and receives every output."""
  for inst in kernels:
    args = [env[v.id] for v in inst.inputs]
    if isinstance(inst.kernel, Dense):
      env[inst.output.id] = _dense(inst.kernel, args)
      continue
    args = [a if jnp.result_type(a) in _KERNEL_DTYPES else jnp.asarray(a, jnp.float32)
            for a in args]
    spec = _spec(inst, [_kernel_dtype(a) for a in args], graph)
    env[inst.output.id] = run_kernel(spec, graph, args)


_UNARY = {"relu": jax.nn.relu, "exp": jnp.exp, "tanh": jnp.tanh, "sigmoid": jax.nn.sigmoid,
          "neg": jnp.negative}


def _dense(k: Dense, args):
  f32 = [a.astype(jnp.float32) for a in args]
  if k.op == "add":
    return f32[0] + f32[1]
  if k.op == "mul":
    return f32[0] * f32[1]
  if k.op == "unary":
    return _UNARY[k.fn](f32[0])
  if k.op == "unary_grad":
    x, g = f32
    return jax.vjp(_UNARY[k.fn], x)[1](g)[0]
  raise NotImplementedError(f"hector: dense {k.op}")


def _zero_cotangent(x):
  x = jnp.asarray(x)
  if jnp.issubdtype(x.dtype, jnp.floating):
    return jnp.zeros_like(x)
  return np.zeros(x.shape, jax.dtypes.float0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _apply(plan: Plan, names: tuple[str, ...], graph: GraphArrays, arrays: tuple):
  return _forward(plan, names, graph, arrays)


def _forward(plan, names, graph, arrays):
  env = {plan.forward.inputs[k].id: a for k, a in zip(names, arrays)}
  execute(plan.forward_kernels, graph, env)
  dtype = jnp.result_type(*arrays)
  return {k: env[v.id].astype(dtype) for k, v in plan.forward.outputs.items()}


def _apply_fwd(plan, names, graph, arrays):
  return _forward(plan, names, graph, arrays), (graph, arrays)


def _apply_bwd(plan, names, residuals, cts):
  graph, arrays = residuals
  env = {plan.forward.inputs[k].id: a for k, a in zip(names, arrays)}
  for k, ct in cts.items():
    env[plan.backward.inputs[f"ct_{k}"].id] = ct
  execute(plan.backward_kernels, graph, env)
  grads = tuple(
      env[plan.backward.outputs[k].id].astype(a.dtype) if k in plan.backward.outputs else
      jnp.zeros_like(a) for k, a in zip(names, arrays))
  return jax.tree_util.tree_map(_zero_cotangent, graph), grads


_apply.defvjp(_apply_fwd, _apply_bwd)
