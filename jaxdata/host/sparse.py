"""Sparse optimizers for embedding tables trained in place in host memory (optax-style).

A table too large for the GPU stays a `HostTable`; a step gathers the rows a batch touches
(`host_gather`), computes their gradients on the device, and an optimizer here writes the
update back into host memory with `host_scatter_add`. Only touched rows change. For SGD and
Adagrad that is exactly what a dense optax optimizer whose gradient is zero elsewhere does (a
zero gradient changes nothing there), so `sparse_sgd` and `sparse_adagrad` equal optax.sgd and
optax.adagrad on the whole table.

Adam is different: in dense optax.adam a zero gradient still decays a row's moments and, with
a nonzero first moment, still moves the row. `sparse_adam` is *lazy* Adam (the rule of
torch.optim.SparseAdam and TensorFlow's LazyAdam): rows the step does not touch keep their
moments and their values, bit for bit; touched rows get optax.adam's arithmetic, with the bias
correction of a global step count that advances once per `update` call (not per row). It
therefore equals optax.adam exactly when every row is touched at every step (then it does equal
it, up to rounding), and differs from it otherwise: that is the point, a step costs the rows it
touches, not the table.

    >>> opt = sparse_adagrad(0.1)
    >>> state = opt.init(table)                          # accumulators: a HostTable like `table`
    >>> token = opt.update(table, state, ids, row_grads)  # inside or outside jit

Data parallelism: under `shard_map` (or `pmap`) every device holds a share of the batch. Give
`update` the mesh axis name (`axis_name="data"`): the devices then combine their indices and
gradients first (an all-gather over the axis) and each writes a disjoint share of the touched
rows, so the step equals the dense optax step on the whole batch (for Adam: the lazy step on
the whole batch, with the step count advanced once), whatever the number of devices. Without it
each device's call is a separate update of the same table (no update is lost,
`host_scatter_add` serializes them): for SGD that is the same step up to rounding, for Adagrad
and Adam it is not (each device would read the per-row state before the others' additions, and
Adam's count would advance once per device).

Several processes (`jax.distributed`): each process has its own copy of the table (and of the
optimizer's state) in its own host memory, and the axis spans every process's devices. The
all-gather then brings every process the whole global batch's (row, gradient) pairs, and the
touched rows are shared out among each process's own devices only: every copy receives every
row, from exactly one writer per copy, and Adam's count advances once in every copy. So the
copies stay equal, bit for bit, to one another and to a one-process run over the same global
batch. `copies` (default `jax.process_count()`) is how many copies the axis spans; the axis must
list each copy's devices together, the same number per copy (a mesh built process by process,
as jaxdata's trainers build theirs). Cost per step and device: the all-gather receives the whole
batch's indices and float32 gradients, `batch x (4 + 4 x columns)` bytes (docs/distributed.md).
"""

from collections.abc import Callable
from typing import Any, NamedTuple

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
  update(table, state, indices, grads, *, axis_name=None, copies=None) -> token: applies the
    rule to rows `indices` of `table` given their gradients `grads` (shape indices.shape +
    (columns,)); repeated indices have their gradients summed first, as the dense gradient of a
    gather would. Under shard_map, `axis_name` names the data-parallel axis and `copies` the
    number of separate table copies (processes) along it (see the module docstring).
  """

  init: Callable[[HostTable], Any]
  update: Callable[..., jax.Array]


class AdagradState(NamedTuple):
  """Adagrad's per-row accumulators (a pytree: jit sees the table's handle, not the table)."""

  sum_of_squares: HostTable


def _copies(axis_name: Any, copies: int | None, what: str) -> int:
  """How many separate table copies (processes) the axis spans; checks the argument."""
  if copies is None:
    return 1 if axis_name is None else jax.process_count()
  if isinstance(copies, bool) or not isinstance(copies, (int, np.integer)) or copies < 1:
    raise ValueError(f"{what}: copies must be a positive int, got {copies!r}")
  if axis_name is None and copies != 1:
    raise ValueError(f"{what}: copies={copies} needs axis_name (the axis the copies lie along)")
  return int(copies)


def _writer(axis_name: Any, copies: int, what: str) -> tuple[jax.Array, int]:
  """(this device's index among its copy's devices, the number of devices per copy)."""
  devices = jax.lax.psum(1, axis_name)
  if devices % copies:
    raise ValueError(
      f"{what}: the axis {axis_name!r} has {devices} devices, not a multiple of "
      f"copies={copies} (one table copy per process: give copies= the number of "
      f"processes the axis spans)"
    )
  per_copy = devices // copies
  return jax.lax.axis_index(axis_name) % per_copy, per_copy


def _unique_rows(
  table: HostTable,
  indices: Any,
  grads: Any,
  axis_name: Any = None,
  what: str = "sparse optimizer",
  copies: int = 1,
) -> tuple[jax.Array, jax.Array]:
  """(unique resolved rows padded with `rows`, their summed gradients).

  With `axis_name`, over the whole batch of every device along that axis, and each device
  keeps only its share of the rows (row % per_copy == its index within its copy; the others
  become `rows`, which the scatter drops), so that each copy's devices write disjoint rows and
  together every row.
  """
  rows, cols = table.shape
  indices = as_indices(indices, what)
  grads = jnp.asarray(grads)
  if grads.shape != indices.shape + (cols,):
    raise ValueError(
      f"{what}: grads must have shape {indices.shape + (cols,)} "
      f"(indices' shape plus the table's {cols} columns), got {grads.shape}"
    )
  idx = resolve_rows(indices, rows)
  grads = grads.reshape(-1, cols).astype(jnp.float32)
  if axis_name is not None:
    idx = jax.lax.all_gather(idx, axis_name, tiled=True)
    grads = jax.lax.all_gather(grads, axis_name, tiled=True)
  n = idx.shape[0]
  uniq, inverse = jnp.unique(idx, size=n, fill_value=rows, return_inverse=True)
  summed = jax.ops.segment_sum(grads, inverse.reshape(-1), num_segments=n)
  if axis_name is not None:
    local, per_copy = _writer(axis_name, copies, what)
    uniq = jnp.where(uniq % per_copy == local, uniq, rows)
  return uniq, summed


def sparse_sgd(learning_rate: float) -> SparseOptimizer:
  """Plain SGD on touched rows: row -= learning_rate * (sum of the row's gradients)."""
  lr = np.float32(learning_rate)

  def init(table: HostTable) -> tuple[()]:
    del table
    return ()

  def update(
    table: HostTable,
    state: Any,
    indices: Any,
    grads: Any,
    *,
    axis_name: Any = None,
    copies: int | None = None,
  ) -> jax.Array:
    del state
    copies = _copies(axis_name, copies, "sparse_sgd")
    rows, summed = _unique_rows(table, indices, grads, axis_name, "sparse_sgd", copies)
    return host_scatter_add(table, rows, (-lr * summed).astype(table.dtype))

  return SparseOptimizer(init, update)


def sparse_adagrad(
  learning_rate: float, initial_accumulator_value: float = 0.1, eps: float = 1e-7
) -> SparseOptimizer:
  """Adagrad on touched rows, with optax.adagrad's arithmetic (and defaults).

  Per row: s += g * g; row -= learning_rate * g / sqrt(s + eps) (0 where s == 0). The
  accumulators `s` are a float32 HostTable of the table's shape, in host memory too.
  """
  lr, eps32 = np.float32(learning_rate), np.float32(eps)
  init_value = np.float32(initial_accumulator_value)

  def init(table: HostTable) -> AdagradState:
    acc = HostTable.empty(table.shape, np.float32, pinned=table.pinned)
    acc.as_numpy()[...] = init_value
    return AdagradState(acc)

  def update(
    table: HostTable,
    state: AdagradState,
    indices: Any,
    grads: Any,
    *,
    axis_name: Any = None,
    copies: int | None = None,
  ) -> jax.Array:
    copies = _copies(axis_name, copies, "sparse_adagrad")
    rows, g = _unique_rows(table, indices, grads, axis_name, "sparse_adagrad", copies)
    acc = host_gather(state.sum_of_squares, rows, mode="fill", fill_value=0)
    squares = g * g
    # The accumulator rows must be read before they are written: make the write depend on them.
    squares, acc = jax.lax.optimization_barrier((squares, acc))
    total = acc + squares  # what the scatter below leaves in the table, bit for bit
    step = jnp.where(total > 0, jax.lax.rsqrt(total + eps32), 0.0) * g
    t1 = host_scatter_add(state.sum_of_squares, rows, squares)
    t2 = host_scatter_add(table, rows, (-lr * step).astype(table.dtype))
    return t1 + t2

  return SparseOptimizer(init, update)


class AdamState(NamedTuple):
  """Lazy Adam's state, all in host memory (a pytree: jit sees the tables' handles).

  mu, nu: float32 tables of the parameter table's shape (first and second moments per row).
  count: an int32 table of shape (1, 1), the number of `update` calls so far.
  """

  mu: HostTable
  nu: HostTable
  count: HostTable


def sparse_adam(
  learning_rate: float, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8
) -> SparseOptimizer:
  """Lazy Adam on touched rows, with optax.adam's arithmetic (and defaults).

  Per touched row, with g the row's summed gradient and t the step count after this call
  (1, 2, ...): m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g * g;
  row -= learning_rate * (m / (1 - b1**t)) / (sqrt(v / (1 - b2**t)) + eps), eps outside the
  square root as in optax.scale_by_adam (eps_root=0). Untouched rows keep their moments and
  values: this equals optax.adam only when every row is touched at every step (see the module
  docstring). The moments are float32 tables of the table's shape in host memory, whatever the
  table's dtype; the count is an int32 (1, 1) table that `update` advances by one per call
  (under `axis_name`, once per call of all the devices together), saturating as optax's does.

  Example:
    >>> opt = sparse_adam(1e-3)
    >>> state = opt.init(table)                       # AdamState(mu, nu, count): host tables
    >>> token = opt.update(table, state, ids, row_grads)
  """
  # 1 - b**t loses most of float32's digits when b is near 1 (b2 = 0.999 rounds to 0.99900001,
  # so 1 - b2 would be 1.3e-5 off): the bias corrections are -expm1(t * log(b)), with log(b)
  # taken in float64 here, as accurate as optax's 1 - b**t computed in float64 (jax_enable_x64).
  log_b1, log_b2 = np.float32(np.log(float(b1))), np.float32(np.log(float(b2)))
  one_minus_b1, one_minus_b2 = np.float32(1 - float(b1)), np.float32(1 - float(b2))
  lr, b1_32, b2_32, eps32 = (np.float32(x) for x in (learning_rate, b1, b2, eps))
  count_max = np.iinfo(np.int32).max

  def init(table: HostTable) -> AdamState:
    mu = HostTable.empty(table.shape, np.float32, pinned=table.pinned)
    nu = HostTable.empty(table.shape, np.float32, pinned=table.pinned)
    count = HostTable.empty((1, 1), np.int32, pinned=table.pinned)
    for t in (mu, nu, count):
      t.as_numpy()[...] = 0
    return AdamState(mu, nu, count)

  def update(
    table: HostTable,
    state: AdamState,
    indices: Any,
    grads: Any,
    *,
    axis_name: Any = None,
    copies: int | None = None,
  ) -> jax.Array:
    _check_open("sparse_adam", table=table, **{f"state.{k}": v for k, v in state._asdict().items()})
    copies = _copies(axis_name, copies, "sparse_adam")
    rows, g = _unique_rows(table, indices, grads, axis_name, "sparse_adam", copies)
    # One device per copy reads and advances its copy's count (row 0); on the others the index
    # is 1, out of range: the gather gives the fill value 0 and the scatter drops the write.
    # The first copy's value reaches every device through psum (the copies' counts are equal),
    # so no device can read the count after another one has advanced it (devices of one
    # process share the table and run concurrently).
    count_row = jnp.zeros((1,), jnp.int32)
    if axis_name is not None:
      local, _ = _writer(axis_name, copies, "sparse_adam")
      count_row = jnp.where(local == 0, 0, 1).astype(jnp.int32)[None]
    mu = host_gather(state.mu, rows, mode="fill", fill_value=0)
    nu = host_gather(state.nu, rows, mode="fill", fill_value=0)
    count = host_gather(state.count, count_row, mode="fill", fill_value=0)[0, 0]
    if axis_name is not None:
      count = jax.lax.psum(jnp.where(jax.lax.axis_index(axis_name) == 0, count, 0), axis_name)
    # Every read precedes its write: each delta below is computed from what was read (and the
    # barrier keeps the reads together, before any write, as in sparse_adagrad).
    g, mu, nu, count = jax.lax.optimization_barrier((g, mu, nu, count))
    bump = jnp.where(count < count_max, 1, 0).astype(jnp.int32)  # optax's safe_increment
    t = (count + bump).astype(jnp.float32)
    d_mu = (one_minus_b1 * g + b1_32 * mu) - mu
    d_nu = (one_minus_b2 * (g * g) + b2_32 * nu) - nu
    # What the scatters below leave in the moment tables, bit for bit (rows are unique, so each
    # gets exactly one addition); the step uses these, so the stored state is the state.
    mu, nu = mu + d_mu, nu + d_nu
    mu_hat = mu / -jnp.expm1(t * log_b1)
    nu_hat = nu / -jnp.expm1(t * log_b2)
    step = mu_hat / (jnp.sqrt(nu_hat) + eps32)
    t1 = host_scatter_add(state.mu, rows, d_mu)
    t2 = host_scatter_add(state.nu, rows, d_nu)
    t3 = host_scatter_add(state.count, count_row, bump.reshape(1, 1))
    t4 = host_scatter_add(table, rows, (-lr * step).astype(table.dtype))
    return t1 + t2 + t3 + t4

  return SparseOptimizer(init, update)


def _check_open(what: str, **tables: HostTable) -> None:
  for name, t in tables.items():
    if isinstance(t, HostTable) and t.closed:
      raise ValueError(
        f"{what}: {name} is closed ({t!r}); an optimizer state lives as long as "
        "its tables: close it (sparse.close(state)) only after the last update"
      )


def close(state: Any) -> None:
  """Closes the host tables an optimizer state holds."""
  for leaf in jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, HostTable)):
    if isinstance(leaf, HostTable):
      leaf.close()


#: The sparse optimizers by name (for command-line flags): name -> factory(learning_rate).
BY_NAME: dict[str, Callable[[float], SparseOptimizer]] = {
  "adam": sparse_adam,
  "adagrad": sparse_adagrad,
  "sgd": sparse_sgd,
}
