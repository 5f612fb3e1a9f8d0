"""Full-graph RGAT / HGT / RGCN over several devices and processes: destination partitions.

`jaxdata train rgat|hgt --devices K` (and `rgcn --scale S --devices K`) splits the heterograph by
destination nodes (`jaxdata.hector.partition`, as `jaxdata.train.rgcn.partitioned` does): device d
owns the node range ``[d * rows, (d + 1) * rows)`` (node types may cross it) and the edges into it,
and holds its rows of every type's features. Per step, on each device:

* RGAT (RGCN alike): its rows' per-type linear maps, all-gathered (``[K * rows, hidden]``); each
  RGAT layer computes its own rows (`RGAT.on_partition`, `RGCN.on_partition`), whose outputs are
  all-gathered for the next;
* HGT: each layer projects its own rows' keys, queries and values and all-gathers them
  (``3 * hidden`` wide, `HGT.on_partition`);
* the classifier on its own rows; the cross entropy of its own training papers over the global
  count; one psum of the gradients, the same Adam update everywhere.

Validation and test accuracy are counted after each update, as the single-device trainer does.
With one device in one process the single-device path runs (`jaxdata.train.attention.train`).
Learnable embeddings (`TrainConfig.embed`) are single-device only.
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
from jaxdata.data.mag import MagDataset
from jaxdata.hector.partition import partition
from jaxdata.tasks.hetero import build_model
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
  dataset: MagDataset, config, *, on_epoch: Callable[[dict], None] | None = None
) -> TrainResult:
  """`jaxdata.train.attention.train` over the mesh of `config.devices` devices per process."""
  if config.embed:
    raise ValueError(
      "attention: learnable embeddings (embed) train on one device only; use devices=1"
    )
  mesh = device_mesh(config.devices)
  graph = dataset.graph
  parts = partition(graph, mesh.devices.size)
  n, rows = parts.padded_nodes, parts.rows
  model = build_model(dataset, config, nnx.Rngs(config.seed))
  optimizer = nnx.Optimizer(model, optax.adam(config.learning_rate), wrt=nnx.Param)
  graphdef, state = nnx.split((model, optimizer))
  offsets = np.asarray(graph.node_type_offsets)
  types = np.full(n, -1, np.int32)
  features = []  # type t's features on its rows of the padded node space, zeros elsewhere
  for t, x in enumerate(dataset.features):
    types[offsets[t] : offsets[t + 1]] = t
    rows_t = np.zeros((n, x.shape[1]), np.float32)
    rows_t[offsets[t] : offsets[t + 1]] = x
    features.append(rows_t)
  paper0 = dataset.node_range(dataset.target)[0]
  labels = np.zeros(n, np.int32)
  labels[paper0 : paper0 + len(dataset.labels)] = dataset.labels
  split = {
    s: paper0 + np.asarray(getattr(dataset, f"{s}_papers")) for s in ("train", "val", "test")
  }
  host = {
    "graph": parts.arrays,
    "xs": features,
    "types": types,
    "labels": labels,
    **{s: node_rows(n, ids) for s, ids in split.items()},
  }
  consts = distributed.put(host, NamedSharding(mesh, P(AXIS)))
  state = distributed.put(state, NamedSharding(mesh, P()))
  num_train = max(len(split["train"]), 1)

  def logits_of(model, consts):
    return model.on_partition(
      parts.local(consts["graph"]),
      consts["xs"],
      consts["types"],
      first_row(rows),
      rows,
      gather_rows,
    )

  def hits(logits, consts, mask):
    return jnp.sum((jnp.argmax(logits, -1) == consts["labels"]) & consts[mask])

  def device_step(state, consts):
    model, optimizer = nnx.merge(graphdef, state)

    def loss_fn(model):
      logits = logits_of(model, consts)
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, consts["labels"])
      return jnp.sum(jnp.where(consts["train"], ce, 0.0)) / num_train, logits

    (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    loss, grads = jax.lax.psum((loss, grads), AXIS)  # each device's part: psum (check_vma off)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss, jax.lax.psum(hits(logits, consts, "train"), AXIS)

  def device_eval(state, consts):
    model, _ = nnx.merge(graphdef, state)
    logits = logits_of(model, consts)
    return jax.lax.psum(
      jnp.stack([hits(logits, consts, "val"), hits(logits, consts, "test")]), AXIS
    )

  step = shard(device_step, mesh, (P(), P(AXIS)), (P(), P(), P()))
  evaluate = shard(device_eval, mesh, (P(), P(AXIS)), P())

  def accuracies(state) -> dict:
    val, test = distributed.local_value(evaluate(state, consts))
    return {
      f"{s}_accuracy": float(c) / len(split[s]) if len(split[s]) else float("nan")
      for s, c in (("val", val), ("test", test))
    }

  history = []
  start = time.perf_counter()
  for epoch in range(1, config.epochs + 1):
    t0 = time.perf_counter()
    state, loss, correct = step(state, consts)
    loss, correct = distributed.local_value((loss, correct))
    record = dict(
      epoch=epoch,
      loss=float(loss),
      train_accuracy=float(correct) / num_train,
      seconds=time.perf_counter() - t0,
    )
    record["val_accuracy"] = accuracies(state)["val_accuracy"]
    add_record(history, record, on_epoch)
    if command.stop_requested():  # SIGTERM: the last completed step ends the run
      break
  final = accuracies(state)
  model, optimizer = nnx.merge(graphdef, distributed.local_value(state))
  return TrainResult(model, history, final, time.perf_counter() - start, optimizer)
