"""HostTable: a 2-D table in host memory that GPU kernels read directly."""

from __future__ import annotations

import concurrent.futures
import operator
import os
import weakref
from typing import Any

import jax
import jax.core
import ml_dtypes
import numpy as np
import rich.progress

from jaxdata import _ffi

#: Element types a HostTable may hold (the gather moves bytes, so any 1/2/4/8-byte type works).
SUPPORTED_DTYPES = tuple(
  np.dtype(t)
  for t in (
    np.float16,
    ml_dtypes.bfloat16,
    np.float32,
    np.float64,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
  )
)

_READ_CHUNK = 64 << 20  # .npy files are read in chunks of this size, several at once
_PROGRESS_ABOVE = 1 << 30  # show a progress bar for files larger than this


def _check_dtype(dtype: Any, what: str) -> np.dtype:
  try:
    dtype = np.dtype(dtype)
  except TypeError as e:
    raise TypeError(f"{what}: {dtype!r} is not a NumPy dtype") from e
  if dtype.newbyteorder("=") not in SUPPORTED_DTYPES:
    names = ", ".join(d.name for d in SUPPORTED_DTYPES)
    raise TypeError(f"{what}: dtype {dtype} is not supported; use one of {names}")
  if not dtype.isnative:
    raise TypeError(
      f"{what}: dtype {dtype.str} is not in this machine's byte order "
      "(convert with .astype(dtype.newbyteorder('=')))"
    )
  return dtype


def _check_int(value: Any, what: str) -> int:
  """`value` as a Python int, or a TypeError naming `what` (floats and bools are refused)."""
  if isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{what} must be an integer, got {value!r}")
  try:
    return operator.index(value)
  except TypeError:
    raise TypeError(f"{what} must be an integer, got {value!r}") from None


def _check_shape(shape: Any, what: str) -> tuple[int, int]:
  try:
    shape = tuple(shape)
  except TypeError:
    raise TypeError(f"{what}: shape must be a (rows, columns) tuple, got {shape!r}") from None
  shape = tuple(_check_int(s, f"{what}: shape {shape}") for s in shape)
  if len(shape) != 2:
    raise ValueError(f"{what}: a HostTable is 2-D (rows, columns); got shape {shape}")
  if shape[0] < 1 or shape[1] < 1:
    raise ValueError(f"{what}: a HostTable needs at least one row and one column; got {shape}")
  if shape[0] * shape[1] > 1 << 60:
    raise ValueError(f"{what}: shape {shape} is too large for host memory")
  return shape


# Open tables by id, so that a pytree of tables rebuilt from concrete handles (jax.tree.map, the
# outputs of jax.jit) gives back the tables themselves.
_LIVE: weakref.WeakValueDictionary[int, HostTable] = weakref.WeakValueDictionary()


class HostTable:
  """A 2-D table in host memory that the GPU reads directly (zero-copy).

  With a GPU visible (and jaxdata built with CUDA) the memory is page-locked and mapped into
  every GPU's address space, so `host_gather` reads rows over PCIe from inside a jitted GPU
  program; otherwise it is plain aligned memory and gathers run on the CPU.

  The table owns its memory: `close()` it (or use it as a context manager) to release it.
  A closed table cannot be gathered from: tracing raises `ValueError`, and an executable that
  was compiled for it fails with an error naming the table (on a GPU, where `host_gather` and
  `sample_neighbors` never wait for the device, the call reads nothing and the next jaxdata host
  call on that GPU raises it: docs/host.md). NumPy views from `as_numpy()` keep the memory alive
  on their own, so they never dangle.

  A HostTable is a pytree whose one leaf is its handle (an int32 scalar naming the table to the
  native code) and whose static part is its shape and dtype: pass it to a jitted function like
  any argument, and every table of one shape and dtype shares one compiled executable, which
  holds no table alive. Inside the function the table is a placeholder that `host_gather` and
  friends accept but whose memory cannot be read from Python (`as_numpy`, `write`). Closing
  over a table works too (its handle becomes a constant of the program). Under `vmap`, give a
  table `in_axes=None`.

  `copy.copy` and `copy.deepcopy` give an independent table: new memory holding the same
  contents, which the caller owns and closes.

  Example:
    >>> table = HostTable(np.random.rand(1000, 64).astype(np.float32))
    >>> rows = jax.jit(host_gather)(table, jnp.array([5, 17, 999]))
    >>> table.close()

  Args:
    array: the contents, any array-like of a supported dtype with two dimensions. It is copied
      once, into the table's memory.
    pinned: page-lock and map the memory for the GPU. Default: when a GPU is visible.
  """

  def __init__(self, array: Any, *, pinned: bool | None = None):
    array = np.asarray(array)
    dtype = _check_dtype(array.dtype, "HostTable")
    shape = _check_shape(array.shape, "HostTable")
    self._allocate(shape, dtype, pinned)
    try:
      self.write(0, array)
    except BaseException:
      self.close()
      raise

  # -- construction -------------------------------------------------------------------------

  @classmethod
  def empty(cls, shape: tuple[int, int], dtype: Any, *, pinned: bool | None = None) -> HostTable:
    """A table of the given shape and dtype whose contents are not initialized."""
    table = cls.__new__(cls)
    table._allocate(
      _check_shape(shape, "HostTable.empty"), _check_dtype(dtype, "HostTable.empty"), pinned
    )
    return table

  @classmethod
  def from_npy(
    cls,
    path: str | os.PathLike,
    *,
    dtype: Any = None,
    pinned: bool | None = None,
    progress: bool | None = None,
    threads: int = 8,
  ) -> HostTable:
    """Loads a 2-D `.npy` file straight into table memory, with no intermediate copy.

    The file is read in chunks by several threads directly into the (pinned) table, so a file
    larger than what comfortably fits twice in RAM loads fine.

    Args:
      path: a `.npy` file holding a C-ordered 2-D array.
      dtype: read the elements as this dtype instead (same item size), e.g. `ml_dtypes.bfloat16`
        for files NumPy saved as raw 2-byte voids.
      pinned: as for `HostTable`.
      progress: show a progress bar; default: for files over 1 GiB.
      threads: reads in flight at once.
    """
    path = os.fspath(path)
    threads = _check_int(threads, "HostTable.from_npy: threads")
    with open(path, "rb") as f:
      try:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
          shape, fortran_order, file_dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
          shape, fortran_order, file_dtype = np.lib.format.read_array_header_2_0(f)
        else:
          raise ValueError(f".npy format version {version} is not supported")
      except OSError:
        raise
      except Exception as e:  # NumPy's header parser raises ValueError, SyntaxError, TokenError...
        raise ValueError(
          f"HostTable.from_npy: {path} is not a readable .npy file ({type(e).__name__}: {e})"
        ) from e
      data_offset = f.tell()
      file_size = os.fstat(f.fileno()).st_size
      if dtype is not None:
        want = np.dtype(dtype)
        if want.itemsize != file_dtype.itemsize:
          raise TypeError(
            f"HostTable.from_npy: dtype {want} has {want.itemsize}-byte items, "
            f"the file's {file_dtype} has {file_dtype.itemsize}"
          )
        file_dtype = want
      file_dtype = _check_dtype(file_dtype, f"HostTable.from_npy({path})")
      shape = _check_shape(shape, f"HostTable.from_npy({path})")
      if fortran_order and shape[1] > 1:
        raise ValueError(
          f"HostTable.from_npy: {path} is in Fortran order; a HostTable needs "
          "C-ordered rows (save np.ascontiguousarray(x))"
        )
      nbytes = shape[0] * shape[1] * file_dtype.itemsize
      if file_size < data_offset + nbytes:
        raise ValueError(
          f"HostTable.from_npy: {path} is truncated: its header promises "
          f"{nbytes} bytes of data, the file holds {file_size - data_offset}"
        )
      table = cls.__new__(cls)
      table._allocate(shape, file_dtype, pinned)
      try:
        table._read_file(f.fileno(), data_offset, nbytes, path, progress, threads)
      except BaseException:
        table.close()
        raise
    return table

  def _allocate(self, shape: tuple[int, int], dtype: np.dtype, pinned: bool | None) -> None:
    if pinned is None:
      pinned = _ffi.cuda_device_count() > 0
    elif pinned and not _ffi.built_with_cuda():
      raise ValueError("HostTable(pinned=True) needs jaxdata built with CUDA (see `jaxdata info`)")
    nbytes = shape[0] * shape[1] * dtype.itemsize
    buffer = _ffi.ext.HostBuffer.allocate(nbytes, bool(pinned))
    self._init_view(buffer, shape, dtype)

  def _init_view(self, buffer: Any, shape: tuple[int, int], dtype: np.dtype) -> None:
    self._buffer = buffer
    self._shape = shape
    self._dtype = dtype
    self._closed = False
    self._id = _ffi.ext.register_table(buffer, shape[0], shape[1] * dtype.itemsize)
    self._handle = np.asarray(self._id, np.int32)
    self._finalizer = weakref.finalize(self, _ffi.ext.close_table, self._id)
    _LIVE[self._id] = self

  @classmethod
  def _placeholder(
    cls, handle: Any, shape: tuple[int, int], dtype: np.dtype, closed: bool
  ) -> HostTable:
    """What a table is inside a transformation: its handle (a tracer), shape and dtype only."""
    table = cls.__new__(cls)
    table._buffer = None
    table._shape, table._dtype, table._closed = shape, dtype, closed
    table._handle, table._id, table._finalizer = handle, None, None
    return table

  def _read_file(
    self, fd: int, offset: int, nbytes: int, name: str, progress: bool | None, threads: int
  ) -> None:
    chunks = [(o, min(_READ_CHUNK, nbytes - o)) for o in range(0, nbytes, _READ_CHUNK)]
    buffer = self._open_buffer("HostTable.from_npy")

    def read(c):
      return buffer.read_file(fd, offset + c[0], c[0], c[1])

    show = nbytes > _PROGRESS_ABOVE if progress is None else progress
    with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
      done = pool.map(read, chunks)
      if not show:
        list(done)
        return

      with rich.progress.Progress(
        *rich.progress.Progress.get_default_columns(),
        rich.progress.TransferSpeedColumn(),
        transient=True,
      ) as bar:
        task = bar.add_task(f"loading {os.path.basename(name)}", total=nbytes)
        for (_, size), _ in zip(chunks, done):
          bar.advance(task, size)

  # -- properties ---------------------------------------------------------------------------

  @property
  def shape(self) -> tuple[int, int]:
    return self._shape

  @property
  def dtype(self) -> np.dtype:
    return self._dtype

  @property
  def nbytes(self) -> int:
    return self._shape[0] * self._shape[1] * self._dtype.itemsize

  @property
  def ndim(self) -> int:
    return 2

  @property
  def pinned(self) -> bool:
    """Whether the memory is page-locked and mapped for the GPU."""
    return self._buffer is not None and self._buffer.pinned

  @property
  def closed(self) -> bool:
    return self._closed

  @property
  def table_id(self) -> int:
    """The id FFI calls refer to this table by."""
    self._check_open("table_id")
    return self._id

  @property
  def handle(self) -> Any:
    """The table's id as an int32 scalar: the operand FFI calls take (a tracer inside jit)."""
    return self._handle

  def __repr__(self) -> str:
    if self._id is None:
      state = "closed" if self._closed else "traced"
      return f"HostTable(shape={self._shape}, dtype={self._dtype.name}, {state})"
    state = "closed" if self.closed else ("pinned" if self.pinned else "unpinned")
    return f"HostTable(shape={self._shape}, dtype={self._dtype.name}, {state}, id={self._id})"

  def __copy__(self) -> HostTable:
    """An independent table with the same contents (new memory, the caller's to close)."""
    self._check_open("copy.copy(HostTable)")
    return HostTable(self.as_numpy(), pinned=self.pinned)

  def __deepcopy__(self, memo: dict) -> HostTable:
    return self.__copy__()

  # -- contents -----------------------------------------------------------------------------

  def write(self, start: int, values: Any) -> None:
    """Copies `values` (rows, columns) into rows `start`, `start + 1`, ... of the table.

    As NumPy's `a[start:start + n] = values`, also when `values` is a view of this table's own
    memory (overlapping rows are read before they are overwritten). Each chunk is written under
    the memory's update lock, so it never interleaves with a running `host_scatter_add`.
    """
    buffer = self._open_buffer("write")
    start = _check_int(start, "HostTable.write: start")
    values = np.asarray(values)
    if values.ndim != 2 or values.shape[1] != self._shape[1]:
      raise ValueError(
        f"HostTable.write: values of shape {values.shape} do not fit rows of "
        f"{self._shape[1]} columns"
      )
    if not 0 <= start <= self._shape[0] - values.shape[0]:
      raise ValueError(
        f"HostTable.write: rows [{start}, {start + values.shape[0]}) are outside "
        f"the table's {self._shape[0]} rows"
      )
    if values.dtype != self._dtype:
      if not np.can_cast(values.dtype, self._dtype, "same_kind"):
        raise TypeError(f"HostTable.write: cannot cast {values.dtype} to {self._dtype}")
      values = values.astype(self._dtype)
    elif np.may_share_memory(values, buffer.view()):
      values = values.copy()  # the chunks below would overwrite rows before reading them
    row_bytes = self._shape[1] * self._dtype.itemsize
    step = max(1, (256 << 20) // row_bytes)  # strided input is made contiguous a chunk at a time
    for i in range(0, values.shape[0], step):
      chunk = np.ascontiguousarray(values[i : i + step])
      buffer.write((start + i) * row_bytes, chunk.reshape(-1).view(np.uint8))

  def as_numpy(self) -> np.ndarray:
    """A NumPy view of the table's memory (no copy); writes through it change the table.

    The view holds the memory alive by itself: after `close()` it stays valid, and the memory
    is released when the last view is gone.
    """
    return self._open_buffer("as_numpy").view().view(self._dtype).reshape(self._shape)

  def view(self, dtype: Any = None, *, columns: int | None = None) -> HostTable:
    """The same memory seen with another dtype and/or row width, as a new table.

    The new table has its own id and lifetime; the memory is released once every table and
    NumPy view sharing it is gone.
    """
    self._check_open("view")
    dtype = self._dtype if dtype is None else _check_dtype(dtype, "HostTable.view")
    width = (
      self._shape[1] * self._dtype.itemsize // dtype.itemsize
      if columns is None
      else _check_int(columns, "HostTable.view: columns")
    )
    row_bytes = width * dtype.itemsize
    if row_bytes <= 0 or self.nbytes % row_bytes:
      raise ValueError(
        f"HostTable.view: {self.nbytes} bytes do not divide into rows of {width} x {dtype}"
      )
    table = HostTable.__new__(HostTable)
    table._init_view(self._buffer, (self.nbytes // row_bytes, int(width)), dtype)
    return table

  # -- lifetime -----------------------------------------------------------------------------

  def close(self) -> None:
    """Releases the table. Safe to call twice; gathers already running on a GPU finish first.

    On a GPU this waits for the devices that have run jaxdata host kernels, so no kernel can
    still be reading the table afterwards. A computation dispatched earlier but not yet running
    (JAX dispatch is asynchronous) reads nothing from the table and fails with an error naming
    it (on a GPU, raised by the next jaxdata host call there): wait for results that read it
    before closing.
    """
    if self._closed or self._finalizer is None:
      return  # a placeholder owns nothing
    self._finalizer()  # unregisters the id
    self._buffer = None
    self._closed = True

  def __enter__(self) -> HostTable:
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()

  def _open_buffer(self, what: str) -> Any:
    """The table's memory, after `_check_open(what)`: an open table that is no placeholder."""
    self._check_open(what)
    assert self._buffer is not None  # only placeholders and closed tables lack one
    return self._buffer

  def _check_open(self, what: str) -> None:
    if self._closed:
      raise ValueError(f"{what}: {self!r} is closed")
    if self._buffer is None and self._id is None:
      raise TypeError(
        f"{what}: {self!r} stands for a table inside a JAX transformation (jit, "
        "vmap, ...), where its memory cannot be used from Python; use the table "
        "outside the transformation, or pass what you need as an array"
      )


def _flatten(table: HostTable) -> tuple[tuple[Any], tuple[Any, ...]]:
  # Only the shape, dtype and whether it is closed are static: tables of one shape and dtype
  # share an executable, and the jit cache never holds a table. (A closed table retraces, so
  # host_gather and friends refuse it with a Python error before anything runs.)
  return (table.handle,), (table.shape, table.dtype, table.closed)


def _unflatten(aux: tuple[Any, ...], leaves: tuple[Any]) -> HostTable:
  (handle,) = leaves
  shape, dtype, closed = aux
  live = None
  if (
    not isinstance(handle, jax.core.Tracer)
    and isinstance(handle, (int, np.integer, np.ndarray, jax.Array))
    and np.ndim(handle) == 0
  ):
    try:  # a concrete handle (tree_map, device_put, a jit output): the live table itself
      live = _LIVE.get(int(handle))
    except (TypeError, ValueError, RuntimeError):
      live = None
  if live is not None and live.shape == shape and live.dtype == dtype and not live.closed:
    return live
  return HostTable._placeholder(handle, shape, dtype, closed)


jax.tree_util.register_pytree_node(HostTable, _flatten, _unflatten)
