"""remat: per block, keep its residuals, offload them to a TensorStore, or recompute them."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.extend  # noqa: F401  (jax.extend.core: the closure conversion)
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
  inputs: with "offload", positions of the block's arguments whose arrays go to the store too
    when the backward pass needs them. A layer stack keeps every layer's input for the backward
    pass (its carry): `inputs=(1,)` for a block `f(params, x)` offloads x as well, and with
    `inner=jax.checkpoint_policies.nothing_saveable` the block is recomputed from an offloaded
    input. Other inputs (parameters) stay where they are.
  name: how plans print it.
  """

  mode: str = "keep"
  store: TensorStore | None = None
  tier: str = "auto"
  inner: Callable[..., Any] | None = None
  min_bytes: int = 1 << 16
  inputs: tuple[int, ...] = ()
  name: str = ""

  def __post_init__(self):
    if self.mode not in _MODES:
      raise ValueError(f"mode must be one of {_MODES}, got {self.mode!r}")
    inputs = tuple(self.inputs)
    if any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in inputs):
      raise ValueError(f"inputs must be argument positions (ints >= 0), got {self.inputs!r}")
    if inputs and self.mode != "offload":
      raise ValueError(f"inputs= offloads block inputs: it needs mode 'offload', not {self.mode!r}")
    object.__setattr__(self, "inputs", inputs)
    if self.mode == "offload" and not isinstance(self.store, TensorStore):
      raise TypeError("an offload policy needs store=jaxdata.offload.TensorStore(...)")
    _spill._tier(self.tier, self.store, what="offload policy")

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


def offload(
  store: TensorStore,
  tier: str = "auto",
  inner=None,
  *,
  min_bytes: int = 1 << 16,
  inputs: tuple[int, ...] = (),
  name: str = "",
) -> Policy:
  """Residuals (those `inner` saves) go to `store`'s `tier` ("auto", "ram", "ssd"); with
  `inputs`, the arrays of those argument positions too (see `Policy`)."""
  return Policy(
    "offload", store=store, tier=tier, inner=inner, min_bytes=min_bytes, inputs=inputs, name=name
  )


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Spilled:
  """Where a spilled residual sat in the backward closure: which array of the spill (a residual
  the closure holds twice is spilled once), its shape and dtype, no data."""

  slot: int
  shape: tuple[int, ...]
  dtype: np.dtype


def remat(fn: Callable[..., Any], policy: Policy | None) -> Callable[..., Any]:
  """`fn` with its residuals handled by `policy`: same results and gradients as `fn`.

  With "offload", `fn` becomes a `jax.custom_vjp`: forward runs `fn` (under
  `jax.checkpoint(policy=inner)` when given) with `jax.vjp`, spills every residual of at least
  `min_bytes` that is not one of `fn`'s own inputs (unless `policy.inputs` names its argument)
  in one call, and returns a ticket; backward loads them (after its cotangent exists, so not
  earlier than needed) and applies the VJP. `fn` may close over arrays (an `nnx.Module`'s
  parameters, a weight under `jax.grad`): they are passed to the custom_vjp as arguments, so they
  get their gradients and are not spilled.
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
  offloaded = _offloaded(policy)

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    # custom_vjp takes positional arguments only: keywords travel as one dict argument. What
    # the block closes over (a weight under jax.grad, an NNX module's parameters) becomes an
    # explicit argument too, so that it gets its gradient: a custom_vjp cannot close over
    # tracers.
    converted, consts = _closure_convert(lambda a, k: inner(*a, **k), args, kwargs)
    return offloaded(converted, args, kwargs, *consts)

  return wrapped


def _closure_convert(fn: Callable[..., Any], *args: Any) -> tuple[Callable[..., Any], list]:
  """(g, consts) with g(*args, *consts) == fn(*args), and every array fn closes over among
  consts: `jax.closure_convert`, without its cache. That cache is keyed on fn and the argument
  types, so the same block called on new closed-over values (an NNX module under a new trace)
  would get the old trace's values back, and it would keep closed-over arrays alive."""
  closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
  out_tree = jax.tree_util.tree_structure(out_shape)
  jaxpr = closed.jaxpr

  def converted(*args_and_consts):
    flat = jax.tree_util.tree_leaves(args_and_consts[: len(args)])
    consts = list(args_and_consts[len(args) :])
    out = jax.extend.core.jaxpr_as_fun(jax.extend.core.ClosedJaxpr(jaxpr, consts))(*flat)
    return jax.tree_util.tree_unflatten(out_tree, out)

  return converted, list(closed.consts)


def _offloaded(policy: Policy) -> Callable[..., Any]:
  """custom_vjp(fn, args, kwargs, *consts): fn(args, kwargs, *consts) with its residuals
  spilled to the policy's store in the forward pass and loaded back in the backward pass."""
  site = _spill.new_site()

  @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
  def call(fn, *args):
    return fn(*args)

  def fwd(fn, *args):
    out, vjp = jax.vjp(fn, *args)
    leaves, treedef = jax.tree_util.tree_flatten(vjp)
    positional = args[0]  # fn takes (positional arguments, keyword arguments, *consts)
    if policy.inputs and max(policy.inputs) >= len(positional):
      raise ValueError(
        f"remat: the policy offloads argument {max(policy.inputs)}, but the block "
        f"was called with {len(positional)} positional arguments"
      )
    movable = {id(a) for i in policy.inputs for a in jax.tree_util.tree_leaves(positional[i])}
    inputs = {id(a) for a in jax.tree_util.tree_leaves(args)} - movable
    slots: dict[int, int] = {}  # id of a spilled array -> its place in the spill
    spilled = []
    for i, l in enumerate(leaves):
      if id(l) in inputs or np.prod(l.shape) * l.dtype.itemsize < policy.min_bytes:
        continue
      if id(l) not in slots:
        slots[id(l)] = len(spilled)
        spilled.append(l)
      leaves[i] = _Spilled(slots[id(l)], tuple(l.shape), np.dtype(l.dtype))
    if not spilled:
      return out, (vjp, None)
    ticket = _spill.spill(spilled, policy.store, site=site, tier=policy.tier)
    # The outputs exist only once the spill has its data: nothing downstream can start before it
    # and keep the residuals alive longer than the spill needs them.
    out, ticket = jax.lax.optimization_barrier((out, ticket))
    return out, (jax.tree_util.tree_unflatten(treedef, leaves), ticket)

  def bwd(fn, res, g):
    del fn  # the VJP closure has what it needs
    vjp, ticket = res
    if ticket is not None:
      leaves, treedef = jax.tree_util.tree_flatten(vjp, is_leaf=lambda l: isinstance(l, _Spilled))
      holes = {l.slot: l for l in leaves if isinstance(l, _Spilled)}
      like = [jax.ShapeDtypeStruct(holes[k].shape, holes[k].dtype) for k in range(len(holes))]
      loaded = _spill.load(
        ticket, like, policy.store, site=site, after=jax.tree_util.tree_leaves(g)
      )
      leaves = [loaded[l.slot] if isinstance(l, _Spilled) else l for l in leaves]
      vjp = jax.tree_util.tree_unflatten(treedef, leaves)
    return vjp(g)

  call.defvjp(fwd, bwd)
  return call
