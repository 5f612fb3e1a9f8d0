"""`jaxdata bench rgnn --model rgat|hgt`: one attention layer, side by side, per training step
(forward + backward) or, with `--mode inference`, per forward pass alone.

RGAT (relational graph attention, H heads of dim / H features, concatenated; see
jaxdata/reference/attention.py for the definition) on AIFB, MUTAG and a synthetic knowledge
graph of 2 million edges and 535 relations; HGT (the heterogeneous graph transformer as PyG's
HGTConv computes it) on `synthetic_mag`, an ogbn-mag-shaped graph (full scale: 1.9 million
nodes, 42 million edges, 8 relations). Hidden sizes d_in = d_out = dim (HGT: d_out = dim, its
inputs are the per-type features of the graph). In one run, for each graph and dim:

  jaxdata                    the generated kernels with every pass (`jaxdata.hector.rgat_message`;
                             for HGT `jaxdata.hector.hgt_message`, the relational part, between
                             the per-type projections and outputs in plain JAX)
  jaxdata (no passes) ...    the same with passes switched off: none, compaction only, reordering
                             only (the ablation: what each pass buys)
  transform-all-then-gather  plain JAX: every node through every relation's weights, then gather
  ragged_dot                 plain JAX: per-edge rows grouped by relation, `jax.lax.ragged_dot`
  per-edge weights           plain JAX: W[etype] gathered per edge
  PyG                        torch_geometric.nn.RGATConv / HGTConv holding the same weights, on
                             CUDA when torch sees one

Each step is loss = sum(out * ct) for a fixed random ct, with gradients for the inputs and every
weight (mode "train"), or the forward pass alone (mode "inference"; PyG in eval mode under
torch.inference_mode()). Precision "both" runs the plain-JAX rows at "highest" and "default"
(`rgnn.plain_precisions`). Time and memory are measured as `jaxdata bench rgnn` (RGCN) measures them
(examples/benchmarks/rgnn.py): per step, steps queued back to back; XLA's memory_analysis() of the
compiled step for JAX, torch.cuda.max_memory_allocated for PyG; a formulation that cannot fit is
reported as OOM, never a crash. Every formulation of a case must compute the same loss; a difference
is a note. `--write` keeps one document with a section per model (`document`).

RGAT's attention vectors are shared by all relations (PyG's RGATConv shares its q and k), so
that PyG computes the same layer; the other formulations still take them per relation.

    >>> results, notes, cases = run("rgat", ["synthetic"], [32], quick=True)
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import statistics
from collections.abc import Callable, Sequence

import numpy as np

from benchmarks import common, rgnn
from benchmarks import rgnn_peers as peers
from jaxdata import command
from jaxdata.reference import attention as attention_ref
from jaxdata.timing import step_seconds

MODELS = ("rgat", "hgt")
#: Attention heads; each has dim / HEADS features (RGAT: per head; HGT: d_k).
HEADS = 4
DIMS = rgnn.DIMS
GRAPHS = {"rgat": ("aifb", "mutag", "synthetic"), "hgt": ("mag",)}
#: The synthetic knowledge graph for the attention layers: 2 million edges, 535 relations.
SYNTHETIC = dict(num_nodes=200_000, num_edges=2_000_000, num_relations=535)
QUICK_SYNTHETIC = rgnn.QUICK_SYNTHETIC
#: synthetic_mag's scale: ogbn-mag's counts (1.0), or a small graph for --quick.
MAG_SCALE = 1.0
QUICK_MAG_SCALE = 1e-3
QUICK = {
  "rgat": dict(graphs=("aifb", "synthetic"), dims=(32,), repeats=3),
  "hgt": dict(graphs=("mag",), dims=(32,), repeats=3),
}
#: jaxdata's rows: name -> the passes it runs (None: all of `jaxdata.hector.PASSES`).
VARIANTS = {
  "jaxdata": None,
  "jaxdata (no passes)": (),
  "jaxdata (compact only)": ("compact",),
  "jaxdata (reorder only)": ("reorder",),
}
PLAIN_JAX = tuple(attention_ref.RGAT)  # the same three names for HGT
FORMULATIONS = (*VARIANTS, *PLAIN_JAX, "PyG")
TITLES = {"rgat": "one RGAT layer: forward + backward", "hgt": "one HGT layer: forward + backward"}


@dataclasses.dataclass
class Case:
  """A benchmark graph and, for HGT, its node types, relation types and per-type features."""

  graph: rgnn.Graph
  node_types: tuple[str, ...] = ()
  relation_types: tuple[tuple[str, str, str], ...] = ()
  features: tuple[np.ndarray, ...] = ()

  @property
  def name(self) -> str:
    return self.graph.name

  def describe(self) -> str:
    text = self.graph.describe()
    if self.features:
      text += "; features " + ", ".join(
        f"{t} {x.shape[0]:,}x{x.shape[1]}" for t, x in zip(self.node_types, self.features)
      )
    return text


# ------------------------------------------------------------------------------------------------
# Graphs and inputs


def known(model: str, name: str) -> bool:
  """Whether `load_case` knows graph `name` for `model`: `GRAPHS`, and for RGAT the hub-heavy
  family too (`rgnn.SKEWED`)."""
  return name in GRAPHS[model] or (model == "rgat" and rgnn.SKEWED.fullmatch(name) is not None)


def load_case(
  model: str,
  name: str,
  *,
  data_dir: str | None,
  quick: bool,
  mag_scale: float | None = None,
  seed: int = 0,
) -> tuple[Case | None, str | None]:
  """(case, None), or (None, why it was skipped)."""
  if not known(model, name):
    raise ValueError(f"unknown graph {name!r} for {model}; choose from {', '.join(GRAPHS[model])}")
  if model == "rgat":
    sizes = QUICK_SYNTHETIC if quick else SYNTHETIC
    graph, why = rgnn.load_graph(name, data_dir=data_dir, quick=quick, seed=seed, synthetic=sizes)
    return (None, why) if graph is None else (Case(graph), None)
  from jaxdata.data import synthetic_mag  # pylint: disable=g-import-not-at-top

  scale = mag_scale if mag_scale is not None else (QUICK_MAG_SCALE if quick else MAG_SCALE)
  ds = synthetic_mag(scale=scale, seed=seed)
  g = ds.graph
  graph = rgnn.Graph.from_hetero(name, g, f"jaxdata.data.synthetic_mag(scale={scale:g})")
  return Case(
    graph,
    tuple(g.node_type_names),
    tuple(ds.relation_types),
    tuple(np.asarray(x, np.float32) for x in ds.features),
  ), None


def head_features(dim: int, heads: int) -> int:
  if dim % heads:
    raise ValueError(f"dim {dim} is not a multiple of heads={heads}")
  return dim // heads


def case_arrays(model: str, case: Case, dim: int, heads: int, seed: int = 0):
  """(x, params, ct) as float32 NumPy (pytrees of them); the same for every formulation.

  RGAT: x [N, dim] standard normal, `init_rgat` weights with the attention vectors of relation
  0 repeated for every relation. HGT: the graph's per-type features, `init_hgt` weights (PyG's
  start: zero biases, mu = skip = 1), out dim = heads * (dim / heads). ct: [N, dim].
  """
  d = head_features(dim, heads)
  g = case.graph
  rng = np.random.default_rng((seed, g.num_nodes, g.num_edges, dim))
  ct = rng.standard_normal((g.num_nodes, dim), dtype=np.float32)
  to_np = lambda tree: _tree_map(lambda a: np.asarray(a, np.float32), tree)  # noqa: E731
  if model == "rgat":
    x = rng.standard_normal((g.num_nodes, dim), dtype=np.float32)
    p = attention_ref.init_rgat(
      seed, num_relations=g.num_relations, in_features=dim, head_features=d, heads=heads
    )
    shared = lambda a: np.broadcast_to(np.asarray(a)[:1], a.shape).copy()  # noqa: E731
    return x, to_np(p._replace(a_src=shared(p.a_src), a_dst=shared(p.a_dst))), ct
  p = attention_ref.init_hgt(
    seed,
    in_features=[x.shape[1] for x in case.features],
    num_relations=g.num_relations,
    head_features=d,
    heads=heads,
  )
  return case.features, to_np(p), ct


def _tree_map(fn, tree):
  import jax  # pylint: disable=g-import-not-at-top

  return jax.tree.map(fn, tree)


# ------------------------------------------------------------------------------------------------
# jaxdata's kernels as `rgnn_peers.Formulation`s: the only code here that knows hector's API


def rgat_jaxdata_formulation(
  arrays, passes, name: str = "jaxdata", *, precision=None
) -> peers.Formulation:
  """`jaxdata.hector.rgat_message` with these passes at this matmul precision:
  message(graph, x, RGATParams)."""
  from jaxdata import hector  # pylint: disable=g-import-not-at-top

  if not hasattr(hector, "rgat_message"):
    raise peers.Unavailable("jaxdata.hector.rgat_message not built yet")
  return peers.Formulation(
    name,
    lambda g, x, p: hector.rgat_message(
      g, x, p.w, p.a_src, p.a_dst, passes=passes, precision=precision
    ),
    arrays,
  )


def hgt_message_fn():
  """`jaxdata.hector.hgt_message`, or None while it does not exist (it is being written)."""
  try:
    from jaxdata import hector  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return getattr(hector, "hgt_message", None)


#: hgt_message's inputs after the graph, in order (hector's signature, like rgat_message's).
HGT_INPUTS = ("k", "q", "v", "w_att", "w_msg", "mu")


def hgt_jaxdata_formulation(
  arrays, passes, name: str = "jaxdata", *, precision=None
) -> peers.Formulation:
  """HGT with `jaxdata.hector.hgt_message` as message(graph, xs, HGTParams) -> [N, dim].

  hgt_message(graph, k, q, v, w_att, w_msg, mu, *, passes=None) is the relational part: K, Q, V of
  every node [N, H*d_k] in (`jaxdata.reference.attention.hgt_projections`, flattened), w_att, w_msg
  [R, H, d_k, d_k], mu [R, H]; the aggregated messages [N, H*d_k] out. The per-type projections
  before it and A_t(gelu(.)) with the skip gate after it (`jaxdata.reference.attention.hgt_output`)
  run in plain JAX, as `jaxdata.nn.HGT` runs them around the kernel; the outputs of the node types
  are concatenated in id order. Raises `peers.Unavailable` while hgt_message does not exist or has
  another signature (then adapt this function).
  """
  fn = hgt_message_fn()
  if fn is None:
    raise peers.Unavailable("jaxdata.hector.hgt_message not built yet")
  signature = inspect.signature(fn)
  names = tuple(n.lower() for n in list(signature.parameters)[1 : len(HGT_INPUTS) + 1])
  if names != HGT_INPUTS or "passes" not in signature.parameters:
    raise peers.Unavailable(
      f"jaxdata.hector.hgt_message{signature}: no adapter for this "
      f"signature (examples/benchmarks/rgnn_attention.py, "
      f"hgt_jaxdata_formulation)"
    )
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  extra = {"precision": precision} if "precision" in signature.parameters else {}

  def message(g, xs, p):
    k, q, v = (
      a.reshape(a.shape[0], -1) for a in attention_ref.hgt_projections(xs, p, precision=precision)
    )
    agg = fn(g, k, q, v, p.w_att, p.w_msg, p.mu, passes=passes, **extra)
    agg = agg.astype(jnp.promote_types(agg.dtype, jnp.float32))
    return jnp.concatenate(attention_ref.hgt_output(agg, xs, p, precision=precision))

  return peers.Formulation(name, message, arrays)


def plain_formulation(
  model: str, name: str, edges: attention_ref.Edges, *, precision=None
) -> peers.Formulation:
  if model == "rgat":
    return peers.rgat_formulation(name, edges, precision=precision)
  return peers.hgt_formulation(name, edges, precision=precision)


# ------------------------------------------------------------------------------------------------
# PyG


def pyg_bytes_model(model: str, num_edges: int, d_in: int, dim: int, mode: str = "train") -> int:
  """A lower bound on PyG's memory for one step where torch cannot tell (the CPU), used only to
  avoid starting what cannot fit (the kernel's OOM killer does not raise).

  RGATConv gathers W[etype] per edge, [E, d_in, H*d], and its backward builds a gradient of the
  same shape; HGTConv keeps a handful of [E, H*d] tensors (keys, values, messages, their
  gradients): counted as eight. Inference (no backward, nothing saved): half of each.
  """
  share = 2 if mode == "inference" else 1
  if model == "rgat":
    return 2 * num_edges * d_in * dim * 4 // share
  return 8 * num_edges * dim * 4 // share


def _pyg_step(model: str, case: Case, x, params, ct, device, mode: str = "train"):
  """Builds PyG's layer and inputs on `device`; returns step() -> loss tensor: forward + backward
  (mode "train"), or the forward alone in eval mode under `torch.inference_mode()` with
  sum(out * ct) taken outside the timed forward's autograd (mode "inference": step(checksum=True)
  returns it, step() only runs the layer)."""
  import torch  # pylint: disable=g-import-not-at-top

  from jaxdata.reference import pyg as pyg_ref  # pylint: disable=g-import-not-at-top

  train = mode == "train"
  g = case.graph
  ctt = torch.from_numpy(ct).to(device)
  if model == "rgat":
    conv = pyg_ref.pyg_rgat_conv(params, device=device, dtype=torch.float32)
    edge_index, edge_type = pyg_ref.pyg_graph(g.src, g.dst, g.etype, device)
    xt = torch.from_numpy(x).to(device).requires_grad_(train)
    xts = [xt]

    def layer():
      return conv(xt, edge_index, edge_type)

    def loss(out):
      return (out * ctt).sum()
  else:
    conv = pyg_ref.pyg_hgt_conv(
      params, case.node_types, case.relation_types, device=device, dtype=torch.float32
    )
    xts = [torch.from_numpy(a).to(device).requires_grad_(train) for a in x]
    x_dict, edge_index_dict = pyg_ref.pyg_hetero_inputs(
      g.src, g.dst, g.etype, xts, case.node_types, case.relation_types, device=device
    )
    bounds = np.cumsum([0] + [len(a) for a in x])
    cts = {t: ctt[a:b] for t, a, b in zip(case.node_types, bounds[:-1], bounds[1:])}

    def layer():
      return conv(x_dict, edge_index_dict)

    def loss(out):
      return sum((out[t] * cts[t]).sum() for t in case.node_types)

  if not train:
    conv.eval()

    def forward(checksum: bool = False):
      with torch.inference_mode():
        out = layer()
        return loss(out) if checksum else out

    return forward

  def step():
    conv.zero_grad(set_to_none=True)
    for a in xts:
      a.grad = None
    value = loss(layer())
    value.backward()
    return value

  return step


def measure_pyg(
  model: str,
  case: Case,
  dim: int,
  heads: int,
  *,
  repeats: int,
  precision: str,
  notes: list[str],
  mode: str = "train",
) -> rgnn.Result:
  r = rgnn.Result(case.name, dim, "PyG")
  try:
    import torch  # pylint: disable=g-import-not-at-top

    from jaxdata.reference import pyg as pyg_ref  # pylint: disable=g-import-not-at-top

    importlib.import_module("torch_geometric.nn")
  except ImportError as e:
    r.status = "skipped"
    rgnn._note(notes, f"PyG row skipped: torch_geometric is not importable ({e})")
    return r
  device = pyg_ref.torch_device()
  x, params, ct = case_arrays(model, case, dim, heads)
  where = f"{case.name}, dim {dim}, PyG"
  if device.type != "cuda":
    import jax  # pylint: disable=g-import-not-at-top

    d_in = dim if model == "rgat" else max(a.shape[1] for a in x)
    need = pyg_bytes_model(model, case.graph.num_edges, d_in, dim, mode)
    free = rgnn.available_bytes(jax.devices("cpu")[0])
    if need > free:
      r.status = f"OOM (est. {rgnn.gib(need)})"
      rgnn._note(
        notes,
        f"{where}: not run, its per-edge tensors alone need {rgnn.gib(need)} "
        f"and {rgnn.gib(free)} are free",
      )
      return r
  saved_tf32 = torch.backends.cuda.matmul.allow_tf32
  torch.backends.cuda.matmul.allow_tf32 = rgnn.pyg_tf32(precision)
  cuda = device.type == "cuda"
  try:
    if cuda:
      torch.cuda.synchronize(device)
      torch.cuda.reset_peak_memory_stats(device)
      base = torch.cuda.memory_allocated(device)
    step = _pyg_step(model, case, x, params, ct, device, mode)
    r.loss = float((step(checksum=True) if mode == "inference" else step()).detach().item())
    r.seconds, r.alone_seconds = step_seconds(step, repeats=repeats, wait=peers.pyg_wait(device))
    r.bytes = torch.cuda.max_memory_allocated(device) - base if cuda else None
  except Exception as e:  # pylint: disable=broad-except
    r.status = "OOM" if rgnn.is_oom(e) else "error"
    r.loss = r.seconds = None
    rgnn._note(
      notes, f"{where}: {'out of memory' if rgnn.is_oom(e) else 'failed'} ({rgnn._short(e)})"
    )
  finally:
    step = None
    torch.backends.cuda.matmul.allow_tf32 = saved_tf32
    if cuda:
      torch.cuda.empty_cache()
  return r


# ------------------------------------------------------------------------------------------------
# JAX


def measure_jax(
  model: str,
  case: Case,
  dim: int,
  heads: int,
  names: Sequence[str],
  *,
  repeats: int,
  precision: str,
  edges: attention_ref.Edges,
  arrays,
  notes: list[str],
  advance: Callable[[], None],
  mode: str = "train",
) -> list[rgnn.Result]:
  """Every JAX formulation on one (graph, dim): jaxdata's variants at `rgnn.jaxdata_precisions`,
  the plain-JAX ones at each of `rgnn.plain_precisions`; `arrays` is hector's GraphArrays (or
  the `peers.Unavailable` that building it raised). `advance()` after each name."""
  import jax  # pylint: disable=g-import-not-at-top

  device = jax.devices()[0]
  x, params, ct = jax.device_put(case_arrays(model, case, dim, heads), device)
  results = []
  for name in names:
    runs = (
      rgnn.plain_precisions(precision)
      if name in PLAIN_JAX
      else rgnn.jaxdata_precisions(precision, name)
    )
    try:
      for p in runs:
        r = rgnn.Result(case.name, dim, name, precision=p)
        results.append(r)
        prec = rgnn._precision(p)

        def build(name=name, prec=prec):
          if name in PLAIN_JAX:
            return plain_formulation(model, name, edges, precision=prec)
          if isinstance(arrays, Exception):
            raise arrays
          if model == "rgat":
            return rgat_jaxdata_formulation(arrays, VARIANTS[name], name, precision=prec)
          return hgt_jaxdata_formulation(arrays, VARIANTS[name], name, precision=prec)

        rgnn.measure_step(r, build, x, params, ct, repeats=repeats, notes=notes, mode=mode)
    finally:
      advance()
  return results


def graph_arrays(case: Case):
  """hector's GraphArrays of the case's graph, or the `peers.Unavailable` saying why not."""
  try:
    from jaxdata import hector  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    return peers.Unavailable(f"jaxdata.hector is not importable ({e})")
  if case.graph.hetero is None:
    return peers.Unavailable("no jaxdata.data.HeteroGraph of this graph to compile for")
  return hector.GraphArrays.from_graph(case.graph.hetero)


# ------------------------------------------------------------------------------------------------
# The run


def run(
  model: str,
  graphs: Sequence[str] | None = None,
  dims: Sequence[int] = DIMS,
  *,
  heads: int = HEADS,
  formulations: Sequence[str] = FORMULATIONS,
  data_dir: str | None = None,
  quick: bool = False,
  mag_scale: float | None = None,
  repeats: int = 7,
  precision: str = "highest",
  seed: int = 0,
  mode: str = "train",
  console=None,
) -> tuple[list[rgnn.Result], list[str], list[Case]]:
  """Runs the benchmark of `model` ("rgat" or "hgt"); returns results, notes, the cases.

  mode: "train" or "inference" (forward only); precision: one of `rgnn.PRECISION_CHOICES`.

  As for RGCN, PyG runs first for every case, before JAX touches the device. HGT gets jaxdata
  rows only where `jaxdata.hector.hgt_message` exists (a note says so otherwise).
  """
  import rich.progress  # pylint: disable=g-import-not-at-top

  if model not in MODELS:
    raise ValueError(f"model must be one of {MODELS}, got {model!r}")
  rgnn.check_mode_precision(mode, precision)
  if heads <= 0:
    raise ValueError(f"heads must be positive, got {heads}")
  for d in dims:
    if d <= 0:
      raise ValueError(f"dims must be positive, got {d}")
    head_features(d, heads)
  unknown = [f for f in formulations if f not in FORMULATIONS]
  if unknown:
    raise ValueError(f"unknown formulations {unknown}; choose from {', '.join(FORMULATIONS)}")
  graphs = GRAPHS[model] if graphs is None else graphs
  notes: list[str] = []
  formulations = list(formulations)
  if model == "hgt" and hgt_message_fn() is None and any(f in VARIANTS for f in formulations):
    formulations = [f for f in formulations if f not in VARIANTS]
    notes.append("no jaxdata row: jaxdata.hector.hgt_message (hector's HGT) is not built yet")
  loaded: list[Case] = rgnn.load_each(
    graphs,
    lambda name: load_case(
      model, name, data_dir=data_dir, quick=quick, mag_scale=mag_scale, seed=seed
    ),
    notes,
  )
  jax_names = [f for f in FORMULATIONS if f in formulations and f != "PyG"]
  results: list[rgnn.Result] = []
  with rich.progress.Progress(console=console, transient=True) as bar:
    task = bar.add_task(f"bench rgnn {model}", total=len(loaded) * len(dims) * len(formulations))
    if "PyG" in formulations:
      for c in loaded:
        for d in dims:
          bar.update(task, description=f"{c.name}, dim {d}, PyG")
          results.append(
            measure_pyg(
              model, c, d, heads, repeats=repeats, precision=precision, notes=notes, mode=mode
            )
          )
          bar.advance(task)
    if jax_names:
      import jax  # pylint: disable=g-import-not-at-top

      for c in loaded:
        g = c.graph
        edges = attention_ref.Edges.build(
          g.src, g.dst, g.etype, num_nodes=g.num_nodes, num_relations=g.num_relations
        )
        arrays = None
        if any(n in VARIANTS for n in jax_names):
          try:
            arrays = graph_arrays(c)
          except Exception as e:  # pylint: disable=broad-except
            arrays = peers.Unavailable(f"building hector's GraphArrays failed ({rgnn._short(e)})")
        for d in dims:
          bar.update(task, description=f"{c.name}, dim {d}, JAX")
          results += measure_jax(
            model,
            c,
            d,
            heads,
            jax_names,
            repeats=repeats,
            precision=precision,
            edges=edges,
            arrays=arrays,
            notes=notes,
            advance=lambda: bar.advance(task),
            mode=mode,
          )
        del edges, arrays
        jax.clear_caches()
  results.sort(key=rgnn.sort_key(FORMULATIONS, [c.name for c in loaded]))
  rgnn._check_losses(results, precision, notes)
  return results, notes, loaded


# ------------------------------------------------------------------------------------------------
# Output


def _ratio(x: float) -> str:
  return f"{x:.2f}x"


def comparisons(results: list[rgnn.Result], graph: str, dim: int) -> tuple[str, ...]:
  """(jaxdata vs the fastest plain-JAX formulation, at each precision the run has; vs PyG;
  jaxdata's memory / PyG's) for one case (`rgnn.comparisons`); speedups divide the peer's time
  by jaxdata's."""
  return rgnn.comparisons(results, graph, dim, plain=PLAIN_JAX, pyg=("PyG",))


def table_rows(
  results: list[rgnn.Result], mode: str = "train"
) -> tuple[list[str], list[list[str]]]:
  return rgnn.table_rows(results, mode=mode, plain=PLAIN_JAX, pyg=("PyG",))


def ablation(
  results: list[rgnn.Result], mode: str = "train"
) -> tuple[list[str], list[list[str]], list[str]]:
  """(header, rows, summary lines): each jaxdata variant against jaxdata with no passes.

  Per case: time and memory of every variant, its speedup over no passes and its memory as a
  share of no passes'. The summary gives, per variant, the range and median of both over the
  cases where both ran.
  """
  header = [
    "graph",
    "dim",
    "passes",
    rgnn.time_header(mode)[0],
    "peak memory",
    "speedup over no passes",
    "memory / no passes'",
  ]
  rows, speed, memory = [], {}, {}
  cases = []
  for r in results:
    if (r.graph, r.dim) not in cases:
      cases.append((r.graph, r.dim))
  for graph, dim in cases:
    rows_ = [r for r in results if r.graph == graph and r.dim == dim and r.formulation in VARIANTS]
    # the variants at one precision: the "jaxdata" row may also have run at another
    at = next((r.precision for r in rows_ if r.formulation == "jaxdata (no passes)"), None)
    mine = {r.formulation: r for r in rows_ if at is None or r.precision == at}
    if not mine:
      continue
    base = mine.get("jaxdata (no passes)")
    for name in (
      "jaxdata (no passes)",
      "jaxdata (compact only)",
      "jaxdata (reorder only)",
      "jaxdata",
    ):
      r = mine.get(name)
      if r is None:
        continue
      label = "all" if name == "jaxdata" else name[len("jaxdata (") : -1]
      s = m = ""
      if r.ok and base is not None and base.ok and name != "jaxdata (no passes)":
        speed.setdefault(label, []).append(base.seconds / r.seconds)
        s = _ratio(speed[label][-1])
        if r.bytes and base.bytes:
          memory.setdefault(label, []).append(r.bytes / base.bytes)
          m = _ratio(memory[label][-1])
      elif base is not None and not base.ok and r.ok:
        s = f"no passes: {base.status}"
      rows.append([graph, str(dim), label, rgnn._ms(r), rgnn._mem(r.bytes, r), s, m])

  def spread(xs: list[float]) -> str:
    if len(xs) == 1:
      return _ratio(xs[0])
    return (
      f"{_ratio(min(xs))} to {_ratio(max(xs))} (median {_ratio(statistics.median(xs))}, "
      f"{len(xs)} cases)"
    )

  summary = []
  for label in ("compact only", "reorder only", "all"):
    if label in speed:
      line = f"{label}: speedup over no passes {spread(speed[label])}"
      if memory.get(label):
        line += f"; memory {spread(memory[label])} of no passes'"
      summary.append(line)
  return header, rows, summary


DEFINITIONS = {
  "rgat": (
    "RGAT, one layer: h_e = x[src] W[r] (H heads of d = dim / H features), score = "
    "leaky_relu(a_src[r] . h_e + a_dst[r] . x[dst] W[r], 0.2) per head, softmax over all "
    "in-edges of a node (across relations), out[i] = concat_h sum_e alpha[e, h] h_e[h]; "
    "d_in = H d = dim; no self loop, no bias. Gradients for x, W, a_src and a_dst. *jaxdata* "
    "is `jaxdata.hector.rgat_message` (generated kernels, every pass); *PyG* is "
    '`torch_geometric.nn.RGATConv(attention_mode="additive-self-attention", '
    'attention_mechanism="across-relation", dim=1, bias=False)` holding the same weights. '
    "RGATConv's attention vectors (its q and k) are shared by all relations, so every "
    "formulation gets a_src and a_dst equal across relations (the others would take them "
    "per relation at the same cost)."
  ),
  "hgt": (
    "HGT, one layer, as PyG's HGTConv computes it: per-type K, Q, V linear maps, per-relation "
    "W_att, W_msg [H, d_k, d_k] and prior mu, softmax over all in-edges of a node, "
    "A_t(gelu(.)) per node type and the skip gate where a type's input width equals dim; "
    "H d_k = dim, inputs are the graph's per-type features. Gradients for the features and "
    "every weight. *jaxdata* is `jaxdata.hector.hgt_message` (generated kernels, every "
    "pass) for the relational part, with the per-type projections before it and "
    "A_t(gelu(.)) and the skip after it in plain JAX, as `jaxdata.nn.HGT` runs them; *PyG* "
    "is `torch_geometric.nn.HGTConv` holding the same weights (PyG's initialisation: zero "
    "biases, mu = skip = 1)."
  ),
}

PASSES_BUY = {
  "rgat": (
    "*compact* is compact materialization (h = x[src] W_r and the source's score, which "
    "depend only on (source node, relation), computed once per unique pair instead of once "
    "per edge); *reorder* is linear-operator reordering (W_r a_dst folded on XLA, so the "
    "destination's score is one [N, H] product instead of a per-edge [E, H d] term)."
  ),
  "hgt": (
    "*compact* is compact materialization (K W_att and V W_msg, which depend only on "
    "(source node, relation), computed once per unique pair instead of once per edge); "
    "*reorder* is linear-operator reordering (the prior mu folded into W_att on XLA, no "
    "multiply per edge and head, and the W_att product kept on the source side where "
    "compaction can share it)."
  ),
}

TITLE = "# Attention layers (RGAT, HGT): one layer, forward + backward"


def markdown(
  model: str,
  results: list[rgnn.Result],
  notes: list[str],
  cases: list[Case],
  command: str,
  *,
  heads: int = HEADS,
  precision: str = "highest",
  mode: str = "train",
) -> str:
  """One model's section of the document (`document`, or `rgnn.inference_document` for mode
  "inference", puts the sections together)."""
  hw = common.hardware()
  header, rows = table_rows(results, mode)
  what = "inference (forward only)" if mode == "inference" else "forward + backward"
  text = [
    _begin(model),
    f"## One {model.upper()} layer: {what}",
    "",
    f"Measured by `jaxdata bench rgnn --model {model}` (examples/benchmarks/rgnn_attention.py): "
    f"milliseconds of {rgnn.mode_text(mode)}, float32, the whole graph, {heads} heads. "
    + DEFINITIONS[model]
    + " "
    "*transform-all-then-gather*, *ragged_dot* and *per-edge weights* are plain JAX "
    "(jaxdata/reference/attention.py). " + rgnn.precision_text(precision),
    "",
    "*Peak memory*, *measured peak* and *OOM* as in the RGCN table (rgnn.md): for JAX, what "
    "XLA's compiled executable needs (`memory_analysis()`: arguments + outputs + "
    "temporaries; for jaxdata's FFI kernels that is what they take from XLA, their "
    "intermediates included); for PyG, `torch.cuda.max_memory_allocated` over the case "
    "(n/a on the CPU, where a PyG case whose per-edge tensors cannot fit in free RAM is not "
    "started: *OOM (est.)*). *OOM (est.)* for JAX: XLA's analysis says the step cannot fit "
    "in free device memory; *OOM*: the run failed for memory. Speedups divide the peer's "
    "time by jaxdata's (all passes); *memory / PyG's* divides jaxdata's peak memory by "
    "PyG's. Every formulation's loss is checked against transform-all-then-gather's; a "
    "difference would be listed at the end.",
    "",
    f"Command: `{command}`",
    "",
    *[f"- {k}: {v}" for k, v in hw.items()],
    f"- PyG: {rgnn.software_line()}",
    "",
    "Graphs:",
    "",
    *[f"- {c.describe()}" for c in cases],
    "",
    common.markdown_table(header, rows),
    "",
  ]
  ab_header, ab_rows, summary = ablation(results, mode)
  if ab_rows:
    text += [
      f"### {model.upper()}: what each pass buys",
      "",
      "jaxdata's rows again, each against the same kernels with no optimizing pass "
      "(`passes=()`): " + PASSES_BUY[model],
      "",
      common.markdown_table(ab_header, ab_rows),
      "",
    ]
    if summary:
      text += ["Measured, over the cases above:", "", *(f"- {s}" for s in summary), ""]
  if notes:
    text += ["Skipped or unexpected:", "", *(f"- {n}" for n in notes), ""]
  text.append(_end(model))
  return "\n".join(text)


def _begin(model: str) -> str:
  return rgnn.section_begin(model)


def _end(model: str) -> str:
  return rgnn.section_end(model)


def document(previous: str | None, model: str, section: str) -> str:
  """The whole document with `model`'s section replaced by `section`, the other model's section
  kept from `previous` (the file as it was, or None), so that RGAT and HGT, run separately,
  land in one file."""
  return rgnn.sectioned(
    previous,
    model,
    section,
    title=TITLE,
    models=MODELS,
    intro="Written by `jaxdata bench rgnn --model rgat|hgt --write <this file>`: each run "
    "replaces its model's section and keeps the other's. The RGCN figures are in "
    "rgnn.md.",
  )


# ----------------------------------------------------------------------------- the CLI
def main(args) -> int:
  """`jaxdata bench rgnn --model rgat|hgt` (its options: `benchmarks.rgnn_command`)."""
  import rich.markup  # pylint: disable=g-import-not-at-top

  model = args.model
  quick = QUICK[model]
  graphs = common.pick(args.graphs, args.quick, list(quick["graphs"]), list(GRAPHS[model]))
  dims = common.pick(args.dims, args.quick, list(quick["dims"]), list(DIMS))
  repeats = common.pick(args.repeats, args.quick, quick["repeats"], 7)
  unknown = [g for g in graphs if not known(model, g)]
  if unknown:
    raise command.UsageError(
      f"argument --graphs: unknown graph(s) {', '.join(unknown)} for "
      f"--model {model}; choose from {', '.join(GRAPHS[model])}"
    )
  for d in dims:
    if d % args.heads:
      raise command.UsageError(f"argument --dims: {d} is not a multiple of --heads {args.heads}")
  formulations = args.formulations or list(FORMULATIONS)
  unknown = [f for f in formulations if f not in FORMULATIONS]
  if unknown:
    raise command.UsageError(
      f"argument --formulations: unknown {unknown}; choose from {', '.join(FORMULATIONS)}"
    )
  data_dir = args.data_dir if args.data_dir is not None else rgnn.default_data_dir()
  console = command.console(width=180)
  results, notes, cases = run(
    model,
    graphs,
    dims,
    heads=args.heads,
    formulations=formulations,
    data_dir=data_dir,
    quick=args.quick,
    mag_scale=args.mag_scale,
    repeats=repeats,
    precision=args.precision,
    mode=args.mode,
    console=console,
  )
  common.check_measured(results, notes)
  for c in cases:
    console.print(c.describe())
  title = (
    TITLES[model].replace("forward + backward", "inference (forward only)")
    if args.mode == "inference"
    else TITLES[model]
  )
  common.print_table(console, title, *table_rows(results, args.mode), left=("graph", "formulation"))
  header, rows, summary = ablation(results, args.mode)
  if rows:
    common.print_table(
      console,
      "what each pass buys (jaxdata against itself with no passes)",
      header,
      rows,
      summary,
      left=("graph", "passes"),
    )
  for n in notes:
    console.print(f"[yellow]{rich.markup.escape(n)}")
  if args.write:
    section = markdown(
      model,
      results,
      notes,
      cases,
      common.command_line(),
      heads=args.heads,
      precision=args.precision,
      mode=args.mode,
    )
    rgnn.write_markdown(console, args.write, model, section, args.mode, document)
  return 0
