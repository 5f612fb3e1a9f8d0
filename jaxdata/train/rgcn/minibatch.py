"""Mini-batch RGCN entity classification from host memory: `jaxdata train rgcn --minibatch`.

The graph (in-edges by destination, with relations) sits in pinned host memory as a `HostGraph`;
inside the jitted step the GPU samples the seeds' neighbourhood hop by hop
(`loader.sample_blocks`), builds each hop's block on the device, reads its inputs from host memory
and runs the two RGCN layers on the blocks.

The inputs are the nodes' features where the dataset has them (a `HostTable`, gathered with
`host_gather`). The RDF graphs are featureless: there the first layer's input is a node's
one-hot id, so every parameter of that layer with a row per node (each basis V_b, or each
relation's W_r, and a separate self-loop W_0) is in effect a learnable embedding of the node.
Those rows live side by side in one host table (`RGCN.node_rows`, ``[nodes, row_width]``); a
step gathers the rows of its sampled nodes, and a sparse optimizer (`host.sparse_adam`, lazy
Adam, by default) writes their update back with `host_scatter_add`. Only the touched rows
change, as in PyTorch's SparseAdam. The layer computes on those rows exactly what the full-graph
layer computes (`RGCN.on_rows`), so with fanouts that cover every in-edge a step gives the
full-graph step's loss and gradients at its seeds, and at the end the rows go back into the
model: the checkpoint is a full-graph one (`jaxdata eval` evaluates it on the whole graph).

The paper's L2 term covers the first layer's parameters; here it covers its dense parameters
and the rows a step reads (each sampled node once), the lazy counterpart of the full penalty.

Data parallel (`TrainConfig.devices` other than 1, or several processes): as the relational
trainer of RGAT and HGT, `batch_size` seeds per device (`sharded_steps`); one device of one
process runs the unsharded step.

    from jaxdata.data import load_entities
    from jaxdata.train.rgcn import TrainConfig
    from jaxdata.train.rgcn.minibatch import MinibatchConfig, train
    result = train(load_entities("aifb.tgz"), TrainConfig(epochs=50),
                   MinibatchConfig(fanouts=(20, 20), batch_size=64))
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxdata import command
from jaxdata.data import EntityDataset
from jaxdata.host import sparse
from jaxdata.loader import Batch, Loader
from jaxdata.nn import EntityClassifier
from jaxdata.tasks.rgcn import TrainConfig, build_model, evaluate, split_validation
from jaxdata.train import common
from jaxdata.train.common import TrainResult


@dataclasses.dataclass(frozen=True)
class MinibatchConfig(common.MinibatchConfig):
  """`common.MinibatchConfig` for RGCN: `batch_size` seed nodes per step; "device": graph and
  features in device memory (the node rows of featureless data stay in host memory either
  way); `table_optimizer` trains those rows; two `fanouts`, one per layer of the model."""

  def __post_init__(self):
    super().__post_init__()
    if len(self.fanouts) != 2:
      raise ValueError(
        f"MinibatchConfig: fanouts must be two positive ints (one per layer of "
        f"the two-layer RGCN), got {self.fanouts}"
      )


def _is_row_param(path, value) -> bool:
  """The first layer's parameters with a row per node (featureless input): they train in a
  host table, not through the dense optimizer. Only for a featureless model (`dense_filter`)."""
  del value
  return len(path) >= 2 and path[0] == "conv1" and path[1] in ("weight", "bases", "root")


def dense_filter(model: EntityClassifier):
  """The parameters the dense optimizer trains: all of them with input features; without, all
  but the first layer's node rows."""
  return nnx.All(nnx.Param, nnx.Not(_is_row_param)) if model.conv1.featureless else nnx.Param


def make_loader(dataset: EntityDataset, model: EntityClassifier, pipeline: str, fanouts) -> Loader:
  """The dataset as a `jaxdata.loader.Loader` of one node type: its features, or (featureless)
  the model's node rows as a learnable embedding (`RGCN.node_rows`); the training labels."""
  labels = np.full(dataset.graph.num_nodes, -1, np.int32)
  labels[dataset.train_idx] = dataset.train_y
  rows = None
  if model.conv1.featureless:
    rows = {dataset.graph.node_type_names[0]: np.asarray(model.conv1.node_rows(), np.float32)}
  return Loader(
    dataset.graph,
    fanouts=fanouts,
    features=dataset.features,
    embeddings=rows,
    labels=labels,
    pipeline=pipeline,
  )


def forward(loader: Loader, seeds, key) -> tuple[Batch, jax.Array, jax.Array]:
  """(the batch, the slots' inputs: features or node rows, their node-row ids): what a step's
  loss reads; a slot without a row has the id `num_nodes` (out of range: dropped by a
  scatter), and so has every slot of a model with features."""
  batch = loader.sample(seeds, key)
  ids = loader.embedding_ids(batch)
  return batch, batch.inputs[0], ids[0] if ids else jnp.full_like(batch.types, loader.num_nodes)


def summed_loss(model: EntityClassifier, batch: Batch, inputs):
  """(summed cross entropy of the valid seeds, (correct, count)): no L2 term."""
  logits = model.on_blocks(batch.blocks, inputs)[: batch.seeds.shape[0]]
  valid, y = batch.mask, batch.labels
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
  correct = ((jnp.argmax(logits, -1) == y) & valid).sum()
  return jnp.sum(jnp.where(valid, ce, 0)), (correct, valid.sum())


def dense_penalty(model: EntityClassifier) -> jax.Array:
  """The L2 term's dense part: the first layer's squared parameters, but for the node rows of
  a featureless model (the rows a step reads count instead, `batch_loss`)."""
  featureless = model.conv1.featureless
  return sum(
    jnp.sum(p[...].astype(jnp.float32) ** 2)
    for path, p in nnx.iter_graph(model.conv1)
    if isinstance(p, nnx.Param) and not (featureless and _is_row_param(("conv1",) + path, p))
  )


def batch_loss(model: EntityClassifier, batch: Batch, inputs, l2: float):
  """(mean cross entropy of the valid seeds + the L2 term, (correct, count))."""
  total, (correct, count) = summed_loss(model, batch, inputs)
  loss = total / jnp.maximum(count, 1)
  if l2:
    rows = jnp.sum(inputs.astype(jnp.float32) ** 2) if model.conv1.featureless else 0.0
    loss = loss + l2 * (dense_penalty(model) + rows)
  return loss, (correct, count)


def first_reads(ids: jax.Array, axis: str) -> jax.Array:
  """Inside `sharded_jit`: bool[slots], True where this device's slot holds a row that no
  device before it along `axis` holds (each device's `ids` are unique), so that the rows of
  the global batch each count once in the L2 term, as on one device."""
  every = jax.lax.all_gather(ids, axis, tiled=True)
  order = jnp.argsort(every, stable=True)  # device by device within equal ids
  ranked = every[order]
  first = jnp.concatenate([jnp.ones(1, bool), ranked[1:] != ranked[:-1]])
  first = jnp.zeros_like(first).at[order].set(first)
  return jax.lax.dynamic_slice_in_dim(first, jax.lax.axis_index(axis) * ids.shape[0], ids.shape[0])


def sharded_steps(
  loader: Loader,
  model,
  optimizer,
  dense,
  table_opt,
  opt_state,
  l2: float,
  mesh,
  batch_size: int,
) -> common.ShardedSteps:
  """Data-parallel mini-batch training over `mesh` (`common.ShardedSteps`): `batch_size` seeds
  per device, each device sampling its share with its own key. The summed cross entropy's
  gradients are summed over the mesh in one all-reduce (`common.psum_flat`) and divided by the
  global count of valid seeds; the L2 term's gradient is added once: its dense part on every
  device alike, its node rows' part where a row is first read (`first_reads`). The node rows'
  update runs with ``axis_name`` and ``copies=jax.process_count()`` (`host.sparse`): every
  process's copy of the table receives every row."""
  axis = common.MESH_AXIS
  copies = jax.process_count()

  def penalty(model, inputs, first):
    rows = jnp.sum(jnp.where(first[:, None], inputs.astype(jnp.float32) ** 2, 0))
    return l2 * (dense_penalty(model) + rows), l2 * rows

  featureless = bool(loader.embedded)

  def train_on(model, optimizer, loader, seeds, key):
    batch, inputs, ids = forward(loader, seeds, key)
    grad_fn = nnx.value_and_grad(summed_loss, argnums=(nnx.DiffState(0, dense), 2), has_aux=True)
    (total, (correct, count)), (grads, row_grads) = grad_fn(model, batch, inputs)
    dense_l2 = rows_l2 = jnp.float32(0)
    if l2:
      # features: no rows in the term
      first = first_reads(ids, axis) if featureless else jnp.zeros(ids.shape, bool)
      (pen, rows_l2), (pen_grads, pen_rows) = nnx.value_and_grad(
        penalty, argnums=(nnx.DiffState(0, dense), 1), has_aux=True
      )(model, inputs, first)
      dense_l2 = pen - rows_l2  # the same on every device
    total, rows_l2, correct, count, grads = common.psum_flat(
      (total, rows_l2, correct, count, grads), axis
    )
    n = jnp.maximum(count, 1)
    grads, row_grads = jax.tree.map(lambda g: g / n, grads), row_grads / n
    if l2:
      grads, row_grads = jax.tree.map(jnp.add, grads, pen_grads), row_grads + pen_rows
    optimizer.update(model, grads)
    token = loader.update_embeddings(
      table_opt, opt_state, batch, [row_grads][: len(opt_state)], axis_name=axis, copies=copies
    )
    return (total / n + dense_l2 + rows_l2) * count, correct, count, token

  def correct_of(model, loader, seeds, key):
    batch, inputs, _ = forward(loader, seeds, key)
    return summed_loss(model, batch, inputs)[1]

  return common.ShardedSteps(model, optimizer, loader, mesh, batch_size, train_on, correct_of)


def train(
  dataset: EntityDataset,
  config: TrainConfig,
  minibatch: MinibatchConfig = MinibatchConfig(),
  *,
  on_epoch: Callable[[dict], None] | None = None,
  on_batch: Callable[[int, int], None] | None = None,
) -> TrainResult:
  """Trains the 2-layer RGCN on mini-batches of `dataset`'s training nodes; the final test
  accuracy is measured on the whole graph.

  Data parallel when `config.devices` is not 1 or the job has several processes
  (`sharded_steps`): `minibatch.batch_size` seeds per device, every device of every process
  (`config.devices` per process; None: all). One device of one process runs the steps below.
  """
  mesh = None
  if config.devices != 1 or jax.process_count() > 1:
    mesh = common.device_mesh(config.devices, what="train")
  model = build_model(dataset, config, nnx.Rngs(config.seed))
  dense = dense_filter(model)
  optimizer = nnx.Optimizer(model, optax.adam(config.learning_rate), wrt=dense)
  fanouts = tuple(int(f) for f in minibatch.fanouts)
  fit, val = split_validation(len(dataset.train_idx), config.val_fraction, config.seed)
  table_opt = sparse.BY_NAME[minibatch.table_optimizer](config.learning_rate)
  start = time.perf_counter()
  with make_loader(dataset, model, minibatch.pipeline, fanouts) as loader:
    opt_state = loader.init_embeddings(table_opt)  # one state (featureless) or none
    sharded = (
      None
      if mesh is None
      else sharded_steps(
        loader,
        model,
        optimizer,
        dense,
        table_opt,
        opt_state,
        config.l2,
        mesh,
        minibatch.batch_size,
      )
    )

    def step(model, optimizer, opt_state, loader, seeds, key):
      batch, inputs, _ = forward(loader, seeds, key)
      grad_fn = nnx.value_and_grad(batch_loss, argnums=(nnx.DiffState(0, dense), 2), has_aux=True)
      (loss, (correct, count)), (grads, row_grads) = grad_fn(model, batch, inputs, config.l2)
      optimizer.update(model, grads)
      token = loader.update_embeddings(table_opt, opt_state, batch, [row_grads][: len(opt_state)])
      return loss * count, correct, count, token

    device_steps = common.DeviceSteps(model, optimizer, step)

    @nnx.jit
    def predict(model, loader, seeds, key):
      batch, inputs, _ = forward(loader, seeds, key)
      return summed_loss(model, batch, inputs)[1]

    rng = np.random.default_rng(config.seed)
    key, val_key = jax.random.split(jax.random.key(config.seed))
    history = []
    try:
      for epoch in range(1, config.epochs + 1):
        rows = common.seed_batches(
          dataset.train_idx[fit],
          minibatch.batch_size * (1 if mesh is None else mesh.size),
          rng,
          minibatch.max_batches,
        )
        epoch_key = jax.random.fold_in(key, epoch)
        if sharded is not None:
          record = dict(epoch=epoch, **sharded.epoch(rows, epoch_key, on_batch))
        else:
          record = dict(
            epoch=epoch, **device_steps.epoch((opt_state, loader), rows, epoch_key, on_batch)
          )
        if len(val):
          val_ids, val_key_e = dataset.train_idx[val], jax.random.fold_in(val_key, epoch)
          record["val_accuracy"] = (
            sharded.accuracy(val_ids, val_key_e)
            if sharded is not None
            else common.sampled_accuracy(
              lambda s, k: predict(model, loader, s, k),
              val_ids,
              minibatch.batch_size,
              val_key_e,
            )
          )
        common.add_record(history, record, on_epoch)
        if command.stop_requested():  # SIGTERM: the last completed step ends the run
          break
      if sharded is not None:
        sharded.finish()
      for t in loader.embedded:  # several processes: every copy received every row update
        common.check_copies_agree(loader.tables[t].as_numpy(), "node rows")
    finally:
      for t in loader.embedded:  # the trained rows back into the model: a full-graph checkpoint
        model.conv1.set_node_rows(jax.device_put(loader.tables[t].as_numpy()))
      for state in opt_state:
        sparse.close(state)
  test_accuracy = evaluate(model, dataset)["test_accuracy"]
  # Featureless: no optimizer state in the result (the node rows' moments lived in a host table).
  return TrainResult(
    model,
    history,
    {"test_accuracy": test_accuracy},
    time.perf_counter() - start,
    None if model.conv1.featureless else optimizer,
  )
