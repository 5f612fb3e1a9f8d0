"""`jaxdata bench minibatch`: mini-batch GraphSAGE epochs through three data pipelines side by side.

One synthetic power-law graph (`jaxdata.data.powerlaw`), one model, one optimizer, the same
seeds and the same samples; only where the graph and features live and who samples and gathers
them differ (see jaxdata/train/sage.py):

- all-in-GPU ("device"): CSR and features in device memory;
- CPU-centric ("cpu"): the CPU samples and gathers (jaxdata's CPU kernels on XLA's thread pool,
  a prefetch thread two batches ahead) and `jax.device_put`s each batch;
- GPU-centric ("host", jaxdata): the GPU samples from the CSR and gathers features straight
  from pinned host memory inside the jitted step (each distinct node of a batch read once);
  also with the most-sampled rows in a device cache (CACHE_FRACTION of the rows).

Each run trains two short epochs of `batches` steps: the first compiles and warms up, the
second is timed. The epoch time is the timed per-batch time multiplied by the batches of a full
epoch over the training seeds (stated as extrapolated in the table).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any

import jax
import numpy as np

from benchmarks import common
from jaxdata import command
from jaxdata.data.powerlaw import powerlaw_graph
from jaxdata.host import HostGraph, HostTable, sample_neighbors
from jaxdata.train.common import seed_batches
from jaxdata.train.sage import SageConfig, lowered_step, train

#: The default graph: 10M nodes, 200M edges, 256 float32 features (10 GiB of features).
FULL = dict(nodes=10_000_000, edges=200_000_000, features=256)
QUICK = dict(nodes=100_000, edges=2_000_000, features=64)

#: The device cache of the cached GPU-centric row: this fraction of the feature rows.
CACHE_FRACTION = 0.2

#: name (for --pipelines): (label, pipeline, cache fraction)
PIPELINES = {
  "device": ("all-in-GPU", "device", 0.0),
  "cpu": ("CPU-centric", "cpu", 0.0),
  "host": ("GPU-centric (jaxdata)", "host", 0.0),
  "host-cache": (f"GPU-centric + {CACHE_FRACTION:.0%} device cache", "host", CACHE_FRACTION),
}


@dataclasses.dataclass
class Result:
  label: str
  pipeline: str
  devices: int
  batch_ms: float | None  # None: skipped (error or does not fit)
  seeds_per_second: float | None
  epoch_seconds: float | None
  loss: float | None
  note: str = ""
  repeat: int = 1


def run(
  *,
  nodes: int,
  edges: int,
  features: int,
  fanouts=(15, 10),
  batch_size: int = 1024,
  batches: int = 100,
  devices=(1,),
  classes: int = 8,
  seed: int = 0,
  pipelines=tuple(PIPELINES),
  repeats: int = 1,
  breakdown: bool = False,
  console: Any = None,
) -> tuple[list[Result], list[str], Any, Any]:
  """Generates the graph, runs the named pipelines (keys of PIPELINES) on it, the whole set
  `repeats` times (device counts interleaved inside each repeat, so that a 1-vs-2-GPU ratio
  compares runs made minutes apart at most); with `breakdown`, then splits the GPU-centric
  step into parts (`Breakdown`). Returns (results, notes, dataset, breakdown or None)."""
  log = console.print if console is not None else print
  t0 = time.perf_counter()
  table = HostTable.empty((nodes, features), np.float32)
  dataset = powerlaw_graph(
    num_nodes=nodes,
    num_edges=edges,
    feature_dim=features,
    num_classes=classes,
    seed=seed,
    features_out=table.as_numpy(),
    progress=console is not None,
  )
  log(f"graph generated in {time.perf_counter() - t0:.1f} s: {dataset.summary()}")
  results, notes = [], []
  gpus = jax.devices()
  with HostGraph(dataset.indptr, dataset.indices, features=table) as graph, table:
    for ndev in devices:
      if ndev > len(gpus):
        notes.append(f"{ndev} devices asked for, {len(gpus)} visible: skipped")
    runs = [
      (repeat, ndev, name)
      for repeat in range(1, repeats + 1)
      for name in pipelines
      for ndev in devices
      if ndev <= len(gpus)
    ]
    for repeat, ndev, name in runs:
      label, pipeline, cache = PIPELINES[name]
      if ndev > 1 and pipeline != "host":
        continue  # several devices: the GPU-centric path only (the scaling measurement)
      config = SageConfig(
        pipeline=pipeline,
        fanouts=tuple(fanouts),
        batch_size=batch_size,
        epochs=2,
        max_batches=batches,
        devices=ndev,
        cache=cache,
        seed=seed,
        evaluate=False,
      )
      per_epoch = math.ceil(len(dataset.train_nodes) / (batch_size * ndev))
      log(f"{label} on {ndev} device(s): {batches} batches x 2 epochs ...")
      try:
        r = train(dataset, config, graph=graph)
      except Exception as e:  # noqa: BLE001  out of memory, or a pipeline that cannot run
        message = str(e).splitlines()[0][:160]
        results.append(Result(label, pipeline, ndev, None, None, None, None, message, repeat))
        notes.append(f"{label} on {ndev} device(s) failed: {message}")
        continue
      timed = r.history[-1]
      batch_s = timed["seconds"] / timed["batches"]
      results.append(
        Result(
          label,
          pipeline,
          ndev,
          1e3 * batch_s,
          timed["seeds_per_second"],
          per_epoch * batch_s,
          timed["loss"],
          repeat=repeat,
        )
      )
      log(
        f"  {1e3 * batch_s:.2f} ms/batch, {timed['seeds_per_second']:,.0f} seeds/s, "
        f"loss {timed['loss']:.4f}"
      )
    parts = None
    if breakdown:
      log("breakdown of the GPU-centric step ...")
      parts = stages(dataset, graph, fanouts, batch_size, batches, seed)
  return results, notes, dataset, parts


@dataclasses.dataclass
class Breakdown:
  """The GPU-centric step split by device time (`common.step_parts`), and its link bound: the
  distinct feature rows a batch reads over PCIe at the pinned memcpy rate."""

  parts: common.StepParts
  feature_bytes: float  # per batch: distinct sampled nodes x row bytes
  memcpy_gbps: float

  @property
  def link_ms(self) -> float:
    return 1e3 * self.feature_bytes / (self.memcpy_gbps * 1e9)


def stages(dataset, graph: HostGraph, fanouts, batch_size: int, batches: int, seed: int):
  """`Breakdown` of the GPU-centric ("host") step over `batches` batches of training seeds."""
  warmup = 5
  rows = seed_batches(dataset.train_nodes, batch_size, np.random.default_rng(seed), None)
  rows = rows[: warmup + batches]
  config = SageConfig(pipeline="host", fanouts=tuple(fanouts), batch_size=batch_size, seed=seed)
  with lowered_step(dataset, config, graph, rows) as (lowered, call):
    parts = common.step_parts(lowered, call, warmup, len(rows) - warmup)
  sample = jax.jit(sample_neighbors, static_argnums=2)
  distinct = []
  for i, seeds in enumerate(rows[: min(len(rows), 8)]):
    tree = sample(graph, seeds, tuple(fanouts), jax.random.key(i))
    nodes = np.concatenate([np.asarray(n)[np.asarray(m)] for n, m in zip(tree.nodes, tree.masks)])
    distinct.append(len(np.unique(nodes)))
  row_bytes = dataset.features.shape[1] * dataset.features.dtype.itemsize
  feature_bytes = float(np.mean(distinct)) * row_bytes
  copy = int(min(max(4 * feature_bytes, 2**26), 2**30))
  return Breakdown(parts, feature_bytes, common.memcpy_gbps(copy))


def breakdown_rows(b: Breakdown) -> list[list[str]]:
  """`common.StepParts.rows` and the link bound."""
  return b.parts.rows() + [
    [
      f"link bound ({b.feature_bytes / 2**20:.1f} MiB of distinct rows at "
      f"{b.memcpy_gbps:.1f} GB/s pinned memcpy)",
      f"{b.link_ms:.3f}",
      "",
      "",
    ]
  ]


def _find(results, pipeline, devices=1, label=None, repeat=None):
  for r in results:
    if r.pipeline == pipeline and r.devices == devices and (label is None or r.label == label):
      if r.batch_ms is not None and (repeat is None or r.repeat == repeat):
        return r
  return None


def table_rows(results: list[Result]) -> tuple[list[str], list[list[str]]]:
  repeated = len({r.repeat for r in results}) > 1
  header = [
    "pipeline",
    "GPUs",
    "ms / batch",
    "seeds / s",
    "epoch s (extrapolated)",
    "vs CPU-centric",
    "vs all-in-GPU",
    "vs 1 GPU",
    "loss (epoch 2)",
  ]
  rows = []
  for r in results:
    cpu, dev = _find(results, "cpu", repeat=r.repeat), _find(results, "device", repeat=r.repeat)
    label = f"{r.label}, run {r.repeat}" if repeated else r.label
    if r.batch_ms is None:
      rows.append([label, str(r.devices), "failed", "", "", "", "", "", r.note])
      continue
    one = _find(results, r.pipeline, 1, r.label, r.repeat)
    rows.append(
      [
        label,
        str(r.devices),
        f"{r.batch_ms:.2f}",
        f"{r.seeds_per_second:,.0f}",
        f"{r.epoch_seconds:.2f}",
        f"{cpu.epoch_seconds / r.epoch_seconds:.2f}x faster" if cpu else "",
        f"{r.epoch_seconds / dev.epoch_seconds:.2f}x the time" if dev else "",
        f"{r.seeds_per_second / one.seeds_per_second:.2f}x throughput"
        if one and r.devices > 1
        else "",
        f"{r.loss:.4f}",
      ]
    )
  return header, rows


def markdown(
  results: list[Result],
  notes: list[str],
  dataset: Any,
  command: str,
  fanouts,
  batch_size: int,
  batches: int,
  breakdown: Breakdown | None = None,
) -> str:
  hw = common.hardware()
  header, rows = table_rows(results)
  text = [
    "# Mini-batch GraphSAGE from host memory: three pipelines",
    "",
    "Measured by `jaxdata bench minibatch` (examples/benchmarks/minibatch.py). GraphSAGE (mean "
    f"aggregator, {len(fanouts)} layers, hidden 256, Adam), fanouts {tuple(fanouts)}, "
    f"{batch_size} seeds per GPU per batch; the same seeds and the same samples in every "
    "pipeline. *all-in-GPU*: graph and features in device memory. *CPU-centric*: jaxdata's "
    "multithreaded CPU sampler and gather, a prefetch thread two batches ahead, "
    "`jax.device_put`. *GPU-centric*: the GPU samples and gathers straight from pinned host "
    "memory inside the jitted step (zero-copy), each distinct node of a batch read once; "
    f"*device cache*: the {CACHE_FRACTION:.0%} of the feature rows with the highest "
    "out-degree (those most often sampled) are kept in device memory "
    f"({CACHE_FRACTION * dataset.features.nbytes / 2**30:.1f} GiB) and only the rest are read from "
    f"the host. Each run: 2 epochs of {batches} batches, the second timed; the epoch time is that "
    "per-batch time times the batches of a full epoch over the training seeds.",
    "",
    f"Command: `{command}`",
    "",
    *[f"- {k}: {v}" for k, v in hw.items()],
    "",
    "```",
    dataset.summary(),
    "```",
    "",
    common.markdown_table(header, rows),
    "",
  ]
  if breakdown is not None:
    text += [
      "## Where the GPU-centric step's time goes",
      "",
      "`--breakdown`: the GPU-centric step, compiled once, runs batches queued back to back "
      "(the steady step); a `jax.profiler` trace of the same program compiled without command "
      "buffers attributes each kernel, copy and memset to a part by its named scope. Device "
      "ms per step; the parts may overlap on the device's streams.",
      "",
      common.markdown_table(common.PARTS_HEADER, breakdown_rows(breakdown)),
      "",
      "The busiest kernels, with the last scopes of their op names:",
      "",
      common.markdown_table(common.KERNELS_HEADER, breakdown.parts.kernel_rows()),
      "",
    ]
  if notes:
    text += [*(f"- {n}" for n in notes), ""]
  return "\n".join(text)


# ----------------------------------------------------------------------------- the CLI
def add_arguments(parser) -> None:
  """`jaxdata bench minibatch` options."""
  parser.add_argument(
    "--nodes",
    type=command.positive_int,
    help=f"graph nodes (default {FULL['nodes']:,}; --quick {QUICK['nodes']:,})",
  )
  parser.add_argument(
    "--edges",
    type=command.positive_int,
    help=f"graph edges (default {FULL['edges']:,}; --quick {QUICK['edges']:,})",
  )
  parser.add_argument(
    "--features",
    type=command.positive_int,
    help=f"feature size (default {FULL['features']}; --quick {QUICK['features']})",
  )
  parser.add_argument(
    "--fanouts",
    type=command.listing(command.positive_int),
    default=[15, 10],
    help="neighbours sampled per hop, comma-separated",
  )
  parser.add_argument(
    "--batch-size", type=command.positive_int, default=1024, help="seeds per device per batch"
  )
  parser.add_argument(
    "--batches", type=command.positive_int, help="batches per timed epoch (default 100; --quick 10)"
  )
  parser.add_argument(
    "--device-counts",
    type=command.listing(command.positive_int),
    default=[1, 2],
    help="GPU counts to run the GPU-centric path on (counts above the visible GPUs are skipped)",
  )
  parser.add_argument(
    "--pipelines",
    type=command.listing(command.choice(tuple(PIPELINES))),
    default=list(PIPELINES),
    help="pipelines to run, comma-separated, from: " + ", ".join(PIPELINES),
  )
  parser.add_argument(
    "--repeats",
    type=command.positive_int,
    default=1,
    help="run the whole set this many times (each repeat's GPU counts side by side)",
  )
  parser.add_argument(
    "--breakdown",
    action="store_true",
    help="also split the GPU-centric step into parts (sampling, gathers, forward, backward, "
    "optimizer) by device time, with its link bound",
  )
  parser.add_argument(
    "--quick", action="store_true", help="a small graph and 10 batches (flags given still apply)"
  )
  parser.add_argument(
    "--write", metavar="PATH.md", type=command.output_path, help="write the table here"
  )


def main(args) -> int:
  """`jaxdata bench minibatch`."""
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  size = {k: common.pick(getattr(args, k), args.quick, QUICK[k], FULL[k]) for k in FULL}
  batches = common.pick(args.batches, args.quick, 10, 100)
  if min(args.device_counts) > (visible := len(jax.devices())):  # before drawing the graph
    raise command.UsageError(
      f"argument --device-counts: every count is above the {visible} "
      f"device(s) visible, so nothing would be measured"
    )
  console = command.console(width=160)
  results, notes, dataset, parts = run(
    **size,
    fanouts=args.fanouts,
    batch_size=args.batch_size,
    batches=batches,
    devices=args.device_counts,
    pipelines=args.pipelines,
    repeats=args.repeats,
    breakdown=args.breakdown,
    console=console,
  )
  common.check_measured(results, notes)
  common.print_table(
    console,
    "mini-batch GraphSAGE: epoch through three pipelines",
    *table_rows(results),
    notes,
    left=("pipeline",),
  )
  if parts is not None:
    common.print_table(
      console,
      "the GPU-centric step: device time by part",
      common.PARTS_HEADER,
      breakdown_rows(parts),
      [],
      left=("part of the step",),
    )
    common.print_table(
      console,
      "the GPU-centric step's busiest kernels",
      common.KERNELS_HEADER,
      parts.parts.kernel_rows(40),
      [],
      left=("part", "kernel [op]"),
    )
  if args.write:
    common.write(
      console,
      args.write,
      markdown(
        results,
        notes,
        dataset,
        common.command_line(),
        args.fanouts,
        args.batch_size,
        batches,
        parts,
      ),
    )
  return 0
