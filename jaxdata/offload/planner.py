"""The planner: keep, offload or recompute, per block, for a device memory budget.

It measures what each choice costs and picks, for every block, the choice that minimizes the
predicted step time while the blocks' device-resident residuals fit the budget:

- per candidate inner checkpoint policy p (what exists as a residual at all): the block's
  residual bytes r_p (traced, exact) and its forward + backward time t_p (measured);
- the store's round-trip bandwidth through the RAM tier (measured with spill / load).

A block may keep(p) (r_p on the device, time t_p), offload(p) (r_p crosses PCIe while other
blocks compute, time t_p plus the device-side copies), or recompute (time t_nothing, nothing
resident). The transfers of all offloaded blocks overlap compute: what does not fit in the
forward time (host-bound) or the backward time (device-bound) is added to the step. Offloading
also holds a few blocks' residuals in the store's device staging (one in flight to the host,
the one being loaded and the one prefetched), which counts against the budget.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxdata.offload import remat as _remat
from jaxdata.offload import spill as _spill
from jaxdata.offload.store import TensorStore

_STAGED_BLOCKS = 3      # device staging held by offloading, in blocks' residuals
_D2D_BANDWIDTH = 1.5e12  # bytes/s of one device-to-device copy (H200: ~3 TB/s read + write)


def residual_bytes(fn: Callable[..., Any], args: Sequence[Any], inner=None) -> int:
  """Bytes of the residuals `fn`'s VJP keeps (under `jax.checkpoint(policy=inner)`), its own
  inputs excluded: what keep holds on the device and offload moves."""
  f = jax.checkpoint(fn, policy=inner) if inner is not None else fn
  total = 0

  def trace(*a):
    nonlocal total
    _, vjp = jax.vjp(f, *a)
    inputs = {id(x) for x in jax.tree_util.tree_leaves(a)}
    total = sum(int(np.prod(l.shape)) * l.dtype.itemsize
                for l in jax.tree_util.tree_leaves(vjp) if id(l) not in inputs)
    return 0

  jax.eval_shape(trace, *args)
  return total


def block_seconds(fn: Callable[..., Any], args: Sequence[Any], inner=None, *,
                  repeats: int = 5) -> float:
  """Median time of one forward + backward of `fn` (under `inner`) on the default device."""
  from jaxdata.bench.common import median_seconds  # pylint: disable=g-import-not-at-top
  f = jax.checkpoint(fn, policy=inner) if inner is not None else fn

  def loss(*a):
    return sum(jnp.sum(o.astype(jnp.float32)) for o in jax.tree_util.tree_leaves(f(*a)))

  step = jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))
  concrete = [jax.tree_util.tree_map(
      lambda s: jnp.zeros(s.shape, s.dtype) if isinstance(s, jax.ShapeDtypeStruct) else s, a)
              for a in args]
  return median_seconds(lambda: step(*concrete), warmup=2, repeats=repeats)


def store_bandwidth(store: TensorStore, nbytes: int = 256 << 20, tier: str = "ram") -> float:
  """Bytes/s of one direction of a spill + load round trip through `store`'s `tier`."""
  from jaxdata.bench.common import median_seconds  # pylint: disable=g-import-not-at-top
  site = _spill.new_site()
  x = jnp.zeros((nbytes // 4,), jnp.float32)

  @jax.jit
  def round_trip(x):
    t = _spill.spill([x], store, site=site, tier=tier)
    return _spill.load(t, [x], store, site=site)[0]

  seconds = median_seconds(lambda: round_trip(x), warmup=2, repeats=5)
  return 2 * nbytes / seconds


@dataclasses.dataclass(frozen=True)
class Choice:
  """One way to run a block, with what it costs."""
  policy: _remat.Policy
  device_bytes: int     # residuals resident on the device
  offload_bytes: int    # residuals moved to the store
  seconds: float        # forward + backward, transfers not included


@dataclasses.dataclass(frozen=True)
class Plan:
  """A policy per block, and what the model predicts for it."""
  policies: tuple[_remat.Policy, ...]
  device_bytes: int         # resident residuals + store staging
  offload_bytes: int
  seconds: float            # predicted forward + backward of the blocks

  def __str__(self) -> str:
    runs = []
    for p, group in itertools.groupby(self.policies):
      runs.append(f"{len(list(group))}x {p}")
    return ", ".join(runs)


def choices(fn: Callable[..., Any], args: Sequence[Any], store: TensorStore,
            inners: dict[str, Any], *, tier: str = "auto", repeats: int = 5,
            progress: Callable[[str], None] | None = None) -> list[Choice]:
  """Measures every candidate for one block: keep(p) and offload(p) for each inner policy p in
  `inners` (name -> policy, None meaning "save everything"), and recompute."""
  out = []
  recompute_s = block_seconds(fn, args, jax.checkpoint_policies.nothing_saveable, repeats=repeats)
  out.append(Choice(_remat.recompute(name="recompute"), 0, 0, recompute_s))
  for name, inner in inners.items():
    if progress:
      progress(name)
    r = residual_bytes(fn, args, inner)
    s = block_seconds(fn, args, inner, repeats=repeats)
    out.append(Choice(_remat.keep(inner, name=f"keep[{name}]"), r, 0, s))
    out.append(Choice(_remat.offload(store, tier, inner, name=f"offload[{name}]"), 0, r,
                      s + 2 * r / _D2D_BANDWIDTH))
  return out


def predict(picks: Sequence[Choice], bandwidth: float) -> tuple[float, int, int]:
  """(seconds, device bytes, offloaded bytes) of running these choices, one per block."""
  compute = sum(c.seconds for c in picks)
  moved = sum(c.offload_bytes for c in picks)
  staged = _STAGED_BLOCKS * max((c.offload_bytes for c in picks), default=0)
  transfer = moved / bandwidth if bandwidth > 0 else (float("inf") if moved else 0.0)
  exposed = max(0.0, transfer - compute / 3) + max(0.0, transfer - 2 * compute / 3)
  return compute + exposed, sum(c.device_bytes for c in picks) + staged, moved


def plan(num_blocks: int, candidates: Sequence[Choice], budget_bytes: int, bandwidth: float, *,
         max_kinds: int = 3) -> Plan:
  """The fastest predicted mix of `candidates` over `num_blocks` identical blocks whose device
  bytes fit `budget_bytes` (mixes of up to `max_kinds` different choices; offloaded blocks come
  first, where their transfers have the most compute to hide behind). Raises ValueError when
  not even recomputing every block fits."""
  best = None
  for k in range(1, max_kinds + 1):
    for kinds in itertools.combinations(range(len(candidates)), k):
      for split in _compositions(num_blocks, k):
        picks = [candidates[i] for i, n in zip(kinds, split) for _ in range(n)]
        seconds, device, moved = predict(picks, bandwidth)
        if device > budget_bytes or (best is not None and seconds >= best.seconds):
          continue
        picks.sort(key=lambda c: -c.offload_bytes)
        best = Plan(tuple(c.policy for c in picks), device, moved, seconds)
  if best is None:
    raise ValueError(f"no plan fits a budget of {budget_bytes} bytes for the residuals")
  return best


def _compositions(n: int, k: int):
  """Ways to write n as an ordered sum of k positive integers."""
  for cuts in itertools.combinations(range(1, n), k - 1):
    yield [b - a for a, b in zip((0,) + cuts, cuts + (n,))]


def gpt_candidates() -> dict[str, Any]:
  """Inner policies worth trying for a `jaxdata.nn.GPT` block (by its checkpoint names)."""
  only = jax.checkpoint_policies.save_only_these_names
  return {
      "all": None,
      "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
      "proj": only("qkv", "attn_out", "mlp_up", "mlp_down"),
      "mlp": only("mlp_up", "mlp_down"),
      "attn": only("qkv", "attn_out"),
  }


def plan_for_model(model, batch_shape: tuple[int, int], budget_bytes: int, store: TensorStore, *,
                   tier: str = "auto", repeats: int = 5, verbose: bool = True) -> list[_remat.Policy]:
  """A per-layer plan for a `jaxdata.nn.GPT` (or any model with `jaxdata.nn.gpt.block_fn`) so that
  the layers' residuals fit `budget_bytes` of device memory, measured on the default device."""
  from jaxdata.nn import gpt  # pylint: disable=g-import-not-at-top
  blk = gpt.block_fn(model, batch_shape)
  say = (lambda name: print(f"  measuring a block under {name} ...", flush=True)) if verbose else None
  cands = choices(blk.apply, (blk.layer(0), blk.x), store, gpt_candidates(), tier=tier,
                  repeats=repeats, progress=say)
  probe = min(256 << 20, max(4 << 20, store.ram_bytes // 4)) if store.ram_bytes else 64 << 20
  bw = store_bandwidth(store, probe, tier="ram" if store.ram_bytes >= probe else "auto")
  best = plan(model.cfg.layers, cands, budget_bytes, bw)
  if verbose:
    print(f"  plan: {best}  (predicted {best.seconds * 1e3:.1f} ms of layers, "
          f"{best.device_bytes / 2**30:.2f} GiB resident, {best.offload_bytes / 2**30:.2f} GiB "
          f"offloaded at {bw / 1e9:.1f} GB/s)", flush=True)
  return list(best.policies)
