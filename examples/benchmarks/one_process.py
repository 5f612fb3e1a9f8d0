"""`jaxdata bench one-process`: is a one-process jax.distributed job as fast as a plain run?

The check behind scaling out: on one device, the same training with one process of a
`jax.distributed` job (`jaxdata launch -n 1 -- train ...`: the coordination service up, the
multi-process code paths live: sparse-optimizer copies, digest checks at the end, process-0
checkpointing) is no slower than the plain single-process run (`jaxdata train ...`). For each
training path this runs the same small configuration both ways, each in a fresh subprocess,
`--repeats` rounds with the order alternating (plain first in even rounds, launched first in odd
ones), and reads the steady-state time from each run's `history.json`:

* epoch trainers (sage, rgcn, rgat): the `seconds` of every epoch after the first (the first
  compiles);
* gpt: the `seconds` of every logged window after the first, divided by the steps in it.

A run's figure is the median of those; a variant's is the median over rounds; the ratio is
launched / plain of the two medians, with the min-max of the per-round ratios as its spread. Both
variants train with the same seed on the same data, so their final losses must agree: equal
where the runs are deterministic (the CPU), and on a GPU, whose atomic adds make every run
differ a little, no farther apart than the runs of one variant are from each other. Anything
else is printed loudly, marked in the table and makes the command exit with 1.

    jaxdata bench one-process --quick --paths rgcn --repeats 1 --write /tmp/one_process.md
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.common import command_line, hardware, markdown_table, print_table, write
from jaxdata import command

#: The training paths: name -> (what it exercises, quick CPU-sized args, GPU-sized args). Every
#: train command's sizes are here; `--epochs`, `--steps`, `--scale` and `--extra` override them.
PATHS = {
  "sage": (
    "GraphSAGE mini-batches, host embeddings + sparse Adam",
    [
      "train",
      "sage",
      "--nodes",
      "2000",
      "--edges",
      "16000",
      "--features",
      "8",
      "--classes",
      "4",
      "--fanouts",
      "5,5",
      "--batch-size",
      "128",
      "--hidden",
      "16",
      "--embed-dim",
      "8",
      "--table-optimizer",
      "adam",
      "--epochs",
      "4",
    ],
    ["train", "sage", "--embed-dim", "64", "--table-optimizer", "adam", "--epochs", "5"],
  ),
  "rgcn": (
    "RGCN full graph (the README's default job)",
    ["train", "rgcn", "--nodes", "2000", "--edges", "16000", "--hidden", "8", "--epochs", "6"],
    ["train", "rgcn", "--epochs", "30"],
  ),
  "rgat": (
    "RGAT mini-batches on synthetic_mag",
    [
      "train",
      "rgat",
      "--minibatch",
      "--scale",
      "0.0005",
      "--hidden",
      "8",
      "--heads",
      "2",
      "--fanouts",
      "3,3",
      "--batch-size",
      "32",
      "--epochs",
      "3",
    ],
    ["train", "rgat", "--minibatch", "--scale", "0.05", "--epochs", "4"],
  ),
  "gpt": (
    "GPT, attention residuals and layer inputs offloaded",
    [
      "train",
      "gpt",
      "--layers",
      "2",
      "--hidden",
      "32",
      "--heads",
      "2",
      "--seq",
      "16",
      "--vocab",
      "32",
      "--batch-size",
      "4",
      "--steps",
      "8",
      "--log-every",
      "2",
      "--offload",
      "--plan",
      "offload[attn]+in",
    ],
    [
      "train",
      "gpt",
      "--steps",
      "60",
      "--log-every",
      "10",
      "--offload",
      "--plan",
      "offload[attn]+in",
    ],
  ),
}
VARIANTS = ("plain", "launched")
#: Seconds one training subprocess may take.
RUN_TIMEOUT = 900


@dataclasses.dataclass
class Run:
  """One training subprocess: its steady-state seconds per epoch (or step), final loss, wall."""

  path: str
  variant: str
  round: int
  seconds: float | None = None  # median steady-state seconds per epoch / step
  final_loss: float | None = None
  wall: float = 0.0  # the whole subprocess, start-up and compile included
  error: str | None = None


def train_args(
  path: str, quick: bool, *, epochs=None, steps=None, scale=None, extra: str = ""
) -> list[str]:
  """The `train ...` arguments of `path` (without --out): the preset, then the overrides (later
  options win, as argparse reads them)."""
  args = list(PATHS[path][1 if quick else 2])
  if epochs is not None and path != "gpt":
    args += ["--epochs", str(epochs)]
  if steps is not None and path == "gpt":
    args += ["--steps", str(steps)]
  if scale is not None and path == "rgat":
    args += ["--scale", str(scale)]
  return args + shlex.split(extra)


def command_for(variant: str, args: list[str], out: str) -> list[str]:
  """The subprocess command of one variant: `jaxdata train ...` or `jaxdata launch -n 1 --
  train ...`, writing its checkpoint and history to `out`."""
  cli = [sys.executable, "-m", "jaxdata.cli"]
  if variant == "plain":
    return cli + args + ["--out", out]
  if variant == "launched":
    return cli + ["launch", "-n", "1", "--"] + args + ["--out", out]
  raise ValueError(f"command_for: variant must be one of {VARIANTS}, got {variant!r}")


def steady_seconds(history: list[dict]) -> tuple[float, str]:
  """(median steady-state seconds, unit) of a trainer's history: per epoch for records with
  `epoch`, per step for gpt's logged windows (records with `step`); the first record, which
  holds the compilation, is left out. ValueError for a history too short or without times."""
  if len(history) < 2:
    raise ValueError(
      f"steady_seconds: the history has {len(history)} record(s); at least 2 "
      f"are needed (the first compiles): run more epochs or steps"
    )
  if any("seconds" not in r for r in history):
    raise ValueError("steady_seconds: a history record has no 'seconds'")
  if "step" in history[0]:
    per = [r["seconds"] / (r["step"] - prev["step"]) for prev, r in zip(history, history[1:])]
    return statistics.median(per), "step"
  return statistics.median(r["seconds"] for r in history[1:]), "epoch"


def run_one(
  path: str, variant: str, rnd: int, args: list[str], folder: str, timeout: float = RUN_TIMEOUT
) -> tuple[Run, str]:
  """Runs one variant in a subprocess; returns its `Run` and unit ("epoch" or "step")."""
  out = os.path.join(folder, f"{path}-{variant}-{rnd}")
  cmd = command_for(variant, args, out)
  t0 = time.perf_counter()
  try:
    proc = subprocess.run(
      cmd,
      capture_output=True,
      text=True,
      timeout=timeout,
      env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
  except subprocess.TimeoutExpired:
    return Run(
      path, variant, rnd, wall=time.perf_counter() - t0, error=f"timed out after {timeout:g} s"
    ), ""
  wall = time.perf_counter() - t0
  # beside its checkpoint (for --keep), not in it: a checkpoint folder holding someone's file is
  # never replaced, and a second run into the same --keep replaces the first's checkpoints
  with open(out + ".txt", "w") as f:
    f.write(shlex.join(cmd) + "\n" + proc.stdout + proc.stderr)
  if proc.returncode != 0:
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    return Run(
      path, variant, rnd, wall=wall, error=f"exit code {proc.returncode}:\n" + "\n".join(tail)
    ), ""
  try:
    with open(os.path.join(out, "history.json")) as f:
      history = json.load(f)
    seconds, unit = steady_seconds(history)
  except (OSError, ValueError) as e:
    return Run(path, variant, rnd, wall=wall, error=str(e)), ""
  return Run(path, variant, rnd, seconds, float(history[-1]["loss"]), wall), unit


@dataclasses.dataclass
class Row:
  """One path's result over every round."""

  path: str
  args: list[str]
  unit: str
  plain: float | None  # median over rounds of the runs' steady-state seconds
  launched: float | None
  ratios: list[float]  # launched / plain, round by round
  losses: dict[str, list[float]]
  walls: dict[str, float]  # median wall seconds of the whole subprocess
  errors: list[str]

  @property
  def ratio(self) -> float | None:
    return None if not (self.plain and self.launched) else self.launched / self.plain

  @property
  def losses_equal(self) -> bool:
    every = self.losses["plain"] + self.losses["launched"]
    return bool(every) and all(v == every[0] for v in every)

  @property
  def agreement(self) -> str:
    """How the two variants' final losses compare: "yes" (every run gave the same float),
    "within spread" (they differ, but the two variants are no farther apart than the runs of
    one variant are from each other: on a GPU, atomic adds sum in a different order each run),
    "MISMATCH" (farther apart than that, or different with nothing to compare against), or
    "n/a" (a variant has no finished run)."""
    p, q = self.losses["plain"], self.losses["launched"]
    if not (p and q):
      return "n/a"
    if self.losses_equal:
      return "yes"
    gap = max(0.0, max(min(p), min(q)) - min(max(p), max(q)))  # 0 where the ranges overlap
    run_to_run = max(max(p) - min(p), max(q) - min(q))
    return "within spread" if 0 < run_to_run and gap <= run_to_run else "MISMATCH"


def summarize(path: str, args: list[str], runs: list[Run], unit: str) -> Row:
  """A path's `Row` from its runs."""
  by = {v: [r for r in runs if r.variant == v and r.error is None] for v in VARIANTS}
  med = {v: statistics.median(r.seconds for r in by[v]) if by[v] else None for v in VARIANTS}
  rounds = sorted({r.round for r in runs})
  ratios = []
  for k in rounds:
    pair = {r.variant: r.seconds for r in runs if r.round == k and r.error is None}
    if len(pair) == 2:
      ratios.append(pair["launched"] / pair["plain"])
  return Row(
    path,
    args,
    unit,
    med["plain"],
    med["launched"],
    ratios,
    {v: [r.final_loss for r in by[v]] for v in VARIANTS},
    {v: statistics.median(r.wall for r in by[v]) if by[v] else float("nan") for v in VARIANTS},
    [f"{r.variant} round {r.round}: {r.error}" for r in runs if r.error],
  )


HEADER = [
  "path",
  "unit",
  "plain (ms)",
  "launched (ms)",
  "launched / plain",
  "spread (min-max)",
  "final loss plain",
  "final loss launched",
  "equal",
  "process wall s (plain / launched)",
]


def _ms(seconds: float | None) -> str:
  return "failed" if seconds is None else f"{seconds * 1e3:.4g}"


def table_rows(rows: list[Row]) -> list[list[str]]:
  """The table's cells, as the console and the Markdown file show them."""
  out = []
  for r in rows:
    loss = {v: (f"{r.losses[v][-1]:.8g}" if r.losses[v] else "n/a") for v in VARIANTS}
    equal = r.agreement
    spread = f"{min(r.ratios):.3f}-{max(r.ratios):.3f}" if r.ratios else "n/a"
    out.append(
      [
        r.path,
        r.unit or "n/a",
        _ms(r.plain),
        _ms(r.launched),
        "n/a" if r.ratio is None else f"{r.ratio:.3f}",
        spread,
        loss["plain"],
        loss["launched"],
        equal,
        f"{r.walls['plain']:.1f} / {r.walls['launched']:.1f}",
      ]
    )
  return out


def run(
  paths: list[str],
  *,
  quick: bool,
  repeats: int,
  folder: str,
  epochs=None,
  steps=None,
  scale=None,
  extra: dict[str, str] | None = None,
  console=None,
  timeout: float = RUN_TIMEOUT,
) -> list[Row]:
  """Runs every path's two variants `repeats` rounds (paths interleaved within a round, the
  variants' order alternating between rounds); returns one `Row` per path."""
  from jaxdata.train.common import progress  # pylint: disable=g-import-not-at-top

  extra = extra or {}
  args = {
    p: train_args(p, quick, epochs=epochs, steps=steps, scale=scale, extra=extra.get(p, ""))
    for p in paths
  }
  runs: dict[str, list[Run]] = {p: [] for p in paths}
  units: dict[str, str] = {}
  total = len(paths) * repeats * len(VARIANTS)
  with progress(console, "plain vs launched", total) as update:
    for k in range(repeats):
      order = VARIANTS if k % 2 == 0 else VARIANTS[::-1]
      for p in paths:
        for v in order:
          update(metrics=f"round {k + 1}/{repeats}: {p}, {v}")
          r, unit = run_one(p, v, k, args[p], folder, timeout)
          runs[p].append(r)
          units[p] = units.get(p) or unit
          if r.error and console is not None:
            console.print(
              f"[red]{p} {v} round {k + 1} failed: {r.error}", markup=True, highlight=False
            )
          update(advance=1)
  return [summarize(p, args[p], runs[p], units.get(p, "")) for p in paths]


def markdown(rows: list[Row], hw: dict[str, str], *, quick: bool, repeats: int) -> str:
  """The Markdown page: what was run, on what, and the table."""
  on_gpu = hw["device"].startswith("gpu")
  lines = ["# One process of a jax.distributed job against a plain run", ""]
  if not on_gpu:
    lines += [
      "> Not yet measured on the H200: this table comes from a CPU run. "
      "`bash .ci/gpu build bench-one-process` writes the GPU table.",
      "",
    ]
  lines += [
    f"`{command_line()}` on {hw['device']} ({hw['host']}; {hw['software']}; {hw['date']}).",
    "",
    "With one process and one device, `jaxdata launch -n 1 -- train ...` "
    "(jax.distributed initialized, the multi-process code live) against `jaxdata train "
    "...`, the same configuration, each run a fresh subprocess, "
    f"{repeats} round(s) with the order alternating"
    f"{' (--quick: CPU-sized configurations)' if quick else ''}. Times are steady state, read from "
    "each run's `history.json`: the median `seconds` of the epochs after the first (gpt: "
    "of the logged windows after the first, per step); a variant's figure is the "
    "median over rounds, the ratio is launched / plain of those, the spread the "
    "min-max of the per-round ratios. Final loss: the last record's `loss`, of the last "
    "round; equal is yes where every run of both variants gave the same float, "
    "within spread where the runs differ but the two variants are no farther apart "
    "than one variant's runs are from each other (atomic adds on a GPU sum in a "
    "different order each run), MISMATCH otherwise. Process wall: the whole "
    "subprocess (start-up, data, compile, checkpoint), for reference only.",
    "",
  ]
  lines.append(markdown_table(HEADER, table_rows(rows)))
  lines += ["", "| path | what | train command |", "| --- | --- | --- |"]
  lines += [f"| {r.path} | {PATHS[r.path][0]} | `jaxdata {shlex.join(r.args)}` |" for r in rows]
  problems = [f"- {r.path}: {e.splitlines()[0]}" for r in rows for e in r.errors]
  problems += [
    f"- {r.path}: FINAL LOSSES DIFFER: plain {r.losses['plain']}, launched {r.losses['launched']}"
    for r in rows
    if r.agreement == "MISMATCH"
  ]
  if problems:
    lines += ["", "Problems:", ""] + problems
  return "\n".join(lines) + "\n"


def _extra(text: str) -> tuple[str, str]:
  import argparse  # pylint: disable=g-import-not-at-top

  name, sep, args = text.partition("=")
  if not sep or name not in PATHS:
    raise argparse.ArgumentTypeError(
      f"{text!r} is not PATH=ARGS with PATH one of {', '.join(PATHS)} (e.g. 'rgat=--scale 0.02')"
    )
  return name, args


def add_arguments(parser) -> None:
  parser.add_argument(
    "--paths",
    type=command.listing(command.choice(tuple(PATHS))),
    default=list(PATHS),
    help="training paths to compare, comma-separated",
  )
  parser.add_argument(
    "--repeats",
    type=command.positive_int,
    default=3,
    help="rounds of both variants (the order alternates between rounds)",
  )
  parser.add_argument(
    "--quick", action="store_true", help="CPU-sized configurations (a minute or two on a laptop)"
  )
  parser.add_argument(
    "--epochs",
    type=command.positive_int,
    default=None,
    help="epochs of sage, rgcn and rgat (at least 2: the first is left out)",
  )
  parser.add_argument(
    "--steps",
    type=command.positive_int,
    default=None,
    help="gpt's training steps (its windows are --log-every steps)",
  )
  parser.add_argument(
    "--scale", type=command.positive_float, default=None, help="rgat's synthetic_mag scale"
  )
  parser.add_argument(
    "--extra",
    type=_extra,
    action="append",
    default=None,
    metavar="PATH=ARGS",
    help="more train options for one path, e.g. 'sage=--nodes 1000000' "
    "(repeatable; they come last, so they win)",
  )
  parser.add_argument(
    "--timeout",
    type=command.positive_int,
    default=RUN_TIMEOUT,
    help="seconds one training subprocess may take",
  )
  parser.add_argument(
    "--keep",
    default=None,
    metavar="DIR",
    type=command.output_folder,
    help="keep every run's checkpoint (with its history.json) and output "
    "(beside it, .txt) under DIR (default: a temporary folder, removed)",
  )
  parser.add_argument(
    "--write",
    metavar="PATH.md",
    type=command.output_path,
    help="write the table here (e.g. docs/benchmarks/one_process.md)",
  )


def main(args) -> int:
  console = command.console()
  extra: dict[str, str] = {}
  for name, more in args.extra or []:
    extra[name] = (extra.get(name, "") + " " + more).strip()
  paths = list(dict.fromkeys(args.paths))
  with tempfile.TemporaryDirectory(prefix="jaxdata-one-process-") as tmp:
    folder = args.keep or tmp
    os.makedirs(folder, exist_ok=True)
    rows = run(
      paths,
      quick=args.quick,
      repeats=args.repeats,
      folder=folder,
      epochs=args.epochs,
      steps=args.steps,
      scale=args.scale,
      extra=extra,
      console=console,
      timeout=args.timeout,
    )
  # Only now does this process touch a JAX backend: a GPU held here would not be the runs'.
  hw = hardware()
  print_table(
    console,
    f"one process: plain vs jaxdata launch -n 1 ({hw['device']})",
    HEADER,
    table_rows(rows),
    left=("path",),
  )
  failed = False
  for r in rows:
    for e in r.errors:
      console.print(f"[red]{r.path} {e}", highlight=False)
      failed = True
    if r.agreement == "MISMATCH":
      console.print(
        f"[bold red]MISMATCH: {r.path}'s final losses differ more between the "
        f"variants than between runs of one: plain {r.losses['plain']}, launched "
        f"{r.losses['launched']}",
        highlight=False,
      )
      failed = True
  if args.write:
    write(console, args.write, markdown(rows, hw, quick=args.quick, repeats=args.repeats))
  return 1 if failed else 0
