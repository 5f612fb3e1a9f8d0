"""host_gather and host_slice: jit-compatible reads of a HostTable into a device array."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from jaxdata import _ffi  # registers the FFI targets
from jaxdata.host.table import HostTable, _check_int

_MODES = {"fill": 0, "clip": 1}

#: With sort=None, indices are sorted before reading tables at least this large (bytes) whose
#: rows are narrower than SORT_BELOW_ROW_BYTES. Random rows scattered over a table this big
#: defeat the GPU's address translation: measured on the H200 (docs/benchmarks/gather.md), a
#: 16 GiB table gives 2.3 GB/s unsorted and 29 GB/s sorted for 64-byte rows, 14.5 and 34 GB/s
#: for 512-byte rows, while rows of 2 KiB and more read as fast unsorted.
SORT_THRESHOLD_BYTES = 2 << 30
SORT_BELOW_ROW_BYTES = 2048


def host_gather(
  table: HostTable,
  indices: Any,
  *,
  mode: str = "fill",
  fill_value: Any = None,
  sort: bool | None = None,
) -> jax.Array:
  """Gathers rows of a host table into a device array: `jnp.take(table, indices, axis=0)`.

  On a GPU the kernel reads the rows straight from the table's pinned host memory (zero-copy);
  on the CPU, XLA's thread pool copies them. The result has exactly the semantics of
  `jnp.take(table_as_array, indices, axis=0, mode=mode, fill_value=fill_value)`:

  - mode="fill": an index in [-rows, 0) counts from the end; any other index outside
    [0, rows) gives a row of `fill_value` (default: NaN for floats, the most negative value
    for signed and the largest value for unsigned integers).
  - mode="clip": indices are clamped to [0, rows - 1].

  Works under `jax.jit`, `jax.vmap` and `jax.grad` (the table is a constant and the indices are
  integers, so the cotangent of `indices` is zero). The table may be closed over or passed as an
  argument (with `in_axes=None` under vmap); either way the compiled program takes the table's
  handle as an operand, so tables of one shape and dtype share it and none is kept alive by it.

  On a GPU the call never waits for the device: the kernel resolves the handle through the
  GPU's copy of the table registry. A handle that names no open table of this shape (a
  function that closed over a table, called after `close()`) reads nothing: the result is all
  fill values and the next jaxdata host call on that GPU raises the error. On the CPU the call
  itself raises it.

  Example:
    >>> with HostTable(np.eye(4, dtype=np.float32)) as t:
    ...   host_gather(t, jnp.array([[0, 3], [-1, 9]]))   # shape (2, 2, 4); row 9 is NaN

  Args:
    table: an open `HostTable`.
    indices: an integer array of any shape and integer dtype.
    mode: "fill" or "clip".
    fill_value: a scalar for out-of-range rows in "fill" mode.
    sort: read the table in ascending row order (GPU): radix-sort the indices first and
      scatter rows back to their places. Default: `sorts_by_default(table)`.

  Returns:
    An array of shape `indices.shape + (table.shape[1],)` and dtype `table.dtype`.
  """
  _check_table(table, "host_gather")
  if mode not in _MODES:
    raise ValueError(f"host_gather: mode must be 'fill' or 'clip', got {mode!r}")
  indices = as_indices(indices, "host_gather")
  fill_bits = _fill_bits(table.dtype, fill_value) if mode == "fill" else np.int64(0)
  if sort is None:
    sort = sorts_by_default(table)
  return _gather(
    table.shape,
    table.dtype,
    _MODES[mode],
    fill_bits,
    bool(sort),
    table.handle,
    _canonical_indices(indices, table.shape[0]),
  )


def sorts_by_default(table: HostTable) -> bool:
  """Whether host_gather sorts indices for this table when `sort` is not given."""
  row_bytes = table.shape[1] * table.dtype.itemsize
  return table.nbytes >= SORT_THRESHOLD_BYTES and row_bytes < SORT_BELOW_ROW_BYTES


def host_slice(table: HostTable, start: int, size: int) -> jax.Array:
  """Rows `start` to `start + size` of a host table, as a device array.

  The rows are contiguous, so on a GPU this is one DMA copy from pinned memory (the fastest
  way to move host memory to the device: `jaxdata bench gather` uses it as the ceiling).
  `start` and `size` are static Python integers; for rows chosen at run time use `host_gather`.
  """
  _check_table(table, "host_slice")
  start = _check_int(start, "host_slice: start")
  size = _check_int(size, "host_slice: size")
  if size < 0 or start < 0 or start + size > table.shape[0]:
    raise ValueError(
      f"host_slice: rows [{start}, {start + size}) are outside the table's {table.shape[0]} rows"
    )
  return jax.ffi.ffi_call(
    "jaxdata_host_slice", jax.ShapeDtypeStruct((size, table.shape[1]), table.dtype)
  )(table.handle, rows=np.int64(table.shape[0]), start=np.int64(start))


# -- checks and conversions --------------------------------------------------------------------


def _x64() -> bool:
  """Whether jax_enable_x64 is on."""
  # jax sets its flags on Config at runtime: no stub declares them
  return bool(jax.config.jax_enable_x64)  # pyright: ignore[reportAttributeAccessIssue]


def _check_table(table: Any, what: str) -> None:
  if not isinstance(table, HostTable):
    raise TypeError(f"{what}: table must be a HostTable, got {type(table).__name__}")
  if table.closed:
    raise ValueError(f"{what}: {table!r} is closed")
  if table.dtype.itemsize == 8 and not _x64():
    raise TypeError(
      f"{what}: the table holds {table.dtype}, which JAX represents only with "
      "jax_enable_x64 on (jax.config.update('jax_enable_x64', True))"
    )


def as_indices(indices: Any, what: str) -> jax.Array:
  """`indices` as a JAX integer array with its meaning kept, or a TypeError naming `what`.

  With jax_enable_x64 off, JAX turns 64-bit NumPy integers into 32-bit ones by wrapping them
  (uint64 2**32 + 5 would become row 5). Concrete 64-bit indices are therefore saturated to the
  32-bit range first: a value past it is out of range for any table JAX can index then, and
  stays out of range ("fill", dropped) or clamps to the same end ("clip").
  """
  dtype = getattr(indices, "dtype", None)
  if dtype is None:
    indices = np.asarray(indices)
    dtype = indices.dtype
  if not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(f"{what}: indices must be integers, got dtype {dtype}")
  dtype = np.dtype(dtype)
  if dtype.itemsize == 8 and not _x64() and not isinstance(indices, jax.Array):
    narrow = np.dtype(np.uint32 if dtype.kind == "u" else np.int32)
    info = np.iinfo(narrow)
    indices = np.clip(np.asarray(indices), info.min, info.max).astype(narrow)
  return jnp.asarray(indices)


def _canonical_indices(idx: jax.Array, rows: int) -> jax.Array:
  """int32 or int64 indices with the same meaning (the kernels take only those two)."""
  dtype = np.dtype(idx.dtype)
  if dtype in (np.int32, np.int64):
    return idx
  if dtype.itemsize < 4:
    return idx.astype(np.int32)
  # Unsigned 32/64-bit: values past the signed range are out of range for any table, so
  # saturating them keeps their meaning.
  if dtype == np.uint32 and _x64():
    return idx.astype(np.int64)
  signed = np.int32 if dtype == np.uint32 else np.int64
  if dtype == np.uint32 and rows > np.iinfo(np.int32).max - 1:
    raise TypeError(
      "host_gather: uint32 indices into a table of more than 2**31 - 2 rows need jax_enable_x64"
    )
  return jnp.minimum(idx, np.array(np.iinfo(signed).max, dtype)).astype(signed)


def _fill_bits(dtype: np.dtype, fill_value: Any) -> np.int64:
  """The fill element's bit pattern, as jnp.take writes it, in an int64 attribute.

  jnp.take converts a scalar fill value with NumPy (`np.asarray(v).astype(dtype)`), never
  through a 32-bit JAX array first: 2**40 fills a float32 table with 1.0995e12 also with x64
  off, 300 wraps to 44 in int8, -1 is 255 in uint8. A float an integer table cannot hold (inf,
  NaN, 1e10 for int32) has no defined integer: jnp.take gives whatever the device's conversion
  gives (the CPU's: 0 for inf on int8, the minimum for 1e10 on int32; a GPU may saturate);
  host_gather gives the CPU's value on every device.
  """
  if isinstance(fill_value, jax.core.Tracer):
    raise TypeError("host_gather: fill_value must be a concrete scalar, not a traced value")
  if fill_value is None:  # jnp.take's defaults
    if jnp.issubdtype(dtype, jnp.inexact):
      fill_value = np.nan
    elif jnp.issubdtype(dtype, jnp.signedinteger):
      fill_value = np.iinfo(dtype).min
    else:
      fill_value = np.iinfo(dtype).max
  if np.shape(fill_value) != ():
    raise ValueError(f"host_gather: fill_value must be a scalar, got shape {np.shape(fill_value)}")
  value = np.asarray(fill_value)
  if not (
    np.issubdtype(value.dtype, np.number)
    or value.dtype == np.bool_
    or value.dtype == object
    or value.dtype == np.dtype(jnp.bfloat16)
  ):
    raise TypeError(f"host_gather: fill_value must be a number, got {fill_value!r}")
  try:
    with np.errstate(invalid="ignore", over="ignore"):
      raw = value.astype(dtype).tobytes()
  except (TypeError, ValueError, OverflowError) as e:
    raise ValueError(
      f"host_gather: fill_value {fill_value!r} cannot fill a {dtype} table: {e}"
    ) from e
  return np.int64(int.from_bytes(raw.ljust(8, b"\0"), "little", signed=True))


# -- the primitive -----------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def _sort_scratch_bytes(n: int, rows: int) -> int:
  return _ffi.ext.sort_scratch_bytes(n, rows)  # 0 without CUDA or a GPU


def _gather_call(shape, dtype, mode, fill_bits, sort, handle, idx):
  out = jax.ShapeDtypeStruct(idx.shape + (shape[1],), dtype)
  # The GPU sorts in a second output that XLA allocates (empty when not sorting; the CPU ignores
  # it). Under vmap it grows with the batch; if that is ever short, the kernel reads unsorted.
  scratch = _sort_scratch_bytes(int(np.prod(idx.shape)), shape[0]) if sort else 0
  # A batch of index arrays is one larger index array: the kernel reads indices flat. The
  # handle is not batched (one table serves the batch): "expand_dims" gives it size-1 axes only.
  result, _ = jax.ffi.ffi_call(
    "jaxdata_host_gather",
    (out, jax.ShapeDtypeStruct((scratch,), np.uint8)),
    vmap_method="expand_dims",
  )(
    handle,
    idx,
    rows=np.int64(shape[0]),
    mode=np.int32(mode),
    fill_bits=fill_bits,
    sort=np.int32(sort),
  )
  return result


# The table enters as its handle (an operand) plus its static shape and dtype, so the compiled
# program does not depend on which table it reads.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _gather(shape, dtype, mode, fill_bits, sort, handle, idx):
  return _gather_call(shape, dtype, mode, fill_bits, sort, handle, idx)


def _gather_fwd(shape, dtype, mode, fill_bits, sort, handle, idx):
  return _gather_call(shape, dtype, mode, fill_bits, sort, handle, idx), None


def _gather_bwd(shape, dtype, mode, fill_bits, sort, _, g):
  del shape, dtype, mode, fill_bits, sort, g
  return (None, None)  # an integer handle and integer indices: zero cotangents


_gather.defvjp(_gather_fwd, _gather_bwd)
