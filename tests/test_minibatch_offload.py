"""Deep relational GNNs trained on sampled mini-batches under offload plans
(`jaxdata train rgat|hgt --minibatch --layers L --budget ...`): each hop's block has its own
padded shapes, so every layer call runs under its own policy (`layer_stack.run_each`) with the
plain model's loss and gradients; the planner measures each hop's layer on its own shapes
(`layer_stack.plan_each`, `offload.planner.plan_sequence`); the CLI checks one fanout per layer."""

import functools
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxdata import offload
from jaxdata.data import synthetic_mag
from jaxdata.nn import layer_stack
from jaxdata.offload import planner
from jaxdata.train import attention
from jaxdata.train.attention import minibatch as hetero

# Its tests take 5 s to minutes each: the fast tier (-m "not slow") leaves this file out.
pytestmark = pytest.mark.slow

LAYERS, HIDDEN, HEADS, FANOUTS = 4, 256, 4, (2, 2, 2, 2)


@functools.cache
def mag():
  return synthetic_mag(scale=2e-4, seed=2, num_classes=4)


def _step(net, data, seeds, plan):
  """Loss and gradients of one mini-batch step (the trainer's loss) under `plan`."""
  labels = jnp.asarray(mag().labels)[jnp.maximum(seeds, 0)]

  @nnx.jit
  def run(net):
    def loss(net):
      logits, valid = hetero.forward(net, data, seeds, jax.random.key(4), plan)
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
      return jnp.sum(jnp.where(valid, ce, 0)) / jnp.maximum(valid.sum(), 1)

    return nnx.value_and_grad(loss)(net)

  loss, grads = run(net)
  return float(loss), jax.tree.leaves(nnx.to_pure_dict(grads))


@pytest.mark.parametrize("model", ["rgat", "hgt"])
def test_deep_minibatch_step_under_a_mixed_plan_has_the_plain_loss_and_gradients(model, device):
  ds = mag()
  config = attention.TrainConfig(model=model, layers=LAYERS, hidden=HIDDEN, heads=HEADS)
  net = attention.build_model(ds, config, nnx.Rngs(0))
  seeds = jnp.asarray(np.r_[np.arange(0, 15, 3), -1].astype(np.int32))
  loader = hetero.make_loader(ds, "host", FANOUTS)
  with loader as data, offload.TensorStore(ram_bytes=256 << 20) as store:
    want_loss, want = _step(net, data, seeds, None)
    named = lambda n: layer_stack.policy_named(n, store, attention.candidates(net))  # noqa: E731
    # Offloaded (with and without the input), recomputed and kept layers, each hop its own.
    names = ["offload[edges]+in", "recompute", "offload[in]", "keep[nodes]"]
    plan = tuple(named(n) for n in names[: net.stack_layers])
    got_loss, got = _step(net, data, seeds, plan)
    assert store.stats()["spills"] > 0
  assert got_loss == pytest.approx(want_loss, rel=1e-5)
  assert len(got) == len(want)
  for g, w in zip(got, want):
    np.testing.assert_allclose(
      np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5 * float(np.abs(w).max() + 1e-30)
    )


def test_plan_sequence_fits_the_budget_with_each_blocks_own_costs():
  # Three blocks of different sizes, each with its own measured costs (made up here): the
  # search returns the fastest mix that fits, in block order, and checks every candidate.
  def choices(scale):
    return [
      planner.Choice(offload.keep(name=f"keep{scale}"), 10 * scale, 0, 1.0 * scale, 0.4 * scale),
      planner.Choice(
        offload.recompute(name=f"recompute{scale}"), scale, 0, 1.5 * scale, 0.4 * scale
      ),
    ]

  cands = [choices(9), choices(3), choices(1)]
  everything = planner.plan_sequence(cands, 10**6, 1e9)
  assert [str(p) for p in everything.policies] == ["keep9", "keep3", "keep1"]
  assert everything.device_bytes == 130
  # Without room for the big block's residuals it recomputes that one (the cheapest saving).
  tight = planner.plan_sequence(cands, 50, 1e9)
  assert [str(p) for p in tight.policies] == ["recompute9", "keep3", "keep1"]
  assert tight.device_bytes == 9 + 30 + 10
  # Brute force over every mix agrees.
  import itertools

  best = min(
    (sum(c.seconds for c in picks), picks)
    for picks in itertools.product(*cands)
    if sum(c.device_bytes for c in picks) <= 50
  )[1]
  assert tuple(c.policy for c in best) == tight.policies
  with pytest.raises(ValueError, match="no plan fits a budget of 12 bytes"):
    planner.plan_sequence(cands, 12, 1e9)


def test_cli_fanouts_must_match_layers():

  def run(*a):
    return subprocess.run(
      [sys.executable, "-m", "jaxdata.cli", *a], capture_output=True, text=True, timeout=600
    )

  for model in ("rgat", "hgt"):
    r = run("train", model, "--minibatch", "--scale", "0.0005", "--layers", "3", "--fanouts", "5,5")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "--fanouts" in r.stderr and "--layers 3" in r.stderr and "got 2" in r.stderr
  with pytest.raises(ValueError, match="2 fanouts for 3 layers"):
    hetero.train(
      mag(),
      attention.TrainConfig(model="rgat", layers=3, epochs=1),
      hetero.MinibatchConfig(fanouts=(2, 2)),
    )
