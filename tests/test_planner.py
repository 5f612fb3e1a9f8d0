"""The offload planner's cost model and search, against hand-worked timelines and brute force."""

import itertools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdata import offload
from jaxdata.offload import planner
from jaxdata.offload.planner import Choice, predict

MB = 1 << 20


def keep(name, nbytes, seconds, fwd):
  return Choice(offload.keep(name=name), nbytes, 0, seconds, fwd)


def moved(name, nbytes, seconds, fwd):
  return Choice(offload.recompute(name=name), 0, nbytes, seconds, fwd)


def test_predict_keep_and_recompute_add_up():
  a, b = keep("a", 10 * MB, 3.0, 1.0), keep("r", 0, 4.0, 1.0)
  seconds, device, off, spill = predict([a, b, a], bandwidth=1e9)
  assert seconds == pytest.approx(10.0) and device == 20 * MB and off == 0 and spill == 0


def test_predict_offload_timeline_by_hand():
  # Two blocks, the first offloaded: 100 MB at 100 MB/s is 1 s each way, D2D is free (huge).
  o, k = moved("o", 100 * MB, 3.0, 1.0), keep("k", 0, 3.0, 1.0)
  bw = 100 * MB
  # forward: o ends at 1 (its D2H runs 1..2), k ends at 2; backward: k 2..4, o's load was
  # queued when the backward began (2) and took 2..3: o's backward 4..6.
  seconds, device, _, spill = predict([o, k], bw, d2d_bandwidth=1e30)
  assert seconds == pytest.approx(6.0)
  assert spill == 100 * MB  # staged on the way out, then again on the way back
  assert device == planner._POOL_BLOCKS * 100 * MB  # the pool holds two blocks (measured)
  # Alone, the load cannot hide: forward 0..1, D2H 1..2, H2D 2..3, backward 3..5.
  seconds = predict([o], bw, d2d_bandwidth=1e30).seconds
  assert seconds == pytest.approx(5.0)


def test_predict_staging_piles_up_when_pcie_is_slower_than_compute():
  o = moved("o", 100 * MB, 0.3, 0.1)  # 0.1 s of forward makes 1 s of transfer
  p = predict([o] * 4, 100 * MB, d2d_bandwidth=1e30)
  assert (
    p.device_bytes == p.spill_bytes == 4 * 100 * MB
  )  # all four still staged when the forward ends
  p = predict([o] * 4, 1e15, d2d_bandwidth=1e30)
  assert p.spill_bytes == 100 * MB
  # A fast link drains each spill before the next arrives; the peak is the loads brought back
  # ahead of the block being run.
  assert p.device_bytes == planner._PREFETCH_DEPTH * 100 * MB


def test_predict_spill_cap_trades_time_for_staging():
  # Two offloaded blocks (0.1 s of forward, 1 s of copy each), then a long kept block. Uncapped,
  # both spills are staged at once and the third block computes while they drain; capped at one
  # block's spill, the second block waits 0.9 s for the first copy before spilling.
  o, k = moved("o", 100 * MB, 0.3, 0.1), keep("k", 0, 6.0, 2.0)
  free = predict([o, o, k], 100 * MB, d2d_bandwidth=1e30)
  capped = predict([o, o, k], 100 * MB, spill_cap=100 * MB, d2d_bandwidth=1e30)
  assert (free.spill_bytes, capped.spill_bytes) == (200 * MB, 100 * MB)
  assert free.seconds == pytest.approx(6.6) and capped.seconds == pytest.approx(7.5)


def test_predict_needs_bandwidth_for_offload():
  assert predict([moved("o", MB, 1.0, 0.5)], 0.0)[0] == float("inf")
  assert predict([keep("k", MB, 1.0, 0.5)], 0.0)[0] == pytest.approx(1.0)


CANDS = [
  keep("recompute", 0, 4.0, 1.0),
  keep("keep", 300 * MB, 3.0, 1.0),
  keep("keep-some", 100 * MB, 3.3, 1.0),
  moved("offload", 300 * MB, 3.0, 1.0),
]


def test_plan_extremes():
  big = planner.plan(4, CANDS, 1 << 40, bandwidth=1e12)
  assert {str(p) for p in big.policies} <= {"keep", "offload"}  # both as fast as it gets
  assert big.seconds == pytest.approx(12.0, rel=1e-3)
  none = planner.plan(4, CANDS, 0, bandwidth=0.0)
  assert [str(p) for p in none.policies] == ["recompute"] * 4
  with pytest.raises(ValueError, match="no plan fits"):
    planner.plan(4, [keep("keep", 1, 1.0, 0.5)], 0, bandwidth=1e9)


@pytest.mark.parametrize("budget_mb", [0, 100, 250, 400, 700, 1200])
def test_plan_is_the_best_of_every_fitting_mix(budget_mb):
  """Against brute force over every assignment (the planner searches mixes of up to 3 kinds in
  two orders; with 4 blocks and these candidates, that covers the best assignment's multiset)."""
  bw = 150 * MB
  best = planner.plan(4, CANDS, budget_mb * MB, bw)
  assert best.device_bytes <= budget_mb * MB
  brute = min(
    (
      predict(list(p), bw)[0]
      for p in itertools.product(CANDS, repeat=4)
      if predict(list(p), bw)[1] <= budget_mb * MB
    ),
    default=None,
  )
  assert brute is not None
  assert brute - 1e-9 <= best.seconds <= brute * 1.05


def test_least_bytes_is_the_smallest_plans_floor_and_fails_before_any_timing(monkeypatch):
  """`least_bytes`: every block's fewest kept bytes under a cap on the largest offload, plus the
  staging floor; exactly the smallest floor `plan` finds over identical blocks. A budget below
  it fails in `plan_layers` before one candidate is compiled or timed."""
  blocks = [CANDS] * 4
  assert planner.least_bytes(blocks) == 0  # recompute everywhere
  costly = [keep("keep", 300 * MB, 3.0, 1.0), moved("offload", 200 * MB, 3.0, 1.0)]
  # all kept: 4 x 300 MB; any offload: 2 x 200 MB of staging, the rest kept or moved too
  assert planner.least_bytes([costly] * 4) == 2 * 200 * MB
  # A block that can only keep: keeping both (600 MB) beats staging the other's offload (700).
  assert planner.least_bytes([costly[:1], costly]) == 2 * 300 * MB
  with pytest.raises(ValueError, match="the smallest plan needs at least 419,430,400 bytes"):
    planner.plan(4, costly, 400 * MB - 1, bandwidth=1e12)  # plan's own floor: the same bytes

  def no_timing(*args, **kwargs):
    raise AssertionError("timed a candidate under a budget no plan fits")

  monkeypatch.setattr(planner, "measure_blocks", no_timing)
  w = jnp.ones((8, 8), jnp.float32)
  x = jax.ShapeDtypeStruct((4, 8), jnp.float32)  # 128 bytes: any plan keeps or stages them
  with offload.TensorStore(ram_bytes=1 << 20) as store:
    with pytest.raises(ValueError, match="no plan fits a budget of 16 bytes .* 3 blocks"):
      planner.plan_layers(lambda w, x: jnp.sin(x @ w), w, x, 3, 16, store, {"all": None})


def _named(name, device_bytes, offload_bytes, seconds):
  return Choice(offload.keep(name=name), device_bytes, offload_bytes, seconds, seconds / 3)


def test_policies_no_plan_can_use_are_not_measured_and_the_plan_is_the_same():
  """`worth_measuring` leaves out an inner policy only where every one of its choices overflows
  even the smallest plan: over random candidates and budgets, the plan of what is left is the
  plan of everything (`plan` rejects every mix that holds such a choice)."""
  rng = np.random.default_rng(0)
  pruned = 0
  for _ in range(40):
    cands = [_named("recompute", 8 * MB, 0, 4.0), _named("offload[in]", 0, 8 * MB, 4.0)]
    for p in ("a", "b", "c"):
      r, s = int(rng.integers(1, 64)) * MB, float(rng.uniform(2.0, 4.0))
      cands += [_named(f"keep[{p}]", r + 8 * MB, 0, s), _named(f"offload[{p}]", 8 * MB, r, s)]
      cands.append(_named(f"offload[{p}]+in", 0, r + 8 * MB, s))
    assert {planner.inner_of(c) for c in cands} == {None, "a", "b", "c"}
    budget = int(rng.integers(16, 200)) * MB
    worth = planner.worth_measuring([cands] * 3, budget)
    assert worth[0] == worth[1] == worth[2]
    kept = [c for c in cands if planner.inner_of(c) in worth[0] | {None}]
    everything = planner.plan(3, cands, budget, bandwidth=20 * MB)
    assert planner.plan(3, kept, budget, bandwidth=20 * MB) == everything
    if worth[0] != {"a", "b", "c"}:  # what was left out is in no fitting plan at all
      pruned += 1
      left_out = [c for c in cands if c not in kept]
      assert all(planner.least_bytes([[c]] + [cands] * 2) > budget for c in left_out)
  assert 5 <= pruned < 40  # budgets that left some policies out, and some that kept all


def test_residual_bytes_counts_what_the_vjp_keeps():
  w = jnp.ones((8, 16), jnp.float32)

  def f(w, x):
    h = jnp.sin(x @ w)  # keeps cos(x @ w) or x @ w: [4, 16] float32
    return h @ w.T

  x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
  everything = planner.residual_bytes(f, (w, x))
  nothing = planner.residual_bytes(f, (w, x), jax.checkpoint_policies.nothing_saveable)
  dots = planner.residual_bytes(f, (w, x), jax.checkpoint_policies.dots_saveable)
  assert nothing == 0  # inputs only: they are not counted
  assert dots == 4 * 16 * 4  # x @ w
  assert everything >= dots


def test_block_seconds_and_candidates_on_a_gpt_block():
  from flax import nnx

  from jaxdata.nn import gpt_plan
  from jaxdata.nn.gpt import GPT, GPTConfig, block_fn

  cfg = GPTConfig(vocab=32, layers=2, hidden=32, heads=2, seq=16, dtype=jnp.float32)
  blk = block_fn(GPT(cfg, rngs=nnx.Rngs(0)), (2, 16))
  args = (blk.layer(0), blk.x)
  sizes = {n: planner.residual_bytes(blk.apply, args, p) for n, p in gpt_plan.candidates().items()}
  unit = 2 * 16 * 32 * 4  # one (batch, seq, hidden) float32 activation
  assert sizes["ctx"] >= 2 * unit  # the attention output and the projection's
  assert sizes["attn"] >= 5 * unit and sizes["mlp"] >= 5 * unit
  assert sizes["proj"] > sizes["attn"] > sizes["ctx"] and sizes["proj"] > sizes["mlp"]
  assert sizes["all"] > sizes["proj"]
  t = planner.block_seconds(blk.apply, args, None, blocks=2, repeats=1)
  f = planner.block_seconds(blk.apply, args, None, blocks=2, repeats=1, forward=True)
  assert np.isfinite(t) and t > 0 and np.isfinite(f) and f > 0


_BLOCK = """
import jax, jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
save = jax.checkpoint_policies.save_only_these_names
inners = {"a": save("a"), "b": save("b"), "ab": save("a", "b", "c", "d")}

def f(w, x):
  h = checkpoint_name(jnp.tanh(x @ w), "a")
  return checkpoint_name(jnp.sin(h @ w), "b")

w, x = jnp.ones((16, 16), jnp.float32), jax.ShapeDtypeStruct((8, 16), jnp.float32)
"""


@pytest.mark.default_precision  # the other process computes the keys at JAX's default
def test_a_block_is_measured_once_per_computation(monkeypatch, tmp_path):
  """`choices` compiles and times each policy of a block once: another layer of the same shapes
  and operations (other weights) reuses the measurements, a block of other shapes does not, two
  policies of one kind that save different names are told apart, and another process (other
  string hashing) finds the measurements in the cache folder."""
  monkeypatch.setenv("JAXDATA_CACHE_DIR", str(tmp_path))
  monkeypatch.setattr(planner, "_MEASURED", {})
  timed = []
  real = planner.median_seconds
  monkeypatch.setattr(planner, "median_seconds", lambda fn, **k: timed.append(1) or real(fn, **k))
  space = {}
  exec(_BLOCK, space)
  f, w, x, inners = space["f"], space["w"], space["x"], space["inners"]
  with offload.TensorStore(ram_bytes=1 << 20) as store:
    first = planner.choices(f, (w, x), store, inners, repeats=1, carry=1)
    assert len(timed) == 5  # the forward pass, recompute, "a", "b" and "ab"
    other = planner.choices(f, (2 * w, x), store, inners, repeats=1, carry=1)
    assert len(timed) == 5 and [c.seconds for c in other] == [c.seconds for c in first]
    taller = jax.ShapeDtypeStruct((32, 16), jnp.float32)
    planner.choices(f, (w, taller), store, inners, repeats=1, carry=1)
    assert len(timed) == 10
    monkeypatch.setattr(planner, "_MEASURED", {})  # as in a new process: from the folder
    again = planner.choices(f, (w, x), store, inners, repeats=1, carry=1)
    assert len(timed) == 10 and [c.seconds for c in again] == [c.seconds for c in first]
  assert all(np.isfinite(c.seconds) and c.seconds > 0 for c in first)
  block = planner._block_text(f, (w, x), 4, 5)
  keys = [planner._measurement_key(block, p, False) for p in inners.values()]
  assert len(set(keys)) == 3
  code = _BLOCK + (
    "from jaxdata.offload import planner\n"
    "block = planner._block_text(f, (w, x), 4, 5)\n"
    "print(*[planner._measurement_key(block, p, False) for p in inners.values()])"
  )
  # the key names the device kind: the fresh process inherits this one's platform choice
  env = {**os.environ, "PYTHONHASHSEED": "12345"}
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
  assert out.returncode == 0, out.stderr
  assert out.stdout.split() == keys


def test_choices_count_the_carried_input():
  """With carry=1 every choice counts the block's input x: on the device for keep, recompute and
  plain offload, moved for '+in' and 'offload[in]'; the policies offload what they say."""
  w = jnp.ones((16, 16), jnp.float32)
  x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
  f = lambda w, x: jnp.sin(x @ w) @ w  # noqa: E731
  x_bytes, r = 8 * 16 * 4, planner.residual_bytes(f, (w, x))
  with offload.TensorStore(ram_bytes=1 << 20) as store:
    got = {
      str(c.policy): (c.device_bytes, c.offload_bytes)
      for c in planner.choices(f, (w, x), store, {"all": None}, repeats=1, carry=1)
    }
    assert got == {
      "recompute": (x_bytes, 0),
      "offload[in]": (0, x_bytes),
      "keep[all]": (r + x_bytes, 0),
      "offload[all]": (x_bytes, r),
      "offload[all]+in": (0, r + x_bytes),
    }
    plain = planner.choices(f, (w, x), store, {"all": None}, repeats=1)
    assert {str(c.policy): (c.device_bytes, c.offload_bytes) for c in plain} == {
      "recompute": (0, 0),
      "keep[all]": (r, 0),
      "offload[all]": (0, r),
    }
    moved = {
      str(c.policy): c.policy
      for c in planner.choices(f, (w, x), store, {"all": None}, repeats=1, carry=1)
    }
    assert moved["offload[in]"].inputs == (1,) and moved["offload[all]+in"].inputs == (1,)
    assert moved["offload[all]"].inputs == ()
    # A block whose VJP does not keep its input (sin keeps cos x and sin x): nothing to count
    # for "all", no "+in" variant; recomputing still needs the input.
    g = lambda w, x: jnp.sin(x) @ w  # noqa: E731
    r_g = planner.residual_bytes(g, (w, x))
    got = {
      str(c.policy): (c.device_bytes, c.offload_bytes)
      for c in planner.choices(g, (w, x), store, {"all": None}, repeats=1, carry=1)
    }
    assert got == {
      "recompute": (x_bytes, 0),
      "offload[in]": (0, x_bytes),
      "keep[all]": (r_g, 0),
      "offload[all]": (0, r_g),
    }


def test_policy_named_round_trips_the_names_plans_print():
  from jaxdata.nn import gpt_plan

  with offload.TensorStore(ram_bytes=1 << 20) as store:
    for name, mode, inputs in [
      ("recompute", "recompute", ()),
      ("keep[dots]", "keep", ()),
      ("offload[mlp]", "offload", ()),
      ("offload[mlp]+in", "offload", (1,)),
      ("offload[in]", "offload", (1,)),
    ]:
      p = gpt_plan.policy_named(name, store)
      assert (str(p), p.mode, p.inputs) == (name, mode, inputs)
      if mode == "offload":
        assert p.store is store
    assert (
      gpt_plan.policy_named("offload[in]", store).inner is jax.checkpoint_policies.nothing_saveable
    )
    for bad in ("keep[in]", "keep[dots]+in", "offload[in]+in", "offload[nope]", "dots", ""):
      with pytest.raises(ValueError, match="unknown policy"):
        gpt_plan.policy_named(bad, store)
  with pytest.raises(ValueError, match="needs a TensorStore"):
    gpt_plan.policy_named("offload[attn]")
  assert gpt_plan.policy_named("keep[attn]").mode == "keep"
