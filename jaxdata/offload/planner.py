"""The planner: keep, offload or recompute, per block, for a device memory budget.

It measures what each choice costs and picks, for every block, the choice that minimizes the
predicted step time while the blocks' device-resident residuals fit the budget:

- per candidate inner checkpoint policy p (what exists as a residual at all): the block's
  residual bytes r_p (traced, exact) and its forward and forward + backward times (measured
  over a few blocks in a scan, so one block's launch overheads do not hide what recompute
  costs);
- the store's bandwidth through the RAM tier (measured with spill / load).

Bytes come first and cost no compile: a budget that no plan fits fails before anything is
measured, and an inner policy none of whose choices fits any plan is not measured at all.

A block may keep(p) (r_p on the device, time t_p), offload(p) (r_p crosses PCIe, time t_p plus
the device-side copies), or recompute (time t_nothing, nothing resident). `predict` plays a plan
forward on a timeline: every spill copies into device staging on the compute stream, the host-
bound copies queue on their own engine and free the staging when done; in the backward pass the
loads come back on the other engine (PCIe is full duplex), at most two blocks ahead, and a block
waits for its residuals. Its device bytes are the peak of kept residuals plus staging over the
whole step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os
import re
from collections.abc import Callable, Collection, Sequence
from typing import Any, NamedTuple

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from jaxdata._version import __version__
from jaxdata.offload import remat as _remat
from jaxdata.offload import spill as _spill
from jaxdata.offload.store import TensorStore
from jaxdata.timing import CacheDirError, cache_dir, median_seconds

_PREFETCH_DEPTH = 2  # blocks a load brings back ahead of the one it waits for (spill_cuda.cu)
_D2D_BANDWIDTH = 1.5e12  # bytes/s of one device-to-device copy (H200: ~3 TB/s read + write)
_CAPS = (1, 2, 4)  # spill staging caps a plan may ask for, in its largest block's spills
_POOL_BLOCKS = 2  # the store's staging holds at least this many blocks' residuals
# jax.core.Tracer, or jax's private one where jax.core no longer exports it
_TRACER = getattr(jax.core, "Tracer", None) or jax._src.core.Tracer  # pyright: ignore[reportAttributeAccessIssue]


def residual_bytes(fn: Callable[..., Any], args: Sequence[Any], inner=None) -> int:
  """Bytes of the residuals `fn`'s VJP keeps (under `jax.checkpoint(policy=inner)`), its own
  inputs and the constants it closes over excluded and each array counted once: what keep
  holds on the device and offload moves."""
  return _residuals(fn, args, inner)[0]


def _residuals(fn, args, inner=None, carry: int | None = None) -> tuple[int, bool]:
  """(residual_bytes, whether the VJP keeps argument `carry` as a residual too)."""
  f = jax.checkpoint(fn, policy=inner) if inner is not None else fn
  total, kept = 0, False

  def trace(*a):
    nonlocal total, kept
    _, vjp = jax.vjp(f, *a)
    inputs = {id(x) for x in jax.tree_util.tree_leaves(a)}
    carried = {id(x) for x in jax.tree_util.tree_leaves(a[carry])} if carry is not None else set()
    seen = {}
    for l in jax.tree_util.tree_leaves(vjp):
      # Arrays the block closes over (a graph's index arrays) are constants, not tracers: they
      # exist once whatever the policy, and remat passes them as inputs (never spilled).
      if isinstance(l, _TRACER):
        seen[id(l)] = l
    total = sum(
      int(np.prod(l.shape)) * l.dtype.itemsize for i, l in seen.items() if i not in inputs
    )
    kept = bool(carried & set(seen))
    return 0

  jax.eval_shape(trace, *args)
  return total, kept


def block_seconds(
  fn: Callable[..., Any],
  args: Sequence[Any],
  inner=None,
  *,
  blocks: int = 4,
  repeats: int = 5,
  forward: bool = False,
) -> float:
  """Median time of one block's forward + backward (or forward only) under `inner`, on the
  default device: `blocks` applications of `fn(state, x) -> x` in a `lax.scan` (state shared),
  divided by `blocks`."""
  return measure_blocks(fn, args, [(inner, forward)], blocks=blocks, repeats=repeats)[0]


#: Seconds measured by `measure_blocks` in this process, by `_measurement_key`.
_MEASURED: dict[str, float] = {}


def measure_blocks(
  fn: Callable[..., Any],
  args: Sequence[Any],
  specs: Sequence[tuple[Any, bool]],
  *,
  names: Sequence[str] | None = None,
  blocks: int = 4,
  repeats: int = 5,
  progress: Callable[[str], None] | None = None,
) -> list[float]:
  """`block_seconds` for each (inner policy, forward only) of `specs` (`names`: what progress
  calls them).

  Each measurement is kept, in the process and in `$JAXDATA_CACHE_DIR/planner`, keyed by the
  device kind, the software's versions and XLA_FLAGS, the block's computation (its jaxpr: the
  layer's shapes and operations), the policy and the settings: a block measured before is not
  compiled or run again. A stack of identical layers costs one measurement per policy, and so
  does planning the same model again (compiling is most of a measurement's cost: about 4 s per
  policy for a 4096-wide GPT block on an H200)."""
  block = _block_text(fn, args, blocks, repeats)  # traced once for every spec
  keys = [_measurement_key(block, p, f) for p, f in specs]
  try:
    folder = cache_dir("planner")
  except CacheDirError:
    folder = None  # measured again next time
  for k in keys:
    if k not in _MEASURED and folder is not None and (folder / k).is_file():
      try:
        _MEASURED[k] = float((folder / k).read_text())
      except (OSError, ValueError):
        pass
  todo = [i for i, k in enumerate(keys) if k not in _MEASURED]
  concrete = [
    jax.tree_util.tree_map(
      lambda s: jnp.zeros(s.shape, s.dtype) if isinstance(s, jax.ShapeDtypeStruct) else s, a
    )
    for a in (args if todo else ())
  ]
  for i in todo:
    inner, forward = specs[i]
    if progress:
      progress(f"measuring {names[i] if names else i}")
    f = jax.checkpoint(fn, policy=inner) if inner is not None else fn

    def run(state, x, f=f):
      y, _ = jax.lax.scan(lambda h, _: (f(state, h), None), x, None, length=blocks)
      return jnp.sum(y.astype(jnp.float32))

    step = jax.jit(run if forward else jax.grad(run, argnums=(0, 1)))
    seconds = median_seconds(lambda s=step: s(*concrete), warmup=2, repeats=repeats) / blocks
    _MEASURED[keys[i]] = seconds
    if folder is not None:
      try:
        (folder / keys[i]).write_text(repr(seconds))
      except OSError:
        pass
  return [_MEASURED[k] for k in keys]


def _block_text(fn, args, blocks: int, repeats: int) -> str:
  """What a measurement of block `fn` on `args` depends on besides its policy: the device kind,
  the versions of JAX, jaxlib and jaxdata, XLA_FLAGS, the block's jaxpr on these shapes (two
  layers of the same shapes and operations have the same one) and the measurement's settings."""
  shapes = jax.tree_util.tree_map(
    lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype) if hasattr(a, "shape") else a, tuple(args)
  )
  return "|".join(
    [
      jax.devices()[0].device_kind,
      jax.__version__,
      jax.lib.__version__,  # pyright: ignore[reportPrivateImportUsage]
      __version__,
      os.environ.get("XLA_FLAGS", ""),
      f"{blocks}|{repeats}",
      str(jax.make_jaxpr(fn)(*shapes)),
    ]
  )


def _measurement_key(block: str, inner, forward: bool) -> str:
  """What `measure_blocks` measures, as a digest: the block (`_block_text`), the inner policy
  (its function and what it closes over: the names it saves) and whether forward only."""
  return hashlib.sha256(f"{_fingerprint(inner)}|{forward}|{block}".encode()).hexdigest()


def _fingerprint(x: Any, depth: int = 4) -> str:
  """A text for a checkpoint policy that is the same in every process: a function by its name
  and what it closes over, a dataclass by its fields, sets sorted (a set of names' order changes
  with string hashing)."""
  if depth and callable(x) and hasattr(x, "__code__"):
    cells = [_fingerprint(c.cell_contents, depth - 1) for c in x.__closure__ or ()]
    return f"{x.__module__}.{x.__qualname__}({','.join(cells)})"
  if depth and dataclasses.is_dataclass(x) and not isinstance(x, type):
    fields = [_fingerprint(getattr(x, f.name), depth - 1) for f in dataclasses.fields(x)]
    return f"{type(x).__module__}.{type(x).__qualname__}({','.join(fields)})"
  if depth and isinstance(x, (set, frozenset)):
    return "{" + ",".join(sorted(_fingerprint(v, depth - 1) for v in x)) + "}"
  if depth and isinstance(x, (list, tuple)):
    return "(" + ",".join(_fingerprint(v, depth - 1) for v in x) + ")"
  return repr(x)


def store_bandwidth(
  store: TensorStore, nbytes: int = 256 << 20, tier: str = "ram", *, repeats: int = 5
) -> float:
  """Bytes/s of one direction of a spill + load round trip through `store`'s `tier` (the
  median of `repeats` timed round trips)."""

  site = _spill.new_site()
  x = jnp.zeros((nbytes // 4,), jnp.float32)

  @jax.jit
  def round_trip(x):
    t = _spill.spill([x], store, site=site, tier=tier)
    return _spill.load(t, [x], store, site=site)[0]

  seconds = median_seconds(lambda: round_trip(x), warmup=2, repeats=repeats)
  return 2 * nbytes / seconds


@dataclasses.dataclass(frozen=True)
class Choice:
  """One way to run a block, with what it costs."""

  policy: _remat.Policy
  device_bytes: int  # residuals resident on the device
  offload_bytes: int  # residuals moved to the store
  seconds: float  # forward + backward, transfers not included
  forward_seconds: float = 0.0  # the forward part of `seconds`


@dataclasses.dataclass(frozen=True)
class OffloadPlan:
  """A policy per block, and what the model predicts for it."""

  policies: tuple[_remat.Policy, ...]
  device_bytes: int  # peak of kept residuals + peak of the store's staging
  offload_bytes: int
  seconds: float  # predicted forward + backward of the blocks
  spill_cap: int = 0  # the store's `device_bytes` the prediction assumes (0: no cap)

  def __str__(self) -> str:
    runs = [(p, len(list(group))) for p, group in itertools.groupby(self.policies)]
    if len(runs) <= 4:
      return ", ".join(f"{n}x {p}" for p, n in runs)
    counts: dict[Any, int] = {}
    for p, n in runs:
      counts[p] = counts.get(p, 0) + n
    return " + ".join(f"{n}x {p}" for p, n in counts.items()) + f", interleaved ({len(runs)} runs)"


def choices(
  fn: Callable[..., Any],
  args: Sequence[Any],
  store: TensorStore,
  inners: dict[str, Any],
  *,
  tier: str = "auto",
  repeats: int = 5,
  carry: int | None = None,
  progress: Callable[[str], None] | None = None,
  measure: bool = True,
  only: Collection[str] | None = None,
) -> list[Choice]:
  """Measures every candidate for one block: keep(p) and offload(p) for each inner policy p in
  `inners` (name -> policy, None meaning "save everything"), and recompute. With `measure`
  False only the bytes (traced, nothing compiled or run; every `seconds` 0): what `fits_at_all`
  and `worth_measuring` need before the planner spends a compile and timed runs per candidate.
  `only`: the inner policies to include (None: all of `inners`); the others' choices are left
  out, unmeasured.

  `carry`: the position of the argument that is the block's activation input, which a layer
  stack keeps for every layer's backward pass (where the block's VJP needs it). With it, every
  choice whose VJP keeps that input counts it too (on the device, or moved), and such offload
  choices come twice: with the input kept ("offload[p]") and offloaded as well
  ("offload[p]+in"); "offload[in]" recomputes the block from an offloaded input.
  """
  in_bytes = 0
  if carry is not None:
    in_bytes = sum(
      int(np.prod(l.shape)) * np.dtype(l.dtype).itemsize
      for l in jax.tree_util.tree_leaves(args[carry])
    )
  picked = [(n, p) for n, p in inners.items() if only is None or n in only]
  # What is timed: the forward alone, the block recomputed whole, and each inner policy.
  specs = [(None, True), (jax.checkpoint_policies.nothing_saveable, False)]
  specs += [(p, False) for _, p in picked]
  names = ["the forward pass", "recompute"] + [n for n, _ in picked]
  seconds = (
    measure_blocks(fn, args, specs, names=names, repeats=repeats, progress=progress)
    if measure
    else [0.0] * len(specs)
  )
  fwd, recompute_s = seconds[:2]

  def named(name: str) -> _remat.Policy:
    # Without a carry no policy named here offloads it, so policy_named's default stands in.
    at = 1 if carry is None else carry
    return policy_named(name, store, tier=tier, carry=at, inners=inners)

  out = [Choice(named("recompute"), in_bytes, 0, recompute_s, fwd)]
  if carry is not None:
    out.append(Choice(named("offload[in]"), 0, in_bytes, recompute_s, fwd))
  for (name, inner), s in zip(picked, seconds[2:]):
    r, needs_input = _residuals(fn, args, inner, carry)
    x = in_bytes if needs_input else 0
    out.append(Choice(named(f"keep[{name}]"), r + x, 0, s, fwd))
    out.append(Choice(named(f"offload[{name}]"), x, r, s, fwd))
    if x:
      out.append(Choice(named(f"offload[{name}]+in"), 0, r + x, s, fwd))
  return out


def least_bytes(candidates: Sequence[Sequence[Choice]]) -> int:
  """The fewest device bytes any plan over these blocks (`candidates[i]`: block i's choices)
  can need: its kept bytes plus the store's staging floor, `_POOL_BLOCKS` x the largest
  offloaded block (see `predict`). Bytes only, so it holds before any choice is timed."""
  if not candidates or any(not c for c in candidates):
    raise ValueError("least_bytes: every block needs at least one candidate choice")
  # For each cap L on the largest offload, every block takes its fewest kept bytes under L.
  caps = sorted({c.offload_bytes for cs in candidates for c in cs})
  return min(
    sum(min(c.device_bytes for c in cs if c.offload_bytes <= cap) for cs in candidates)
    + _POOL_BLOCKS * cap
    for cap in caps
    if all(any(c.offload_bytes <= cap for c in cs) for cs in candidates)
  )


def fits_at_all(candidates: Sequence[Sequence[Choice]], budget_bytes: int) -> None:
  """Raises `plan`'s and `plan_sequence`'s ValueError when not even the smallest plan over these
  blocks fits `budget_bytes`: the planners check this on `choices(..., measure=False)` before
  they compile and time any candidate, so a budget that cannot work fails at once."""
  smallest = least_bytes(candidates)
  if smallest > budget_bytes:
    raise ValueError(
      f"no plan fits a budget of {budget_bytes:,} bytes for the residuals of "
      f"{len(candidates)} blocks: the smallest plan needs at least {smallest:,} bytes"
    )


def inner_of(choice: Choice | _remat.Policy) -> str | None:
  """The inner policy p of a "keep[p]", "offload[p]" or "offload[p]+in" choice (or policy);
  None for "recompute" and "offload[in]" (the block recomputed whole)."""
  name = (choice.policy if isinstance(choice, Choice) else choice).name or ""
  m = re.fullmatch(r"(?:keep|offload)\[([^\[\]]+)\](?:\+in)?", name)
  return None if m is None or name == "offload[in]" else m.group(1)


def worth_measuring(sized: Sequence[Sequence[Choice]], budget_bytes: int) -> list[set[str]]:
  """Per block, the inner policies some plan within `budget_bytes` could use, from the choices'
  bytes (`choices(..., measure=False)` of each block): a policy all of whose choices make even
  the smallest plan (`least_bytes`, with that choice at that block) overflow the budget can
  never be picked, so the planners do not compile and time it. The plan is the same: `plan`
  and `plan_sequence` reject every mix that holds such a choice."""
  out = []
  for i, block in enumerate(sized):
    others = list(sized[:i]) + list(sized[i + 1 :])
    out.append(
      {
        p
        for c in block
        if (p := inner_of(c)) is not None and least_bytes([[c], *others]) <= budget_bytes
      }
    )
  return out


class Prediction(NamedTuple):
  seconds: float  # forward + backward of the blocks
  device_bytes: int  # peak of kept residuals + peak of the store's staging
  offload_bytes: int  # moved to the store
  spill_bytes: int  # peak of spill staging alone (what `TensorStore(device_bytes=)` caps)


def predict(
  picks: Sequence[Choice],
  bandwidth: float,
  *,
  spill_cap: int | None = None,
  d2d_bandwidth: float = _D2D_BANDWIDTH,
) -> Prediction:
  """What running `picks`, one per block, in order, costs.

  The timeline: block i's forward, then (offloaded) its residuals copied into staging on the
  compute stream; the host-bound copies run one after another on their own engine, each
  freeing its staging when done. With `spill_cap` (the store's `device_bytes`) a spill that
  would stage more waits for earlier copies, and the compute with it (one always proceeds).
  Backward in reverse: an offloaded block's residuals come back on the other engine once they
  are on the host, the engine is free, and the backward has come within `_PREFETCH_DEPTH`
  blocks of it; the block waits for them, copies them out of staging, and runs its backward.
  Kept residuals live from their forward to their backward.

  Kept residuals live in XLA's memory, staging in the store's own: each holds on to its own
  peak, so the device bytes are the sum of the two peaks.
  """
  moved = sum(c.offload_bytes for c in picks)
  # Kept residuals all live from their block's forward to its backward: nested intervals, all
  # alive when the forward ends, so their peak is their sum.
  kept = sum(c.device_bytes for c in picks)
  if bandwidth <= 0 and moved:
    return Prediction(float("inf"), kept, moved, 0)
  t, d2h_free = 0.0, 0.0
  spills, loads = [], []  # (start, end, bytes) of staging, in start and end order
  on_host = [0.0] * len(picks)
  head, staged = 0, 0  # spills[head:] may still be in flight, `staged` bytes
  for i, c in enumerate(picks):
    t += c.forward_seconds
    if c.offload_bytes:
      # The host-bound copies run in order, so spills end in the order they began.
      while head < len(spills) and spills[head][1] <= t:
        staged -= spills[head][2]
        head += 1
      if spill_cap is not None:  # wait until this spill fits (or none is in flight)
        while head < len(spills) and staged + c.offload_bytes > spill_cap:
          t = spills[head][1]
          staged -= spills[head][2]
          head += 1
      t += c.offload_bytes / d2d_bandwidth
      start = max(t, d2h_free)
      d2h_free = on_host[i] = start + c.offload_bytes / bandwidth
      spills.append((t, d2h_free, c.offload_bytes))
      staged += c.offload_bytes
  # A load queues its own entry and the `_PREFETCH_DEPTH` spilled before it; counted here in
  # blocks, not in offloaded blocks as the store counts them (the same where every block
  # offloads; elsewhere the store brings loads back earlier than this assumes).
  h2d_free, begun = 0.0, []  # begun[k]: when the k-th backward block (reversed) started
  for k, i in enumerate(reversed(range(len(picks)))):
    c = picks[i]
    if c.offload_bytes:
      trigger = begun[max(0, k - _PREFETCH_DEPTH)] if begun else t
      start = max(on_host[i], h2d_free, trigger)
      h2d_free = start + c.offload_bytes / bandwidth
      t = max(t, h2d_free)
      loads.append((start, t + c.offload_bytes / d2d_bandwidth, c.offload_bytes))
      t += c.offload_bytes / d2d_bandwidth
    begun.append(t)
    t += c.seconds - c.forward_seconds
  # The store's staging holds two of the largest block's residuals whenever a plan offloads
  # (the one copied out on XLA's stream while the next comes back), even where the timeline
  # has them apart.
  largest = max((c.offload_bytes for c in picks), default=0)
  staging = max(_peak(spills + loads), _POOL_BLOCKS * largest)
  return Prediction(t, kept + staging, moved, _peak(spills))


def _peak(intervals: list[tuple[float, float, int]]) -> int:
  """The largest sum of bytes of (start, end, bytes) intervals alive at one time."""
  # At equal times frees (negative) sort before allocations.
  events = sorted([(s, b) for s, _, b in intervals] + [(e, -b) for _, e, b in intervals])
  peak = now = 0
  for _, b in events:
    now += b
    if now > peak:
      peak = now
  return peak


def _orders(picks: list[Choice]) -> list[list[Choice]]:
  """Orders worth trying for a mix of choices: offloaded blocks first (most compute after them
  to hide their transfers), and offloaded blocks spread evenly among the others (each one's
  transfer overlaps the next blocks' compute)."""
  moved = sorted((c for c in picks if c.offload_bytes), key=lambda c: -c.offload_bytes)
  rest = sorted((c for c in picks if not c.offload_bytes), key=lambda c: -c.device_bytes)
  if not moved or not rest:
    return [moved + rest]
  spread, step = [], len(picks) / len(moved)
  slots = {int(j * step) for j in range(len(moved))}
  it_m, it_r = iter(moved), iter(rest)
  for j in range(len(picks)):
    spread.append(next(it_m) if j in slots else next(it_r))
  return [moved + rest, spread]


def plan(
  num_blocks: int,
  candidates: Sequence[Choice],
  budget_bytes: int,
  bandwidth: float,
  *,
  max_kinds: int = 3,
) -> OffloadPlan:
  """The fastest predicted mix of `candidates` over `num_blocks` identical blocks whose peak
  device bytes fit `budget_bytes` (mixes of up to `max_kinds` different choices, in the orders
  `_orders` tries). Raises ValueError when not even recomputing every block fits."""
  best, smallest = None, None
  for k in range(1, max_kinds + 1):
    for kinds in itertools.combinations(range(len(candidates)), k):
      for split in _compositions(num_blocks, k):
        picks = [candidates[i] for i, n in zip(kinds, split) for _ in range(n)]
        # Compute and the device-side copies alone bound the time from below.
        floor = sum(c.seconds + 2 * c.offload_bytes / _D2D_BANDWIDTH for c in picks)
        if best is not None and floor >= best.seconds:
          continue
        largest = max(c.offload_bytes for c in picks)
        # The staging floor (see `predict`) with the kept bytes already overflows.
        floor_bytes = sum(c.device_bytes for c in picks) + _POOL_BLOCKS * largest
        smallest = floor_bytes if smallest is None else min(smallest, floor_bytes)
        if floor_bytes > budget_bytes:
          continue
        # Offloading always runs capped: uncapped, JAX's host thread (ahead of the GPU) would
        # stage every spill of the step at once, whatever the timeline says.
        caps = [n * largest for n in _CAPS] if largest else [None]
        for order in _orders(picks):
          for cap in caps:
            p = predict(order, bandwidth, spill_cap=cap)
            if p.device_bytes <= budget_bytes and (best is None or p.seconds < best.seconds):
              best = OffloadPlan(
                tuple(c.policy for c in order), p.device_bytes, p.offload_bytes, p.seconds, cap or 0
              )
  if best is None:
    raise ValueError(
      f"no plan fits a budget of {budget_bytes:,} bytes for the residuals of "
      f"{num_blocks} blocks: the smallest plan needs at least {smallest or 0:,} "
      f"bytes"
    )
  return best


def plan_layers(
  apply: Callable[[Any, Any], Any],
  layer_state: Any,
  x: Any,
  num_layers: int,
  budget_bytes: int,
  store: TensorStore,
  inners: dict[str, Any],
  *,
  tier: str = "auto",
  repeats: int = 5,
  progress: Callable[[str], None] | None = None,
) -> tuple[OffloadPlan, float]:
  """A per-layer plan for a stack of `num_layers` identical layers `apply(layer_state, x) -> x`
  (x: the stack's carry, an array or its `jax.ShapeDtypeStruct`) so that the layers' residuals
  and inputs fit `budget_bytes` of device memory, measured on the default device; and the
  store's measured bandwidth.

  What a model gives the planner: its layer function, one layer's state, and its candidate
  inner policies (`inners`, name -> checkpoint policy, usually built from the names the layer
  tags its intermediates with: `jax.checkpoint_policies.save_only_these_names`). Every choice
  counts the layer's input (argument 1, the carry). An offloading plan sets `store.device_bytes`
  to the spill cap it was predicted with. ValueError when not even the smallest plan fits,
  found from the choices' bytes before any of them is compiled or timed (`fits_at_all`); inner
  policies that no plan within the budget could use are not measured (`worth_measuring`).
  """
  args = (layer_state, x)
  sized = [choices(apply, args, store, inners, tier=tier, carry=1, measure=False)] * num_layers
  fits_at_all(sized, budget_bytes)
  only = worth_measuring(sized, budget_bytes)[0]  # the layers are alike
  cands = choices(
    apply, args, store, inners, tier=tier, repeats=repeats, carry=1, progress=progress, only=only
  )
  bw = _probe_bandwidth(store, repeats)
  best = plan(num_layers, cands, budget_bytes, bw)
  if best.offload_bytes:
    store.device_bytes = best.spill_cap  # the staging the plan was predicted with
  return best, bw


def plan_sequence(
  candidates: Sequence[Sequence[Choice]],
  budget_bytes: int,
  bandwidth: float,
  *,
  max_plans: int = 200_000,
) -> OffloadPlan:
  """The fastest predicted plan for blocks that differ (a sampled hop each: their own shapes,
  so their own measured `candidates[i]`), run in the order given, whose peak device bytes fit
  `budget_bytes`. A depth-first search over one choice per block, pruned by the same bounds as
  `plan` (compute and device copies bound the time; kept bytes and the staging floor bound the
  memory), trying each block's fastest choices first; after `max_plans` predictions it returns
  the best found. Raises ValueError when no plan fits."""
  if not candidates or any(not c for c in candidates):
    raise ValueError("plan_sequence: every block needs at least one candidate choice")
  ordered = [sorted(c, key=lambda c: (c.seconds, c.device_bytes)) for c in candidates]
  n = len(ordered)
  # The smallest kept bytes and the fastest time that blocks i.. can still add.
  rest_bytes = [0] * (n + 1)
  rest_seconds = [0.0] * (n + 1)
  for i in reversed(range(n)):
    rest_bytes[i] = rest_bytes[i + 1] + min(c.device_bytes for c in ordered[i])
    rest_seconds[i] = rest_seconds[i + 1] + min(
      c.seconds + 2 * c.offload_bytes / _D2D_BANDWIDTH for c in ordered[i]
    )
  best: OffloadPlan | None = None
  smallest = least_bytes(ordered)
  tried = 0

  def search(i: int, picks: list[Choice], kept: int, largest: int, floor: float):
    nonlocal best, tried
    if tried >= max_plans:
      return
    if best is not None and floor + rest_seconds[i] >= best.seconds:
      return
    if kept + rest_bytes[i] + _POOL_BLOCKS * largest > budget_bytes:
      return
    if i == n:
      caps = [k * largest for k in _CAPS] if largest else [None]
      for cap in caps:
        tried += 1
        p = predict(picks, bandwidth, spill_cap=cap)
        if p.device_bytes <= budget_bytes and (best is None or p.seconds < best.seconds):
          best = OffloadPlan(
            tuple(c.policy for c in picks), p.device_bytes, p.offload_bytes, p.seconds, cap or 0
          )
      return
    for c in ordered[i]:
      search(
        i + 1,
        picks + [c],
        kept + c.device_bytes,
        max(largest, c.offload_bytes),
        floor + c.seconds + 2 * c.offload_bytes / _D2D_BANDWIDTH,
      )

  search(0, [], 0, 0, 0.0)
  if best is None:
    raise ValueError(
      f"no plan fits a budget of {budget_bytes:,} bytes for the residuals of "
      f"{n} blocks: the smallest plan needs at least {smallest:,} bytes"
    )
  return best


def plan_blocks(
  blocks: Sequence[tuple[Callable[[Any, Any], Any], Any, Any]],
  budget_bytes: int,
  store: TensorStore,
  inners: dict[str, Any],
  *,
  tier: str = "auto",
  repeats: int = 5,
  progress: Callable[[str], None] | None = None,
) -> tuple[OffloadPlan, float]:
  """`plan_layers` for layers that differ in shape (a sampled hop each, so no scan over them):
  `blocks` holds one (apply, layer_state, x) per layer in the order they run, with
  `apply(layer_state, x)` of x's shape (the layer's output padded to its input's rows, so that
  `block_seconds` can chain it) and x the layer's input (an array or its
  `jax.ShapeDtypeStruct`). Each layer is measured on its own (`choices`, carry 1); the plan is
  `plan_sequence`'s. An offloading plan sets `store.device_bytes` to its spill cap. ValueError
  when not even the smallest plan fits, before any layer is measured (`fits_at_all`); a layer's
  inner policies that no plan within the budget could use are not measured there."""
  sized = [
    choices(a, (st, x), store, inners, tier=tier, carry=1, measure=False) for a, st, x in blocks
  ]
  fits_at_all(sized, budget_bytes)
  worth = worth_measuring(sized, budget_bytes)
  cands = []
  for i, (apply, state, x) in enumerate(blocks):
    say = (lambda what, i=i: progress(f"layer {i}: {what}")) if progress else None
    cands.append(
      choices(
        apply,
        (state, x),
        store,
        inners,
        tier=tier,
        repeats=repeats,
        carry=1,
        progress=say,
        only=worth[i],
      )
    )
  bw = _probe_bandwidth(store, repeats)
  best = plan_sequence(cands, budget_bytes, bw)
  if best.offload_bytes:
    store.device_bytes = best.spill_cap
  return best, bw


def _probe_bandwidth(store: TensorStore, repeats: int = 5) -> float:
  """`store_bandwidth` through a probe sized to the store's RAM tier."""
  probe = min(256 << 20, max(4 << 20, store.ram_bytes // 4)) if store.ram_bytes else 64 << 20
  tier = "ram" if store.ram_bytes >= probe else "auto"
  return store_bandwidth(store, probe, tier, repeats=repeats)


def _compositions(n: int, k: int):
  """Ways to write n as an ordered sum of k positive integers."""
  for cuts in itertools.combinations(range(1, n), k - 1):
    yield [b - a for a, b in zip((0,) + cuts, cuts + (n,))]


def policy_named(
  name: str,
  store: TensorStore | None = None,
  *,
  inners: dict[str, Any],
  tier: str = "auto",
  carry: int = 1,
) -> _remat.Policy:
  """The policy a plan prints as `name`: "recompute", "keep[p]", "offload[p]", "offload[p]+in"
  or "offload[in]", with p one of `inners` (name -> inner checkpoint policy, as `choices`
  takes them); offloads go to `store`'s `tier`, "+in" offloads argument `carry` too."""
  m = re.fullmatch(r"recompute|(keep|offload)\[([^\[\]]+)\](\+in)?", name)
  kind, p, plus = m.groups() if m else (None, None, None)
  if not (
    name == "recompute"
    or (kind == "keep" and p in inners and not plus)
    or (kind == "offload" and (p in inners or (p == "in" and not plus)))
  ):
    known = ", ".join(
      ["recompute", "offload[in]"]
      + [f"{k}[{q}]" for k in ("keep", "offload") for q in inners]
      + ["offload[p]+in"]
    )
    raise ValueError(f"unknown policy {name!r}; one of: {known}")
  if kind is None:
    return _remat.recompute(name=name)
  assert p is not None  # "keep[p]" and "offload[p]" match the bracketed group
  if kind == "keep":
    return _remat.keep(inners[p], name=name)
  if store is None:
    raise ValueError(f"policy {name!r} offloads: it needs a TensorStore")
  if p == "in":  # recomputed from its offloaded input
    return _remat.offload(
      store, tier, jax.checkpoint_policies.nothing_saveable, inputs=(carry,), name=name
    )
  return _remat.offload(store, tier, inners[p], inputs=(carry,) if plus else (), name=name)
