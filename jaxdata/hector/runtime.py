"""Running generated kernels from JAX: the graph's device arrays and the kernel primitive.

`kernel_p` is a JAX primitive with one lowering per platform: lowering for "cpu" generates the
instance's C++, for "cuda" its CUDA; either is compiled (or found in the disk cache), loaded into
the native registry under an id taken from the source hash, and called through the FFI target
``jaxdata_hector_launch``. Kernels are therefore built lazily, only for the platforms a program is
actually lowered for, and an executable restored from JAX's persistent cache still finds its
kernels: lowering (which loads them) runs before the cache lookup.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
import weakref

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from jaxdata import _ffi  # noqa: F401  (registers jaxdata_hector_launch)
from jaxdata import _xla_ffi as ext  # pyright: ignore[reportAttributeAccessIssue]  (compiled, no stub)
from jaxdata.data import graph_build
from jaxdata.hector import codegen, compiler, operands, tuning
from jaxdata.hector.codegen.common import reads_valid
from jaxdata.hector.lowering import Dense, Template

#: GraphArrays' array fields and each one's length, from the graph's sizes (E edges, N nodes,
#: R relations, P pairs); which of them a kernel reads, and in what order, is `operands.GRAPH`
_FIELDS = {
  "src": "E",
  "dst": "E",
  "etype": "E",
  "norm": "E",
  "rel_offsets": "R+1",
  "csr_offsets": "N+1",
  "csr_edges": "E",
  "csc_offsets": "N+1",
  "csc_edges": "E",
  "pair": "E",
  "pair_offsets": "P+1",
  "pair_edges": "E",
  "pair_src": "P",
  "pair_etype": "P",
  "pair_rel_offsets": "R+1",
  "pair_csr_offsets": "N+1",
  "pair_csr_edges": "P",
}
_INDEX_FIELDS = [f for f in _FIELDS if f != "norm"]


@functools.partial(
  jax.tree_util.register_dataclass,
  data_fields=list(_FIELDS),
  meta_fields=["num_nodes", "num_relations", "node_type_offsets", "node_type_names"],
)
@dataclasses.dataclass(frozen=True)
class GraphArrays:
  """A relational graph as the generated kernels read it: device arrays plus static sizes.

  Edges are sorted by relation (`rel_offsets[r]:rel_offsets[r+1]` are relation r's); the CSR
  (by source) and CSC (by destination) views list edge ids per node. `norm` is the per-edge
  normalizer (the RGCN paper's 1/c_{i,r} by default). A pytree: pass it to jitted functions.

  The unique (source node, relation) pairs, for compact materialization, are computed on the
  host: pair u is ``(pair_src[u], pair_etype[u])``, sorted by relation then source
  (`pair_rel_offsets`), with a CSR view by source (`pair_csr_offsets`, `pair_csr_edges`: pair
  ids per node); edge e belongs to pair ``pair[e]`` and the edges of pair u are
  ``pair_edges[pair_offsets[u]:pair_offsets[u + 1]]``.

  *Unused* edges and pairs (a sampled block's padding, `jaxdata.hector.block`) come last: the
  edges past ``rel_offsets[R]`` and the pairs past ``pair_rel_offsets[R]`` have relation
  ``num_relations`` (none), the CSR and CSC views list the unused edges after their last group
  (their offsets end at ``rel_offsets[R]``), and the unused edges belong to unused pairs. No
  kernel visits them: they contribute nothing, and a row a kernel stores for one is 0.

  `node_type_offsets` (static, a tuple, or None for one node type): node type t owns the ids
  ``node_type_offsets[t]:node_type_offsets[t + 1]``; layers that take features per node type
  check their rows against it. `node_type_names` (static, or None) names the types: layers then
  also take features as ``{node type: array}`` and return a dict.

  Validated on construction (so also by `dataclasses.replace` and pytree unflattening): the
  index arrays must be int32 and `norm` float32, each of its length (always checked, also on
  tracers); when the arrays are concrete, every id must be in range (``src``/``dst`` in
  ``[0, num_nodes)``, ``etype`` in ``[0, num_relations)``, ...), every offsets array must rise
  from 0 to its total, and the views must agree with the edges. A ValueError names the field.
  A concrete set of arrays is checked once (repeated unflattening of the same arrays is free).

  Out-of-range ids that reach a kernel without this check (arrays computed under `jax.jit`, or
  fields set behind the dataclass's back) are safe: **an edge whose ``src`` or ``dst`` is
  outside ``[0, num_nodes)``, whose ``etype`` is outside ``[0, num_relations)`` or whose
  ``pair`` is outside ``[0, num_pairs)`` contributes nothing** (no message, no attention
  weight, no gradient; its edge-wise values are 0), and offsets are clamped to their arrays.
  Views that disagree with the edges give unspecified values but never read or write out of
  bounds.
  """

  src: jax.Array
  dst: jax.Array
  etype: jax.Array
  norm: jax.Array
  rel_offsets: jax.Array
  csr_offsets: jax.Array
  csr_edges: jax.Array
  csc_offsets: jax.Array
  csc_edges: jax.Array
  pair: jax.Array
  pair_offsets: jax.Array
  pair_edges: jax.Array
  pair_src: jax.Array
  pair_etype: jax.Array
  pair_rel_offsets: jax.Array
  pair_csr_offsets: jax.Array
  pair_csr_edges: jax.Array
  num_nodes: int
  num_relations: int
  node_type_offsets: tuple[int, ...] | None = None
  node_type_names: tuple[str, ...] | None = None

  def __post_init__(self):
    _check_sizes(self)
    if self._arrays_are_values():
      self.check_structure()
      _check_values_once(self)

  @classmethod
  def from_graph(cls, graph, *, norm: str | np.ndarray = "mean", device=None) -> GraphArrays:
    """From a `jaxdata.data.HeteroGraph` (`norm`: "mean", "none", or a float array per edge).

    The views come from the graph's native builders (`jaxdata.data.graph_build`, held equal to
    the NumPy formulations of `jaxdata.reference.graph` by the tests) and the graph has checked
    its edges, so their values are not checked again: that NumPy check would cost more than
    building them (1.7 s of 2.4 s for 8M edges on 2 cores). Dtypes and shapes still are.
    """
    if graph.num_edges >= 2**31 or graph.num_nodes >= 2**31:
      raise ValueError("hector: graphs with 2**31 or more edges or nodes are not supported")
    n = graph.edge_norm(norm) if isinstance(norm, str) else np.asarray(norm, np.float32)
    if n.shape != (graph.num_edges,):
      raise ValueError(f"norm must have one value per edge ({graph.num_edges}), got {n.shape}")
    csr_off, csr_e = graph.csr()
    csc_off, csc_e = graph.csc()
    pairs = unique_pairs(graph.src, graph.etype, graph.num_nodes, graph.num_relations)
    i32 = lambda a: jax.device_put(np.asarray(a, np.int32), device)  # noqa: E731
    types = graph.node_type_offsets
    arrays = (
      i32(graph.src),
      i32(graph.dst),
      i32(graph.etype),
      jax.device_put(n.astype(np.float32), device),
      i32(graph.relation_offsets),
      i32(csr_off),
      i32(csr_e),
      i32(csc_off),
      i32(csc_e),
      *map(i32, pairs),
    )
    # Known good: enter them in the cache of checked arrays, as a checked set would be.
    try:
      refs = tuple(weakref.ref(a) for a in arrays)
    except TypeError:
      refs = None
    if refs is not None:
      if len(_CHECKED) >= _CHECKED_MAX:
        _CHECKED.pop(next(iter(_CHECKED)))
      key = (int(graph.num_nodes), int(graph.num_relations)) + tuple(id(a) for a in arrays)
      _CHECKED[key] = refs
    return cls(
      *arrays,
      num_nodes=int(graph.num_nodes),
      num_relations=int(graph.num_relations),
      node_type_offsets=None if types is None else tuple(int(t) for t in types),
      node_type_names=None if types is None else tuple(graph.node_type_names),
    )

  @property
  def num_edges(self) -> int:
    return self.src.shape[0]

  @property
  def num_pairs(self) -> int:
    """The number of unique (source node, relation) pairs: the rows of a compact value."""
    return self.pair_src.shape[0]

  def node_type_rows(self) -> tuple[int, ...] | None:
    """The number of nodes of each type (None when the graph does not say)."""
    t = self.node_type_offsets
    return None if t is None else tuple(b - a for a, b in zip(t[:-1], t[1:]))

  def check_node_type_rows(self, rows, who: str) -> None:
    """ValueError (from `who`) unless `rows[t]`, the feature rows given for node type t, is the
    graph's number of nodes of type t (checked only when the graph has node-type offsets)."""
    want = self.node_type_rows()
    rows = tuple(int(r) for r in rows)
    if want is not None and rows != want:
      raise ValueError(
        f"{who}: feature rows per node type {list(rows)} do not match the "
        f"graph's node types {list(want)} (node_type_offsets="
        f"{list(self.node_type_offsets or ())})"
      )

  def check_structure(self) -> None:
    """ValueError unless every array has its dtype and length (works on tracers: shapes and
    dtypes only). Run before every kernel, since fields can be replaced behind the dataclass's
    back; the kernels rely on it to bound their loops."""
    sizes = {
      "E": _common_length(self, "E"),
      "N": self.num_nodes,
      "R": self.num_relations,
      "P": _common_length(self, "P"),
    }
    for f in _FIELDS:
      a = getattr(self, f)
      want_dtype = np.float32 if f == "norm" else np.int32
      dtype = getattr(a, "dtype", None)
      if dtype is None or np.dtype(dtype) != want_dtype:
        raise ValueError(
          f"hector.GraphArrays: {f} must be a {np.dtype(want_dtype)} array, got "
          f"{type(a).__name__} of dtype {dtype}"
        )
      spec = _FIELDS[f]
      n = sizes[spec[0]] + (1 if spec.endswith("+1") else 0)
      if tuple(np.shape(a)) != (n,):
        raise ValueError(
          f"hector.GraphArrays: {f} must have shape ({spec} = {n},), got {tuple(np.shape(a))}"
        )

  def _arrays_are_values(self) -> bool:
    """Whether the fields hold arrays of this graph (not a pytree of cotangents, specs or
    placeholders that JAX builds by unflattening, e.g. float0 zeros or None). Python
    sequences count as values, so that they are rejected rather than let through."""
    fields = [getattr(self, f) for f in _FIELDS]
    if any(isinstance(a, (list, tuple)) for a in fields):
      return True
    for a in fields:
      dtype = getattr(a, "dtype", None)
      if dtype is None or dtype == jax.dtypes.float0:
        return False
    return True


def _common_length(ga: GraphArrays, size: str) -> int:
  """E or P as most of the arrays sized by it say (so that an error names the odd one out)."""
  lengths = []
  for f, spec in _FIELDS.items():
    shape = tuple(np.shape(getattr(ga, f)))
    if spec[0] == size and len(shape) == 1:
      lengths.append(shape[0] - (1 if spec.endswith("+1") else 0))
  return max(set(lengths), key=lengths.count) if lengths else -1


def _check_sizes(ga: GraphArrays) -> None:
  """The static fields: sizes are ints in range, node-type offsets rise from 0 to num_nodes."""
  for f in ("num_nodes", "num_relations"):
    v = getattr(ga, f)
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= v < 2**31:
      raise ValueError(f"hector.GraphArrays: {f} must be an int in [0, 2**31), got {v!r}")
    object.__setattr__(ga, f, int(v))
  t = ga.node_type_offsets
  if t is not None:
    t = tuple(int(x) for x in t)
    if len(t) < 2 or t[0] != 0 or t[-1] != ga.num_nodes or any(b < a for a, b in zip(t, t[1:])):
      raise ValueError(
        f"hector.GraphArrays: node_type_offsets must rise from 0 to num_nodes="
        f"{ga.num_nodes}, got {list(t)}"
      )
    object.__setattr__(ga, "node_type_offsets", t)


def _is_concrete(a) -> bool:
  return isinstance(a, np.ndarray) or (
    isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer)
  )


#: arrays already checked: key -> weak references to them (a hit needs the same live objects)
_CHECKED: dict[tuple, tuple] = {}
_CHECKED_MAX = 64


def _check_values_once(ga: GraphArrays) -> None:
  """`_check_values` when the arrays are concrete and this set of arrays was not checked yet."""
  arrays = [getattr(ga, f) for f in _FIELDS]
  if not all(_is_concrete(a) for a in arrays):
    return  # traced: shapes and dtypes were checked; values are the kernels' to survive
  key = (ga.num_nodes, ga.num_relations) + tuple(id(a) for a in arrays)
  refs = _CHECKED.get(key)
  if refs is not None and all(r() is a for r, a in zip(refs, arrays)):
    return
  _check_values(ga)
  try:
    refs = tuple(weakref.ref(a) for a in arrays)
  except TypeError:  # NumPy arrays of some kinds cannot be weakly referenced: check each time
    return
  if len(_CHECKED) >= _CHECKED_MAX:
    _CHECKED.pop(next(iter(_CHECKED)))
  _CHECKED[key] = refs


def _check_values(ga: GraphArrays) -> None:
  """ValueError naming the field unless every id is in range and the views agree."""
  a = {f: np.asarray(getattr(ga, f)) for f in _INDEX_FIELDS}
  n, r, e, p = ga.num_nodes, ga.num_relations, len(a["src"]), len(a["pair_src"])

  def ids(f, bound, what, upto=None):
    x = a[f][:upto]
    bad = np.flatnonzero((x < 0) | (x >= bound))
    if bad.size:
      raise ValueError(
        f"hector.GraphArrays: {f} holds ids outside [0, {what}={bound}): "
        f"{f}[{bad[0]}] = {x[bad[0]]} ({bad.size} such)"
      )

  def offsets(f, total, what):
    x = a[f]
    if x[0] != 0 or x[-1] != total or np.any(np.diff(x) < 0):
      raise ValueError(
        f"hector.GraphArrays: {f} must rise from 0 to {what}={total}, got "
        f"{x[:4].tolist()}...{x[-2:].tolist()}"
      )

  def sorted_by(key_f, off_f, groups, members=None, upto=None):
    """The members (the rows themselves, or the ids listed in `members`; the first `upto`) of
    group g are `off_f[g]:off_f[g + 1]` and have key g."""
    key = a[key_f][:upto] if members is None else a[key_f][a[members][:upto]]
    if not np.array_equal(key, np.repeat(np.arange(groups), np.diff(a[off_f]))):
      raise ValueError(
        f"hector.GraphArrays: {members or key_f} disagrees with {off_f} (the {key_f} of its rows)"
      )

  def permutation(f, total):
    ids(f, total, "its length")
    if np.any(np.bincount(a[f], minlength=total) != 1):
      raise ValueError(f"hector.GraphArrays: {f} must list each id exactly once")

  def unused_tail(f, used, what, members=None):
    """The rows (or the ids listed in `members`) past `used` are unused: `f` is R there."""
    rows = a[f] if members is None else a[members]
    if used > len(rows) or np.any((rows[used:] if members is None else a[f][rows[used:]]) != r):
      raise ValueError(
        f"hector.GraphArrays: {members or f} must hold only {what} past {used}, the last of its "
        f"offsets ({f} = num_relations={r} there: no relation)"
      )

  ids("src", n, "num_nodes")
  ids("dst", n, "num_nodes")
  # edges past rel_offsets[R] are unused: no relation (etype R), listed after the views' groups
  used = int(a["rel_offsets"][-1])
  offsets("rel_offsets", used, "its used edges")
  unused_tail("etype", used, "unused edges")
  ids("etype", r, "num_relations", used)
  sorted_by("etype", "rel_offsets", r, upto=used)
  for off, members, end in (
    ("csr_offsets", "csr_edges", "src"),
    ("csc_offsets", "csc_edges", "dst"),
  ):
    offsets(off, used, "the used edges")
    permutation(members, e)
    unused_tail("etype", used, "unused edges", members)
    sorted_by(end, off, n, members, used)
  ids("pair", p, "num_pairs")
  ids("pair_src", n, "num_nodes")
  offsets("pair_offsets", e, "num_edges")
  permutation("pair_edges", e)
  sorted_by("pair", "pair_offsets", p, "pair_edges")
  for f, edge_f in (("pair_src", "src"), ("pair_etype", "etype")):
    if not np.array_equal(a[f][a["pair"]], a[edge_f]):
      raise ValueError(f"hector.GraphArrays: {f}[pair] disagrees with {edge_f}")
  # pairs past pair_rel_offsets[R] are unused: no relation (the unused edges' pair, if any)
  used = int(a["pair_rel_offsets"][-1])
  offsets("pair_rel_offsets", used, "its used pairs")
  unused_tail("pair_etype", used, "unused pairs")
  ids("pair_etype", r, "num_relations", used)
  sorted_by("pair_etype", "pair_rel_offsets", r, upto=used)
  offsets("pair_csr_offsets", p, "num_pairs")
  permutation("pair_csr_edges", p)
  sorted_by("pair_src", "pair_csr_offsets", n, "pair_csr_edges")


def _grouped(keys: np.ndarray, groups: int) -> tuple[np.ndarray, np.ndarray]:
  """(offsets[groups + 1], ids): the ids i with keys[i] == g are ids[offsets[g]:offsets[g+1]]."""
  return graph_build.group_by(keys, groups)


def unique_pairs(src: np.ndarray, etype: np.ndarray, num_nodes: int, num_relations: int):
  """The unique (src, relation) pairs of edges and the maps between edges and pairs.

  Returns, in `GraphArrays`' order: pair[E], pair_offsets[P+1], pair_edges[E], pair_src[P],
  pair_etype[P], pair_rel_offsets[R+1], pair_csr_offsets[N+1], pair_csr_edges[P] (offsets
  int64, ids int32). Computed by parallel radix sorts in native code
  (`jaxdata.data.graph_build.unique_pairs`); the values equal the NumPy formulation
  `jaxdata.reference.graph.unique_pairs`.
  """
  return graph_build.unique_pairs(src, etype, num_nodes, num_relations)


#: up to this many relations, `tiles` sums a masked [R+1, R] matrix (one fused reduction) rather
#: than calling `jnp.cumsum`
TILES_ONE_SUM = 1024


def tiles(rel_offsets: jax.Array, rows: int) -> jax.Array:
  """tiles[r]: how many row tiles of `rows` edges relations before r need (int32[R+1]).

  Up to `TILES_ONE_SUM` relations, as one masked sum: XLA makes it one kernel where it splits
  `jnp.cumsum` into several, and each is a launch for the host on a small graph (MUTAG RGCN
  forward on the H200: 63 -> 59 us, probe_inference.py). Integers: the same values."""
  counts = jnp.diff(rel_offsets)
  per = (counts + rows - 1) // rows
  r = per.shape[0]
  if r <= TILES_ONE_SUM:
    before = jnp.arange(r + 1, dtype=jnp.int32)[:, None] > jnp.arange(r, dtype=jnp.int32)[None, :]
    return jnp.sum(jnp.where(before, per[None, :], 0), axis=1, dtype=jnp.int32)
  return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(per).astype(jnp.int32)])


# ----------------------------------------------------------------------------- the primitive
@dataclasses.dataclass(frozen=True)
class KernelSpec:
  """What a kernel call computes (hashable: a primitive parameter); `precision` is the matmul
  level of a GEMM (`jaxdata.hector.precision.LEVELS`), which the CUDA source depends on;
  `out_dtype` the output's dtype ("float32", or "bfloat16" for a kernel that stores its rows)."""

  kernel: Template
  dtypes: tuple[str, ...]
  out_shape: tuple[int, ...]
  zero_output: bool
  label: str = ""
  precision: str = "default"
  out_dtype: str = "float32"


kernel_p = Primitive("jaxdata_hector_kernel")


def run_kernel(spec: KernelSpec, graph: GraphArrays, inputs: list[jax.Array]) -> jax.Array:
  """Runs one generated kernel over its domain's view of the graph; returns its output (of
  `spec.out_dtype`)."""
  assert not isinstance(spec.kernel, Dense)  # XLA ops, no kernel (`execute` runs them)
  graph.check_structure()  # the kernels bound their loops by these lengths
  rows = codegen.tile_rows(spec.kernel, _math(spec))
  # Only the CUDA GEMMs read row tiles; the others get the relation offsets in their place.
  # Kernels that check every id themselves (`codegen.common.reads_valid`) do not read `valid`:
  # it is not computed for them.
  ops = operands.graph_operands(
    graph,
    spec.kernel.domain,
    lambda offsets: tiles(offsets, rows) if rows else offsets,
    valid=reads_valid(spec.kernel, _math(spec)),
  )
  with jax.named_scope(_scope(spec.label)):
    return kernel_p.bind(*ops, *inputs, spec=spec)


def _scope(label: str) -> str:
  """A kernel's computation as a named scope, so that a profile says which kernel a launch is:
  its label (`Instance.__str__`) without operand names, in letters, digits and underscores
  (the scope becomes the instruction's name, which profilers parse)."""
  words = re.findall(r"[A-Za-z0-9]+", label.split("   [")[0])
  return "hector_" + "_".join(words)[:80]


@functools.cache
def _jitted(spec: KernelSpec):
  return jax.jit(lambda *args: kernel_p.bind(*args, spec=spec))


kernel_p.def_impl(lambda *args, spec: _jitted(spec)(*args))  # eager calls compile a small program


@kernel_p.def_abstract_eval
def _abstract(*avals, spec: KernelSpec):
  return jax.core.ShapedArray(spec.out_shape, jnp.dtype(spec.out_dtype))


def _math(spec: KernelSpec) -> str:
  """The kind of GEMM (`codegen.MATHS`) a CUDA kernel of `spec` is generated as."""
  return codegen.math(spec.kernel, spec.dtypes, spec.precision)


def kernel_id(source: str) -> int:
  return int(hashlib.sha256(source.encode()).hexdigest()[:15], 16)


def source(spec: KernelSpec, target: str, tile: codegen.Tile | None = None) -> str:
  """The source of `spec`'s kernel for `target`, in tiling `tile` (`codegen.tilings`; by
  default the first)."""
  return codegen.generate(
    spec.kernel, spec.dtypes, target, spec.label, spec.precision, spec.out_dtype, tile
  )


def _lower(ctx, *args, spec: KernelSpec, target: str):
  src = source(spec, target)
  operands.check(ctx.avals_in, len(spec.dtypes), "hector kernel " + (spec.label or "call"))
  size = operands.sizes(ctx.avals_in)  # E: the domain's rows (edges, or pairs), N, R, P
  max_tiles = 0
  if target == "cpu":
    kid = kernel_id(src + target)
    compiler.compile_cpu(
      src, load=lambda path: ext.hector_load_cpu_kernel(kid, str(path), "jaxdata_hector_kernel")
    )
    launches, tune_file = [(kid, 0, 0)], ""
  else:
    arch = ext.cuda_compute_capability()
    if arch == 0:
      raise RuntimeError("hector: lowering for CUDA but the extension sees no CUDA device")
    kind = _math(spec)
    rows = codegen.tile_rows(spec.kernel, kind)
    max_tiles = -(-size["E"] // rows) + size["R"] if rows else 0
    tiles = codegen.tilings(spec.kernel, kind) if tuning.enabled() else [None]
    tune_file = ""
    if len(tiles) > 1:  # a tensor-core instance: the recorded tiling, else all of them, tuned
      path = tuning.choice_file(src, arch, size["E"], tiles, size["P"])
      choice = tuning.read_choice(path, len(tiles))
      if choice is not None:
        tiles = [tiles[choice.index]]
      else:
        tune_file = str(path)
    launches = []
    for tile in tiles:
      code = src if tile is None else source(spec, target, tile)
      kid = kernel_id(code + target)
      compiler.compile_cuda(
        code,
        arch,
        load=lambda path, kid=kid: ext.hector_load_cuda_kernel(
          kid, path.read_bytes(), "jaxdata_hector_kernel"
        ),
      )
      launches.append(
        (kid,) + codegen.launch(spec.kernel, max_tiles, size["E"], size["N"], kind, tile)
      )
  scalars = operands.scalar_values(dict(size, T=max_tiles))
  (kid, grid, block), *_ = launches
  tune = np.array(launches if tune_file else [], np.int64).reshape(-1)
  # a call that tunes goes to the target XLA keeps out of its CUDA graphs (its first run must
  # not be captured: it times the tilings); every other call may join them
  target = "jaxdata_hector_tune" if tune_file else "jaxdata_hector_launch"
  if tune_file:
    tuning.note_tuning_lowering()
  return jax.ffi.ffi_lowering(target)(
    ctx,
    *args,
    kernel=np.int64(kid),
    scalars=scalars,
    grid=np.int64(grid),
    block=np.int64(block),
    zero_outputs=np.int32(spec.zero_output),
    tune_launches=tune,
    tune_file=tune_file,
  )


mlir.register_lowering(kernel_p, functools.partial(_lower, target="cpu"), platform="cpu")
mlir.register_lowering(kernel_p, functools.partial(_lower, target="cuda"), platform="cuda")


def _batch(args, dims, *, spec: KernelSpec):
  """vmap: one kernel call per batch element (lax.map), the graph shared when unbatched."""
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
  moved = [a if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)]
  batched = [d is not None for d in dims]

  def one(xs):
    it = iter(xs)
    return kernel_p.bind(*[next(it) if b else a for a, b in zip(moved, batched)], spec=spec)

  out = jax.lax.map(one, [a for a, b in zip(moved, batched) if b])
  assert out.shape[0] == size
  return out, 0


batching.primitive_batchers[kernel_p] = _batch
