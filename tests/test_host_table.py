"""HostTable: construction, contents, files, lifetime, bad input."""
import gc

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxdata import _ffi
from jaxdata.host import HostTable, host_gather


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
  np.testing.assert_array_equal(np.asarray(host_gather(wide, jnp.array([1]))),
                                data.reshape(4, 16)[1:2])
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


@pytest.mark.parametrize("array,error,match", [
    (np.ones(5, np.float32), ValueError, "2-D"),
    (np.ones((2, 3, 4), np.float32), ValueError, "2-D"),
    (np.ones((0, 4), np.float32), ValueError, "at least one row"),
    (np.ones((2, 2), np.complex64), TypeError, "not supported"),
    (np.ones((2, 2), bool), TypeError, "not supported"),
    (np.array([["a"]]), TypeError, "not supported"),
    (np.ones((2, 2), ">f4"), TypeError, "byte order"),
])
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
