"""What every trainer shares: its result, its epoch loop, accuracy, and a run's progress display.

result = train(...)                  # any of jaxdata.train.{attention,sage,gpt,link}
result.model, result.history         # the trained model; one record per epoch or logged step
result.metrics                       # what training measured at its end (test accuracy, ...)
result.test_accuracy                 # = result.metrics["test_accuracy"], where measured
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from jaxdata import command, distributed
from jaxdata.host import sparse
from jaxdata.host.sample import check_fanouts as check_fanout_values
from jaxdata.offload.stack import segments
from jaxdata.placement import MESH_AXIS, device_mesh, psum_flat, sharded_jit  # noqa: F401
from jaxdata.tasks import (  # noqa: F401  (the trainers' names for them)
  accuracy,
  checkpoint,
  prefetched,
  seed_batches,
)


@dataclasses.dataclass
class TrainResult:
  """A finished run: the model, its history, what it measured at the end, and the optimizer
  state (an `nnx.Optimizer`, or an optax state) that a checkpoint saves to resume from."""

  model: Any
  history: list[dict]  # per epoch (or logged step): loss, accuracies, seconds, ...
  metrics: dict[str, Any]  # measured at the end: test/val accuracy, held-out loss, ...
  seconds: float = 0.0  # the run's wall time
  optimizer: Any = None  # nnx.Optimizer or optax state
  plan: Any = None  # gpt: the per-layer remat plan it trained under
  tables: dict[str, Any] | None = None  # host tables trained in place (sage: "embedding")
  #: how `metrics` were measured where that is not on the whole evaluation set (said with them,
  #: and saved: `jaxdata eval` measures the whole graph), else ""
  metrics_note: str = ""

  @property
  def test_accuracy(self) -> float:
    return float(self.metrics["test_accuracy"])

  @property
  def val_accuracy(self) -> float:
    return float(self.metrics["val_accuracy"])


@contextlib.contextmanager
def mistakes(flag: str = "", *errors: type[Exception]) -> Iterator[None]:
  """Turns `errors` (default: ValueError) raised inside into a user's mistake: a one-line
  `command.UsageError`, naming `flag` where one is given."""
  caught = errors or (ValueError,)
  try:
    yield
  except caught as e:
    raise command.UsageError(f"argument {flag}: {e}" if flag else str(e)) from None


class LossNotFinite(FloatingPointError):
  """A run's training loss became NaN or infinite (a learning rate too large, ...): the run
  stops there, and the command saves nothing (`jaxdata.cli` prints one line, exit code 1)."""


def add_record(
  history: list[dict], record: dict, report: Callable[[dict], None] | None = None
) -> None:
  """Appends a run's `record` (an epoch's, or a logged window of steps') to `history` and passes
  it to `report`; LossNotFinite instead where its loss (or held-out loss, "val_loss") is NaN or
  infinite, so that a diverged run stops rather than train on and save NaN weights."""
  for key, what in (("loss", "training loss"), ("val_loss", "held-out loss")):
    if not math.isfinite(record.get(key, 0.0)):
      where = f"epoch {record['epoch']}" if "epoch" in record else f"step {record['step']}"
      raise LossNotFinite(
        f"the {what} became {record[key]} at {where}: the run stopped and "
        "saved nothing (a smaller learning rate may help)"
      )
  history.append(record)
  if report is not None:
    report(record)


def fit_epochs(
  epochs: int,
  run_epoch: Callable[..., Any],
  result: Callable[[list[dict], dict, float], TrainResult],
  measure: Callable[[], dict] | None = None,
  *,
  history: Sequence[dict] = (),
  unit: str = "epoch",
  seed_rows: Callable[[int], np.ndarray] | None = None,
  on_epoch: Callable[[dict], None] | None = None,
  save_every: int = 0,
  on_save: Callable[[TrainResult], None] | None = None,
  measure_saves: bool = True,
) -> TrainResult:
  """Every trainer's epoch loop: `run_epoch(epoch)` trains an epoch and returns its record (but
  the epoch's number); `result(history, metrics, seconds)` is the run as it stands, with
  `measure()`'s metrics at the end (None: none).

  `history`: a resumed run's (`resumer`); training goes on from where it ends. A trainer that
  counts steps (gpt: `unit` "step") records some of them: `run_epoch` returns None for the
  others. Mini-batch trainers give `seed_rows(epoch)`, the epoch's seed batches, drawn for
  every epoch (also those a resumed run skips, so that its order is the same);
  `run_epoch(epoch, rows, start)` then trains from batch `start` (a resumed epoch's), and the
  record says where the epoch ended ("batch" of "batches_per_epoch"). A stop request (SIGTERM,
  Ctrl-C) ends the run after the epoch in progress. `on_save(result)` gets the run so far
  every `save_every` epochs, its metrics measured then (`measure_saves`) or left empty."""
  history = list(history)
  first_epoch, first_batch = position(history, unit)
  start = time.perf_counter()
  for epoch in range(1, epochs + 1):
    rows = None if seed_rows is None else seed_rows(epoch)
    if epoch < first_epoch:
      continue
    if rows is None:
      record = run_epoch(epoch)
    else:
      skip = first_batch if epoch == first_epoch else 0
      record = run_epoch(epoch, rows, skip)
      record.update(batch=skip + record["batches"], batches_per_epoch=len(rows))
    if record is None:  # a step between records (gpt records every --log-every steps)
      continue
    add_record(history, {unit: epoch, **record}, on_epoch)
    if command.stop_requested():  # SIGTERM or Ctrl-C: the last completed epoch ends the run
      break
    if on_save is not None and save_due(save_every, epoch, epochs):
      now = measure() if measure_saves and measure is not None else {}
      on_save(result(history, now, time.perf_counter() - start))
  return result(history, {} if measure is None else measure(), time.perf_counter() - start)


def run_steps(step: Callable[[int], Any], start: int, total: int, on_batch=None) -> list:
  """`step(i)` for the batches i = `start` .. `total` - 1 of an epoch, reported to
  `on_batch(i + 1, total)`; their outputs. A stop request (SIGTERM, `command.soft_stop`) ends
  the epoch after the step in progress."""
  outs = []
  for i in range(start, total):
    outs.append(step(i))
    if on_batch is not None:
      on_batch(i + 1, total)
    if command.stop_requested():
      break
  return outs


def model_plan(plan: Any, model, *inputs) -> tuple | None:
  """The offload plan a run trains `model` with: `plan` (None, or one policy per planned
  layer, `model.stack_layers`), or the one a planner `plan(model, *inputs)` makes; ValueError
  for another count of policies."""
  if callable(plan):
    plan = plan(model, *inputs)
  if plan is not None and len(plan := tuple(plan)) != model.stack_layers:
    raise ValueError(
      f"train: the plan has {len(plan)} policies for the model's {model.stack_layers} "
      "stacked layers"
    )
  return plan


def describe_plan(plan: Sequence) -> str:
  """A plan as runs print it: "layers 0-2: keep, layer 3: offload[in]"."""
  return ", ".join(
    f"layers {a}-{b - 1}: {p}" if b - a > 1 else f"layer {a}: {p}"
    for a, b, p in segments(plan, len(plan))
  )


# ----------------------------------------------------------------------------- mini-batches
#: The relational mini-batch trainers' data pipelines: "host" (GPU-centric: graph and features
#: in pinned host memory) or "device" (all in device memory).
PIPELINES = ("host", "device")


class DeviceBudgetError(ValueError):
  """A mini-batch run's device budget (`device_bytes`) is below what the dense model and its
  optimizer state need (the CLI reports it as a mistake in --device-bytes)."""


@dataclasses.dataclass(frozen=True)
class MinibatchConfig:
  """How a relational trainer draws its batches: `fanouts` per hop (one per layer of the model: the
  trainer checks the count), `batch_size` seeds per step, the `pipeline`, the sparse optimizer of
  the tables trained in host memory (`table_optimizer`; learning rate: the model's), and
  `max_batches` to cut epochs short (benchmarks). Each trainer subclasses it."""

  fanouts: tuple[int, ...] = (10, 10)
  batch_size: int = 256
  pipeline: str = "host"
  table_optimizer: str = "adam"
  max_batches: int | None = None

  def __post_init__(self):
    if self.pipeline not in PIPELINES:
      raise ValueError(
        f"MinibatchConfig: pipeline must be one of {PIPELINES}, got {self.pipeline!r}"
      )
    # the samplers' rules, checked here so that a bad config fails before any data loads
    # (int(2.5) would train with fanout 2)
    object.__setattr__(self, "fanouts", check_fanout_values(self.fanouts, "MinibatchConfig"))
    if self.batch_size < 1:
      raise ValueError(f"MinibatchConfig: batch_size must be >= 1, got {self.batch_size}")
    if self.table_optimizer not in sparse.BY_NAME:
      raise ValueError(
        f"MinibatchConfig: table_optimizer must be one of "
        f"{tuple(sparse.BY_NAME)}, got {self.table_optimizer!r}"
      )


#: The options of `add_minibatch_arguments` and their defaults (but --batch-size's: per trainer).
MINIBATCH_DEFAULTS = {"fanouts": None, "pipeline": "host", "table_optimizer": "adam"}


def add_minibatch_arguments(
  parser, *, batch_size: int, seeds: str, tables: str, pipeline: str = "graph and features"
) -> None:
  """The `--fanouts`, `--batch-size`, `--pipeline` and `--table-optimizer` options of a
  relational trainer's `--minibatch` (`seeds`: what a seed is; `tables`: what the sparse
  optimizer trains)."""
  parser.add_argument(
    "--fanouts",
    type=command.listing(command.positive_int),
    default=MINIBATCH_DEFAULTS["fanouts"],
    help="--minibatch: in-edges sampled per node and hop, one per layer (default: 10 per layer)",
  )
  parser.add_argument(
    "--batch-size",
    type=command.positive_int,
    default=batch_size,
    help=f"--minibatch: seed {seeds} per step",
  )
  parser.add_argument(
    "--pipeline",
    choices=PIPELINES,
    default=MINIBATCH_DEFAULTS["pipeline"],
    help=f"--minibatch: {pipeline} in pinned host memory (GPU-centric) or in device memory",
  )
  parser.add_argument(
    "--table-optimizer",
    choices=tuple(sparse.BY_NAME),
    default=MINIBATCH_DEFAULTS["table_optimizer"],
    help=f"--minibatch: the sparse optimizer of {tables} (lazy Adam by "
    "default; the learning rate is --lr)",
  )


def refuse_without_minibatch(args, defaults: dict) -> None:
  """UsageError naming the first option of `defaults` (its `args` name -> its default) that was
  given a value of its own without --minibatch: training would ignore it without a word."""
  if args.minibatch:
    return
  for name, default in defaults.items():
    if getattr(args, name) != default:
      raise command.UsageError(
        f"argument --{name.replace('_', '-')}: only with --minibatch "
        f"(full-graph training has no use for it)"
      )


def check_fanouts(fanouts, batch_size: int) -> None:
  """UsageError (naming --fanouts) where a batch's last hop would sample more nodes (batch size
  times every fanout) than int32 indices can number."""
  slots = batch_size * math.prod(fanouts)
  if slots >= 2**31:
    raise command.UsageError(
      f"argument --fanouts: {','.join(map(str, fanouts))} with batches "
      f"of {batch_size} samples {slots:,} nodes at the last hop, more "
      f"than int32 indices can number (2,147,483,647)"
    )


def minibatch_options(args, layers: int) -> dict:
  """The `MinibatchConfig` fields the common `--minibatch` options give for a model of
  `layers` graph layers: one fanout per layer (default 10 each; UsageError for another count)."""
  fanouts = [10] * layers if args.fanouts is None else list(args.fanouts)
  if len(fanouts) != layers:
    raise command.UsageError(
      f"argument --fanouts: give one fanout per layer (--layers {layers}), got {len(fanouts)}"
    )
  check_fanouts(fanouts, args.batch_size)
  return dict(
    fanouts=tuple(fanouts),
    batch_size=args.batch_size,
    pipeline=args.pipeline,
    table_optimizer=args.table_optimizer,
  )


def run_epoch(
  step: Callable[[jax.Array, jax.Array], tuple],
  rows: np.ndarray,
  key: jax.Array,
  on_batch: Callable[[int, int], None] | None = None,
) -> dict:
  """One epoch of mini-batch steps: `step(seeds, key)` for every row of `rows` (batch i's key
  folded in from `key`), each returning (summed loss, correct, count, token of its table
  updates). Waits for every update, then returns the epoch's record: mean loss, train
  accuracy, seconds, batches, seeds per second."""
  t0 = time.perf_counter()
  one = lambda i: step(jnp.asarray(rows[i]), jax.random.fold_in(key, i))  # noqa: E731
  return epoch_record(run_steps(one, 0, len(rows), on_batch), t0)


def position(history: Sequence[dict], unit: str = "epoch") -> tuple[int, int]:
  """(epoch, batch) where a run with `history` goes on: the batch after its last record's
  ("batch" of "batches_per_epoch", where the record has them), else the next epoch's first
  (`unit` "step": the step after the last record's, batch 0)."""
  if not history:
    return 1, 0
  last = history[-1]
  done, of = last.get("batch"), last.get("batches_per_epoch")
  if done is not None and of is not None and done < of:
    return int(last[unit]), int(done)
  return int(last[unit]) + 1, 0


def epoch_record(sums: list, t0: float) -> dict:
  """The epoch's record from its steps' (summed loss, correct, count, token), started at
  `t0`; waits for every table update."""
  loss, correct, count = (sum(float(s[k]) for s in sums) for k in range(3))
  jax.block_until_ready([s[3] for s in sums])  # every table update has landed
  seconds = time.perf_counter() - t0
  return dict(
    loss=loss / max(count, 1),
    train_accuracy=correct / max(count, 1),
    seconds=seconds,
    batches=len(sums),
    seeds=int(count),
    seeds_per_second=count / seconds,
  )


def sampled_accuracy(
  predict: Callable[[jax.Array, jax.Array], tuple], ids: np.ndarray, batch_size: int, key: jax.Array
) -> float:
  """The accuracy on `ids` measured on mini-batches: `predict(seeds, key)` returns (correct,
  count) of one batch; NaN without ids."""
  correct = count = 0
  for i, row in enumerate(seed_batches(ids, batch_size)):
    c, n = predict(jnp.asarray(row), jax.random.fold_in(key, i))
    correct, count = correct + int(c), count + int(n)
  return correct / count if count else float("nan")


@contextlib.contextmanager
def progress(
  console, label: str, total: int | None, **fields: Any
) -> Iterator[Callable[..., None]]:
  """A progress bar for a run (`label`, `total` epochs or steps; None: unknown), yielding
  `update(advance=1, **fields)`; `fields` are shown after the bar ("metrics": a short text)."""
  fields.setdefault("metrics", "")
  columns = (
    TextColumn(label),
    BarColumn(),
    MofNCompleteColumn(),
    TextColumn("{task.fields[metrics]}"),
    TimeElapsedColumn(),
  )
  with Progress(*columns, console=console, transient=fields.pop("transient", False)) as bar:
    task = bar.add_task("run", total=total, **fields)
    yield lambda **kw: bar.update(task, **kw)


def save_result(
  path: str, kind: str, result: TrainResult, config: Any, data: dict, **more: Any
) -> str:
  """Saves a run of an NNX model as a checkpoint of `kind` (`checkpoint.save_nnx`): its model,
  optimizer state, history, metrics (and how they were measured), `config` and `data`; a step
  per record unless `more` says otherwise (`more`: `checkpoint.save`'s other arguments)."""
  return checkpoint.save_nnx(
    path,
    kind=kind,
    model=result.model,
    optimizer=result.optimizer,
    config=config,
    data=data,
    history=result.history,
    metrics=result.metrics,
    **{"step": len(result.history), "metrics_note": result.metrics_note, **more},
  )


def add_out_argument(
  parser, kind: str, model: str = "the trained model", kinds: tuple[str, ...] = ()
) -> None:
  """Every trainer's `--out DIR`: where its checkpoint goes (checked before training starts;
  a checkpoint of a kind other than `kinds`, default `kind`, is not replaced)."""
  parser.add_argument(
    "--out",
    default=f"{kind}-checkpoint",
    type=lambda text: checkpoint.out_dir(text, kinds or (kind,)),
    metavar="DIR",
    help=f"checkpoint folder for {model} (`jaxdata eval DIR` measures it again); a "
    "checkpoint of another kind already there is refused, not replaced",
  )


def add_resume_arguments(parser, every_default: int | None = 0, unit: str = "epochs") -> None:
  """Every resumable trainer's `--save-every N` and `--resume DIR` (`resumer` reads it);
  `unit`: what the run counts ("epochs", or "steps")."""
  parser.add_argument(
    "--save-every",
    type=command.natural_int,
    default=every_default,
    metavar="N",
    help=f"also save to --out every N {unit} (one device; 0: at the end)",
  )
  parser.add_argument(
    "--resume",
    metavar="DIR",
    default=None,
    help=f"continue the run saved in DIR (same flags; --{unit} counts from its start) to the "
    "parameters an uninterrupted run reaches (one device; a stopped mini-batch run goes on "
    "from the batch after its last)",
  )


def resumer(
  path: str | None,
  *,
  kind: str,
  config: Any,
  data: dict,
  settings: dict | None = None,
  newer: tuple[str, ...] = (),
  saved_config: Callable[[dict], Any] | None = None,
  restore: Callable[..., Any] | None = None,
  length: str = "epochs",
) -> Callable | None:
  """A trainer's ``resume(model, optimizer) -> history`` for `--resume path` (None without
  one): `path` must hold a checkpoint of `kind` saved with `config` (but its epochs), `data`,
  the same `settings` (`checkpoint.save`'s) and its optimizer state, with fewer epochs done than
  `config.epochs`; `command.UsageError` naming what differs otherwise. `newer`: fields of the
  configuration older checkpoints lack (`checkpoint.config_from`). `length`: the configuration's
  field that counts the run, "epochs" or "steps" (records with a "step").

  A trainer whose checkpoint is not `checkpoint.save_nnx`'s gives `saved_config(meta)` (the
  configuration the checkpoint holds, ValueError where it cannot) and `restore(meta, *state)`
  (the saved state in the form of `state`); ``resume(*state)`` then returns
  ``(restore(meta, *state), history)``."""
  if path is None:
    return None

  def refuse(why: str):
    raise command.UsageError(f"argument --resume: {path}: {why}")

  try:
    meta = checkpoint.read_meta(path)
    if saved_config is None:
      saved = checkpoint.config_from(type(config), meta["config"], newer=newer)
    else:
      saved = saved_config(meta)
  except (OSError, ValueError) as e:
    refuse(str(e))
  if meta["kind"] != kind:
    refuse(f"holds a {meta['kind']} checkpoint, this run trains {kind}")
  other = [
    f.name
    for f in dataclasses.fields(config)
    if f.name != length and getattr(saved, f.name) != getattr(config, f.name)
  ]
  if other:
    refuse(f"was trained with other settings ({', '.join(other)}): give the same flags")
  if meta["data"] != data:
    refuse(f"was trained on other data ({meta['data']})")
  if meta.get("settings", {}) != (settings or {}):
    saved_mb = meta.get("settings", {}).get("minibatch")
    refuse(
      "was trained with other mini-batch settings "
      f"({saved_mb if saved_mb is not None else 'none: full graph'})"
    )
  done = position(meta["history"], length.removesuffix("s"))[0] - 1
  if done >= getattr(config, length):
    refuse(f"has trained {done} {length} already: ask for more with --{length}")

  if not meta.get("has_optimizer"):
    refuse("holds no optimizer state to continue from")

  def resume(*state):
    if restore is not None:
      return restore(meta, *state), list(meta["history"])
    checkpoint.restore_nnx(path, meta, *state)
    return list(meta["history"])

  return resume


def refuse_resuming(args, unresumable: bool, what: str) -> None:
  """UsageError for the --resume or --save-every given to a run that cannot resume (`what`:
  the runs they are for)."""
  for flag, given in (("--resume", args.resume is not None), ("--save-every", args.save_every)):
    if given and unresumable:
      raise command.UsageError(f"argument {flag}: {what}")


def save_due(every: int, done: int, total: int) -> bool:
  """Whether a run `done` of `total` epochs (or steps) in saves now, saving `every` (0: only at
  the end, which is the trainer's own save)."""
  return bool(every) and done % every == 0 and done < total


def minibatch_settings(minibatch: Any) -> dict:
  """A checkpoint's `settings` for a run with `minibatch` (a dataclass, or None: full graph),
  as JSON gives it back."""
  if minibatch is None:
    return {}
  return json.loads(json.dumps({"minibatch": dataclasses.asdict(minibatch)}))


def add_offload_arguments(parser, *, planned: str, policies: str, per_device: str = "") -> None:
  """Every trainer's activation-offload flags: --offload (`planned`: what the planner plans,
  named in its help), --plan (`policies`: examples of policy names; a policy implies --offload),
  --budget (implies --offload; `per_device`: how the budget is shared out, if it is), --ram and
  --ssd-dir.
  `check_offload_arguments` validates them before anything runs."""
  parser.add_argument(
    "--offload",
    action="store_true",
    help=f"plan keep / offload / recompute per layer under --budget ({planned}) "
    "and train with the plan",
  )
  parser.add_argument(
    "--plan",
    default="auto",
    metavar="POLICY",
    help="'auto' (the planner, under --budget) or one policy for every "
    f"planned layer (implies --offload), as plans print them: {policies}",
  )
  parser.add_argument(
    "--budget",
    type=command.size,
    default=None,
    help="device memory for the planned layers' activations"
    f"{', ' + per_device if per_device else ''}, e.g. 2GiB (implies "
    "--offload)",
  )
  parser.add_argument(
    "--ram",
    type=command.size,
    default=None,
    help="--offload: pinned host RAM for offloaded activations, per process "
    "(shared by its devices), e.g. 8G; train gpt sizes it for its plan, up to this "
    "(default: what the plan needs); the other trainers take it as given (default 1 GiB)",
  )
  parser.add_argument(
    "--ssd-dir",
    default=None,
    metavar="DIR",
    help="--offload: a folder on local SSD for what does not fit in --ram",
  )


def check_offload_arguments(args) -> None:
  """UsageError for offload flags that cannot work; sets `args.offload` where --budget or a
  --plan policy asked for it. The planner needs a budget unless --plan names one policy;
  --ram and --ssd-dir size the store of an offload, so they need one."""
  args.offload = args.offload or args.budget is not None or args.plan != "auto"
  for flag, value in (("--ram", args.ram), ("--ssd-dir", args.ssd_dir)):
    if value is not None and not args.offload:
      raise command.UsageError(
        f"argument {flag}: only with --offload (or --budget, or --plan "
        "POLICY): without an offload plan nothing is offloaded"
      )
  if args.offload and args.plan == "auto" and args.budget is None:
    raise command.UsageError(
      "argument --offload: needs --budget (e.g. --budget 2GiB) for the planner, or --plan POLICY"
    )
  if args.ssd_dir is not None and not os.path.isdir(args.ssd_dir):
    raise command.UsageError(f"argument --ssd-dir: {args.ssd_dir!r} is not a folder")


def add_target_argument(parser) -> None:
  """`--target TYPE`: the node type a dataset folder's run classifies (`--data DIR`)."""
  parser.add_argument(
    "--target",
    default=None,
    help="--data DIR: the node type to classify (default: the one type with labels)",
  )


def say_saved(console, path: str) -> None:
  """The line every trainer ends with: where the checkpoint and its history went (with
  matplotlib installed, also a plot of the history beside it: `plot_history`)."""
  path = os.path.abspath(path)  # `--out .` is no longer "." once the folders are swapped
  plot = plot_history(path)
  console.print(
    f"checkpoint saved to {path} (history in {os.path.join(path, 'history.json')}"
    + (f", plotted in {plot}" if plot else "")
    + f"; `jaxdata eval {path}` measures it again)"
  )


def plot_history(path: str) -> str | None:
  """Draws a checkpoint's history.json as history.png beside it: the loss per epoch (or logged
  step) on the left, every accuracy, MRR or Hits@k on the right. Returns the PNG's path, or
  None where matplotlib is not installed or the history is empty."""
  try:
    import matplotlib  # optional (the plot extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional, after choosing the Agg backend
  except ImportError:
    return None
  with open(os.path.join(path, "history.json"), encoding="utf-8") as f:
    history = [r for r in json.load(f) if isinstance(r, dict)]
  if not history:
    return None
  x_key = "epoch" if all("epoch" in r for r in history) else "step"
  xs = [r.get(x_key, i + 1) for i, r in enumerate(history)]
  scores = sorted(
    {k for r in history for k in r if k.endswith(("accuracy", "mrr")) or k.startswith("hits@")}
  )
  fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2))
  left.plot(xs, [r.get("loss", float("nan")) for r in history])
  left.set(xlabel=x_key, ylabel="loss", title="training loss")
  for k in scores:
    right.plot(xs, [r.get(k, float("nan")) for r in history], label=k.replace("_", " "))
  right.set(xlabel=x_key, title="accuracy" if scores else "")
  if scores:
    right.legend(fontsize=8)
  for ax in (left, right):
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
  fig.tight_layout()
  out = os.path.join(path, "history.png")
  fig.savefig(out, dpi=100)
  plt.close(fig)
  return out


def check_copies_agree(array: np.ndarray, name: str) -> None:
  """Raises when the processes' copies of a host table differ (compares SHA-256 digests)."""
  if jax.process_count() == 1:
    return

  digest = np.frombuffer(hashlib.sha256(np.ascontiguousarray(array).tobytes()).digest(), np.uint8)
  digests = np.asarray(multihost_utils.process_allgather(digest))
  if not (digests == digests[0]).all():
    differ = [p for p in range(len(digests)) if not (digests[p] == digests[0]).all()]
    raise RuntimeError(
      f"train: the {name} table's copies differ between processes (process 0 "
      f"and {differ}): a row update did not reach every copy"
    )


# ----------------------------------------------------------------------------- full graph, a mesh
# What the trainers share to run over a mesh of devices and processes: a 1-D mesh
# (`jaxdata.placement.device_mesh`, programs over it by `sharded_jit`); the full-graph trainers
# split the graph by destination nodes over it (`jaxdata.train.partitioned`).


def devices_flag(value: int) -> int | None:
  """A trainer's `--devices` (0: all, as None), checked before anything trains: more devices than
  this process sees is a one-line usage error naming the flag."""
  local = len(jax.local_devices())
  if value > local:
    raise command.UsageError(
      f"argument --devices: {value} devices asked for, but {local} "
      f"{'is' if local == 1 else 'are'} visible to this process"
    )
  return None if value == 0 else value


class DeviceSteps:
  """One dispatch per mini-batch step on one device: what `run_epoch` does, with no host work
  between steps. The model and optimizer are split once into a state pytree (donated to each
  step, written back by `sync`); an epoch's seed rows go to the device once, and step i picks
  its row and its key ``fold_in(key, i)`` itself from a counter that lives on the device. The
  counter comes back as ``i + 1 + token`` (the step's table-update token, 0 once its writes
  are done), so the next step's reads follow this step's writes, as in `ShardedSteps`.

  ``fn(model, optimizer, *args, seeds, key) -> (summed loss, correct, count, token)`` is the
  step's body (not jitted); `args` (tables' states, the loader) are its other arguments.
  `run_epoch`'s keys and order: the same results as ``run_epoch(lambda s, k: jit(fn)(...))``.
  """

  def __init__(self, model, optimizer, fn: Callable):
    self.model, self.optimizer = model, optimizer
    graphdef, self.state = nnx.split((model, optimizer))

    def step(state, args, rows, i, key):
      model, optimizer = nnx.merge(graphdef, state)
      seeds = jax.lax.dynamic_index_in_dim(rows, i, keepdims=False)
      out = fn(model, optimizer, *args, seeds, jax.random.fold_in(key, i))
      return nnx.state((model, optimizer)), i + 1 + out[3], out

    self._step = jax.jit(step, donate_argnums=0)

  def epoch(self, args: tuple, rows: np.ndarray, key, on_batch=None, start: int = 0) -> dict:
    """One epoch over `rows` (int32[batches, batch_size]) from batch `start` (a resumed
    epoch); `epoch_record`'s record. The model and optimizer hold the trained state afterwards."""
    t0 = time.perf_counter()
    device_rows, i = jnp.asarray(rows), jnp.int32(start)

    def one(_):
      nonlocal i
      self.state, i, out = self._step(self.state, args, device_rows, i, key)
      return out

    try:
      return epoch_record(run_steps(one, start, len(rows), on_batch), t0)
    finally:  # also when interrupted: the model holds the last completed step's state
      nnx.update((self.model, self.optimizer), self.state)


# ----------------------------------------------------------------------------- mini-batches, a mesh
class ShardedSteps:
  """Data-parallel mini-batch training over `mesh` (a 1-D `device_mesh`): the steps, the
  replicated training state and the epoch and accuracy loops of a relational trainer
  (`jaxdata.train.attention.minibatch`).

  `batch_size` seeds per device; a row of seeds (`batch_size` x devices) is split over the
  mesh, and device d trains on its share with ``fold_in(fold_in(key, i), d)`` (step i), as
  GraphSAGE's steps do. The trainer gives what one device does, inside `sharded_jit`:

  - ``train_on(model, optimizer, consts, seeds, key) -> (summed loss, correct, count,
    token)``: samples its share, sums its gradients over the mesh in one all-reduce
    (`psum_flat`; check_vma is off, so each device's gradients are its own), divides them by
    the global count of valid seeds (the one-device step's mean), updates `optimizer` and the
    trainer's tables (`host.sparse` with ``axis_name=MESH_AXIS`` and ``copies=`` the
    processes); returns the global sums. The token, summed over the mesh here, feeds the next
    step's counter, so the next step's reads follow every device's writes.
  - ``correct_of(model, consts, seeds, key) -> (correct, count)`` of its share (summed here).

  `consts` (a pytree of arrays the steps read: device graph, features, labels) is replicated.
  """

  def __init__(
    self, model, optimizer, consts, mesh, batch_size: int, train_on: Callable, correct_of: Callable
  ):
    axis = MESH_AXIS
    self.mesh, self.batch_size = mesh, batch_size * mesh.devices.size
    self.replicated = NamedSharding(mesh, P())
    self.rows_sharding = NamedSharding(mesh, P(None, axis))
    graphdef, state = nnx.split((model, optimizer))
    self.model, self.optimizer = model, optimizer
    self.state = distributed.put(state, self.replicated)
    self.consts = distributed.put(consts, self.replicated)

    def share(rows, i, key):
      seeds = jax.lax.dynamic_index_in_dim(rows, i, keepdims=False)
      return seeds, jax.random.fold_in(jax.random.fold_in(key, i), jax.lax.axis_index(axis))

    def device_step(state, consts, rows, i, key):
      model, optimizer = nnx.merge(graphdef, state)
      total, correct, count, token = train_on(model, optimizer, consts, *share(rows, i, key))
      token = jax.lax.psum(token, axis)  # 0 once every device's writes are done
      return nnx.state((model, optimizer)), i + 1 + token, (total, correct, count, token)

    def device_eval(state, consts, rows, i, key):
      model, _ = nnx.merge(graphdef, state)
      return i + 1, jax.lax.psum(correct_of(model, consts, *share(rows, i, key)), axis)

    data_rows = P(None, axis)
    self._step = sharded_jit(
      device_step, mesh, (P(), P(), data_rows, P(), P()), (P(), P(), (P(), P(), P(), P()))
    )
    self._eval = sharded_jit(device_eval, mesh, (P(), P(), data_rows, P(), P()), (P(), (P(), P())))

  def _placed(self, seed_rows: np.ndarray, key):
    return (
      distributed.put(seed_rows, self.rows_sharding),
      distributed.put(np.int32(0), self.replicated),
      distributed.put(key, self.replicated),
    )

  def epoch(self, seed_rows: np.ndarray, key, on_batch=None) -> dict:
    """One epoch over `seed_rows` (int32[batches, batch_size x devices], the same in every
    process); `epoch_record`'s record."""
    t0 = time.perf_counter()
    rows, i, key = self._placed(seed_rows, key)

    def one(_):
      nonlocal i
      self.state, i, out = self._step(self.state, self.consts, rows, i, key)
      return out

    # (stop requests are for one-process runs, `command.soft_stop`: all its devices stop together)
    return epoch_record(run_steps(one, 0, len(seed_rows), on_batch), t0)

  def accuracy(self, ids: np.ndarray, key) -> float:
    """The sampled accuracy on `ids` (global node ids), `batch_size` x devices per step."""
    seed_rows = seed_batches(ids, self.batch_size)
    rows, i, key = self._placed(seed_rows, key)
    outs = []
    for _ in range(len(seed_rows)):
      i, out = self._eval(self.state, self.consts, rows, i, key)
      outs.append(out)
    correct, count = (sum(int(o[k]) for o in outs) for k in range(2))
    return correct / count if count else float("nan")

  def finish(self):
    """Writes the trained state (this process's copy) back into the model and optimizer."""
    nnx.update(
      (self.model, self.optimizer), jax.tree.map(jnp.asarray, distributed.local_value(self.state))
    )
