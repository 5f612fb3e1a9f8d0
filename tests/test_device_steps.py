"""train.common.DeviceSteps: one dispatch per step gives run_epoch's results, keys and order,
and an interrupted epoch leaves the model with the last completed step's parameters."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxdata.train import common


def _setup():
  model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  data = jnp.asarray(np.random.default_rng(0).standard_normal((20, 3)), jnp.float32)

  def fn(model, optimizer, data, seeds, key):
    noise = jax.random.normal(key, (seeds.shape[0],))
    valid = seeds >= 0
    x = data[jnp.maximum(seeds, 0)]

    def loss_fn(model):
      err = jnp.where(valid, model(x)[:, 0] - noise, 0)
      return jnp.sum(err**2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss, jnp.int32(0), valid.sum(), jnp.int32(0)

  return model, optimizer, data, fn


def test_device_steps_equal_run_epoch_and_survive_an_interruption():
  rows = common.seed_batches(np.arange(20), 6, np.random.default_rng(1))  # the last one padded
  key = jax.random.key(5)
  model, optimizer, data, fn = _setup()
  jitted = nnx.jit(fn)
  want = common.run_epoch(lambda s, k: jitted(model, optimizer, data, s, k), rows, key)
  want_params = jax.tree.leaves(nnx.state(model))

  model2, optimizer2, data2, fn2 = _setup()
  steps = common.DeviceSteps(model2, optimizer2, fn2)
  got = steps.epoch((data2,), rows, key)
  assert (got["loss"], got["seeds"], got["batches"]) == pytest.approx(
    (want["loss"], want["seeds"], want["batches"]), rel=1e-6
  )
  for a, b in zip(want_params, jax.tree.leaves(nnx.state(model2))):
    np.testing.assert_allclose(a, b, rtol=1e-6)

  # interrupted after its second step: the model holds that step's parameters and still works
  model3, optimizer3, data3, fn3 = _setup()
  two = common.run_epoch(lambda s, k: nnx.jit(fn3)(model3, optimizer3, data3, s, k), rows[:2], key)
  del two
  model4, optimizer4, data4, fn4 = _setup()

  def stop(done, total):
    if done == 2:
      raise KeyboardInterrupt

  with pytest.raises(KeyboardInterrupt):
    common.DeviceSteps(model4, optimizer4, fn4).epoch((data4,), rows, key, stop)
  for a, b in zip(jax.tree.leaves(nnx.state(model3)), jax.tree.leaves(nnx.state(model4))):
    np.testing.assert_allclose(a, b, rtol=1e-6)
  model4(jnp.ones((1, 3)))  # its arrays are live


def test_a_requested_stop_ends_the_epoch_after_the_current_step():
  """`command.stop_requested()` (a SIGTERM under `soft_stop`) ends `DeviceSteps.epoch` and
  `run_epoch` after the step in progress: their records count the steps that ran."""
  from jaxdata import command

  rows = common.seed_batches(np.arange(20), 6, np.random.default_rng(1))
  key = jax.random.key(5)

  def stop_at_two(done, total):
    if done == 2:
      command._stop_requested.set()

  try:
    model, optimizer, data, fn = _setup()
    got = common.DeviceSteps(model, optimizer, fn).epoch((data,), rows, key, stop_at_two)
    command._stop_requested.clear()
    model2, optimizer2, data2, fn2 = _setup()
    jitted = nnx.jit(fn2)
    step = lambda s, k: jitted(model2, optimizer2, data2, s, k)  # noqa: E731
    want = common.run_epoch(step, rows, key, stop_at_two)
  finally:
    command._stop_requested.clear()
  assert got["batches"] == want["batches"] == 2 and got["seeds"] == want["seeds"] == 12
  for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(model2))):
    np.testing.assert_allclose(a, b, rtol=1e-6)


@pytest.mark.parametrize("limit", [None, 2, 4, 9])
def test_seed_batches_shuffle_limit_and_pad(limit):
  """Shuffled batches are distinct ids of the set (a limit draws only what it keeps), padded
  with -1 only in the last batch of a whole epoch; the same generator seed gives the same rows."""
  ids = np.arange(100, 150)
  rows = common.seed_batches(ids, 6, np.random.default_rng(3), limit)
  batches = -(-len(ids) // 6) if limit is None else min(limit, -(-len(ids) // 6))
  assert rows.shape == (batches, 6) and rows.dtype == np.int32
  real = rows[rows >= 0]
  assert len(real) == min(len(ids), batches * 6) and len(np.unique(real)) == len(real)
  assert np.isin(real, ids).all()
  np.testing.assert_array_equal(rows, common.seed_batches(ids, 6, np.random.default_rng(3), limit))
  if limit is None or batches * 6 >= len(ids):  # every id once, in shuffled order
    np.testing.assert_array_equal(np.sort(real), ids)
    assert not np.array_equal(real, ids)
