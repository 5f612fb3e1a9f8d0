"""host_scatter_add: jit-compatible, deterministic in-place additions into a HostTable."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdata import _ffi  # registers the FFI targets  # noqa: F401
from jaxdata.host.gather import _canonical_indices, _check_table, as_indices
from jaxdata.host.table import HostTable

#: Element types host_scatter_add adds in (the kernels' arithmetic).
SCATTER_DTYPES = tuple(
  np.dtype(t) for t in ("float32", "float64", "bfloat16", "float16", "int32", "int64")
)


def host_scatter_add(table: HostTable, indices: Any, updates: Any) -> jax.Array:
  """Adds `updates` to rows `indices` of a host table in place: np.add.at(table, indices, updates).

  On a GPU the kernel writes straight into the table's pinned host memory (zero-copy); on the
  CPU, XLA's thread pool does. The order is defined: the updates of one row are added to it one
  after another in the order they appear in `indices`, rounding to the table's dtype after each
  addition, so the result is deterministic and bit-identical on CPU, GPU and NumPy's
  `np.add.at`. Indices follow `x.at[indices].add(updates)`: one in [-rows, 0) counts from the
  end, any other outside [0, rows) is dropped.

  Concurrent calls: calls on one table (or on tables viewing the same memory) from several
  threads, or from several devices of one process (`shard_map`, `pmap`, a CPU and a GPU), run
  one after another, each call as a whole: no addition is ever lost, and each call adds to what
  the previous one left, in an order between calls that is not defined (so float results may
  round differently from run to run; integer results are exact). On a GPU the call therefore
  waits for its stream before it returns. A `host_gather` running at the same time as a scatter
  on the same rows may see some of its additions and not others: order them through the token
  when it matters. Separate processes (`jax.distributed`) each have their own table memory: a
  scatter in one never reaches the table of another; combine updates with collectives first
  (as `sparse_sgd(...).update(..., axis_name=...)` does).

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
    raise TypeError(
      f"host_scatter_add: tables of {table.dtype} are not supported; use one of "
      + ", ".join(d.name for d in SCATTER_DTYPES)
    )
  indices = as_indices(indices, "host_scatter_add")
  if not hasattr(updates, "dtype"):
    updates = np.asarray(updates)
  if not (jnp.issubdtype(updates.dtype, jnp.number) or updates.dtype == np.bool_):
    raise TypeError(f"host_scatter_add: updates must be numbers, got dtype {updates.dtype}")
  updates = jnp.asarray(updates)
  want = indices.shape + (table.shape[1],)
  if updates.shape != want:
    raise ValueError(
      f"host_scatter_add: updates must have shape {want} (indices' shape plus "
      f"the table's {table.shape[1]} columns), got {updates.shape}"
    )
  resolved = resolve_rows(indices, table.shape[0])
  perm = jnp.argsort(resolved, stable=True).astype(jnp.int32)
  return _scatter(
    table.shape[0],
    table.handle,
    resolved[perm],
    perm,
    updates.reshape(-1, table.shape[1]).astype(table.dtype),
  )


def resolve_rows(indices: jax.Array, rows: int) -> jax.Array:
  """Flat table rows of `x.at[indices]`: negative ones counted from the end, `rows` for dropped."""
  row_dtype = jnp.int32 if rows < np.iinfo(np.int32).max else jnp.int64
  idx = _canonical_indices(indices.reshape(-1), rows)  # int32 or int64, same meaning
  idx = jnp.where(idx < 0, idx + rows, idx)
  return jnp.where((idx >= 0) & (idx < rows), idx, rows).astype(row_dtype)


# The table enters as its handle (an operand) and its row count, so the compiled program does not
# depend on which table it writes.
@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _scatter(
  table_rows: int, handle: jax.Array, rows: jax.Array, perm: jax.Array, updates: jax.Array
) -> jax.Array:
  return jax.ffi.ffi_call(
    "jaxdata_host_scatter_add",
    jax.ShapeDtypeStruct((), jnp.int32),
    has_side_effect=True,
    vmap_method="sequential",
  )(handle, rows, perm, updates, rows=np.int64(table_rows))


@_scatter.defjvp
def _scatter_jvp(table_rows, primals, tangents):
  del table_rows, primals, tangents
  raise TypeError(
    "host_scatter_add writes into host memory and is not differentiable: apply it "
    "to computed gradients (jax.lax.stop_gradient them) rather than inside jax.grad"
  )
