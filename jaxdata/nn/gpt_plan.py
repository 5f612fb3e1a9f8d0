"""Offload planning for `jaxdata.nn.GPT`: the inner policies worth trying for its block, the
policies a plan names, and a per-layer plan for a device memory budget.

The planner itself (`jaxdata.offload.planner`) knows nothing of GPT: it measures any block
function under the inner policies it is given. This module gives it GPT's block and names.

    plan = plan_for_model(model, (batch, seq), budget_bytes=4 << 30, store=store)
    loss = model.loss(tokens, plan=plan)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from jaxdata.nn.gpt import block_fn, save_names
from jaxdata.offload import planner
from jaxdata.offload.remat import Policy
from jaxdata.offload.store import TensorStore


def candidates() -> dict[str, Any]:
  """Inner policies worth trying for a GPT block (by its checkpoint names).

  What a block's backward pass reads: q, k, v and the attention's output and statistics (the
  attention backward), the attention output again and the MLP's input (weight gradients), the
  MLP's pre-activation (GELU's derivative). Each set below saves some of those; the rest is
  recomputed from the block's input.
  """
  return {
    "all": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "proj": save_names("qkv", "attn_ctx", "attn_out", "mlp_up"),
    "attn": save_names("qkv", "attn_ctx", "attn_out"),
    "mlp": save_names("attn_out", "mlp_up"),
    "ctx": save_names("attn_ctx", "attn_out"),
  }


def policy_named(name: str, store: TensorStore | None = None, *, tier: str = "auto") -> Policy:
  """The policy a GPT plan prints as `name` ("recompute", "keep[attn]", "offload[mlp]+in", ...;
  see `jaxdata.offload.planner.policy_named`), over `candidates()`."""
  return planner.policy_named(name, store, inners=candidates(), tier=tier, carry=1)


def plan_for_model(
  model,
  batch_shape: tuple[int, int],
  budget_bytes: int,
  store: TensorStore,
  *,
  tier: str = "auto",
  repeats: int = 5,
  verbose: bool = True,
) -> list[Policy]:
  """A per-layer plan for a `jaxdata.nn.GPT` so that the layers' residuals and inputs (what the
  stack keeps for each layer's backward pass) fit `budget_bytes` of device memory, measured on
  the default device."""
  blk = block_fn(model, batch_shape)
  say = (lambda what: print(f"  planning: {what} ...", flush=True)) if verbose else None
  best, bw = planner.plan_layers(
    blk.apply,
    blk.layer(0),
    blk.x,
    model.cfg.layers,
    budget_bytes,
    store,
    candidates(),
    tier=tier,
    repeats=repeats,
    progress=say,
  )
  if verbose:
    print(
      f"  plan: {best}  (predicted {best.seconds * 1e3:.1f} ms of layers, "
      f"{best.device_bytes / 2**30:.2f} GiB resident, {best.offload_bytes / 2**30:.2f} GiB "
      f"offloaded at {bw / 1e9:.1f} GB/s)",
      flush=True,
    )
  return list(best.policies)


def offloaded_bytes(
  model, batch_shape: tuple[int, int], plan: Sequence[Policy], store: TensorStore
) -> int:
  """The bytes one step of `plan` over `model` on one device's `batch_shape` moves to the
  store, all of them held there at once (every layer's forward spills before the first
  backward loads): what its RAM tier must hold. From the traced residuals of each policy
  (`planner.choices(..., measure=False)`: nothing compiled or run)."""
  blk = block_fn(model, batch_shape)
  only = {i for p in plan if (i := planner.inner_of(p))}  # trace only the plan's policies
  sized = planner.choices(
    blk.apply, (blk.layer(0), blk.x), store, candidates(), carry=1, measure=False, only=only
  )
  moved = {str(c.policy): c.offload_bytes for c in sized}
  return sum(moved.get(str(p), 0) for p in plan)
