"""Mini-batch GraphSAGE training on graphs in host memory: `jaxdata train sage`.

Three pipelines feed the same model and the same jitted update, so they can be compared:

- "host" (jaxdata's GPU-centric path): graph and features stay in pinned host memory; inside
  the jitted step the GPU samples the neighbourhood and gathers the features over PCIe,
  zero-copy, through a tree-sampling `jaxdata.loader.Loader` passed to the step. The host only
  dispatches: JAX's asynchronous dispatch queues the next steps while the GPU runs this one, so
  the next batch's sampling and gathering follow the current step with no host work in between.
- "device" (all-in-GPU): the same loader with ``pipeline="device"``: the CSR and features are
  device arrays; same kernels, same samples, only the memory differs. Needs the graph to fit.
- "cpu" (CPU-centric): a background thread samples and gathers on the CPU (jaxdata's CPU
  kernels on XLA's CPU thread pool) and `jax.device_put`s each batch, two batches ahead.

Several local devices train data-parallel (`shard_map` over a 1-D mesh): the batch is split
across devices, each samples and gathers its part from the same host graph and tables with its
own key, and gradients are averaged. With several processes (`jaxdata.distributed`, e.g.
`jaxdata launch -n 2 -- train sage --devices 0`) the mesh spans every process's devices: each
process holds its own graph and tables, draws the same global batches, samples only its own
devices' shares, and process 0 reports and saves (docs/distributed.md).

Learnable node embeddings (`embed_dim`): a `HostTable` of one `embed_dim`-wide row per node,
concatenated to the node's features at the model's input (concatenated rather than in place of
them: the features keep their signal and the model's other inputs stay as they were; in place
would only save a few columns). The table trains in host memory with a sparse optimizer
(`table_optimizer`, `jaxdata.host.sparse`; the learning rate is the model's): a step gathers
the rows its blocks touch, and the rows' gradients go back through `update(...,
axis_name="data")`. Each process keeps its own copy of the table; the update all-gathers the
global batch's (row, gradient) pairs over the whole mesh, so every copy applies every row, one
writer per copy, and the copies stay equal to one another and to a one-process run
(docs/distributed.md has the bytes this costs).

    from jaxdata.train.sage import SageConfig, train
    result = train(powerlaw_graph(), SageConfig(pipeline="host", epochs=3))
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdata import command, distributed
from jaxdata.data.powerlaw import powerlaw_graph
from jaxdata.host import HostGraph, HostTable, sample_neighbors, sparse
from jaxdata.loader import Loader
from jaxdata.nn import GraphSAGE
from jaxdata.tasks import checkpoint
from jaxdata.train.common import (
  TrainResult,
  add_out_argument,
  add_record,
  add_resume_arguments,
  check_copies_agree,
  check_fanouts,
  device_mesh,
  devices_flag,
  position,
  prefetched,
  progress,
  psum_flat,
  refuse_resuming,
  resumer,
  save_due,
  say_saved,
  seed_batches,
  sharded_jit,
)

PIPELINES = ("host", "device", "cpu")
#: `jaxdata train sage` runs as one of several processes (`jaxdata.distributed`).
MULTI_PROCESS = True


@dataclasses.dataclass(frozen=True)
class SageConfig:
  """What `train` does. `batch_size` is per device; `max_batches` cuts epochs short (benchmarks)."""

  pipeline: str = "host"
  fanouts: tuple[int, ...] = (15, 10)
  batch_size: int = 1024
  hidden: int = 256
  learning_rate: float = 3e-3
  epochs: int = 5
  seed: int = 0
  dtype: str = "float32"
  devices: int | None = 1  # per process; None: every local device of the platform
  platform: str | None = None  # "gpu", "cpu", ...; None: JAX's default backend
  max_batches: int | None = None
  eval_batches: int | None = None  # cap on evaluation batches (None: all)
  cache: float = 0.0  # "host": keep this fraction of the feature rows (most sampled) on device
  evaluate: bool = True  # validation accuracy after every epoch and test accuracy at the end
  embed_dim: int = 0  # learnable node embeddings this wide, concatenated to the features (0: none)
  table_optimizer: str = "adam"  # the sparse optimizer of the embeddings (jaxdata.host.sparse)

  def __post_init__(self):
    if self.pipeline not in PIPELINES:
      raise ValueError(f"SageConfig: pipeline must be one of {PIPELINES}, got {self.pipeline!r}")
    if not self.fanouts or any(int(f) < 1 for f in self.fanouts):
      raise ValueError(f"SageConfig: fanouts must be positive, got {self.fanouts}")
    if self.batch_size < 1 or self.epochs < 0 or self.hidden < 1:
      raise ValueError("SageConfig: batch_size and hidden must be >= 1, epochs >= 0")
    if not 0 <= self.cache <= 1:
      raise ValueError(f"SageConfig: cache must be a fraction in [0, 1], got {self.cache}")
    if self.dtype not in ("float32", "bfloat16"):
      raise ValueError(f"SageConfig: dtype must be float32 or bfloat16, got {self.dtype!r}")
    if self.embed_dim < 0:
      raise ValueError(f"SageConfig: embed_dim must be >= 0, got {self.embed_dim}")
    if self.table_optimizer not in sparse.BY_NAME:
      raise ValueError(
        f"SageConfig: table_optimizer must be one of {tuple(sparse.BY_NAME)}, "
        f"got {self.table_optimizer!r}"
      )
    if self.embed_dim and self.pipeline == "cpu":
      raise ValueError(
        "SageConfig: embed_dim needs pipeline host or device (the cpu pipeline "
        "gathers before the step, so its rows could not learn)"
      )


# ----------------------------------------------------------------------------- the model step


def _loss(model: GraphSAGE, feats, masks, labels, valid, embedded=None) -> tuple:
  """Summed cross-entropy and correct count over the `valid` seeds; `embedded`: per hop, the
  nodes' embedding rows, concatenated to their features."""
  if embedded is not None:
    feats = tuple(jnp.concatenate([f, e.astype(f.dtype)], -1) for f, e in zip(feats, embedded))
  logits = model(feats, masks).astype(jnp.float32)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  correct = (jnp.argmax(logits, -1) == labels) & valid
  return jnp.sum(jnp.where(valid, ce, 0.0)), correct.sum()


def _loader(graph: HostGraph, labels: np.ndarray, config: SageConfig) -> Loader:
  """The tree-sampling loader of the "host" and "device" pipelines."""
  return Loader(
    graph,
    fanouts=config.fanouts,
    features=graph.features,
    labels=labels,
    pipeline=config.pipeline,
    cache=config.cache,
    tree=True,
  )


def _mesh(config: SageConfig) -> Mesh:
  """The 1-D "data" mesh: `config.devices` devices (None: all) of the platform in each process,
  process by process, so that with several processes it spans every process's devices."""
  return device_mesh(config.devices, config.platform, what="SageConfig")


# ----------------------------------------------------------------------------- training


def train(
  dataset: Any,
  config: SageConfig = SageConfig(),
  *,
  graph: HostGraph | None = None,
  on_epoch: Callable[[dict], None] | None = None,
  on_batch: Callable[[int, int], None] | None = None,
  init: Any = None,
  embedding: np.ndarray | None = None,
  resume: Callable | None = None,
  save_every: int = 0,
  on_save: Callable[[TrainResult], None] | None = None,
) -> TrainResult:
  """Trains GraphSAGE on a node-classification dataset with mini-batches of sampled blocks.

  Args:
    dataset: a `jaxdata.data.powerlaw.NodeDataset`-like object (indptr, indices, features,
      labels, train/val/test_nodes, num_classes).
    config: the run.
    graph: the dataset as a HostGraph with features, if already made (else made here and closed
      at the end).
    on_epoch: called with each epoch's metrics.
    on_batch: called as on_batch(done, total) after each dispatched batch (progress bars).
    init: parameters to start from (`nnx.state(model, nnx.Param)` of a trained GraphSAGE of this
      configuration) instead of fresh ones; with `epochs=0`, `train` only evaluates them.
    embedding: with `config.embed_dim`, the embedding table to start from ([nodes, embed_dim]
      float32) instead of a fresh one (normal, standard deviation 0.1, from `config.seed`).
    resume: ``resume(params, opt_state) -> ((params, opt_state), history)``, a saved run's state
      (`common.resumer`); training goes on from the batch after its last record's ("batch" of
      "batches_per_epoch"), to the parameters a run never stopped would have.
    save_every, on_save: `on_save(result)` gets the run so far every `save_every` epochs.

  With `config.embed_dim`, `result.tables["embedding"]` is the trained table (NumPy); with
  several processes, `train` checks that every process's copy ended equal.
  """
  own_graph = graph is None
  if own_graph:
    graph = HostGraph(dataset.indptr, dataset.indices, features=dataset.features)
  try:
    saving = (resume, save_every, on_save)
    return _train(dataset, config, graph, on_epoch, on_batch, init, embedding, saving)
  finally:
    if own_graph:
      graph.close()


@contextlib.contextmanager
def lowered_step(dataset: Any, config: SageConfig, graph: HostGraph, rows: np.ndarray):
  """The training step of `config` (pipeline host or device) on one device, lowered for the
  seed batches `rows` (int32 [batches, batch_size]), and ``call(program)``: runs a compiled
  program of it on the next row (the last row again once past it), the model's state carried
  from call to call; returns that step's summed loss. What `jaxdata bench minibatch
  --breakdown` times and profiles."""
  if config.pipeline == "cpu":
    raise ValueError("lowered_step: the cpu pipeline's step takes batches, not seeds")
  mesh = _mesh(dataclasses.replace(config, devices=1))
  labels = np.asarray(dataset.labels).astype(np.int32)
  loader = _loader(graph, labels, config)
  try:
    programs = _steps(dataset, config, graph, mesh, loader, labels, None, None, None)
    whole = NamedSharding(mesh, P())
    seeds = distributed.put(np.asarray(rows, np.int32), NamedSharding(mesh, P(None, "data")))
    key = distributed.put(jax.random.key(config.seed), whole)
    state = [programs.params, programs.opt_state, distributed.put(np.int32(0), whole)]
    lowered = programs.step.lower(*state[:2], *programs.consts, seeds, state[2], key)

    def call(program):
      params, opt_state, i, (total, _, _) = program(
        *state[:2], *programs.consts, seeds, state[2], key
      )
      state[:] = params, opt_state, i
      return total

    yield lowered, call
  finally:
    loader.close()


def initial_embedding(num_nodes: int, config: SageConfig) -> np.ndarray:
  """The embedding table a run starts from: normal, standard deviation 0.1, from the seed (the
  same in every process)."""
  rng = np.random.default_rng([config.seed, 1])
  return (0.1 * rng.standard_normal((num_nodes, config.embed_dim))).astype(np.float32)


def _train(dataset, config, graph, on_epoch, on_batch, init, embedding, saving) -> TrainResult:
  if not config.embed_dim:
    return _train_with(dataset, config, graph, on_epoch, on_batch, init, None, None, saving)
  if saving[0] is not None or saving[1]:
    raise ValueError("train: resume and save_every are for runs without embeddings")
  if embedding is None:
    embedding = initial_embedding(graph.num_nodes, config)
  embedding = np.asarray(embedding)
  if embedding.shape != (graph.num_nodes, config.embed_dim):
    raise ValueError(
      f"train: embedding must have shape {(graph.num_nodes, config.embed_dim)} "
      f"(nodes, embed_dim), got {embedding.shape}"
    )
  table_opt = sparse.BY_NAME[config.table_optimizer](config.learning_rate)
  with HostTable(embedding.astype(np.float32)) as table:
    state = table_opt.init(table)
    try:
      result = _train_with(
        dataset, config, graph, on_epoch, on_batch, init, table, (table_opt, state), saving
      )
    finally:
      sparse.close(state)
    result.tables = {"embedding": np.array(table.as_numpy())}
  check_copies_agree(result.tables["embedding"], "embedding")
  return result


def _train_with(
  dataset, config, graph, on_epoch, on_batch, init, table, table_opt, saving
) -> TrainResult:
  if graph.features is None:
    raise ValueError("train: the graph has no node features")
  if graph.num_nodes != len(dataset.labels):
    raise ValueError(f"train: {len(dataset.labels)} labels for a graph of {graph.num_nodes} nodes")
  mesh = _mesh(config)
  if config.pipeline == "cpu" and jax.process_count() > 1:
    raise ValueError(
      "train: the cpu pipeline runs in one process only; use pipeline host or "
      "device with several processes"
    )
  labels = np.asarray(dataset.labels).astype(np.int32)
  loader = None if config.pipeline == "cpu" else _loader(graph, labels, config)
  try:
    args = (labels, on_epoch, on_batch, init, table, table_opt, saving)
    return _train_loop(dataset, config, graph, mesh, loader, *args)
  finally:
    if loader is not None:
      loader.close()


def _steps(dataset, config, graph, mesh, loader, labels, init, table, table_opt):
  """A run's jitted programs and starting state: `step` (params, opt_state, *consts, ...) and
  `evaluate_batch`, the initial `params` and `opt_state` (placed on the mesh), the `consts` the
  loader's pipelines pass, and `cpu_batches` for the cpu pipeline."""
  cpu_batches = None
  dtype = jnp.bfloat16 if config.dtype == "bfloat16" else jnp.float32
  model = GraphSAGE(
    graph.features.shape[1] + config.embed_dim,
    config.hidden,
    dataset.num_classes,
    num_layers=len(config.fanouts),
    dtype=dtype,
    rngs=nnx.Rngs(config.seed),
  )
  graphdef, params = nnx.split(model, nnx.Param)
  if init is not None:
    params = init
  tx = optax.adam(config.learning_rate)
  opt_state = tx.init(params)
  fanouts = tuple(int(f) for f in config.fanouts)
  replicated = NamedSharding(mesh, P())
  params, opt_state = distributed.put((params, opt_state), replicated)

  def grads_of(params, feats, masks, labels, valid, embedded=None):
    def f(p, e):
      total, correct = _loss(nnx.merge(graphdef, p), feats, masks, labels, valid, e)
      return total, correct

    (total, correct), (grads, row_grads) = jax.value_and_grad(f, (0, 1), has_aux=True)(
      params, embedded
    )
    count = valid.sum()
    # Averages over the whole (global) batch: sums then one division. The sums travel as one
    # flat float32 vector, so a step makes one all-reduce, not one per leaf and dtype: on two
    # H200s each collective costs the step a host-side rendezvous.
    total, correct, count, grads = psum_flat((total, correct, count, grads), "data")
    scale = lambda g: g / jnp.maximum(count, 1)  # noqa: E731
    return jax.tree.map(scale, grads), jax.tree.map(scale, row_grads), total, correct, count

  def update_table(blocks, row_grads):
    """The embedding rows' update (every copy gets every row); returns its token, 0 once every
    device's writes are done (so the next step's reads see them)."""
    opt, state = table_opt
    rows = table.shape[0]
    ids = jnp.concatenate([jnp.where(m, n, rows) for n, m in zip(blocks.nodes, blocks.masks)])
    token = opt.update(table, state, ids, jnp.concatenate(row_grads), axis_name="data")
    return jax.lax.psum(token, "data")

  def apply(params, opt_state, grads):
    with jax.named_scope("optimizer"):
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

  def shard(fn, in_specs, out_specs):
    # check_vma off: each device's gradients stay its own and psum_flat sums them once (with
    # it on, JAX's transpose already summed the replicated parameters' gradients, and the
    # psum made them K times too large; Adam's scale invariance hid it).
    return sharded_jit(fn, mesh, in_specs, out_specs)

  metrics_spec = (P(), P(), P())
  if config.pipeline in ("host", "device"):
    # One dispatch per step: the epoch's seeds are on the device and the step picks its row
    # and derives its key from a step counter it carries, so the host issues nothing else (with
    # several devices, every extra dispatch costs the host more than the step itself).
    def sampled(loader, rows, i, key):
      seeds = jax.lax.dynamic_index_in_dim(rows, i, keepdims=False)
      key = jax.random.fold_in(jax.random.fold_in(key, i), jax.lax.axis_index("data"))
      batch = loader.sample(seeds, key)
      with jax.named_scope("gathers"):
        embedded = None if table is None else batch.blocks.gather(table, unique=True)
      return batch, embedded

    def device_step(params, opt_state, loader, rows, i, key):
      batch, embedded = sampled(loader, rows, i, key)
      grads, row_grads, total, correct, count = grads_of(
        params, batch.inputs, batch.blocks.masks, batch.labels, batch.mask, embedded
      )
      params, opt_state = apply(params, opt_state, grads)
      if table is not None:  # the token is 0: the next step's counter waits for the writes
        i = i + update_table(batch.blocks, row_grads)
      return params, opt_state, i + 1, (total, correct, count)

    step = shard(
      device_step, (P(), P(), P(), P(None, "data"), P(), P()), (P(), P(), P(), metrics_spec)
    )
    step_consts = (distributed.put(loader, replicated),)

    def device_eval(params, loader, rows, i, key):
      batch, embedded = sampled(loader, rows, i, key)
      model = nnx.merge(graphdef, params)
      _, correct = _loss(
        model, batch.inputs, batch.blocks.masks, batch.labels, batch.mask, embedded
      )
      return i + 1, jax.lax.psum((correct, batch.mask.sum()), "data")

    evaluate_batch = shard(device_eval, (P(), P(), P(None, "data"), P(), P()), (P(), (P(), P())))
  else:

    def cpu_step(params, opt_state, feats, masks, labels):
      grads, _, total, correct, count = grads_of(params, feats, masks, labels, masks[0])
      params, opt_state = apply(params, opt_state, grads)
      return params, opt_state, (total, correct, count)

    data = P("data")
    step = shard(cpu_step, (P(), P(), data, data, data), (P(), P(), metrics_spec))

    def cpu_eval(params, feats, masks, labels):
      _, correct = _loss(nnx.merge(graphdef, params), feats, masks, labels, masks[0])
      return jax.lax.psum((correct, masks[0].sum()), "data")

    evaluate_batch = shard(cpu_eval, (P(), data, data, data), (P(), P()))
    step_consts = ()
    cpu_batches = _CpuBatches(graph, labels, fanouts, mesh)

  return types.SimpleNamespace(
    step=step,
    evaluate_batch=evaluate_batch,
    params=params,
    opt_state=opt_state,
    consts=step_consts,
    cpu_batches=cpu_batches,
    graphdef=graphdef,
  )


def _train_loop(
  dataset, config, graph, mesh, loader, labels, on_epoch, on_batch, init, table, table_opt, saving
) -> TrainResult:
  ndev = mesh.devices.size
  replicated = NamedSharding(mesh, P())
  programs = _steps(dataset, config, graph, mesh, loader, labels, init, table, table_opt)
  step, evaluate_batch = programs.step, programs.evaluate_batch
  params, opt_state, step_consts = programs.params, programs.opt_state, programs.consts
  cpu_batches, graphdef = programs.cpu_batches, programs.graphdef
  batch = config.batch_size * ndev
  seed_sharding = NamedSharding(mesh, P(None, "data"))
  rng = np.random.default_rng(config.seed)
  key, eval_key, test_key = jax.random.split(jax.random.key(config.seed), 3)

  def run_batches(seed_rows: np.ndarray, epoch_key, fn, *state, start: int = 0):
    """Runs fn over the rows of seeds from row `start`; returns the final state, the summed
    metrics and the number of rows run."""
    sums = []
    if config.pipeline == "cpu":
      stream = cpu_batches.stream(seed_rows, epoch_key, start)
      for i, inputs in enumerate(stream, start):
        out = fn(*state, *inputs)
        state, m = (out[:-1], out[-1]) if state else ((), out)
        sums.append(m)
        if on_batch:
          on_batch(i + 1, len(seed_rows))
        if state and command.stop_requested():  # training (not evaluating): stop after this step
          break
    else:
      # Everything a step takes already placed as the step wants it: an argument on the wrong
      # devices is resharded at every call, off JAX's fast dispatch path.
      rows = distributed.put(seed_rows, seed_sharding)
      i = distributed.put(np.int32(start), replicated)
      epoch_key = distributed.put(epoch_key, replicated)
      for n in range(start, len(seed_rows)):
        *state, i, m = fn(*state, *step_consts, rows, i, epoch_key)
        sums.append(m)
        if on_batch:
          on_batch(n + 1, len(seed_rows))
        if state and command.stop_requested():
          break
    totals = [float(sum(np.asarray(x) for x in col)) for col in zip(*sums)] if sums else []
    return tuple(state), totals, len(sums)

  def accuracy(nodes: np.ndarray, epoch_key) -> float:
    rows = seed_batches(nodes, batch, None, config.eval_batches)
    _, (correct, count), _ = run_batches(rows, epoch_key, lambda *a: evaluate_batch(params, *a))
    return correct / max(count, 1)

  resume, save_every, on_save = saving
  history = []
  if resume is not None:
    (params, opt_state), history = resume(params, opt_state)
    params, opt_state = distributed.put((params, opt_state), replicated)
  first_epoch, first_batch = position(history)
  start = time.perf_counter()
  for epoch in range(config.epochs):
    # every epoch's seed order is drawn, so that a resumed run's order is the same
    rows = seed_batches(dataset.train_nodes, batch, rng, config.max_batches)
    if epoch + 1 < first_epoch:
      continue
    skip = first_batch if epoch + 1 == first_epoch else 0
    t0 = time.perf_counter()
    (params, opt_state), (total, correct, count), done = run_batches(
      rows, jax.random.fold_in(key, epoch), step, params, opt_state, start=skip
    )
    seconds = time.perf_counter() - t0
    record = dict(
      epoch=epoch + 1,
      loss=total / max(count, 1),
      train_accuracy=correct / max(count, 1),
      seconds=seconds,
      batches=done,
      batch=skip + done,
      batches_per_epoch=len(rows),
      seeds_per_second=count / seconds,
    )
    if config.evaluate and len(dataset.val_nodes):
      record["val_accuracy"] = accuracy(dataset.val_nodes, jax.random.fold_in(eval_key, epoch))
    add_record(history, record, on_epoch)
    if command.stop_requested():  # SIGTERM: the last completed step ends the run
      break
    if on_save is not None and save_due(save_every, epoch + 1, config.epochs):
      model = nnx.merge(graphdef, distributed.local_value(params))
      now = {"test_accuracy": float("nan")}  # measured at the end
      on_save(TrainResult(model, history, now, 0.0, distributed.local_value(opt_state)))
  test = (
    accuracy(dataset.test_nodes, test_key)
    if config.evaluate and len(dataset.test_nodes)
    else float("nan")
  )
  # Replicated over the mesh: each process reads its own copy (no collective).
  model = nnx.merge(graphdef, distributed.local_value(params))
  return TrainResult(
    model,
    history,
    {"test_accuracy": test},
    time.perf_counter() - start,
    distributed.local_value(opt_state),
  )


#: The entries of a data description (`load_dataset`).
DATA_ENTRIES = {
  "source": str,
  "nodes": int,
  "edges": int,
  "features": int,
  "classes": int,
  "seed": int,
}


def load_dataset(data: dict, features_out: np.ndarray | None = None):
  """The synthetic power-law graph a data description names ({"nodes", "edges", "features",
  "classes", "seed"}); features written into `features_out` where given (a HostTable's memory)."""

  return powerlaw_graph(
    num_nodes=data["nodes"],
    num_edges=data["edges"],
    feature_dim=data["features"],
    num_classes=data["classes"],
    seed=data["seed"],
    features_out=features_out,
  )


#: The checkpoint's key, beside the model's parameters, of a learned embedding table.
EMBEDDING = "host_embedding"


def save(path: str, result: TrainResult, config: SageConfig, data: dict) -> str:
  """Saves a trained GraphSAGE as a checkpoint (`jaxdata.tasks.checkpoint`); a learned
  embedding table goes with the parameters (`EMBEDDING`), without its sparse optimizer's state
  (so such a checkpoint is not resumable)."""
  params = nnx.to_pure_dict(nnx.state(result.model, nnx.Param))
  embedded = bool(result.tables and "embedding" in result.tables)
  if embedded:
    params = {**params, EMBEDDING: result.tables["embedding"]}
  # The mesh it trained on: its sampled metrics split each batch over that many devices.
  local = config.devices or len(jax.local_devices(backend=config.platform))
  return checkpoint.save(
    path,
    kind="sage",
    params=params,
    optimizer_state=None if embedded else result.optimizer,
    config=dict(dataclasses.asdict(config), mesh=[jax.process_count(), local]),
    data=data,
    step=sum(r["batches"] for r in result.history),
    history=result.history,
    metrics={"test_accuracy": result.test_accuracy},
  )


def _resumer(path: str | None, config: SageConfig, data: dict):
  """`common.resumer` for a GraphSAGE checkpoint of one device: ``resume(params, opt_state)``
  returns the saved ones (host arrays) and the history."""

  def saved_config(meta: dict) -> SageConfig:
    saved = dict(meta["config"])
    saved.pop("unique", None)  # checkpoints from before the loader
    mesh = saved.pop("mesh", None)
    if mesh not in (None, [1, 1]):
      raise ValueError(f"was trained on {mesh[0]} process(es) x {mesh[1]} devices, not one")
    return checkpoint.config_from(SageConfig, saved)

  def restore_run(meta: dict, params, opt_state):
    params, opt_state = jax.device_get((params, opt_state))
    target = {"params": nnx.to_pure_dict(params), "optimizer": opt_state}
    state = checkpoint.restore_state(path, target, meta.get("digests"))
    nnx.replace_by_pure_dict(params, state["params"])
    return params, state["optimizer"]

  return resumer(
    path, kind="sage", config=config, data=data, saved_config=saved_config, restore=restore_run
  )


def restore(path: str, meta: dict):
  """Rebuilds a saved GraphSAGE and its graph (`jaxdata.tasks.checkpoint.load_model`).
  `evaluate()` samples the test seeds' neighbourhoods with the run's own keys over a mesh of as
  many devices as training had (whatever the processes were: a run of 2 processes x 2 devices
  is measured again by one process of 4), so it measures the test accuracy training measured;
  ValueError where this process has fewer devices than that."""
  saved = dict(meta["config"])
  saved.pop("unique", None)  # checkpoints from before the loader (feature rows always read once)
  processes, per_process = checkpoint.json_value(
    saved.pop("mesh", None) or [1, saved.get("devices") or 1],
    tuple[int, ...],
    "the configuration's 'mesh'",
  )
  config = checkpoint.config_from(SageConfig, saved)
  dataset = load_dataset(
    checkpoint.check_entries(meta["data"], DATA_ENTRIES, "a GraphSAGE checkpoint")
  )
  dtype = jnp.bfloat16 if config.dtype == "bfloat16" else jnp.float32
  model = GraphSAGE(
    dataset.features.shape[1] + config.embed_dim,
    config.hidden,
    dataset.num_classes,
    num_layers=len(config.fanouts),
    dtype=dtype,
    rngs=nnx.Rngs(config.seed),
  )
  params = nnx.state(model, nnx.Param)
  target = {"params": nnx.to_pure_dict(params)}
  if config.embed_dim:
    target["params"][EMBEDDING] = np.zeros((dataset.num_nodes, config.embed_dim), np.float32)
  if meta.get("has_optimizer"):
    target["optimizer"] = optax.adam(config.learning_rate).init(params)
  state = checkpoint.restore_state(path, target, meta.get("digests"))
  embedding = state["params"].pop(EMBEDDING, None)
  nnx.replace_by_pure_dict(params, state["params"])
  nnx.update(model, params)

  def evaluate() -> dict:
    total, visible = processes * per_process, len(jax.local_devices(backend=config.platform))
    if total > visible:
      raise ValueError(
        f"load_model: {path}: this GraphSAGE was trained and measured on a mesh of {total} "
        f"devices ({processes} process(es) x {per_process}); its sampled evaluation splits "
        f"each batch over that many devices, but this process sees {visible} (on the CPU: "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={total})"
      )
    result = train(
      dataset,
      dataclasses.replace(config, epochs=0, devices=total),
      init=nnx.state(model, nnx.Param),
      embedding=embedding,
    )
    return {"test_accuracy": result.test_accuracy}

  def predict(nodes=None, *, key=None, batch_size: int = 1024) -> np.ndarray:
    """Predicted classes of `nodes` (default: every node), each node's neighbourhood sampled
    with the run's fanouts (without replacement: a node of degree <= fanout keeps all of its
    neighbours) from `key` (default: the run's seed), on the CPU, `batch_size` seeds at a time."""
    n = dataset.num_nodes
    nodes = np.arange(n) if nodes is None else np.asarray(nodes)
    if nodes.ndim != 1 or nodes.dtype.kind not in "iu":
      raise TypeError(
        f"predict: nodes must be a 1-D array of integer node ids, got "
        f"{nodes.dtype} of shape {nodes.shape}"
      )
    if nodes.size and (nodes.min() < 0 or nodes.max() >= n):
      raise ValueError(f"predict: node ids must be in [0, {n}), got {nodes.min()}..{nodes.max()}")
    if batch_size < 1:
      raise ValueError(f"predict: batch_size must be >= 1, got {batch_size}")
    features = np.asarray(dataset.features)
    if embedding is not None:
      features = np.concatenate([features, embedding.astype(features.dtype)], axis=1)
    cpu = jax.devices("cpu")[0]
    graphdef, state = nnx.split(model)
    key = jax.random.key(config.seed) if key is None else key
    out = np.empty(len(nodes), np.int32)
    with (
      jax.default_device(cpu),
      HostGraph(dataset.indptr, dataset.indices, features=features) as graph,
    ):

      @jax.jit
      def batch(state, seeds, key):
        blocks = sample_neighbors(graph, seeds, config.fanouts, key)
        logits = nnx.merge(graphdef, state)(blocks.gather(graph.features), blocks.masks)
        return jnp.argmax(logits, -1)

      state = jax.device_put(state, cpu)
      for i, start in enumerate(range(0, len(nodes), batch_size)):
        part = nodes[start : start + batch_size]
        seeds = np.full(batch_size, -1, np.int32)
        seeds[: len(part)] = part
        out[start : start + len(part)] = np.asarray(
          batch(state, seeds, jax.random.fold_in(key, i))
        )[: len(part)]
    return out

  return checkpoint.Loaded(
    "sage",
    model,
    meta,
    evaluate=evaluate,
    predict=predict,
    optimizer_state=state.get("optimizer"),
    tables=None if embedding is None else {"embedding": embedding},
  )


class _CpuBatches:
  """The CPU-centric feed: sample and gather on the CPU, device_put, two batches ahead."""

  def __init__(self, graph: HostGraph, labels: np.ndarray, fanouts, mesh: Mesh, depth: int = 2):
    self.cpu = jax.devices("cpu")[0]
    self.graph, self.labels, self.fanouts, self.depth = graph, labels, fanouts, depth
    self.sharding = NamedSharding(mesh, P("data"))

    def prepare(seeds, key):
      blocks = sample_neighbors(graph, seeds, fanouts, key)
      return blocks.gather(graph.features), blocks.masks

    self.prepare = jax.jit(prepare)

  def one(self, seeds: np.ndarray, key) -> tuple:
    ndev = self.sharding.mesh.devices.size
    parts = np.split(seeds, ndev)  # each device's share samples with its own key, like "host"
    feats, masks = [], []
    for d, part in enumerate(parts):
      f, m = self.prepare(
        jax.device_put(part, self.cpu), jax.device_put(jax.random.fold_in(key, d), self.cpu)
      )
      feats.append(f)
      masks.append(m)
    # Per hop, concatenate the devices' shares on the host, then one transfer per array.
    feats = tuple(np.concatenate([np.asarray(f[h]) for f in feats]) for h in range(len(feats[0])))
    masks = tuple(np.concatenate([np.asarray(m[h]) for m in masks]) for h in range(len(masks[0])))
    labels = self.labels[np.maximum(seeds, 0)]
    return jax.device_put((feats, masks, labels), self.sharding)

  def stream(self, rows: np.ndarray, epoch_key, start: int = 0) -> Iterator[tuple]:
    """Batches `rows[start:]`, batch i's key ``fold_in(epoch_key, i)``."""
    cpu_key = jax.device_put(epoch_key, self.cpu)
    batches = enumerate(rows[start:], start)
    return prefetched((self.one(s, jax.random.fold_in(cpu_key, i)) for i, s in batches), self.depth)


# ----------------------------------------------------------------------------- the CLI


def add_arguments(parser):
  """`jaxdata train sage` options."""
  parser.add_argument(
    "--pipeline",
    choices=PIPELINES,
    default="host",
    help="host: GPU samples and gathers from host memory (jaxdata); device: "
    "all in device memory; cpu: CPU samples and gathers, device_put",
  )
  parser.add_argument(
    "--nodes", type=command.integer(1, 2**31 - 1), default=100_000, help="synthetic graph: nodes"
  )
  parser.add_argument(
    "--edges", type=command.positive_int, default=2_000_000, help="synthetic graph: edges"
  )
  parser.add_argument(
    "--features", type=command.positive_int, default=64, help="synthetic graph: feature size"
  )
  parser.add_argument(
    "--classes", type=command.positive_int, default=8, help="synthetic graph: classes"
  )
  parser.add_argument(
    "--fanouts",
    type=command.listing(command.positive_int),
    default=[15, 10],
    help="neighbours sampled per hop, comma-separated",
  )
  parser.add_argument(
    "--batch-size", type=command.positive_int, default=1024, help="seeds per device per step"
  )
  parser.add_argument("--hidden", type=command.positive_int, default=256, help="hidden features")
  parser.add_argument(
    "--lr", type=command.positive_float, default=3e-3, help="Adam's learning rate"
  )
  parser.add_argument("--epochs", type=command.positive_int, default=5, help="training epochs")
  parser.add_argument(
    "--devices",
    type=command.natural_int,
    default=1,
    help="data-parallel over this many local devices (0: all)",
  )
  parser.add_argument(
    "--dtype",
    choices=("float32", "bfloat16"),
    default="float32",
    help="compute dtype (parameters stay float32)",
  )
  parser.add_argument("--seed", type=command.seed, default=0, help="seed of data and model")
  add_out_argument(parser, "sage")
  add_resume_arguments(parser)
  parser.add_argument(
    "--cache",
    type=command.fraction,
    default=0.0,
    help="host pipeline: keep this fraction of the feature rows (the most "
    "sampled) in device memory",
  )
  parser.add_argument(
    "--embed-dim",
    type=command.natural_int,
    default=0,
    help="learnable node embeddings this wide in host memory, concatenated to "
    "the features (0: none)",
  )
  parser.add_argument(
    "--table-optimizer",
    choices=tuple(sparse.BY_NAME),
    default="adam",
    help="--embed-dim: the sparse optimizer of the embedding table (lazy Adam "
    "by default; the learning rate is --lr)",
  )


def main(args) -> int:
  console = command.console()
  console.quiet = not distributed.is_primary()  # one process reports for the job
  try:
    config = SageConfig(
      pipeline=args.pipeline,
      fanouts=tuple(args.fanouts),
      batch_size=args.batch_size,
      hidden=args.hidden,
      learning_rate=args.lr,
      epochs=args.epochs,
      seed=args.seed,
      dtype=args.dtype,
      devices=devices_flag(args.devices),
      cache=args.cache,
      embed_dim=args.embed_dim,
      table_optimizer=args.table_optimizer,
    )
  except ValueError as e:  # settings the flags' own checks cannot see (--embed-dim with cpu)
    raise command.UsageError(str(e)) from None
  if args.cache and args.pipeline != "host":
    raise command.UsageError(
      f"argument --cache: a device cache of feature rows is for "
      f"--pipeline host; --pipeline {args.pipeline} would ignore it"
    )
  if args.classes > args.nodes:
    raise command.UsageError(
      f"argument --nodes: {args.nodes} nodes cannot hold --classes "
      f"{args.classes} (every class needs a node)"
    )
  check_fanouts(config.fanouts, config.batch_size)
  devices = (config.devices or len(jax.local_devices())) * jax.process_count()
  refuse_resuming(
    args,
    bool(config.embed_dim) or devices != 1,
    "for one device, without --embed-dim (the embeddings' optimizer state lives in host memory "
    "and is not saved)",
  )
  with console.status("generating the synthetic graph"):
    data = {
      "source": "powerlaw",
      "nodes": args.nodes,
      "edges": args.edges,
      "features": args.features,
      "classes": args.classes,
      "seed": args.seed,
    }
    table = HostTable.empty((args.nodes, args.features), np.float32)
    dataset = load_dataset(data, features_out=table.as_numpy())
  console.print(
    f"[bold]{dataset.name}[/]: {dataset.num_nodes:,} nodes, {dataset.num_edges:,} "
    f"edges, {args.features} features, {dataset.num_classes} classes, "
    f"{len(dataset.train_nodes):,} train seeds | pipeline {config.pipeline}, "
    f"fanouts {config.fanouts}, {jax.devices()[0].platform} x "
    f"{len(jax.devices()) if config.devices is None else config.devices}"
    + (
      f" | {config.embed_dim}-wide node embeddings in host memory ({config.table_optimizer})"
      if config.embed_dim
      else ""
    )
  )
  with HostGraph(dataset.indptr, dataset.indices, features=table) as graph, table:
    with progress(console, "epoch {task.fields[epoch]}", None, epoch=1) as update:

      def on_batch(done, total):
        update(completed=done, total=total)

      def on_epoch(r):
        more = r["epoch"] < config.epochs  # the bar moves on to the next epoch, if there is one
        update(
          **(dict(epoch=r["epoch"] + 1, completed=0) if more else {}),
          metrics=f"loss {r['loss']:.4f}  val acc {r.get('val_accuracy', 0):.3f}",
        )
        console.print(
          f"epoch {r['epoch']:3d}  loss {r['loss']:.4f}  train acc {r['train_accuracy']:.4f}  "
          f"val acc {r.get('val_accuracy', float('nan')):.4f}  {r['seconds']:.2f} s  "
          f"({r['seeds_per_second']:,.0f} seeds/s)"
        )

      result = train(
        dataset,
        config,
        graph=graph,
        on_epoch=on_epoch,
        on_batch=on_batch,
        resume=_resumer(args.resume, config, data),
        save_every=args.save_every or 0,
        on_save=lambda r: save(args.out, r, config, data),
      )
  console.print(f"[bold]test accuracy {result.test_accuracy:.4f}[/] ({result.seconds:.1f} s)")
  save(args.out, result, config, data)  # every process takes part; Orbax writes once
  say_saved(console, args.out)
  return 0
