"""host_gather and host_slice against jnp.take / NumPy, on every platform available."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from handle_errors import all_nan, assert_handle_error
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxdata.host import SUPPORTED_DTYPES, HostTable, host_gather, host_slice

INDEX_DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]


def random_table(rng, rows, cols, dtype):
  dtype = np.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.floating):
    return rng.standard_normal((rows, cols)).astype(dtype)
  info = np.iinfo(dtype)
  return rng.integers(info.min, info.max, size=(rows, cols), dtype=dtype, endpoint=True)


def assert_same(got, want):
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == want.shape and got.dtype == want.dtype
  # Bit-for-bit, NaNs included: the gather must move bytes unchanged.
  np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def indices_with_edges(rng, rows, shape, dtype):
  """Random indices in and around [-rows, rows), plus the exact edges."""
  dtype = np.dtype(dtype)
  lo = max(-2 * rows - 3, np.iinfo(dtype).min)
  hi = min(2 * rows + 3, np.iinfo(dtype).max)
  idx = rng.integers(lo, hi, size=shape, endpoint=True).astype(dtype)
  edges = np.array(
    [e for e in (-rows - 1, -rows, -1, 0, rows - 1, rows, hi) if lo <= e <= hi], dtype
  )
  flat = idx.reshape(-1)
  flat[: min(flat.size, edges.size)] = edges[: flat.size]
  return idx


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("mode", ["fill", "clip"])
@pytest.mark.parametrize("cols", [1, 3, 32, 150])
def test_matches_take_every_dtype(device, dtype, mode, cols):
  rng = np.random.default_rng(cols)
  data = random_table(rng, 37, cols, dtype)
  idx = jnp.asarray(indices_with_edges(rng, 37, (5, 9), np.int32))
  with HostTable(data) as table:
    got = jax.block_until_ready(host_gather(table, idx, mode=mode))  # before close()
  assert_same(got, jnp.take(jnp.asarray(data), idx, axis=0, mode=mode))
  assert got.devices() == {device}


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(), (1,), (11,), (3, 4), (2, 0), (2, 3, 5)])
@pytest.mark.parametrize("mode", ["fill", "clip"])
def test_matches_take_every_index_type_and_shape(device, index_dtype, shape, mode):
  rng = np.random.default_rng(7)
  rows = 100  # indices of every type reach past both ends
  data = random_table(rng, rows, 6, np.float32)
  idx = jnp.asarray(indices_with_edges(rng, rows, shape, index_dtype))
  with HostTable(data) as table:
    got = jax.block_until_ready(host_gather(table, idx, mode=mode))
  assert_same(got, jnp.take(jnp.asarray(data), idx, axis=0, mode=mode))


def test_unsigned_indices_past_the_signed_range(device):
  data = np.arange(20, dtype=np.float32).reshape(10, 2)
  ref = jnp.asarray(data)
  with HostTable(data) as table:
    for idx in (
      jnp.array([0, 9, 10, 2**31, 2**32 - 1], jnp.uint32),
      jnp.array([0, 9, 10, 2**31, 2**32 - 1], jnp.uint64),
    ):
      for mode in ("fill", "clip"):
        assert_same(host_gather(table, idx, mode=mode), jnp.take(ref, idx, axis=0, mode=mode))
    # uint64 values of 2**32 and more are out of range as well. (jnp.take itself returns row 0
    # for 2**32 and 2**63 in "fill" mode, a truncation in its index arithmetic; we keep the
    # unsigned meaning, as NumPy does.)
    huge = jnp.array([2**32, 2**63 - 1, 2**63, 2**64 - 1], jnp.uint64)
    assert np.isnan(np.asarray(host_gather(table, huge))).all()
    assert_same(host_gather(table, huge, mode="clip"), data[[9, 9, 9, 9]])


@pytest.mark.parametrize(
  "dtype,fill",
  [
    (np.float32, -1.5),
    (ml_dtypes.bfloat16, 3.0),
    (np.int32, 7),
    (np.uint8, 9),
    (np.float64, np.inf),
  ],
)
def test_fill_value(device, dtype, fill):
  data = random_table(np.random.default_rng(1), 8, 5, dtype)
  idx = jnp.array([0, 8, -9, 3, 100])
  with HostTable(data) as table:
    got = jax.block_until_ready(host_gather(table, idx, fill_value=fill))
  assert_same(got, jnp.take(jnp.asarray(data), idx, axis=0, mode="fill", fill_value=fill))


# Row sizes that exercise every kernel plan on the GPU: 1/2/4/8/16-byte vectors, one or several
# segments, rows that are and are not multiples of 128 bytes.
@pytest.mark.parametrize(
  "dtype,cols",
  [
    (np.uint8, 1),
    (ml_dtypes.bfloat16, 1),
    (np.float32, 3),
    (np.float32, 16),
    (np.float32, 24),
    (np.float64, 65),
    (np.float32, 130),
    (np.float32, 250),
    (np.float32, 1024),
    (np.int8, 1001),
  ],
)
@pytest.mark.parametrize("sort", [False, True])
def test_row_sizes_sorted_and_unsorted(device, dtype, cols, sort):
  rng = np.random.default_rng(cols)
  rows = 1500
  data = random_table(rng, rows, cols, dtype)
  idx = jnp.asarray(indices_with_edges(rng, rows, (4000,), np.int64))
  with HostTable(data) as table:
    for mode in ("fill", "clip"):
      got = jax.jit(functools.partial(host_gather, mode=mode, sort=sort))(table, idx)
      assert_same(got, jnp.take(jnp.asarray(data), idx, axis=0, mode=mode))


def test_many_indices_use_the_thread_pool(device):
  rng = np.random.default_rng(3)
  data = random_table(rng, 50_000, 64, np.float32)
  idx = jnp.asarray(rng.integers(-60_000, 60_000, size=300_000))
  with HostTable(data) as table:
    assert_same(host_gather(table, idx), jnp.take(jnp.asarray(data), idx, axis=0))


def test_jit_with_table_as_argument_and_as_constant(device):
  data = np.arange(40, dtype=np.float32).reshape(10, 4)
  idx = jnp.array([[1, 2], [9, -1]])
  want = jnp.take(jnp.asarray(data), idx, axis=0)
  with HostTable(data) as table:
    assert_same(jax.jit(host_gather)(table, idx), want)
    assert_same(jax.jit(lambda i: host_gather(table, i))(idx), want)
    assert_same(jax.jit(host_gather, static_argnames="mode")(table, idx, mode="fill"), want)


def test_vmap(device):
  rng = np.random.default_rng(5)
  data = random_table(rng, 30, 7, np.float32)
  batch = jnp.asarray(rng.integers(-35, 35, size=(6, 4, 3)))
  with HostTable(data) as table:
    got = jax.vmap(lambda i: host_gather(table, i))(batch)
    nested = jax.vmap(jax.vmap(lambda i: host_gather(table, i, mode="clip")))(batch)
    jax.block_until_ready((got, nested))
  ref = jnp.asarray(data)
  assert_same(got, jax.vmap(lambda i: jnp.take(ref, i, axis=0))(batch))
  assert_same(nested, jax.vmap(jax.vmap(lambda i: jnp.take(ref, i, axis=0, mode="clip")))(batch))


def test_grad(device):
  rng = np.random.default_rng(6)
  data = random_table(rng, 12, 5, np.float32)
  idx = jnp.array([0, 3, 3, 11, -2])
  w = jnp.asarray(rng.standard_normal((5, 5)), jnp.float32)
  ref = jnp.asarray(data)
  with HostTable(data) as table:
    loss = lambda w: jnp.sum(jnp.tanh(host_gather(table, idx) @ w))  # noqa: E731
    g = jax.jit(jax.grad(loss))(w)
    g_idx = jax.grad(lambda i: jnp.sum(host_gather(table, i)), allow_int=True)(idx)
    jax.block_until_ready((g, g_idx))
  want = jax.grad(lambda w: jnp.sum(jnp.tanh(jnp.take(ref, idx, axis=0) @ w)))(w)
  np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6)
  assert g_idx.dtype == jax.dtypes.float0 and g_idx.shape == idx.shape


def test_shard_map_over_cpu_devices():
  devices = jax.devices("cpu")
  if len(devices) < 2:
    pytest.skip("needs two CPU devices")
  from jax.sharding import Mesh
  from jax.sharding import PartitionSpec as P

  shard_map = getattr(jax, "shard_map", None)
  if shard_map is None:
    from jax.experimental.shard_map import shard_map
  mesh = Mesh(np.array(devices[:2]), ("data",))
  data = np.arange(60, dtype=np.float32).reshape(20, 3)
  idx = jnp.arange(-4, 28)
  with HostTable(data) as table:
    f = shard_map(
      lambda i: host_gather(table, i), mesh=mesh, in_specs=P("data"), out_specs=P("data")
    )
    got = jax.jit(f)(jax.device_put(idx, jax.sharding.NamedSharding(mesh, P("data"))))
    jax.block_until_ready(got)  # dispatch is asynchronous: finish before close()
  assert_same(got, jnp.take(jnp.asarray(data), idx, axis=0))


@settings(max_examples=30, deadline=None)
@given(
  rows=st.integers(1, 300),
  cols=st.integers(1, 40),
  dtype=st.sampled_from([np.float32, ml_dtypes.bfloat16, np.int16, np.int64, np.uint8]),
  shape=st.lists(st.integers(0, 5), min_size=0, max_size=3),
  mode=st.sampled_from(["fill", "clip"]),
  seed=st.integers(0, 2**32 - 1),
  data=st.data(),
)
def test_property_matches_take(rows, cols, dtype, shape, mode, seed, data):
  platform = data.draw(st.sampled_from(["cpu", "gpu"] if _has_gpu() else ["cpu"]))
  rng = np.random.default_rng(seed)
  table_data = random_table(rng, rows, cols, dtype)
  idx = rng.integers(-3 * rows, 3 * rows, size=shape, endpoint=True)
  with jax.default_device(jax.devices(platform)[0]), HostTable(table_data) as table:
    got = host_gather(table, jnp.asarray(idx), mode=mode)
    assert_same(got, jnp.take(jnp.asarray(table_data), jnp.asarray(idx), axis=0, mode=mode))


def _has_gpu():
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


@pytest.mark.parametrize("start,size", [(0, 1), (3, 10), (0, 50), (49, 1), (10, 0)])
def test_host_slice(device, start, size):
  data = random_table(np.random.default_rng(2), 50, 33, np.int32)
  with HostTable(data) as table:
    assert_same(host_slice(table, start, size), data[start : start + size])
    assert_same(jax.jit(lambda: host_slice(table, start, size))(), data[start : start + size])


# -- bad input -----------------------------------------------------------------------------------


def test_float_and_bool_indices_are_refused():
  with HostTable(np.ones((4, 2), np.float32)) as table:
    with pytest.raises(TypeError, match="indices must be integers"):
      host_gather(table, jnp.array([0.0, 1.0]))
    with pytest.raises(TypeError, match="indices must be integers"):
      host_gather(table, np.array([True, False]))


def test_bad_mode_fill_and_table_arguments():
  with HostTable(np.ones((4, 2), np.float32)) as table:
    with pytest.raises(ValueError, match="mode must be"):
      host_gather(table, jnp.array([0]), mode="wrap")
    with pytest.raises(ValueError, match="fill_value must be a scalar"):
      host_gather(table, jnp.array([0]), fill_value=np.ones(2))
    with pytest.raises(TypeError, match="concrete scalar"):
      jax.jit(lambda f: host_gather(table, jnp.array([0]), fill_value=f))(1.0)
    with pytest.raises(ValueError, match="outside the table"):
      host_slice(table, 2, 3)
  with pytest.raises(TypeError, match="must be a HostTable"):
    host_gather(np.ones((4, 2), np.float32), jnp.array([0]))


def test_closed_table_is_refused_when_tracing_and_when_running():
  table = HostTable(np.ones((4, 2), np.float32))
  compiled = jax.jit(lambda i: host_gather(table, i))
  compiled(jnp.array([1])).block_until_ready()
  table.close()
  table.close()  # twice is fine
  with pytest.raises(ValueError, match="is closed"):
    host_gather(table, jnp.array([0]))
  with HostTable(np.ones((1, 1), np.float32)) as probe:  # a later host call, for a GPU's report
    assert_handle_error(
      lambda: compiled(jnp.array([1])),
      "is closed",
      then=lambda: host_gather(probe, jnp.array([0])),
      untouched=all_nan,
    )


def test_64_bit_tables_need_x64():
  with HostTable(np.ones((4, 2), np.int64)) as table:
    with jax.enable_x64(False) if hasattr(jax, "enable_x64") else jax.experimental.disable_x64():
      with pytest.raises(TypeError, match="jax_enable_x64"):
        host_gather(table, jnp.array([0]))


# -- fill values and 64-bit indices, as jnp.take has them ----------------------------------------


def _no_x64():
  return jax.enable_x64(False) if hasattr(jax, "enable_x64") else jax.experimental.disable_x64()


@pytest.mark.parametrize(
  "dtype,fill",
  [
    (np.float32, 2**40),
    (np.float32, -(2**62)),
    (ml_dtypes.bfloat16, 2**40),
    (np.int8, np.inf),
    (np.int8, -np.inf),
    (np.int8, np.nan),
    (np.int8, 300),
    (np.int8, -129),
    (np.uint8, -1),
    (np.uint8, 2.7),
    (np.int32, 1e10),
    (np.int32, np.float32(-3.5)),
    (np.uint32, np.inf),
    (np.int16, True),
    (np.float32, np.int64(2**40)),
    (np.float32, np.uint64(2**64 - 1)),
  ],
)
@pytest.mark.parametrize("x64", [True, False], ids=["x64", "no_x64"])
def test_fill_values_convert_as_jnp_take_converts_them(device, dtype, fill, x64):
  data = random_table(np.random.default_rng(1), 6, 3, dtype)
  idx = np.array([0, 6, -7, 2, 100], np.int32)
  # A float fill an integer table cannot hold (inf, NaN, past the dtype's range) has no defined
  # integer: jnp.take gives each device's conversion, host_gather the CPU's on every device.
  undefined = (
    np.issubdtype(dtype, np.integer)
    and isinstance(fill, (float, np.floating))
    and not np.iinfo(dtype).min <= fill <= np.iinfo(dtype).max
  )
  where = jax.devices("cpu")[0] if undefined else device
  with HostTable(data) as table, _no_x64() if not x64 else jax.default_device(device):
    try:
      with jax.default_device(where):
        want = jnp.take(jnp.asarray(data), jnp.asarray(idx), axis=0, mode="fill", fill_value=fill)
    except (TypeError, ValueError, OverflowError) as e:  # jnp.take refuses it: so must we
      with pytest.raises(ValueError, match="host_gather: fill_value"):
        host_gather(table, jnp.asarray(idx), fill_value=fill)
      return e
    got = jax.block_until_ready(host_gather(table, jnp.asarray(idx), fill_value=fill))
    # Blocked on before the table closes: a kernel still queued when it closes reads nothing
    # (fill values; the next host call reports it), as an H200 run saw once.
    jitted = jax.block_until_ready(
      jax.jit(lambda i: host_gather(table, i, fill_value=fill))(jnp.asarray(idx))
    )
  assert_same(got, want)
  assert_same(jitted, want)


@pytest.mark.parametrize("mode", ["fill", "clip"])
def test_concrete_64_bit_indices_with_x64_off_keep_their_meaning(device, mode):
  data = np.arange(20, dtype=np.float32).reshape(10, 2)
  idx_u = np.array([0, 9, 10, 2**32, 2**32 + 1, 2**33 + 3, 2**63, 2**64 - 1], np.uint64)
  idx_s = np.array([0, -1, -10, -11, 2**32 + 1, -(2**32) + 1, 2**62, -(2**62)], np.int64)
  with HostTable(data) as table, _no_x64():
    for idx in (idx_u, idx_s):
      got = np.asarray(host_gather(table, idx, mode=mode))
      # NumPy's meaning of every index, exact: in [-rows, rows) a row, else fill or clamp.
      big = idx.astype(object)
      rows = [i + 10 if -10 <= i < 0 else i for i in big]
      if mode == "fill":
        want = np.stack([data[r] if 0 <= r < 10 else np.full(2, np.nan, np.float32) for r in rows])
      else:
        want = np.stack([data[min(max(i, 0), 9)] for i in big])
      assert_same(got, want)
