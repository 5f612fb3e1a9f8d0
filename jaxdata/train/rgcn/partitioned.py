"""Full-graph RGCN over several devices and processes: destination partitions.

`jaxdata train rgcn --devices K` (K devices per process; with `jaxdata launch -n P` the mesh
spans all P x K devices) splits the graph with `jaxdata.hector.partition`: device d owns the
node range ``[d * rows, (d + 1) * rows)`` and the edges into it. Each step, on every device:

1. the first layer reads every source row (features, padded and all-gathered; or, featureless,
   the per-node parameters, which are replicated) and computes its own rows;
2. ReLU, then the hidden rows are all-gathered (``[K * rows, hidden]``) for the second layer,
   which again computes its own rows;
3. the cross entropy of the training nodes it owns, divided by the global number of training
   nodes (plus the L2 term, counted on device 0 only), so that the psum of the devices'
   gradients is the gradient of the whole graph's loss; every device applies the same Adam
   update to its replicated parameters.

The autodiff transpose of each all-gather is a reduce-scatter, so gradients reach the rows'
owners. The losses equal a single device's to float tolerance. With one device in one process
the trainer keeps the single-device path (`jaxdata.train.rgcn.train`), so nothing is added there.

    from jaxdata.train.rgcn import TrainConfig, train
    result = train(dataset, TrainConfig(devices=2))      # two local devices
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdata import command, distributed
from jaxdata.data import EntityDataset
from jaxdata.hector.partition import partition
from jaxdata.tasks.rgcn import build_model, l2_penalty, split_validation
from jaxdata.train.common import MESH_AXIS as AXIS
from jaxdata.train.common import (
  TrainResult,
  add_record,
  device_mesh,
  first_row,
  gather_rows,
  node_rows,
)
from jaxdata.train.common import (
  sharded_jit as shard,
)


def train(
  dataset: EntityDataset, config, *, on_epoch: Callable[[dict], None] | None = None
) -> TrainResult:
  """`jaxdata.train.rgcn.train` over the mesh of `config.devices` devices per process."""
  mesh = device_mesh(config.devices)
  k = mesh.devices.size
  parts = partition(dataset.graph, k)
  rows = parts.rows
  model = build_model(dataset, config, nnx.Rngs(config.seed))
  optimizer = nnx.Optimizer(model, optax.adam(config.learning_rate), wrt=nnx.Param)
  graphdef, state = nnx.split((model, optimizer))
  fit, val = split_validation(len(dataset.train_idx), config.val_fraction, config.seed)
  train_idx, train_y = dataset.train_idx, dataset.train_y
  by_rows = NamedSharding(mesh, P(AXIS))
  replicated = NamedSharding(mesh, P())
  n = parts.padded_nodes
  host = {
    "graph": parts.arrays,
    "labels": node_rows(n, train_idx, train_y),
    "fit": node_rows(n, train_idx[fit]),
    "val": node_rows(n, train_idx[val]),
    "test_labels": node_rows(n, dataset.test_idx, dataset.test_y),
    "test": node_rows(n, dataset.test_idx),
  }
  if dataset.features is not None:
    host["x"] = parts.pad_rows(np.asarray(dataset.features, np.float32))
  consts = distributed.put(host, by_rows)
  state = distributed.put(state, replicated)
  num_fit, num_val = max(len(fit), 1), max(len(val), 1)

  def logits_of(model, consts):
    x = consts.get("x")
    return model.on_partition(
      parts.local(consts["graph"]),
      first_row(rows),
      rows,
      gather_rows,
      None if x is None else gather_rows(x),
    )

  def correct(logits, labels, mask):
    return jnp.sum((jnp.argmax(logits, -1) == labels) & mask)

  def device_step(state, consts):
    model, optimizer = nnx.merge(graphdef, state)
    labels, fit_mask = consts["labels"], consts["fit"]

    def loss_fn(model):
      logits = logits_of(model, consts)
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
      loss = jnp.sum(jnp.where(fit_mask, ce, 0.0)) / num_fit
      first = jax.lax.axis_index(AXIS) == 0  # the L2 term once, not once per device
      return loss + jnp.where(first, config.l2 * l2_penalty(model), 0.0), logits

    (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    # shard_map runs with check_vma=False (hector's kernels carry no varying-axis types), so
    # each device's gradient is its own part's: the psum is the whole graph's gradient.
    loss, grads = jax.lax.psum((loss, grads), AXIS)
    optimizer.update(model, grads)
    hits = jax.lax.psum(
      jnp.stack([correct(logits, labels, fit_mask), correct(logits, labels, consts["val"])]), AXIS
    )
    return nnx.state((model, optimizer)), loss, hits

  def device_test(state, consts):
    model, _ = nnx.merge(graphdef, state)
    logits = logits_of(model, consts)
    return jax.lax.psum(correct(logits, consts["test_labels"], consts["test"]), AXIS)

  step = shard(device_step, mesh, (P(), P(AXIS)), (P(), P(), P()))
  test = shard(device_test, mesh, (P(), P(AXIS)), P())
  history = []
  start = time.perf_counter()
  for epoch in range(1, config.epochs + 1):
    t0 = time.perf_counter()
    state, loss, hits = step(state, consts)
    loss, hits = distributed.local_value((loss, hits))
    record = dict(
      epoch=epoch,
      loss=float(loss),
      train_accuracy=float(hits[0]) / num_fit,
      seconds=time.perf_counter() - t0,
    )
    if len(val):
      record["val_accuracy"] = float(hits[1]) / num_val
    add_record(history, record, on_epoch)
    if command.stop_requested():  # SIGTERM: the last completed step ends the run
      break
  test_correct = int(distributed.local_value(test(state, consts)))
  # Replicated over the mesh: each process reads its own copy (no collective).
  model, optimizer = nnx.merge(graphdef, distributed.local_value(state))
  return TrainResult(
    model,
    history,
    {"test_accuracy": test_correct / max(len(dataset.test_idx), 1)},
    time.perf_counter() - start,
    optimizer,
  )
