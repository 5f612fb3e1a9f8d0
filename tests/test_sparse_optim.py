"""sparse_sgd and sparse_adagrad against dense optax, on every platform available.

The dense reference: the parameters are an ordinary array, the gradient of a step is the
scatter-add of the row gradients (`zeros.at[indices].add(grads)`, what jax.grad of a gather
gives), and optax.sgd / optax.adagrad with the same hyperparameters update every row. The sparse
optimizers must agree on the rows a step touches and leave every other row bit-identical.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxdata.host import HostTable, sparse_adagrad, sparse_sgd
from jaxdata.host import sparse

ROWS, COLS = 50, 6


def dense_gradient(indices, grads, rows=ROWS):
  grads = jnp.asarray(grads, jnp.float32).reshape(-1, grads.shape[-1])
  return jnp.zeros((rows, grads.shape[-1]), jnp.float32).at[jnp.asarray(indices).reshape(-1)].add(
      grads, mode="drop")


def touched_rows(indices, rows=ROWS):
  idx = np.asarray(indices).reshape(-1).astype(np.int64)
  idx = np.where(idx < 0, idx + rows, idx)
  out = np.zeros(rows, bool)
  out[idx[(idx >= 0) & (idx < rows)]] = True
  return out


def batches(seed, steps, shape=(64,), cols=COLS, rows=ROWS):
  """Index batches with many repeats (a few hot rows), negative and out-of-range indices."""
  rng = np.random.default_rng(seed)
  for _ in range(steps):
    idx = rng.integers(-rows - 4, rows + 4, size=shape)
    hot = rng.random(shape) < 0.4
    idx = np.where(hot, rng.integers(-3, 4, size=shape), idx)
    idx.reshape(-1)[:3] = [-1, rows, -rows - 1]  # from the end, dropped, dropped
    # Rows 40..44 never appear: they must stay untouched.
    idx = np.where((idx >= 40) & (idx < 45), 0, idx)
    idx = np.where((idx >= 40 - rows) & (idx < 45 - rows), 0, idx)
    yield idx, rng.standard_normal(shape + (cols,)).astype(np.float32)


def run_both(device, sparse_opt, dense_opt, steps, use_jit, shape=(64,), dtype=np.float32,
             seed=0):
  init = np.random.default_rng(100 + seed).standard_normal((ROWS, COLS)).astype(dtype)
  params = jnp.asarray(init)
  dense_state = dense_opt.init(params)
  ever = np.zeros(ROWS, bool)
  with HostTable(init) as table:
    state = sparse_opt.init(table)
    update = sparse_opt.update
    if use_jit:
      update = jax.jit(lambda i, g: sparse_opt.update(table, state, i, g))
    for idx, g in batches(seed, steps, shape):
      token = update(jnp.asarray(idx), jnp.asarray(g)) if use_jit else update(
          table, state, jnp.asarray(idx), jnp.asarray(g))
      jax.block_until_ready(token)
      assert token.devices() == {device}
      updates, dense_state = dense_opt.update(dense_gradient(idx, g), dense_state, params)
      params = optax.apply_updates(params, updates)
      ever |= touched_rows(idx)
    got = table.as_numpy().copy()
    extra = jax.tree_util.tree_map(lambda t: t.as_numpy().copy(), state,
                                   is_leaf=lambda x: isinstance(x, HostTable))
    sparse.close(state)
  assert not ever[40:45].any() and ever.sum() > 30
  # Untouched rows: not a bit changed. Touched rows: what optax computes.
  np.testing.assert_array_equal(got[~ever].view(np.uint8), init[~ever].view(np.uint8))
  np.testing.assert_allclose(got[ever], np.asarray(params)[ever], rtol=2e-6, atol=2e-6)
  return got, extra, dense_state, ever


@pytest.mark.parametrize("lr,use_jit", [(0.1, True), (3.0, True), (0.1, False)])
def test_sgd_matches_optax(device, use_jit, lr):
  run_both(device, sparse_sgd(lr), optax.sgd(lr), steps=6 if use_jit else 3, use_jit=use_jit)


@pytest.mark.parametrize("lr,init,eps,use_jit", [(0.1, 0.1, 1e-7, True), (0.5, 0.0, 1e-7, True),
                                                 (1.0, 1.0, 1e-3, True), (0.1, 0.1, 1e-7, False)])
def test_adagrad_matches_optax(device, use_jit, lr, init, eps):
  got, state, dense_state, ever = run_both(
      device, sparse_adagrad(lr, init, eps),
      optax.adagrad(lr, initial_accumulator_value=init, eps=eps), steps=6 if use_jit else 3,
      use_jit=use_jit)
  acc = state.sum_of_squares
  dense_acc = np.asarray(dense_state[0].sum_of_squares)
  assert acc.dtype == np.float32 and acc.shape == (ROWS, COLS)
  np.testing.assert_allclose(acc[ever], dense_acc[ever], rtol=2e-6)
  np.testing.assert_array_equal(acc[~ever], np.full(((~ever).sum(), COLS), init, np.float32))


def test_defaults_are_optax_defaults(device):
  run_both(device, sparse_adagrad(0.2), optax.adagrad(0.2), steps=3, use_jit=True, seed=1)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_multi_dimensional_indices(device, optimizer):
  sparse_opt, dense_opt = ((sparse_sgd(0.3), optax.sgd(0.3)) if optimizer == "sgd" else
                           (sparse_adagrad(0.3), optax.adagrad(0.3)))
  run_both(device, sparse_opt, dense_opt, steps=3, use_jit=True, shape=(4, 16), seed=2)


def test_float64_table(device):
  # The row arithmetic is float32; the table keeps float64.
  run_both(device, sparse_adagrad(0.1), optax.adagrad(0.1), steps=3, use_jit=True,
           dtype=np.float64, seed=3)


def test_zero_gradient_of_a_touched_row_changes_nothing(device):
  # With no initial accumulator a row whose summed gradient is 0 has s == 0: the step is 0,
  # as in optax (no NaN from 0 / sqrt(0)).
  init = np.arange(12, dtype=np.float32).reshape(4, 3)
  with HostTable(init) as table:
    opt = sparse_adagrad(1.0, initial_accumulator_value=0.0)
    state = opt.init(table)
    g = jnp.array([[1.0, 2.0, 0.0], [-1.0, -2.0, 0.0], [0.0, 0.0, 0.0]], jnp.float32)
    update = jax.jit(lambda i, g: opt.update(table, state, i, g))
    jax.block_until_ready(update(jnp.array([2, 2, 3]), g))
    assert np.array_equal(table.as_numpy(), init)
    assert not np.isnan(state.sum_of_squares.as_numpy()).any()
    np.testing.assert_array_equal(state.sum_of_squares.as_numpy(), np.zeros((4, 3)))
    sparse.close(state)
  assert state.sum_of_squares.closed


def test_state_survives_jit_retracing_and_steps_see_each_other(device):
  # Two different jitted update functions share one state: each sees the other's writes.
  init = np.zeros((6, 2), np.float32)
  dense = optax.adagrad(0.5)
  params, dstate = jnp.asarray(init), dense.init(jnp.asarray(init))
  with HostTable(init) as table:
    opt = sparse_adagrad(0.5)
    state = opt.init(table)
    f1 = jax.jit(lambda i, g: opt.update(table, state, i, g))
    f2 = jax.jit(lambda i, g: opt.update(table, state, i, g))
    for step, f in enumerate([f1, f2, f1, f2]):
      idx = jnp.array([1, 1, 4]) + step % 2
      g = jnp.full((3, 2), step + 1.0, jnp.float32)
      jax.block_until_ready(f(idx, g))
      upd, dstate = dense.update(dense_gradient(idx, g, 6), dstate, params)
      params = optax.apply_updates(params, upd)
    np.testing.assert_allclose(table.as_numpy(), np.asarray(params), rtol=2e-6, atol=1e-7)
    sparse.close(state)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
@pytest.mark.parametrize("index_dtype,rows", [(np.int8, 300), (np.uint8, 300), (np.int16, 70_000),
                                              (np.uint16, 70_000)])
def test_narrow_index_dtypes_into_a_larger_table(device, optimizer, index_dtype, rows):
  # The table's row count does not fit the index dtype: every index is still the row it names.
  info = np.iinfo(index_dtype)
  idx = np.array([1, 5, info.max, info.max, -1 if info.min < 0 else 7], index_dtype)
  g = np.arange(10, dtype=np.float32).reshape(5, 2) + 1
  init = np.zeros((rows, 2), np.float32)
  sparse_opt, dense_opt = ((sparse_sgd(0.5), optax.sgd(0.5)) if optimizer == "sgd" else
                           (sparse_adagrad(0.5), optax.adagrad(0.5)))
  with HostTable(init) as table:
    state = sparse_opt.init(table)
    jax.block_until_ready(sparse_opt.update(table, state, jnp.asarray(idx), jnp.asarray(g)))
    got = table.as_numpy().copy()
    sparse.close(state)
  params = jnp.asarray(init)
  updates, _ = dense_opt.update(dense_gradient(idx.astype(np.int64), g, rows),
                                dense_opt.init(params), params)
  want = np.asarray(optax.apply_updates(params, updates))
  np.testing.assert_array_equal(np.nonzero(got[:, 0])[0], np.nonzero(want[:, 0])[0])
  np.testing.assert_allclose(got, want, rtol=2e-6)


def test_bad_input():
  with HostTable(np.zeros((6, 2), np.float32)) as table:
    for opt in (sparse_sgd(0.1), sparse_adagrad(0.1)):
      state = opt.init(table)
      with pytest.raises(ValueError, match="grads"):  # the columns do not match
        opt.update(table, state, jnp.array([1]), jnp.ones((1, 3)))
      with pytest.raises(ValueError, match="grads"):  # one gradient row too many
        opt.update(table, state, jnp.array([1, 2, 3]), jnp.ones((4, 2)))
      with pytest.raises(ValueError, match="grads"):  # one too few
        opt.update(table, state, jnp.array([1, 2, 3]), jnp.ones((2, 2)))
      with pytest.raises(TypeError, match="indices must be integers"):
        opt.update(table, state, jnp.array([1.0]), jnp.ones((1, 2)))
      np.testing.assert_array_equal(table.as_numpy(), np.zeros((6, 2)))
      sparse.close(state)


# -- data parallelism: shard_map over two devices -------------------------------------------------


def _shard_map():
  shard_map = getattr(jax, "shard_map", None)
  if shard_map is None:
    from jax.experimental.shard_map import shard_map
  return shard_map


def _two_device_mesh():
  from jax.sharding import Mesh
  devices = jax.devices("cpu")[:2]
  if len(devices) < 2:
    pytest.skip("needs two CPU devices")
  return Mesh(np.array(devices), ("data",))


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_under_shard_map_with_axis_name_equals_dense_optax_on_the_whole_batch(optimizer):
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = _two_device_mesh()
  sparse_opt, dense_opt = ((sparse_sgd(0.3), optax.sgd(0.3)) if optimizer == "sgd" else
                           (sparse_adagrad(0.3), optax.adagrad(0.3)))
  init = np.random.default_rng(20).standard_normal((ROWS, COLS)).astype(np.float32)
  params = jnp.asarray(init)
  dense_state = dense_opt.init(params)
  sharding = NamedSharding(mesh, P("data"))
  ever = np.zeros(ROWS, bool)
  with HostTable(init) as table:
    state = sparse_opt.init(table)

    def step(idx, g):  # every device's share of the batch; the two share hot rows
      return sparse_opt.update(table, state, idx, g, axis_name="data")[None]

    f = jax.jit(_shard_map()(step, mesh=mesh, in_specs=(P("data"), P("data")),
                             out_specs=P("data")))
    for idx, g in batches(21, 8, shape=(128,)):
      jax.block_until_ready(f(jax.device_put(idx, sharding), jax.device_put(g, sharding)))
      updates, dense_state = dense_opt.update(dense_gradient(idx, g), dense_state, params)
      params = optax.apply_updates(params, updates)
      ever |= touched_rows(idx)
    got = table.as_numpy().copy()
    sparse.close(state)
  np.testing.assert_array_equal(got[~ever], init[~ever])
  np.testing.assert_allclose(got, np.asarray(params), rtol=2e-6, atol=2e-6)


def test_sgd_under_shard_map_without_axis_name_loses_no_update():
  # Each device applies its own share as a separate update of the one table: with integer
  # gradients every sum is exact, so the result must equal the dense step exactly.
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = _two_device_mesh()
  rows, cols, n = 64, 16, 65536
  rng = np.random.default_rng(22)
  want = np.zeros((rows, cols), np.float32)
  with HostTable(want) as table:
    opt = sparse_sgd(1.0)
    f = jax.jit(_shard_map()(lambda i, g: opt.update(table, (), i, g)[None], mesh=mesh,
                             in_specs=(P("data"), P("data")), out_specs=P("data")))
    sharding = NamedSharding(mesh, P("data"))
    for _ in range(8):
      idx = rng.integers(0, rows, size=n)
      g = rng.integers(-3, 4, size=(n, cols)).astype(np.float32)
      jax.block_until_ready(f(jax.device_put(idx, sharding), jax.device_put(g, sharding)))
      np.subtract.at(want, idx, g)
    np.testing.assert_array_equal(table.as_numpy(), want)
