"""Mini-batch training of a relational GNN from host memory: `jaxdata train rgcn|rgat|hgt
--minibatch`.

The three parts of jaxdata in one step, through the public loader (`jaxdata.loader.Loader`,
the dataset's graph and features in pinned host memory): inside the jitted step the GPU samples
the seeds' neighbourhood hop by hop, builds each hop's block on the device, gathers the
features of the sampled nodes straight from the host tables, and runs the model's hector
layers on the blocks. JAX's asynchronous dispatch queues step i + 1 (its
sampling and gathers) behind step i, with no host work between them.

The model is the full-graph trainer's (`jaxdata.nn.classifiers`): the same parameters,
so a checkpoint of either trains on or evaluates with the other. Validation accuracy is measured
on mini-batches of validation papers after every epoch (same fanouts, another key); the final
accuracies are measured full-graph when the graph fits (`evaluate="full"`), which is exact.

Data parallel (`TrainConfig.devices` other than 1, or several processes of a `jax.distributed`
job): as GraphSAGE (`jaxdata.train.sage`), `batch_size` is per device and a step trains on
`batch_size` x devices seeds, each device sampling its share from its process's host graph
with its own key; the dense parameters and their Adam state are replicated, their gradients
summed once over the mesh (`common.psum_flat`); every embedding table update all-gathers the
global batch's (row, gradient) pairs (`host.sparse`, `copies=` the processes), so each
process's copy of a table receives every row (docs/distributed.md). One device of one process
runs the unsharded step (`make_step`).

The RGCN entity task (`jaxdata.tasks.rgcn`) runs the same loop: on the featureless RDF graphs
the first layer's input is a node's one-hot id, so its parameters with a row per node (each
basis V_b, or each relation's W_r, and a separate W_0) are in effect a learnable embedding;
they live in one host table (`RGCN.node_rows`) and train like embeddings, lazily (only the
rows a step reads change, as in PyTorch's SparseAdam), and come back into the model at the end.
The layer computes on those rows what the full-graph layer computes (`RGCN.on_rows`), so with
fanouts that cover every in-edge a step gives the full-graph step's loss and gradients at its
seeds. The paper's L2 term counts the first layer's dense parameters and the rows a step reads
(`l2_penalty`).

    from jaxdata.data import synthetic_mag
    from jaxdata.train.attention import TrainConfig
    from jaxdata.train.attention.minibatch import MinibatchConfig, train
    result = train(synthetic_mag(scale=0.002, num_classes=8), TrainConfig(model="rgat", epochs=2),
                   MinibatchConfig(fanouts=(5, 5), batch_size=64))
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxdata.data import EntityDataset
from jaxdata.data.mag import MagDataset
from jaxdata.host import sparse
from jaxdata.loader import Batch, Loader, initial_embeddings
from jaxdata.nn.classifiers import EntityClassifier, is_table
from jaxdata.sizes import format_bytes
from jaxdata.tasks import rgcn
from jaxdata.tasks.hetero import TrainConfig, build_model, evaluate
from jaxdata.train import common
from jaxdata.train.common import TrainResult


@dataclasses.dataclass(frozen=True)
class MinibatchConfig(common.MinibatchConfig):
  """`common.MinibatchConfig` for RGAT / HGT: `batch_size` seed papers per step, "device": graph
  and features in device memory (where they fit; embedding tables stay in host memory),
  `table_optimizer` trains the embedding tables (`TrainConfig.embed`), and `cache`: with
  "host", keep this fraction of each feature table's rows on the device; or `device_bytes`:
  the device holds at most this many bytes of dense parameters, their optimizer state and
  cached feature rows (the cache gets what the dense model leaves; every other row is read
  from host memory)."""

  batch_size: int = 1024
  cache: float = 0.0
  device_bytes: int | None = None

  def __post_init__(self):
    super().__post_init__()
    if not 0 <= self.cache <= 1:
      raise ValueError(f"MinibatchConfig: cache must be a fraction in [0, 1], got {self.cache}")
    if self.cache and self.pipeline != "host":
      raise ValueError(
        "MinibatchConfig: a device cache is for the host pipeline (the device "
        "pipeline has every row on the device)"
      )
    if self.device_bytes is not None:
      if self.pipeline != "host":
        raise ValueError(
          "MinibatchConfig: device_bytes is for the host pipeline (the device "
          "pipeline has every row on the device)"
        )
      if self.cache:
        raise ValueError(
          "MinibatchConfig: give cache or device_bytes, not both (device_bytes sizes the cache)"
        )
      if (
        isinstance(self.device_bytes, bool)
        or not isinstance(self.device_bytes, (int, np.integer))
        or self.device_bytes < 0
      ):
        raise ValueError(
          f"MinibatchConfig: device_bytes must be a byte count >= 0, got {self.device_bytes!r}"
        )


def make_loader(
  dataset: MagDataset,
  pipeline: str,
  fanouts: Sequence[int],
  *,
  embeddings: dict[int, Any] | None = None,
  cache: float = 0.0,
  cache_bytes: int | None = None,
) -> Loader:
  """The dataset as a `jaxdata.loader.Loader`: features of every type but those in
  `embeddings` ({node type index: initial [N_t, d] rows}, trained in host memory), the papers'
  labels, `fanouts`; "device": graph and features on the device. `cache` keeps that fraction
  of each feature table's rows on the device; `cache_bytes` sizes the cache to that many bytes
  instead (`loader.cache_fraction` says what it gave)."""
  names = dataset.graph.node_type_names
  embeddings = embeddings or {}
  return Loader(
    dataset.graph,
    fanouts=fanouts,
    features={n: x for t, (n, x) in enumerate(zip(names, dataset.features)) if t not in embeddings},
    embeddings={names[t]: x for t, x in embeddings.items()},
    labels={dataset.target: dataset.labels},
    cache=cache,
    cache_bytes=cache_bytes,
    pipeline=pipeline,
  )


def entity_loader(
  dataset: EntityDataset, model: EntityClassifier, pipeline: str, fanouts: Sequence[int]
) -> Loader:
  """An entity dataset as a `Loader` of one node type: its features, or (featureless) the
  model's node rows as a learnable embedding (`RGCN.node_rows`); the training labels."""
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


def logits_of(model, batch: Batch, inputs=None, plan=None):
  """Logits of the batch's seeds (`inputs`: the batch's, or replacements) and the valid-seed
  mask (`plan`: the model's offload plan on blocks, `on_blocks`)."""
  inputs = batch.inputs if inputs is None else inputs
  logits = model.on_blocks(batch.blocks, inputs, batch.types, plan)
  return logits[: batch.seeds.shape[0]], batch.mask


def hits(logits: jax.Array, valid: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(correct, count) over the valid seeds: what every step and evaluation reports."""
  return ((jnp.argmax(logits, -1) == y) & valid).sum(), valid.sum()


def summed_loss(model, batch: Batch, learned=(), embedded=(), plan=None):
  """The summed cross entropy of the batch's valid seeds, and (correct, valid count): the
  model on the batch's inputs with the rows of the node types `embedded` replaced by `learned`
  (what the step differentiates for the tables' sparse updates)."""
  inputs = list(batch.inputs)
  for t, x in zip(embedded, learned):
    inputs[t] = x
  logits, valid = logits_of(model, batch, inputs, plan)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch.labels)
  return jnp.sum(jnp.where(valid, ce, 0)), hits(logits, valid, batch.labels)


def correct_of(model, loader: Loader, seeds, key) -> tuple[jax.Array, jax.Array]:
  """(correct, count) of the seeds' sampled batch: what the accuracies count."""
  batch = loader.sample(seeds, key)
  return hits(*logits_of(model, batch), batch.labels)


def forward(model, loader: Loader, seeds, key, plan=None):
  """Logits of the seeds' slots (first len(seeds) rows) and the valid-seed mask."""
  return logits_of(model, loader.sample(seeds, key), plan=plan)


def table_bytes(dataset: MagDataset, embed: Sequence[str], embed_dim: int) -> tuple[int, int]:
  """(bytes of the feature tables of the types not in `embed`, bytes of float32 `embed_dim`-wide
  embedding tables for the types in `embed`): what a mini-batch run keeps in host memory;
  `--device-bytes auto` is a quarter of their sum."""
  names = dataset.graph.node_type_names
  features = sum(x.nbytes for t, x in zip(names, dataset.features) if t not in embed)
  embeddings = sum(len(x) * embed_dim * 4 for t, x in zip(names, dataset.features) if t in embed)
  return features, embeddings


def device_bytes_of(tree) -> int:
  """Bytes of the JAX arrays in `tree` (NumPy arrays, host memory, are not counted)."""
  return sum(x.nbytes for x in jax.tree.leaves(tree) if isinstance(x, jax.Array))


#: Makes a plan (one offload policy per planned layer, `model.stack_layers`) for a freshly built
#: model from a sampled batch: its blocks (fixed padded shapes per hop, so one plan fits every
#: batch) and the node type of each outermost slot (`budget_planner(..., blocks=True)`).
BlockPlanner = Callable[[nnx.Module, Any, jax.Array], Sequence]


def _is_row_param(path, value) -> bool:
  """An entity classifier's first-layer parameters with a row per node (featureless input):
  they train in a host table, not through the dense optimizer (`dense_filter`)."""
  del value
  return len(path) >= 2 and path[0] == "conv1" and path[1] in ("weight", "bases", "root")


def dense_filter(model) -> Any:
  """The parameters the dense optimizer trains: all but the embedding tables (`is_table`); for
  an `EntityClassifier` without features, all but its first layer's node rows."""
  if isinstance(model, EntityClassifier):
    return nnx.All(nnx.Param, nnx.Not(_is_row_param)) if model.conv1.featureless else nnx.Param
  return nnx.All(nnx.Param, nnx.Not(is_table))


def dense_penalty(model: EntityClassifier) -> jax.Array:
  """The RGCN paper's L2 term's dense part: the first layer's squared parameters, but for the
  node rows of a featureless model (the rows a step reads count instead, `l2_penalty`)."""
  featureless = model.conv1.featureless
  return sum(
    jnp.sum(p[...].astype(jnp.float32) ** 2)
    for path, p in nnx.iter_graph(model.conv1)
    if isinstance(p, nnx.Param) and not (featureless and _is_row_param(("conv1",) + path, p))
  )


def l2_penalty(l2: float) -> Penalty:
  """The entity task's L2 term on mini-batches, the lazy counterpart of the full penalty
  (`jaxdata.tasks.rgcn.l2_penalty`): `l2` times the first layer's dense parameters' squares
  and those of the node rows a step reads (`learned`; each sampled node once, or on a mesh
  where `first` is True: `first_reads`). Returns (the term, its node rows' part)."""

  def penalty(model, learned, first=None):
    rows = jnp.zeros((), jnp.float32)
    for x, f in zip(learned, first or [None] * len(learned)):
      squares = x.astype(jnp.float32) ** 2
      rows = rows + jnp.sum(squares if f is None else jnp.where(f[:, None], squares, 0))
    return l2 * (dense_penalty(model) + rows), l2 * rows

  return penalty


#: ``penalty(model, learned, first=None) -> (term, the learned rows' part of it)``: what a
#: task adds to the mean cross entropy (`l2_penalty`).
Penalty = Callable[..., tuple[Any, Any]]


def first_reads(ids: jax.Array, axis: str) -> jax.Array:
  """Inside `sharded_jit`: bool[slots], True where this device's slot holds a row that no
  device before it along `axis` holds (each device's `ids` are unique), so that the rows of
  the global batch each count once in an L2 term, as on one device."""
  every = jax.lax.all_gather(ids, axis, tiled=True)
  order = jnp.argsort(every, stable=True)  # device by device within equal ids
  ranked = every[order]
  first = jnp.concatenate([jnp.ones(1, bool), ranked[1:] != ranked[:-1]])
  first = jnp.zeros_like(first).at[order].set(first)
  return jax.lax.dynamic_slice_in_dim(first, jax.lax.axis_index(axis) * ids.shape[0], ids.shape[0])


def make_step(dense, table_opt, plan: Sequence | None = None, penalty: Penalty | None = None):
  """The step that trains a model on a loader's mini-batch, ``step(model, optimizer,
  table_states, loader, seeds, key) -> (summed loss, correct, count, token of the table
  updates)``, not jitted (`common.DeviceSteps` runs it with one dispatch per step): samples
  and gathers, then the cross entropy of the valid seeds (plus `penalty`'s term), the
  parameters `dense` selects (an nnx filter) updated by the caller's `nnx.Optimizer`, each
  embedding table by `table_opt` (a `host.sparse` optimizer; its states are `table_states`)."""

  def train_on(model, optimizer, table_states, loader, batch):
    def loss_fn(model, learned):
      total, (correct, count) = summed_loss(model, batch, learned, loader.embedded, plan)
      loss = total / jnp.maximum(count, 1)
      return loss if penalty is None else loss + penalty(model, learned)[0], (correct, count)

    grad_fn = nnx.value_and_grad(loss_fn, argnums=(nnx.DiffState(0, dense), 1), has_aux=True)
    learned = [batch.inputs[t] for t in loader.embedded]
    (loss, (correct, count)), (grads, row_grads) = grad_fn(model, learned)
    optimizer.update(model, grads)
    token = loader.update_embeddings(table_opt, table_states, batch, row_grads)
    return loss * count, correct, count, token  # summed loss: epochs add them up

  def step(model, optimizer, table_states, loader, seeds, key):
    return train_on(model, optimizer, table_states, loader, loader.sample(seeds, key))

  return step


def sharded_steps(
  loader: Loader,
  model,
  optimizer,
  dense,
  table_opt,
  table_states,
  mesh,
  batch_size: int,
  penalty: Penalty | None = None,
) -> common.ShardedSteps:
  """Data-parallel mini-batch training over `mesh` (`common.ShardedSteps`): `batch_size` seeds
  per device, each device sampling its share; gradients of the summed cross entropy summed over
  the mesh in one all-reduce and divided by the global count of valid seeds (the one-device
  step's mean). `penalty`'s gradient is added once: its dense part on every device alike, its
  rows' part where a row is first read (`first_reads`). Each table update runs with
  ``axis_name`` and ``copies=jax.process_count()`` (`host.sparse`): every process's copy
  receives every row."""
  axis = common.MESH_AXIS
  copies = jax.process_count()

  def train_on(model, optimizer, loader, seeds, key):
    batch = loader.sample(seeds, key)
    loss_fn = lambda model, learned: summed_loss(model, batch, learned, loader.embedded)  # noqa: E731
    grad_fn = nnx.value_and_grad(loss_fn, argnums=(nnx.DiffState(0, dense), 1), has_aux=True)
    learned = [batch.inputs[t] for t in loader.embedded]
    (total, (correct, count)), (grads, row_grads) = grad_fn(model, learned)
    if penalty is None:
      total, correct, count, grads = common.psum_flat((total, correct, count, grads), axis)
    else:
      first = [first_reads(ids, axis) for ids in loader.embedding_ids(batch)]
      (term, rows_term), (term_grads, term_rows) = nnx.value_and_grad(
        penalty, argnums=(nnx.DiffState(0, dense), 1), has_aux=True
      )(model, learned, first)
      dense_term = term - rows_term  # the same on every device
      total, rows_term, correct, count, grads = common.psum_flat(
        (total, rows_term, correct, count, grads), axis
      )
    n = jnp.maximum(count, 1)
    grads, row_grads = jax.tree.map(lambda g: g / n, (grads, row_grads))
    if penalty is not None:
      grads, row_grads = jax.tree.map(jnp.add, (grads, row_grads), (term_grads, term_rows))
      total = (total / n + dense_term + rows_term) * count
    optimizer.update(model, grads)
    token = loader.update_embeddings(
      table_opt, table_states, batch, row_grads, axis_name=axis, copies=copies
    )
    return total, correct, count, token

  return common.ShardedSteps(model, optimizer, loader, mesh, batch_size, train_on, correct_of)


def train(
  dataset: MagDataset | EntityDataset,
  config: TrainConfig | rgcn.TrainConfig,
  minibatch: MinibatchConfig = MinibatchConfig(),
  *,
  plan: Sequence | BlockPlanner | None = None,
  on_epoch: Callable[[dict], None] | None = None,
  on_batch: Callable[[int, int], None] | None = None,
  final_evaluation: str | None = None,
  validate: bool = True,
  resume: Callable[[nnx.Module, nnx.Optimizer], list[dict]] | None = None,
  save_every: int = 0,
  on_save: Callable[[TrainResult], None] | None = None,
) -> TrainResult:
  """Trains `config.model` (RGAT, HGT or RGCN) on mini-batches of training papers, or with a
  `jaxdata.tasks.rgcn` configuration the 2-layer RGCN on an entity dataset's training nodes:
  featureless, the first layer's node rows train in a host table (as embeddings do), the L2
  term counting the rows a step reads (`l2_penalty`); validation on the nodes `val_fraction`
  holds out, the test accuracy on the whole graph.

  The device holds the dense parameters, their Adam state, the feature cache (if any) and each
  step's arrays; the embedding tables (`config.embed`) exist only in host memory (initial
  values: `initial_embeddings`) and come back into the returned model as NumPy arrays, so that
  its checkpoint is a full-graph one. Each epoch's record says how many bytes the model and
  optimizer state take on the device ("device_state_bytes") and the cache's ("cache_bytes").

  `final_evaluation`: "full" measures the final validation and test accuracy on the whole graph
  (exact; needs the graph on the device), "minibatch" on sampled mini-batches, "none" not at
  all; default "full", or "minibatch" under `minibatch.device_bytes`. `validate=False` skips
  the validation accuracy after each epoch (benchmarks).

  `plan`: None (plain layers), one `jaxdata.offload.Policy` per planned layer
  (`model.stack_layers`: RGAT's every layer, HGT's after the first), applied per layer call on
  the blocks, or a `BlockPlanner` called once on the model and the first batch's blocks. A plan
  changes memory and time, not the numbers; it is kept as `TrainResult.plan`.

  Data parallel when `config.devices` is not 1 or the job has several processes
  (`sharded_steps`): `minibatch.batch_size` seeds per device, every device of every process
  (`config.devices` per process; None: all); no `plan` there. Every process
  evaluates on its own copy of the trained model.

  Each epoch's record says where in the epoch it ended ("batch" of "batches_per_epoch": fewer
  when a stop request ended it). `resume(model, optimizer)` puts a saved run's state into the
  fresh model and optimizer and returns its history; training goes on from the batch after the
  last record's, with the same seed order and keys, to the parameters a run never stopped would
  have. `on_save(result)` gets the run so far every `save_every` epochs. Both: one device, no
  `plan`, no embedding tables (their optimizer state lives in host memory).
  """
  entity = isinstance(config, rgcn.TrainConfig)
  layers = 2 if entity else config.layers  # type: ignore[union-attr]
  if len(minibatch.fanouts) != layers:
    raise ValueError(
      f"train: {len(minibatch.fanouts)} fanouts for {layers} layers (give one fanout per layer)"
    )
  mesh = None
  if config.devices != 1 or jax.process_count() > 1:  # data parallel (sharded_steps)
    if plan is not None:
      raise ValueError("train: an offload plan runs on one device of one process (devices=1)")
    mesh = common.device_mesh(config.devices, what="train")
  if isinstance(dataset, EntityDataset) and (
    final_evaluation is not None or minibatch.cache or minibatch.device_bytes is not None
  ):
    raise ValueError(
      "train: an entity dataset is evaluated on its whole graph and has no device cache: "
      "final_evaluation, cache and device_bytes are for heterographs"
    )
  if final_evaluation is None:
    final_evaluation = "full" if minibatch.device_bytes is None else "minibatch"
  if final_evaluation not in ("full", "minibatch", "none"):
    raise ValueError(
      f"final_evaluation must be 'full', 'minibatch' or 'none', got {final_evaluation!r}"
    )
  penalty = None
  if isinstance(dataset, EntityDataset):
    if plan is not None:
      raise ValueError("train: an entity classifier has no layers to plan")
    model = rgcn.build_model(dataset, config, nnx.Rngs(config.seed))  # type: ignore[arg-type]
    fit, val = rgcn.split_validation(len(dataset.train_idx), config.val_fraction, config.seed)
    ids = {"train": dataset.train_idx[fit], "val": dataset.train_idx[val], "test": None}
    validate = validate and len(val) > 0
    final_evaluation = "entity"
    if config.l2:  # type: ignore[union-attr]
      penalty = l2_penalty(config.l2)  # type: ignore[union-attr]
  else:
    model = build_model(dataset, config, nnx.Rngs(config.seed), tables=False)  # type: ignore[arg-type]
    first = dataset.node_range(dataset.target)[0]
    ids = {s: np.asarray(getattr(dataset, f"{s}_papers")) + first for s in ("train", "val", "test")}
  # Embedding tables (and node rows) train in host memory (a sparse optimizer), the rest with
  # optax Adam.
  dense = dense_filter(model)
  optimizer = nnx.Optimizer(model, optax.adam(config.learning_rate), wrt=dense)
  state_bytes = device_bytes_of(nnx.state((model, optimizer)))
  cache_bytes = None
  if minibatch.device_bytes is not None:
    cache_bytes = minibatch.device_bytes - state_bytes
    if cache_bytes < 0:
      raise common.DeviceBudgetError(
        f"train: the dense model and its optimizer state need "
        f"{format_bytes(state_bytes)} on the device, more than device_bytes "
        f"{format_bytes(minibatch.device_bytes)}"
      )
  table_opt = sparse.BY_NAME[minibatch.table_optimizer](config.learning_rate)
  fanouts = tuple(int(f) for f in minibatch.fanouts)
  if isinstance(dataset, EntityDataset):
    loader = entity_loader(dataset, model, minibatch.pipeline, fanouts)
  else:
    initial = initial_embeddings(
      [len(dataset.features[t]) for t in model.embedded], config.embed_dim, config.seed
    )
    loader = make_loader(
      dataset,
      minibatch.pipeline,
      fanouts,
      cache=minibatch.cache,
      embeddings=dict(zip(model.embedded, initial)),
      cache_bytes=cache_bytes,
    )
    del initial  # the host tables hold copies
  with loader, contextlib.ExitStack() as closing:
    if (resume is not None or save_every) and (
      mesh is not None or plan is not None or loader.embedded
    ):
      # embedded rows train in host tables: a checkpoint mid-run would hold their first rows
      raise ValueError(
        "train: resume and save_every are for one device, without a plan or embedded node rows"
      )
    table_states = loader.init_embeddings(table_opt)
    for state in table_states:
      closing.callback(sparse.close, state)
    if callable(plan):  # measured on a sampled batch: every batch has its padded shapes
      seeds = jnp.asarray(common.seed_batches(ids["train"], minibatch.batch_size, limit=1)[0])
      batch = jax.jit(Loader.prepare)(loader, seeds, jax.random.key(config.seed))
      plan = plan(model, batch.blocks, batch.types)
    plan = common.model_plan(plan, model)

    sharded = (
      None
      if mesh is None
      else sharded_steps(
        loader,
        model,
        optimizer,
        dense,
        table_opt,
        table_states,
        mesh,
        minibatch.batch_size,
        penalty,
      )
    )
    step = make_step(dense, table_opt, plan=plan, penalty=penalty)
    device_steps = common.DeviceSteps(model, optimizer, step)

    predict = nnx.jit(correct_of)

    def accuracy(nodes, key) -> float:
      if sharded is not None:
        return sharded.accuracy(nodes, key)
      predicted = lambda s, k: predict(model, loader, s, k)  # noqa: E731
      return common.sampled_accuracy(predicted, nodes, minibatch.batch_size, key)

    rng = np.random.default_rng(config.seed)
    # (the entity task's keys: two, as it has no sampled test accuracy)
    key, val_key, *test_key = jax.random.split(jax.random.key(config.seed), 2 if entity else 3)
    per_step = minibatch.batch_size * (1 if mesh is None else mesh.size)
    seed_rows = lambda _: common.seed_batches(ids["train"], per_step, rng, minibatch.max_batches)  # noqa: E731

    def run_epoch(epoch: int, rows: np.ndarray, skip: int) -> dict:
      epoch_key = jax.random.fold_in(key, epoch)
      if sharded is not None:
        record = sharded.epoch(rows, epoch_key, on_batch)
      else:
        record = device_steps.epoch((table_states, loader), rows, epoch_key, on_batch, skip)
      record["device_state_bytes"] = device_bytes_of(
        nnx.state((model, optimizer)) if sharded is None else sharded.state
      )
      record["cache_bytes"] = loader.cache_nbytes
      record["cache_fraction"] = loader.cache_fraction
      if validate:
        record["val_accuracy"] = accuracy(ids["val"], jax.random.fold_in(val_key, epoch))
      return record

    start = time.perf_counter()
    history = common.fit_epochs(
      config.epochs,
      run_epoch,
      lambda *run: TrainResult(model, *run, optimizer, plan),
      history=[] if resume is None else resume(model, optimizer),
      seed_rows=seed_rows,
      on_epoch=on_epoch,
      save_every=save_every,
      on_save=on_save,
      measure_saves=False,
    ).history
    if final_evaluation == "minibatch":
      final = {
        "val_accuracy": accuracy(ids["val"], jax.random.fold_in(val_key, 0)),
        "test_accuracy": accuracy(ids["test"], test_key[0]),
      }
    if sharded is not None:
      sharded.finish()
    # The trained embeddings (node rows) back into the model: its checkpoint is a full-graph one.
    trained = [loader.tables[t].as_numpy().copy() for t in loader.embedded]
    if isinstance(model, EntityClassifier):
      for rows in trained:
        model.conv1.set_node_rows(jax.device_put(rows))
    else:
      model.set_tables(trained)  # as host arrays
    for t in loader.embedded:  # several processes: every copy received every row update
      common.check_copies_agree(loader.tables[t].as_numpy(), dataset.graph.node_type_names[t])
  if final_evaluation == "entity":
    final = rgcn.evaluate(model, dataset)  # type: ignore[arg-type]
  elif final_evaluation == "full":
    final = evaluate(model, dataset)  # type: ignore[arg-type]
  elif final_evaluation == "none":
    final = {}
  note = ""
  if final_evaluation == "minibatch":
    note = (
      f"on sampled mini-batches (fanouts {','.join(map(str, minibatch.fanouts))}, "
      f"{minibatch.batch_size} seeds each), not the whole graph"
    )
  # With embedding tables the optimizer state is partial (their moments lived in host memory).
  return TrainResult(
    model,
    history,
    final,
    time.perf_counter() - start,
    None if loader.embedded else optimizer,
    plan,
    metrics_note=note,
  )
