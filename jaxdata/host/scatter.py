"""host_scatter_add: jit-compatible, deterministic in-place additions into a HostTable."""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdata import _ffi  # registers the FFI targets  # noqa: F401
from jaxdata.host.gather import _canonical_indices, _check_table
from jaxdata.host.table import HostTable

#: Element types host_scatter_add adds in (the kernels' arithmetic).
SCATTER_DTYPES = tuple(np.dtype(t) for t in ("float32", "float64", "bfloat16", "float16",
                                              "int32", "int64"))


def host_scatter_add(table: HostTable, indices: Any, updates: Any) -> jax.Array:
  """Adds `updates` into rows `indices` of a host table, in place: `np.add.at(table, indices, updates)`.

  On a GPU the kernel writes straight into the table's pinned host memory (zero-copy); on the
  CPU, XLA's thread pool does. The order is defined: the updates of one row are added to it one
  after another in the order they appear in `indices`, rounding to the table's dtype after each
  addition, so the result is deterministic and bit-identical on CPU, GPU and NumPy's
  `np.add.at`. Indices follow `x.at[indices].add(updates)`: one in [-rows, 0) counts from the
  end, any other outside [0, rows) is dropped.

  The call is a side effect: it returns a token (an int32 scalar 0) and is never removed by
  XLA. Reads of the table later in the same jitted function are not ordered after it unless
  they depend on its inputs; separate calls (the next training step) see the update. It is not
  differentiable: apply it to gradients, not inside them.

  Example:
    >>> with HostTable(np.zeros((4, 2), np.float32)) as t:
    ...   jax.block_until_ready(host_scatter_add(t, jnp.array([1, 1, 3]), jnp.ones((3, 2))))
    ...   t.as_numpy()[:, 0]   # [0, 2, 0, 1]

  Args:
    table: an open `HostTable` of a dtype in `SCATTER_DTYPES`.
    indices: integer array of any shape S.
    updates: array of shape S + (table.shape[1],), cast to the table's dtype.

  Returns:
    The token.
  """
  _check_table(table, "host_scatter_add")
  if table.dtype not in SCATTER_DTYPES:
    raise TypeError(f"host_scatter_add: tables of {table.dtype} are not supported; use one of "
                    + ", ".join(d.name for d in SCATTER_DTYPES))
  idx_dtype = getattr(indices, "dtype", None) or np.asarray(indices).dtype
  if not jnp.issubdtype(idx_dtype, jnp.integer):
    raise TypeError(f"host_scatter_add: indices must be integers, got dtype {idx_dtype}")
  indices, updates = jnp.asarray(indices), jnp.asarray(updates)
  want = indices.shape + (table.shape[1],)
  if updates.shape != want:
    raise ValueError(f"host_scatter_add: updates must have shape {want} (indices' shape plus "
                     f"the table's {table.shape[1]} columns), got {updates.shape}")
  resolved = resolve_rows(indices, table.shape[0])
  perm = jnp.argsort(resolved, stable=True).astype(jnp.int32)
  return _scatter(table, resolved[perm], perm,
                  updates.reshape(-1, table.shape[1]).astype(table.dtype))


def resolve_rows(indices: jax.Array, rows: int) -> jax.Array:
  """Flat table rows of `x.at[indices]`: negative ones counted from the end, `rows` for dropped."""
  row_dtype = jnp.int32 if rows < np.iinfo(np.int32).max else jnp.int64
  idx = _canonical_indices(indices.reshape(-1), rows)  # int32 or int64, same meaning
  idx = jnp.where(idx < 0, idx + rows, idx)
  return jnp.where((idx >= 0) & (idx < rows), idx, rows).astype(row_dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _scatter(table: HostTable, rows: jax.Array, perm: jax.Array, updates: jax.Array) -> jax.Array:
  return jax.ffi.ffi_call("jaxdata_host_scatter_add", jax.ShapeDtypeStruct((), jnp.int32),
                          has_side_effect=True, vmap_method="sequential")(
                              rows, perm, updates, table_id=np.int64(table.table_id))


@_scatter.defjvp
def _scatter_jvp(table, primals, tangents):
  del table, primals, tangents
  raise TypeError("host_scatter_add writes into host memory and is not differentiable: apply it "
                  "to computed gradients (jax.lax.stop_gradient them) rather than inside jax.grad")
