"""Relational node classification: `jaxdata train rgcn|rgat|hgt`, one trainer for RGCN, RGAT
and HGT over the same loops (full graph here, on sampled mini-batches in `.minibatch`, over
destination partitions in `jaxdata.train.partitioned`).

Paper classification on an ogbn-mag-shaped heterograph (`jaxdata.tasks.hetero`): predict each
paper's venue from the academic graph (papers, authors, institutions, fields of study; writes,
cites, has_topic, affiliated_with and their reverses). `jaxdata.data.synthetic_mag` draws a
graph of its shape at any scale, so the same command runs in a minute on a laptop CPU (the
default, scale 0.005) and at ogbn-mag's full size on a GPU (``--scale 1``). The models run their
relational layers through hector's generated kernels:

* ``rgat``: a per-type linear map of every node type's features to a common width, two RGAT
  layers (heads concatenated, self loop, bias, ReLU after each), a linear classifier on papers;
* ``hgt``: two HGT layers (the first reads every type's own feature width), a linear classifier
  on papers;
* ``rgcn`` (`jaxdata train rgcn --scale S`): a per-type linear map to a common width, two RGCN
  layers (a full weight per relation, or `TrainConfig.num_bases` shared bases; self loop, bias,
  ReLU after each), a linear classifier on papers.

Entity classification with RGCN (`jaxdata.tasks.rgcn`, `jaxdata train rgcn` without --scale),
the RGCN paper's setup (Schlichtkrull et al., 2018, sec. 4): two RGCN layers (16 hidden units),
Adam (learning rate 0.01) for 50 epochs, an L2 penalty on the first layer's parameters and
optionally basis decomposition, on the RDF archives (AIFB, MUTAG: featureless, one-hot node
ids) or a synthetic graph; input features, where the data has them, live in a `HostTable` and
every step gathers them with `host_gather` inside the jitted step.

Full-graph training with Adam; the loss is the cross entropy of the training nodes.

    from jaxdata.data import load_entities, synthetic_mag
    from jaxdata.tasks import rgcn
    from jaxdata.train.attention import TrainConfig, train
    result = train(synthetic_mag(scale=0.005, num_classes=32), TrainConfig(model="hgt"))
    result = train(load_entities("aifb.tgz"), rgcn.TrainConfig(epochs=50))
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
import numpy as np
import optax
from flax import nnx

from jaxdata import command, distributed
from jaxdata.data import EntityDataset, read
from jaxdata.data.mag import NODE_TYPES, NUM_CLASSES, NUM_NODES, MagDataset
from jaxdata.hector import GraphArrays
from jaxdata.hector.passes import PASSES
from jaxdata.hector.passes import select as select_passes
from jaxdata.host import HostTable, host_gather
from jaxdata.nn import layer_stack
from jaxdata.offload import TensorStore
from jaxdata.offload.store import summary as store_summary
from jaxdata.sizes import format_bytes
from jaxdata.tasks import hetero, rgcn
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
from jaxdata.train import common, partitioned
from jaxdata.train.attention import minibatch as sampled
from jaxdata.train.common import (
  MINIBATCH_DEFAULTS,
  DeviceBudgetError,
  TrainResult,
  accuracy,
  add_minibatch_arguments,
  add_offload_arguments,
  add_out_argument,
  add_resume_arguments,
  add_target_argument,
  check_offload_arguments,
  devices_flag,
  minibatch_options,
  minibatch_settings,
  mistakes,
  progress,
  refuse_resuming,
  refuse_without_minibatch,
  resumer,
  say_saved,
)

#: `jaxdata train rgcn|rgat|hgt` runs as one of several processes (`jaxdata.distributed`):
#: full-graph training with the graph partitioned by destinations over every process's devices,
#: or `--minibatch` data parallel over them (`minibatch.sharded_steps`).
MULTI_PROCESS = True
#: The tasks' configuration, data, models and measurement live in `jaxdata.tasks.hetero` and
#: `jaxdata.tasks.rgcn` (the loops share them).
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
  dataset: MagDataset | EntityDataset,
  config: TrainConfig | rgcn.TrainConfig = TrainConfig(),  # noqa: B008  (frozen)
  *,
  plan: Sequence | Planner | None = None,
  on_epoch: Callable[[dict], None] | None = None,
  resume: Callable[[nnx.Module, nnx.Optimizer], list[dict]] | None = None,
  save_every: int = 0,
  on_save: Callable[[TrainResult], None] | None = None,
) -> TrainResult:
  """Trains `config.model` on `dataset`'s training papers, or with a `jaxdata.tasks.rgcn`
  configuration the 2-layer RGCN on an entity dataset's training nodes (the paper's L2 term on
  the first layer in the loss, features gathered from a `HostTable` every step, validation
  accuracy from each step's logits on the nodes `val_fraction` holds out); returns the model
  and accuracies.

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
  entity = isinstance(config, rgcn.TrainConfig)
  if config.devices != 1 or jax.process_count() > 1:
    if plan is not None or getattr(config, "layers", 2) != 2:
      raise ValueError(
        "train: over several devices (the partitioned path) the model has two "
        "layers and no offload plan"
      )
    if resume is not None or save_every:
      raise ValueError("train: resume and save_every are for one device of one process")
    fit = partitioned.train_rgcn if entity else partitioned.train_hetero
    return fit(dataset, config, on_epoch=on_epoch)  # type: ignore[arg-type]
  graph = GraphArrays.from_graph(dataset.graph)
  task = rgcn if entity else hetero
  model = task.build_model(dataset, config, nnx.Rngs(config.seed))  # type: ignore[arg-type]
  optimizer = nnx.Optimizer(model, optax.adam(config.learning_rate), wrt=nnx.Param)
  table = None
  if isinstance(dataset, EntityDataset):
    if plan is not None:
      raise ValueError("train: an entity classifier has no layers to plan")
    fit, val = rgcn.split_validation(len(dataset.train_idx), config.val_fraction, config.seed)
    train_idx, train_y = jnp.asarray(dataset.train_idx[fit]), jnp.asarray(dataset.train_y[fit])
    val_idx, val_y = jnp.asarray(dataset.train_idx[val]), jnp.asarray(dataset.train_y[val])
    table = None if dataset.features is None else HostTable(dataset.features)
    node_ids = jnp.arange(dataset.graph.num_nodes, dtype=jnp.int32)
    inputs = None

    def logits_of(model, graph, inputs):
      del inputs  # the whole graph is one batch: every node's row is gathered from host memory
      return model(graph, None if table is None else host_gather(table, node_ids))

    def penalty(model):
      return config.l2 * rgcn.l2_penalty(model)

    def measure() -> dict:
      return rgcn.evaluate(model, dataset, graph)

  else:
    inputs = device_features(dataset, model)
    plan = common.model_plan(plan, model, graph, inputs)
    papers = dataset.node_range(dataset.target)[1]
    train_idx = jnp.asarray(dataset.train_papers)
    train_y = jnp.asarray(dataset.labels)[train_idx]
    val_idx = val_y = None  # measured after each update instead

    def logits_of(model, graph, inputs):
      return model(graph, inputs, papers, plan)

    penalty = None

    def measure() -> dict:
      return hetero.evaluate(model, dataset, graph, inputs)

  @nnx.jit
  def step(model, optimizer, graph, inputs):

    def loss_fn(model):
      logits = logits_of(model, graph, inputs)
      loss = optax.softmax_cross_entropy_with_integer_labels(logits[train_idx], train_y).mean()
      return loss if penalty is None else loss + penalty(model), logits

    (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    # Both on this epoch's logits (the model before the update): no second forward pass.
    held_out = None if val_idx is None else accuracy(logits[val_idx], val_y)
    return loss, accuracy(logits[train_idx], train_y), held_out

  def run_epoch(epoch: int) -> dict:
    del epoch
    t0 = time.perf_counter()
    loss, acc, held_out = step(model, optimizer, graph, inputs)
    record = dict(loss=float(loss), train_accuracy=float(acc), seconds=time.perf_counter() - t0)
    if val_idx is None:
      record["val_accuracy"] = measure()["val_accuracy"]
    elif len(val_idx):
      record["val_accuracy"] = float(held_out)
    return record

  try:
    return common.fit_epochs(
      config.epochs,
      run_epoch,
      lambda *run: TrainResult(model, *run, optimizer, plan),
      measure,
      history=[] if resume is None else resume(model, optimizer),
      on_epoch=on_epoch,
      save_every=save_every,
      on_save=on_save,
    )
  finally:
    if table is not None:
      # close() waits for the kernels reading the table. Not jax.effects_barrier(): on a GPU it
      # re-raises the last error of any effectful computation on the device, even one the user
      # already caught (a failed offload spill, say).
      table.close()


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
    if blocks:  # graph: sampled blocks, xs: the outermost slots' node types
      plan, stack, what = layer_stack.plan_each, model.block_stack(graph, xs), "  measuring {} ..."
    else:
      rows = [x.shape[0] for x in model.inputs(xs)]
      plan, stack, what = layer_stack.plan, model.stack(graph, rows), "  planning: {} ..."
    best, bw = plan(
      *stack,
      budget_bytes,
      store,
      candidates(model),
      tier=tier,
      repeats=repeats,
      progress=(lambda name: say(what.format(name))) if say else None,
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
  path: str,
  result: TrainResult,
  config: TrainConfig | rgcn.TrainConfig,
  data: dict,
  minibatch: Any = None,
) -> str:
  """Saves a trained RGAT / HGT / RGCN classifier as a checkpoint (`jaxdata.tasks.checkpoint`;
  kind `KINDS[config.model]`, or "rgcn" for the entity classifier); `minibatch`: the mini-batch
  settings it trained with, which a resumed run must repeat."""
  settings = minibatch_settings(minibatch)
  return common.save_result(path, _kind(config), result, config, data, settings=settings)


def _kind(config: TrainConfig | rgcn.TrainConfig) -> str:
  return KINDS[config.model] if isinstance(config, TrainConfig) else "rgcn"


# ----------------------------------------------------------------------------- the CLI
#: The options that only --minibatch uses, and their defaults (`refuse_without_minibatch`).
MINIBATCH_ONLY = dict(MINIBATCH_DEFAULTS, batch_size=1024, cache=0.0, device_bytes=None)
#: The heterograph runs' defaults. `train rgcn` leaves these options None, as it has two sets:
#: these with --scale or --data DIR, `ENTITY_DEFAULTS` on an entity dataset (`main`).
HETERO_DEFAULTS = dict(
  MINIBATCH_ONLY, epochs=40, hidden=64, lr=0.005, layers=2, embed=[], embed_dim=64, save_every=0
)
ENTITY_DEFAULTS = dict(
  epochs=50, hidden=16, lr=0.01, seeds=1, nodes=20_000, edges=200_000, relations=50, batch_size=256
)
#: `train rgcn`'s options that name or shape an entity dataset (not with --scale or --data DIR),
#: and those of the heterographs only, by their `args` names.
ENTITY_OPTIONS = ("data", "nodes", "edges", "relations", "l2", "self_loop", "bias")
ENTITY_OPTIONS += ("val_fraction", "seeds")
MAG_OPTIONS = ("classes", "layers", "embed", "embed_dim", "cache", "device_bytes")
#: The synthetic entity graph's fewest nodes: one per class (synthetic_entities draws 4) and at
#: least one labelled for training (a tenth of them, rounded).
SYNTHETIC_MIN_NODES = 6


def add_arguments(parser, model: str):
  """`jaxdata train rgat|hgt|rgcn` options. `train rgcn` classifies an entity dataset (an RDF
  archive or the built-in synthetic graph) unless --scale or --data DIR names a heterograph, and
  adds that task's options (and `jaxdata.train.link`'s, --task link)."""
  parser.set_defaults(attention_model=model)
  entity = model == "rgcn"
  default = dict.fromkeys(HETERO_DEFAULTS) if entity else HETERO_DEFAULTS
  add = parser.add_argument
  if entity:
    add(
      "--data",
      metavar="PATH",
      type=command.existing_path,
      help="an RDF entity-classification archive (aifb.tgz, mutag.tgz), or a dataset folder "
      "(OGB's raw layout or edge lists, docs/data.md; with --target); default: the built-in "
      "synthetic graph",
    )
    add(
      "--task",
      choices=("node", "link"),
      default="node",
      help="node: entity classification; link: link prediction with a DistMult decoder, "
      "filtered MRR and Hits@1/3/10 (--data: a folder of train.txt, valid.txt, test.txt "
      "triples, or an RDF archive's triples split at random; default: a synthetic knowledge "
      "graph)",
    )
    add(
      "--negatives",
      type=command.positive_int,
      default=1,
      help="--task link: corrupted triples per training triple (default: 1)",
    )
    add(
      "--eval-every",
      type=command.natural_int,
      default=0,
      help="--task link: validation MRR every this many steps (default 0: at the end)",
    )
    # the heterograph options, and their defaults where train rgat|hgt has no such flags
    parser.set_defaults(heads=4, passes=None, offload=False, plan="auto", budget=None)
    parser.set_defaults(ram=None, ssd_dir=None)
    mag = parser.add_argument_group(
      "synthetic_mag (--scale)",
      "RGCN paper classification on a synthetic ogbn-mag through the "
      "trainer of `jaxdata train rgat|hgt`: --help there says more",
    )
  else:
    add(
      "--data",
      metavar="DIR",
      type=command.existing_dir,
      default=None,
      help="train on a dataset folder instead of synthetic_mag: OGB's raw node-property "
      "layout or a folder of edge lists (docs/data.md)",
    )
    mag = parser
  add_target_argument(parser)
  mag.add_argument(
    "--scale",
    type=command.positive_float,
    default=None,
    help="synthetic_mag's share of ogbn-mag's size (default 0.005: about 9,700 nodes and "
    "211,000 edges, a minute on a 2-core CPU; 1.0: full size, about 1.9M nodes and 21M edges, "
    "for a GPU)" + ("; instead of an entity dataset" if entity else ""),
  )
  mag.add_argument(
    "--classes",
    type=command.positive_int,
    default=None,
    help="paper classes (default: ogbn-mag's 349, or fewer at small scales "
    "so that every class has about 100 papers)",
  )
  add(
    "--epochs",
    type=command.positive_int,
    default=default["epochs"],
    help="training epochs" + (" (default: 50; 40 with --scale)" if entity else ""),
  )
  add_resume_arguments(parser, every_default=default["save_every"])
  add(
    "--hidden",
    type=command.positive_int,
    default=default["hidden"],
    help="hidden features" + (" (default: 16; 64 with --scale)" if entity else ""),
  )
  mag.add_argument(
    "--layers",
    type=command.natural_int if entity else command.positive_int,
    default=default["layers"],
    help="graph layers (default 2; with --minibatch, one --fanouts entry each"
    + ("; --task link: 0 is DistMult alone)" if entity else ")"),
  )
  if not entity:
    add(
      "--heads",
      type=command.positive_int,
      default=4,
      help="attention heads (--hidden must be a multiple)",
    )
  add(
    "--lr",
    type=command.positive_float,
    default=default["lr"],
    help="Adam's learning rate" + (" (default: 0.01; 0.005 with --scale)" if entity else ""),
  )
  add("--seed", type=command.seed, default=0, help="seed of data and model (the first seed)")
  add(
    "--dtype",
    choices=("float32", "bfloat16"),
    default="float32",
    help="compute dtype (parameters stay float32)",
  )
  if not entity:
    add(
      "--passes",
      default=None,
      type=_passes,
      help="hector passes, comma-separated (reorder,compact; 'none' for none; default all)",
    )
  mag.add_argument(
    "--embed",
    type=command.listing(str),
    default=default["embed"],
    help="node types whose input is a learnable embedding instead of their features, "
    "comma-separated (ogbn-mag's featureless types: author,institution,field_of_study); "
    "with --minibatch they train in host memory with a sparse optimizer",
  )
  mag.add_argument(
    "--embed-dim",
    type=command.positive_int,
    default=default["embed_dim"],
    help="--embed: the embeddings' width",
  )
  if entity:
    _entity_arguments(parser)
  add(
    "--devices",
    type=command.natural_int,
    default=1,
    help="train over this many local devices (0: all); with several processes the mesh spans "
    "every process's devices. Full graph: the graph partitioned by destination nodes "
    "(jaxdata.train.partitioned); --minibatch: data parallel, --batch-size seeds per device",
  )
  add(
    "--minibatch",
    action="store_true",
    help="train on sampled mini-batches, graph and features in host memory "
    + ("(featureless entities: the first layer's node rows too) " if entity else "")
    + "(see jaxdata.train.attention.minibatch)",
  )
  add_minibatch_arguments(
    parser,
    batch_size=default["batch_size"],
    seeds="nodes (default 256; with --scale 1024 papers)" if entity else "papers per device",
    tables="the embedding tables (--embed)" + (" or node rows" if entity else ""),
  )
  mag.add_argument(
    "--cache",
    type=command.fraction,
    default=default["cache"],
    help="--minibatch, host pipeline: keep this fraction of each feature "
    "table's rows (its most sampled nodes) in device memory",
  )
  mag.add_argument(
    "--device-bytes",
    type=command.size_or_auto,
    default=default["device_bytes"],
    help="--minibatch, host pipeline: the device holds at most this many bytes "
    "of parameters, optimizer state and cached feature rows (e.g. 8GiB, "
    "or auto: a quarter of the feature and embedding tables; the cache "
    "gets what the dense model leaves)",
  )
  if entity:
    add_out_argument(parser, "rgcn", "the (last seed's) model", ("rgcn", "rgcn-mag", "rgcn-link"))
    return
  add_offload_arguments(
    parser,
    planned="jaxdata.nn.layer_stack.plan: RGAT's every layer, HGT's after the first",
    policies="recompute, keep[nodes], offload[edges], offload[dots]+in, offload[in], ...",
  )
  add_out_argument(parser, model)


def _entity_arguments(parser) -> None:
  """`train rgcn`'s options of the RGCN paper's setup and of the synthetic entity graph."""
  add = parser.add_argument
  add(
    "--bases",
    type=command.natural_int,
    default=None,
    help="basis decomposition with this many bases, 0 for a full weight per relation "
    "(default: the paper's setting for the archive, 30 on MUTAG and 0 on AIFB; 8 on the "
    "synthetic graph; none with --scale)",
  )
  add(
    "--l2",
    type=command.natural_float,
    default=None,
    help="L2 penalty: this times the sum of squares of the first layer's parameters is added "
    "to the loss (default: the paper's setting, 5e-4 on MUTAG and 0 on AIFB; 5e-4 on the "
    "synthetic graph)",
  )
  add(
    "--self-loop",
    choices=("separate", "basis"),
    default=None,
    help="the self-loop weight W_0: a weight of its own, or combined from the bases like a "
    "relation's (needs bases) (default: the paper's setting on AIFB and MUTAG, basis "
    "wherever there are bases; separate on the synthetic graph)",
  )
  add(
    "--bias",
    action=argparse.BooleanOptionalAction,
    default=None,
    help="add a bias in each layer (default: the paper's setting, none on AIFB and MUTAG; a "
    "bias on the synthetic graph)",
  )
  add(
    "--val-fraction",
    type=command.fraction,
    default=None,
    help="training nodes held out to report validation accuracy every epoch (default 0.2 on "
    "the synthetic graph; 0 on RDF archives, as the paper trains on the whole training set)",
  )
  add(
    "--seeds",
    type=command.positive_int,
    default=None,
    help="train this many times (seeds seed, seed+1, ...) and report the mean (default: 1)",
  )
  for name, what in (("nodes", "20,000"), ("edges", "200,000"), ("relations", "50")):
    add(
      f"--{name}",
      type=command.positive_int,
      default=None,
      help=f"synthetic graph: {name} (default: {what})",
    )


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
        with mistakes("--budget"):
          plan = measure(model, graph, xs)
        say(
          f"plan under {args.budget:,} bytes: {common.describe_plan(plan)} (of the "
          f"{model.stack_layers} planned layers)"
        )
        probed.update(store.stats())  # the planner's bandwidth probe spilled too
        return plan
    else:

      def planner(model, graph, xs):
        del graph, xs
        with mistakes("--plan"):
          policy = layer_stack.policy_named(args.plan, store, candidates(model))
        return [policy] * model.stack_layers

    if minibatch is None:
      result = train(dataset, config, plan=planner, on_epoch=on_epoch)
    else:
      result = sampled.train(dataset, config, minibatch, plan=planner, on_epoch=on_epoch)
    say(store_summary(store.stats(), probed))
  return result


def _fit(args, dataset, config, data: dict, minibatch, on_epoch) -> TrainResult:
  """`train`, or with `minibatch` `minibatch.train`, from the run saved in --resume, saving to
  --out every --save-every epochs."""
  resume = resumer(
    args.resume,
    kind=_kind(config),
    config=config,
    data=data,
    settings=minibatch_settings(minibatch),
    newer=("embed",),
  )
  save_every, on_save = args.save_every or 0, lambda r: save(args.out, r, config, data, minibatch)
  hooks = dict(on_epoch=on_epoch, resume=resume, save_every=save_every, on_save=on_save)
  if minibatch is None:
    return train(dataset, config, **hooks)
  return sampled.train(dataset, config, minibatch, **hooks)


def main(args) -> int:
  """`jaxdata train rgat|hgt|rgcn` (`jaxdata.cli` sends `train rgcn --task link` to
  `jaxdata.train.link`)."""
  if args.attention_model == "rgcn":
    folder = args.data is not None and os.path.isdir(args.data)
    if args.scale is None and not folder:
      return _train_entities(args)
    given = [
      n for n in ENTITY_OPTIONS if getattr(args, n) is not None and not (folder and n == "data")
    ]
    if given:
      what = f"the dataset folder {args.data}" if folder else "synthetic_mag"
      what += "" if folder else f" (--scale {args.scale:g})"
      raise command.UsageError(
        f"argument {_flag(given[0])}: names an entity dataset, not {what}; give one of them"
      )
    for name, value in HETERO_DEFAULTS.items():
      if getattr(args, name) is None:
        setattr(args, name, value)
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
    minibatch = sampled.MinibatchConfig(
      cache=args.cache,
      device_bytes=None if auto else args.device_bytes,
      **options,
    )
  t0 = time.perf_counter()
  if args.data is not None:
    # read once: the default target comes from the same data (a TargetError, a ValueError,
    # names --target: the inner one)
    with (
      mistakes("--data", ValueError, TypeError, FileNotFoundError),
      mistakes("--target", TargetError),
    ):
      dataset = folder_dataset(read(args.data), args.data, args.target)
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
    features, embeddings = sampled.table_bytes(dataset, config.embed, config.embed_dim)
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
    on_epoch = _epoch_printer(console, update, "val")
    if minibatch is not None:
      console.print(
        f"mini-batches: fanouts {minibatch.fanouts}, {minibatch.batch_size} papers "
        f"per step, graph and features in {minibatch.pipeline} memory"
      )
    try:
      if args.offload:
        result = _train_offloaded(dataset, config, args, console, on_epoch, minibatch)
      else:
        result = _fit(args, dataset, config, data, minibatch, on_epoch)
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


def _flag(name: str) -> str:
  return "--" + name.replace("_", "-")


def _train_entities(args) -> int:
  """`jaxdata train rgcn` on an entity dataset: the RGCN paper's setup for the archive, or the
  synthetic graph's, where the flags leave it; `--seeds` runs."""
  if args.target is not None:
    raise command.UsageError("argument --target: names a node type of --data DIR")
  given = [n for n in MAG_OPTIONS if getattr(args, n) is not None]
  if given:
    raise command.UsageError(f"argument {_flag(given[0])}: for synthetic_mag (with --scale)")
  refuse_without_minibatch(args, dict(MINIBATCH_DEFAULTS, batch_size=None))
  for name, value in ENTITY_DEFAULTS.items():
    if getattr(args, name) is None:
      setattr(args, name, value)
  console = command.console()
  console.quiet = not distributed.is_primary()  # one process reports for the job
  basis_needs_bases = command.UsageError(
    "argument --self-loop: 'basis' combines W_0 from the bases; it needs --bases of at least 1"
  )
  if args.self_loop == "basis" and args.bases == 0:
    raise basis_needs_bases
  if args.data:
    data = {"source": "rdf", "path": os.path.abspath(args.data)}
  elif args.nodes < SYNTHETIC_MIN_NODES:
    raise command.UsageError(
      f"argument --nodes: the synthetic graph needs at least {SYNTHETIC_MIN_NODES} nodes (4 "
      f"classes, and a tenth of the nodes to train on), got {args.nodes}"
    )
  else:
    data = {"source": "synthetic", "seed": args.seed}
    data.update(nodes=args.nodes, edges=args.edges, relations=args.relations)
  with mistakes("--data" if args.data else "--nodes", OSError, ValueError, EOFError):
    dataset, setup = rgcn.load_dataset(data)
  num_bases = args.bases if args.bases is not None else setup.get("num_bases")
  num_bases = num_bases or None  # --bases 0: a full weight per relation
  l2 = args.l2 if args.l2 is not None else setup.get("l2", 0.0)
  bias = args.bias if args.bias is not None else setup.get("bias", True)
  self_loop = args.self_loop or setup.get("self_loop", "separate")
  if self_loop == "basis" and num_bases is None:
    if args.self_loop:
      raise basis_needs_bases
    self_loop = "separate"  # no bases: the paper's identity relation has a full weight, W_0
  minibatch = None
  devices = devices_flag(args.devices)
  if args.minibatch:
    if args.fanouts is not None and len(args.fanouts) != 2:
      raise command.UsageError(
        f"argument --fanouts: give two fanouts (the RGCN model has two layers), got "
        f"{len(args.fanouts)}"
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
    config = rgcn.TrainConfig(
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
      on_epoch = _epoch_printer(console, update, "train", every=args.seeds == 1)
      result = _fit(args, dataset, config, data, minibatch, on_epoch)
    accuracies.append(result.test_accuracy)
    console.print(
      f"seed {seed}: test accuracy {result.test_accuracy:.4f} "
      f"({result.seconds:.1f} s; last epoch {1e3 * result.history[-1]['seconds']:.1f} ms)"
    )
  save(args.out, result, config, data, minibatch)
  if args.seeds > 1:
    console.print(
      f"[bold]test accuracy over {args.seeds} seeds: {np.mean(accuracies):.4f} "
      f"± {np.std(accuracies):.4f}[/] (population std; min {min(accuracies):.4f}, "
      f"max {max(accuracies):.4f}; per seed: "
      f"{' '.join(f'{a:.4f}' for a in accuracies)})"
    )
  say_saved(console, args.out)
  return 0


def _epoch_printer(console, update, bar: str, every: bool = True) -> Callable[[dict], None]:
  """A run's `on_epoch`: the progress bar's loss and `bar` ("train" or "val") accuracy, and
  (`every`) a line per epoch."""

  def on_epoch(r):
    update(advance=1, metrics=f"loss {r['loss']:.4f}  {bar} acc {r[bar + '_accuracy']:.3f}")
    if every:
      val = f"  val acc {r['val_accuracy']:.4f}" if "val_accuracy" in r else ""
      console.print(
        f"epoch {r['epoch']:3d}  loss {r['loss']:.4f}  "
        f"train acc {r['train_accuracy']:.4f}{val}  {1e3 * r['seconds']:.1f} ms"
      )

  return on_epoch
