"""Sparse optimizers for embedding tables trained in place in host memory (optax-style).

A table too large for the GPU stays a `HostTable`; a step gathers the rows a batch touches
(`host_gather`), computes their gradients on the device, and an optimizer here writes the
update back into host memory with `host_scatter_add`. Only touched rows change, exactly as a
dense optax optimizer whose gradient is zero elsewhere would change them (for SGD and Adagrad
a zero gradient changes nothing; Adam-like rules would, which is why they are not here).

    >>> opt = sparse_adagrad(0.1)
    >>> state = opt.init(table)                          # accumulators: a HostTable like `table`
    >>> token = opt.update(table, state, ids, row_grads)  # inside or outside jit

Data parallelism: under `shard_map` (or `pmap`) every device holds a share of the batch. Give
`update` the mesh axis name (`axis_name="data"`): the devices then combine their indices and
gradients first (an all-gather over the axis) and each writes a disjoint share of the touched
rows, so the step equals the dense optax step on the whole batch, whatever the number of
devices. Without it each device's call is a separate update of the same table (no update is
lost, `host_scatter_add` serializes them): for SGD that is the same step up to rounding, for
Adagrad it is not (each device would read the accumulators before the others' additions).
Separate processes have separate host memory: there `axis_name` is the only way to keep their
tables equal.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxdata.host.gather import as_indices, host_gather
from jaxdata.host.scatter import host_scatter_add, resolve_rows
from jaxdata.host.table import HostTable


class SparseOptimizer(NamedTuple):
  """A pair of pure-looking functions, as in optax; the state holds host tables.

  init(table) -> state: allocates what the rule keeps per row (host tables, closed with
    `close(state)` or left to the garbage collector).
  update(table, state, indices, grads, *, axis_name=None) -> token: applies the rule to rows
    `indices` of `table` given their gradients `grads` (shape indices.shape + (columns,));
    repeated indices have their gradients summed first, as the dense gradient of a gather
    would. Under shard_map, `axis_name` names the data-parallel axis (see the module docstring).
  """
  init: Callable[[HostTable], Any]
  update: Callable[..., jax.Array]


class AdagradState(NamedTuple):
  """Adagrad's per-row accumulators (a pytree: jit sees the table's handle, not the table)."""
  sum_of_squares: HostTable


def _unique_rows(table: HostTable, indices: Any, grads: Any,
                 axis_name: Any = None) -> tuple[jax.Array, jax.Array]:
  """(unique resolved rows padded with `rows`, their summed gradients).

  With `axis_name`, over the whole batch of every device along that axis, and each device
  keeps only its share of the rows (row % devices == its index; the others become `rows`,
  which the scatter drops), so that the devices write disjoint rows.
  """
  rows, cols = table.shape
  indices = as_indices(indices, "sparse optimizer")
  grads = jnp.asarray(grads)
  if grads.shape != indices.shape + (cols,):
    raise ValueError(f"sparse optimizer: grads must have shape {indices.shape + (cols,)} "
                     f"(indices' shape plus the table's {cols} columns), got {grads.shape}")
  idx = resolve_rows(indices, rows)
  grads = grads.reshape(-1, cols).astype(jnp.float32)
  if axis_name is not None:
    idx = jax.lax.all_gather(idx, axis_name, tiled=True)
    grads = jax.lax.all_gather(grads, axis_name, tiled=True)
  n = idx.shape[0]
  uniq, inverse = jnp.unique(idx, size=n, fill_value=rows, return_inverse=True)
  summed = jax.ops.segment_sum(grads, inverse.reshape(-1), num_segments=n)
  if axis_name is not None:
    devices = jax.lax.psum(1, axis_name)
    mine = uniq % devices == jax.lax.axis_index(axis_name)
    uniq = jnp.where(mine, uniq, rows)
  return uniq, summed


def sparse_sgd(learning_rate: float) -> SparseOptimizer:
  """Plain SGD on touched rows: row -= learning_rate * (sum of the row's gradients)."""
  lr = np.float32(learning_rate)

  def init(table: HostTable) -> tuple[()]:
    del table
    return ()

  def update(table: HostTable, state: Any, indices: Any, grads: Any, *,
             axis_name: Any = None) -> jax.Array:
    del state
    rows, summed = _unique_rows(table, indices, grads, axis_name)
    return host_scatter_add(table, rows, (-lr * summed).astype(table.dtype))

  return SparseOptimizer(init, update)


def sparse_adagrad(learning_rate: float, initial_accumulator_value: float = 0.1,
                   eps: float = 1e-7) -> SparseOptimizer:
  """Adagrad on touched rows, with optax.adagrad's arithmetic (and defaults).

  Per row: s += g * g; row -= learning_rate * g / sqrt(s + eps) (0 where s == 0). The
  accumulators `s` are a float32 HostTable of the table's shape, in host memory too.
  """
  lr, eps = np.float32(learning_rate), np.float32(eps)
  init_value = np.float32(initial_accumulator_value)

  def init(table: HostTable) -> AdagradState:
    acc = HostTable.empty(table.shape, np.float32, pinned=table.pinned)
    acc.as_numpy()[...] = init_value
    return AdagradState(acc)

  def update(table: HostTable, state: AdagradState, indices: Any, grads: Any, *,
             axis_name: Any = None) -> jax.Array:
    rows, g = _unique_rows(table, indices, grads, axis_name)
    acc = host_gather(state.sum_of_squares, rows, mode="fill", fill_value=0)
    squares = g * g
    # The accumulator rows must be read before they are written: make the write depend on them.
    squares, acc = jax.lax.optimization_barrier((squares, acc))
    total = acc + squares  # what the scatter below leaves in the table, bit for bit
    step = jnp.where(total > 0, jax.lax.rsqrt(total + eps), 0.0) * g
    t1 = host_scatter_add(state.sum_of_squares, rows, squares)
    t2 = host_scatter_add(table, rows, (-lr * step).astype(table.dtype))
    return t1 + t2

  return SparseOptimizer(init, update)


def close(state: Any) -> None:
  """Closes the host tables an optimizer state holds."""
  for leaf in jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, HostTable)):
    if isinstance(leaf, HostTable):
      leaf.close()
