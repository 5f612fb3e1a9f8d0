"""HostTable: construction, contents, files, lifetime, bad input."""

import functools
import gc
import weakref

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from handle_errors import all_nan, assert_handle_error

from jaxdata import _ffi
from jaxdata.host import HostTable, host_gather, host_scatter_add, host_slice
from jaxdata.host.gather import _fill_bits


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16, np.int32, np.int64])
def test_round_trip(dtype):
  data = (np.arange(35) - 17).reshape(5, 7).astype(dtype)
  with HostTable(data) as t:
    assert t.shape == (5, 7) and t.dtype == np.dtype(dtype) and t.nbytes == data.nbytes
    np.testing.assert_array_equal(t.as_numpy(), data)
    assert t.pinned == (_ffi.cuda_device_count() > 0)


def test_read_only_source():
  data = np.arange(12, dtype=np.float32).reshape(4, 3)
  data.setflags(write=False)  # e.g. a dataset's frozen arrays
  with HostTable(data) as t:
    np.testing.assert_array_equal(t.as_numpy(), data)
    t.write(1, data[:2])


def test_non_contiguous_source_and_write():
  data = np.arange(200, dtype=np.float32).reshape(20, 10)
  with HostTable(data[:, ::2]) as t:
    np.testing.assert_array_equal(t.as_numpy(), data[:, ::2])
    t.write(3, np.full((2, 5), -1, np.int16))  # same-kind cast
    assert (t.as_numpy()[3:5] == -1).all() and t.as_numpy()[5, 0] == data[5, 0]
    with pytest.raises(ValueError, match="outside"):
      t.write(19, np.zeros((2, 5), np.float32))
    with pytest.raises(ValueError, match="do not fit"):
      t.write(0, np.zeros((2, 4), np.float32))
    with pytest.raises(TypeError, match="cannot cast"):
      t.write(0, np.zeros((2, 5), np.complex64))


def test_view_shares_memory_and_has_its_own_lifetime():
  data = np.arange(64, dtype=np.float32).reshape(8, 8)
  t = HostTable(data)
  wide = t.view(columns=16)
  raw = t.view(np.uint8, columns=4)
  assert wide.shape == (4, 16) and raw.shape == (64, 4)
  t.close()
  np.testing.assert_array_equal(
    np.asarray(host_gather(wide, jnp.array([1]))), data.reshape(4, 16)[1:2]
  )
  np.testing.assert_array_equal(raw.as_numpy()[:4].reshape(-1).view(np.float32), data[0, :4])
  with pytest.raises(ValueError, match="do not divide"):
    wide.view(columns=5)
  wide.close(), raw.close()


def test_numpy_view_outlives_close():
  t = HostTable(np.full((1000, 100), 3.0, np.float32))
  v = t.as_numpy()
  t.close()
  del t
  gc.collect()
  assert v.sum() == 3.0 * 100_000  # the memory is still there: no dangling view, no crash
  with pytest.raises(ValueError, match="closed"):
    HostTable(np.ones((1, 1), np.float32)).close() or HostTable.as_numpy(_closed())


def _closed():
  t = HostTable(np.ones((1, 1), np.float32))
  t.close()
  return t


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.uint8])
def test_from_npy(tmp_path, dtype):
  data = (np.random.default_rng(0).standard_normal((300, 17)) * 50).astype(dtype)
  path = tmp_path / "t.npy"
  np.save(path, data)
  with HostTable.from_npy(path, progress=True, threads=3) as t:
    np.testing.assert_array_equal(t.as_numpy(), data)


def test_from_npy_reinterprets_bfloat16(tmp_path):
  data = np.arange(12, dtype=np.float32).reshape(3, 4).astype(ml_dtypes.bfloat16)
  path = tmp_path / "bf16.npy"
  np.save(path, data.view(np.uint16))
  with HostTable.from_npy(path, dtype=ml_dtypes.bfloat16) as t:
    np.testing.assert_array_equal(t.as_numpy().astype(np.float32), data.astype(np.float32))
  with pytest.raises(TypeError, match="4-byte items"):
    HostTable.from_npy(path, dtype=np.float32)


def test_from_npy_bad_files(tmp_path):
  good = tmp_path / "good.npy"
  np.save(good, np.ones((100, 10), np.float32))
  truncated = tmp_path / "truncated.npy"
  truncated.write_bytes(good.read_bytes()[:-7])
  with pytest.raises(ValueError, match="truncated"):
    HostTable.from_npy(truncated)
  fortran = tmp_path / "fortran.npy"
  np.save(fortran, np.asfortranarray(np.ones((10, 3), np.float32)))
  with pytest.raises(ValueError, match="Fortran order"):
    HostTable.from_npy(fortran)
  flat = tmp_path / "flat.npy"
  np.save(flat, np.ones(10, np.float32))
  with pytest.raises(ValueError, match="2-D"):
    HostTable.from_npy(flat)
  junk = tmp_path / "junk.npy"
  junk.write_bytes(b"not an array at all")
  with pytest.raises(ValueError, match="not a readable .npy"):
    HostTable.from_npy(junk)
  with pytest.raises(FileNotFoundError):
    HostTable.from_npy(tmp_path / "missing.npy")


@pytest.mark.parametrize(
  "array,error,match",
  [
    (np.ones(5, np.float32), ValueError, "2-D"),
    (np.ones((2, 3, 4), np.float32), ValueError, "2-D"),
    (np.ones((0, 4), np.float32), ValueError, "at least one row"),
    (np.ones((2, 2), np.complex64), TypeError, "not supported"),
    (np.ones((2, 2), bool), TypeError, "not supported"),
    (np.array([["a"]]), TypeError, "not supported"),
    (np.ones((2, 2), ">f4"), TypeError, "byte order"),
  ],
)
def test_bad_arrays(array, error, match):
  with pytest.raises(error, match=match):
    HostTable(array)


def test_larger_than_host_memory_is_refused_before_allocating():
  ram = _ffi.ext.physical_memory_bytes()
  rows = ram // 4096 + 1024
  with pytest.raises(MemoryError, match="physical memory"):
    HostTable.empty((rows, 1024), np.float32)


def test_context_manager_and_repr():
  with HostTable(np.ones((3, 2), np.float32)) as t:
    assert "float32" in repr(t) and "(3, 2)" in repr(t)
  assert t.closed and "closed" in repr(t)
  with pytest.raises(ValueError, match="closed"):
    t.write(0, np.ones((1, 2), np.float32))


# -- lifetime through JAX's caches ---------------------------------------------------------------


def test_tables_of_one_shape_and_dtype_share_one_executable(device):
  # Each table is closed before the next opens: on a GPU the new one takes a registry slot the
  # same executable resolves afresh.
  f = jax.jit(lambda t, i: host_gather(t, i))  # its own cache (jit shares a function's)
  idx = jnp.array([0, 2, -1, 5])
  data = np.random.default_rng(0).standard_normal((8, 3, 4)).astype(np.float32)
  for k in range(8):
    with HostTable(data[k]) as t:
      got = jax.block_until_ready(f(t, idx))
    np.testing.assert_array_equal(got, jnp.take(jnp.asarray(data[k]), idx, axis=0))
  assert f._cache_size() == 1
  with HostTable(np.zeros((5, 4), np.float32)) as other:  # another shape: its own executable
    jax.block_until_ready(f(other, idx))
  assert f._cache_size() == 2


def _gather_and_drop(f, shape, dtype=np.float32):
  t = HostTable(np.ones(shape, dtype))
  jax.block_until_ready(f(t, jnp.array([0])))
  return weakref.ref(t)


def test_a_dropped_table_passed_through_jit_is_collected():
  f = jax.jit(host_gather)
  refs = [_gather_and_drop(f, (1024, 16)) for _ in range(20)]
  gc.collect()
  assert all(r() is None for r in refs), f"{sum(r() is not None for r in refs)} of 20 alive"


def test_a_dropped_adagrad_state_and_graph_passed_through_jit_are_collected():
  from jaxdata.host import HostGraph, sample_neighbors, sparse_adagrad

  opt = sparse_adagrad(0.1)
  update = jax.jit(lambda *a: opt.update(*a))
  sample = jax.jit(lambda g, s, k: sample_neighbors(g, s, (2,), k))
  refs = []
  for _ in range(5):
    table = HostTable(np.ones((64, 4), np.float32))
    state = opt.init(table)
    jax.block_until_ready(update(table, state, jnp.array([1, 2]), jnp.ones((2, 4))))
    graph = HostGraph.from_edges([0, 1, 2], [1, 2, 0], 3)
    jax.block_until_ready(sample(graph, jnp.array([0, 1]), jax.random.key(0)))
    refs += [weakref.ref(table), weakref.ref(state.sum_of_squares), weakref.ref(graph)]
    del table, state, graph
  gc.collect()
  assert all(r() is None for r in refs), f"{sum(r() is not None for r in refs)} alive"
  assert update._cache_size() == 1 and sample._cache_size() == 1


def test_a_closed_table_passed_to_a_function_compiled_for_a_live_one_raises_a_clear_error():
  f = jax.jit(host_gather)
  with HostTable(np.ones((4, 2), np.float32)) as live:
    jax.block_until_ready(f(live, jnp.array([1])))
  closed = HostTable(np.ones((4, 2), np.float32))
  closed.close()
  with pytest.raises(ValueError, match=r"host_gather: HostTable\(shape=\(4, 2\).* is closed"):
    f(closed, jnp.array([1]))
  with pytest.raises(ValueError, match="is closed"):
    jax.jit(lambda t, i, u: host_scatter_add(t, i, u))(closed, jnp.array([1]), jnp.ones((1, 2)))


def test_a_stale_or_foreign_handle_is_refused_by_the_native_side(device):
  # A program built for one table's shape, fed the handle of a closed table or of a table of
  # another shape: the FFI call fails with an error (on a GPU, possibly the next host call on
  # the device: handle_errors.py), it never reads the wrong memory.
  f = jax.jit(host_gather)
  with HostTable(np.ones((4, 2), np.float32)) as a, HostTable(np.ones((6, 2), np.float32)) as b:
    probe = lambda: f(a, jnp.array([0]))  # noqa: E731
    treedef = jax.tree.structure(a)
    foreign = jax.tree.unflatten(treedef, [b.handle])
    assert_handle_error(
      lambda: f(foreign, jnp.array([1])),
      r"has 6 rows .* built for 4 rows",
      then=probe,
      untouched=all_nan,
    )
    never = jax.tree.unflatten(treedef, [np.int32(2**31 - 1)])
    assert_handle_error(
      lambda: f(never, jnp.array([1])), "is closed", then=probe, untouched=all_nan
    )
    gone = HostTable(np.ones((4, 2), np.float32))
    stale = jax.tree.unflatten(treedef, [gone.handle])
    gone.close()
    assert_handle_error(
      lambda: f(stale, jnp.array([1])), "is closed", then=probe, untouched=all_nan
    )


def _raw_gather(handle, idx, rows, cols):
  """jaxdata_host_gather called directly, as a forged program would: float32, NaN fill."""
  out = jax.ShapeDtypeStruct(idx.shape + (cols,), np.float32)
  result, _ = jax.ffi.ffi_call("jaxdata_host_gather", (out, jax.ShapeDtypeStruct((0,), np.uint8)))(
    jnp.asarray(handle, jnp.int32),
    idx,
    rows=np.int64(rows),
    mode=np.int32(0),
    fill_bits=_fill_bits(np.dtype(np.float32), None),
    sort=np.int32(0),
  )
  return result


def _raw_scatter(handle, rows, updates, table_rows):
  return jax.ffi.ffi_call(
    "jaxdata_host_scatter_add", jax.ShapeDtypeStruct((), jnp.int32), has_side_effect=True
  )(
    jnp.asarray(handle, jnp.int32),
    rows,
    jnp.arange(rows.shape[0], dtype=jnp.int32),
    updates,
    rows=np.int64(table_rows),
  )


def _raw_sample(indptr_handle, indices_handle, nodes, num_nodes, num_edges, fanout):
  shape = (nodes.shape[0], fanout)
  return jax.ffi.ffi_call(
    "jaxdata_host_sample",
    (jax.ShapeDtypeStruct(shape, jnp.int32), jax.ShapeDtypeStruct(shape, bool)),
  )(
    jnp.asarray(indptr_handle, jnp.int32),
    jnp.asarray(indices_handle, jnp.int32),
    nodes,
    jnp.zeros(2, jnp.uint32),
    num_nodes=np.int64(num_nodes),
    num_edges=np.int64(num_edges),
    fanout=np.int64(fanout),
    replace=np.int32(0),
  )


def test_forged_handles_through_the_raw_ffi_calls_read_and_write_nothing(device):
  # Handles no public API makes: zero, negative, never issued, closed, of another geometry, and
  # one that lands on a live table's registry slot (id + 2**16) but is not its id.
  from jaxdata.host import HostGraph

  data = np.arange(24, dtype=np.float32).reshape(8, 3)
  with (
    HostTable(data) as t,
    HostTable(np.ones((5, 3), np.float32)) as other,
    HostTable(np.ones((1, 1), np.float32)) as probe_table,
    HostGraph.from_edges([0, 1, 2, 3], [1, 2, 3, 0], 4) as g,
  ):
    gone = HostTable(data)
    gone_id = gone.table_id
    gone.close()
    probe = lambda: host_gather(probe_table, jnp.array([0]))  # noqa: E731
    idx = jnp.array([0, 3, 7, -1], jnp.int32)
    forged = [
      (0, "is closed"),
      (-7, "is closed"),
      (2**31 - 1, "is closed"),
      (gone_id, "is closed"),
      (t.table_id + 2**16, "is closed"),
      (other.table_id, r"has 5 rows of 12 bytes; .* built for 8 rows of 12"),
    ]
    for handle, match in forged:
      assert_handle_error(
        functools.partial(_raw_gather, handle, idx, 8, 3), match, then=probe, untouched=all_nan
      )
      # A scatter fails the call itself (it waits for its kernel) and adds nothing anywhere.
      with pytest.raises(Exception, match=match):
        jax.block_until_ready(
          _raw_scatter(handle, jnp.array([0, 7], jnp.int32), jnp.ones((2, 3), jnp.float32), 8)
        )
      nodes = jnp.array([0, 1, 2, 3], jnp.int32)
      for handles in ((handle, g.indices.handle), (g.indptr.handle, handle)):
        assert_handle_error(
          functools.partial(_raw_sample, *handles, nodes, 4, 4, 2),
          "jaxdata: HostTable",
          then=probe,
          untouched=lambda r: not np.asarray(r[1]).any(),
        )
    np.testing.assert_array_equal(t.as_numpy(), data)
    np.testing.assert_array_equal(other.as_numpy(), np.ones((5, 3), np.float32))
    # The real handle still works, through the same raw call.
    np.testing.assert_array_equal(_raw_gather(t.table_id, idx, 8, 3), data[[0, 3, 7, 7]])
    jax.block_until_ready(probe())


def test_an_unmapped_table_is_refused_by_a_gpu_kernel(device):
  if device.platform != "gpu":
    pytest.skip("only a GPU needs mapped memory")
  with (
    HostTable(np.ones((4, 2), np.float32), pinned=False) as t,
    HostTable(np.ones((1, 1), np.float32)) as probe_table,
  ):
    assert_handle_error(
      lambda: host_gather(t, jnp.array([0])),
      "not in pinned, device-mapped",
      then=lambda: host_gather(probe_table, jnp.array([0])),
      untouched=all_nan,
    )


def _queued_fraction(fn, *args, calls: int = 50) -> float:
  """Of the time `calls` calls take to run, the part spent queuing them (the second of two
  rounds: the allocator already holds the outputs' memory, so no allocation waits)."""
  import time

  for _ in range(2):
    start = time.perf_counter()
    outs = [fn(*args) for _ in range(calls)]
    queued = time.perf_counter() - start
    jax.block_until_ready(outs)
    total = time.perf_counter() - start
    del outs
  return queued / total


@pytest.mark.gpu
def test_gathers_are_queued_without_waiting_for_the_gpu():
  """A handler that waited for the GPU (to read the table's handle, say) would make queuing
  take nearly all the time the calls take to run (49/50 measured); host_gather queues as well
  as XLA's own gather from device memory, whatever JAX's limit on work in flight."""
  try:
    gpu = jax.devices("gpu")[0]
  except RuntimeError:
    pytest.skip("no GPU visible to JAX")
  rng = np.random.default_rng(0)
  rows = 1 << 18
  data = rng.standard_normal((rows, 64), np.float32)
  with jax.default_device(gpu), HostTable(data) as t:
    idx = jax.device_put(rng.integers(0, rows, 1 << 19).astype(np.int32), gpu)
    ours = jax.jit(host_gather)
    plain = jax.jit(lambda a, i: jnp.take(a, i, axis=0))
    on_device = jax.device_put(data, gpu)
    jax.block_until_ready((ours(t, idx), plain(on_device, idx)))  # compiled and warm
    gather = _queued_fraction(ours, t, idx)  # 128 MiB each, a few milliseconds of GPU time
    reference = _queued_fraction(plain, on_device, idx)
    np.testing.assert_array_equal(ours(t, idx)[:4], data[np.asarray(idx[:4])])
  assert gather < max(0.5, reference + 0.15), (gather, reference)


def test_tree_map_over_a_table_gives_the_table_back_and_placeholders_refuse_host_access():
  with HostTable(np.ones((4, 2), np.float32)) as t:
    assert jax.tree.map(lambda x: x, t) is t
    assert jax.device_put(t) is t and jax.jit(lambda x: x)(t) is t

    @jax.jit
    def f(table):
      with pytest.raises(TypeError, match="inside a JAX transformation"):
        table.as_numpy()
      return host_gather(table, jnp.array([0]))

    jax.block_until_ready(f(t))


# -- edge semantics and bad input -----------------------------------------------------------------


@pytest.mark.parametrize("shift", [1, -1, 3, -5])
def test_write_from_an_overlapping_view_has_numpy_semantics(shift):
  rng = np.random.default_rng(1)
  data = rng.standard_normal((2000, 33)).astype(np.float32)
  want = data.copy()
  if shift > 0:
    want[shift:] = want[:-shift]
  else:
    want[:shift] = want[-shift:]
  with HostTable(data) as t:
    view = t.as_numpy()
    if shift > 0:
      t.write(shift, view[:-shift])
    else:
      t.write(0, view[-shift:])
    np.testing.assert_array_equal(t.as_numpy(), want)
    t.write(0, view[::-1])  # reversed, non-contiguous, the whole table
    np.testing.assert_array_equal(t.as_numpy(), want[::-1])


def test_copy_and_deepcopy_give_an_independent_table():
  import copy

  data = np.arange(12, dtype=np.float32).reshape(4, 3)
  with HostTable(data) as t:
    for c in (copy.copy(t), copy.deepcopy(t)):
      assert c is not t and c.shape == t.shape and c.dtype == t.dtype
      np.testing.assert_array_equal(c.as_numpy(), data)
      c.as_numpy()[0] = -1
      c.close()
      assert not t.closed
      np.testing.assert_array_equal(t.as_numpy(), data)
      np.testing.assert_array_equal(host_gather(t, jnp.array([0])), data[:1])


def test_copying_a_graph_is_refused_with_advice():
  import copy

  from jaxdata.host import HostGraph

  with HostGraph.from_edges([0, 1], [1, 0], 2) as g:
    with pytest.raises(TypeError, match="build another HostGraph"):
      copy.copy(g)
    with pytest.raises(TypeError, match="build another HostGraph"):
      copy.deepcopy(g)
    assert not g.closed


def test_from_npy_garbled_header_is_a_value_error_naming_the_file(tmp_path):
  good = tmp_path / "good.npy"
  np.save(good, np.ones((3, 2), np.float32))
  raw = good.read_bytes()
  header_end = raw.index(b"}")
  for k, garble in enumerate(
    [
      b"{'descr': '<f4', 'fortran_order': False, 'shape': (3, 2",
      b"{'descr': '<f4' 'fortran_order'",
      b"{(((((",
      b"\x00\xff{",
    ]
  ):
    bad = tmp_path / f"bad{k}.npy"
    bad.write_bytes(raw[:10] + garble.ljust(header_end - 10, b" ") + raw[header_end:])
    with pytest.raises(ValueError, match=f"HostTable.from_npy: .*bad{k}.npy is not a readable"):
      HostTable.from_npy(bad)


@pytest.mark.parametrize(
  "call,error,match",
  [
    (lambda: HostTable.empty((2.5, 3), np.float32), TypeError, r"HostTable.empty: shape"),
    (lambda: HostTable.empty(("a", 3), np.float32), TypeError, r"HostTable.empty: shape"),
    (lambda: HostTable.empty(7, np.float32), TypeError, r"HostTable.empty: shape"),
    (lambda: HostTable.empty((2**40, 2**40), np.float32), ValueError, "too large"),
    (lambda: _open().write(1.5, np.ones((1, 3), np.float32)), TypeError, "HostTable.write: start"),
    (lambda: _open().write(True, np.ones((1, 3), np.float32)), TypeError, "HostTable.write: start"),
    (lambda: _open().write(2**70, np.ones((1, 3), np.float32)), ValueError, "outside"),
    (lambda: _open().view(np.float32, columns=1.5), TypeError, "HostTable.view: columns"),
    (lambda: _open().view(np.float32, columns=-3), ValueError, "do not divide"),
    (lambda: host_slice(_open(), 1.0, 2), TypeError, "host_slice: start"),
    (lambda: host_slice(_open(), 0, None), TypeError, "host_slice: size"),
    (lambda: host_slice(_open(), 2**70, 1), ValueError, "outside"),
  ],
)
def test_bad_shapes_and_offsets_give_errors_naming_the_function(call, error, match):
  with pytest.raises(error, match=match) as info:
    call()
  assert "incompatible function arguments" not in str(info.value)


_KEEP = []


def _open():
  t = HostTable(np.ones((4, 3), np.float32))
  _KEEP.append(t)
  return t
