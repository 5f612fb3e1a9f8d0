"""host_gather and host_slice: jit-compatible reads of a HostTable into a device array."""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdata import _ffi  # registers the FFI targets
from jaxdata.host.table import HostTable

_MODES = {"fill": 0, "clip": 1}

#: With sort=None, indices are sorted before reading tables at least this large (bytes) whose
#: rows are narrower than SORT_BELOW_ROW_BYTES. Random rows scattered over a table this big
#: defeat the GPU's address translation: measured on the H200 (docs/benchmarks/gather.md), a
#: 16 GiB table gives 2.3 GB/s unsorted and 29 GB/s sorted for 64-byte rows, 14.5 and 34 GB/s
#: for 512-byte rows, while rows of 2 KiB and more read as fast unsorted.
SORT_THRESHOLD_BYTES = 2 << 30
SORT_BELOW_ROW_BYTES = 2048


def host_gather(table: HostTable, indices: Any, *, mode: str = "fill", fill_value: Any = None,
                sort: bool | None = None) -> jax.Array:
  """Gathers rows of a host table into a device array: `jnp.take(table, indices, axis=0)`.

  On a GPU the kernel reads the rows straight from the table's pinned host memory (zero-copy);
  on the CPU, XLA's thread pool copies them. The result has exactly the semantics of
  `jnp.take(table_as_array, indices, axis=0, mode=mode, fill_value=fill_value)`:

  - mode="fill": an index in [-rows, 0) counts from the end; any other index outside
    [0, rows) gives a row of `fill_value` (default: NaN for floats, the most negative value
    for signed and the largest value for unsigned integers).
  - mode="clip": indices are clamped to [0, rows - 1].

  Works under `jax.jit`, `jax.vmap` and `jax.grad` (the table is a constant and the indices are
  integers, so the cotangent of `indices` is zero).

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
  indices = _check_indices(indices)
  fill_bits = _fill_bits(table.dtype, fill_value) if mode == "fill" else 0
  if sort is None:
    sort = sorts_by_default(table)
  return _gather(table, _MODES[mode], fill_bits, bool(sort),
                 _canonical_indices(indices, table.shape[0]))


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
  start, size = int(start), int(size)
  if size < 0 or start < 0 or start + size > table.shape[0]:
    raise ValueError(f"host_slice: rows [{start}, {start + size}) are outside the table's "
                     f"{table.shape[0]} rows")
  return jax.ffi.ffi_call(
      "jaxdata_host_slice", jax.ShapeDtypeStruct((size, table.shape[1]), table.dtype))(
          table_id=np.int64(table.table_id), start=np.int64(start))


# -- checks and conversions --------------------------------------------------------------------


def _check_table(table: Any, what: str) -> None:
  if not isinstance(table, HostTable):
    raise TypeError(f"{what}: table must be a HostTable, got {type(table).__name__}")
  if table.closed:
    raise ValueError(f"{what}: {table!r} is closed")
  if table.dtype.itemsize == 8 and not jax.config.jax_enable_x64:
    raise TypeError(f"{what}: the table holds {table.dtype}, which JAX represents only with "
                    "jax_enable_x64 on (jax.config.update('jax_enable_x64', True))")


def _check_indices(indices: Any) -> jax.Array:
  dtype = getattr(indices, "dtype", None)
  if dtype is None:
    dtype = np.asarray(indices).dtype
  if not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(f"host_gather: indices must be integers, got dtype {dtype}")
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
  if dtype == np.uint32 and jax.config.jax_enable_x64:
    return idx.astype(np.int64)
  signed = np.int32 if dtype == np.uint32 else np.int64
  if dtype == np.uint32 and rows > np.iinfo(np.int32).max - 1:
    raise TypeError("host_gather: uint32 indices into a table of more than 2**31 - 2 rows need "
                    "jax_enable_x64")
  return jnp.minimum(idx, np.array(np.iinfo(signed).max, dtype)).astype(signed)


def _fill_bits(dtype: np.dtype, fill_value: Any) -> np.int64:
  """The fill element's bit pattern, as jnp.take would write it, in an int64 attribute."""
  if fill_value is None:
    if jnp.issubdtype(dtype, jnp.inexact):
      fill_value = np.nan
    elif jnp.issubdtype(dtype, jnp.signedinteger):
      fill_value = np.iinfo(dtype).min
    else:
      fill_value = np.iinfo(dtype).max
  if isinstance(fill_value, jax.core.Tracer):
    raise TypeError("host_gather: fill_value must be a concrete scalar, not a traced value")
  value = np.asarray(fill_value)
  if value.shape != ():
    raise ValueError(f"host_gather: fill_value must be a scalar, got shape {value.shape}")
  with jax.ensure_compile_time_eval():  # JAX's own conversion rules, also while tracing
    raw = np.asarray(jnp.asarray(value).astype(dtype)).tobytes()
  return np.int64(int.from_bytes(raw.ljust(8, b"\0"), "little", signed=True))


# -- the primitive -----------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def _sort_scratch_bytes(n: int, rows: int) -> int:
  return _ffi.ext.sort_scratch_bytes(n, rows)  # 0 without CUDA or a GPU


def _gather_call(table: HostTable, mode: int, fill_bits: np.int64, sort: bool,
                 idx: jax.Array) -> jax.Array:
  out = jax.ShapeDtypeStruct(idx.shape + (table.shape[1],), table.dtype)
  # The GPU sorts in a second output that XLA allocates (empty when not sorting; the CPU ignores
  # it). Under vmap it grows with the batch; if that is ever short, the kernel reads unsorted.
  scratch = _sort_scratch_bytes(int(np.prod(idx.shape)), table.shape[0]) if sort else 0
  # A batch of index arrays is one larger index array: the kernel reads indices flat.
  result, _ = jax.ffi.ffi_call(
      "jaxdata_host_gather", (out, jax.ShapeDtypeStruct((scratch,), np.uint8)),
      vmap_method="broadcast_all")(
          idx, table_id=np.int64(table.table_id), mode=np.int32(mode), fill_bits=fill_bits,
          sort=np.int32(sort))
  return result


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _gather(table, mode, fill_bits, sort, idx):
  return _gather_call(table, mode, fill_bits, sort, idx)


def _gather_fwd(table, mode, fill_bits, sort, idx):
  return _gather_call(table, mode, fill_bits, sort, idx), None


def _gather_bwd(table, mode, fill_bits, sort, _, g):
  del table, mode, fill_bits, sort, g
  return (None,)  # integer indices: zero cotangent


_gather.defvjp(_gather_fwd, _gather_bwd)
