"""Identical layers run one after another or as a stack under a per-layer offload plan.

A deep relational GNN (`jaxdata.train.attention`'s classifiers with `layers > 2`) repeats one
hidden-to-hidden layer. Its layers stay separate modules (``conv2``, ``conv3``, ...: a plain
model's parameters and checkpoints look as they always did); `run` applies them in a Python
loop, or, given a plan (one `jaxdata.offload.Policy` per layer), stacks their states and runs
`jaxdata.offload.run_layers`: one `lax.scan` per run of equal policies, each layer's residuals
kept, offloaded to a `TensorStore` or recomputed. Stacking copies the layers' parameters once
per step (a few MiB: small next to a graph's activations); results and gradients are the plain
loop's.

Layers that differ in shape (one per sampled hop of a mini-batch: each hop's block has its own
padded sizes) cannot be scanned: `run_each` applies each under its own policy
(`jaxdata.offload.remat` per layer call), and `plan_each` measures each on its own input.

`candidates` gives the planner the inner policies worth trying, from the names a layer tags its
intermediates with (`jaxdata.nn.hgt.NAMES`, `jaxdata.nn.rgat.NAMES`) and hector's
`SAVED_NAME`; `plan` measures one layer and picks a policy per layer for a device budget.

    layers = [model.conv2, model.conv3, model.conv4]
    fn = lambda conv, h: jax.nn.relu(conv(graph, h))
    best, _ = plan(layers, fn, jax.ShapeDtypeStruct(h.shape, h.dtype), 64 << 20, store,
                   candidates(RGAT_NAMES))
    h = run(layers, fn, h, list(best.policies))      # == run(layers, fn, h)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdata.hector.compiled import SAVED_NAME
from jaxdata.offload import planner
from jaxdata.offload.remat import Policy, remat
from jaxdata.offload.stack import run_layers
from jaxdata.offload.store import TensorStore

#: layer_fn(layer module, x) -> x: one layer of the stack, with whatever it closes over (the
#: graph) and applies around it (an activation).
LayerFn = Callable[[nnx.Module, jax.Array], jax.Array]


def candidates(names: Sequence[str]) -> dict[str, Any]:
  """Inner policies worth trying for a layer that tags its node-level intermediates with
  `names` and runs hector kernels (whose residuals are named `SAVED_NAME`):

  - "all": every residual (None: no checkpoint);
  - "edges": the node-level intermediates and the edge kernels' residuals: the backward pass
    recomputes only elementwise work;
  - "nodes": the node-level intermediates alone: the backward pass runs the edge kernels'
    forward again (for their residuals), not the projections;
  - "dots": XLA's matrix products (`dots_with_no_batch_dims_saveable`): the dense projections'
    outputs; the edge kernels run again.
  """
  save = jax.checkpoint_policies.save_only_these_names
  return {
    "all": None,
    "edges": save(*names, SAVED_NAME),
    "nodes": save(*names),
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
  }


def stacked(layers: Sequence[nnx.Module], layer_fn: LayerFn) -> tuple[Callable, Any]:
  """(apply, states): `apply(state, x)` is `layer_fn` on the layer whose state is `state`;
  `states` holds every layer's state stacked on a leading axis (a copy of their parameters).
  The layers must be alike (same type, shapes and settings)."""
  if not layers:
    raise ValueError("layer_stack: no layers to stack")
  graphdef = nnx.split(layers[0])[0]
  states = []
  for i, layer in enumerate(layers):
    g, state = nnx.split(layer)
    if g != graphdef:
      raise ValueError(f"layer_stack: layer {i} differs from layer 0 (type, shapes or settings)")
    states.append(state)

  def apply(state, x):
    return layer_fn(nnx.merge(graphdef, state), x)

  return apply, jax.tree.map(lambda *a: jnp.stack(a), *states)


def run(
  layers: Sequence[nnx.Module],
  layer_fn: LayerFn,
  x: jax.Array,
  plan: Sequence[Policy | None] | None = None,
) -> jax.Array:
  """`layer_fn` of each layer in turn on x; with `plan` (one policy per layer, None for a plain
  layer), as a stack under `jaxdata.offload.run_layers`: the same results and gradients."""
  if plan is None:
    for layer in layers:
      x = layer_fn(layer, x)
    return x
  if len(plan) != len(layers):
    raise ValueError(f"layer_stack.run: plan has {len(plan)} policies for {len(layers)} layers")
  if not layers:
    return x
  apply, states = stacked(layers, layer_fn)
  return run_layers(apply, states, x, list(plan))


def _bound(layer: nnx.Module, layer_fn: LayerFn) -> tuple[Callable, Any]:
  """(apply, state): `apply(state, x)` is `layer_fn(layer, x)` with the layer's state an
  argument (so that a remat policy sees its parameters as inputs, not residuals)."""
  graphdef, state = nnx.split(layer)
  return (lambda s, x: layer_fn(nnx.merge(graphdef, s), x)), state


def run_each(
  layers: Sequence[nnx.Module],
  layer_fns: Sequence[LayerFn],
  x: jax.Array,
  plan: Sequence[Policy | None] | None = None,
) -> jax.Array:
  """`layer_fns[i](layers[i], x)` in turn, layer i under policy `plan[i]` (None, or a plan
  of None: plain layers) through `jaxdata.offload.remat`, one call per layer: for layers whose
  shapes differ (no scan). The same results and gradients as the plain loop."""
  if len(layer_fns) != len(layers):
    raise ValueError(
      f"layer_stack.run_each: {len(layer_fns)} layer functions for {len(layers)} layers"
    )
  if plan is not None and len(plan) != len(layers):
    raise ValueError(
      f"layer_stack.run_each: plan has {len(plan)} policies for {len(layers)} layers"
    )
  for i, (layer, fn) in enumerate(zip(layers, layer_fns)):
    policy = None if plan is None else plan[i]
    if policy is None:
      x = fn(layer, x)
    else:
      apply, state = _bound(layer, fn)
      x = remat(apply, policy)(state, x)
  return x


def _padded(layer_fn: LayerFn) -> LayerFn:
  """`layer_fn` with its output padded with zero rows to its input's rows: a layer that a
  planner can chain on its own output (a block's layer keeps only its destinations' rows)."""

  def fn(layer, x):
    y = layer_fn(layer, x)
    return jnp.pad(y, ((0, x.shape[0] - y.shape[0]),) + ((0, 0),) * (y.ndim - 1))

  return fn


def plan_each(
  layers: Sequence[nnx.Module],
  layer_fns: Sequence[LayerFn],
  xs: Sequence[jax.ShapeDtypeStruct | jax.Array],
  budget_bytes: int,
  store: TensorStore,
  inners: dict[str, Any],
  *,
  tier: str = "auto",
  repeats: int = 5,
  progress: Callable[[str], None] | None = None,
) -> tuple[planner.OffloadPlan, float]:
  """`plan` for layers that differ in shape (`run_each`'s): layer i measured on its own, under
  `inners`, on an input like `xs[i]` (`jaxdata.offload.planner.plan_blocks`), so that every
  layer's residuals and input fit `budget_bytes`; and the store's measured bandwidth. A layer
  may return fewer rows than it reads (a block's destinations). ValueError when not even the
  smallest plan fits."""
  if not (len(layers) == len(layer_fns) == len(xs)):
    raise ValueError(
      f"layer_stack.plan_each: {len(layers)} layers, {len(layer_fns)} layer "
      f"functions and {len(xs)} inputs"
    )
  blocks = []
  for layer, fn, x in zip(layers, layer_fns, xs):
    apply, state = _bound(layer, _padded(fn))
    blocks.append((apply, state, jax.ShapeDtypeStruct(x.shape, x.dtype)))
  return planner.plan_blocks(
    blocks, budget_bytes, store, inners, tier=tier, repeats=repeats, progress=progress
  )


def plan(
  layers: Sequence[nnx.Module],
  layer_fn: LayerFn,
  x: jax.ShapeDtypeStruct | jax.Array,
  budget_bytes: int,
  store: TensorStore,
  inners: dict[str, Any],
  *,
  tier: str = "auto",
  repeats: int = 5,
  progress: Callable[[str], None] | None = None,
) -> tuple[planner.OffloadPlan, float]:
  """The planner's per-layer plan for `layers` (`jaxdata.offload.plan_layers`): layer 0
  measured under `inners` (e.g. `candidates(NAMES)`) on an input like `x`, so that the stack's
  residuals and layer inputs fit `budget_bytes`; and the store's measured bandwidth.
  ValueError when not even the smallest plan fits."""
  apply, states = stacked(layers, layer_fn)
  x = jax.ShapeDtypeStruct(x.shape, x.dtype)
  first = jax.tree.map(lambda a: a[0], states)
  return planner.plan_layers(
    apply,
    first,
    x,
    len(layers),
    budget_bytes,
    store,
    inners,
    tier=tier,
    repeats=repeats,
    progress=progress,
  )


def policy_named(
  name: str, store: TensorStore | None, inners: dict[str, Any], *, tier: str = "auto"
) -> Policy:
  """The policy a plan prints as `name` over `inners` ("recompute", "keep[nodes]",
  "offload[edges]+in", "offload[in]", ...; `jaxdata.offload.planner.policy_named`)."""
  return planner.policy_named(name, store, inners=inners, tier=tier, carry=1)
