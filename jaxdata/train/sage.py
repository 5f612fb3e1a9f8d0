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
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdata import command, distributed
from jaxdata.host import HostGraph, HostTable, sparse
from jaxdata.tasks import checkpoint
from jaxdata.tasks.sage import (  # noqa: F401  (the trainer's names for them)
  EMBEDDING,
  PIPELINES,
  CpuBatches,
  SageConfig,
  build_model,
  evaluation,
  load_dataset,
  loader_of,
  loss,
  mesh_of,
  run_keys,
  sample_batch,
  sampled_accuracy,
)
from jaxdata.train.common import (
  TrainResult,
  add_out_argument,
  add_resume_arguments,
  check_copies_agree,
  check_fanouts,
  devices_flag,
  fit_epochs,
  mistakes,
  progress,
  psum_flat,
  refuse_resuming,
  resumer,
  run_steps,
  say_saved,
  seed_batches,
  sharded_jit,
)

#: `jaxdata train sage` runs as one of several processes (`jaxdata.distributed`).
MULTI_PROCESS = True


# ----------------------------------------------------------------------------- training


def train(
  dataset: Any,
  config: SageConfig = SageConfig(),  # noqa: B008  (frozen)
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
  with contextlib.ExitStack() as stack:
    if graph is None:
      graph = HostGraph(dataset.indptr, dataset.indices, features=dataset.features)
      stack.enter_context(graph)
    table = table_opt = None
    if config.embed_dim:
      if resume is not None or save_every:
        raise ValueError("train: resume and save_every are for runs without embeddings")
      if embedding is None:
        embedding = initial_embedding(graph.num_nodes, config)
      embedding = np.asarray(embedding)
      if embedding.shape != (graph.num_nodes, config.embed_dim):
        raise ValueError(
          f"train: embedding must have shape {(graph.num_nodes, config.embed_dim)} "
          f"(nodes, embed_dim), got {embedding.shape}"
        )
      opt = sparse.BY_NAME[config.table_optimizer](config.learning_rate)
      table = stack.enter_context(HostTable(embedding.astype(np.float32)))
      table_opt = (opt, opt.init(table))
      stack.callback(sparse.close, table_opt[1])
    if graph.features is None:
      raise ValueError("train: the graph has no node features")
    if graph.num_nodes != len(dataset.labels):
      raise ValueError(
        f"train: {len(dataset.labels)} labels for a graph of {graph.num_nodes} nodes"
      )
    mesh = mesh_of(config)
    if config.pipeline == "cpu" and jax.process_count() > 1:
      raise ValueError(
        "train: the cpu pipeline runs in one process only; use pipeline host or "
        "device with several processes"
      )
    labels = np.asarray(dataset.labels).astype(np.int32)
    loader = None
    if config.pipeline != "cpu":
      loader = stack.enter_context(loader_of(graph, labels, config))
    run = _steps(dataset, config, graph, mesh, loader, labels, init, table, table_opt)
    result = _train_loop(
      dataset, config, mesh, run, on_epoch, on_batch, resume, save_every, on_save
    )
    if table is not None:
      result.tables = {"embedding": np.array(table.as_numpy())}
  if table is not None:
    check_copies_agree(result.tables["embedding"], "embedding")
  return result


@contextlib.contextmanager
def lowered_step(dataset: Any, config: SageConfig, graph: HostGraph, rows: np.ndarray):
  """The training step of `config` (pipeline host or device) on one device, lowered for the
  seed batches `rows` (int32 [batches, batch_size]), and ``call(program)``: runs a compiled
  program of it on the next row (the last row again once past it), the model's state carried
  from call to call; returns that step's summed loss. What `jaxdata bench minibatch
  --breakdown` times and profiles."""
  if config.pipeline == "cpu":
    raise ValueError("lowered_step: the cpu pipeline's step takes batches, not seeds")
  mesh = mesh_of(dataclasses.replace(config, devices=1))
  labels = np.asarray(dataset.labels).astype(np.int32)
  loader = loader_of(graph, labels, config)
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


def _steps(dataset, config, graph, mesh, loader, labels, init, table, table_opt):
  """A run's jitted programs and starting state: `step` (params, opt_state, *consts, ...) and
  `evaluate_batch`, the initial `params` and `opt_state` (placed on the mesh), the `consts` the
  loader's pipelines pass, and `cpu_batches` for the cpu pipeline."""
  cpu_batches = None
  model = build_model(config, graph.features.shape[1], dataset.num_classes)
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
      total, correct = loss(nnx.merge(graphdef, p), feats, masks, labels, valid, e)
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
    def device_step(params, opt_state, loader, rows, i, key):
      batch, embedded = sample_batch(loader, table, rows, i, key)
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

  else:

    def cpu_step(params, opt_state, feats, masks, labels):
      grads, _, total, correct, count = grads_of(params, feats, masks, labels, masks[0])
      params, opt_state = apply(params, opt_state, grads)
      return params, opt_state, (total, correct, count)

    data = P("data")
    step = shard(cpu_step, (P(), P(), data, data, data), (P(), P(), metrics_spec))

    step_consts = ()
    cpu_batches = CpuBatches(graph, labels, fanouts, mesh)

  return types.SimpleNamespace(
    step=step,
    evaluate_batch=evaluation(graphdef, mesh, config.pipeline, table),
    params=params,
    opt_state=opt_state,
    consts=step_consts,
    cpu_batches=cpu_batches,
    graphdef=graphdef,
  )


def _train_loop(
  dataset, config, mesh, run, on_epoch, on_batch, resume, save_every, on_save
) -> TrainResult:
  """The epochs of a run of `_steps`' programs `run`."""
  replicated = NamedSharding(mesh, P())
  batch = config.batch_size * mesh.devices.size
  seed_sharding = NamedSharding(mesh, P(None, "data"))
  rng = np.random.default_rng(config.seed)
  key, eval_key, test_key = run_keys(config)

  def run_epoch(epoch: int, seed_rows: np.ndarray, start: int) -> dict:
    """The training steps over the rows of seeds from row `start`; the epoch's record."""
    t0, epoch_key = time.perf_counter(), jax.random.fold_in(key, epoch - 1)
    if config.pipeline == "cpu":
      stream = run.cpu_batches.stream(seed_rows, epoch_key, start)

      def one(_):
        run.params, run.opt_state, m = run.step(run.params, run.opt_state, *next(stream))
        return m
    else:
      # Everything a step takes already placed as the step wants it: an argument on the wrong
      # devices is resharded at every call, off JAX's fast dispatch path.
      rows = distributed.put(seed_rows, seed_sharding)
      i = [distributed.put(np.int32(start), replicated)]
      epoch_key = distributed.put(epoch_key, replicated)

      def one(_):
        *state, i[0], m = run.step(run.params, run.opt_state, *run.consts, rows, i[0], epoch_key)
        run.params, run.opt_state = state
        return m

    sums = run_steps(one, start, len(seed_rows), on_batch)
    total, correct, count = (float(sum(np.asarray(x) for x in col)) for col in zip(*sums))
    seconds = time.perf_counter() - t0
    record = dict(
      loss=total / max(count, 1),
      train_accuracy=correct / max(count, 1),
      seconds=seconds,
      batches=len(sums),
      seeds_per_second=count / seconds,
    )
    if config.evaluate and len(dataset.val_nodes):
      record["val_accuracy"] = accuracy(dataset.val_nodes, jax.random.fold_in(eval_key, epoch - 1))
    return record

  def accuracy(nodes: np.ndarray, epoch_key) -> float:
    rows = seed_batches(nodes, batch, None, config.eval_batches)
    feed = run.cpu_batches if config.pipeline == "cpu" else run.consts[0]
    return sampled_accuracy(run.evaluate_batch, run.params, feed, rows, epoch_key, mesh)

  def measure() -> dict:
    if config.evaluate and len(dataset.test_nodes):
      return {"test_accuracy": accuracy(dataset.test_nodes, test_key)}
    return {"test_accuracy": float("nan")}

  def result(history, metrics, seconds) -> TrainResult:
    # Replicated over the mesh: each process reads its own copy (no collective).
    model = nnx.merge(run.graphdef, distributed.local_value(run.params))
    return TrainResult(model, history, metrics, seconds, distributed.local_value(run.opt_state))

  history = []
  if resume is not None:
    (params, opt_state), history = resume(run.params, run.opt_state)
    run.params, run.opt_state = distributed.put((params, opt_state), replicated)
  return fit_epochs(
    config.epochs,
    run_epoch,
    result,
    measure,
    history=history,
    seed_rows=lambda _: seed_batches(dataset.train_nodes, batch, rng, config.max_batches),
    on_epoch=on_epoch,
    save_every=save_every,
    on_save=on_save,
    measure_saves=False,  # the test accuracy is measured at the end
  )


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
    metrics={
      "test_accuracy": result.metrics.get("test_accuracy", float("nan"))
    },  # NaN: saved early
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
  with mistakes():  # settings the flags' own checks cannot see (--embed-dim with cpu)
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
