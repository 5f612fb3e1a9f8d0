"""Sparse optimizers for embedding tables trained in place in host memory (optax-style).

A table too large for the GPU stays a `HostTable`; a step gathers the rows a batch touches
(`host_gather`), computes their gradients on the device, and an optimizer here writes the
update back into host memory with `host_scatter_add`. Only touched rows change, exactly as a
dense optax optimizer whose gradient is zero elsewhere would change them (for SGD and Adagrad
a zero gradient changes nothing; Adam-like rules would, which is why they are not here).

    >>> opt = sparse_adagrad(0.1)
    >>> state = opt.init(table)                          # accumulators: a HostTable like `table`
    >>> token = opt.update(table, state, ids, row_grads)  # inside or outside jit
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxdata.host.gather import host_gather
from jaxdata.host.scatter import host_scatter_add, resolve_rows
from jaxdata.host.table import HostTable


class SparseOptimizer(NamedTuple):
  """A pair of pure-looking functions, as in optax; the state holds host tables.

  init(table) -> state: allocates what the rule keeps per row (host tables, closed with
    `close(state)` or left to the garbage collector).
  update(table, state, indices, grads) -> token: applies the rule to rows `indices` of `table`
    given their gradients `grads` (shape indices.shape + (columns,)); repeated indices have their
    gradients summed first, as the dense gradient of a gather would.
  """
  init: Callable[[HostTable], Any]
  update: Callable[[HostTable, Any, Any, Any], jax.Array]


class AdagradState(NamedTuple):
  sum_of_squares: HostTable


def _unique_rows(table: HostTable, indices: Any, grads: Any) -> tuple[jax.Array, jax.Array]:
  """(unique resolved rows padded with `rows`, their summed gradients)."""
  rows, cols = table.shape
  dtype = getattr(indices, "dtype", None) or np.asarray(indices).dtype
  if not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(f"sparse optimizer: indices must be integers, got dtype {dtype}")
  indices, grads = jnp.asarray(indices), jnp.asarray(grads)
  if grads.shape != indices.shape + (cols,):
    raise ValueError(f"sparse optimizer: grads must have shape {indices.shape + (cols,)} "
                     f"(indices' shape plus the table's {cols} columns), got {grads.shape}")
  idx = resolve_rows(indices, rows)
  grads = grads.reshape(-1, cols).astype(jnp.float32)
  n = idx.shape[0]
  uniq, inverse = jnp.unique(idx, size=n, fill_value=rows, return_inverse=True)
  summed = jax.ops.segment_sum(grads, inverse.reshape(-1), num_segments=n)
  return uniq, summed


def sparse_sgd(learning_rate: float) -> SparseOptimizer:
  """Plain SGD on touched rows: row -= learning_rate * (sum of the row's gradients)."""
  lr = np.float32(learning_rate)

  def init(table: HostTable) -> tuple[()]:
    del table
    return ()

  def update(table: HostTable, state: Any, indices: Any, grads: Any) -> jax.Array:
    del state
    rows, summed = _unique_rows(table, indices, grads)
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

  def update(table: HostTable, state: AdagradState, indices: Any, grads: Any) -> jax.Array:
    rows, g = _unique_rows(table, indices, grads)
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
