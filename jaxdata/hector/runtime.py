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

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from jaxdata import _ffi  # noqa: F401  (registers jaxdata_hector_launch)
from jaxdata import _xla_ffi as ext
from jaxdata.hector import codegen, compiler
from jaxdata.hector.lowering import Template


_EDGE_FIELDS = ["src", "dst", "etype", "norm", "rel_offsets", "csr_offsets", "csr_edges",
                "csc_offsets", "csc_edges"]
_PAIR_FIELDS = ["pair", "pair_offsets", "pair_edges", "pair_src", "pair_etype",
                "pair_rel_offsets", "pair_csr_offsets", "pair_csr_edges"]


@functools.partial(jax.tree_util.register_dataclass, data_fields=_EDGE_FIELDS + _PAIR_FIELDS,
                   meta_fields=["num_nodes", "num_relations"])
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

  @classmethod
  def from_graph(cls, graph, *, norm: str | np.ndarray = "mean", device=None) -> GraphArrays:
    """From a `jaxdata.data.HeteroGraph` (`norm`: "mean", "none", or a float array per edge)."""
    if graph.num_edges >= 2**31 or graph.num_nodes >= 2**31:
      raise ValueError("hector: graphs with 2**31 or more edges or nodes are not supported")
    n = graph.edge_norm(norm) if isinstance(norm, str) else np.asarray(norm, np.float32)
    if n.shape != (graph.num_edges,):
      raise ValueError(f"norm must have one value per edge ({graph.num_edges}), got {n.shape}")
    csr_off, csr_e = graph.csr()
    csc_off, csc_e = graph.csc()
    pairs = unique_pairs(graph.src, graph.etype, graph.num_nodes, graph.num_relations)
    i32 = lambda a: jax.device_put(np.asarray(a, np.int32), device)  # noqa: E731
    return cls(i32(graph.src), i32(graph.dst), i32(graph.etype),
               jax.device_put(n.astype(np.float32), device), i32(graph.relation_offsets),
               i32(csr_off), i32(csr_e), i32(csc_off), i32(csc_e), *map(i32, pairs),
               int(graph.num_nodes), int(graph.num_relations))

  @property
  def num_edges(self) -> int:
    return self.src.shape[0]

  @property
  def num_pairs(self) -> int:
    """The number of unique (source node, relation) pairs: the rows of a compact value."""
    return self.pair_src.shape[0]

  def view(self, domain: str) -> list[jax.Array]:
    """The first nine graph operands of a kernel over `domain` ("edge", or "compact": the pairs
    stand in for the edges; they have no destination, so `dst` and the CSC view repeat the
    source side and `norm` is not theirs)."""
    if domain == "compact":
      return [self.pair_src, self.pair_src, self.pair_etype, self.norm, self.pair_rel_offsets,
              self.pair_csr_offsets, self.pair_csr_edges, self.pair_csr_offsets,
              self.pair_csr_edges]
    return [getattr(self, f) for f in _EDGE_FIELDS]


def _grouped(keys: np.ndarray, groups: int) -> tuple[np.ndarray, np.ndarray]:
  """(offsets[groups + 1], ids): the ids i with keys[i] == g are ids[offsets[g]:offsets[g+1]]."""
  counts = np.bincount(keys, minlength=groups)
  return np.concatenate([[0], np.cumsum(counts)]), np.argsort(keys, kind="stable")


def unique_pairs(src: np.ndarray, etype: np.ndarray, num_nodes: int, num_relations: int):
  """The unique (src, relation) pairs of edges and the maps between edges and pairs.

  Returns, in `GraphArrays`' order: pair[E], pair_offsets[P+1], pair_edges[E], pair_src[P],
  pair_etype[P], pair_rel_offsets[R+1], pair_csr_offsets[N+1], pair_csr_edges[P].
  """
  key = np.asarray(etype, np.int64) * max(num_nodes, 1) + np.asarray(src, np.int64)
  uniq, pair = np.unique(key, return_inverse=True)  # sorted by (relation, source)
  pair = pair.reshape(-1)
  p_src, p_etype = uniq % max(num_nodes, 1), uniq // max(num_nodes, 1)
  pair_offsets, pair_edges = _grouped(pair, len(uniq))
  rel_offsets, _ = _grouped(p_etype, num_relations)
  csr_offsets, csr_edges = _grouped(p_src, num_nodes)
  return (pair, pair_offsets, pair_edges, p_src, p_etype, rel_offsets, csr_offsets, csr_edges)


def tiles(rel_offsets: jax.Array, rows: int) -> jax.Array:
  """tiles[r]: how many row tiles of `rows` edges relations before r need (int32[R+1])."""
  counts = jnp.diff(rel_offsets)
  per = (counts + rows - 1) // rows
  return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(per).astype(jnp.int32)])


# ----------------------------------------------------------------------------- the primitive
@dataclasses.dataclass(frozen=True)
class KernelSpec:
  """What a kernel call computes (hashable: a primitive parameter)."""
  kernel: Template
  dtypes: tuple[str, ...]
  out_shape: tuple[int, ...]
  zero_output: bool
  label: str = ""


kernel_p = Primitive("jaxdata_hector_kernel")


def run_kernel(spec: KernelSpec, graph: GraphArrays, inputs: list[jax.Array]) -> jax.Array:
  """Runs one generated kernel over its domain's view of the graph; returns its float32 output."""
  rows = codegen.tile_rows(spec.kernel)
  ops = graph.view(spec.kernel.domain)
  # Only the CUDA GEMMs read row tiles; the others get a placeholder of the same dtype.
  t = tiles(ops[4], rows) if rows else ops[4]
  ops += [t, graph.pair, graph.pair_offsets, graph.pair_edges]
  return kernel_p.bind(*ops, *inputs, spec=spec)


@functools.lru_cache(maxsize=None)
def _jitted(spec: KernelSpec):
  return jax.jit(lambda *args: kernel_p.bind(*args, spec=spec))


kernel_p.def_impl(lambda *args, spec: _jitted(spec)(*args))  # eager calls compile a small program


@kernel_p.def_abstract_eval
def _abstract(*avals, spec: KernelSpec):
  return jax.core.ShapedArray(spec.out_shape, jnp.float32)


def kernel_id(source: str) -> int:
  return int(hashlib.sha256(source.encode()).hexdigest()[:15], 16)


def source(spec: KernelSpec, target: str) -> str:
  return codegen.generate(spec.kernel, spec.dtypes, target, spec.label)


def _lower(ctx, *operands, spec: KernelSpec, target: str):
  src = source(spec, target)
  kid = kernel_id(src + target)
  num_edges = ctx.avals_in[0].shape[0]  # the domain's rows: edges, or pairs
  num_nodes = ctx.avals_in[5].shape[0] - 1
  num_relations = ctx.avals_in[4].shape[0] - 1
  num_pairs = ctx.avals_in[11].shape[0] - 1
  grid, block, max_tiles = 0, 0, 0
  if target == "cpu":
    ext.hector_load_cpu_kernel(kid, str(compiler.compile_cpu(src)), "jaxdata_hector_kernel")
  else:
    arch = ext.cuda_compute_capability()
    if arch == 0:
      raise RuntimeError("hector: lowering for CUDA but the extension sees no CUDA device")
    cubin = compiler.compile_cuda(src, arch).read_bytes()
    ext.hector_load_cuda_kernel(kid, cubin, "jaxdata_hector_kernel")
    rows = codegen.tile_rows(spec.kernel)
    max_tiles = -(-num_edges // rows) + num_relations if rows else 0
    grid, block = codegen.launch(spec.kernel, max_tiles, num_edges, num_nodes)
  scalars = np.array([num_edges, num_nodes, num_relations, max_tiles, num_pairs], np.int64)
  return jax.ffi.ffi_lowering("jaxdata_hector_launch")(
      ctx, *operands, kernel=np.int64(kid), scalars=scalars, grid=np.int64(grid),
      block=np.int64(block), shared_bytes=np.int64(0), zero_outputs=np.int32(spec.zero_output))


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
