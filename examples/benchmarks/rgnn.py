"""`jaxdata bench rgnn`: one RGCN layer's relational part, side by side, per training step
(forward + backward) or, with `--mode inference`, per forward pass alone.

    out[i] = sum_{e : dst[e] == i} norm[e] * (x[src[e]] @ W[etype[e]]),   norm = per-relation mean

on whole graphs (AIFB, MUTAG, a synthetic knowledge graph with hundreds of relations and
heavy-tailed degrees), hidden sizes d_in = d_out = dim. In one run, for each graph and dim:

  jaxdata                    the generated kernel, `jaxdata.hector.rgcn_message` (when built)
  transform-all-then-gather  plain JAX: x @ W_r for every node and relation, gather per edge
  ragged_dot                 plain JAX: `jax.lax.ragged_dot` over edges grouped by relation
  per-edge weights           plain JAX: W[etype] per edge (PyG FastRGCNConv's formulation)
  PyG RGCNConv               torch_geometric.nn.RGCNConv(aggr="mean"), on CUDA when torch sees one
  PyG FastRGCNConv           torch_geometric.nn.FastRGCNConv(aggr="mean"): the same layer through a
                             per-edge W[etype] and a batched matmul (PyG's other formulation;
                             "jaxdata vs PyG" takes the faster of the two)

Each step is loss = sum(out * ct) for a fixed random ct, with gradients for x and W (mode "train"),
or the forward pass alone (mode "inference": `rgnn_peers.forward_only`; PyG in eval mode under
torch.inference_mode()). Precision "both" (the CLI's default) runs the plain-JAX rows at "highest"
and at "default" and compares jaxdata with each. Time is per step, median over repeats of a round of
steps queued back to back and waited for once (enough to fill ~20 ms, at most 20:
`jaxdata.timing.queue_depth`), as a training loop dispatches them; for every formulation alike, so a
sub-millisecond step is not dominated by the host's round trip. Memory: for JAX, what the compiled
executable needs (memory_analysis(): arguments + outputs + temporaries), and on a GPU also the rise
of the allocator's peak; for PyG, torch.cuda.max_memory_allocated over the case. A formulation that
does not fit is reported as OOM (estimated up front where XLA's analysis or the per-edge tensor says
it cannot fit), never a crash. Formulations are in jaxdata/reference/rgcn.py, timed by
examples/benchmarks/rgnn_peers.py.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import pathlib
import re
from collections.abc import Callable, Sequence

import numpy as np

from benchmarks import common
from benchmarks import rgnn_peers as peers
from jaxdata import command
from jaxdata.reference import rgcn as rgcn_ref

DIMS = (32, 64, 128)
GRAPHS = ("aifb", "mutag", "synthetic")
#: The hub-heavy family, besides `GRAPHS`: "zipf-src-E" (source out-degrees follow a Zipf law of
#: exponent E > 1, destinations uniform), "zipf-dst-E" (the other way), "zipf-both-E", and
#: "uniform" (both ends uniform), on the synthetic graph's sizes (`skewed_graph`).
SKEWED = re.compile(r"zipf-(src|dst|both)-([0-9]+(?:\.[0-9]+)?)|uniform")
JAX_FORMULATIONS = ("jaxdata", *rgcn_ref.PLAIN_JAX)
#: PyG's rows: name -> its layer (`rgnn_peers.PYG_RGCN`).
PYG = {"PyG RGCNConv": "RGCNConv", "PyG FastRGCNConv": "FastRGCNConv"}
FORMULATIONS = (*JAX_FORMULATIONS, *PYG)
#: The synthetic knowledge graph: at least 500 relations and 2 million edges, heavy-tailed.
SYNTHETIC = dict(num_nodes=200_000, num_edges=2_000_000, num_relations=500)
QUICK_SYNTHETIC = dict(num_nodes=2_000, num_edges=20_000, num_relations=50)
QUICK = dict(graphs=("aifb", "synthetic"), dims=(32,), repeats=3)
PRECISIONS = ("highest", "default")
#: --precision: one of PRECISIONS for every row, or "both" (`plain_precisions`,
#: `jaxdata_precisions`, `pyg_tf32` say what runs at which).
PRECISION_CHOICES = ("both", *PRECISIONS)
MODES = peers.MODES


def plain_precisions(precision: str) -> tuple[str, ...]:
  """The precisions the plain-JAX rows run at: both for "both", else the one given."""
  return PRECISIONS if precision == "both" else (precision,)


def jaxdata_precisions(precision: str, name: str = "jaxdata") -> tuple[str, ...]:
  """The precisions a jaxdata row runs at. hector's GEMMs follow the precision as `jnp.dot`
  does (`jaxdata.hector.precision`: TF32 tensor cores for float32 at "default", float32-exact
  at "highest"; bfloat16 on tensor cores at both), so the "jaxdata" row runs at each of
  `plain_precisions`, side by side with plain JAX; other jaxdata rows (the attention
  benchmark's pass ablation) run once, at "highest" under "both"."""
  if name == "jaxdata":
    return plain_precisions(precision)
  return ("highest",) if precision == "both" else (precision,)


def pyg_tf32(precision: str) -> bool:
  """PyG's matmuls in TF32 under "default" and "both" (PyG at its fastest), float32 under
  "highest"."""
  return precision != "highest"


def check_mode_precision(mode: str, precision: str) -> None:
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
  if precision not in PRECISION_CHOICES:
    raise ValueError(f"precision must be one of {PRECISION_CHOICES}, got {precision!r}")


@dataclasses.dataclass
class Graph:
  """A benchmark graph: edges sorted by relation, the per-relation mean norm, its origin."""

  name: str
  num_nodes: int
  num_relations: int
  src: np.ndarray
  dst: np.ndarray
  etype: np.ndarray
  norm: np.ndarray
  source: str
  hetero: object | None = None  # the jaxdata.data.HeteroGraph, for the jaxdata row

  @property
  def num_edges(self) -> int:
    return len(self.src)

  def describe(self) -> str:
    indeg = np.bincount(self.dst, minlength=self.num_nodes)
    sizes = np.bincount(self.etype, minlength=self.num_relations)
    return (
      f"{self.name}: {self.num_nodes:,} nodes, {self.num_edges:,} edges, "
      f"{self.num_relations} relations (largest {sizes.max():,} edges, "
      f"{int((sizes == 0).sum())} empty); in-degree median {int(np.median(indeg))}, "
      f"max {indeg.max():,}; {self.source}"
    )

  @classmethod
  def from_hetero(cls, name: str, g, source: str) -> Graph:
    return cls(
      name,
      int(g.num_nodes),
      int(g.num_relations),
      np.asarray(g.src, np.int32),
      np.asarray(g.dst, np.int32),
      np.asarray(g.etype, np.int32),
      np.asarray(g.edge_norm("mean"), np.float32),
      source,
      g,
    )


@dataclasses.dataclass
class Result:
  graph: str
  dim: int
  formulation: str
  seconds: float | None = None
  bytes: int | None = None  # JAX: compiled estimate; PyG: torch's peak (CUDA only)
  measured_bytes: int | None = None  # JAX on a GPU: rise of peak_bytes_in_use
  status: str = "ok"  # "ok", "OOM", "OOM (est. X GiB)", "skipped", "error"
  loss: float | None = None
  alone_seconds: float | None = None  # one step waited for on its own (host round trip in it)
  precision: str | None = None  # JAX rows: "highest" or "default"; PyG: None (TF32 per run)

  @property
  def ok(self) -> bool:
    return self.status == "ok"


# ------------------------------------------------------------------------------------------------
# Graphs


def default_data_dir() -> str | None:
  """$JAXDATA_DATA_DIR, else the shared data folder next to the repository (../shared/data), or
  in it (shared/data)."""
  if os.environ.get("JAXDATA_DATA_DIR"):
    return os.environ["JAXDATA_DATA_DIR"]
  root = pathlib.Path(__file__).resolve().parents[2]
  for candidate in (root.parent / "shared" / "data", root / "shared" / "data"):
    if candidate.is_dir():
      return str(candidate)
  return None


def _draw(rng: np.random.Generator, weights: np.ndarray, n: int) -> np.ndarray:
  """`n` indices drawn with probabilities proportional to `weights` (int32)."""
  cdf = np.cumsum(weights)
  return np.minimum(
    np.searchsorted(cdf, rng.random(n) * cdf[-1], side="right"), len(weights) - 1
  ).astype(np.int32)


def synthetic_graph(num_nodes: int, num_edges: int, num_relations: int, seed: int = 0):
  """A heavy-tailed relational graph from NumPy alone: (src, dst, etype), unsorted.

  Used only where jaxdata.data.synthetic_entities is not importable. Node popularity follows a
  Pareto law (a few hubs, a long tail of rare nodes) for both end points; relation sizes follow
  another, with every relation given at least one edge.
  """
  rng = np.random.default_rng(seed)
  popularity = rng.pareto(1.2, num_nodes) + 1.0
  src, dst = _draw(rng, popularity, num_edges), _draw(rng, popularity, num_edges)
  etype = _draw(rng, rng.pareto(0.8, num_relations) + 1.0, num_edges)
  etype[: min(num_edges, num_relations)] = np.arange(min(num_edges, num_relations))
  return src, dst, etype


def is_graph(name: str) -> bool:
  """Whether `load_graph` knows `name`: one of `GRAPHS`, or of the `SKEWED` family."""
  return name in GRAPHS or SKEWED.fullmatch(name) is not None


def skewed_graph(
  num_nodes: int,
  num_edges: int,
  num_relations: int,
  *,
  src_exponent: float | None = None,
  dst_exponent: float | None = None,
  seed: int = 0,
):
  """A relational graph whose nodes' out-degrees follow a Zipf law of exponent `src_exponent`
  (each node's share of the edges' sources is a draw of NumPy's Zipf distribution, P(k) ~
  k ** -exponent, capped at `num_edges`) and whose in-degrees one of `dst_exponent`; an end
  without an exponent is uniform. Relation sizes follow a Zipf law over their ranks (exponent 1,
  as the synthetic graph's), every relation with at least one edge. A
  `jaxdata.data.HeteroGraph`."""
  from jaxdata.data import HeteroGraph  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(seed)

  def end(exponent: float | None) -> np.ndarray:
    if exponent is None:
      return rng.integers(0, num_nodes, num_edges)
    weights = np.minimum(rng.zipf(exponent, num_nodes), num_edges).astype(np.float64)
    return _draw(rng, weights, num_edges)

  src, dst = end(src_exponent), end(dst_exponent)
  relations = np.arange(1, num_relations + 1, dtype=np.float64) ** -1.0
  etype = np.sort(_draw(rng, relations, num_edges))
  etype[: min(num_edges, num_relations)] = np.arange(min(num_edges, num_relations))
  return HeteroGraph.from_edges(
    src, dst, etype, num_nodes=num_nodes, relation_names=[f"r{r}" for r in range(num_relations)]
  )


def load_graph(
  name: str, *, data_dir: str | None, quick: bool, seed: int = 0, synthetic: dict | None = None
) -> tuple[Graph | None, str | None]:
  """(graph, None), or (None, why it was skipped).

  `synthetic`: the synthetic graph's sizes (num_nodes, num_edges, num_relations); default
  `QUICK_SYNTHETIC` or `SYNTHETIC`.
  """
  if name in ("aifb", "mutag"):
    if data_dir is None:
      return None, f"{name} skipped: no data folder (--data-dir)"
    path = os.path.join(data_dir, f"{name}.tgz")
    if not os.path.exists(path):
      return None, f"{name} skipped: {path} is missing"
    try:
      from jaxdata.data import load_entities  # pylint: disable=g-import-not-at-top
    except ImportError as e:
      return None, f"{name} skipped: jaxdata.data.load_entities is not importable ({e})"
    try:
      graph = load_entities(path).graph
    except (OSError, EOFError, ValueError) as e:  # a damaged or wrong archive
      return None, f"{name} skipped: {e}"
    return Graph.from_hetero(name, graph, f"from {os.path.basename(path)}"), None
  if name == "synthetic":
    sizes = synthetic or (QUICK_SYNTHETIC if quick else SYNTHETIC)
    try:
      from jaxdata.data import synthetic_entities  # pylint: disable=g-import-not-at-top
    except ImportError:
      synthetic_entities = None
    if synthetic_entities is not None:
      ds = synthetic_entities(**sizes, num_classes=4, feature_dim=0, seed=seed)
      return Graph.from_hetero(name, ds.graph, "jaxdata.data.synthetic_entities"), None
    src, dst, etype = synthetic_graph(**sizes, seed=seed)
    n, r = sizes["num_nodes"], sizes["num_relations"]
    order = np.argsort(etype, kind="stable")
    src, dst, etype = src[order], dst[order], etype[order]
    try:
      hetero = peers.hetero_graph(src, dst, etype, num_nodes=n, num_relations=r)
    except peers.Unavailable:
      hetero = None
    if hetero is not None:
      return Graph.from_hetero(name, hetero, "local NumPy generator (rgnn.synthetic_graph)"), None
    norm = rgcn_ref.mean_norm(dst, etype, n, r).astype(np.float32)
    return Graph(
      name, n, r, src, dst, etype, norm, "local NumPy generator (rgnn.synthetic_graph)"
    ), None
  if m := SKEWED.fullmatch(name):
    ends, exponent = (m.group(1) or "neither"), float(m.group(2) or 0)
    if ends != "neither" and exponent <= 1:
      raise ValueError(f"graph {name!r}: a Zipf law's exponent must be > 1")
    sizes = synthetic or (QUICK_SYNTHETIC if quick else SYNTHETIC)
    graph = skewed_graph(
      **sizes,
      src_exponent=exponent if ends in ("src", "both") else None,
      dst_exponent=exponent if ends in ("dst", "both") else None,
      seed=seed,
    )
    how = "uniform ends" if ends == "neither" else f"Zipf {exponent:g} {ends} degrees"
    return Graph.from_hetero(name, graph, f"rgnn.skewed_graph, {how}"), None
  raise ValueError(
    f"unknown graph {name!r}; choose from {', '.join(GRAPHS)}, uniform or zipf-src|dst|both-E"
  )


def case_arrays(graph: Graph, dim: int, seed: int = 0):
  """x [N, dim], W [R, dim, dim], ct [N, dim] as float32 NumPy; the same for every formulation."""
  rng = np.random.default_rng((seed, graph.num_nodes, graph.num_edges, dim))
  x = rng.standard_normal((graph.num_nodes, dim), dtype=np.float32)
  w = rng.standard_normal((graph.num_relations, dim, dim), dtype=np.float32) / np.sqrt(dim)
  ct = rng.standard_normal((graph.num_nodes, dim), dtype=np.float32)
  return x, w.astype(np.float32), ct


# ------------------------------------------------------------------------------------------------
# Memory


def is_oom(exc: BaseException) -> bool:
  """Whether an exception is an out-of-memory of XLA, torch or NumPy."""
  if isinstance(exc, MemoryError):
    return True
  try:
    import torch  # pylint: disable=g-import-not-at-top

    if isinstance(exc, torch.cuda.OutOfMemoryError):
      return True
  except ImportError:
    pass
  text = str(exc)
  return (
    "RESOURCE_EXHAUSTED" in text
    or "out of memory" in text.lower()
    or "can't allocate memory" in text
    or "not enough memory" in text
  )


def available_bytes(device) -> int:
  """What a new computation may still allocate: the allocator's limit minus what is in use on a
  GPU; on the CPU, 80% of the kernel's MemAvailable (XLA on the CPU has no limit of its own, and
  the OOM killer does not raise)."""
  stats = peers.device_memory_stats(device)
  if "bytes_limit" in stats:
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(0.8 * int(line.split()[1]) * 1024)
  except OSError:
    pass
  from jaxdata import _ffi  # pylint: disable=g-import-not-at-top

  return _ffi.ext.physical_memory_bytes() // 2


def load_each(names: Sequence[str], load, notes: list[str]) -> list:
  """`load(name) -> (graph or None, why)` for each name: the graphs that loaded; a graph that is
  missing or fails to load (other than a ValueError: a bad argument) becomes a note."""
  loaded = []
  for name in names:
    try:
      g, why = load(name)
    except ValueError:
      raise
    except Exception as e:  # pylint: disable=broad-except
      g, why = None, f"{name} skipped: loading it failed ({_short(e)})"
    if g is None:
      notes.append(why)
    else:
      loaded.append(g)
  return loaded


def gib(n: int) -> str:
  return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _short(exc: BaseException) -> str:
  line = (str(exc).strip().splitlines() or [""])[0]
  return f"{type(exc).__name__}: {line[:160]}{'...' if len(line) > 160 else ''}"


# ------------------------------------------------------------------------------------------------
# Measuring


def _precision(name: str):
  import jax  # pylint: disable=g-import-not-at-top

  return {"highest": jax.lax.Precision.HIGHEST, "default": None}[name]


def measure_step(
  r: Result,
  build: Callable[[], peers.Formulation],
  x,
  w,
  ct,
  *,
  repeats: int,
  notes: list[str],
  fallback_need: Callable[[], int] | None = None,
  mode: str = "train",
) -> peers.Compiled | None:
  """Builds, compiles and times one JAX formulation into `r` (mode "train": loss = sum(out * ct),
  gradients for x and w, any pytrees; "inference": the forward alone, sum(out * ct) as a
  checksum); failures become r.status and notes. Returns the compiled step where it ran (its
  `run()` gives the step's outputs again: `jaxdata bench tensor-cores` compares gradients),
  else None.

  Not run, and reported as "OOM (est. ...)", when XLA's analysis of the compiled step says it
  cannot fit in what `available_bytes` says is free; `fallback_need` gives the bytes beyond the
  arguments where the backend has no analysis. `build` raising `peers.Unavailable` skips it.
  """
  import jax  # pylint: disable=g-import-not-at-top

  device = jax.devices()[0]
  where = f"{r.graph}, dim {r.dim}, {label(r)}"
  phase = "building"
  try:
    form = build()
    # Memory stats from before compiling: XLA's GPU autotuner allocates operand-sized buffers
    # while compiling, which would otherwise hide the run's peak. XLA's analysis of the
    # compiled step then says whether running it can fit.
    baseline = peers.device_memory_stats(device)
    phase = "compiling"
    compiled = peers.compile_step(form, x, w, ct, mode=mode)
    r.bytes = compiled.bytes
    args = int(getattr(compiled.analysis, "argument_size_in_bytes", 0) or 0)
    if compiled.bytes is None and fallback_need is not None:
      need = fallback_need()
    else:
      need = (compiled.bytes or 0) - args
    free = available_bytes(device)
    if need > free:
      r.status = f"OOM (est. {gib(need + args)})"
      _note(
        notes,
        f"{where}: not run, it needs {gib(need)} beyond its arguments (XLA's "
        f"analysis of the compiled step) and {gib(free)} are free",
      )
      return None
    phase = "running"
    if compiled.tunes:  # its first run chooses hector's tilings; compiled again, it launches
      jax.block_until_ready(compiled.run())  # the chosen ones inside XLA's CUDA graphs
      compiled = peers.compile_step(form, x, w, ct, mode=mode)
    timing = peers.time_jax(compiled, repeats=repeats, warmup=2, baseline=baseline)
    r.seconds, r.measured_bytes, r.loss = timing.seconds, timing.measured_bytes, timing.loss
    r.alone_seconds = timing.alone_seconds
    return compiled
  except peers.Unavailable as e:
    r.status = "skipped"
    _note(notes, f"{r.formulation} row skipped: {e}")
  except Exception as e:  # pylint: disable=broad-except
    r.status = "OOM" if is_oom(e) else "error"
    _note(
      notes, f"{where}: {'out of memory' if is_oom(e) else 'failed'} while {phase} ({_short(e)})"
    )
  return None


def measure_jax(
  graph: Graph,
  dim: int,
  names: Sequence[str],
  *,
  repeats: int,
  precision: str,
  edges,
  notes: list[str],
  advance,
  mode: str = "train",
) -> list[Result]:
  """Every JAX formulation on one (graph, dim): jaxdata at `jaxdata_precisions`, each plain-JAX
  one at each of `plain_precisions`; failures become statuses and notes. `advance()` after each
  name."""
  import jax  # pylint: disable=g-import-not-at-top

  device = jax.devices()[0]
  x_np, w_np, ct_np = case_arrays(graph, dim)
  x, w, ct = (jax.device_put(a, device) for a in (x_np, w_np, ct_np))
  results = []
  for name in names:
    try:
      runs = jaxdata_precisions(precision) if name == "jaxdata" else plain_precisions(precision)
      for prec in runs:
        r = Result(graph.name, dim, name, precision=prec)
        results.append(r)
        if name == "jaxdata":
          build = lambda prec=prec: peers.jaxdata_formulation(  # noqa: E731
            graph.hetero, precision=_precision(prec)
          )
        else:
          build = lambda prec=prec, name=name: peers.plain_jax(  # noqa: E731
            name, edges, graph.num_nodes, precision=_precision(prec)
          )
        # No analysis from this backend: assume per-edge weights builds its [E, d_in, d_out].
        fallback = (
          (lambda: rgcn_ref.per_edge_weight_bytes(graph.num_edges, dim, dim))
          if name == "per-edge weights"
          else None
        )
        measure_step(
          r, build, x, w, ct, repeats=repeats, notes=notes, fallback_need=fallback, mode=mode
        )
    finally:
      advance()
  return results


def measure_pyg(
  graph: Graph,
  dim: int,
  *,
  repeats: int,
  precision: str,
  notes: list[str],
  formulation: str = "PyG RGCNConv",
  mode: str = "train",
) -> Result:
  """PyG's RGCNConv or FastRGCNConv (`formulation`, a key of `PYG`) on one case; an OOM (or any
  failure) is the row's status and a note, never raised. On the CPU, FastRGCNConv is not started
  where its per-edge weights alone cannot fit in free RAM (the OOM killer does not raise)."""
  r = Result(graph.name, dim, formulation)
  try:
    import torch  # pylint: disable=g-import-not-at-top

    from jaxdata.reference import pyg as pyg_ref  # pylint: disable=g-import-not-at-top

    importlib.import_module("torch_geometric")
  except ImportError as e:
    r.status = "skipped"
    _note(notes, f"PyG rows skipped: torch_geometric is not importable ({e})")
    return r
  device = pyg_ref.torch_device()
  where = f"{graph.name}, dim {dim}, {formulation}"
  layer = PYG[formulation]
  if device.type != "cuda" and layer == "FastRGCNConv":
    import jax  # pylint: disable=g-import-not-at-top

    need = rgcn_ref.pyg_fast_bytes(graph.num_edges, dim, dim, train=mode == "train")
    free = available_bytes(jax.devices("cpu")[0])
    if need > free:
      r.status = f"OOM (est. {gib(need)})"
      _note(
        notes,
        f"{where}: not run, its per-edge weights alone need {gib(need)} and {gib(free)} are free",
      )
      return r
  x, w, ct = case_arrays(graph, dim)
  saved_tf32 = torch.backends.cuda.matmul.allow_tf32
  torch.backends.cuda.matmul.allow_tf32 = pyg_tf32(precision)
  try:
    timing = peers.time_pyg(
      graph.src,
      graph.dst,
      graph.etype,
      x,
      w,
      ct,
      repeats=repeats,
      warmup=2,
      device=device,
      mode=mode,
      layer=layer,
    )
    r.seconds, r.bytes, r.loss = timing.seconds, timing.bytes, timing.loss
    r.alone_seconds = timing.alone_seconds
  except Exception as e:  # pylint: disable=broad-except
    r.status = "OOM" if is_oom(e) else "error"
    _note(notes, f"{where}: {'out of memory' if is_oom(e) else 'failed'} ({_short(e)})")
  finally:
    torch.backends.cuda.matmul.allow_tf32 = saved_tf32
    if device.type == "cuda":
      torch.cuda.empty_cache()
  return r


def _note(notes: list[str], text: str) -> None:
  if text not in notes:
    notes.append(text)


def _check_losses(results: list[Result], precision: str, notes: list[str]) -> None:
  """Every formulation of one case must compute the same loss (up to float32 rounding; TF32
  rounding where either side may use it: a row at "default", or PyG when `pyg_tf32`)."""
  cases = {}
  for r in results:
    if r.ok and r.loss is not None:
      cases.setdefault((r.graph, r.dim), []).append(r)

  def loose(r: Result) -> bool:
    return r.precision == "default" or (r.precision is None and pyg_tf32(precision))

  for (g, d), rs in cases.items():
    ref = next(
      (r for r in rs if r.formulation == "transform-all-then-gather" and r.precision != "default"),
      None,
    )
    ref = ref or next((r for r in rs if r.formulation == "transform-all-then-gather"), rs[0])
    scale = max(abs(ref.loss), 1.0)
    for r in rs:
      tol = 3e-2 if loose(r) or loose(ref) else 1e-3
      if abs(r.loss - ref.loss) > tol * scale:
        _note(
          notes,
          f"{g}, dim {d}: {label(r)}'s loss {r.loss:.6g} differs from "
          f"{label(ref)}'s {ref.loss:.6g}",
        )


def label(r: Result, results: Sequence[Result] | None = None) -> str:
  """The row's name: the formulation, with its precision in brackets for a JAX row where the
  run has it at more than one (`results`); without `results` (notes, written while the run
  goes), in brackets only when "default"."""
  if r.precision is None:
    return r.formulation
  if results is None and r.precision != "default":
    return r.formulation
  if (
    results is not None
    and len({x.precision for x in results if x.formulation == r.formulation}) < 2
  ):
    return r.formulation
  return f"{r.formulation} ({r.precision})"


def sort_key(formulations: Sequence[str], graphs: Sequence[str]):
  """Results in table order: graph, dim, formulation, then precision (highest first)."""
  order = {f: i for i, f in enumerate(formulations)}
  return lambda r: (
    list(graphs).index(r.graph),
    r.dim,
    order[r.formulation],
    PRECISIONS.index(r.precision) if r.precision in PRECISIONS else 0,
  )


def run(
  graphs: Sequence[str] = GRAPHS,
  dims: Sequence[int] = DIMS,
  *,
  formulations: Sequence[str] = FORMULATIONS,
  data_dir: str | None = None,
  quick: bool = False,
  repeats: int = 7,
  precision: str = "highest",
  seed: int = 0,
  mode: str = "train",
  console=None,
) -> tuple[list[Result], list[str], list[Graph]]:
  """Runs the benchmark; returns the results, notes on what was skipped and why, the graphs.

  mode: "train" (forward + backward per step) or "inference" (forward only). precision: one of
  `PRECISION_CHOICES` ("both": plain JAX at both precisions, jaxdata at highest, PyG in TF32).

  PyG runs first, for every case, before JAX touches the device: JAX's allocator keeps what it
  grows to, torch's cache is emptied after each case, so each side finds the device free.
  """
  import rich.progress  # pylint: disable=g-import-not-at-top

  check_mode_precision(mode, precision)
  for d in dims:
    if d <= 0:
      raise ValueError(f"dims must be positive, got {d}")
  unknown = [f for f in formulations if f not in FORMULATIONS]
  if unknown:
    raise ValueError(f"unknown formulations {unknown}; choose from {', '.join(FORMULATIONS)}")
  notes: list[str] = []
  loaded = load_each(
    graphs, lambda name: load_graph(name, data_dir=data_dir, quick=quick, seed=seed), notes
  )
  jax_names = [f for f in JAX_FORMULATIONS if f in formulations]
  pyg_names = [f for f in PYG if f in formulations]
  results: list[Result] = []
  with rich.progress.Progress(console=console, transient=True) as bar:
    task = bar.add_task("bench rgnn", total=len(loaded) * len(dims) * len(formulations))
    for g in loaded:
      for d in dims:
        for name in pyg_names:
          bar.update(task, description=f"{g.name}, dim {d}, {name}")
          results.append(
            measure_pyg(
              g, d, repeats=repeats, precision=precision, notes=notes, formulation=name, mode=mode
            )
          )
          bar.advance(task)
    if jax_names:
      import jax  # pylint: disable=g-import-not-at-top

      for g in loaded:
        edges = rgcn_ref.EdgeArrays.build(
          g.src, g.dst, g.etype, num_nodes=g.num_nodes, num_relations=g.num_relations, norm=g.norm
        )
        for d in dims:
          bar.update(task, description=f"{g.name}, dim {d}, JAX")
          results += measure_jax(
            g,
            d,
            jax_names,
            repeats=repeats,
            precision=precision,
            edges=edges,
            notes=notes,
            advance=lambda: bar.advance(task),
            mode=mode,
          )
        del edges
        jax.clear_caches()
  results.sort(key=sort_key(FORMULATIONS, [x.name for x in loaded]))
  _check_losses(results, precision, notes)
  return results, notes, loaded


# ------------------------------------------------------------------------------------------------
# Output


def _ms(r: Result) -> str:
  if not r.ok:
    return r.status
  ms = r.seconds * 1e3
  return f"{ms:.2f}" if ms < 10 else f"{ms:.1f}"


def _alone_ms(r: Result) -> str:
  """One step waited for on its own (blank where not measured)."""
  if not r.ok or r.alone_seconds is None:
    return ""
  ms = r.alone_seconds * 1e3
  return f"{ms:.2f}" if ms < 10 else f"{ms:.1f}"


def _mem(n: int | None, r: Result | None = None) -> str:
  if r is not None and r.status.startswith("OOM (est."):
    return ""
  return "n/a" if n is None else gib(n)


def time_header(mode: str) -> tuple[str, str]:
  """(the time column, the waited-alone column) of a table in this mode."""
  if mode == "inference":
    return "forward ms", "one forward alone ms"
  return "fwd+bwd ms", "one step alone ms"


def plain_precisions_in(results: Sequence[Result], plain: Sequence[str]) -> list[str]:
  """The precisions the plain-JAX rows of `results` ran at, in `PRECISIONS` order."""
  seen = {r.precision for r in results if r.formulation in plain}
  return [p for p in PRECISIONS if p in seen]


def _ratio(x: float) -> str:
  return f"{x:.2f}x"


def comparisons(
  results: Sequence[Result],
  graph: str,
  dim: int,
  *,
  plain: Sequence[str],
  pyg: Sequence[str],
  mine: Result | None = None,
) -> tuple[str, ...]:
  """For one case: jaxdata (the row `mine`, else its first row that ran) against the fastest
  plain-JAX formulation at each precision the run has (`plain_precisions_in`), against PyG's
  fastest formulation, and jaxdata's memory / that PyG formulation's; empty strings where
  jaxdata did not run. Speedups divide the peer's time by jaxdata's. Where PyG has more than
  one formulation, its cell names the one compared with."""
  precisions = plain_precisions_in(results, plain)
  case = [r for r in results if r.graph == graph and r.dim == dim]
  if mine is None:
    mine = next((r for r in case if r.formulation == "jaxdata" and r.ok), None)
  if mine is None or not mine.ok:
    return ("",) * (len(precisions) + 2)
  cells = []
  for p in precisions:
    rows = [r for r in case if r.formulation in plain and r.precision == p]
    fast = [r.seconds for r in rows if r.ok]
    if fast:
      cells.append(_ratio(min(fast) / mine.seconds))
    elif rows and all(r.status.startswith("OOM") for r in rows):
      cells.append("all OOM")
    else:
      cells.append("n/a")
  peers_ = [r for r in case if r.formulation in pyg]
  ran = [r for r in peers_ if r.ok]
  if ran:
    best = min(ran, key=lambda r: r.seconds)
    which = f" ({best.formulation.removeprefix('PyG ')})" if len(pyg) > 1 else ""
    memory = _ratio(mine.bytes / best.bytes) if mine.bytes is not None and best.bytes else "n/a"
    return (*cells, _ratio(best.seconds / mine.seconds) + which, memory)
  if peers_ and any(r.status.startswith("OOM") for r in peers_):
    return (*cells, "PyG OOM", "PyG OOM")
  return (*cells, "n/a", "n/a")


def comparison_header(results: Sequence[Result], plain: Sequence[str]) -> list[str]:
  precisions = plain_precisions_in(results, plain)
  if len(precisions) > 1:
    vs_plain = [f"jaxdata vs best plain JAX ({p})" for p in precisions]
  else:
    vs_plain = ["jaxdata vs best plain JAX"] * len(precisions)
  return [*vs_plain, "jaxdata vs PyG", "memory / PyG's"]


def table_rows(
  results: list[Result],
  *,
  mode: str = "train",
  plain: Sequence[str] = tuple(rgcn_ref.PLAIN_JAX),
  pyg: Sequence[str] = tuple(PYG),
) -> tuple[list[str], list[list[str]]]:
  """The table of a run (RGCN's, or the attention layers' with their `plain` and `pyg` rows)."""
  measured = any(r.measured_bytes is not None for r in results)
  header = ["graph", "dim", "formulation", *time_header(mode), "peak memory"]
  if measured:
    header.append("measured peak")
  compared = comparison_header(results, plain)
  header += compared
  rows = []
  for r in results:
    row = [r.graph, str(r.dim), label(r, results), _ms(r), _alone_ms(r), _mem(r.bytes, r)]
    if measured:
      row.append(gib(r.measured_bytes) if r.measured_bytes is not None else "")
    row += (
      list(comparisons(results, r.graph, r.dim, plain=plain, pyg=pyg, mine=r))
      if r.formulation == "jaxdata"
      else [""] * len(compared)
    )
    rows.append(row)
  return header, rows


def software_line() -> str:
  """PyG's versions and device, for the record."""
  try:
    import torch  # pylint: disable=g-import-not-at-top
    import torch_geometric  # pylint: disable=g-import-not-at-top

    from jaxdata.reference import pyg as pyg_ref  # pylint: disable=g-import-not-at-top
  except ImportError:
    return "PyG: not installed"
  dev = pyg_ref.torch_device()
  where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
  return f"torch {torch.__version__}, torch_geometric {torch_geometric.__version__} on {where}"


def precision_text(precision: str) -> str:
  """The table's sentence on matmul precision."""
  if precision == "both":
    return (
      "Matmul precision: the plain-JAX rows and jaxdata's row at `highest` (float32) and "
      "at `default` (what a JAX user gets: TF32 on the tensor cores of a recent NVIDIA "
      "GPU; hector's GEMM and weight-gradient kernels follow it as `jnp.dot` does where "
      "its tensor-core kernels are on (the default; `JAXDATA_HECTOR_TENSOR_CORES=0` "
      "makes them float32 CUDA-core kernels at both precisions), "
      "marked in brackets; each jaxdata row is compared with the fastest plain-JAX row at "
      "each precision; PyG with TF32 on (`torch.backends.cuda.matmul.allow_tf32`), its "
      "fastest setting."
    )
  return (
    f"Matmul precision: `{precision}` on every side (PyG: TF32 "
    f"{'on' if pyg_tf32(precision) else 'off'})."
  )


def mode_text(mode: str) -> str:
  """What one timed step is, in this mode."""
  if mode == "inference":
    return (
      "one forward pass (inference: the layer under `jax.jit` without `jax.grad`, so "
      "nothing is kept for a backward pass; PyG's layer in eval mode under "
      "`torch.inference_mode()`; per forward, median over repeats of rounds of up to 20 "
      "forwards queued back to back and waited for once, for every formulation alike; "
      "*one forward alone*: the median of single forwards, each waited for, so the host's "
      "round trip is in it)"
    )
  return (
    "one step (loss = sum(out * ct) with a fixed random ct, gradients for the inputs and "
    "weights; per step, median over repeats of rounds of up to 20 steps queued back to "
    "back and waited for once, as a training loop runs them, for every formulation alike; "
    "*one step alone*: the median of single steps, each waited for, so the host's round "
    "trip is in it)"
  )


INFERENCE_TITLE = "# Inference (forward only): RGCN, RGAT, HGT"
INFERENCE_MODELS = ("rgcn", "rgat", "hgt")


def section_begin(model: str) -> str:
  return f"<!-- section {model}: written by jaxdata bench rgnn --model {model} -->"


def section_end(model: str) -> str:
  return f"<!-- end of section {model} -->"


def sectioned(
  previous: str | None, model: str, section: str, *, title: str, models: Sequence[str], intro: str
) -> str:
  """A document of one section per model: `model`'s replaced by `section` (which carries its
  `section_begin` / `section_end` markers), the others kept from `previous` (the file as it was,
  or None), so that models run separately land in one file."""
  sections = {}
  for m in models:
    if previous and section_begin(m) in previous and section_end(m) in previous:
      first = previous.index(section_begin(m))
      sections[m] = previous[first : previous.index(section_end(m), first) + len(section_end(m))]
  sections[model] = section.rstrip("\n")
  body = [sections[m] for m in models if m in sections]
  return "\n\n".join([title, intro, *body]) + "\n"


def inference_document(previous: str | None, model: str, section: str) -> str:
  """docs/benchmarks/rgnn_inference.md: one section per model, each from its own run."""
  return sectioned(
    previous,
    model,
    section,
    title=INFERENCE_TITLE,
    models=INFERENCE_MODELS,
    intro="Written by `jaxdata bench rgnn --mode inference --model rgcn|rgat|hgt "
    "--write <this file>`: each run replaces its model's section and keeps "
    "the others'. Training steps (forward + backward): rgnn.md and "
    "rgnn_attention.md; notes: rgnn_notes.md.",
  )


def write_markdown(console, path: str, model: str, section: str, mode: str, document) -> None:
  """Writes a run's markdown: in inference mode (or where `document` is given: the attention
  file), `model`'s section of a sectioned file, keeping the other models' sections."""
  if mode == "inference":
    document = inference_document
  if document is None:
    common.write(console, path, section)
    return
  previous = None
  if os.path.exists(path):
    with open(path) as f:
      previous = f.read()
  common.write(console, path, document(previous, model, section))


def markdown(
  results: list[Result],
  notes: list[str],
  graphs: list[Graph],
  command: str,
  *,
  precision: str = "highest",
  mode: str = "train",
) -> str:
  """The RGCN table as a document (mode "train"), or as the RGCN section of the inference
  document (mode "inference")."""
  hw = common.hardware()
  header, rows = table_rows(results, mode=mode)
  if mode == "inference":
    head = [section_begin("rgcn"), "## One RGCN layer: inference (forward only)", ""]
  else:
    head = [
      "# One RGCN layer: relational message, forward + backward",
      "",
      "RGAT and HGT, with the ablation of hector's passes: "
      "[rgnn_attention.md](rgnn_attention.md) (`jaxdata bench rgnn --model rgat|hgt`); "
      "inference (forward only): [rgnn_inference.md](rgnn_inference.md). Notes: "
      "[rgnn_notes.md](rgnn_notes.md), [rgnn_attention_notes.md](rgnn_attention_notes.md).",
      "",
    ]
  text = [
    *head,
    "Measured by `jaxdata bench rgnn` (examples/benchmarks/rgnn.py): milliseconds of "
    f"{mode_text(mode)}, "
    "out[i] = sum over in-edges e of norm[e] x[src[e]] W[etype[e]] with norm the per-relation "
    "mean, float32, d_in = d_out = dim, the whole graph. *jaxdata* is "
    "`jaxdata.hector.rgcn_message`; *transform-all-then-gather*, *ragged_dot* and *per-edge "
    "weights* are plain JAX (jaxdata/reference/rgcn.py); *PyG RGCNConv* is "
    '`torch_geometric.nn.RGCNConv(aggr="mean")` kept on its per-relation loop (its '
    "segment_matmul path averages over all relations at once), *PyG FastRGCNConv* is "
    '`torch_geometric.nn.FastRGCNConv(aggr="mean")`, the same layer through per-edge '
    "weights W[etype] ([E, d_in, d_out]) and a batched matmul; *jaxdata vs PyG* is against the "
    "faster of the two, named in brackets (which code paths PyG takes without pyg-lib and "
    "torch-sparse: rgnn_notes.md). " + precision_text(precision),
    "",
    "*Peak memory*: for JAX, what XLA's compiled executable needs (`memory_analysis()`: arguments "
    "+ outputs + temporaries); for PyG, `torch.cuda.max_memory_allocated` over the case, inputs "
    "included (n/a on the CPU). XLA's analysis counts the buffers XLA allocates, so for jaxdata's "
    "FFI kernels only what they take from XLA (outputs, scratch passed as outputs) is in it. "
    "*Measured peak* (GPU): how far compiling and running the step raised JAX's "
    "`peak_bytes_in_use`, plus the step's arguments (XLA's autotuner allocates operand-sized "
    "buffers while compiling, so this bounds the run from above); blank where an earlier case's "
    "peak hides it (JAX cannot reset the peak). *OOM (est.)*: not run because XLA's analysis of "
    "the compiled step says it cannot fit in the free device memory (for FastRGCNConv on the CPU: "
    "its per-edge weights cannot fit in free RAM); *OOM*: the run failed for memory. (*per-edge "
    "weights* builds its [E, d_in, d_out] tensor on the CPU; XLA on the GPU fuses the gather "
    "W[etype] into the contraction and does not. *ragged_dot* is expanded densely, [R, E, d_in] "
    "masked, on both: its memory grows with the number of relations.) Speedups divide the faster "
    "peer's time by jaxdata's; *memory / PyG's* divides jaxdata's peak memory by that PyG "
    "formulation's.",
    "",
    f"Command: `{command}`",
    "",
    *[f"- {k}: {v}" for k, v in hw.items()],
    f"- PyG: {software_line()}",
    "",
    "Graphs:",
    "",
    *[f"- {g.describe()}" for g in graphs],
    "",
    common.markdown_table(header, rows),
    "",
  ]
  if notes:
    text += ["Skipped or unexpected:", "", *(f"- {n}" for n in notes), ""]
  if mode == "inference":
    text.append(section_end("rgcn"))
  return "\n".join(text)


# ----------------------------------------------------------------------------- the CLI
def main(args) -> int:
  """`jaxdata bench rgnn --model rgcn` (its options: `benchmarks.rgnn_command`)."""
  if args.formulations:
    raise command.UsageError("argument --formulations: only for --model rgat or hgt")
  graphs = common.pick(args.graphs, args.quick, list(QUICK["graphs"]), list(GRAPHS))
  dims = common.pick(args.dims, args.quick, list(QUICK["dims"]), list(DIMS))
  repeats = common.pick(args.repeats, args.quick, QUICK["repeats"], 7)
  unknown = [g for g in graphs if not is_graph(g)]
  if unknown:
    raise command.UsageError(
      f"argument --graphs: unknown graph(s) {', '.join(unknown)}; choose from "
      f"{', '.join(GRAPHS)}, uniform, zipf-src-E, zipf-dst-E, zipf-both-E (E > 1)"
    )
  data_dir = args.data_dir if args.data_dir is not None else default_data_dir()
  console = command.console(width=160)
  results, notes, loaded = run(
    graphs,
    dims,
    data_dir=data_dir,
    quick=args.quick,
    repeats=repeats,
    precision=args.precision,
    mode=args.mode,
    console=console,
  )
  common.check_measured(results, notes)
  for g in loaded:
    console.print(g.describe())
  what = "inference (forward only)" if args.mode == "inference" else "forward + backward"
  common.print_table(
    console,
    f"one RGCN layer, relational part: {what}",
    *table_rows(results, mode=args.mode),
    notes,
    left=("graph", "formulation"),
  )
  if args.write:
    write_markdown(
      console,
      args.write,
      "rgcn",
      markdown(
        results, notes, loaded, common.command_line(), precision=args.precision, mode=args.mode
      ),
      args.mode,
      None,
    )
  return 0
