"""Paper classification on an ogbn-mag-shaped heterograph with RGAT, HGT or RGCN (full graph).

The task of ogbn-mag: predict each paper's venue from the academic graph (papers, authors,
institutions, fields of study; writes, cites, has_topic, affiliated_with and their reverses).
`jaxdata.data.synthetic_mag` draws a graph of its shape at any scale, so the same command runs
in a minute on a laptop CPU (the default, scale 0.005) and at ogbn-mag's full size on a GPU
(``--scale 1``). The models run their relational layers through hector's generated kernels:

* ``rgat``: a per-type linear map of every node type's features to a common width, two RGAT
  layers (heads concatenated, self loop, bias, ReLU after each), a linear classifier on papers;
* ``hgt``: two HGT layers (the first reads every type's own feature width), a linear classifier
  on papers;
* ``rgcn`` (`jaxdata train rgcn --scale S`): a per-type linear map to a common width, two RGCN
  layers (a full weight per relation, or `TrainConfig.num_bases` shared bases; self loop, bias,
  ReLU after each), a linear classifier on papers.

Full-graph training with Adam; the loss is the cross entropy of the training papers.

    from jaxdata.data import synthetic_mag
    from jaxdata.train.attention import TrainConfig, train
    result = train(synthetic_mag(scale=0.005, num_classes=32), TrainConfig(model="hgt"))
    print(result.test_accuracy)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxdata import command, distributed
from jaxdata.data import read
from jaxdata.data.mag import NODE_TYPES, NUM_CLASSES, NUM_NODES, MagDataset
from jaxdata.hector import GraphArrays
from jaxdata.hector.passes import PASSES
from jaxdata.hector.passes import select as select_passes
from jaxdata.nn import layer_stack
from jaxdata.offload import TensorStore
from jaxdata.offload.stack import segments
from jaxdata.offload.store import summary as store_summary
from jaxdata.sizes import format_bytes
from jaxdata.tasks import checkpoint
from jaxdata.tasks.hetero import (
  CLASSIFIERS,
  KINDS,
  MODELS,
  TargetError,
  TrainConfig,
  build_model,
  device_features,
  evaluate,
  folder_dataset,
  load_dataset,
  predict,
  register,
)
from jaxdata.train import partitioned
from jaxdata.train.attention import minibatch as hetero
from jaxdata.train.common import (
  MINIBATCH_DEFAULTS,
  DeviceBudgetError,
  TrainResult,
  accuracy,
  add_minibatch_arguments,
  add_offload_arguments,
  add_out_argument,
  add_record,
  add_resume_arguments,
  add_target_argument,
  check_offload_arguments,
  devices_flag,
  minibatch_options,
  minibatch_settings,
  progress,
  refuse_resuming,
  refuse_without_minibatch,
  resumer,
  save_due,
  say_saved,
)

MULTI_PROCESS = True
#: The models' configuration, construction and measurement live in `.model` (the loops share them).
__all__ = [
  "CLASSIFIERS",
  "KINDS",
  "MODELS",
  "TrainConfig",
  "add_arguments",
  "build_model",
  "device_features",
  "evaluate",
  "main",
  "load_dataset",
  "predict",
  "register",
  "train",
]


#: Makes a plan (one offload policy per stacked layer) for a freshly built model, the graph and
#: the device features it trains on (where a planner measures its layers).
Planner = Callable[[nnx.Module, GraphArrays, list], Sequence]


def train(
  dataset: MagDataset,
  config: TrainConfig = TrainConfig(),  # noqa: B008  (frozen)
  *,
  plan: Sequence | Planner | None = None,
  on_epoch: Callable[[dict], None] | None = None,
  resume: Callable[[nnx.Module, nnx.Optimizer], list[dict]] | None = None,
  save_every: int = 0,
  on_save: Callable[[TrainResult], None] | None = None,
) -> TrainResult:
  """Trains `config.model` on `dataset`'s training papers; returns the model and accuracies.

  `resume(model, optimizer)` puts a saved run's state into the freshly built model and
  optimizer and returns its history; training goes on from the epoch after it to
  `config.epochs`, to the parameters a run never stopped would have. `on_save(result)` gets the
  run so far every `save_every` epochs (its metrics measured then). Full-graph training on one
  device only.

  With more than one device in all (`config.devices` per process, times the processes of a
  `jax.distributed` job) the graph is partitioned by destinations over them
  (`jaxdata.train.partitioned`); one device in one process runs the path below.

  `plan`: None (plain layers), one `jaxdata.offload.Policy` per stacked layer
  (`model.stack_layers`: RGAT's every layer, HGT's after the first), or a `Planner` called once
  on the freshly built model (`budget_planner`). A plan changes memory and time, not the
  numbers. The plan is kept as `TrainResult.plan`.
  """
  if config.devices != 1 or jax.process_count() > 1:
    if plan is not None or config.layers != 2:
      raise ValueError(
        "train: over several devices (the partitioned path) the model has two "
        "layers and no offload plan"
      )
    if resume is not None or save_every:
      raise ValueError("train: resume and save_every are for one device of one process")

    return partitioned.train_hetero(dataset, config, on_epoch=on_epoch)
  graph = GraphArrays.from_graph(dataset.graph)
  model = build_model(dataset, config, nnx.Rngs(config.seed))
  optimizer = nnx.Optimizer(model, optax.adam(config.learning_rate), wrt=nnx.Param)
  xs = device_features(dataset, model)
  if callable(plan):
    plan = plan(model, graph, xs)
  if plan is not None:
    plan = tuple(plan)
    if len(plan) != model.stack_layers:
      raise ValueError(
        f"train: the plan has {len(plan)} policies for the model's "
        f"{model.stack_layers} stacked layers"
      )
  papers = dataset.node_range(dataset.target)[1]
  labels = jnp.asarray(dataset.labels)
  train_idx = jnp.asarray(dataset.train_papers)
  train_y = labels[train_idx]

  @nnx.jit
  def step(model, optimizer, graph, xs):

    def loss_fn(model):
      logits = model(graph, xs, papers, plan)[train_idx]
      return optax.softmax_cross_entropy_with_integer_labels(logits, train_y).mean(), logits

    (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    return loss, accuracy(logits, train_y)

  history = [] if resume is None else list(resume(model, optimizer))
  start = time.perf_counter()
  for epoch in range(len(history) + 1, config.epochs + 1):
    t0 = time.perf_counter()
    loss, acc = step(model, optimizer, graph, xs)
    record = dict(
      epoch=epoch, loss=float(loss), train_accuracy=float(acc), seconds=time.perf_counter() - t0
    )
    record["val_accuracy"] = evaluate(model, dataset, graph, xs)["val_accuracy"]
    add_record(history, record, on_epoch)
    if command.stop_requested():  # SIGTERM or Ctrl-C: the last completed step ends the run
      break
    if on_save is not None and save_due(save_every, epoch, config.epochs):
      now = evaluate(model, dataset, graph, xs)
      on_save(TrainResult(model, history, now, time.perf_counter() - start, optimizer, plan))
  final = evaluate(model, dataset, graph, xs)
  return TrainResult(model, history, final, time.perf_counter() - start, optimizer, plan)


def candidates(model: nnx.Module) -> dict:
  """The inner policies the planner tries for `model`'s stacked layer (by its checkpoint
  names; `jaxdata.nn.layer_stack.candidates`)."""
  return layer_stack.candidates(model.names())


def budget_planner(
  budget_bytes: int,
  store,
  *,
  tier: str = "auto",
  repeats: int = 5,
  say: Callable[[str], None] | None = None,
  blocks: bool = False,
) -> Planner:
  """A `Planner` for `train`: keep / offload / recompute per stacked layer so that their
  residuals and inputs fit `budget_bytes` of device memory (measured on the default device;
  `jaxdata.nn.layer_stack.plan`); offloads go to `store` (a `jaxdata.offload.TensorStore`).
  ValueError when not even the smallest plan fits.

  `blocks=True`: a `minibatch.BlockPlanner` instead, called with a sampled batch's blocks and
  slot types: each layer measured on its own hop's padded shapes (`layer_stack.plan_each`)."""

  def planner(model, graph, xs):
    if not model.stack_layers:
      raise ValueError(
        f"budget: a {type(model).__name__} of {model.layers} layer(s) has no "
        "stacked layers to plan (HGT's first layer is not one of them)"
      )
    progress = (lambda what: say(f"  planning: {what} ...")) if say else None
    if blocks:  # graph: sampled blocks, xs: the outermost slots' node types
      progress = (lambda name: say(f"  measuring {name} ...")) if say else None
      layers, layer_fns, inputs = model.block_stack(graph, xs)
      best, bw = layer_stack.plan_each(
        layers,
        layer_fns,
        inputs,
        budget_bytes,
        store,
        candidates(model),
        tier=tier,
        repeats=repeats,
        progress=progress,
      )
    else:
      rows = [x.shape[0] for x in model.inputs(xs)]
      layers, layer_fn, x = model.stack(graph, rows)
      best, bw = layer_stack.plan(
        layers,
        layer_fn,
        x,
        budget_bytes,
        store,
        candidates(model),
        tier=tier,
        repeats=repeats,
        progress=progress,
      )
    if say:
      say(
        f"  plan: {best}  (predicted {best.seconds * 1e3:.1f} ms of layers, "
        f"{best.device_bytes / 2**20:.1f} MiB resident, {best.offload_bytes / 2**20:.1f} MiB "
        f"offloaded at {bw / 1e9:.1f} GB/s)"
      )
    return list(best.policies)

  return planner


def save(
  path: str, result: TrainResult, config: TrainConfig, data: dict, minibatch: Any = None
) -> str:
  """Saves a trained RGAT / HGT / RGCN classifier as a checkpoint (`jaxdata.tasks.checkpoint`;
  kind `KINDS[config.model]`); `minibatch`: the mini-batch settings it trained with, which a
  resumed run must repeat."""
  return checkpoint.save_nnx(
    path,
    kind=KINDS[config.model],
    model=result.model,
    optimizer=result.optimizer,
    config=config,
    data=data,
    step=len(result.history),
    history=result.history,
    metrics=result.metrics,
    metrics_note=result.metrics_note,
    settings=minibatch_settings(minibatch),
  )


# ----------------------------------------------------------------------------- the CLI
#: The options that only --minibatch uses, and their defaults (`refuse_without_minibatch`).
MINIBATCH_ONLY = dict(MINIBATCH_DEFAULTS, batch_size=1024, cache=0.0, device_bytes=None)


def add_arguments(parser, model: str):
  """`jaxdata train rgat|hgt` options."""
  parser.set_defaults(attention_model=model)
  parser.add_argument(
    "--scale",
    type=command.positive_float,
    default=None,
    help="synthetic_mag's share of ogbn-mag's size (default 0.005: about 9,700 "
    "nodes and 211,000 edges, a minute on a 2-core CPU; 1.0: full size, "
    "for a GPU)",
  )
  data_arguments(parser)
  parser.add_argument(
    "--classes",
    type=command.positive_int,
    default=None,
    help="paper classes (default: ogbn-mag's 349, or fewer at small scales "
    "so that every class has about 100 papers)",
  )
  parser.add_argument("--epochs", type=command.positive_int, default=40, help="training epochs")
  add_resume_arguments(parser)
  parser.add_argument("--hidden", type=command.positive_int, default=64, help="hidden features")
  parser.add_argument(
    "--layers",
    type=command.positive_int,
    default=2,
    help="graph layers (default 2; with --minibatch, one --fanouts entry each)",
  )
  parser.add_argument(
    "--heads",
    type=command.positive_int,
    default=4,
    help="attention heads (--hidden must be a multiple)",
  )
  parser.add_argument(
    "--lr", type=command.positive_float, default=0.005, help="Adam's learning rate"
  )
  parser.add_argument("--seed", type=command.seed, default=0, help="seed of data and model")
  parser.add_argument(
    "--dtype",
    choices=("float32", "bfloat16"),
    default="float32",
    help="compute dtype (parameters stay float32)",
  )
  parser.add_argument(
    "--passes",
    default=None,
    type=_passes,
    help="hector passes, comma-separated (reorder,compact; 'none' for none; default all)",
  )
  parser.add_argument(
    "--embed",
    type=command.listing(str),
    default=[],
    help="node types whose input is a learnable embedding instead of their "
    "features, comma-separated (ogbn-mag's featureless types: author,"
    "institution,field_of_study); with --minibatch they train in host "
    "memory with a sparse optimizer",
  )
  parser.add_argument(
    "--embed-dim", type=command.positive_int, default=64, help="--embed: the embeddings' width"
  )
  parser.add_argument(
    "--devices",
    type=command.natural_int,
    default=1,
    help="full-graph training over this many local devices (0: all), the "
    "graph partitioned by destination nodes; with several processes the "
    "mesh spans every process's devices (jaxdata.train.attention."
    "partitioned); with --minibatch, data parallel, --batch-size seeds "
    "per device",
  )
  parser.add_argument(
    "--minibatch",
    action="store_true",
    help="train on sampled mini-batches, graph and features in host memory "
    "(see jaxdata.train.attention.minibatch)",
  )
  add_minibatch_arguments(
    parser,
    batch_size=MINIBATCH_ONLY["batch_size"],
    seeds="papers per device",
    tables="the embedding tables (--embed)",
  )
  parser.add_argument(
    "--cache",
    type=command.fraction,
    default=MINIBATCH_ONLY["cache"],
    help="--minibatch, host pipeline: keep this fraction of each feature "
    "table's rows (its most sampled nodes) in device memory",
  )
  parser.add_argument(
    "--device-bytes",
    type=command.size_or_auto,
    default=MINIBATCH_ONLY["device_bytes"],
    help="--minibatch, host pipeline: the device holds at most this many bytes "
    "of parameters, optimizer state and cached feature rows (e.g. 8GiB, "
    "or auto: a quarter of the feature and embedding tables; the cache "
    "gets what the dense model leaves)",
  )
  add_offload_arguments(
    parser,
    planned="jaxdata.nn.layer_stack.plan: RGAT's every layer, HGT's after the first",
    policies="recompute, keep[nodes], offload[edges], offload[dots]+in, offload[in], ...",
  )
  add_out_argument(parser, model)


def _passes(text: str) -> tuple[str, ...]:
  """--passes: 'none', or hector pass names, comma-separated."""
  if text == "none":
    return ()
  names = tuple(p.strip() for p in text.split(","))
  unknown = [p for p in names if p not in PASSES]
  if unknown or not all(names):
    raise argparse.ArgumentTypeError(
      f"unknown pass(es) {', '.join(unknown) or repr(text)}; "
      f"choose from {', '.join(PASSES)}, or 'none'"
    )
  return names


def default_classes(scale: float) -> int:
  """ogbn-mag's 349 classes, or fewer at small scales: about 100 papers per class."""
  return int(max(2, min(NUM_CLASSES, round(NUM_NODES["paper"] * scale / 100))))


def _train_offloaded(
  dataset: MagDataset, config: TrainConfig, args, console, on_epoch, minibatch=None
) -> TrainResult:
  """`train` (with `minibatch`: `minibatch.train`) under --offload: a TensorStore (--ram,
  --ssd-dir), the planner under --budget or one --plan policy for every planned layer, and a
  line on what went where."""
  store_args = {
    k: v for k, v in (("ram_bytes", args.ram), ("ssd_dir", args.ssd_dir)) if v is not None
  }
  say = lambda text: console.print(text, markup=False)  # noqa: E731
  with TensorStore(**store_args) as store:
    probed = {}
    if args.plan == "auto":
      measure = budget_planner(args.budget, store, say=say, blocks=minibatch is not None)

      def planner(model, graph, xs):
        try:
          plan = measure(model, graph, xs)
        except ValueError as e:
          raise command.UsageError(f"argument --budget: {e}") from None
        say(
          f"plan under {args.budget:,} bytes: "
          + ", ".join(
            f"layers {a}-{b - 1}: {p}" if b - a > 1 else f"layer {a}: {p}"
            for a, b, p in segments(plan, len(plan))
          )
          + f" (of the {model.stack_layers} "
          "planned layers)"
        )
        probed.update(store.stats())  # the planner's bandwidth probe spilled too
        return plan
    else:

      def planner(model, graph, xs):
        del graph, xs
        try:
          policy = layer_stack.policy_named(args.plan, store, candidates(model))
        except ValueError as e:
          raise command.UsageError(f"argument --plan: {e}") from None
        return [policy] * model.stack_layers

    if minibatch is None:
      result = train(dataset, config, plan=planner, on_epoch=on_epoch)
    else:
      result = hetero.train(dataset, config, minibatch, plan=planner, on_epoch=on_epoch)
    say(store_summary(store.stats(), probed))
  return result


def _resumer(path: str | None, config: TrainConfig, data: dict, minibatch: Any = None):
  """`common.resumer` for this trainer's checkpoints."""
  settings = minibatch_settings(minibatch)
  return resumer(
    path, kind=KINDS[config.model], config=config, data=data, settings=settings, newer=("embed",)
  )


def data_arguments(parser) -> None:
  """--data DIR and --target TYPE (shared with `jaxdata train rgcn`)."""
  parser.add_argument(
    "--data",
    metavar="DIR",
    type=command.existing_dir,
    default=None,
    help="train on a dataset folder instead of synthetic_mag: OGB's raw node-property layout "
    "or a folder of edge lists (docs/data.md)",
  )
  add_target_argument(parser)


def main(args) -> int:
  # pylint: disable=g-import-not-at-top

  if args.data is None:
    if args.target is not None:
      raise command.UsageError("argument --target: names a node type of --data DIR")
    args.scale = 0.005 if args.scale is None else args.scale
  elif args.scale is not None or args.classes is not None:
    flag = "--scale" if args.scale is not None else "--classes"
    raise command.UsageError(f"argument {flag}: for synthetic_mag, not with --data")
  console = command.console()
  console.quiet = not distributed.is_primary()  # one process reports for the job
  devices = devices_flag(args.devices)
  one_device = devices == 1 and jax.process_count() == 1
  if not one_device and args.embed and not args.minibatch:
    raise command.UsageError(
      "argument --embed: full-graph training runs on one device of one "
      "process; with --devices or several processes add --minibatch"
    )
  if args.attention_model != "rgcn" and args.hidden % args.heads:
    raise command.UsageError(
      f"argument --hidden: {args.hidden} is not a multiple of --heads {args.heads}"
    )
  if len(set(args.embed)) != len(args.embed):
    raise command.UsageError(
      f"argument --embed: a node type is named twice in {','.join(args.embed)}"
    )
  bad = [t for t in args.embed if t not in NODE_TYPES[1:]]
  if bad and args.data is None:
    raise command.UsageError(
      f"argument --embed: {', '.join(map(repr, bad))} is not a "
      f"featureless-able node type; choose from "
      f"{','.join(NODE_TYPES[1:])} (papers keep their features)"
    )
  check_offload_arguments(args)  # --budget sets args.offload
  refuse_resuming(
    args,
    args.offload or not one_device or (args.minibatch and args.embed),
    "for training on one device (not with an offload plan, several devices, or --minibatch "
    "with --embed)",
  )
  if not one_device and args.minibatch and args.offload:
    raise command.UsageError(
      "argument --budget/--offload: --minibatch with an offload plan "
      "runs on one device of one process"
    )
  if not one_device and not args.minibatch and (args.offload or args.layers != 2):
    raise command.UsageError(
      f"argument {'--layers' if args.layers != 2 else '--budget/--offload'}"
      ": several devices (the partitioned path) train two layers without "
      "an offload plan"
    )
  passes = args.passes
  config = TrainConfig(
    model=args.attention_model,
    epochs=args.epochs,
    hidden=args.hidden,
    heads=args.heads,
    learning_rate=args.lr,
    seed=args.seed,
    dtype=args.dtype,
    passes=passes,
    embed=tuple(args.embed),
    embed_dim=args.embed_dim,
    devices=devices,
    layers=args.layers,
    num_bases=getattr(args, "bases", None) or None,
  )  # rgcn's --bases
  minibatch = None
  auto = args.device_bytes == "auto"  # resolved once the tables' sizes are known
  refuse_without_minibatch(args, MINIBATCH_ONLY)
  if args.minibatch:
    options = minibatch_options(args, args.layers)
    if args.cache and args.pipeline != "host":
      raise command.UsageError(
        "argument --cache: a device cache is for --pipeline host (the "
        "device pipeline has every row on the device)"
      )
    if args.device_bytes is not None and (args.cache or args.pipeline != "host"):
      raise command.UsageError(
        "argument --device-bytes: for --pipeline host, without --cache (it sizes the cache)"
      )
    minibatch = hetero.MinibatchConfig(
      cache=args.cache,
      device_bytes=None if auto else args.device_bytes,
      **options,
    )
  t0 = time.perf_counter()
  if args.data is not None:
    try:  # read once: the default target comes from the same data
      dataset = folder_dataset(read(args.data), args.data, args.target)
    except TargetError as e:
      raise command.UsageError(f"argument --target: {e}") from None
    except (ValueError, TypeError, FileNotFoundError) as e:
      raise command.UsageError(f"argument --data: {e}") from None
    target = dataset.target
    data = {"path": os.path.abspath(args.data), "target": target}
    classes = dataset.num_classes
    unknown = [t for t in args.embed if t not in dataset.graph.node_type_names[1:]]
    if unknown:
      raise command.UsageError(
        f"argument --embed: {', '.join(map(repr, unknown))} is not a node type of --data other "
        f"than the target; its types are {', '.join(dataset.graph.node_type_names)}"
      )
    source = f"{args.data}, classifying {target}"
  else:
    classes = args.classes or default_classes(args.scale)
    data = {"scale": args.scale, "seed": args.seed, "classes": classes}
    dataset = load_dataset(data)
    source = f"scale {args.scale:g}"
  g = dataset.graph
  empty = [s for s in ("train", "val", "test") if not len(getattr(dataset, f"{s}_papers"))]
  if empty:  # accuracies over no papers would be NaN, printed and saved as results
    flag = "--data" if args.data is not None else "--scale"
    raise command.UsageError(
      f"argument {flag}: no {'/'.join(empty)} nodes to classify "
      f"({len(dataset.train_papers)} train, "
      f"{len(dataset.val_papers)} val, {len(dataset.test_papers)} test)"
      + ("" if args.data is not None else f" at scale {args.scale:g}: give a larger scale")
    )
  if auto:  # (--minibatch: checked above)
    features, embeddings = hetero.table_bytes(dataset, config.embed, config.embed_dim)
    minibatch = dataclasses.replace(minibatch, device_bytes=(features + embeddings) // 4)
    console.print(
      f"--device-bytes auto: {format_bytes(minibatch.device_bytes)}, a quarter of "
      f"the features ({format_bytes(features)}) and embeddings "
      f"({format_bytes(embeddings)})"
    )
  console.print(
    f"[bold]{dataset.name}[/] ({source}, loaded in "
    f"{time.perf_counter() - t0:.1f} s): "
    + ", ".join(f"{len(x):,} {t}" for t, x in zip(g.node_type_names, dataset.features))
    + f"; {g.num_edges:,} edges, {g.num_relations} relations; {classes} classes, "
    f"{len(dataset.train_papers):,} train / {len(dataset.val_papers):,} val / "
    f"{len(dataset.test_papers):,} test {dataset.target}"
  )
  console.print(
    f"{config.model.upper()}: {config.layers} layers, hidden {config.hidden}, "
    + (
      f"{config.num_bases or 'no'} bases, {config.dtype}, on "
      if config.model == "rgcn"
      else f"{config.heads} heads, {config.dtype}, passes "
      f"{select_passes(config.passes) or 'none'}, on "
    )
    + f"{jax.devices()[0].platform} x "
    f"{(len(jax.local_devices()) if devices is None else devices) * jax.process_count()}"
    " (the first epoch compiles the kernels)"
    + (
      f"; learnable {config.embed_dim}-wide embeddings for {', '.join(config.embed)}"
      if config.embed
      else ""
    )
  )
  with progress(console, config.model, config.epochs) as update:

    def on_epoch(r):
      update(advance=1, metrics=f"loss {r['loss']:.4f}  val acc {r['val_accuracy']:.3f}")
      console.print(
        f"epoch {r['epoch']:3d}  loss {r['loss']:.4f}  "
        f"train acc {r['train_accuracy']:.4f}  "
        f"val acc {r['val_accuracy']:.4f}  {1e3 * r['seconds']:.1f} ms"
      )

    if minibatch is not None:
      console.print(
        f"mini-batches: fanouts {minibatch.fanouts}, {minibatch.batch_size} papers "
        f"per step, graph and features in {minibatch.pipeline} memory"
      )
    try:
      if args.offload:
        result = _train_offloaded(dataset, config, args, console, on_epoch, minibatch)
      elif minibatch is None:
        result = train(
          dataset,
          config,
          on_epoch=on_epoch,
          resume=_resumer(args.resume, config, data),
          save_every=args.save_every or 0,
          on_save=lambda r: save(args.out, r, config, data),
        )
      else:
        result = hetero.train(
          dataset,
          config,
          minibatch,
          on_epoch=on_epoch,
          resume=_resumer(args.resume, config, data, minibatch),
          save_every=args.save_every or 0,
          on_save=lambda r: save(args.out, r, config, data, minibatch),
        )
    except DeviceBudgetError as e:  # a mini-batch run's device budget, with or without a plan
      raise command.UsageError(
        f"argument --device-bytes: {str(e).removeprefix('train: ')}"
      ) from None
  console.print(
    f"[bold]validation accuracy {result.val_accuracy:.4f}, test accuracy "
    f"{result.test_accuracy:.4f}[/] (chance {1 / classes:.4f}; {result.seconds:.1f} s, "
    f"last epoch {1e3 * result.history[-1]['seconds']:.1f} ms)"
    + (f"; measured {result.metrics_note}" if result.metrics_note else "")
  )
  save(args.out, result, config, data, minibatch)
  say_saved(console, args.out)
  return 0
