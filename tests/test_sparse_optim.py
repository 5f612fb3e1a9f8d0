"""sparse_sgd, sparse_adagrad and sparse_adam against dense optax, on every platform available.

The dense reference: the parameters are an ordinary array, the gradient of a step is the
scatter-add of the row gradients (`zeros.at[indices].add(grads)`, what jax.grad of a gather
gives), and optax.sgd / optax.adagrad with the same hyperparameters update every row. The sparse
optimizers must agree on the rows a step touches and leave every other row bit-identical.
Lazy Adam equals dense optax.adam only when every row is touched at every step; otherwise its
reference is `lazy_adam_reference` below, plain NumPy in float64.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxdata.host import HostTable, sparse, sparse_adagrad, sparse_adam, sparse_sgd

ROWS, COLS = 50, 6


def dense_gradient(indices, grads, rows=ROWS):
  grads = jnp.asarray(grads, jnp.float32).reshape(-1, grads.shape[-1])
  return (
    jnp.zeros((rows, grads.shape[-1]), jnp.float32)
    .at[jnp.asarray(indices).reshape(-1)]
    .add(grads, mode="drop")
  )


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


def run_both(device, sparse_opt, dense_opt, steps, use_jit, shape=(64,), dtype=np.float32, seed=0):
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
      token = (
        update(jnp.asarray(idx), jnp.asarray(g))
        if use_jit
        else update(table, state, jnp.asarray(idx), jnp.asarray(g))
      )
      jax.block_until_ready(token)
      assert token.devices() == {device}
      updates, dense_state = dense_opt.update(dense_gradient(idx, g), dense_state, params)
      params = optax.apply_updates(params, updates)
      ever |= touched_rows(idx)
    got = table.as_numpy().copy()
    extra = jax.tree_util.tree_map(
      lambda t: t.as_numpy().copy(), state, is_leaf=lambda x: isinstance(x, HostTable)
    )
    sparse.close(state)
  assert not ever[40:45].any() and ever.sum() > 30
  # Untouched rows: not a bit changed. Touched rows: what optax computes.
  np.testing.assert_array_equal(got[~ever].view(np.uint8), init[~ever].view(np.uint8))
  np.testing.assert_allclose(got[ever], np.asarray(params)[ever], rtol=2e-6, atol=2e-6)
  return got, extra, dense_state, ever


@pytest.mark.parametrize("lr,use_jit", [(0.1, True), (3.0, True), (0.1, False)])
def test_sgd_matches_optax(device, use_jit, lr):
  run_both(device, sparse_sgd(lr), optax.sgd(lr), steps=6 if use_jit else 3, use_jit=use_jit)


@pytest.mark.parametrize(
  "lr,init,eps,use_jit",
  [(0.1, 0.1, 1e-7, True), (0.5, 0.0, 1e-7, True), (1.0, 1.0, 1e-3, True), (0.1, 0.1, 1e-7, False)],
)
def test_adagrad_matches_optax(device, use_jit, lr, init, eps):
  got, state, dense_state, ever = run_both(
    device,
    sparse_adagrad(lr, init, eps),
    optax.adagrad(lr, initial_accumulator_value=init, eps=eps),
    steps=6 if use_jit else 3,
    use_jit=use_jit,
  )
  acc = state.sum_of_squares
  dense_acc = np.asarray(dense_state[0].sum_of_squares)
  assert acc.dtype == np.float32 and acc.shape == (ROWS, COLS)
  np.testing.assert_allclose(acc[ever], dense_acc[ever], rtol=2e-6)
  np.testing.assert_array_equal(acc[~ever], np.full(((~ever).sum(), COLS), init, np.float32))


def test_defaults_are_optax_defaults(device):
  run_both(device, sparse_adagrad(0.2), optax.adagrad(0.2), steps=3, use_jit=True, seed=1)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_multi_dimensional_indices(device, optimizer):
  sparse_opt, dense_opt = (
    (sparse_sgd(0.3), optax.sgd(0.3))
    if optimizer == "sgd"
    else (sparse_adagrad(0.3), optax.adagrad(0.3))
  )
  run_both(device, sparse_opt, dense_opt, steps=3, use_jit=True, shape=(4, 16), seed=2)


def test_float64_table(device):
  # The row arithmetic is float32; the table keeps float64.
  run_both(
    device, sparse_adagrad(0.1), optax.adagrad(0.1), steps=3, use_jit=True, dtype=np.float64, seed=3
  )


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
@pytest.mark.parametrize(
  "index_dtype,rows", [(np.int8, 300), (np.uint8, 300), (np.int16, 70_000), (np.uint16, 70_000)]
)
def test_narrow_index_dtypes_into_a_larger_table(device, optimizer, index_dtype, rows):
  # The table's row count does not fit the index dtype: every index is still the row it names.
  info = np.iinfo(index_dtype)
  idx = np.array([1, 5, info.max, info.max, -1 if info.min < 0 else 7], index_dtype)
  g = np.arange(10, dtype=np.float32).reshape(5, 2) + 1
  init = np.zeros((rows, 2), np.float32)
  sparse_opt, dense_opt = (
    (sparse_sgd(0.5), optax.sgd(0.5))
    if optimizer == "sgd"
    else (sparse_adagrad(0.5), optax.adagrad(0.5))
  )
  with HostTable(init) as table:
    state = sparse_opt.init(table)
    jax.block_until_ready(sparse_opt.update(table, state, jnp.asarray(idx), jnp.asarray(g)))
    got = table.as_numpy().copy()
    sparse.close(state)
  params = jnp.asarray(init)
  updates, _ = dense_opt.update(
    dense_gradient(idx.astype(np.int64), g, rows), dense_opt.init(params), params
  )
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
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = _two_device_mesh()
  sparse_opt, dense_opt = (
    (sparse_sgd(0.3), optax.sgd(0.3))
    if optimizer == "sgd"
    else (sparse_adagrad(0.3), optax.adagrad(0.3))
  )
  init = np.random.default_rng(20).standard_normal((ROWS, COLS)).astype(np.float32)
  params = jnp.asarray(init)
  dense_state = dense_opt.init(params)
  sharding = NamedSharding(mesh, P("data"))
  ever = np.zeros(ROWS, bool)
  with HostTable(init) as table:
    state = sparse_opt.init(table)

    def step(idx, g):  # every device's share of the batch; the two share hot rows
      return sparse_opt.update(table, state, idx, g, axis_name="data")[None]

    f = jax.jit(_shard_map()(step, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data")))
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
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = _two_device_mesh()
  rows, cols, n = 64, 16, 65536
  rng = np.random.default_rng(22)
  want = np.zeros((rows, cols), np.float32)
  with HostTable(want) as table:
    opt = sparse_sgd(1.0)
    f = jax.jit(
      _shard_map()(
        lambda i, g: opt.update(table, (), i, g)[None],
        mesh=mesh,
        in_specs=(P("data"), P("data")),
        out_specs=P("data"),
      )
    )
    sharding = NamedSharding(mesh, P("data"))
    for _ in range(8):
      idx = rng.integers(0, rows, size=n)
      g = rng.integers(-3, 4, size=(n, cols)).astype(np.float32)
      jax.block_until_ready(f(jax.device_put(idx, sharding), jax.device_put(g, sharding)))
      np.subtract.at(want, idx, g)
    np.testing.assert_array_equal(table.as_numpy(), want)


# -- lazy Adam -------------------------------------------------------------------------------------


def lazy_adam_reference(init, steps, lr, b1=0.9, b2=0.999, eps=1e-8, round_to=None):
  """torch.optim.SparseAdam's rule in float64 with plain loops: [(table, mu, nu) after each step].

  `steps` is a list of (indices, grads). A row is touched when an in-range index names it
  (negative ones from the end); only touched rows change. `round_to`: the table's dtype, whose
  rounding of each step's update and of the sum is applied as host_scatter_add does.
  """
  rows, cols = init.shape
  p = init.astype(np.float64)
  m, v = np.zeros((rows, cols)), np.zeros((rows, cols))
  out = []
  for t, (idx, grads) in enumerate(steps, start=1):
    g = {}
    for i, row_grad in zip(
      np.asarray(idx).reshape(-1).tolist(), np.asarray(grads, np.float64).reshape(-1, cols)
    ):
      r = i + rows if i < 0 else i
      if 0 <= r < rows:
        g[r] = g.get(r, 0.0) + row_grad
    for r, gr in g.items():
      m[r] = b1 * m[r] + (1 - b1) * gr
      v[r] = b2 * v[r] + (1 - b2) * gr * gr
      delta = -lr * (m[r] / (1 - b1**t)) / (np.sqrt(v[r] / (1 - b2**t)) + eps)
      if round_to is None:
        p[r] = p[r] + delta
      else:
        p[r] = (p[r].astype(round_to) + delta.astype(round_to)).astype(np.float64)
    out.append((p.copy(), m.copy(), v.copy()))
  return out


def run_adam(opt, init, steps, use_jit):
  """Applies `opt` to a HostTable of `init`: [(table, mu, nu)] after each step, and the count."""
  out = []
  with HostTable(init) as table:
    state = opt.init(table)
    update = jax.jit(opt.update) if use_jit else opt.update
    for idx, g in steps:
      jax.block_until_ready(update(table, state, jnp.asarray(idx), jnp.asarray(g)))
      out.append((table.as_numpy().copy(), state.mu.as_numpy().copy(), state.nu.as_numpy().copy()))
    count = state.count.as_numpy().copy()
    sparse.close(state)
  assert state.mu.closed and state.nu.closed and state.count.closed
  return out, count


def every_row_batches(seed, steps, rows=ROWS, cols=COLS):
  """Each batch names every row at least once (a permutation, some as negative indices) plus
  repeats of random rows."""
  rng = np.random.default_rng(seed)
  for _ in range(steps):
    idx = np.concatenate([rng.permutation(rows), rng.integers(0, rows, size=20)])
    idx = np.where(rng.random(idx.shape) < 0.3, idx - rows, idx)
    yield idx, rng.standard_normal(idx.shape + (cols,)).astype(np.float32)


@pytest.mark.parametrize("lr,b1,b2,eps", [(0.1, 0.9, 0.999, 1e-8), (0.01, 0.5, 0.9, 1e-3)])
def test_adam_equals_dense_optax_adam_when_every_row_is_touched_every_step(device, lr, b1, b2, eps):
  init = np.random.default_rng(30).standard_normal((ROWS, COLS)).astype(np.float32)
  steps = list(every_row_batches(31, 4))
  out, count = run_adam(sparse_adam(lr, b1, b2, eps), init, steps, use_jit=True)
  dense = optax.adam(lr, b1, b2, eps)
  params = jnp.asarray(init)
  dense_state = dense.init(params)
  for (idx, g), (got, mu, nu) in zip(steps, out):
    updates, dense_state = dense.update(dense_gradient(idx, g), dense_state, params)
    params = optax.apply_updates(params, updates)
    # Not bit-equal: the moments are written as deltas (mu + (new - mu) may round differently
    # from new in the last bit), and the bias corrections are computed as -expm1(t log b) in
    # float32 where optax (jax_enable_x64 on) takes 1 - b**t in float64.
    np.testing.assert_allclose(mu, np.asarray(dense_state[0].mu), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(nu, np.asarray(dense_state[0].nu), rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(got, np.asarray(params), rtol=1e-5, atol=1e-6)
  assert count.tolist() == [[4]] and int(dense_state[0].count) == 4


def test_adam_equals_lazy_reference_on_subsets_and_leaves_untouched_rows_bit_identical(device):
  init = np.random.default_rng(32).standard_normal((ROWS, COLS)).astype(np.float32)
  steps = list(batches(33, 5, shape=(24,)))  # few rows a step: most are untouched each time
  out, count = run_adam(sparse_adam(0.05), init, steps, use_jit=True)
  want = lazy_adam_reference(init, steps, 0.05)
  before = (init, np.zeros_like(init), np.zeros_like(init))
  for (idx, _), got, ref in zip(steps, out, want):
    touched = touched_rows(idx)
    assert 5 < touched.sum() < ROWS - 20
    for now, prev in zip(got, before):  # table, mu, nu: untouched rows not a bit changed
      np.testing.assert_array_equal(now[~touched].view(np.uint32), prev[~touched].view(np.uint32))
    for now, r in zip(got, ref):
      np.testing.assert_allclose(now, r, rtol=1e-5, atol=1e-6)
    before = got
  assert count.tolist() == [[5]]


def test_adam_touched_row_with_zero_summed_gradient_still_moves(device):
  # Lazy Adam updates every row the batch names, as torch.optim.SparseAdam does: a row whose
  # gradients cancel decays its moments and keeps moving on its momentum.
  init = np.zeros((4, 2), np.float32)
  g1 = np.array([[1.0, -2.0]], np.float32)
  g2 = np.array([[3.0, 1.0], [-3.0, -1.0]], np.float32)
  steps = [(np.array([2]), g1), (np.array([2, 2]), g2)]
  out, _ = run_adam(sparse_adam(0.1), init, steps, use_jit=True)
  want = lazy_adam_reference(init, steps, 0.1)
  assert not np.array_equal(out[1][0][2], out[0][0][2])
  for got, ref in zip(out[1], want[1]):
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-7)


def test_adam_inside_and_outside_jit_give_the_same_result(device):
  init = np.random.default_rng(34).standard_normal((ROWS, COLS)).astype(np.float32)
  steps = list(batches(35, 4, shape=(4, 8)))
  jitted, count_jit = run_adam(sparse_adam(0.1), init, steps, use_jit=True)
  eager, count_eager = run_adam(sparse_adam(0.1), init, steps, use_jit=False)
  want = lazy_adam_reference(init, steps, 0.1)
  # Not bit-equal: op by op, XLA rounds a few moments 1 ulp differently from the fused program.
  for a, b, ref in zip(jitted, eager, want):
    for x, y, r in zip(a, b, ref):
      np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
      np.testing.assert_allclose(x, r, rtol=1e-5, atol=1e-6)
  assert count_jit.tolist() == count_eager.tolist() == [[4]]


def test_adam_bfloat16_table_keeps_float32_moments(device):
  import ml_dtypes

  bf16 = ml_dtypes.bfloat16
  init = np.random.default_rng(36).standard_normal((ROWS, COLS)).astype(bf16)
  steps = list(batches(37, 4))
  out, count = run_adam(sparse_adam(0.1), init, steps, use_jit=True)
  want = lazy_adam_reference(init.astype(np.float64), steps, 0.1, round_to=bf16)
  for (table, mu, nu), (ref, ref_mu, ref_nu) in zip(out, want):
    assert table.dtype == bf16 and mu.dtype == nu.dtype == np.float32
    # The moments depend only on the gradients: float32 accuracy.
    np.testing.assert_allclose(mu, ref_mu, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(nu, ref_nu, rtol=1e-5, atol=1e-9)
    # The table: within a bfloat16 rounding (2**-8 relative) of the reference's own rounding.
    np.testing.assert_allclose(table.astype(np.float64), ref, rtol=2**-7, atol=1e-2)
  assert count.tolist() == [[4]]
  ever = np.zeros(ROWS, bool)
  for idx, _ in steps:
    ever |= touched_rows(idx)
  np.testing.assert_array_equal(out[-1][0][~ever].view(np.uint16), init[~ever].view(np.uint16))


def test_adam_bad_input_and_closed_tables():
  with HostTable(np.zeros((6, 2), np.float32)) as table:
    opt = sparse_adam(0.1)
    state = opt.init(table)
    assert state.mu.shape == state.nu.shape == (6, 2) and state.count.shape == (1, 1)
    assert state.mu.dtype == state.nu.dtype == np.float32 and state.count.dtype == np.int32
    with pytest.raises(ValueError, match="sparse_adam: grads must have shape"):
      opt.update(table, state, jnp.array([1]), jnp.ones((1, 3)))
    with pytest.raises(ValueError, match="sparse_adam: grads must have shape"):
      opt.update(table, state, jnp.array([1, 2, 3]), jnp.ones((2, 2)))
    with pytest.raises(TypeError, match="sparse_adam: indices must be integers"):
      opt.update(table, state, jnp.array([1.0]), jnp.ones((1, 2)))
    np.testing.assert_array_equal(table.as_numpy(), np.zeros((6, 2)))
    assert state.count.as_numpy().tolist() == [[0]]
    state.nu.close()
    for update in (opt.update, jax.jit(opt.update)):
      with pytest.raises(ValueError, match=r"sparse_adam: state\.nu is closed"):
        update(table, state, jnp.array([1]), jnp.ones((1, 2)))
    sparse.close(state)
    assert state.mu.closed and state.count.closed
  state = opt.init(table := HostTable(np.zeros((6, 2), np.float32)))
  table.close()
  with pytest.raises(ValueError, match="sparse_adam: table is closed"):
    opt.update(table, state, jnp.array([1]), jnp.ones((1, 2)))
  sparse.close(state)


def test_adam_under_shard_map_with_axis_name_equals_one_device_and_counts_once():
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = _two_device_mesh()
  opt = sparse_adam(0.05)
  init = np.random.default_rng(38).standard_normal((ROWS, COLS)).astype(np.float32)
  steps = list(batches(39, 5, shape=(64,)))
  sharding = NamedSharding(mesh, P("data"))
  out = []
  with HostTable(init) as table:
    state = opt.init(table)

    def step(idx, g):  # every device's share of the batch; the two share hot rows
      return opt.update(table, state, idx, g, axis_name="data")[None]

    f = jax.jit(_shard_map()(step, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data")))
    for idx, g in steps:
      jax.block_until_ready(f(jax.device_put(idx, sharding), jax.device_put(g, sharding)))
      out.append((table.as_numpy().copy(), state.mu.as_numpy().copy(), state.nu.as_numpy().copy()))
    count = state.count.as_numpy().copy()
    sparse.close(state)
  assert count.tolist() == [[5]]  # once per step, not once per device
  with jax.default_device(jax.devices("cpu")[0]):
    single, _ = run_adam(opt, init, steps, use_jit=True)
  want = lazy_adam_reference(init, steps, 0.05)
  for got, one, ref in zip(out, single, want):
    for x, y, r in zip(got, one, ref):
      np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
      np.testing.assert_allclose(x, r, rtol=1e-5, atol=1e-6)


def test_adam_state_passed_through_jit_is_collected_and_compiled_once():
  import gc
  import weakref

  opt = sparse_adam(0.1)
  update = jax.jit(opt.update)
  refs = []
  for _ in range(3):
    table = HostTable(np.ones((16, 4), np.float32))
    state = opt.init(table)
    jax.block_until_ready(update(table, state, jnp.array([1, 2]), jnp.ones((2, 4))))
    refs += [weakref.ref(t) for t in (table, *state)]
    del table, state
  gc.collect()
  assert all(r() is None for r in refs), f"{sum(r() is not None for r in refs)} alive"
  assert update._cache_size() == 1
