"""Running a stack of layers under per-layer remat policies.

A stack is one layer function `block_apply(layer_state, x) -> x` and every layer's state
stacked along a leading axis (as `nnx.vmap` makes them). A *plan* gives each layer a policy:
consecutive layers with equal policies form one segment, one `lax.scan` over that slice of the
stack, whose body is `jaxdata.offload.remat(block_apply, policy)` (None: the plain layer).

    x = run_layers(block_apply, states, x, plan=[None, None, p, p])   # layers 2-3 under p
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax

from jaxdata.offload.remat import remat


def segments(plan: Sequence[Hashable] | None, layers: int) -> list[tuple[int, int, Any]]:
  """[(start, stop, policy)]: runs of consecutive layers whose policies are equal (==).

  >>> segments(["a", "a", None, "a"], 4)
  [(0, 2, 'a'), (2, 3, None), (3, 4, 'a')]
  """
  if plan is None:
    return [(0, layers, None)]
  plan = list(plan)
  if len(plan) != layers:
    raise ValueError(f"plan: one policy per layer expected ({layers}), got {len(plan)}")
  runs, start = [], 0
  for i in range(1, layers + 1):
    if i == layers or plan[i] != plan[start]:
      runs.append((start, i, plan[start]))
      start = i
  return runs


def run_layers(
  block_apply: Callable, states: Any, x: jax.Array, plan: Sequence[Hashable] | None = None
) -> jax.Array:
  """Applies stacked layers to x: one `lax.scan` per segment of `plan` (see `segments`).

  `block_apply(layer_state, x) -> x` is one layer; `states` holds every layer's state along a
  leading axis, or is a list of such stacks, one per segment of `plan` (`GPT.split_layers`). A
  segment whose policy is None scans `block_apply` itself; any other runs
  `jaxdata.offload.remat(block_apply, policy)`, which has block_apply's results and gradients.

  One stack under a plan of several segments costs memory: each segment's slice of the stack is
  a copy that the backward pass keeps, one stack's worth in all, and each slice's gradient is
  padded to the whole stack. Stacks split ahead of time (outside the jitted step) cost nothing.
  """
  presplit = isinstance(states, list)  # one stack per segment (what `GPT.split_layers` makes)
  stacks = states if presplit else [states]
  sizes = [jax.tree.leaves(s)[0].shape[0] for s in stacks]
  layers = sum(sizes)
  if presplit and plan is None:  # plain layers, one scan per stack
    runs = [(a, a + n, None) for a, n in zip(itertools.accumulate([0] + sizes), sizes)]
  else:
    runs = segments(plan, layers)
  if presplit:
    if sizes != [stop - start for start, stop, _ in runs]:
      raise ValueError(
        f"run_layers: states split into stacks of {sizes} layers, but the plan's "
        f"segments are {[stop - start for start, stop, _ in runs]}"
      )
  for j, (start, stop, policy) in enumerate(runs):
    body = block_apply
    if policy is not None:
      body = remat(block_apply, policy)
    if presplit:
      part = stacks[j]
    elif len(runs) == 1:
      part = states
    else:
      part = jax.tree.map(lambda a, start=start, stop=stop: a[start:stop], states)
    x, _ = jax.lax.scan(lambda h, s, body=body: (body(s, h), None), x, part)
  return x
