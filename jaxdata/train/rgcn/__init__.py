"""Entity classification with RGCN, the RGCN paper's setup (Schlichtkrull et al., 2018, sec. 4).

Two RGCN layers (16 hidden units, ReLU between), full-graph training with Adam (learning rate
0.01) for 50 epochs, an L2 penalty on the first layer's parameters, and optionally basis
decomposition; the paper uses no bases and no penalty on AIFB, 30 bases and 5e-4 on MUTAG. The
authors' code (tkipf/relational-gcn) also fixes what the paper leaves open: no bias, and the self
loop is one more relation (the identity matrix), so under basis decomposition ``W_0`` is combined
from the bases too (`PAPER_SETUP`).
Input features, where the data has them, live in a `HostTable` and every step gathers them with
`host_gather` inside the jitted step; RDF graphs are featureless (one-hot node ids).

    from jaxdata.data import load_entities
    from jaxdata.train.rgcn import TrainConfig, train
    result = train(load_entities("aifb.tgz"), TrainConfig(epochs=50))
    print(result.test_accuracy)

`jaxdata train rgcn --scale S` trains RGCN on `synthetic_mag` instead (ogbn-mag's paper venues),
through the heterogeneous trainer of RGAT and HGT (`jaxdata.train.attention`, model "rgcn"):
per-type input maps, learnable embeddings for featureless types, `--minibatch` from host memory.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxdata import command, distributed
from jaxdata.data import EntityDataset
from jaxdata.hector import GraphArrays
from jaxdata.host import HostTable, host_gather
from jaxdata.tasks import checkpoint
from jaxdata.tasks.rgcn import (
  DATA_ENTRIES,
  PAPER_SETUP,
  SYNTHETIC_SETUP,
  TrainConfig,
  build_model,
  evaluate,
  l2_penalty,
  load_dataset,
  predict,
  split_validation,
)
from jaxdata.train import partitioned
from jaxdata.train.common import (
  MINIBATCH_DEFAULTS,
  TrainResult,
  accuracy,
  add_minibatch_arguments,
  add_out_argument,
  add_record,
  add_resume_arguments,
  add_target_argument,
  devices_flag,
  minibatch_options,
  progress,
  refuse_resuming,
  refuse_without_minibatch,
  resumer,
  save_due,
  say_saved,
)
from jaxdata.train.rgcn import minibatch as sampled

#: `jaxdata train rgcn` runs as one of several processes (`jaxdata.distributed`): full-graph
#: training with the graph partitioned by destinations over every process's devices, or
#: `--minibatch` data parallel over them (`minibatch.sharded_steps`).
MULTI_PROCESS = True
#: The task's configuration, data, model and measurement live in `jaxdata.tasks.rgcn`.
__all__ = [
  "DATA_ENTRIES",
  "PAPER_SETUP",
  "SYNTHETIC_SETUP",
  "TrainConfig",
  "add_arguments",
  "build_model",
  "evaluate",
  "l2_penalty",
  "load_dataset",
  "main",
  "predict",
  "split_validation",
  "train",
]


def train(
  dataset: EntityDataset,
  config: TrainConfig = TrainConfig(),  # noqa: B008  (frozen)
  *,
  on_epoch: Callable[[dict], None] | None = None,
  resume: Callable[[nnx.Module, nnx.Optimizer], list[dict]] | None = None,
  save_every: int = 0,
  on_save: Callable[[TrainResult], None] | None = None,
) -> TrainResult:
  """Trains a 2-layer RGCN on `dataset`'s training nodes; returns the model and test accuracy.

  With more than one device in all (`config.devices` per process, times the processes of a
  `jax.distributed` job) the graph is partitioned by destinations over them
  (`jaxdata.train.partitioned`); one device in one process runs the path below.

  `resume(model, optimizer)` puts a saved run's state into the fresh model and optimizer and
  returns its history; training goes on from the epoch after it to the parameters a run never
  stopped would have. `on_save(result)` gets the run so far every `save_every` epochs. Both:
  one device of one process.
  """
  if config.devices != 1 or jax.process_count() > 1:
    if resume is not None or save_every:
      raise ValueError("train: resume and save_every are for one device of one process")

    return partitioned.train_rgcn(dataset, config, on_epoch=on_epoch)
  graph = GraphArrays.from_graph(dataset.graph)
  model = build_model(dataset, config, nnx.Rngs(config.seed))
  optimizer = nnx.Optimizer(model, optax.adam(config.learning_rate), wrt=nnx.Param)
  fit, val = split_validation(len(dataset.train_idx), config.val_fraction, config.seed)
  train_idx, train_y = jnp.asarray(dataset.train_idx[fit]), jnp.asarray(dataset.train_y[fit])
  val_idx, val_y = jnp.asarray(dataset.train_idx[val]), jnp.asarray(dataset.train_y[val])
  table = None if dataset.features is None else HostTable(dataset.features)
  node_ids = jnp.arange(dataset.graph.num_nodes, dtype=jnp.int32)

  def features():
    # The whole graph is one batch, so every node's row is gathered from host memory.
    return None if table is None else host_gather(table, node_ids)

  @nnx.jit
  def step(model, optimizer, graph):

    def loss_fn(model):
      logits = model(graph, features())
      loss = optax.softmax_cross_entropy_with_integer_labels(logits[train_idx], train_y).mean()
      return loss + config.l2 * l2_penalty(model), logits

    (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    # Both on this epoch's logits (the model before the update): no second forward pass.
    return loss, accuracy(logits[train_idx], train_y), accuracy(logits[val_idx], val_y)

  history = [] if resume is None else list(resume(model, optimizer))
  start = time.perf_counter()
  try:
    for epoch in range(len(history) + 1, config.epochs + 1):
      t0 = time.perf_counter()
      loss, acc, val_acc = step(model, optimizer, graph)
      record = dict(
        epoch=epoch, loss=float(loss), train_accuracy=float(acc), seconds=time.perf_counter() - t0
      )
      if len(val):
        record["val_accuracy"] = float(val_acc)
      add_record(history, record, on_epoch)
      if command.stop_requested():  # SIGTERM: the last completed step ends the run
        break
      if on_save is not None and save_due(save_every, epoch, config.epochs):
        now = evaluate(model, dataset, graph)
        on_save(TrainResult(model, history, now, time.perf_counter() - start, optimizer))
  finally:
    if table is not None:
      # close() waits for the kernels reading the table. Not jax.effects_barrier(): on a GPU it
      # re-raises the last error of any effectful computation on the device, even one the user
      # already caught (a failed offload spill, say).
      table.close()
  test_accuracy = evaluate(model, dataset, graph)["test_accuracy"]
  return TrainResult(
    model, history, {"test_accuracy": test_accuracy}, time.perf_counter() - start, optimizer
  )


def save(path: str, result: TrainResult, config: TrainConfig, data: dict) -> str:
  """Saves a trained RGCN as a checkpoint (`jaxdata.tasks.checkpoint`)."""
  return checkpoint.save_nnx(
    path,
    kind="rgcn",
    model=result.model,
    optimizer=result.optimizer,
    config=config,
    data=data,
    step=len(result.history),
    history=result.history,
    metrics={"test_accuracy": result.test_accuracy},
  )


# ----------------------------------------------------------------------------- the CLI
def add_arguments(parser):
  """`jaxdata train rgcn` options."""
  parser.add_argument(
    "--data",
    metavar="PATH",
    type=command.existing_path,
    help="an RDF entity-classification archive (aifb.tgz, mutag.tgz), or a dataset folder "
    "(OGB's raw layout or edge lists, docs/data.md; with --target); default: the built-in "
    "synthetic graph",
  )
  add_target_argument(parser)
  parser.add_argument(
    "--task",
    choices=("node", "link"),
    default="node",
    help="node: entity classification; link: link prediction with a DistMult decoder, "
    "filtered MRR and Hits@1/3/10 (--data: a folder of train.txt, valid.txt, test.txt "
    "triples, or an RDF archive's triples split at random; default: a synthetic knowledge "
    "graph)",
  )
  parser.add_argument(
    "--negatives",
    type=command.positive_int,
    default=1,
    help="--task link: corrupted triples per training triple (default: 1)",
  )
  parser.add_argument(
    "--eval-every",
    type=command.natural_int,
    default=0,
    help="--task link: validation MRR every this many steps (default 0: at the end)",
  )
  parser.add_argument(
    "--epochs",
    type=command.positive_int,
    default=None,
    help="training epochs (default: 50; 40 with --scale)",
  )
  parser.add_argument(
    "--hidden",
    type=command.positive_int,
    default=None,
    help="hidden features (default: 16; 64 with --scale)",
  )
  parser.add_argument(
    "--bases",
    type=command.natural_int,
    default=None,
    help="basis decomposition with this many bases, 0 for a full weight per "
    "relation (default: the paper's setting for the archive, 30 on MUTAG "
    "and 0 on AIFB; 8 on the synthetic graph; none with --scale)",
  )
  parser.add_argument(
    "--l2",
    type=command.natural_float,
    default=None,
    help="L2 penalty: this times the sum of squares of the first layer's "
    "parameters is added to the loss (default: the paper's setting, 5e-4 "
    "on MUTAG and 0 on AIFB; 5e-4 on the synthetic graph)",
  )
  parser.add_argument(
    "--self-loop",
    choices=("separate", "basis"),
    default=None,
    help="the self-loop weight W_0: a weight of its own, or combined from the "
    "bases like a relation's (needs bases) (default: the paper's setting "
    "on AIFB and MUTAG, basis wherever there are bases; separate on the "
    "synthetic graph)",
  )
  parser.add_argument(
    "--bias",
    action=argparse.BooleanOptionalAction,
    default=None,
    help="add a bias in each layer (default: the paper's setting, none on AIFB "
    "and MUTAG; a bias on the synthetic graph)",
  )
  parser.add_argument(
    "--lr",
    type=command.positive_float,
    default=None,
    help="Adam's learning rate (default: 0.01; 0.005 with --scale)",
  )
  parser.add_argument(
    "--val-fraction",
    type=command.fraction,
    default=None,
    help="training nodes held out to report validation accuracy every epoch "
    "(default 0.2 on the synthetic graph; 0 on RDF archives, as the paper "
    "trains on the whole training set)",
  )
  parser.add_argument("--seed", type=command.seed, default=0, help="the first seed")
  parser.add_argument(
    "--seeds",
    type=command.positive_int,
    default=None,
    help="train this many times (seeds seed, seed+1, ...) and report the mean (default: 1)",
  )
  parser.add_argument(
    "--dtype",
    choices=("float32", "bfloat16"),
    default="float32",
    help="compute dtype (parameters stay float32)",
  )
  parser.add_argument(
    "--nodes",
    type=command.positive_int,
    default=None,
    help="synthetic graph: nodes (default: 20,000)",
  )
  parser.add_argument(
    "--edges",
    type=command.positive_int,
    default=None,
    help="synthetic graph: edges (default: 200,000)",
  )
  parser.add_argument(
    "--relations",
    type=command.positive_int,
    default=None,
    help="synthetic graph: relations (default: 50)",
  )
  add_resume_arguments(parser, every_default=None)
  parser.add_argument(
    "--devices",
    type=command.natural_int,
    default=1,
    help="train over this many local devices (0: all); with several processes "
    "the mesh spans every process's devices. Full graph: the graph "
    "partitioned by destination nodes (jaxdata.train.partitioned); "
    "--minibatch: data parallel, --batch-size seeds per device",
  )
  parser.add_argument(
    "--minibatch",
    action="store_true",
    help="train on sampled mini-batches, the graph, features and (featureless "
    "data) the first layer's node rows in host memory "
    "(see jaxdata.train.rgcn.minibatch)",
  )
  add_minibatch_arguments(
    parser,
    batch_size=None,
    seeds="nodes (default 256; with --scale 1024 papers)",
    tables="the node rows (featureless data)",
  )
  mag = parser.add_argument_group(
    "synthetic_mag (--scale)",
    "RGCN paper classification on a synthetic ogbn-mag through the "
    "trainer of `jaxdata train rgat|hgt` (jaxdata.train.attention): --help there says more",
  )
  mag.add_argument(
    "--scale",
    type=command.positive_float,
    default=None,
    help="train on synthetic_mag at this share of ogbn-mag's size (1.0: about "
    "1.9M nodes and 21M edges) instead of an entity dataset",
  )
  mag.add_argument(
    "--classes",
    type=command.positive_int,
    default=None,
    help="--scale: paper classes (default: 349, or about 100 papers per class)",
  )
  mag.add_argument(
    "--layers",
    type=command.natural_int,
    default=None,
    help="--scale, --data DIR, --task link: RGCN layers (default: 2; --minibatch takes one "
    "fanout per layer; --task link: 0 is DistMult alone)",
  )
  mag.add_argument(
    "--embed",
    type=command.listing(str),
    default=None,
    help="--scale: node types whose input is a learnable embedding (author,"
    "institution,field_of_study)",
  )
  mag.add_argument(
    "--embed-dim",
    type=command.positive_int,
    default=None,
    help="--scale: the embeddings' width (default: 64)",
  )
  mag.add_argument(
    "--cache",
    type=command.fraction,
    default=None,
    help="--scale --minibatch: keep this fraction of each feature table's rows in device memory",
  )
  mag.add_argument(
    "--device-bytes",
    type=command.size_or_auto,
    default=None,
    help="--scale --minibatch: the device holds at most this many bytes of "
    "parameters, optimizer state and cached feature rows (or auto: a "
    "quarter of the feature and embedding tables)",
  )
  add_out_argument(parser, "rgcn", "the (last seed's) model", ("rgcn", "rgcn-mag", "rgcn-link"))


#: The synthetic graph's fewest nodes: one per class (synthetic_entities draws 4) and at least
#: one labelled for training (a tenth of them, rounded).
SYNTHETIC_MIN_NODES = 6


#: Options that name or shape the entity datasets (not with --scale), and those of synthetic_mag
#: (only with --scale), by their `args` names.
ENTITY_OPTIONS = (
  "data",
  "nodes",
  "edges",
  "relations",
  "l2",
  "self_loop",
  "bias",
  "val_fraction",
  "seeds",
)
MAG_OPTIONS = ("classes", "layers", "embed", "embed_dim", "cache", "device_bytes")
#: Options both take; None (not given) keeps the trainer's own default.
SHARED_OPTIONS = (
  "epochs",
  "save_every",
  "resume",
  "hidden",
  "lr",
  "seed",
  "dtype",
  "devices",
  "minibatch",
  "fanouts",
  "batch_size",
  "pipeline",
  "table_optimizer",
  "out",
  "bases",
)


def _flag(name: str) -> str:
  return "--" + name.replace("_", "-")


def mag_arguments(args: argparse.Namespace, defaults: argparse.Namespace) -> argparse.Namespace:
  """`jaxdata train rgcn --scale S` as the arguments of the heterogeneous trainer
  (`jaxdata.train.attention.main`, model "rgcn"): `defaults` (that trainer's options, parsed
  from nothing) with the options given here. UsageError for an entity dataset's option.
  (`jaxdata.cli` joins the two: a trainer imports no other.)"""
  folder = args.data is not None and os.path.isdir(args.data)
  given = [
    n for n in ENTITY_OPTIONS if getattr(args, n) is not None and not (folder and n == "data")
  ]
  if given:
    what = (
      f"the dataset folder {args.data}" if folder else f"synthetic_mag (--scale {args.scale:g})"
    )
    raise command.UsageError(
      f"argument {_flag(given[0])}: names an entity dataset, not {what}; give one of them"
    )
  mag = argparse.Namespace(**vars(defaults))
  for name in ("scale", "data", "target") + MAG_OPTIONS + SHARED_OPTIONS:
    if getattr(args, name) is not None:
      setattr(mag, name, getattr(args, name))
  return mag


def main(args) -> int:
  """`jaxdata train rgcn` on an entity dataset (`jaxdata.cli` sends --scale to
  `jaxdata.train.attention` with `mag_arguments`)."""
  if args.scale is not None or (args.data and os.path.isdir(args.data)):
    raise command.UsageError(
      "argument --scale/--data DIR: heterographs train through jaxdata.cli (`jaxdata train "
      "rgcn --scale S`)"
    )
  if args.target is not None:
    raise command.UsageError("argument --target: names a node type of --data DIR")
  given = [n for n in MAG_OPTIONS if getattr(args, n) is not None]
  if given:
    raise command.UsageError(f"argument {_flag(given[0])}: for synthetic_mag (with --scale)")
  refuse_without_minibatch(args, dict(MINIBATCH_DEFAULTS, batch_size=None))
  # The entity datasets' defaults (None above: --scale has its own).
  for name, value in (
    ("epochs", 50),
    ("hidden", 16),
    ("lr", 0.01),
    ("seeds", 1),
    ("nodes", 20_000),
    ("edges", 200_000),
    ("relations", 50),
    ("batch_size", 256),
  ):
    if getattr(args, name) is None:
      setattr(args, name, value)
  console = command.console()
  console.quiet = not distributed.is_primary()  # one process reports for the job
  if args.self_loop == "basis" and args.bases == 0:
    raise command.UsageError(
      "argument --self-loop: 'basis' combines W_0 from the bases; it needs --bases of at least 1"
    )
  if args.data:
    data = {"source": "rdf", "path": os.path.abspath(args.data)}
  elif args.nodes < SYNTHETIC_MIN_NODES:
    raise command.UsageError(
      f"argument --nodes: the synthetic graph needs at least "
      f"{SYNTHETIC_MIN_NODES} nodes (4 classes, and a tenth of the nodes "
      f"to train on), got {args.nodes}"
    )
  else:
    data = {
      "source": "synthetic",
      "nodes": args.nodes,
      "edges": args.edges,
      "relations": args.relations,
      "seed": args.seed,
    }
  try:
    dataset, setup = load_dataset(data)
  except (OSError, ValueError, EOFError) as e:
    raise command.UsageError(f"argument {'--data' if args.data else '--nodes'}: {e}") from None
  num_bases = args.bases if args.bases is not None else setup.get("num_bases")
  num_bases = num_bases or None  # --bases 0: a full weight per relation
  l2 = args.l2 if args.l2 is not None else setup.get("l2", 0.0)
  bias = args.bias if args.bias is not None else setup.get("bias", True)
  self_loop = args.self_loop or setup.get("self_loop", "separate")
  if self_loop == "basis" and num_bases is None:
    if args.self_loop:
      raise command.UsageError(
        "argument --self-loop: 'basis' combines W_0 from the bases; it needs --bases of at least 1"
      )
    self_loop = "separate"  # no bases: the paper's identity relation has a full weight, W_0
  minibatch = None
  devices = devices_flag(args.devices)
  if args.minibatch:
    if args.fanouts is not None and len(args.fanouts) != 2:
      raise command.UsageError(
        f"argument --fanouts: give two fanouts (the RGCN model has two "
        f"layers), got {len(args.fanouts)}"
      )
    minibatch = sampled.MinibatchConfig(**minibatch_options(args, 2))
  val_fraction = (
    args.val_fraction if args.val_fraction is not None else setup.get("val_fraction", 0.0)
  )
  if val_fraction >= 1:
    raise command.UsageError("argument --val-fraction: must be below 1 (some nodes must train)")
  g = dataset.graph
  mesh_size = (len(jax.local_devices()) if devices is None else devices) * jax.process_count()
  console.print(
    f"[bold]{dataset.name}[/]: {g.num_nodes:,} nodes, {g.num_edges:,} edges, "
    f"{g.num_relations} relations, {dataset.num_classes} classes, "
    f"{len(dataset.train_idx)} train / {len(dataset.test_idx)} test, "
    + (
      "featureless"
      if dataset.features is None
      else f"{dataset.features.shape[1]} features "
      + ("in a HostTable" if mesh_size == 1 or args.minibatch else "sharded by rows")
    )
    + f" | bases={num_bases} l2={l2:g} self-loop={self_loop} "
    f"bias={'yes' if bias else 'no'} val={val_fraction:g} "
    f"on {jax.devices()[0].platform} x {mesh_size}"
  )
  if minibatch is not None:
    console.print(
      f"mini-batches: fanouts {minibatch.fanouts}, {minibatch.batch_size} nodes per "
      f"step, graph in {minibatch.pipeline} memory"
      + (
        ""
        if dataset.features is not None
        else f", node rows in host memory ({minibatch.table_optimizer})"
      )
    )
  refuse_resuming(
    args,
    args.seeds > 1 or args.minibatch or devices != 1 or jax.process_count() > 1,
    "for one run (--seeds 1) of full-graph training on one device",
  )
  accuracies = []
  for seed in range(args.seed, args.seed + args.seeds):
    config = TrainConfig(
      epochs=args.epochs,
      hidden=args.hidden,
      num_bases=num_bases,
      l2=l2,
      self_loop=self_loop,
      bias=bias,
      learning_rate=args.lr,
      seed=seed,
      dtype=args.dtype,
      val_fraction=val_fraction,
      devices=devices,
    )
    with progress(console, f"seed {seed}", config.epochs, transient=args.seeds > 1) as update:

      def on_epoch(r):
        val = f"  val acc {r['val_accuracy']:.4f}" if "val_accuracy" in r else ""
        update(advance=1, metrics=f"loss {r['loss']:.4f}  train acc {r['train_accuracy']:.3f}")
        if args.seeds == 1:
          console.print(
            f"epoch {r['epoch']:3d}  loss {r['loss']:.4f}  "
            f"train acc {r['train_accuracy']:.4f}{val}  {1e3 * r['seconds']:.1f} ms"
          )

      if minibatch is None:
        result = train(
          dataset,
          config,
          on_epoch=on_epoch,
          resume=resumer(args.resume, kind="rgcn", config=config, data=data),
          save_every=args.save_every or 0,
          on_save=lambda r: save(args.out, r, config, data),  # noqa: B023 (one seed)
        )
      else:
        result = sampled.train(dataset, config, minibatch, on_epoch=on_epoch)
    accuracies.append(result.test_accuracy)
    console.print(
      f"seed {seed}: test accuracy {result.test_accuracy:.4f} "
      f"({result.seconds:.1f} s; last epoch {1e3 * result.history[-1]['seconds']:.1f} ms)"
    )
  save(args.out, result, config, data)
  if args.seeds > 1:
    console.print(
      f"[bold]test accuracy over {args.seeds} seeds: {np.mean(accuracies):.4f} "
      f"± {np.std(accuracies):.4f}[/] (population std; min {min(accuracies):.4f}, "
      f"max {max(accuracies):.4f}; per seed: "
      f"{' '.join(f'{a:.4f}' for a in accuracies)})"
    )
  say_saved(console, args.out)
  return 0
