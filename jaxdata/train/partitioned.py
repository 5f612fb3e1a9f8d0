"""Full-graph training over several devices and processes: destination partitions.

`jaxdata train rgcn|rgat|hgt --devices K` (K devices per process; with `jaxdata launch -n P` the
mesh spans all P x K devices) splits the graph with `jaxdata.hector.partition`: device d owns the
node range ``[d * rows, (d + 1) * rows)`` (node types may cross it), the edges into it and its
rows of the inputs. Each step, on every device, the model's `on_partition` computes its own rows
layer by layer, all-gathering what the next layer reads (RGCN and RGAT: each layer's output,
``[K * rows, hidden]``; HGT: its own rows' keys, queries and values, ``3 * hidden`` wide); the
autodiff transpose of each all-gather is a reduce-scatter, so gradients reach the rows' owners.
The loss is the cross entropy of the training nodes the device owns over the global count (plus
a penalty, counted on device 0 only), so the psum of the devices' gradients is the whole graph's,
and every device applies the same Adam update to its replicated parameters. Losses and
accuracies equal a single device's to float tolerance; with one device in one process the
trainers keep their single-device paths.

    from jaxdata.tasks.rgcn import TrainConfig
    from jaxdata.train.attention import train
    result = train(dataset, TrainConfig(devices=2))      # two local devices
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdata import distributed
from jaxdata.data import EntityDataset
from jaxdata.data.mag import MagDataset
from jaxdata.hector.partition import Partitions, partition
from jaxdata.tasks import hetero, rgcn
from jaxdata.train.common import MESH_AXIS as AXIS
from jaxdata.train.common import TrainResult, device_mesh, fit_epochs
from jaxdata.train.common import sharded_jit as shard


def node_rows(padded_nodes: int, nodes, values=None) -> np.ndarray:
  """A per-node array over ``padded_nodes`` rows: `values` (int32) at `nodes`, zero elsewhere;
  without `values`, a mask (True at `nodes`)."""
  out = np.zeros(padded_nodes, bool if values is None else np.int32)
  out[np.asarray(nodes)] = True if values is None else values
  return out


def gather_rows(h: jax.Array) -> jax.Array:
  """Inside `sharded_jit`: every device's ``[rows, ...]`` laid end to end, ``[K * rows, ...]``."""
  return jax.lax.all_gather(h, AXIS, tiled=True)


def first_row(rows: int) -> jax.Array:
  """Inside `sharded_jit`: the first node id this device's part owns."""
  return jax.lax.axis_index(AXIS) * rows


def fit(
  mesh,
  parts: Partitions,
  model: nnx.Module,
  learning_rate: float,
  host: dict,
  logits_of: Callable,
  sets: dict[str, np.ndarray],
  *,
  epochs: int,
  in_step: Sequence[str] = ("train",),
  every_epoch: Sequence[str] = (),
  penalty: Callable | None = None,
  on_epoch: Callable[[dict], None] | None = None,
) -> TrainResult:
  """Trains `model` with Adam over the destination parts `parts` on `mesh`.

  Args:
    host: NumPy arrays over the padded node space (sharded by rows): ``labels`` and the model's
      inputs; the graph's parts and a mask per set are added here.
    logits_of: ``(model, graph, consts) -> [rows, classes]``, this device's rows, inside the
      sharded step (`graph`: its part's `GraphArrays`; `consts`: its rows of `host`).
    sets: node ids per set; "train" is the loss's, "test" is measured at the end.
    in_step: sets whose accuracy comes from the step's own logits (before the update), "train"
      first; a set with no nodes other than "train" is left out of the history.
    every_epoch: sets measured by a forward pass after each update, recorded every epoch.
    penalty: ``model -> scalar`` added to the loss once (on device 0).

  Returns:
    The trained model, the history of every epoch and each measured set's final accuracy
    (NaN for a set with no nodes).
  """
  n = parts.padded_nodes
  optimizer = nnx.Optimizer(model, optax.adam(learning_rate), wrt=nnx.Param)
  graphdef, state = nnx.split((model, optimizer))
  host = {**host, "graph": parts.arrays, **{s: node_rows(n, ids) for s, ids in sets.items()}}
  consts = distributed.put(host, NamedSharding(mesh, P(AXIS)))
  state = distributed.put(state, NamedSharding(mesh, P()))
  count = {s: len(ids) for s, ids in sets.items()}
  evaluated = tuple(dict.fromkeys((*every_epoch, "test")))

  def logits(model, consts):
    return logits_of(model, parts.local(consts["graph"]), consts)

  def hits(out, consts, names):
    right = jnp.argmax(out, -1) == consts["labels"]
    return jax.lax.psum(jnp.stack([jnp.sum(right & consts[s]) for s in names]), AXIS)

  def device_step(state, consts):
    model, optimizer = nnx.merge(graphdef, state)

    def loss_fn(model):
      out = logits(model, consts)
      ce = optax.softmax_cross_entropy_with_integer_labels(out, consts["labels"])
      loss = jnp.sum(jnp.where(consts["train"], ce, 0.0)) / max(count["train"], 1)
      if penalty is not None:
        loss += jnp.where(jax.lax.axis_index(AXIS) == 0, penalty(model), 0.0)
      return loss, out

    (loss, out), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    # shard_map runs with check_vma=False (hector's kernels carry no varying-axis types), so
    # each device's gradient is its own part's: the psum is the whole graph's gradient.
    loss, grads = jax.lax.psum((loss, grads), AXIS)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss, hits(out, consts, in_step)

  def device_eval(state, consts):
    model, _ = nnx.merge(graphdef, state)
    return hits(logits(model, consts), consts, evaluated)

  step = shard(device_step, mesh, (P(), P(AXIS)), (P(), P(), P()))
  evaluate = shard(device_eval, mesh, (P(), P(AXIS)), P())

  def accuracy(names, correct) -> dict:
    """{set: accuracy}, NaN for a set with no nodes."""
    return {s: float(c) / count[s] if count[s] else float("nan") for s, c in zip(names, correct)}

  def run_epoch(epoch: int) -> dict:
    del epoch
    nonlocal state
    t0 = time.perf_counter()
    state, loss, correct = step(state, consts)
    loss, correct = distributed.local_value((loss, correct))
    seconds = time.perf_counter() - t0  # the step's: evaluation is not training time
    measured = accuracy(in_step, correct)
    record = dict(loss=float(loss), train_accuracy=measured.pop("train"), seconds=seconds)
    record.update((f"{s}_accuracy", a) for s, a in measured.items() if count[s])
    if every_epoch:
      after = accuracy(evaluated, distributed.local_value(evaluate(state, consts)))
      record.update((f"{s}_accuracy", after[s]) for s in every_epoch)
    return record

  def measure() -> dict:
    final = accuracy(evaluated, distributed.local_value(evaluate(state, consts)))
    return {f"{s}_accuracy": a for s, a in final.items()}

  def result(history, metrics, seconds) -> TrainResult:
    # Replicated over the mesh: each process reads its own copy (no collective).
    model, optimizer = nnx.merge(graphdef, distributed.local_value(state))
    return TrainResult(model, history, metrics, seconds, optimizer)

  return fit_epochs(epochs, run_epoch, result, measure, on_epoch=on_epoch)


def train_rgcn(
  dataset: EntityDataset, config, *, on_epoch: Callable[[dict], None] | None = None
) -> TrainResult:
  """`jaxdata.train.attention.train` of an entity task over the mesh of `config.devices`
  devices per process: the first layer reads every source row (features, padded and
  all-gathered; or, featureless, the per-node parameters, which are replicated); validation
  accuracy comes from each step's logits, test accuracy from the trained model."""
  mesh = device_mesh(config.devices)
  parts = partition(dataset.graph, mesh.devices.size)
  fit_ids, val_ids = rgcn.split_validation(len(dataset.train_idx), config.val_fraction, config.seed)
  n = parts.padded_nodes
  labels = node_rows(n, dataset.train_idx, dataset.train_y)
  labels[np.asarray(dataset.test_idx)] = dataset.test_y  # train and test nodes are disjoint
  host = {"labels": labels}
  if dataset.features is not None:
    host["x"] = parts.pad_rows(np.asarray(dataset.features, np.float32))

  def logits_of(model, graph, consts):
    x = consts.get("x")
    rows = parts.rows
    return model.on_partition(
      graph, first_row(rows), rows, gather_rows, None if x is None else gather_rows(x)
    )

  sets = {
    "train": dataset.train_idx[fit_ids],
    "val": dataset.train_idx[val_ids],
    "test": dataset.test_idx,
  }
  return fit(
    mesh,
    parts,
    rgcn.build_model(dataset, config, nnx.Rngs(config.seed)),
    config.learning_rate,
    host,
    logits_of,
    sets,
    epochs=config.epochs,
    in_step=("train", "val"),
    penalty=lambda model: config.l2 * rgcn.l2_penalty(model),
    on_epoch=on_epoch,
  )


def train_hetero(
  dataset: MagDataset, config, *, on_epoch: Callable[[dict], None] | None = None
) -> TrainResult:
  """`jaxdata.train.attention.train` over the mesh of `config.devices` devices per process:
  each device holds its rows of every node type's features; validation and test accuracy are
  counted after each update, as the single-device trainer does. Learnable embeddings
  (`TrainConfig.embed`) are single-device only."""
  if config.embed:
    raise ValueError(
      "attention: learnable embeddings (embed) train on one device only; use devices=1"
    )
  mesh = device_mesh(config.devices)
  graph = dataset.graph
  parts = partition(graph, mesh.devices.size)
  n = parts.padded_nodes
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

  def logits_of(model, graph, consts):
    rows = parts.rows
    return model.on_partition(
      graph, consts["xs"], consts["types"], first_row(rows), rows, gather_rows
    )

  sets = {s: paper0 + np.asarray(getattr(dataset, f"{s}_papers")) for s in ("train", "val", "test")}
  return fit(
    mesh,
    parts,
    hetero.build_model(dataset, config, nnx.Rngs(config.seed)),
    config.learning_rate,
    {"xs": features, "types": types, "labels": labels},
    logits_of,
    sets,
    epochs=config.epochs,
    every_epoch=("val",),
    on_epoch=on_epoch,
  )
