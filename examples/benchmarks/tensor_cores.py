"""`jaxdata bench tensor-cores`: hector's tensor-core kernels against its CUDA-core kernels
and plain JAX, side by side in one run.

The targets, for RGCN and RGAT forward + backward on the 2M-edge synthetic graph at dims 64
and 128 (hector's generated kernels, `jaxdata.hector.rgcn_message` / `rgat_message`):

  bfloat16                  >= 3x today's float32 kernels, and >= 8x the best plain-JAX
                            formulation at default precision
  float32 at "default"      >= 2x today's float32 kernels (TF32 tensor cores on a GPU)
  float32 at "highest"      no slower than today, and float32-exact

"Today's float32 kernels" are jaxdata's at precision "highest" (CUDA-core FMA kernels whether or
not tensor cores are enabled: `jaxdata.hector.codegen.cuda.math`). For each model (`--models`)
and dim (`--dims`), one case: the graph of `jaxdata bench rgnn` (RGCN: `rgnn.SYNTHETIC`, 200K
nodes, 2M edges, 500 relations; RGAT: `rgnn_attention.SYNTHETIC`, 535 relations, `--heads`
heads), rows in this order:

  jaxdata float32 highest   the baseline (row 1)
  jaxdata float32 highest (original traversals)
                            row 1 generated with the constants of the generator as they were
                            when the tensor-core kernels were added (`ORIGINAL_CONSTANTS`):
                            the CUDA-core kernels the tensor-core ones were first measured
                            against, since later changes to the traversals that every
                            precision shares also made row 1 faster
  jaxdata float32 default   TF32 on a GPU's tensor cores
  jaxdata bfloat16          inputs and weights cast to bfloat16 on the device before the step
  <plain JAX> float32       each of `jaxdata.reference`'s plain-JAX formulations at default
  <plain JAX> bfloat16      precision, float32 and bfloat16 inputs; the fastest that runs, of
                            either dtype, is "best plain JAX" (named in the table)

One row is one forward + backward step (loss = sum(out * ct), gradients for x and every weight:
W, and RGAT's attention vectors), timed as `jaxdata bench rgnn` times it (`rgnn.measure_step`:
compiled ahead of time, the median of `--repeats` rounds of steps queued back to back,
`jaxdata.timing`), with inputs, weights and graph on the device before timing and passed to the
jitted step as arguments (numpy inputs or a captured graph add host-to-device copies to every
step). A row that does not fit is "OOM" (`rgnn.is_oom`), never a crash. Error: max |dx - dx_1| /
max |dx_1| against row 1's dx. Row 1's float32-exactness is checked against the fastest plain-JAX
float32 formulation rerun at "highest" (untimed). For RGAT that check leaves out the end nodes
(source and destination) of the edges at the leaky ReLU's kink: those whose float64 score before
the leaky ReLU has |z| <= `KINK` * max |z| for some head (`rgat_kink`). Float32 rounding can put
such a z on the other side of 0 in one of the two computations, and its two ends' dx then jump
by 0.8 * dz * (W_r a_r): a property of comparing two float32 computations of a function with a
kink, not an error of either (docs/benchmarks/tensor_cores.md, "The 1e-3 question"). The
verdict states how many edges and nodes were left out.

    $ jaxdata bench tensor-cores --quick
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Sequence

from benchmarks import common, rgnn
from benchmarks import rgnn_attention as attention
from benchmarks import rgnn_peers as peers
from jaxdata import command
from jaxdata.reference import attention as attention_ref
from jaxdata.reference import rgcn as rgcn_ref

MODELS = ("rgcn", "rgat")
DIMS = (64, 128)
QUICK_DIMS = (32,)
REPEATS = 7
QUICK_REPEATS = 3
HEADS = attention.HEADS
#: The plain-JAX formulations (the same names for RGCN and RGAT), in the table's order.
PLAIN_JAX = tuple(rgcn_ref.PLAIN_JAX)
assert PLAIN_JAX == tuple(attention_ref.RGAT)
#: The targets: bfloat16 vs row 1, bfloat16 vs best plain JAX, float32 "default" vs row 1.
BF16_VS_HIGHEST, BF16_VS_PLAIN, TF32_VS_HIGHEST = 3.0, 8.0, 2.0
#: Row 1's dx against plain JAX at "highest", both float32: at most this is "float32-exact"
#: (sums in another order give ~1e-6 relative; TF32 gives 2e-4 to 8e-3).
EXACT = 1e-5
#: An RGAT edge is at the leaky ReLU's kink where its float64 score has |z| <= KINK * max |z|
#: (over all edges and heads) for some head. Relative, because float32's rounding error in z
#: scales with the products summed, which scale with max |z|. Measured on the bench's 2M-edge
#: graph (seed 0, CPU): transform-all-then-gather's float32 z is off from z64 by at most
#: 3.1e-7 max |z| at dim 64 and 4.1e-7 at dim 128 (max |z| = 11.4, 11.3), so 1e-5 leaves a
#: margin of ~25x; it selects 356 edges / 660 end nodes at dim 64 and 379 / 698 at dim 128 (of
#: 200K nodes; an absolute 1e-5 would select 38 / 75 and 34 / 68). The edge that flipped in
#: edges at the kink have been seen with z64 = 5e-7.
KINK = 1e-5
#: Row 1 is "no slower than today" where its time is at most this much over the original
#: row's: repeated runs of one step move by 1-2% on the H200 (RGCN's two rows at dim 128 run the
#: same kernels, having no traversal the original constants change: 18.03 and 17.99 ms).
NO_SLOWER = 0.02


#: The constants of hector's CUDA generator (jaxdata.hector.codegen.cuda, then .common) and of its
#: passes (jaxdata.hector.passes) as they were when the tensor-core kernels were added, where they
#: have changed since.
#: FUSED_PRODUCT_EDGES_PER_PAIR = inf: RGCN's relation products stay fused into the per-edge GEMM on
#: every graph (today a graph with 4+ edges per (source, relation) pair runs them per pair).
#: TRAVERSAL_FEATURES = 4 (a thread of a per-edge traversal or grouped sum owns up to 4 features of
#: a row; 1 before) and DOT_ALIGN = 16 (dot products read rows in loads of up to 16 bytes; one
#: element at a time before) are in the traversals every precision runs, so row 1 got faster with
#: the rows it is the baseline of (RGAT, 2M edges: 9.31 -> 7.85 ms at dim 64, 24.22 -> 20.22 ms at
#: 128). VALID_MASK = 1: a kernel's ok(e) reads one precomputed byte per row instead of loading and
#: checking the row's src, dst, etype and pair itself. With these values the generator emits the
#: kernels of then again (the same sums in the same order), so the CUDA-core kernels the tensor-core
#: ones were first measured against run side by side with today's.
ORIGINAL_CONSTANTS = {
  "TRAVERSAL_FEATURES": 1,
  "DOT_ALIGN": 1,
  "VALID_MASK": 0,
  "GROUP_RUN": 32,
  "RELATION_FEATURES": 1,
  "GEMM_THIN_K": 0,
  "TRAVERSAL_MIN_BLOCKS": 0,
  "PLAIN_LOADS": 0,
  "OPERAND_ALIGN": 0,
  "SOFTMAX_HUB_CLUSTER": 1,
  "SOFTMAX_MIN_BLOCKS": 0,
  "FUSED_PRODUCT_EDGES_PER_PAIR": float("inf"),
}


@contextlib.contextmanager
def original_kernels():
  """Inside, hector generates its CUDA kernels with `ORIGINAL_CONSTANTS`. JAX's caches are
  cleared on the way in and out: a step's jaxpr does not show the constants, so a cached
  executable would otherwise run the other kernels."""
  import jax  # pylint: disable=g-import-not-at-top

  from jaxdata.hector import passes
  from jaxdata.hector.codegen import common as gen_common  # pylint: disable=g-import-not-at-top
  from jaxdata.hector.codegen import cuda

  where = {
    name: next(m for m in (cuda, gen_common, passes) if hasattr(m, name))
    for name in ORIGINAL_CONSTANTS
  }
  saved = {name: getattr(m, name) for name, m in where.items()}
  jax.clear_caches()
  try:
    for name, value in ORIGINAL_CONSTANTS.items():
      setattr(where[name], name, value)
    yield
  finally:
    for name, value in saved.items():
      setattr(where[name], name, value)
    jax.clear_caches()


@dataclasses.dataclass(frozen=True)
class Row:
  """What one row runs: a formulation ("jaxdata" or a plain-JAX name), a dtype, a precision,
  and for jaxdata whether its kernels are generated with `ORIGINAL_CONSTANTS`."""

  formulation: str
  dtype: str  # "float32" or "bfloat16"
  precision: str  # "highest" or "default"
  original: bool = False

  @property
  def name(self) -> str:
    if self.formulation == "jaxdata":
      return (
        "jaxdata "
        + (self.dtype if self.dtype == "bfloat16" else f"{self.dtype} {self.precision}")
        + (" (original traversals)" if self.original else "")
      )
    return f"{self.formulation} {self.dtype}"

  @property
  def plain(self) -> bool:
    return self.formulation != "jaxdata"


BASELINE = Row("jaxdata", "float32", "highest")
ORIGINAL = Row("jaxdata", "float32", "highest", original=True)
TF32 = Row("jaxdata", "float32", "default")
BF16 = Row("jaxdata", "bfloat16", "default")
DTYPES = ("float32", "bfloat16")
ROWS = (
  BASELINE,
  ORIGINAL,
  TF32,
  BF16,
  *(Row(f, d, "default") for f in PLAIN_JAX for d in DTYPES),
)


def rows(plain_dtypes: Sequence[str] = DTYPES) -> tuple[Row, ...]:
  """The rows run: jaxdata's three, and plain JAX's in these input dtypes only (its bfloat16
  formulations take 13-300x its float32 time on the H200, and minutes of a run)."""
  return tuple(r for r in ROWS if not r.plain or r.dtype in plain_dtypes)


@dataclasses.dataclass
class Measured:
  """One row of one case: its time (None unless it ran), status, and dx error against row 1."""

  model: str
  dim: int
  row: Row
  seconds: float | None = None
  status: str = "ok"  # "ok", "OOM", "OOM (est. X)", "skipped", "error"
  loss: float | None = None
  error: float | None = None  # max |dx - dx_1| / max |dx_1|
  dx: object = None  # float64 NumPy dx, only where run(keep_dx=True)

  @property
  def ok(self) -> bool:
    return self.status == "ok"


@dataclasses.dataclass(frozen=True)
class Kink:
  """RGAT's edges at the leaky ReLU's kink (`KINK`): their indices (in the graph's edge order),
  their end nodes (sources and destinations, unique), and the seconds finding them took."""

  edges: object  # int64 NumPy [k]
  nodes: object  # int64 NumPy, sorted
  seconds: float = 0.0


def kink_edges(scores, tol: float = KINK):
  """The edges e with |scores[e, h]| <= tol * max |scores| for some head h ([E, H] in, int64
  indices out, ascending). With every score 0, every edge is at the kink."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  z = np.abs(np.asarray(scores, np.float64))
  if z.ndim != 2:
    raise ValueError(f"kink_edges: scores must be [E, H], got shape {list(z.shape)}")
  if not z.size:
    return np.zeros(0, np.int64)
  return np.flatnonzero((z <= tol * z.max()).any(axis=1)).astype(np.int64)


def rgat_kink(src, dst, etype, x, params, tol: float = KINK) -> Kink:
  """RGAT's edges at the kink from the float64 scores of the bench's own arrays
  (`jaxdata.reference.attention.rgat_scores_float64`: NumPy, on the host, one relation at a
  time), and their end nodes."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  start = time.perf_counter()
  src, dst = np.asarray(src).reshape(-1), np.asarray(dst).reshape(-1)
  edges = kink_edges(attention_ref.rgat_scores_float64(src, dst, etype, x, params), tol)
  nodes = np.unique(np.concatenate([src[edges], dst[edges]])).astype(np.int64)
  return Kink(edges, nodes, time.perf_counter() - start)


def _count(n: int, what: str) -> str:
  return f"{n} {what}{'' if n == 1 else 's'}"


@dataclasses.dataclass(frozen=True)
class Exact:
  """Row 1's float32-exactness check: `error` = max |dx - dx_1| / max |dx_1| over the `compared`
  nodes, dx from `formulation` at "highest"; `kink`: RGAT's edges at the kink, whose end nodes
  were not compared (None: a model without a kink, RGCN)."""

  error: float
  formulation: str
  compared: int
  kink: Kink | None = None

  @property
  def met(self) -> bool:
    return self.compared > 0 and self.error <= EXACT

  def verdict(self) -> str:
    """ "float32-exact: met (...)" or "not met (...)", saying what was left out."""
    k = self.kink
    if self.compared == 0:
      return (
        f"float32-exact: not checked (every node is an end of one of the "
        f"{_count(k.edges.size, 'edge')} at the leaky ReLU's kink)"
      )
    text = (
      f"float32-exact: {'met' if self.met else 'not met'} (dx vs {self.formulation} at "
      f"highest: {self.error:.1e}"
    )
    if k is not None:
      text += (
        f", leaving out the {_count(k.nodes.size, 'end node')} of "
        f"{_count(k.edges.size, 'edge')} at the leaky ReLU's kink"
        if k.edges.size
        else ", no edge at the leaky ReLU's kink"
      )
    return text + ")"


def check_exact(dx, ref, formulation: str, kink: Kink | None = None) -> Exact:
  """Compares dx (the plain-JAX formulation at "highest") with row 1's `ref` ([N, d] each, on
  the device or NumPy) on every node that is not an end of an edge in `kink`."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  n = ref.shape[0]
  keep = None
  if kink is not None and kink.nodes.size:
    keep = np.ones(n, bool)
    keep[kink.nodes] = False
  compared = n if keep is None else int(keep.sum())
  return Exact(_relative_error(dx, ref, keep) if compared else 0.0, formulation, compared, kink)


@dataclasses.dataclass
class Case:
  """One (model, graph, dim): its rows, and row 1's float32-exactness check (`exact`, or None
  with `exact_note` saying why)."""

  model: str
  dim: int
  rows: list[Measured]
  exact: Exact | None = None
  exact_note: str = ""
  graph: str = "synthetic"

  @property
  def label(self) -> str:
    """The model, and the graph where it is not the synthetic one: "RGCN on zipf-src-1.8"."""
    return self.model.upper() + ("" if self.graph == "synthetic" else f" on {self.graph}")

  def row(self, row: Row) -> Measured:
    return next(m for m in self.rows if m.row == row)

  def best_plain(self) -> Measured | None:
    """The fastest plain-JAX row that ran (either dtype), or None."""
    ran = [m for m in self.rows if m.row.plain and m.ok]
    return min(ran, key=lambda m: m.seconds) if ran else None


# ------------------------------------------------------------------------------------------------
# The device, and tensor cores on or off


def device():
  """The device this bench runs on: JAX's default device where one is set
  (`jax.default_device`, `JAX_DEFAULT_DEVICE`), else the first device."""
  import jax  # pylint: disable=g-import-not-at-top

  chosen = jax.config.jax_default_device
  if isinstance(chosen, str):  # a platform name
    return jax.devices(chosen)[0]
  return chosen if chosen is not None else jax.devices()[0]


def tensor_cores() -> str:
  """Whether hector's tensor-core kernels are on here, as the table states it (this command never
  sets the switch: it reports what the environment chose)."""
  from jaxdata.hector.codegen import cuda  # pylint: disable=g-import-not-at-top

  env = cuda.TENSOR_CORES_ENV
  setting = f"{env}={os.environ[env]!r}" if env in os.environ else f"{env} unset"
  text = f"{'on' if cuda.tensor_cores_enabled() else 'off'} ({setting})"
  from jaxdata.hector import tuning  # pylint: disable=g-import-not-at-top

  tune = tuning.AUTOTUNE_ENV
  tune_setting = f"{tune}={os.environ[tune]!r}" if tune in os.environ else f"{tune} unset"
  text += (
    f"; tilings {'tuned on the first step' if tuning.enabled() else 'default'} ({tune_setting})"
  )
  if device().platform != "gpu":
    text += (
      "; this run is not on a GPU: hector's CPU kernels compute every row in float32 "
      "(bfloat16 operands widened), so no row uses tensor cores"
    )
  return text


# ------------------------------------------------------------------------------------------------
# Measuring


def _cast(tree, dtype):
  import jax  # pylint: disable=g-import-not-at-top

  return jax.tree.map(lambda a: a.astype(dtype), tree)


def _relative_error(dx, ref, keep=None) -> float:
  """max |dx - ref| / max |ref|, in float32 on the device; over the rows where `keep` (a bool
  [N] mask) is True only, where given."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  ref = jnp.asarray(ref).astype(jnp.float32)
  diff = jnp.asarray(dx).astype(jnp.float32) - ref
  if keep is not None:
    keep = jnp.asarray(keep).reshape((-1,) + (1,) * (ref.ndim - 1))
    ref, diff = jnp.where(keep, ref, 0), jnp.where(keep, diff, 0)
  top = jnp.max(jnp.abs(ref))
  return float(jnp.max(jnp.abs(diff)) / jnp.maximum(top, 1e-30))


class _Inputs:
  """One case's graph arguments and inputs on the device, and how to build each row."""

  def __init__(self, model: str, graph, dim: int, heads: int):
    import jax  # pylint: disable=g-import-not-at-top

    here = device()
    self.model, self.dim = model, dim
    if model == "rgcn":
      g = graph
      x, w, ct = rgnn.case_arrays(g, dim)
      self.edges = rgcn_ref.EdgeArrays.build(
        g.src,
        g.dst,
        g.etype,
        num_nodes=g.num_nodes,
        num_relations=g.num_relations,
        norm=g.norm,
        device=here,
      )
      self.arrays = attention.graph_arrays(attention.Case(g))
    else:
      g = graph.graph
      x, w, ct = attention.case_arrays("rgat", graph, dim, heads)
      self.graph = g  # for the kink (`kink`)
      self.edges = attention_ref.Edges.build(
        g.src, g.dst, g.etype, num_nodes=g.num_nodes, num_relations=g.num_relations, device=here
      )
      self.arrays = attention.graph_arrays(graph)
    self.num_nodes, self.num_edges = g.num_nodes, g.num_edges
    self.x, self.w, self.ct = jax.device_put((x, w, ct), here)

  def build(self, row: Row, precision: str | None = None) -> peers.Formulation:
    """The row's formulation (at `precision` instead of the row's where given)."""
    prec = rgnn._precision(precision or row.precision)  # pylint: disable=protected-access
    if row.plain:
      if self.model == "rgcn":
        return peers.plain_jax(row.formulation, self.edges, self.num_nodes, precision=prec)
      return attention.plain_formulation("rgat", row.formulation, self.edges, precision=prec)
    if isinstance(self.arrays, Exception):
      raise self.arrays
    if self.model == "rgcn":
      return peers.jaxdata_formulation(self.arrays, precision=prec)
    return attention.rgat_jaxdata_formulation(self.arrays, None, precision=prec)

  def kink(self) -> Kink | None:
    """RGAT's edges at the leaky ReLU's kink, from the case's own x and weights; None for RGCN."""
    if self.model == "rgcn":
      return None
    import jax  # pylint: disable=g-import-not-at-top

    x, w = jax.device_get((self.x, self.w))
    return rgat_kink(self.graph.src, self.graph.dst, self.graph.etype, x, w)

  def inputs(self, dtype: str):
    """(x, weights) in `dtype`, on the device (cast there, before any timing)."""
    import jax  # pylint: disable=g-import-not-at-top

    if dtype == "float32":
      return self.x, self.w
    return jax.block_until_ready(_cast((self.x, self.w), dtype))

  def fallback(self, row: Row):
    """Bytes of RGCN's per-edge weights where the backend has no memory analysis (the CPU)."""
    if self.model == "rgcn" and row.formulation == "per-edge weights":
      size = 2 if row.dtype == "bfloat16" else 4
      return lambda: rgcn_ref.per_edge_weight_bytes(self.num_edges, self.dim, self.dim, size)
    return None


def _print_row(m: Measured) -> None:
  what = f"{_ms(m)} ms" if m.ok else m.status
  err = "" if m.error is None else f", dx error {m.error:.2e}"
  print(f"  {m.model} dim {m.dim}: {m.row.name}: {what}{err}", flush=True)


def measure_case(
  model: str,
  graph,
  dim: int,
  *,
  heads: int = HEADS,
  repeats: int = REPEATS,
  notes: list[str],
  keep_dx: bool = False,
  plain_dtypes: Sequence[str] = DTYPES,
) -> Case:
  """Every row of one (model, dim) on `graph` (RGCN: an `rgnn.Graph`; RGAT: an
  `rgnn_attention.Case`); then row 1's float32-exactness check. Prints a line per row."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  data = _Inputs(model, graph, dim, heads)
  name = graph.name if model == "rgcn" else graph.graph.name
  case = Case(model, dim, [], graph=name)
  ref = None  # row 1's dx, on the device
  for row in rows(plain_dtypes):
    m = Measured(model, dim, row)
    case.rows.append(m)
    x, w = data.inputs(row.dtype)
    r = rgnn.Result(model, dim, row.name)
    with original_kernels() if row.original else contextlib.nullcontext():
      compiled = rgnn.measure_step(
        r,
        lambda row=row: data.build(row),
        x,
        w,
        data.ct,
        repeats=repeats,
        notes=notes,
        fallback_need=data.fallback(row),
      )
    m.seconds, m.status, m.loss = r.seconds, r.status, r.loss
    if compiled is not None:
      _, (dx, _) = compiled.run()
      if row == BASELINE:
        ref = dx
      if ref is not None:
        m.error = _relative_error(dx, ref)
      if keep_dx:
        m.dx = np.asarray(dx.astype(np.float32), np.float64)
      del dx
    del compiled, x, w
    _print_row(m)
  ran = [m for m in case.rows if m.ok and m.row.plain and m.row.dtype == "float32"]
  best = min(ran, key=lambda m: m.seconds) if ran else None
  if ref is None:
    case.exact_note = "row 1 did not run"
  elif best is None:
    case.exact_note = "no plain-JAX float32 row ran"
  else:
    where = f"{model}, dim {dim}, {best.row.formulation} float32 highest (exactness check)"
    dx = None
    try:
      step = peers.compile_step(data.build(best.row, "highest"), data.x, data.w, data.ct)
      _, (dx, _) = step.run()
      del step
    except Exception as e:  # pylint: disable=broad-except
      why = "out of memory" if rgnn.is_oom(e) else "failed"
      case.exact_note = f"{best.row.formulation} at highest {why}"
      rgnn._note(notes, f"{where}: {why} ({rgnn._short(e)})")  # pylint: disable=protected-access
    if dx is not None:
      try:
        kink = data.kink()
      except Exception as e:  # pylint: disable=broad-except
        case.exact_note = "finding the edges at the leaky ReLU's kink failed"
        rgnn._note(
          notes,
          f"{model}, dim {dim}, edges at the leaky ReLU's kink (float64 scores): "
          f"failed ({rgnn._short(e)})",
        )  # pylint: disable=protected-access
      else:
        case.exact = check_exact(dx, ref, best.row.formulation, kink)
      del dx
  if case.exact is not None:
    k = case.exact.kink
    kink = (
      ""
      if k is None
      else (
        f" (left out: the {_count(k.nodes.size, 'end node')} of "
        f"{_count(k.edges.size, 'edge')} at the leaky ReLU's kink, "
        f"found in {k.seconds:.2f} s)"
      )
    )
    print(
      f"  {model} dim {dim}: row 1's dx vs {case.exact.formulation} float32 highest: "
      f"{case.exact.error:.2e}{kink}",
      flush=True,
    )
  return case


def unknown_graphs(names: Sequence[str]) -> list[str]:
  """The names that are neither `rgnn.GRAPHS` (the synthetic graph, the RDF archives AIFB and
  MUTAG) nor of the hub-heavy family (`rgnn.SKEWED`)."""
  return [g for g in names if g not in rgnn.GRAPHS and not rgnn.SKEWED.fullmatch(g)]


def load(model: str, name: str = "synthetic", *, quick: bool, seed: int = 0):
  """The case's graph `name` (the synthetic one, of the hub-heavy family `rgnn.SKEWED`, or an
  RDF archive from `rgnn.default_data_dir()`): RGCN's `rgnn.Graph`, RGAT's
  `rgnn_attention.Case` (the synthetic sizes of each)."""
  data_dir = rgnn.default_data_dir()  # read for the archives only
  if model == "rgcn":
    graph, why = rgnn.load_graph(name, data_dir=data_dir, quick=quick, seed=seed)
  else:
    graph, why = attention.load_case("rgat", name, data_dir=data_dir, quick=quick, seed=seed)
  if graph is None:
    raise RuntimeError(f"jaxdata bench tensor-cores: the {model} graph: {why}")
  return graph


def describe(model: str, graph) -> str:
  return f"{model}: {graph.describe()}"


def run(
  models: Sequence[str] = MODELS,
  dims: Sequence[int] = DIMS,
  *,
  heads: int = HEADS,
  graphs: Sequence[str] = ("synthetic",),
  quick: bool = False,
  repeats: int = REPEATS,
  keep_dx: bool = False,
  plain_dtypes: Sequence[str] = DTYPES,
  on_case: Callable[[list[Case], list[str], list[str]], None] | None = None,
) -> tuple[list[Case], list[str], list[str]]:
  """Every case, in order; returns (cases, notes on what failed, the graphs described).

  `keep_dx`: keep every row's dx as float64 NumPy in `Measured.dx` (for tests; on the full graph
  that is 1 MB per thousand nodes and dim 128 per row). `on_case(cases, notes, graphs)`: called
  after each case with what has been measured so far (the CLI rewrites its table).
  """
  import jax  # pylint: disable=g-import-not-at-top

  for m in models:
    if m not in MODELS:
      raise ValueError(f"models must be from {MODELS}, got {m!r}")
  for d in dims:
    if d <= 0:
      raise ValueError(f"dims must be positive, got {d}")
    if "rgat" in models:
      attention.head_features(d, heads)
  graph_names = list(dict.fromkeys(graphs))
  unknown = unknown_graphs(graph_names)
  if unknown:
    raise ValueError(
      f"graphs must be synthetic, aifb, mutag, uniform or zipf-src|dst|both-E, got {unknown}"
    )
  cases, notes, described = [], [], []
  for model, name in ((m, g) for m in models for g in graph_names):
    graph = load(model, name, quick=quick)
    described.append(describe(model, graph))
    print(described[-1], flush=True)
    for dim in dims:
      cases.append(
        measure_case(
          model,
          graph,
          dim,
          heads=heads,
          repeats=repeats,
          notes=notes,
          keep_dx=keep_dx,
          plain_dtypes=plain_dtypes,
        )
      )
      if on_case is not None:
        on_case(cases, notes, described)
    del graph
    jax.clear_caches()
  return cases, notes, described


# ------------------------------------------------------------------------------------------------
# The table


def _ms(m: Measured) -> str:
  return f"{m.seconds * 1e3:.3f}" if m.ok else m.status


def _ratio(x: float) -> str:
  return f"{x:.2f}x"


def _bar(what: str, value: float, need: float) -> str:
  return f"{what} >= {need:g}x: {'met' if value >= need else 'not met'}"


def bars(case: Case, m: Measured) -> str:
  """The targets that apply to row `m`, each met or not met; blank for plain-JAX rows."""
  base, best = case.row(BASELINE), case.best_plain()
  first = next((x for x in case.rows if x.row == ORIGINAL and x.ok), None)
  if m.row == ORIGINAL:
    return ""
  if m.row == BASELINE:
    if not m.ok:
      return ""
    if case.exact is None:
      exact = f"float32-exact: not checked ({case.exact_note})"
    else:
      exact = case.exact.verdict()
    if first is None:
      return f"{exact}; no slower than today: this row is today's kernel"
    ratio = first.seconds / m.seconds
    return (
      f"{exact}; no slower than today: {'met' if ratio * (1 + NO_SLOWER) >= 1 else 'not met'}"
      f" ({_ratio(ratio)} the original traversals)"
    )
  if m.row.plain or not m.ok:
    return ""
  out = []
  need = BF16_VS_HIGHEST if m.row == BF16 else TF32_VS_HIGHEST
  if base.ok:
    out.append(_bar("vs f32 highest", base.seconds / m.seconds, need))
  if first is not None:
    ratio = first.seconds / m.seconds
    out.append(_bar(f"vs original f32 highest ({_ratio(ratio)})", ratio, need))
  if m.row == BF16 and best is not None:
    out.append(_bar("vs best plain JAX", best.seconds / m.seconds, BF16_VS_PLAIN))
  return "; ".join(out)


HEADER = [
  "model",
  "dim",
  "row",
  "fwd+bwd ms",
  "vs f32 highest",
  "vs best plain JAX (default)",
  "dx error vs f32 highest",
  "targets",
]


def table_rows(cases: Sequence[Case]) -> tuple[list[str], list[list[str]]]:
  """(header, rows): every row of every case, the ratios computed from the same measurements."""
  rows = []
  for case in cases:
    base, best = case.row(BASELINE), case.best_plain()
    for m in case.rows:
      vs_base = vs_plain = ""
      if m.ok and not m.row.plain and base.ok:
        vs_base = _ratio(base.seconds / m.seconds)
      if m.ok and m.row in (TF32, BF16):
        if best is not None:
          vs_plain = f"{_ratio(best.seconds / m.seconds)} ({best.row.name})"
        elif any(x.row.plain for x in case.rows):
          plain = [x for x in case.rows if x.row.plain]
          vs_plain = "all OOM" if all(x.status.startswith("OOM") for x in plain) else "none ran"
      error = "" if m.error is None else f"{m.error:.1e}"
      rows.append(
        [
          case.label,
          str(case.dim),
          m.row.name,
          _ms(m),
          vs_base,
          vs_plain,
          error,
          bars(case, m),
        ]
      )
  return HEADER, rows


def markdown(
  cases: Sequence[Case],
  notes: Sequence[str],
  graphs: Sequence[str],
  command_line: str,
  *,
  heads: int,
  repeats: int,
  tensor_cores_text: str,
  planned: int | None = None,
) -> str:
  """The table as a document: what was measured, the command, the machine, the table
  (`planned`: the number of cases the run will measure, where it has measured fewer so far)."""
  hw, here = common.hardware(), device()
  text = [
    "# Hector on tensor cores",
    "",
    "Measured by `jaxdata bench tensor-cores` (examples/benchmarks/tensor_cores.py): "
    "milliseconds of "
    "one RGCN or RGAT layer's relational part, forward + backward (loss = sum(out * ct), "
    f"gradients for x and every weight: W and RGAT's attention vectors; RGAT with {heads} "
    "heads), the whole graph, per step: the median of "
    f"{repeats} round{'s' if repeats != 1 else ''} of steps queued back to back "
    "(`jaxdata.timing`), inputs, weights and "
    "graph on the device before timing and passed to the jitted step as arguments. Rows: "
    "*jaxdata float32 highest* (`jaxdata.hector.rgcn_message` / `rgat_message` at precision "
    '"highest": the CUDA-core kernels, today\'s float32 kernels and the baseline), *jaxdata '
    "float32 highest (original traversals)* (the same, generated with the constants of the "
    "code generator as they were when the tensor-core kernels were added: "
    f"{', '.join(f'{k} = {v}' for k, v in ORIGINAL_CONSTANTS.items())}; later changes to "
    "the traversals that every precision runs made row 1 faster as well, so this row is the "
    "CUDA-core kernels the tensor-core ones were first measured against, and the TF32 and "
    "bfloat16 rows' targets are given "
    "against it too, ratio in brackets), *jaxdata "
    "float32 default* (TF32 tensor cores on a GPU), *jaxdata bfloat16* (inputs and weights "
    "cast to bfloat16 on the device before the step), then the plain-JAX formulations of "
    "jaxdata/reference/ at XLA's default precision with float32 and with bfloat16 inputs. "
    "*vs f32 highest*: row 1's time over the row's. *vs best plain JAX (default)*: the "
    "fastest plain-JAX row that ran (either dtype, named in brackets) over the row's. *dx "
    "error*: max |dx - dx_1| / max |dx_1| against row 1's dx. Targets: bfloat16 >= "
    f"{BF16_VS_HIGHEST:g}x row 1 and >= {BF16_VS_PLAIN:g}x the best plain JAX at default "
    f"precision; float32 at default >= {TF32_VS_HIGHEST:g}x row 1; at highest no slower than "
    'today and float32-exact. Row 1 is today\'s kernel (hector runs float32 at "highest" on '
    "CUDA cores whether or not tensor cores are on); *no slower than today* compares it with "
    f"the original row (met within {NO_SLOWER:.0%}: run-to-run timing noise); "
    "*float32-exact* compares row 1's "
    'dx with the fastest plain-JAX float32 formulation rerun at "highest" (untimed): met '
    f"where the error is at most {EXACT:g} (float32 sums in another order; TF32 gives 2e-4 "
    "and more); for RGAT that error leaves out the end nodes of every edge whose float64 "
    f"score before the leaky ReLU has |z| <= {KINK:g} * max |z| for some head (at the kink, "
    "float32 rounding can give the edge the other slope in one of the two computations and "
    "move its ends' dx by 0.8 dz W_r a_r), and the verdict says how many. *OOM*: the row "
    "failed for memory; *OOM (est.)*: not run, XLA's analysis of the compiled step says it "
    "cannot fit.",
    "",
    f"Command: `{command_line}`",
    "",
    f"- device: {here.device_kind} ({here.platform})",
    f"- tensor cores: {tensor_cores_text}",
    *[f"- {k}: {v}" for k, v in hw.items() if k != "device"],
    "",
    "Graphs:",
    "",
    *[f"- {g}" for g in graphs],
    "",
    common.markdown_table(*table_rows(cases)),
    "",
  ]
  if planned is not None and len(cases) < planned:
    text += [
      f"**Incomplete**: {len(cases)} of {planned} cases measured so far (the run was "
      "cut short, or is still running).",
      "",
    ]
  if notes:
    text += ["Skipped or unexpected:", "", *(f"- {n}" for n in notes), ""]
  return "\n".join(text)


# ----------------------------------------------------------------------------- the CLI
def add_arguments(parser) -> None:
  """`jaxdata bench tensor-cores` options."""
  parser.add_argument(
    "--models",
    type=command.listing(command.choice(MODELS)),
    default=list(MODELS),
    help="layers, comma-separated",
  )
  parser.add_argument(
    "--dims",
    type=command.listing(command.positive_int),
    help="hidden sizes, comma-separated (default 64,128; --quick 32)",
  )
  parser.add_argument(
    "--graphs",
    type=command.listing(str),
    default=["synthetic"],
    help="graphs, comma-separated: synthetic (2M edges, heavy-tailed both ways), uniform, and "
    "the hub-heavy zipf-src-E, zipf-dst-E, zipf-both-E (out-degrees, in-degrees or both follow "
    "a Zipf law of exponent E > 1, the other end uniform; all of the synthetic graph's sizes), "
    "and the RDF graphs aifb, mutag ($JAXDATA_DATA_DIR or ../shared/data)",
  )
  parser.add_argument(
    "--heads",
    type=command.positive_int,
    default=HEADS,
    help="RGAT's attention heads, each of dim/heads features",
  )
  parser.add_argument(
    "--repeats",
    type=command.positive_int,
    help=f"timed rounds per row, median (default {REPEATS}; --quick {QUICK_REPEATS})",
  )
  parser.add_argument(
    "--plain-dtypes",
    type=command.listing(command.choice(DTYPES)),
    default=list(DTYPES),
    help="input dtypes of the plain-JAX rows, comma-separated (its bfloat16 "
    "rows are by far its slowest)",
  )
  parser.add_argument(
    "--quick",
    action="store_true",
    help="the small synthetic graph of `jaxdata bench rgnn --quick`, dim 32, "
    f"{QUICK_REPEATS} repeats (flags given still apply)",
  )
  parser.add_argument(
    "--write",
    metavar="PATH.md",
    type=command.output_path,
    help="write the table here, with the command, machine and date",
  )


def main(args) -> int:
  """`jaxdata bench tensor-cores`."""
  # As `jaxdata bench rgnn`: allocate as needed, so an OOM row leaves the next rows room.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
  dims = common.pick(args.dims, args.quick, list(QUICK_DIMS), list(DIMS))
  repeats = common.pick(args.repeats, args.quick, QUICK_REPEATS, REPEATS)
  if "rgat" in args.models:
    for d in dims:
      if d % args.heads:
        raise command.UsageError(
          f"argument --dims: {d} is not a multiple of --heads {args.heads} (RGAT)"
        )
  import jax  # pylint: disable=g-import-not-at-top

  state = tensor_cores()
  print(
    f"jaxdata bench tensor-cores on {device().device_kind}; jax {jax.__version__}; "
    f"tensor cores: {state}",
    flush=True,
  )
  models = list(dict.fromkeys(args.models))
  graph_names = list(dict.fromkeys(args.graphs))
  unknown = unknown_graphs(graph_names)
  if unknown:
    raise command.UsageError(
      f"argument --graphs: unknown graph(s) {', '.join(unknown)}; choose from synthetic, aifb, "
      "mutag, uniform, zipf-src-E, zipf-dst-E, zipf-both-E"
    )
  console = command.console(width=200)

  def write(cases, notes, graphs, quiet=False):
    text = markdown(
      cases,
      notes,
      graphs,
      common.command_line(),
      heads=args.heads,
      repeats=repeats,
      tensor_cores_text=state,
      planned=len(models) * len(graph_names) * len(dims),
    )
    if quiet:  # after each case: the table so far, in case the run is cut short
      with open(args.write, "w") as f:
        f.write(text)
    else:
      common.write(console, args.write, text)

  cases, notes, graphs = run(
    models,
    dims,
    graphs=graph_names,
    heads=args.heads,
    quick=args.quick,
    repeats=repeats,
    plain_dtypes=args.plain_dtypes,
    on_case=(lambda *so_far: write(*so_far, quiet=True)) if args.write else None,
  )
  common.print_table(
    console,
    "hector on tensor cores, forward + backward",
    *table_rows(cases),
    notes,
    left=("model", "row", "targets"),
  )
  common.check_measured([m for c in cases for m in c.rows if m.ok], notes)
  if args.write:
    write(cases, notes, graphs)
  return 0
