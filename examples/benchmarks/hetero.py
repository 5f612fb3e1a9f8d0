"""`jaxdata bench hetero`: mini-batch RGAT / HGT on a heterograph through four pipelines.

One `synthetic_mag` graph (ogbn-mag's shape), one model of `jaxdata.train.attention` (same
widths, same init seed, Adam), the same seed batches in the same order, the same fanouts;
what differs is where the graph and features live and who samples and gathers:

- "host" (GPU-centric, jaxdata): graph (with relations) and every node type's features in
  pinned host memory; inside the jitted step the GPU samples the blocks
  (`loader.sample_blocks`, zero-copy), gathers the features (`host.gather_typed`) and runs the
  model on the blocks. This is `jaxdata train rgat|hgt --minibatch`'s step.
- "host-cache": the same, with the CACHE_FRACTION most sampled rows of each feature table in a
  device cache (`host.type_caches`, `gather_typed(..., caches)`): only the others cross PCIe.
- "device" (all-in-GPU, jaxdata): the same step with graph and features in device memory.
- "cpu" (CPU-centric): `sample_blocks` + `gather_typed` jitted on the CPU (jaxdata's CPU
  kernels: the same samples for the same key), `jax.device_put` of the blocks and features, a
  jitted step that takes them; a prefetch thread keeps batches ahead, as `jaxdata.train.sage`'s
  CPU-centric feed does.
- "pyg": PyG's HGTConv (--model hgt) or RGATConv (--model rgat) of the same widths on CUDA
  (the CPU where torch sees none), fed `HeteroData` mini-batches by
  `benchmarks.pyg_sampler`, a NumPy stand-in for NeighborLoader (whose sampler needs
  pyg-lib or torch-sparse); sampling and batch building on a prefetch thread, `.to(device)`
  and the step in the loop. NeighborLoader draws `fanout` in-edges per node *per edge type*,
  jaxdata `fanout` per node over all relations: PyG's batches are larger (the table shows
  the edges per batch of each).

Each pipeline runs `warmup` batches (compiling), then times `batches` batches: wall time from
the first dispatch to the last result, per batch. The epoch time is that times the batches of
a full epoch over the training papers (extrapolated; the table says so).

The link bound: the feature bytes a GPU-centric step reads from host memory (the valid slots
of the outermost frontier times their type's row bytes; mean over the timed batches), divided
by the pinned host-to-device memcpy bandwidth measured in the same run (`host_slice` of a
pinned `HostTable`, one DMA copy). The GPU-centric step's ratio to it is what is left to win.

    results, link, notes, dataset = run(scale=0.01, model="hgt", batches=5)
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from benchmarks import common
from jaxdata import command
from jaxdata.loader import Batch, Loader
from jaxdata.loader.blocks import node_types
from jaxdata.train.attention import MODELS, TrainConfig, build_model, default_classes
from jaxdata.train.attention.minibatch import make_loader, summed_loss, table_bytes
from jaxdata.train.common import prefetched, seed_batches

#: ogbn-mag's size: 1.9M nodes, 42M edges (with reverses); --quick: a small graph.
FULL = dict(scale=1.0, batches=50, warmup=5)
QUICK = dict(scale=0.01, batches=10, warmup=2)
#: name (for --pipelines): label
#: The device cache of the cached GPU-centric row: this fraction of each feature table's rows.
CACHE_FRACTION = 0.2
PIPELINES = {
  "host": "GPU-centric (jaxdata)",
  "host-cache": f"GPU-centric + {CACHE_FRACTION:.0%} device cache (jaxdata)",
  "device": "all-in-GPU (jaxdata)",
  "cpu": "CPU-centric (CPU sampling + device_put)",
  "pyg": "PyG (NumPy NeighborLoader stand-in)",
}
#: Batches `--breakdown` times (after the warm-up batches), and its table's header.
BREAKDOWN_BATCHES = 20
#: Bytes copied to measure the pinned memcpy bandwidth (CPU: less).
COPY_BYTES = 1 << 30
CPU_COPY_BYTES = 64 << 20
#: Batches a prefetch thread keeps ready (sage's CPU-centric feed keeps two).
PREFETCH = 2
#: The DESIGN.md figure: PyTorch's pinned copy_ on the H200 machine, timed with CUDA events.
DESIGN_MEMCPY_GBPS = 55.5


@dataclasses.dataclass
class Result:
  name: str
  label: str
  batch_ms: float | None = None  # None: skipped (see note)
  seeds_per_second: float | None = None
  epoch_seconds: float | None = None
  loss: float | None = None  # mean over the timed batches
  edges_per_batch: float | None = None  # sampled edges (valid), mean over the timed batches
  feature_bytes: float | None = None  # jaxdata: feature bytes gathered per batch, mean
  losses: list[float] = dataclasses.field(default_factory=list)
  note: str = ""


@dataclasses.dataclass
class LinkBound:
  feature_bytes: float  # per GPU-centric batch, mean
  memcpy_gbps: float  # measured now
  copy_bytes: int

  @property
  def batch_ms(self) -> float:
    return 1e3 * self.feature_bytes / (self.memcpy_gbps * 1e9)


# ----------------------------------------------------------------------------- jaxdata's steps
def batch_loss(model, batch: Batch) -> jax.Array:
  """Mean cross entropy of the valid seeds (as `train.attention.minibatch.train`'s step)."""
  total, (_, count) = summed_loss(model, batch)
  return total / jnp.maximum(count, 1)


def batch_stats(
  blocks, type_offsets, row_bytes: Sequence[int], caches=None
) -> tuple[jax.Array, jax.Array]:
  """(sampled edges, feature bytes gathered) of a batch: the real edges of all blocks (padding
  edges have norm 0), and the valid slots of the outermost frontier times their node type's
  row bytes (what `gather_typed` reads; the link bound's numerator), less the rows a device
  cache holds (`caches`, one per type or None)."""
  edges = sum((g.norm > 0).sum() for g in blocks.graphs)
  nodes = blocks.nodes[-1]
  types = node_types(type_offsets, nodes)
  valid = blocks.masks[-1] & (types >= 0)
  for t, cache in enumerate(caches or ()):
    if cache is not None:
      valid = valid & ~(cache.lookup(nodes - type_offsets[t], valid & (types == t)) >= 0)
  per_type = jnp.asarray(np.asarray(row_bytes, np.float32))
  return edges, jnp.sum(jnp.where(valid, per_type[jnp.maximum(types, 0)], 0))


def _whole_loss(offsets, row_bytes: Sequence[int], caches) -> Callable:
  """``loss_of(model, i, loader, all_rows, key)`` of the GPU-centric and all-in-GPU steps: batch
  i's seed row (``i`` modulo the rows) and key picked on the device (one dispatch per step), the
  batch sampled and gathered in the step."""

  def whole(model, i, loader, all_rows, key):
    seeds = jax.lax.dynamic_index_in_dim(all_rows, i % all_rows.shape[0], keepdims=False)
    batch = loader.sample(seeds, jax.random.fold_in(key, i))
    return batch_loss(model, batch), batch_stats(batch.blocks, offsets, row_bytes, caches)

  return whole


def _trainer(dataset, config: TrainConfig):
  """The state of a fresh model and its Adam, and `make(loss_of)`: a jitted update
  ``step(state, i, *args) -> (state, i + 1, loss, stats)`` from
  ``loss_of(model, i, *args) -> (loss, stats)``. `i`, the batch counter, lives on the device
  and comes back incremented, so that a step that picks its own seeds and key needs no other
  dispatch (the lesson of docs/benchmarks/minibatch_notes.md)."""
  model = build_model(dataset, config, nnx.Rngs(config.seed))
  optimizer = nnx.Optimizer(model, optax.adam(config.learning_rate), wrt=nnx.Param)
  graphdef, state = nnx.split((model, optimizer))

  def make(loss_of):
    @functools.partial(jax.jit, donate_argnums=0)
    def step(state, i, *args):
      model, optimizer = nnx.merge(graphdef, state)
      (loss, stats), grads = nnx.value_and_grad(loss_of, has_aux=True)(model, i, *args)
      with jax.named_scope("optimizer"):  # a part of the step (`stages`)
        optimizer.update(model, grads)
      return nnx.state((model, optimizer)), i + 1, loss, stats

    return step

  return state, make


def _timed(
  run_batches: Callable[[np.ndarray, int], list], rows: np.ndarray, warmup: int
) -> tuple[float, list]:
  """Runs the warm-up rows, then times the rest; `run_batches(rows, first_index)` returns the
  batches' outputs with every result ready. Returns (seconds, timed outputs)."""
  if warmup:
    run_batches(rows[:warmup], 0)
  t0 = time.perf_counter()
  out = run_batches(rows[warmup:], warmup)
  return time.perf_counter() - t0, out


def _jaxdata(
  name: str, dataset, config: TrainConfig, fanouts, rows, warmup, key, on_batch
) -> tuple[float, list, dict]:
  """Pipeline `name` ("host", "host-cache", "device", "cpu"): (timed seconds,
  (loss, edges, feature bytes) per timed batch, {"blocks", "features"}: bytes each batch moves to
  the device ("cpu"))."""
  fanouts = tuple(int(f) for f in fanouts)
  row_bytes = [x.shape[1] * x.dtype.itemsize for x in dataset.features]
  state, make = _trainer(dataset, config)
  # Every argument committed to the device from the first call on: an uncommitted first
  # state or counter would compile the step again in the timed run.
  gpu = jax.devices()[0]
  state, key = jax.device_put((state, key), gpu)
  counter = lambda first: jax.device_put(np.int32(first), gpu)  # noqa: E731
  with make_loader(
    dataset,
    "device" if name == "device" else "host",
    fanouts,
    cache=CACHE_FRACTION if name == "host-cache" else 0.0,
  ) as loader:
    offsets = loader.type_offsets

    def given(model, i, batch):
      del i
      return batch_loss(model, batch), batch_stats(batch.blocks, offsets, row_bytes)

    holder, moved = {"state": state}, {}
    if name in ("host", "host-cache", "device"):
      step = make(_whole_loss(offsets, row_bytes, loader.caches))
      all_rows = jax.device_put(rows, gpu)

      def run_batches(part, first):
        out, i = [], counter(first)
        for _ in part:
          holder["state"], i, loss, stats = step(holder["state"], i, loader, all_rows, key)
          out.append((loss, stats))
          on_batch()
        return jax.block_until_ready(out)
    else:  # "cpu"
      step = make(given)
      cpu = jax.devices("cpu")[0]
      on_cpu = jax.jit(Loader.sample)
      cpu_loader, cpu_key = jax.device_put((loader, key), cpu)

      def batches(part, first):
        for i, row in enumerate(part):
          seeds = jax.device_put(row, cpu)
          batch = on_cpu(cpu_loader, seeds, jax.random.fold_in(cpu_key, first + i))
          moved["blocks"] = sum(a.nbytes for a in jax.tree.leaves(batch.blocks))
          moved["features"] = sum(a.nbytes for a in batch.inputs)
          yield jax.device_put(batch, gpu)

      def run_batches(part, first):
        out, i = [], counter(first)
        for batch in prefetched(batches(part, first), PREFETCH):
          holder["state"], i, loss, stats = step(holder["state"], i, batch)
          out.append((loss, stats))
          on_batch()
        return jax.block_until_ready(out)

    seconds, out = _timed(run_batches, rows, warmup)
  return (
    seconds,
    [(float(loss), float(edges), float(nbytes)) for loss, (edges, nbytes) in out],
    moved,
  )


def _trained(
  name: str,
  dataset,
  config: TrainConfig,
  fanouts,
  batch_size: int,
  batches: int,
  device_bytes: int | None,
  on_batch,
) -> tuple[float, list, dict]:
  """Pipeline "host" or "host-cache" with learnable embeddings and a device budget: the steps of
  `jaxdata train rgat|hgt --minibatch` itself (`minibatch.train`, embedding tables trained in
  host memory by the sparse optimizer, no table on the device), two epochs of `batches`
  batches, the first compiling; the second is timed. "host" caches nothing; "host-cache" sizes
  its feature cache to `device_bytes`. Returns (timed seconds, (loss, None, None) of the timed
  epoch, {"state", "cache", "fraction", "peak"}: device bytes)."""
  from jaxdata.train.attention import minibatch  # pylint: disable=g-import-not-at-top

  config = dataclasses.replace(config, epochs=2)
  options = minibatch.MinibatchConfig(
    fanouts=tuple(int(f) for f in fanouts),
    batch_size=batch_size,
    max_batches=batches,
    device_bytes=device_bytes if name == "host-cache" else None,
  )
  result = minibatch.train(
    dataset,
    config,
    options,
    on_batch=lambda *_: on_batch(),
    final_evaluation="none",
    validate=False,
  )
  r = result.history[-1]
  return (
    r["seconds"],
    [(r["loss"], None, None)] * r["batches"],
    {
      "state": r["device_state_bytes"],
      "cache": r["cache_bytes"],
      "fraction": r["cache_fraction"],
      "peak": peak_device_bytes(),
    },
  )


def peak_device_bytes() -> int | None:
  """The device's peak bytes in use so far (`memory_stats`), None where it reports none."""
  try:
    stats = jax.devices()[0].memory_stats() or {}
  except Exception:  # noqa: BLE001  not every backend has memory stats
    stats = {}
  return stats.get("peak_bytes_in_use")


def host_bytes_estimate(scale: float, embed: Sequence[str] = (), embed_dim: int = 64) -> int:
  """Host memory a scaled run needs at its peak, estimated: per edge (with reverses) the
  HeteroGraph's three int32 arrays, the sort's temporaries (three more) and the HostGraph's
  two tables; the features twice (dataset and host tables); embeddings four times (initial,
  host table, Adam's two moments)."""
  from jaxdata.data import mag  # pylint: disable=g-import-not-at-top

  edges = 2 * sum(mag.NUM_EDGES.values()) * scale
  features = sum(mag.NUM_NODES[t] * mag.FEATURE_DIMS[t] * 4 for t in mag.NODE_TYPES) * scale
  embeddings = sum(mag.NUM_NODES[t] * embed_dim * 4 for t in embed) * scale
  return int(edges * 4 * 8 + 2 * features + 4 * embeddings)


def _pyg(
  dataset, config: TrainConfig, fanouts, rows, warmup, seed, on_batch
) -> tuple[float, list, dict]:
  """The PyG pipeline: (timed seconds, (loss, edges, None) per timed batch, {"ran on"})."""
  import torch  # pylint: disable=g-import-not-at-top

  from benchmarks import pyg_sampler  # pylint: disable=g-import-not-at-top
  from jaxdata.reference.pyg import torch_device  # pylint: disable=g-import-not-at-top

  device = torch_device()
  sampler = pyg_sampler.HeteroNeighborSampler(dataset)
  model = pyg_sampler.pyg_model(config.model, dataset, config.hidden, config.heads, config.seed).to(
    device
  )
  opt = torch.optim.Adam(model.parameters(), lr=config.learning_rate)
  rng = np.random.default_rng(seed)
  paper0 = dataset.node_range("paper")[0]

  def batches(part):
    for row in part:
      sampled = sampler.sample(row[row >= 0] - paper0, fanouts, rng)
      yield pyg_sampler.hetero_data(sampled, dataset), sampled.num_edges

  def run_batches(part, first):
    del first
    out = []
    for data, edges in prefetched(batches(part), PREFETCH):
      data = data.to(device)
      opt.zero_grad(set_to_none=True)
      n = data["paper"].batch_size
      logits = model(data.x_dict, data.edge_index_dict)[:n]
      loss = torch.nn.functional.cross_entropy(logits, data["paper"].y)
      loss.backward()
      opt.step()
      out.append((loss.detach(), edges))
      on_batch()
    if device.type == "cuda":
      torch.cuda.synchronize(device)
    return out

  seconds, out = _timed(run_batches, rows, warmup)
  import torch_geometric  # pylint: disable=g-import-not-at-top

  where = f"{device}" + (
    f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""
  )
  return (
    seconds,
    [(float(loss.item()), float(edges), None) for loss, edges in out],
    {
      "ran on": f"{where}, torch {torch.__version__}, torch_geometric {torch_geometric.__version__}"
    },
  )


# ----------------------------------------------------------------------------- where the time goes
def stages(
  dataset, config: TrainConfig, fanouts, rows: np.ndarray, warmup: int, key
) -> common.StepParts:
  """The GPU-centric step (the "host" pipeline's program) split into parts by device time: a
  `jax.profiler` trace of the steady step attributes every kernel, copy and memset to a part
  (`common.part_of`) through its HLO instruction's named scope; the steady step is `rows`
  queued back to back after `warmup`."""
  fanouts = tuple(int(f) for f in fanouts)
  row_bytes = [x.shape[1] * x.dtype.itemsize for x in dataset.features]
  state, make = _trainer(dataset, config)
  gpu = jax.devices()[0]
  state, key = jax.device_put((state, key), gpu)
  with make_loader(dataset, "host", fanouts) as loader:
    all_rows = jax.device_put(rows, gpu)
    step = make(_whole_loss(loader.type_offsets, row_bytes, loader.caches))
    i = jax.device_put(np.int32(0), gpu)
    lowered = step.lower(state, i, loader, all_rows, key)
    holder = {"state": state, "i": i}

    def call(program):
      holder["state"], holder["i"], loss, _ = program(
        holder["state"], holder["i"], loader, all_rows, key
      )
      return loss

    return common.step_parts(lowered, call, warmup, len(rows) - warmup)


# ----------------------------------------------------------------------------- the link bound
# ----------------------------------------------------------------------------- the run
def _seed_rows(dataset, batch_size: int, count: int, seed: int) -> np.ndarray:
  """`count` batches of training papers (global ids), shuffled epoch after epoch as needed."""
  rng = np.random.default_rng(seed)
  ids = np.asarray(dataset.train_papers) + dataset.node_range("paper")[0]
  parts, have = [], 0
  while have < count:
    part = seed_batches(ids, batch_size, rng, count - have)
    parts.append(part)
    have += len(part)
  return np.concatenate(parts)


def _fits_on_device(dataset) -> str | None:
  """Why the all-in-GPU copy cannot fit, or None (where the device reports its memory)."""
  g = dataset.graph
  need = sum(x.nbytes for x in dataset.features) + g.num_edges * 12 + g.num_nodes * 8
  try:
    stats = jax.devices()[0].memory_stats() or {}
  except Exception:  # noqa: BLE001  not every backend has memory stats
    stats = {}
  limit = stats.get("bytes_limit")
  if limit and need > 0.8 * (limit - stats.get("bytes_in_use", 0)):
    return f"graph and features need {need / 2**30:.1f} GiB, the device has {limit / 2**30:.1f}"
  return None


def run(
  *,
  scale: float,
  model: str = "hgt",
  fanouts=(10, 10),
  batch_size: int = 1024,
  batches: int = 50,
  warmup: int = 5,
  pipelines: Sequence[str] = tuple(PIPELINES),
  classes: int | None = None,
  hidden: int = 64,
  heads: int = 4,
  seed: int = 0,
  copy_bytes: int | None = None,
  console: Any = None,
  embed: Sequence[str] = (),
  embed_dim: int = 64,
  device_bytes: int | str | None = None,
) -> tuple[list[Result], LinkBound | None, list[str], Any]:
  """Generates the graph, runs the named pipelines on it in turn; returns (results, link bound
  or None when "host" was not run, notes, dataset). A pipeline that cannot run gives a row
  with its reason, never an exception.

  With `embed` (node types given learnable `embed_dim`-wide embeddings) or `device_bytes` (a
  byte count, or "auto": a quarter of the features and embeddings), "host" and "host-cache"
  run `jaxdata train rgat|hgt --minibatch`'s own steps (`_trained`): tables in host memory
  only, the device holding at most `device_bytes` of parameters, optimizer state and cached
  rows; the notes give the table totals, the budget, the graph's construction time and each
  pipeline's device bytes and peak device memory."""
  from jaxdata.data import synthetic_mag  # pylint: disable=g-import-not-at-top
  from jaxdata.host import HostGraph  # pylint: disable=g-import-not-at-top
  from jaxdata.sizes import format_bytes  # pylint: disable=g-import-not-at-top

  log = console.print if console is not None else print
  budgeted = bool(embed) or device_bytes is not None
  notes = []
  if budgeted:
    need = host_bytes_estimate(scale, embed, embed_dim)
    notes.append(f"host memory needed, estimated: {format_bytes(need)}")
    log(notes[-1])
  t0 = time.perf_counter()
  classes = classes or default_classes(scale)
  dataset = synthetic_mag(scale=scale, seed=seed, num_classes=classes)
  drawn = time.perf_counter() - t0
  log(f"graph generated in {drawn:.1f} s: {dataset!r}")
  if budgeted:
    with HostGraph.from_hetero(dataset.graph):
      built = time.perf_counter() - t0
    features, embeddings = table_bytes(dataset, embed, embed_dim)
    if device_bytes == "auto":
      device_bytes = (features + embeddings) // 4
    notes += [
      f"graph construction: {built:.1f} s (synthetic_mag {drawn:.1f} s, then "
      f"HostGraph.from_hetero)",
      f"tables: features {format_bytes(features)} + embeddings "
      f"{format_bytes(embeddings)} ({', '.join(embed) or 'none'}, {embed_dim} wide) = "
      f"{format_bytes(features + embeddings)}; device budget (--device-bytes) "
      + ("none" if device_bytes is None else format_bytes(device_bytes)),
    ]
    for n in notes[-2:]:
      log(n)
  config = TrainConfig(
    model=model, hidden=hidden, heads=heads, seed=seed, embed=tuple(embed), embed_dim=embed_dim
  )
  rows = _seed_rows(dataset, batch_size, warmup + batches, seed)
  per_epoch = math.ceil(len(dataset.train_papers) / batch_size)
  key = jax.random.key(seed)
  results = []
  for name in pipelines:
    label = PIPELINES[name]
    if budgeted and name == "host-cache":
      label = "GPU-centric + device cache in the --device-bytes budget (jaxdata)"
    r = Result(name, label)
    results.append(r)
    why = None
    if budgeted and name == "device":
      why = "every row on the device, past the device budget"
    elif embed and name in ("cpu", "pyg"):
      why = "no learnable embeddings in this pipeline"
    elif name == "device":
      why = _fits_on_device(dataset)
    elif name == "pyg":
      try:
        importlib.import_module("torch")
        importlib.import_module("torch_geometric.nn")
      except ImportError as e:
        why = f"torch_geometric is not importable ({e})"
    if why:
      r.note = f"skipped: {why}"
      notes.append(f"{label}: {r.note}")
      log(f"[yellow]{label}: {r.note}" if console is not None else f"{label}: {r.note}")
      continue
    try:
      with _progress(console, label, warmup + batches) as on_batch:
        if budgeted and name in ("host", "host-cache"):
          seconds, out, extra = _trained(
            name, dataset, config, fanouts, batch_size, batches, device_bytes, on_batch
          )
        elif name == "pyg":
          seconds, out, extra = _pyg(dataset, config, tuple(fanouts), rows, warmup, seed, on_batch)
        else:
          seconds, out, extra = _jaxdata(
            name, dataset, config, fanouts, rows, warmup, key, on_batch
          )
    except Exception as e:  # noqa: BLE001  out of memory, or a pipeline that cannot run here
      message = " ".join(str(e).split())[:200] or type(e).__name__
      r.note = f"failed: {type(e).__name__}: {message}"
      notes.append(f"{label}: {r.note}")
      log(f"{label}: {r.note}")
      continue
    batch_s = seconds / batches
    seeds = int((rows[warmup:] >= 0).sum())
    r.batch_ms, r.seeds_per_second = 1e3 * batch_s, seeds / seconds
    r.epoch_seconds = per_epoch * batch_s
    r.losses = [loss for loss, _, _ in out]
    r.loss = float(np.mean(r.losses))
    if out[0][1] is not None:
      r.edges_per_batch = float(np.mean([e for _, e, _ in out]))
    if out[0][2] is not None:
      r.feature_bytes = float(np.mean([b for _, _, b in out]))
    if "state" in extra:  # the trainer's steps: what the device held
      peak = extra["peak"]
      notes.append(
        f"{label}: device holds {format_bytes(extra['state'])} of parameters and Adam state"
        f" + {format_bytes(extra['cache'])} of feature cache ({extra['fraction']:.1%} of "
        f"each feature table's rows); peak device memory so far in this run "
        + ("n/a (no memory stats on this backend)" if peak is None else format_bytes(peak))
        + f"; epoch of {batches} batches timed after one compiling epoch"
      )
    elif "ran on" in extra:  # PyG: where
      notes.append(f"{label}: ran on {extra['ran on']}")
    elif extra:  # CPU-centric: what each batch moves
      notes.append(
        f"{label}: each batch moves {sum(extra.values()) / 2**20:.1f} MiB to the device: "
        f"blocks {extra['blocks'] / 2**20:.1f} MiB, features {extra['features'] / 2**20:.1f} "
        "MiB in gather_typed's layout (one array per node type over every slot of the "
        "outermost frontier, zeros where the slot is of another type or unused)"
      )
    log(
      f"  {label}: {r.batch_ms:.2f} ms/batch, {r.seeds_per_second:,.0f} seeds/s, loss {r.loss:.4f}"
    )
  link = None
  host = next((r for r in results if r.name == "host" and r.batch_ms is not None), None)
  if host is not None and host.feature_bytes is not None:
    copy = copy_bytes or (COPY_BYTES if jax.default_backend() == "gpu" else CPU_COPY_BYTES)
    link = LinkBound(host.feature_bytes, common.memcpy_gbps(copy), copy)
    log(
      f"link bound: {link.feature_bytes / 2**20:.1f} MiB of features per batch at "
      f"{link.memcpy_gbps:.1f} GB/s (pinned memcpy) = {link.batch_ms:.2f} ms; GPU-centric "
      f"step {host.batch_ms / link.batch_ms:.2f}x that"
    )
    cached = next((r for r in results if r.name == "host-cache" and r.batch_ms is not None), None)
    if cached is not None and cached.feature_bytes is not None:
      bound = cached.feature_bytes / (link.memcpy_gbps * 1e9) * 1e3
      notes.append(
        f"{cached.label}: the cache holds {CACHE_FRACTION:.0%} of each type's rows (the "
        f"nodes with the most out-edges); {cached.feature_bytes / 2**20:.1f} MiB per batch "
        f"still come from host memory ({cached.feature_bytes / host.feature_bytes:.0%} of "
        f"the uncached pipeline's), a link bound of {bound:.2f} ms; its step takes "
        f"{cached.batch_ms:.2f} ms ({cached.batch_ms / bound:.1f}x)"
      )
  return results, link, notes, dataset


def _progress(console, label: str, total: int):
  """A progress bar over a pipeline's batches (none without a console)."""
  import contextlib  # pylint: disable=g-import-not-at-top

  if console is None:
    return contextlib.nullcontext(lambda: None)
  from jaxdata.train.common import progress  # pylint: disable=g-import-not-at-top

  @contextlib.contextmanager
  def bar():
    with progress(console, f"{label:<44}", total, transient=True) as update:
      yield lambda: update(advance=1)

  return bar()


# ----------------------------------------------------------------------------- tables
def _ratio(r: Result, gpu: Result | None) -> str:
  if gpu is None or r.epoch_seconds is None:
    return ""
  if r is gpu:
    return "1.00x"
  return f"{r.epoch_seconds / gpu.epoch_seconds:.2f}x the time"


def table_rows(results: list[Result], link: LinkBound | None) -> tuple[list[str], list[list[str]]]:
  header = [
    "pipeline",
    "ms / batch",
    "seeds / s",
    "epoch s (extrapolated)",
    "vs GPU-centric (epoch)",
    "edges / batch",
    "loss (timed batches)",
  ]
  gpu = next((r for r in results if r.name == "host" and r.batch_ms is not None), None)
  rows = []
  for r in results:
    if r.batch_ms is None:
      rows.append([r.label, r.note or "not run", "", "", "", "", ""])
      continue
    rows.append(
      [
        r.label,
        f"{r.batch_ms:.2f}",
        f"{r.seeds_per_second:,.0f}",
        f"{r.epoch_seconds:.2f}",
        _ratio(r, gpu),
        "" if r.edges_per_batch is None else f"{r.edges_per_batch:,.0f}",
        f"{r.loss:.4f}",
      ]
    )
  if link is not None and gpu is not None:
    rows.append(
      [
        "link bound (features / pinned memcpy)",
        f"{link.batch_ms:.2f}",
        "",
        "",
        f"GPU-centric step: {gpu.batch_ms / link.batch_ms:.2f}x the bound",
        "",
        "",
      ]
    )
  return header, rows


#: (what, the pipeline compared, the least ratio) of the speed targets.
SPEEDUP_BARS = (("PyG pipeline", "pyg", 5.0), ("CPU-centric pipeline", "cpu", 5.0))
#: The GPU-centric step's largest ratio to its link-bound time.
LINK_BAR = 1.3


def bars(results: list[Result], link: LinkBound | None) -> tuple[list[str], list[list[str]]]:
  """The targets, each with what this run measured and whether it is met."""
  got = {r.name: r for r in results if r.batch_ms is not None}
  gpu = got.get("host")
  rows = []
  for what, name, least in SPEEDUP_BARS:
    bar = f"GPU-centric epoch >= {least:g}x faster than the {what}"
    if gpu is None or name not in got:
      rows.append([bar, "not measured in this run", "open"])
      continue
    ratio = got[name].epoch_seconds / gpu.epoch_seconds
    rows.append([bar, f"{ratio:.2f}x", "met" if ratio >= least else "**not met**"])
  bar = f"GPU-centric step within {LINK_BAR:g}x of its link-bound time"
  if gpu is None or link is None:
    rows.append([bar, "not measured in this run", "open"])
  else:
    ratio = gpu.batch_ms / link.batch_ms
    rows.append(
      [
        bar,
        f"{gpu.batch_ms:.2f} ms vs {link.batch_ms:.2f} ms: {ratio:.2f}x",
        "met" if ratio <= LINK_BAR else "**not met**",
      ]
    )
  return ["bar", "measured", "verdict"], rows


def describe(
  model: str, fanouts, batch_size: int, batches: int, warmup: int, hidden: int, heads: int
) -> str:
  """The paragraph every hetero.md starts with: what was run, how, what each row means."""
  what = {
    "hgt": "HGT (two `jaxdata.nn.HGT` layers, PyG 2.8's HGTConv semantics, then a linear "
    "classifier on papers)",
    "rgat": "RGAT (per-type linear maps to the hidden width, two `jaxdata.nn.RGAT` layers "
    "with self loop, bias and ReLU, then a linear classifier on papers)",
  }[model]
  peer = {
    "hgt": "`torch_geometric.nn.HGTConv` twice and a `Linear`, the same widths",
    "rgat": "per-type `Linear`s, twice `torch_geometric.nn.RGATConv` (additive "
    "self-attention across relations, heads concatenated, bias) plus a self-loop "
    "`Linear` and ReLU, then a `Linear`: the same layer as ours (RGATConv, not "
    "RGCNConv, because ours is an attention layer)",
  }[model]
  return (
    f"Mini-batch {what}, hidden {hidden}, {heads} heads, Adam, on `synthetic_mag` (ogbn-mag's "
    f"shape). Fanouts {tuple(fanouts)}, {batch_size} seed papers per batch; every pipeline "
    "trains a fresh model from the same init seed on the same seed batches in the same "
    f"order: {warmup} warm-up batches (compiling), then {batches} timed batches, wall time "
    "from the first dispatch to the last result. The epoch time is the timed per-batch time "
    "times the batches of a full epoch over the training papers (extrapolated, not run).\n\n"
    "- *GPU-centric (jaxdata)*: graph (CSR with relations) and every node type's features "
    "in pinned host memory; inside the jitted step the GPU samples the blocks "
    "(`loader.sample_blocks`, zero-copy), gathers the features (`host.gather_typed`) and runs "
    "the model on the blocks: `jaxdata train rgat|hgt --minibatch`'s step.\n"
    "- *all-in-GPU (jaxdata)*: the same step with graph and features in device memory "
    "(skipped where they do not fit).\n"
    "- *CPU-centric*: `sample_blocks` + `gather_typed` jitted on the CPU (jaxdata's CPU "
    "kernels, the same samples for the same key, so the three jaxdata rows see the same "
    "batches and report the same loss), `jax.device_put` of the blocks and features, a "
    f"jitted step taking them; a prefetch thread keeps {PREFETCH} batches ahead.\n"
    f"- *PyG*: {peer}, on CUDA where torch sees a GPU (the notes say where it ran), fed "
    "`HeteroData` mini-batches by `examples/benchmarks/pyg_sampler.py`, **our NumPy sampler "
    "standing in "
    "for PyG's `NeighborLoader`**, whose sampler needs pyg-lib or torch-sparse, which the GPU "
    "machine lacks. It does what NeighborLoader does on a HeteroData: per hop, for each node "
    "found by the previous hop and each edge type into its type, up to fanout in-edges uniformly "
    "without replacement; relabelled per-type node ids, `edge_index` per edge type, features "
    "gathered with NumPy indexing. Sampling and batch building run on a prefetch thread "
    f"({PREFETCH} ahead, like NeighborLoader with a worker), `.to(device)` and the step in the "
    "loop; all of it is timed. NeighborLoader draws the fanout *per edge type*, jaxdata's sampler "
    "the fanout per node over all relations, so PyG's batches hold more edges (see *edges / "
    "batch*); its loss is of another sample and another init.\n"
    "- *link bound*: the feature bytes a GPU-centric step reads from host memory (the valid "
    "slots of the outermost frontier times their type's row bytes, mean over the timed "
    "batches; graph reads by the sampler are not counted) divided by the pinned "
    "host-to-device memcpy bandwidth measured in the same run (`host_slice` of a pinned "
    f"`HostTable`, one DMA copy; DESIGN.md records {DESIGN_MEMCPY_GBPS} GB/s for PyTorch's "
    "pinned `copy_` on the H200 machine). The GPU-centric step's ratio to it is what is left "
    "to win."
  )


def markdown(
  results: list[Result],
  link: LinkBound | None,
  notes: list[str],
  dataset: Any,
  command_line: str,
  *,
  model: str,
  fanouts,
  batch_size: int,
  batches: int,
  warmup: int,
  hidden: int,
  heads: int,
  breakdown: common.StepParts | None = None,
) -> str:
  hw = common.hardware()
  header, rows = table_rows(results, link)
  g = dataset.graph
  text = [
    f"# Mini-batch {model.upper()} on a heterograph: four pipelines",
    "",
    "Measured by `jaxdata bench hetero` (examples/benchmarks/hetero.py). "
    + describe(model, fanouts, batch_size, batches, warmup, hidden, heads),
    "",
    f"Command: `{command_line}`",
    "",
    *[f"- {k}: {v}" for k, v in hw.items()],
    "",
    "```",
    repr(dataset),
    f"  {len(dataset.train_papers):,} training papers: "
    f"{math.ceil(len(dataset.train_papers) / batch_size)} batches per epoch; "
    f"{g.num_edges:,} edges",
    "```",
    "",
    common.markdown_table(header, rows),
    "",
  ]
  text += ["## The bars", "", common.markdown_table(*bars(results, link)), ""]
  if link is not None:
    text += [
      f"Link bound: {link.feature_bytes / 2**20:.1f} MiB of features per GPU-centric "
      f"batch / {link.memcpy_gbps:.1f} GB/s pinned memcpy (measured now, "
      f"{link.copy_bytes / 2**20:.0f} MiB copies) = {link.batch_ms:.2f} ms per batch.",
      "",
    ]
  if breakdown:
    text += [
      "## Where the GPU-centric step's time goes",
      "",
      "`--breakdown`: the GPU-centric step, compiled once, runs the batches queued back to "
      "back (the steady step), then a `jax.profiler` trace of 5 more steps attributes every "
      "kernel, copy and memset on the device to a part of the step through its HLO "
      "instruction's named scope (`jaxdata.timing.device_events`): sampling, "
      "deduplication and block building (`loader.sample_blocks`), the feature gathers, the "
      "optimizer; the rest is the model's forward pass, or its backward pass (`transpose(` in "
      "the op name). The device is idle for the part of a step it is not busy: host work "
      "and waits.",
      "",
      common.markdown_table(common.PARTS_HEADER, breakdown.rows()),
      "",
      "The busiest kernels, with the last scopes of their op names:",
      "",
      common.markdown_table(common.KERNELS_HEADER, breakdown.kernel_rows()),
      "",
    ]
  if notes:
    text += [*(f"- {n}" for n in notes), ""]
  return "\n".join(text)


# ----------------------------------------------------------------------------- the CLI
def add_arguments(parser) -> None:
  """`jaxdata bench hetero` options."""
  parser.add_argument(
    "--scale",
    type=command.positive_float,
    help=f"synthetic_mag's share of ogbn-mag (default {FULL['scale']}; --quick {QUICK['scale']})",
  )
  parser.add_argument("--model", choices=MODELS, default="hgt", help="the model trained")
  parser.add_argument(
    "--fanouts",
    type=command.listing(command.positive_int),
    default=[10, 10],
    help="in-edges sampled per node and hop, one per layer (two)",
  )
  parser.add_argument(
    "--batch-size", type=command.positive_int, default=1024, help="seed papers per batch"
  )
  parser.add_argument(
    "--batches",
    type=command.positive_int,
    help=f"timed batches per pipeline (default {FULL['batches']}; --quick {QUICK['batches']})",
  )
  parser.add_argument(
    "--warmup",
    type=command.natural_int,
    help=f"untimed batches first (default {FULL['warmup']}; --quick {QUICK['warmup']})",
  )
  parser.add_argument(
    "--pipelines",
    type=command.listing(command.choice(tuple(PIPELINES))),
    default=list(PIPELINES),
    help="pipelines to run, comma-separated, from: " + ", ".join(PIPELINES),
  )
  parser.add_argument(
    "--classes",
    type=command.positive_int,
    default=None,
    help="paper classes (default as `jaxdata train hgt`: 349, fewer at small scales)",
  )
  parser.add_argument("--hidden", type=command.positive_int, default=64, help="hidden features")
  parser.add_argument("--heads", type=command.positive_int, default=4, help="attention heads")
  parser.add_argument(
    "--seed", type=command.seed, default=0, help="seed of graph, batches, keys and init"
  )
  parser.add_argument(
    "--quick", action="store_true", help="a small graph and few batches (flags given still apply)"
  )
  parser.add_argument(
    "--embed",
    type=command.listing(str),
    default=[],
    help="node types given learnable embeddings instead of features (e.g. "
    "author,institution,field_of_study): host and host-cache then run "
    "the trainer's steps, tables trained in host memory",
  )
  parser.add_argument(
    "--embed-dim", type=command.positive_int, default=64, help="--embed: the embeddings' width"
  )
  parser.add_argument(
    "--device-bytes",
    type=command.size_or_auto,
    default=None,
    help="auto (a quarter of the features and embeddings) or a size such as "
    "8GiB: the device holds at most this many bytes of parameters, "
    "optimizer state and cached rows (host-cache's cache gets the rest)",
  )
  parser.add_argument(
    "--breakdown",
    action="store_true",
    help="also time the GPU-centric step's parts (sampling and blocks, gathers, forward, "
    "backward, optimizer, launch and wait), each its own program, on the same batches",
  )
  parser.add_argument(
    "--out",
    metavar="PATH.md",
    type=command.output_path,
    help="write the Markdown table here (e.g. docs/benchmarks/hetero.md)",
  )


def main(args) -> int:
  """`jaxdata bench hetero`."""
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  if len(args.fanouts) != 2:
    raise command.UsageError(
      f"argument --fanouts: give two fanouts (one per layer), got {len(args.fanouts)}"
    )
  if args.hidden % args.heads:
    raise command.UsageError(
      f"argument --hidden: {args.hidden} is not a multiple of --heads {args.heads}"
    )
  from jaxdata.data.mag import NODE_TYPES  # pylint: disable=g-import-not-at-top

  bad = [t for t in args.embed if t not in NODE_TYPES[1:]]
  if bad:
    raise command.UsageError(
      f"argument --embed: {', '.join(bad)}: choose from {','.join(NODE_TYPES[1:])}"
    )
  size = {k: common.pick(getattr(args, k), args.quick, QUICK[k], FULL[k]) for k in FULL}
  console = command.console(width=160)
  results, link, notes, dataset = run(
    **size,
    model=args.model,
    fanouts=args.fanouts,
    batch_size=args.batch_size,
    pipelines=args.pipelines,
    classes=args.classes,
    hidden=args.hidden,
    heads=args.heads,
    seed=args.seed,
    console=console,
    embed=tuple(args.embed),
    embed_dim=args.embed_dim,
    device_bytes=args.device_bytes,
  )
  common.print_table(
    console,
    f"mini-batch {args.model.upper()}: four pipelines",
    *table_rows(results, link),
    notes,
    left=("pipeline",),
  )
  parts = None
  host = next((r for r in results if r.name == "host" and r.batch_ms is not None), None)
  if args.breakdown and host is not None:
    config = TrainConfig(model=args.model, hidden=args.hidden, heads=args.heads, seed=args.seed)
    timed = min(size["batches"], BREAKDOWN_BATCHES)
    rows = _seed_rows(dataset, args.batch_size, size["warmup"] + timed, args.seed)
    parts = stages(dataset, config, args.fanouts, rows, size["warmup"], jax.random.key(args.seed))
    title = "the GPU-centric step's device time by part, ms per batch"
    common.print_table(console, title, common.PARTS_HEADER, parts.rows(), [], ("part of the step",))
    title = "the GPU-centric step's busiest kernels"
    common.print_table(
      console, title, common.KERNELS_HEADER, parts.kernel_rows(40), [], ("part", "kernel [op]")
    )
  common.check_measured([r for r in results if r.batch_ms is not None], notes)
  if args.out:
    common.write(
      console,
      args.out,
      markdown(
        results,
        link,
        notes,
        dataset,
        common.command_line(),
        model=args.model,
        fanouts=args.fanouts,
        batch_size=args.batch_size,
        batches=size["batches"],
        warmup=size["warmup"],
        hidden=args.hidden,
        heads=args.heads,
        breakdown=parts,
      ),
    )
  return 0
