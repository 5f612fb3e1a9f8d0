"""Mini-batch training of a relational GNN from host memory: `jaxdata train rgat|hgt --minibatch`.

The three parts of jaxdata in one step. The graph (in-edges by destination, with relations)
and every node type's features sit in pinned host memory (`HostGraph`, `HostTable`); inside
the jitted step the GPU samples the seeds' neighbourhood hop by hop (`loader.sample_blocks`,
zero-copy), builds each hop's block as a hector graph on the device (`hector.block`), gathers the
features of the sampled nodes straight from the host tables (`host_gather`), and runs the
model's hector layers on the blocks. JAX's asynchronous dispatch queues step i + 1 (its
sampling and gathers) behind step i, with no host work between them.

The model is the full-graph trainer's (`train.attention.RGATClassifier`): the same parameters,
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
runs the unsharded steps (`make_steps`).

    from jaxdata.data import synthetic_mag
    from jaxdata.train.attention import TrainConfig
    from jaxdata.train.attention.minibatch import MinibatchConfig, train
    result = train(synthetic_mag(scale=0.002, num_classes=8), TrainConfig(model="rgat", epochs=2),
                   MinibatchConfig(fanouts=(5, 5), batch_size=64))
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxdata.data.mag import MagDataset
from jaxdata.host import HostGraph, HostTable, sparse
from jaxdata.loader.blocks import (
  budget_fraction,
  gather_typed,
  node_types,
  sample_blocks,
  type_caches,
)
from jaxdata.host.sample import DeviceGraph
from jaxdata.sizes import format_bytes
from jaxdata.train import common
from jaxdata.train.attention import TrainConfig, build_model, evaluate, is_table
from jaxdata.train.common import TrainResult


@dataclasses.dataclass(frozen=True)
class MinibatchConfig(common.MinibatchConfig):
  """`common.MinibatchConfig` for RGAT / HGT: `batch_size` seed papers per step, "device": graph
  and features in device memory (where they fit; embedding tables stay in host memory),
  `table_optimizer` trains the embedding tables (`TrainConfig.embed`), and `cache`: with
  "host", keep this fraction of each feature table's rows on the device; or `device_bytes`:
  the device holds at most this many bytes of dense parameters, their optimizer state and
  cached feature rows (the cache gets what the dense model leaves; every other row is read
  from host memory). `prefetch`: software-pipelined steps, step i also samples batch i + 1
  and gathers its feature rows in the same program (`Steps.pipelined`); the same results.
  XLA runs it on one stream: the next batch's work can fill gaps between the model's kernels,
  not run beside them (docs/minibatch.md)."""

  batch_size: int = 1024
  cache: float = 0.0
  device_bytes: int | None = None
  prefetch: bool = False

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


class HostData:
  """The dataset's graph and features where `pipeline` wants them, and the model's embedding
  tables (`TrainConfig.embed`) in host memory; a context manager that frees the host tables.

  The embedding tables' initial values come from `embeddings` ({node type: [N_t, d] array},
  in the model's `embedded` order) or from `model.tables`. `cache` keeps that fraction of each
  feature table's rows (its most sampled nodes) in a device cache; `cache_bytes` sizes the
  cache to that many bytes instead (`loader.blocks.budget_fraction`; `self.cache_fraction` says
  what it gave).
  """

  def __init__(
    self,
    dataset: MagDataset,
    pipeline: str,
    model=None,
    cache: float = 0.0,
    *,
    embeddings: dict[int, Any] | None = None,
    cache_bytes: int | None = None,
  ):
    g = dataset.graph
    self.type_offsets = tuple(int(o) for o in g.node_type_offsets)
    self.num_relations = g.num_relations
    self.host = HostGraph.from_hetero(g)
    if embeddings is None:
      embeddings = (
        {}
        if model is None
        else {
          t: np.asarray(table.embedding[...], np.float32)
          for t, table in zip(model.embedded, model.tables)
        }
      )
    # Embedded types: the model's initial embedding, trained in place by a sparse optimizer.
    self.embedded = tuple(embeddings)
    self.tables = [
      HostTable(embeddings[t] if t in embeddings else np.ascontiguousarray(x, np.float32))
      for t, x in enumerate(dataset.features)
    ]
    # "device": the step takes the device arrays as arguments (`consts`), not as constants
    # baked into the program; "host": the host objects enter the step as handles.
    self.consts = {}
    featured = [None if t in self.embedded else x for t, x in enumerate(self.tables)]
    if cache_bytes is not None:
      cache = budget_fraction(featured, cache_bytes)
    self.cache_fraction = cache
    if cache:  # the most sampled rows of each feature table (not of the embeddings: they train)
      self.consts["caches"] = type_caches(self.host, featured, self.type_offsets, cache)
    if pipeline == "device":
      self.consts = {
        "graph": DeviceGraph.from_host(self.host),
        "features": [
          None if t in self.embedded else jnp.asarray(x) for t, x in enumerate(dataset.features)
        ],
      }

  @property
  def cache_bytes(self) -> int:
    """Device bytes of the feature caches."""
    return sum(c.nbytes for c in self.consts.get("caches", ()) if c is not None)

  def where(self, consts):
    """(graph, tables) a step reads: its `consts` arguments, or the host objects (embedding
    tables stay in host memory either way)."""
    if "graph" in consts:
      return consts["graph"], [
        self.tables[t] if x is None else x for t, x in enumerate(consts["features"])
      ]
    return self.host, self.tables

  def embedding_ids(self, nodes: jax.Array, mask: jax.Array) -> list[jax.Array]:
    """Per embedded type, each slot's row of its table (the table's row count, out of range,
    for slots of other types and unused slots: dropped by a scatter)."""
    out = []
    for t in self.embedded:
      lo, hi = self.type_offsets[t], self.type_offsets[t + 1]
      out.append(jnp.where(mask & (nodes >= lo) & (nodes < hi), nodes - lo, hi - lo))
    return out

  def close(self):
    for t in self.tables:
      t.close()
    self.host.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def sample(data: HostData, consts, seeds, fanouts, key):
  """(blocks, every type's input rows for the outermost frontier's slots)."""
  graph, tables = data.where(consts)
  blocks = sample_blocks(graph, seeds, fanouts, key, num_relations=data.num_relations)
  return blocks, gather_typed(
    tables, data.type_offsets, blocks.nodes[-1], blocks.masks[-1], consts.get("caches")
  )


def logits_of(model, data: HostData, blocks, xs, seeds, plan=None):
  """Logits of the seeds' slots (first len(seeds) rows) and the valid-seed mask (`plan`: the
  model's offload plan on blocks, `on_blocks`)."""
  logits = model.on_blocks(blocks, xs, node_types(data.type_offsets, blocks.nodes[-1]), plan)
  return logits[: seeds.shape[0]], blocks.masks[0][: seeds.shape[0]]


def hits(logits: jax.Array, valid: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(correct, count) over the valid seeds: what every step and evaluation reports."""
  return ((jnp.argmax(logits, -1) == y) & valid).sum(), valid.sum()


def summed_loss(model, data: HostData, blocks, xs, learned, seeds, y, plan=None):
  """The summed cross entropy of the valid seeds against labels `y`, and (correct, valid
  count): the model on `blocks` with input rows `xs`, the embedded types' rows replaced by
  `learned` (what the step differentiates for the tables' sparse updates)."""
  inputs = list(xs)
  for t, x in zip(data.embedded, learned):
    inputs[t] = x
  logits, valid = logits_of(model, data, blocks, inputs, seeds, plan)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
  return jnp.sum(jnp.where(valid, ce, 0)), hits(logits, valid, y)


def update_tables(
  data: HostData, table_opt, table_states, blocks, row_grads, **update_kwargs
) -> jax.Array:
  """Each embedding table's sparse update (`table_opt.update`) from its rows' gradients;
  returns the summed update tokens (0 once the writes are done)."""
  token = jnp.int32(0)
  for t, state, ids, g in zip(
    data.embedded, table_states, data.embedding_ids(blocks.nodes[-1], blocks.masks[-1]), row_grads
  ):
    token = token + table_opt.update(data.tables[t], state, ids, g, **update_kwargs)
  return token


def forward(model, data: HostData, consts, seeds, fanouts, key, plan=None):
  """Logits of the seeds' slots (first len(seeds) rows) and the valid-seed mask."""
  blocks, xs = sample(data, consts, seeds, fanouts, key)
  return logits_of(model, data, blocks, xs, seeds, plan)


def _gather_types(data: HostData, tables, caches, blocks, types) -> list:
  """`gather_typed`'s rows of the node types in `types` (None for the others), each type
  gathered by its own `gather_typed` call over that type's id range: the same rows."""
  caches = [None] * len(tables) if caches is None else caches
  o = data.type_offsets
  return [
    gather_typed([tables[t]], o[t : t + 2], blocks.nodes[-1], blocks.masks[-1], [caches[t]])[0]
    if t in types
    else None
    for t in range(len(tables))
  ]


def prepare(data: HostData, consts, seeds, fanouts, key):
  """The part of a batch a step may prepare while the previous step computes: (seeds, blocks,
  rows of the feature types, None for the embedded types). It reads only what training never
  writes (the graph, the feature tables and their caches); the embedding rows, which the
  previous step updates, are gathered by the step itself (`complete`)."""
  graph, tables = data.where(consts)
  blocks = sample_blocks(graph, seeds, fanouts, key, num_relations=data.num_relations)
  featured = [t for t in range(len(tables)) if t not in data.embedded]
  return seeds, blocks, _gather_types(data, tables, consts.get("caches"), blocks, featured)


def complete(data: HostData, consts, batch):
  """(seeds, blocks, every type's input rows) of a `prepare`d batch: the embedding rows
  gathered now, from the tables as the steps so far left them. The rows equal `sample`'s."""
  seeds, blocks, xs = batch
  _, tables = data.where(consts)
  learned = _gather_types(data, tables, consts.get("caches"), blocks, data.embedded)
  return seeds, blocks, [x if x is not None else y for x, y in zip(xs, learned)]


#: Embedding rows drawn per chunk by `initial_embeddings` (each chunk its own generator).
EMBED_CHUNK = 1 << 16


def initial_embeddings(
  rows: Sequence[int], dim: int, seed: int, threads: int | None = None
) -> list[np.ndarray]:
  """float32 [rows_i, dim] tables of N(0, 1 / dim) entries, the distribution of `nnx.Embed`'s
  default init, drawn in host memory (NumPy, chunk by chunk on a thread pool; the values
  depend on `seed` only): mini-batch training's embedding tables never exist on the device."""
  seeds = np.random.SeedSequence([seed, 0x7AB1E5]).spawn(len(rows))
  out = [np.empty((n, dim), np.float32) for n in rows]
  scale = np.float32(1 / np.sqrt(dim))

  def fill(x, part, ss):
    np.random.default_rng(ss).standard_normal(out=x[part], dtype=np.float32)
    x[part] *= scale

  with ThreadPoolExecutor(threads or os.cpu_count() or 1) as pool:
    jobs = [
      pool.submit(fill, x, slice(a, a + EMBED_CHUNK), ss)
      for x, table_seed in zip(out, seeds)
      for a, ss in zip(range(0, len(x), EMBED_CHUNK), table_seed.spawn(-(-len(x) // EMBED_CHUNK)))
    ]
    for job in jobs:
      job.result()
  return out


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


@dataclasses.dataclass(frozen=True)
class Steps:
  """The jitted steps of a mini-batch run (`make_steps`).

  Attributes:
    step: ``step(model, optimizer, table_states, consts, seeds, key) -> (summed loss, correct,
      count, token of the table updates)``: samples, gathers and trains on one batch.
    prepare: ``prepare(consts, seeds, key) -> batch``: the batch's blocks and feature rows
      (`prepare`, jitted).
    compute: ``compute(model, optimizer, table_states, consts, batch) -> step's outputs``:
      gathers the batch's embedding rows and trains on it (the step without its data path).
    pipelined: ``pipelined(model, optimizer, table_states, consts, batch, seeds_next,
      key_next) -> step's outputs + (next batch,)``: `compute` on `batch`, and the next batch
      prepared in the same program. It computes exactly what `step` computes: the prepared
      rows are read only, and the embedding rows are gathered inside the step, after the
      previous step's table updates.
  """

  step: Callable
  prepare: Callable
  compute: Callable
  pipelined: Callable


def make_steps(
  data: HostData,
  labels: jax.Array,
  fanouts: Sequence[int],
  dense,
  table_opt,
  plan: Sequence | None = None,
) -> Steps:
  """The jitted steps that train a model on `data`'s mini-batches: cross entropy of the valid
  seeds against `labels` (by global node id), the parameters `dense` selects (an nnx filter)
  updated by the caller's `nnx.Optimizer`, each embedding table by `table_opt` (a
  `host.sparse` optimizer; its states are the steps' `table_states`)."""
  fanouts = tuple(int(f) for f in fanouts)

  def train_on(model, optimizer, table_states, seeds, blocks, xs):
    def loss_fn(model, learned):
      total, (correct, count) = summed_loss(
        model, data, blocks, xs, learned, seeds, labels[jnp.maximum(seeds, 0)], plan
      )
      return total / jnp.maximum(count, 1), (correct, count)

    grad_fn = nnx.value_and_grad(loss_fn, argnums=(nnx.DiffState(0, dense), 1), has_aux=True)
    (loss, (correct, count)), (grads, row_grads) = grad_fn(model, [xs[t] for t in data.embedded])
    optimizer.update(model, grads)
    token = update_tables(data, table_opt, table_states, blocks, row_grads)
    return loss * count, correct, count, token  # summed loss: epochs add them up

  @nnx.jit
  def step(model, optimizer, table_states, consts, seeds, key):
    blocks, xs = sample(data, consts, seeds, fanouts, key)
    return train_on(model, optimizer, table_states, seeds, blocks, xs)

  @jax.jit
  def prepare_batch(consts, seeds, key):
    return prepare(data, consts, seeds, fanouts, key)

  @nnx.jit
  def compute(model, optimizer, table_states, consts, batch):
    return train_on(model, optimizer, table_states, *complete(data, consts, batch))

  @nnx.jit
  def pipelined(model, optimizer, table_states, consts, batch, seeds_next, key_next):
    batch_next = prepare_batch(consts, seeds_next, key_next)
    out = train_on(model, optimizer, table_states, *complete(data, consts, batch))
    return (*out, batch_next)

  return Steps(step, prepare_batch, compute, pipelined)


def sharded_steps(
  data: HostData,
  labels: np.ndarray,
  fanouts: Sequence[int],
  model,
  optimizer,
  dense,
  table_opt,
  table_states,
  mesh,
  batch_size: int,
) -> common.ShardedSteps:
  """Data-parallel mini-batch training over `mesh` (`common.ShardedSteps`): `batch_size` seeds
  per device, each device sampling its share; gradients of the summed cross entropy summed over
  the mesh in one all-reduce and divided by the global count of valid seeds (the one-device
  step's mean). Each table update runs with ``axis_name`` and ``copies=jax.process_count()``
  (`host.sparse`): every process's copy receives every row."""
  axis = common.MESH_AXIS
  fanouts = tuple(int(f) for f in fanouts)
  copies = jax.process_count()

  def batch_of(consts, seeds, key):
    blocks, xs = sample(data, consts, seeds, fanouts, key)
    return blocks, xs, consts["labels"][jnp.maximum(seeds, 0)]

  def train_on(model, optimizer, consts, seeds, key):
    blocks, xs, y = batch_of(consts, seeds, key)
    loss_fn = lambda model, learned: summed_loss(  # noqa: E731
      model, data, blocks, xs, learned, seeds, y
    )
    grad_fn = nnx.value_and_grad(loss_fn, argnums=(nnx.DiffState(0, dense), 1), has_aux=True)
    (total, (correct, count)), (grads, row_grads) = grad_fn(model, [xs[t] for t in data.embedded])
    total, correct, count, grads = common.psum_flat((total, correct, count, grads), axis)
    scale = lambda g: g / jnp.maximum(count, 1)  # noqa: E731
    optimizer.update(model, jax.tree.map(scale, grads))
    token = update_tables(
      data, table_opt, table_states, blocks, map(scale, row_grads), axis_name=axis, copies=copies
    )
    return total, correct, count, token

  def correct_of(model, consts, seeds, key):
    blocks, xs, y = batch_of(consts, seeds, key)
    return hits(*logits_of(model, data, blocks, xs, seeds), y)

  consts = dict(data.consts, labels=np.asarray(labels, np.int32))
  return common.ShardedSteps(model, optimizer, consts, mesh, batch_size, train_on, correct_of)


def train(
  dataset: MagDataset,
  config: TrainConfig,
  minibatch: MinibatchConfig = MinibatchConfig(),
  *,
  plan: Sequence | BlockPlanner | None = None,
  on_epoch: Callable[[dict], None] | None = None,
  on_batch: Callable[[int, int], None] | None = None,
  final_evaluation: str | None = None,
  validate: bool = True,
) -> TrainResult:
  """Trains `config.model` (RGAT or HGT) on mini-batches of training papers.

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
  (`config.devices` per process; None: all); no `prefetch` and no `plan` there. Every process
  evaluates on its own copy of the trained model.
  """
  if len(minibatch.fanouts) != config.layers:
    raise ValueError(
      f"train: {len(minibatch.fanouts)} fanouts for {config.layers} layers "
      f"(give one fanout per layer)"
    )
  mesh = None
  if config.devices != 1 or jax.process_count() > 1:  # data parallel (sharded_steps)
    if minibatch.prefetch:
      raise ValueError("train: prefetch runs on one device of one process (devices=1)")
    if plan is not None:
      raise ValueError("train: an offload plan runs on one device of one process (devices=1)")
    mesh = common.device_mesh(config.devices, what="train")
  if final_evaluation is None:
    final_evaluation = "full" if minibatch.device_bytes is None else "minibatch"
  if final_evaluation not in ("full", "minibatch", "none"):
    raise ValueError(
      f"final_evaluation must be 'full', 'minibatch' or 'none', got {final_evaluation!r}"
    )
  model = build_model(dataset, config, nnx.Rngs(config.seed), tables=False)
  embeddings = dict(
    zip(
      model.embedded,
      initial_embeddings(
        [len(dataset.features[t]) for t in model.embedded], config.embed_dim, config.seed
      ),
    )
  )
  # Embedding tables train in host memory (a sparse optimizer), the rest with optax Adam.
  dense = nnx.All(nnx.Param, nnx.Not(is_table))
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
  papers = dataset.node_range("paper")
  labels = jnp.asarray(dataset.labels)
  with HostData(
    dataset,
    minibatch.pipeline,
    cache=minibatch.cache,
    embeddings=embeddings,
    cache_bytes=cache_bytes,
  ) as data:
    embeddings.clear()  # the host tables hold copies
    table_states = [table_opt.init(data.tables[t]) for t in data.embedded]
    if callable(plan):  # measured on a sampled batch: every batch has its padded shapes
      first = jnp.asarray(
        common.seed_batches(
          np.asarray(dataset.train_papers) + papers[0], minibatch.batch_size, limit=1
        )[0]
      )
      blocks, _ = jax.jit(lambda c, s, k: sample(data, c, s, fanouts, k))(
        data.consts, first, jax.random.key(config.seed)
      )
      plan = plan(model, blocks, node_types(data.type_offsets, blocks.nodes[-1]))
    if plan is not None:
      plan = tuple(plan)
      if len(plan) != model.stack_layers:
        raise ValueError(
          f"train: the plan has {len(plan)} policies for the model's "
          f"{model.stack_layers} planned layers"
        )

    sharded = (
      None
      if mesh is None
      else sharded_steps(
        data,
        dataset.labels,
        fanouts,
        model,
        optimizer,
        dense,
        table_opt,
        table_states,
        mesh,
        minibatch.batch_size,
      )
    )
    steps = make_steps(data, labels, fanouts, dense, table_opt, plan=plan)

    @nnx.jit
    def predict(model, consts, seeds, key):
      return hits(*forward(model, data, consts, seeds, fanouts, key), labels[jnp.maximum(seeds, 0)])

    def accuracy(ids, key) -> float:
      if sharded is not None:
        return sharded.accuracy(np.asarray(ids) + papers[0], key)
      return common.sampled_accuracy(
        lambda s, k: predict(model, data.consts, s, k),
        np.asarray(ids) + papers[0],
        minibatch.batch_size,
        key,
      )

    rng = np.random.default_rng(config.seed)
    key, val_key, test_key = jax.random.split(jax.random.key(config.seed), 3)
    history, start = [], time.perf_counter()
    for epoch in range(1, config.epochs + 1):
      rows = common.seed_batches(
        np.asarray(dataset.train_papers) + papers[0],
        minibatch.batch_size * (1 if mesh is None else mesh.size),
        rng,
        minibatch.max_batches,
      )
      if sharded is not None:
        record = dict(epoch=epoch, **sharded.epoch(rows, jax.random.fold_in(key, epoch), on_batch))
      elif minibatch.prefetch:  # batch i + 1 prepared while step i computes
        record = dict(
          epoch=epoch,
          **common.run_pipelined_epoch(
            lambda s, k: steps.prepare(data.consts, s, k),
            lambda b, s, k: steps.pipelined(model, optimizer, table_states, data.consts, b, s, k),
            rows,
            jax.random.fold_in(key, epoch),
            on_batch,
          ),
        )
      else:
        record = dict(
          epoch=epoch,
          **common.run_epoch(
            lambda s, k: steps.step(model, optimizer, table_states, data.consts, s, k),
            rows,
            jax.random.fold_in(key, epoch),
            on_batch,
          ),
        )
      record["device_state_bytes"] = device_bytes_of(
        nnx.state((model, optimizer)) if sharded is None else sharded.state
      )
      record["cache_bytes"] = data.cache_bytes
      record["cache_fraction"] = data.cache_fraction
      if validate:
        record["val_accuracy"] = accuracy(dataset.val_papers, jax.random.fold_in(val_key, epoch))
      common.add_record(history, record, on_epoch)
    if final_evaluation == "minibatch":
      final = {
        "val_accuracy": accuracy(dataset.val_papers, jax.random.fold_in(val_key, 0)),
        "test_accuracy": accuracy(dataset.test_papers, test_key),
      }
    if sharded is not None:
      sharded.finish()
    # The trained embeddings back into the model, as host arrays: its checkpoint is a
    # full-graph one.
    model.set_tables([data.tables[t].as_numpy().copy() for t in data.embedded])
    for t in data.embedded:  # several processes: every copy received every row update
      common.check_copies_agree(data.tables[t].as_numpy(), dataset.graph.node_type_names[t])
    for state in table_states:
      sparse.close(state)
  if final_evaluation == "full":
    final = evaluate(model, dataset)
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
    None if data.embedded else optimizer,
    plan,
    metrics_note=note,
  )
