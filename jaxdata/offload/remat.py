"""remat: per block, keep its residuals, offload them to a TensorStore, or recompute them."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import numpy as np

from jaxdata.offload import spill as _spill
from jaxdata.offload.store import TensorStore

_MODES = ("keep", "offload", "recompute")


@dataclasses.dataclass(frozen=True, eq=True)
class Policy:
  """What one block does with the residuals its backward pass needs.

  mode: "keep" (stay on the device), "offload" (to `store`, in `tier`), "recompute" (only the
  block's inputs are kept; backward runs the block again).
  inner: a JAX checkpoint policy (`jax.checkpoint_policies.*`) that decides which residuals exist
  at all: with "keep" and "offload" the block runs under `jax.checkpoint(fn, policy=inner)`, so
  what `inner` does not save is recomputed and what it saves is kept or offloaded.
  min_bytes: with "offload", residuals smaller than this stay on the device.
  name: how plans print it.
  """
  mode: str = "keep"
  store: TensorStore | None = None
  tier: str = "auto"
  inner: Callable[..., Any] | None = None
  min_bytes: int = 1 << 16
  name: str = ""

  def __post_init__(self):
    if self.mode not in _MODES:
      raise ValueError(f"mode must be one of {_MODES}, got {self.mode!r}")
    if self.mode == "offload" and not isinstance(self.store, TensorStore):
      raise TypeError("an offload policy needs store=jaxdata.offload.TensorStore(...)")
    _spill._tier(self.tier)

  def __str__(self) -> str:
    if self.name:
      return self.name
    inner = f"[{getattr(self.inner, '__name__', 'custom')}]" if self.inner else ""
    return f"offload({self.tier}){inner}" if self.mode == "offload" else self.mode + inner


def keep(inner=None, *, name: str = "") -> Policy:
  """Residuals stay on the device (those `inner` saves; the rest is recomputed)."""
  return Policy("keep", inner=inner, name=name)


def recompute(*, name: str = "") -> Policy:
  """Only the block's inputs stay; backward runs the block again (`jax.checkpoint`)."""
  return Policy("recompute", name=name)


def offload(store: TensorStore, tier: str = "auto", inner=None, *, min_bytes: int = 1 << 16,
            name: str = "") -> Policy:
  """Residuals (those `inner` saves) go to `store`'s `tier` ("auto", "ram", "ssd")."""
  return Policy("offload", store=store, tier=tier, inner=inner, min_bytes=min_bytes, name=name)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Spilled:
  """Where a spilled residual sat in the backward closure (its shape and dtype, no data)."""
  shape: tuple[int, ...]
  dtype: np.dtype


def remat(fn: Callable[..., Any], policy: Policy | None) -> Callable[..., Any]:
  """`fn` with its residuals handled by `policy`: same results and gradients as `fn`.

  With "offload", `fn` becomes a `jax.custom_vjp`: forward runs `fn` (under
  `jax.checkpoint(policy=inner)` when given) with `jax.vjp`, spills every residual of at least
  `min_bytes` that is not one of `fn`'s own inputs in one call, and returns a ticket; backward
  loads them (after its cotangent exists, so not earlier than needed) and applies the VJP.
  Spill and load have side effects, which `jax.checkpoint` rejects: use this transform outside
  checkpointed regions (its `inner` policy is the checkpoint inside it). It works under `jit`,
  `grad`, `vmap` and inside `lax.scan` / `nnx.scan`: a scan's backward consumes its iterations'
  spills in reverse order, which is the order a store's site returns them.

      >>> block = remat(block_fn, offload(store, inner=jax.checkpoint_policies.dots_saveable))
      >>> x, _ = jax.lax.scan(lambda x, w: (block(w, x), None), x, stacked_weights)

  policy None is "keep": `fn` itself.
  """
  if policy is not None and not isinstance(policy, Policy):
    raise TypeError(f"policy must be a jaxdata.offload.Policy or None, got {policy!r}")
  if policy is None or (policy.mode == "keep" and policy.inner is None):
    return fn
  if policy.mode == "recompute":
    return jax.checkpoint(fn, policy=jax.checkpoint_policies.nothing_saveable)
  inner = jax.checkpoint(fn, policy=policy.inner) if policy.inner is not None else fn
  if policy.mode == "keep":
    return inner
  # custom_vjp takes positional arguments only: keywords travel as one dict argument.
  offloaded = _offloaded(lambda args, kwargs: inner(*args, **kwargs), policy)

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    return offloaded(args, kwargs)
  return wrapped


def _offloaded(fn: Callable[..., Any], policy: Policy) -> Callable[..., Any]:
  site = _spill.new_site()

  @jax.custom_vjp
  def call(*args):
    return fn(*args)

  def fwd(*args):
    out, vjp = jax.vjp(fn, *args)
    leaves, treedef = jax.tree_util.tree_flatten(vjp)
    inputs = {id(a) for a in jax.tree_util.tree_leaves(args)}
    big = [i for i, l in enumerate(leaves)
           if id(l) not in inputs and np.prod(l.shape) * l.dtype.itemsize >= policy.min_bytes]
    if not big:
      return out, (vjp, None)
    ticket = _spill.spill([leaves[i] for i in big], policy.store, site=site, tier=policy.tier)
    for i in big:
      leaves[i] = _Spilled(tuple(leaves[i].shape), np.dtype(leaves[i].dtype))
    # The outputs exist only once the spill has its data: nothing downstream can start before it
    # and keep the residuals alive longer than the spill needs them.
    out, ticket = jax.lax.optimization_barrier((out, ticket))
    return out, (jax.tree_util.tree_unflatten(treedef, leaves), ticket)

  def bwd(res, g):
    vjp, ticket = res
    if ticket is not None:
      leaves, treedef = jax.tree_util.tree_flatten(vjp, is_leaf=lambda l: isinstance(l, _Spilled))
      holes = [i for i, l in enumerate(leaves) if isinstance(l, _Spilled)]
      like = [jax.ShapeDtypeStruct(leaves[i].shape, leaves[i].dtype) for i in holes]
      loaded = _spill.load(ticket, like, policy.store, site=site,
                           after=jax.tree_util.tree_leaves(g))
      for i, x in zip(holes, loaded):
        leaves[i] = x
      vjp = jax.tree_util.tree_unflatten(treedef, leaves)
    return vjp(g)

  call.defvjp(fwd, bwd)

  return functools.wraps(fn)(call)
