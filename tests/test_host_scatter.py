"""host_scatter_add against NumPy's np.add.at, bit for bit, on every platform available."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxdata.host import HostTable, host_scatter_add

DTYPES = [np.float32, np.float64, np.int32, np.int64, ml_dtypes.bfloat16, np.float16]
INDEX_DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]


def random_values(rng, shape, dtype):
  dtype = np.dtype(dtype)
  if np.issubdtype(dtype, np.integer):  # the full range: sums wrap around, as in NumPy
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
  return (rng.standard_normal(shape) * 4).astype(dtype)


def reference(data, indices, updates):
  """np.add.at with x.at[indices].add's index rules: [-rows, 0) counts from the end, the rest of
  what lies outside [0, rows) is dropped; updates are cast to the table's dtype first."""
  rows = data.shape[0]
  idx = np.asarray(indices).astype(np.int64).reshape(-1)  # exact for every index dtype but
  if np.asarray(indices).dtype == np.uint64:  # uint64 >= 2**63, never used here
    assert np.all(np.asarray(indices) < 2**63)
  upd = np.asarray(updates).reshape(-1, data.shape[1]).astype(data.dtype)
  idx = np.where(idx < 0, idx + rows, idx)
  keep = (idx >= 0) & (idx < rows)
  out = data.copy()
  np.add.at(out, idx[keep], upd[keep])
  return out


def assert_bits(got, want):
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == want.shape and got.dtype == want.dtype
  np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def scatter(table, indices, updates, fn=host_scatter_add):
  token = jax.block_until_ready(fn(table, indices, updates))  # the write is done after this
  assert token.shape == () and token.dtype == np.int32 and int(token) == 0
  return table.as_numpy().copy()


def indices_around(rng, rows, shape, lo=None, hi=None):
  """Indices in and past [-rows, rows) with many repeats, and the exact edges."""
  lo = -rows - 3 if lo is None else lo
  hi = 2 * rows + 3 if hi is None else hi
  idx = rng.integers(lo, hi, size=shape)
  hot = rng.random(shape) < 0.5  # half of them hit a few hot rows
  idx = np.where(hot, rng.integers(-2, 3, size=shape), idx)
  flat = idx.reshape(-1)
  edges = np.array([-rows - 1, -rows, -1, 0, rows - 1, rows])
  flat[: min(flat.size, edges.size)] = edges[: flat.size]
  return idx


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("cols", [1, 3, 64])
def test_matches_add_at_every_dtype(device, dtype, cols):
  rng = np.random.default_rng(cols)
  rows = 40
  data = random_values(rng, (rows, cols), dtype)
  idx = indices_around(rng, rows, (700,))
  upd = random_values(rng, (700, cols), dtype)
  with HostTable(data) as table:
    got = scatter(table, jnp.asarray(idx), jnp.asarray(upd))
  assert_bits(got, reference(data, idx, upd))


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16])
def test_one_hot_row_rounds_after_every_addition(device, dtype):
  # 3000 updates of one row: the order of the additions shows in the rounding.
  rng = np.random.default_rng(1)
  data = np.zeros((3, 2), dtype)
  upd = (rng.standard_normal((3000, 2)) * np.logspace(-3, 3, 3000)[:, None]).astype(dtype)
  idx = np.ones(3000, np.int32)
  with HostTable(data) as table:
    got = scatter(table, jnp.asarray(idx), jnp.asarray(upd))
  want = reference(data, idx, upd)
  assert_bits(got, want)
  # ...and the sum in another order would differ, so the test can tell.
  other = reference(data, idx[::-1], upd[::-1])
  assert not np.array_equal(want.view(np.uint8), other.view(np.uint8))


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_index_dtype(device, index_dtype):
  rng = np.random.default_rng(2)
  rows = 60  # indices of every dtype reach past both ends
  info = np.iinfo(index_dtype)
  idx = indices_around(rng, rows, (300,), max(info.min, -rows - 3), min(info.max, 2 * rows))
  idx = idx.astype(index_dtype) if info.min < 0 else np.abs(idx).astype(index_dtype)
  data = random_values(rng, (rows, 5), np.float32)
  upd = random_values(rng, (300, 5), np.float32)
  with HostTable(data) as table:
    got = scatter(table, jnp.asarray(idx), jnp.asarray(upd))
  assert_bits(got, reference(data, idx, upd))


@pytest.mark.parametrize(
  "index_dtype,rows", [(np.uint8, 300), (np.uint16, 70_000), (np.int8, 300), (np.int16, 70_000)]
)
def test_narrow_indices_into_a_table_with_more_rows_than_they_count(device, index_dtype, rows):
  # The table's row count does not fit the index dtype; every index is still a valid row.
  info = np.iinfo(index_dtype)
  idx = np.array([0, 1, info.max, info.max, 5], index_dtype)
  data = np.zeros((rows, 2), np.float32)
  upd = np.arange(10, dtype=np.float32).reshape(5, 2)
  with HostTable(data) as table:
    got = scatter(table, jnp.asarray(idx), jnp.asarray(upd))
  assert_bits(got, reference(data, idx, upd))


def test_unsigned_indices_past_the_signed_range(device):
  data = np.zeros((10, 2), np.float32)
  upd = np.ones((5, 2), np.float32)
  with HostTable(data) as table:
    for idx in (
      jnp.array([0, 9, 10, 2**31, 2**32 - 1], jnp.uint32),
      jnp.array([0, 9, 2**32, 2**63, 2**64 - 1], jnp.uint64),
    ):
      table.as_numpy()[...] = 0
      got = scatter(table, idx, jnp.asarray(upd))
      # no wrap-around to negative meanings: only rows 0 and 9 change
      want = np.zeros((10, 2), np.float32)
      want[[0, 9]] = 1
      assert_bits(got, want)


@pytest.mark.parametrize("shape", [(), (1,), (3, 4), (2, 3, 5), (0,), (2, 0)])
def test_multi_dimensional_and_empty_indices(device, shape):
  rng = np.random.default_rng(3)
  rows, cols = 12, 3
  data = random_values(rng, (rows, cols), np.float64)
  idx = rng.integers(-rows - 2, rows + 2, size=shape)
  upd = random_values(rng, shape + (cols,), np.float64)
  with HostTable(data) as table:
    got = scatter(table, jnp.asarray(idx), jnp.asarray(upd))
  assert_bits(got, reference(data, idx, upd))  # flat (C) order of the indices


def test_updates_are_cast_to_the_table_dtype(device):
  rng = np.random.default_rng(4)
  data = random_values(rng, (8, 4), np.float32)
  idx = rng.integers(0, 8, 50)
  upd64 = rng.standard_normal((50, 4))  # float64: rounded to float32 before each addition
  with HostTable(data) as table:
    got = scatter(table, jnp.asarray(idx), jnp.asarray(upd64))
  assert_bits(got, reference(data, idx, upd64.astype(np.float32)))
  with HostTable(np.zeros((4, 2), np.int32)) as table:
    got = scatter(table, jnp.array([1, 1]), jnp.array([[1.75, -2.5], [1.0, 0.0]], jnp.float32))
  assert_bits(got, np.array([[0, 0], [2, -2], [0, 0], [0, 0]], np.int32))


def test_many_updates_use_the_thread_pool(device):
  rng = np.random.default_rng(5)
  rows, cols, n = 5000, 16, 300_000
  data = random_values(rng, (rows, cols), np.float32)
  idx = rng.integers(-rows - 100, rows + 100, size=n)
  idx[: n // 3] = rng.integers(0, 20, n // 3)  # long runs on a few rows
  upd = random_values(rng, (n, cols), np.float32)
  with HostTable(data) as table:
    got = scatter(table, jnp.asarray(idx), jnp.asarray(upd))
  assert_bits(got, reference(data, idx, upd))


def test_deterministic_across_runs(device):
  rng = np.random.default_rng(6)
  data = random_values(rng, (30, 8), np.float32)
  idx = jnp.asarray(rng.integers(0, 5, size=20_000))
  upd = jnp.asarray(random_values(rng, (20_000, 8), np.float32) * 1000)
  results = []
  with HostTable(data) as table:
    step = jax.jit(lambda i, u: host_scatter_add(table, i, u))
    for _ in range(4):
      table.as_numpy()[...] = data
      results.append(scatter(table, idx, upd, fn=lambda t, i, u: step(i, u)))
  for r in results[1:]:
    assert_bits(r, results[0])
  assert_bits(results[0], reference(data, np.asarray(idx), np.asarray(upd)))


def test_jit_with_table_as_argument_and_as_constant_and_repeated_calls(device):
  rng = np.random.default_rng(7)
  data = random_values(rng, (20, 3), np.float32)
  idx = rng.integers(-22, 22, size=(6, 7))
  upd = random_values(rng, (6, 7, 3), np.float32)
  with HostTable(data) as table:
    as_arg = jax.jit(host_scatter_add)
    closed_over = jax.jit(lambda i, u: host_scatter_add(table, i, u))
    want = data
    for step in range(3):  # every call is executed (side effect): the additions accumulate
      fn = as_arg if step % 2 == 0 else (lambda t, i, u: closed_over(i, u))
      got = scatter(table, jnp.asarray(idx), jnp.asarray(upd), fn=fn)
      want = reference(want, idx, upd)
      assert_bits(got, want)


def test_unused_token_is_not_removed(device):
  data = np.zeros((4, 2), np.float32)
  with HostTable(data) as table:

    @jax.jit
    def step(i, u):
      host_scatter_add(table, i, u)  # token dropped
      return jnp.sum(u)

    jax.block_until_ready(step(jnp.array([1, 2, 1]), jnp.ones((3, 2), jnp.float32)))
    assert_bits(table.as_numpy(), np.array([[0, 0], [2, 2], [1, 1], [0, 0]], np.float32))


def test_vmap_applies_every_batch_element(device):
  rng = np.random.default_rng(8)
  data = random_values(rng, (10, 4), np.float32)
  idx = rng.integers(-10, 12, size=(3, 25))
  upd = random_values(rng, (3, 25, 4), np.float32)
  with HostTable(data) as table:
    tokens = jax.block_until_ready(
      jax.vmap(lambda i, u: host_scatter_add(table, i, u))(jnp.asarray(idx), jnp.asarray(upd))
    )
    got = table.as_numpy().copy()
  assert tokens.shape == (3,)
  want = data
  for b in range(3):  # one batch element after another
    want = reference(want, idx[b], upd[b])
  assert_bits(got, want)


def test_on_device_results_equal_cpu_results(device):
  rng = np.random.default_rng(9)
  data = random_values(rng, (50, 6), ml_dtypes.bfloat16)
  idx = jnp.asarray(indices_around(rng, 50, (5000,)))
  upd = jnp.asarray(random_values(rng, (5000, 6), ml_dtypes.bfloat16))
  with HostTable(data) as table:
    here = scatter(table, idx, upd)
    table.as_numpy()[...] = data
    with jax.default_device(jax.devices("cpu")[0]):
      cpu = scatter(table, idx, upd)
  assert_bits(here, cpu)


# -- bad input -----------------------------------------------------------------------------------


def test_shape_and_dtype_errors():
  with HostTable(np.zeros((5, 3), np.float32)) as table:
    with pytest.raises(ValueError, match=r"updates must have shape \(2, 3\)"):
      host_scatter_add(table, jnp.array([0, 1]), jnp.ones((2, 4)))
    with pytest.raises(ValueError, match=r"updates must have shape \(2, 3\)"):
      host_scatter_add(table, jnp.array([0, 1]), jnp.ones((6,)))
    with pytest.raises(ValueError, match=r"updates must have shape \(2, 2, 3\)"):
      host_scatter_add(table, jnp.zeros((2, 2), jnp.int32), jnp.ones((4, 3)))
    with pytest.raises(TypeError, match="indices must be integers"):
      host_scatter_add(table, jnp.array([0.0, 1.0]), jnp.ones((2, 3)))
    with pytest.raises(TypeError, match="indices must be integers"):
      host_scatter_add(table, np.array([True]), jnp.ones((1, 3)))
    with pytest.raises(TypeError, match="indices must be integers"):
      jax.jit(lambda i: host_scatter_add(table, i, jnp.ones((1, 3))))(jnp.array([0.5]))
  for dtype in (np.uint8, np.int8, np.uint32, np.int16):
    with HostTable(np.zeros((5, 3), dtype)) as table:
      with pytest.raises(TypeError, match="not supported"):
        host_scatter_add(table, jnp.array([0]), jnp.ones((1, 3), dtype))
  with pytest.raises(TypeError, match="must be a HostTable"):
    host_scatter_add(np.zeros((5, 3), np.float32), jnp.array([0]), jnp.ones((1, 3)))


def test_closed_table_is_refused_when_tracing_and_when_running():
  table = HostTable(np.zeros((4, 2), np.float32))
  step = jax.jit(lambda i, u: host_scatter_add(table, i, u))
  jax.block_until_ready(step(jnp.array([1]), jnp.ones((1, 2), jnp.float32)))
  table.close()
  with pytest.raises(ValueError, match="is closed"):
    host_scatter_add(table, jnp.array([0]), jnp.ones((1, 2)))
  with pytest.raises(Exception, match="is closed"):
    jax.block_until_ready(step(jnp.array([1]), jnp.ones((1, 2), jnp.float32)))


def test_not_differentiable(device):
  data = np.zeros((4, 2), np.float32)
  idx = jnp.array([0, 1])
  upd = jnp.ones((2, 2), jnp.float32)
  with HostTable(data) as table:
    loss = lambda u: jnp.sum(u) + host_scatter_add(table, idx, u)  # noqa: E731
    with pytest.raises(TypeError, match="not differentiable"):
      jax.grad(loss)(upd)
    with pytest.raises(TypeError, match="not differentiable"):
      jax.jit(jax.grad(loss))(upd)
    with pytest.raises(TypeError, match="not differentiable"):
      jax.jvp(lambda u: host_scatter_add(table, idx, u), (upd,), (upd,))
    # Nothing was written while failing.
    assert_bits(table.as_numpy(), data)
    # Applied to stopped gradients (the intended use) it runs inside a differentiated function.
    g = jax.grad(lambda u: jnp.sum(u * u) + host_scatter_add(table, idx, jax.lax.stop_gradient(u)))(
      upd
    )
    jax.block_until_ready(g)
    np.testing.assert_array_equal(np.asarray(g), 2 * np.asarray(upd))
    assert_bits(table.as_numpy(), np.array([[1, 1], [1, 1], [0, 0], [0, 0]], np.float32))


def test_64_bit_tables_need_x64():
  with HostTable(np.zeros((4, 2), np.int64)) as table:
    with jax.enable_x64(False) if hasattr(jax, "enable_x64") else jax.experimental.disable_x64():
      with pytest.raises(TypeError, match="jax_enable_x64"):
        host_scatter_add(table, jnp.array([0]), jnp.ones((1, 2), jnp.int32))


# -- concurrency: calls on one table never lose an addition ---------------------------------------


def test_two_threads_scattering_into_the_same_rows_lose_no_addition(device):
  import threading

  rows, cols, n, calls = 64, 8, 4096, 150
  rng = np.random.default_rng(10)
  batches = [rng.integers(0, rows, size=n) for _ in range(2 * calls)]
  ones = jnp.ones((n, cols), jnp.float32)
  with HostTable(np.zeros((rows, cols), np.float32)) as table:
    step = jax.jit(host_scatter_add)
    start = threading.Barrier(2)

    def worker(mine):
      start.wait()
      tokens = [step(table, jnp.asarray(b), ones) for b in mine]
      jax.block_until_ready(tokens)

    threads = [threading.Thread(target=worker, args=(batches[k::2],)) for k in range(2)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    got = table.as_numpy().copy()
  want = np.zeros((rows, cols), np.float32)  # counts: exact in float32, in any order
  for b in batches:
    np.add.at(want, b, 1.0)
  assert got.sum() == want.sum() == 2 * calls * n * cols, f"lost {want.sum() - got.sum()} additions"
  assert_bits(got, want)


def _shard_map():
  shard_map = getattr(jax, "shard_map", None)
  if shard_map is None:
    from jax.experimental.shard_map import shard_map
  return shard_map


def test_shard_map_over_two_devices_loses_no_addition():
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  devices = jax.devices("cpu")[:2]
  if len(devices) < 2:
    pytest.skip("needs two CPU devices")
  mesh = Mesh(np.array(devices), ("data",))
  # Calls large enough for the two devices' handlers to overlap (on a 2-core machine the old
  # kernel lost about 1000 of these additions in one run out of three).
  rows, cols, n, steps = 256, 32, 131072, 8
  rng = np.random.default_rng(11)
  want = np.zeros((rows, cols), np.int64)
  with HostTable(np.zeros((rows, cols), np.int64)) as table:
    f = jax.jit(
      _shard_map()(
        lambda i, u: host_scatter_add(table, i, u)[None],
        mesh=mesh,
        in_specs=(P("data"), P("data")),
        out_specs=P("data"),
      )
    )
    sharding = NamedSharding(mesh, P("data"))
    for _ in range(steps):
      idx = rng.integers(-rows, rows, size=n)
      upd = rng.integers(-5, 6, size=(n, cols))
      jax.block_until_ready(f(jax.device_put(idx, sharding), jax.device_put(upd, sharding)))
      want = reference(want, idx, upd)
    assert_bits(table.as_numpy(), want)


def test_scatters_through_two_views_of_one_memory_are_serialized(device):
  import threading

  rows, n = 32, 4096
  rng = np.random.default_rng(12)
  with HostTable(np.zeros((rows, 2), np.int32)) as table:
    wide = table.view(columns=4)  # the same bytes, rows of 4: row r is rows 2r, 2r + 1 of table
    narrow_step = jax.jit(host_scatter_add)
    wide_step = jax.jit(host_scatter_add)
    a = [rng.integers(0, rows, size=n) for _ in range(60)]
    b = [rng.integers(0, rows // 2, size=n) for _ in range(60)]
    threads = [
      threading.Thread(
        target=lambda: jax.block_until_ready(
          [narrow_step(table, jnp.asarray(i), jnp.ones((n, 2), jnp.int32)) for i in a]
        )
      ),
      threading.Thread(
        target=lambda: jax.block_until_ready(
          [wide_step(wide, jnp.asarray(i), jnp.ones((n, 4), jnp.int32)) for i in b]
        )
      ),
    ]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    got = table.as_numpy().copy()
    wide.close()
  want = np.zeros((rows, 2), np.int32)
  for i in a:
    np.add.at(want, i, 1)
  flat = want.reshape(rows // 2, 4)
  for i in b:
    np.add.at(flat, i, 1)
  assert_bits(got, want)
