"""sample_neighbors: fixed-shape, multi-hop uniform neighbour sampling from a HostGraph, with the
relation of every sampled edge when the graph is typed."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from jaxdata import _ffi  # registers the FFI targets  # noqa: F401
from jaxdata.host.gather import _canonical_indices, as_indices, host_gather
from jaxdata.host.graph import HostGraph, check_in_degrees
from jaxdata.host.table import HostTable


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Blocks:
  """The sampled neighbourhood of a batch of seed nodes, hop by hop, in fixed shapes.

  Sampling is tree-shaped, as in GraphSAGE: every node of hop l gets its own `fanouts[l]`
  neighbour slots, so hop l + 1 holds `len(nodes[l]) * fanouts[l]` entries and the slots of
  node i of hop l are entries `i * fanouts[l]` to `(i + 1) * fanouts[l]` of hop l + 1. A node
  may appear several times (each time with its own sample). Unused slots hold -1 with mask
  False, and so do all the slots below them.

  Sampled from a typed (relational) graph, `etypes[l]` holds, for every entry of hop l >= 1,
  the relation of the very edge that was drawn from that entry's node to its parent (entry
  `i // fanouts[l - 1]` of hop l - 1): two nodes joined by edges of several relations show the
  relation of the edge drawn, so each relation in proportion to its edges. A relational layer
  splits its messages by it.

  Attributes:
    nodes: hop 0 is the seeds [B]; hop l is int32 [B * fanouts[0] * ... * fanouts[l - 1]].
    masks: bool arrays of the same shapes; False marks padding.
    fanouts: the fanout of every hop (static).
    num_nodes: the number of nodes of the graph sampled from (static; None: unknown), which a
      table gathered for these blocks must have at least as rows.
    etypes: None for an untyped graph; else int32 arrays of the shapes of `nodes`: hop l >= 1
      the relation of each entry's edge to its parent, -1 on padding; hop 0 (the seeds, which
      have no parent) all -1.
  """

  nodes: tuple[jax.Array, ...]
  masks: tuple[jax.Array, ...]
  fanouts: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
  num_nodes: int | None = dataclasses.field(default=None, metadata=dict(static=True))
  etypes: tuple[jax.Array, ...] | None = None

  @property
  def num_hops(self) -> int:
    return len(self.fanouts)

  def neighbours(self, hop: int) -> tuple[jax.Array, jax.Array]:
    """Hop `hop + 1`'s nodes and masks shaped [len(nodes[hop]), fanouts[hop]]."""
    f = self.fanouts[hop]
    return self.nodes[hop + 1].reshape(-1, f), self.masks[hop + 1].reshape(-1, f)

  def relations(self, hop: int) -> jax.Array:
    """Hop `hop + 1`'s edge relations shaped [len(nodes[hop]), fanouts[hop]] (as `neighbours`).

    Raises ValueError for blocks sampled from an untyped graph.
    """
    if self.etypes is None:
      raise ValueError("Blocks.relations: these blocks were sampled from a graph without etypes")
    return self.etypes[hop + 1].reshape(-1, self.fanouts[hop])

  def gather(
    self, table: HostTable, *, unique: bool = False, cache: Any = None, **kwargs: Any
  ) -> tuple[jax.Array, ...]:
    """The rows of `table` for every hop's nodes (zeros for padding), via `host_gather`.

    With `unique`, each distinct node is read from the table once and copied on the device to
    every place it appears: on power-law graphs the hubs recur across a batch, so this moves
    fewer bytes over PCIe, at the price of a sort of the batch's node ids. With a `cache`
    (`DeviceCache` of this table), cached rows come from device memory and only the others
    are read from the host.

    Raises ValueError when the table has fewer rows than the graph has nodes (a real neighbour
    would otherwise read as padding).
    """
    if not isinstance(table, HostTable):
      raise TypeError(f"Blocks.gather: table must be a HostTable, got {type(table).__name__}")
    rows = table.shape[0]
    if self.num_nodes is not None and rows < self.num_nodes:
      raise ValueError(
        f"Blocks.gather: the table has {rows} rows, but the blocks were sampled "
        f"from a graph of {self.num_nodes} nodes"
      )
    if cache is not None and cache.slots.shape[0] != rows:
      raise ValueError(
        f"Blocks.gather: the cache was built for a table of "
        f"{cache.slots.shape[0]} rows, this table has {rows}"
      )
    ids = [jnp.where(m, n, rows) for n, m in zip(self.nodes, self.masks)]
    slots = []
    if cache is not None:
      slots = [cache.lookup(n, m) for n, m in zip(self.nodes, self.masks)]
      ids = [jnp.where(s >= 0, rows, i) for i, s in zip(ids, slots)]  # hits: nothing to read
    if not unique:
      out = [host_gather(table, i, mode="fill", fill_value=0, **kwargs) for i in ids]
    else:
      flat = jnp.concatenate(ids)
      distinct, inverse = jnp.unique(flat, size=flat.shape[0], fill_value=rows, return_inverse=True)
      kwargs.setdefault("sort", False)  # already ascending
      read = host_gather(table, distinct, mode="fill", fill_value=0, **kwargs)
      out = jnp.split(
        jnp.take(read, inverse.reshape(-1), axis=0), np.cumsum([i.shape[0] for i in ids])[:-1]
      )
    if cache is not None:
      out = [cache.fill(s, o) for o, s in zip(out, slots)]
    return tuple(out)

  def to_jraph(self, hop: int = 0, node_features: jax.Array | None = None):
    """Hop `hop`'s sampled edges as a bipartite `jraph.GraphsTuple` (needs jraph).

    Nodes are hop `hop`'s entries followed by hop `hop + 1`'s; there is an edge from every slot
    of hop `hop + 1` to the node it was sampled for, padding included: `edges["mask"]` tells
    which are real, and for a typed graph `edges["etype"]` their relations (-1 on padding).
    `nodes` holds `{"id", "mask"}` and, if given, `"features"` (the rows of both hops, stacked
    the same way).
    """
    import jraph  # optional (the jraph extra)

    dst, src = self.nodes[hop], self.nodes[hop + 1]
    n_dst, n_src = dst.shape[0], src.shape[0]
    nodes = {
      "id": jnp.concatenate([dst, src]),
      "mask": jnp.concatenate([self.masks[hop], self.masks[hop + 1]]),
    }
    if node_features is not None:
      nodes["features"] = node_features
    edges = {"mask": self.masks[hop + 1]}
    if self.etypes is not None:
      edges["etype"] = self.etypes[hop + 1]
    return jraph.GraphsTuple(
      nodes=nodes,
      edges=edges,
      senders=n_dst + jnp.arange(n_src, dtype=jnp.int32),
      receivers=jax.lax.broadcasted_iota(jnp.int32, (n_dst, self.fanouts[hop]), 0).reshape(-1),
      globals=None,
      n_node=jnp.array([n_dst + n_src]),
      n_edge=jnp.array([n_src]),
    )


class DeviceGraph(NamedTuple):
  """An in-neighbour CSR held as JAX arrays: the in-device-memory counterpart of `HostGraph`.

  `sample_neighbors` draws exactly the same sample from it as from the HostGraph it was made
  from (relations included); it exists for graphs that fit in device memory and as the
  all-in-GPU baseline.
  """

  indptr: jax.Array  # int32 or int64 [num_nodes + 1]
  indices: jax.Array  # int32 [num_edges]
  etypes: jax.Array | None = None  # int32 [num_edges], the relation of every edge; None: untyped

  @classmethod
  def from_host(cls, graph: HostGraph, device: Any = None) -> DeviceGraph:
    # Copies, so the arrays never keep the host tables' memory alive.
    indptr = graph.indptr.as_numpy()[:, 0]
    indptr = indptr.astype(np.int32 if indptr[-1] < np.iinfo(np.int32).max else np.int64)
    indices = graph.indices.as_numpy()[: graph.num_edges, 0].copy()
    etypes = None
    if graph.etypes is not None:
      etypes = jax.device_put(graph.etypes.as_numpy()[: graph.num_edges, 0].copy(), device)
    return cls(jax.device_put(indptr, device), jax.device_put(indices, device), etypes)

  @property
  def num_nodes(self) -> int:
    return self.indptr.shape[0] - 1


def sample_neighbors(
  graph: HostGraph | DeviceGraph,
  seeds: Any,
  fanouts: Sequence[int],
  key: jax.Array,
  *,
  replace: bool = False,
) -> Blocks:
  """Samples up to `fanouts[l]` neighbours of every node of hop l, for l = 0, 1, ...

  On a GPU the kernel reads the graph's CSR straight from pinned host memory (zero-copy) and
  the call never waits for the device (a closed graph's handles, reaching it through a compiled
  closure, give padding and an error from the next jaxdata host call on that GPU); on the CPU,
  XLA's thread pool samples. Both draw exactly the same sample for the same key:
  uniform without replacement (a node of degree <= fanout keeps all its neighbours), or with
  replacement if `replace`. Without replacement the *set* of a node's samples is uniform, not
  the order of its slots: use all of a node's slots, not a prefix. Output shapes depend only on
  `len(seeds)` and `fanouts`, so a jitted training step compiles once.

  A typed graph (one with `etypes`) also gives the relation of every drawn edge
  (`Blocks.etypes`), read by the same kernel beside the neighbour: the nodes and masks are
  exactly those the same graph without etypes gives for the key.

  Example:
    >>> blocks = jax.jit(sample_neighbors, static_argnums=(2,))(
    ...     graph, jnp.array([3, 7, -1]), (10, 5), jax.random.key(0))   # -1: a padded seed
    >>> feats = blocks.gather(graph.features)   # hop 0: [3, d], hop 1: [30, d], hop 2: [150, d]
    >>> blocks.etypes[1]   # with etypes: [30] int32, the relation of each hop-1 edge (-1: padding)

  Args:
    graph: an open `HostGraph`, or a `DeviceGraph` (the CSR in device arrays), typed or not.
    seeds: 1-D integer node ids. A negative seed is padding (masked, nothing sampled). A seed
      >= num_nodes is an error when `seeds` is concrete; under `jit` it is treated as padding.
    fanouts: neighbours per node at each hop, positive Python ints (a single int is one hop);
      a hop may hold at most 2**31 - 1 slots (``len(seeds) * fanouts[0] * ...``).
    key: a JAX PRNG key (typed or raw); hop l uses `fold_in(key, l)`.
    replace: sample with replacement.

  Returns:
    `Blocks` with hops 0 (the seeds) to len(fanouts); `etypes` filled for a typed graph.
  """
  # The relations enter as an optional last operand, and come back as an optional third
  # output: an untyped call is the same FFI call as before and runs the untyped kernel.
  if isinstance(graph, HostGraph):
    if graph.closed:
      raise ValueError(f"sample_neighbors: {graph!r} is closed")
    # The tables enter as handles (operands) and sizes, not as identities baked into the program.
    operands = (graph.indptr.handle, graph.indices.handle)
    typed = (graph.etypes.handle,) if graph.etypes is not None else ()
    target, attrs = (
      "jaxdata_host_sample",
      dict(
        num_nodes=np.int64(graph.indptr.shape[0] - 1), num_edges=np.int64(graph.indices.shape[0])
      ),
    )
  elif isinstance(graph, DeviceGraph):
    operands = _check_device_csr(graph)
    typed = () if graph.etypes is None else (_check_device_etypes(graph),)
    target, attrs = "jaxdata_sample", {}
  else:
    raise TypeError(
      f"sample_neighbors: graph must be a HostGraph or DeviceGraph, got {type(graph).__name__}"
    )
  seeds = check_seeds(seeds, graph.num_nodes, "sample_neighbors")
  fanouts = check_fanouts(fanouts, "sample_neighbors", tree_slots(seeds.shape[0]))
  valid = (seeds >= 0) & (seeds < graph.num_nodes)
  nodes = [jnp.where(valid, seeds, -1).astype(jnp.int32)]
  masks = [valid]
  etypes = [jnp.full(seeds.shape, -1, jnp.int32)]  # the seeds have no parent edge
  for hop, fanout in enumerate(fanouts):
    words = jax.random.bits(jax.random.fold_in(key, hop), (2,), jnp.uint32)
    n = nodes[-1].shape[0]
    slots = jax.ShapeDtypeStruct((n, fanout), jnp.int32)
    out = (slots, jax.ShapeDtypeStruct((n, fanout), bool)) + ((slots,) if typed else ())
    got = jax.ffi.ffi_call(target, out, vmap_method="sequential")(
      *operands,
      nodes[-1],
      words,
      *typed,
      fanout=np.int64(fanout),
      replace=np.int32(bool(replace)),
      **attrs,
    )
    nodes.append(got[0].reshape(-1))
    masks.append(got[1].reshape(-1))
    if typed:
      etypes.append(got[2].reshape(-1))
  return Blocks(
    tuple(nodes), tuple(masks), fanouts, graph.num_nodes, tuple(etypes) if typed else None
  )


def _check_device_csr(graph: DeviceGraph) -> tuple[jax.Array, jax.Array]:
  """(indptr, int32 indices) of a DeviceGraph, checked: integer arrays of one dimension; when
  concrete, indptr rises from 0 to the edge count and every index names a node, checked in
  the caller's dtype before the cast (an int64 index past int32 never wraps into a node)."""
  arrays = {}
  for name, allowed in (("indptr", (jnp.int32, jnp.int64)), ("indices", None)):
    a = getattr(graph, name)
    dtype = getattr(a, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
      raise TypeError(
        f"sample_neighbors: DeviceGraph.{name} must be an integer array, got "
        f"{dtype if dtype is not None else type(a).__name__}"
      )
    if allowed is not None and dtype not in allowed:
      raise TypeError(f"sample_neighbors: DeviceGraph.{name} must be int32 or int64, got {dtype}")
    if np.ndim(a) != 1:
      raise ValueError(f"sample_neighbors: DeviceGraph.{name} must be 1-D, got {np.shape(a)}")
    arrays[name] = a
  indptr, indices = arrays["indptr"], arrays["indices"]
  num_nodes = indptr.shape[0] - 1
  if num_nodes < 0 or num_nodes > np.iinfo(np.int32).max:
    raise ValueError(
      f"sample_neighbors: DeviceGraph.indptr must hold 1 to 2**31 entries, got {indptr.shape[0]}"
    )
  if not isinstance(indptr, jax.core.Tracer) and not isinstance(indices, jax.core.Tracer):
    # reductions where the arrays are (a device graph is not copied back), then a few scalars
    ptr, idx = jnp.asarray(indptr), jnp.asarray(indices)
    if int(ptr[0]) != 0 or int(ptr[-1]) != idx.shape[0] or bool(jnp.any(ptr[1:] < ptr[:-1])):
      raise ValueError(
        "sample_neighbors: DeviceGraph.indptr must rise from 0 to len(indices) without decreasing"
      )
    check_in_degrees(ptr[1:] - ptr[:-1], "sample_neighbors: DeviceGraph")
    low, high = (int(x) for x in (idx.min(), idx.max())) if idx.size else (0, 0)
    if low < 0 or high >= max(num_nodes, 1):
      raise ValueError(
        f"sample_neighbors: DeviceGraph.indices holds ids outside the graph's {num_nodes} "
        f"nodes ({low} .. {high})"
      )
  return indptr, indices.astype(jnp.int32)


def _check_device_etypes(graph: DeviceGraph) -> jax.Array:
  etypes = graph.etypes
  dtype = getattr(etypes, "dtype", None)
  if dtype is None or not jnp.issubdtype(dtype, jnp.integer) or dtype == jnp.bool_:
    raise TypeError(
      f"sample_neighbors: DeviceGraph.etypes must be an integer array, got "
      f"{dtype if dtype is not None else type(etypes).__name__}"
    )
  assert etypes is not None  # it has a dtype
  if np.shape(etypes) != np.shape(graph.indices):
    raise ValueError(
      f"sample_neighbors: DeviceGraph.etypes {np.shape(etypes)} must have one "
      f"entry per edge, like indices {np.shape(graph.indices)}"
    )
  return etypes.astype(jnp.int32)


#: The most slots a hop may hold: positions in a hop, and a sampled row's positions in the
#: kernels (xla_ffi/host/sample.h), are int32.
MAX_SLOTS = int(np.iinfo(np.int32).max)


def tree_slots(batch: int) -> Callable[[tuple[int, ...]], list[int]]:
  """The hop sizes of tree-shaped sampling (`Blocks`) of `batch` seeds, as a function of the
  fanouts: hop l + 1 holds fanouts[l] slots per entry of hop l."""

  def slots(fanouts: tuple[int, ...]) -> list[int]:
    sizes = [int(batch)]
    for f in fanouts:
      sizes.append(sizes[-1] * f)
    return sizes

  return slots


def check_fanouts(
  fanouts: Any, what: str, slots: Callable[[tuple[int, ...]], list[int]] | None = None
) -> tuple[int, ...]:
  """`fanouts` as a tuple of positive Python ints (a single int is one hop), or a TypeError /
  ValueError naming `what`. With `slots` (fanouts -> the slots of every hop, Python ints), a hop
  of more than `MAX_SLOTS` slots is refused here: XLA aborts the process on an array whose size
  overflows, and the kernels index a hop with int32."""
  if isinstance(fanouts, (int, np.integer)) and not isinstance(fanouts, (bool, np.bool_)):
    fanouts = (fanouts,)
  if isinstance(fanouts, (str, bytes)):
    raise TypeError(f"{what}: fanouts must be an int or a sequence of ints, got {fanouts!r}")
  try:
    hops = tuple(fanouts)  # pyright: ignore[reportArgumentType]  (not iterable: TypeError)
  except TypeError:
    raise TypeError(
      f"{what}: fanouts must be an int or a sequence of ints, got {fanouts!r}"
    ) from None
  if not hops:
    raise ValueError(f"{what}: fanouts is empty; give at least one hop")
  for f in hops:
    if isinstance(f, (bool, np.bool_)) or not isinstance(f, (int, np.integer)):
      raise TypeError(f"{what}: fanouts must be Python ints, got {f!r} in {hops!r}")
    if f < 1:
      raise ValueError(f"{what}: fanouts must be positive ints (each >= 1), got {hops}")
  hops = tuple(int(f) for f in hops)
  for f in hops:
    if f > MAX_SLOTS:
      raise ValueError(f"{what}: a fanout must be at most 2**31 - 1, got {f}")
  if slots is not None:
    for hop, n in enumerate(slots(hops)):
      if n > MAX_SLOTS:
        raise ValueError(
          f"{what}: hop {hop} would hold {n} slots for fanouts {hops}, more than 2**31 - 1"
        )
  return hops


def check_seeds(seeds: Any, num_nodes: int, what: str) -> jax.Array:
  """The seeds as int32 or int64 ids with their meaning kept (`_canonical_indices`): a 1-D
  integer array, and when concrete every seed below `num_nodes`, checked in the caller's dtype
  before any cast (else TypeError / ValueError naming `what`)."""
  dtype = getattr(seeds, "dtype", None)
  if dtype is None:
    seeds = np.asarray(seeds)
    dtype = seeds.dtype
  if not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(f"{what}: seeds must be integers, got dtype {dtype}")
  if np.ndim(seeds) != 1:
    raise ValueError(f"{what}: seeds must be 1-D, got shape {np.shape(seeds)}")
  if not isinstance(seeds, jax.core.Tracer):
    concrete = np.asarray(seeds)
    if concrete.size and concrete.max() >= num_nodes:
      raise ValueError(
        f"{what}: seed {concrete.max()} is outside the graph's "
        f"{num_nodes} nodes (negative seeds mark padding)"
      )
    seeds = as_indices(seeds, what)
  return _canonical_indices(jnp.asarray(seeds), num_nodes)
