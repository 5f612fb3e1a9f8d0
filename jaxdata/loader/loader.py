"""`Loader`: mini-batches of a (typed) graph in host memory, for the user's own model and loop.

A `Loader` owns what sampling reads — the graph's in-edges by destination (a pinned `HostGraph`,
or a `DeviceGraph` with `pipeline="device"`), each node type's input rows (feature tables in
host memory, device arrays, or `.npy` files read straight into a table), learnable embeddings
(host tables a sparse optimizer trains in place) and labels — and is itself a pytree: pass it to
your jitted step like any argument, and `loader.sample(seeds, key)` samples the blocks and gathers
their inputs inside the step, on the device, with nothing baked into the program.

    loader = Loader(edges, num_nodes=counts, features={"paper": x}, embeddings={"author": 64},
                    labels={"paper": y}, fanouts=(10, 5))

    @nnx.jit
    def step(model, optimizer, loader, seeds, key):
      batch = loader.sample(seeds, key)
      ...

    for batch in loader.batches({"paper": train_ids}, batch_size=1024, num_epochs=10): ...

`batches` is the other way in: an iterator over epochs of shuffled seeds, prefetched, whose
`get_state()` / `set_state()` resume a run mid-epoch with the same batches (Grain's convention).
"""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxdata import placement
from jaxdata.data.graph import HeteroGraph
from jaxdata.data.hetero import HeteroData
from jaxdata.host.graph import HostGraph
from jaxdata.host.sample import Blocks, DeviceGraph, sample_neighbors
from jaxdata.host.table import HostTable
from jaxdata.loader.blocks import (
  RelationalBlocks,
  budget_fraction,
  gather_typed,
  node_types,
  sample_blocks,
  type_caches,
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Batch:
  """One mini-batch in fixed shapes (a pytree: every batch of a loader has the same shapes).

  Attributes:
    seeds: int32 [B] global node ids of the seeds, -1 in padding slots.
    labels: int32 [B] the seeds' labels (0 where a seed has none).
    mask: bool [B] a real seed with a label: what a loss averages over.
    blocks: the sampled hops (`RelationalBlocks`): ``blocks.graphs[h]`` is hop h's block, hop
      0 next to the seeds; a model's first layer runs on ``blocks.graphs[-1]``; the seeds are
      the first B slots of ``blocks.nodes[0]``.
    types: int32 node type of each slot of the outermost frontier ``blocks.nodes[-1]`` (-1:
      unused slot).
    inputs: per node type (the loader's `node_types` order) ``[slots, d_t]``: that type's rows for
      the outermost frontier's slots, zeros in slots of other types. None for an embedded type
      in a `prepare`d batch (`Loader.complete` fills it).
  """

  seeds: jax.Array
  labels: jax.Array
  mask: jax.Array
  blocks: RelationalBlocks
  types: jax.Array
  inputs: tuple[jax.Array | None, ...]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TreeBatch:
  """One mini-batch of a tree-sampling loader (``Loader(..., tree=True)``), in fixed shapes.

  Every node of hop l gets its own ``fanouts[l]`` neighbour slots in hop l + 1 (`host.Blocks`):
  no deduplication, so a GraphSAGE-style model aggregates by a reshape, with no scatter
  (`jaxdata.nn.GraphSAGE` takes ``batch.inputs, batch.blocks.masks``).

  Attributes:
    seeds: int32 [B] the seeds, -1 in padding slots (``blocks.nodes[0]``).
    labels: int32 [B] the seeds' labels (0 where a seed has none).
    mask: bool [B] a real seed with a label.
    blocks: the tree (`jaxdata.host.Blocks`): ``blocks.nodes[l]`` and ``blocks.masks[l]``.
    inputs: per hop, ``[len(blocks.nodes[l]), d]``: the rows of hop l's nodes (zeros in
      padding); None for an embedded type in a `prepare`d batch (`Loader.complete` fills it).
  """

  seeds: jax.Array
  labels: jax.Array
  mask: jax.Array
  blocks: Blocks
  inputs: tuple[jax.Array, ...] | None


@dataclasses.dataclass(frozen=True)
class _Meta:
  """A loader's static description (hashable: the pytree's aux data)."""

  names: tuple[str, ...]
  offsets: tuple[int, ...]
  num_relations: int
  fanouts: tuple[int, ...]
  embedded: tuple[int, ...]
  norm: str
  tree: bool = False


class Loader:
  """Samples mini-batches of a graph held in host memory and gathers their inputs.

  Args:
    graph: a `jaxdata.data.HeteroGraph`; or ``{(src_type, relation, dst_type): (src, dst)}``
      with ids local to each type and `num_nodes` (``{type: count}``), built with
      `HeteroGraph.from_typed_edges` (reverse relations added unless ``add_inverse=False``);
      or a homogeneous `HostGraph` (one node type, "node"; one relation unless it has etypes).
    num_nodes: ``{node type: count}`` for a dict `graph`.
    features: ``{node type: rows}``, each a NumPy array (copied once into a pinned `HostTable`),
      a `HostTable` (used, not owned), a JAX array (read on the device), or the path of a
      ``.npy`` file (read straight into a table, no second copy). One array or path is the
      features of a graph of one node type.
    embeddings: ``{node type: [N_t, d] array or an int d}``: learnable rows of a type without
      features, in host tables the loader owns (an int: drawn as `nnx.Embed` draws them, from
      `seed`). Train them with `update_embeddings`.
    labels: ``{node type: int [N_t]}`` (or one array for one node type); negative: no label.
    fanouts: in-edges drawn per node at each hop, hop 0 next to the seeds.
    cache: keep this fraction of each host feature table's rows (its most sampled nodes) in a
      device cache.
    cache_bytes: size the cache to at most this many device bytes instead
      (`budget_fraction`; `cache_fraction` says what it gave).
    pipeline: "host" (graph and host tables read zero-copy by the GPU) or "device" (graph and
      feature tables copied to the device: the all-in-GPU baseline; embeddings stay in host).
    norm: the blocks' edge norm ("mean": 1 / sampled in-edges of the same relation; "none").
    tree: sample tree-shaped neighbourhoods instead of blocks (a graph of one node type):
      every node of a hop gets its own neighbour slots in the next, with no deduplication, and
      a batch is a `TreeBatch` (for GraphSAGE-style models, which aggregate by a reshape).
      Feature rows are read once per distinct node of the batch all the same.
    seed: the seed of int-given embeddings.

  The loader owns the tables it made: `close()` it, or use it as a context manager.

  Example:
    >>> edges = {("user", "follows", "user"): ([0, 1, 2, 3], [1, 2, 3, 0])}
    >>> loader = Loader(edges, num_nodes={"user": 4}, features=np.eye(4, dtype=np.float32),
    ...                 labels=np.array([0, 1, 1, 0]), fanouts=(2, 2))
    >>> batches = loader.batches(np.arange(4), batch_size=3, seed=1)
    >>> [batch.mask.tolist() for batch in batches]  # the second batch is padded
    [[True, True, True], [True, False, False]]
    >>> batches.get_state()
    {'epoch': 1, 'index': 0, 'seed': 1}
    >>> loader.close()
  """

  def __init__(
    self,
    graph: HeteroGraph | HostGraph | Mapping,
    *,
    fanouts: Sequence[int],
    num_nodes: Mapping[str, int] | None = None,
    features: Mapping[str, Any] | Any = None,
    embeddings: Mapping[str, Any] | None = None,
    labels: Mapping[str, Any] | Any = None,
    cache: float = 0.0,
    cache_bytes: int | None = None,
    pipeline: str = "host",
    norm: str = "mean",
    add_inverse: bool = True,
    tree: bool = False,
    seed: int = 0,
  ):
    if pipeline not in ("host", "device"):
      raise ValueError(f"Loader: pipeline must be 'host' or 'device', got {pipeline!r}")
    if not 0 <= cache <= 1:
      raise ValueError(f"Loader: cache must be a fraction in [0, 1], got {cache}")
    if (cache or cache_bytes is not None) and pipeline == "device":
      raise ValueError("Loader: a device cache is for the host pipeline (the device one has all)")
    if cache and cache_bytes is not None:
      raise ValueError("Loader: give cache or cache_bytes, not both (cache_bytes sizes the cache)")
    self._owned: list[Any] = []
    try:
      host = self._build(
        graph, num_nodes, add_inverse, features, embeddings, labels, fanouts, norm, seed, tree
      )
      featured = [
        t if isinstance(t, HostTable) and i not in self._meta.embedded else None
        for i, t in enumerate(self.tables)
      ]
      if cache_bytes is not None:
        cache = budget_fraction(featured, cache_bytes)
      self.caches = tuple(type_caches(host, featured, self._meta.offsets, cache)) if cache else None
      self.cache_fraction = float(cache)
      if pipeline == "device":
        self.graph = DeviceGraph.from_host(host)
        self.tables = tuple(
          t if i in self._meta.embedded or not isinstance(t, HostTable) else _on_device(t)
          for i, t in enumerate(self.tables)
        )
    except BaseException:
      self.close()
      raise

  @classmethod
  def from_data(cls, data: HeteroData, fanouts: Sequence[int], **kwargs: Any) -> Loader:
    """A loader over a `jaxdata.data.HeteroData`: its graph (with reverse edges unless
    ``add_inverse=False``), its features and labels by node type (`kwargs`: the other
    arguments, such as ``embeddings`` for types without features)."""
    kwargs.setdefault("features", data.x_dict)
    kwargs.setdefault("labels", data.y_dict)
    graph = data.graph(add_inverse=kwargs.pop("add_inverse", True))
    return cls(graph, fanouts=fanouts, num_nodes=data.num_nodes, **kwargs)

  def _build(
    self, graph, num_nodes, add_inverse, features, embeddings, labels, fanouts, norm, seed, tree
  ) -> HostGraph:
    """Sets the graph, tables, labels and description; returns the HostGraph sampled from."""
    if isinstance(graph, Mapping):
      if num_nodes is None:
        raise ValueError("Loader: a graph given as an edge dict needs num_nodes={type: count}")
      graph = HeteroGraph.from_typed_edges(graph, num_nodes, add_inverse=add_inverse)
    if isinstance(graph, HeteroGraph):
      names = graph.node_type_names
      offsets = (
        (0, graph.num_nodes)
        if graph.node_type_offsets is None
        else tuple(int(o) for o in graph.node_type_offsets)
      )
      host = HostGraph.from_hetero(graph)
      self._owned.append(host)
      num_relations = max(graph.num_relations, 1)
    elif isinstance(graph, HostGraph):
      names, offsets, host = ("node",), (0, graph.num_nodes), graph
      num_relations = graph.num_relations or 1
    else:
      raise TypeError(
        "Loader: graph must be a HeteroGraph, an edge dict or a HostGraph, "
        f"got {type(graph).__name__}"
      )
    self.graph = host
    sizes = {n: offsets[t + 1] - offsets[t] for t, n in enumerate(names)}

    def per_type(value, what) -> dict:
      if value is None:
        return {}
      if not isinstance(value, Mapping):
        if len(names) != 1:
          raise ValueError(
            f"Loader: {what} of a graph of {len(names)} node types is a dict by type"
          )
        value = {names[0]: value}
      unknown = sorted(set(value) - set(names))
      if unknown:
        raise ValueError(
          f"Loader: {what} names node types {unknown}; the graph's are {list(names)}"
        )
      return dict(value)

    features, embeddings, labels = (
      per_type(features, "features"),
      per_type(embeddings, "embeddings"),
      per_type(labels, "labels"),
    )
    both = sorted(set(features) & set(embeddings))
    if both:
      raise ValueError(f"Loader: node types {both} have both features and embeddings")
    drawn = [n for n in names if isinstance(embeddings.get(n), (int, np.integer))]
    for n, x in zip(
      drawn,
      initial_embeddings([sizes[n] for n in drawn], [int(embeddings[n]) for n in drawn], seed),
    ):
      embeddings[n] = x
    tables = []
    for n in names:
      if n in embeddings:
        table = self._own(HostTable(np.ascontiguousarray(embeddings[n], np.float32)))
      elif n in features:
        table = self._table(features[n], n)
      else:  # a type without inputs: a zero-width table (its slots read nothing)
        table = jnp.zeros((sizes[n], 0), jnp.float32)
      if table.shape[0] != sizes[n]:
        raise ValueError(
          f"Loader: the {'embeddings' if n in embeddings else 'features'} of node type {n!r} "
          f"have {table.shape[0]} rows, the type has {sizes[n]} nodes"
        )
      tables.append(table)
    self.tables = tuple(tables)
    label_array = np.full(offsets[-1], -1, np.int32)
    for n, y in labels.items():
      y = np.asarray(y)
      if not np.issubdtype(y.dtype, np.integer) or y.shape != (sizes[n],):
        raise ValueError(
          f"Loader: the labels of node type {n!r} must be {sizes[n]} ints, got {y.dtype} {y.shape}"
        )
      t = names.index(n)
      label_array[offsets[t] : offsets[t + 1]] = y
    self.labels = jnp.asarray(label_array)
    fanouts = tuple(fanouts)
    if not fanouts:
      raise ValueError("Loader: fanouts must name at least one hop")
    if tree and len(names) != 1:
      raise ValueError(
        f"Loader: tree=True samples a graph of one node type, this one has {len(names)} "
        f"({list(names)}); blocks (tree=False) carry node types"
      )
    self._meta = _Meta(
      tuple(names),
      tuple(offsets),
      int(num_relations),
      fanouts,
      tuple(names.index(n) for n in embeddings),
      norm,
      bool(tree),
    )
    return host

  def _own(self, table: HostTable) -> HostTable:
    self._owned.append(table)
    return table

  def _table(self, value, name: str):
    if isinstance(value, (HostTable, jax.Array)):
      table = value
    elif isinstance(value, (str, os.PathLike)):
      table = self._own(HostTable.from_npy(value))
    else:
      table = self._own(HostTable(np.asarray(value)))
    if len(table.shape) != 2:
      raise ValueError(f"Loader: the features of node type {name!r} must be 2-D, got {table.shape}")
    return table

  # -- what the loader is ----------------------------------------------------------------------

  @property
  def node_types(self) -> tuple[str, ...]:
    """The node types' names, in the order of `Batch.inputs`."""
    return self._meta.names

  @property
  def type_offsets(self) -> tuple[int, ...]:
    """Node type t owns global ids ``[type_offsets[t], type_offsets[t + 1])``."""
    return self._meta.offsets

  @property
  def num_relations(self) -> int:
    return self._meta.num_relations

  @property
  def fanouts(self) -> tuple[int, ...]:
    return self._meta.fanouts

  @property
  def tree(self) -> bool:
    """Whether batches are tree-shaped (`TreeBatch`) rather than blocks (`Batch`)."""
    return self._meta.tree

  @property
  def embedded(self) -> tuple[int, ...]:
    """The node types (indices) whose inputs are learnable embeddings."""
    return self._meta.embedded

  @property
  def cache_nbytes(self) -> int:
    """Device bytes of the feature caches."""
    return sum(c.nbytes for c in self.caches or () if c is not None)

  @property
  def num_nodes(self) -> int:
    return self._meta.offsets[-1]

  def global_ids(self, seeds: Mapping[str, Any] | Any) -> np.ndarray:
    """int64 global ids of ``{node type: local ids}`` (types in the loader's order), or
    `seeds` itself when it is an array of global ids."""
    if not isinstance(seeds, Mapping):
      return np.asarray(seeds, np.int64)
    out = []
    for t, n in enumerate(self.node_types):
      if n in seeds:
        ids = np.asarray(seeds[n], np.int64)
        size = self.type_offsets[t + 1] - self.type_offsets[t]
        if ids.size and (ids.min() < 0 or ids.max() >= size):
          raise ValueError(f"Loader: seeds of node type {n!r} must lie in [0, {size})")
        out.append(ids + self.type_offsets[t])
    unknown = sorted(set(seeds) - set(self.node_types))
    if unknown:
      raise ValueError(
        f"Loader: seeds name node types {unknown}; the graph's are {list(self.node_types)}"
      )
    return np.concatenate(out) if out else np.zeros(0, np.int64)

  # -- in the jitted step ----------------------------------------------------------------------

  def sample(self, seeds: Any, key: jax.Array) -> Batch | TreeBatch:
    """The batch of `seeds` (1-D global ids, negative: padding): sampled blocks (a tree with
    ``tree=True``), every type's inputs gathered. Call it inside your jitted step with the
    loader as an argument."""
    return self.complete(self.prepare(seeds, key))

  def prepare(self, seeds: Any, key: jax.Array) -> Batch | TreeBatch:
    """`sample` without the embedded types' inputs (None): what may be computed ahead of the
    steps that update the embeddings, which read them at `complete`."""
    m = self._meta
    if m.tree:
      with jax.named_scope("sampling"):
        tree = sample_neighbors(self.graph, seeds, m.fanouts, key)
      seeds = tree.nodes[0]
      y = self.labels[jnp.maximum(seeds, 0)]
      inputs = None if m.embedded else self._gather_tree(tree)
      return TreeBatch(seeds, jnp.maximum(y, 0), tree.masks[0] & (y >= 0), tree, inputs)
    blocks = sample_blocks(
      self.graph, seeds, m.fanouts, key, num_relations=m.num_relations, norm=m.norm
    )
    inputs = self._gather(blocks, [t for t in range(len(m.names)) if t not in m.embedded])
    seeds = blocks.nodes[0][: jnp.shape(seeds)[0]]
    y = self.labels[jnp.maximum(seeds, 0)]
    mask = (seeds >= 0) & (y >= 0) & blocks.masks[0][: seeds.shape[0]]
    types = node_types(m.offsets, blocks.nodes[-1])
    return Batch(seeds, jnp.maximum(y, 0), mask, blocks, types, tuple(inputs))

  def complete(self, batch: Batch | TreeBatch) -> Batch | TreeBatch:
    """`batch` with the embedded types' inputs gathered now (as the tables are now)."""
    if isinstance(batch, TreeBatch):
      inputs = batch.inputs if batch.inputs is not None else self._gather_tree(batch.blocks)
      return dataclasses.replace(batch, inputs=inputs)
    learned = self._gather(batch.blocks, self._meta.embedded)
    inputs = tuple(x if x is not None else y for x, y in zip(batch.inputs, learned))
    return dataclasses.replace(batch, inputs=inputs)

  def _gather(self, blocks: RelationalBlocks, types: Sequence[int]) -> list:
    o, caches = self._meta.offsets, self.caches or (None,) * len(self.tables)
    return [
      gather_typed([self.tables[t]], o[t : t + 2], blocks.nodes[-1], blocks.masks[-1], [caches[t]])[
        0
      ]
      if t in types
      else None
      for t in range(len(self.tables))
    ]

  def _gather_tree(self, tree: Blocks) -> tuple[jax.Array, ...]:
    """The one type's rows for every hop of `tree` (zeros in padding)."""
    table, cache = self.tables[0], (self.caches or (None,))[0]
    with jax.named_scope("gathers"):
      if isinstance(table, HostTable):
        return tree.gather(table, unique=True, cache=cache)
      return tuple(
        jnp.where(m[:, None], jnp.take(table, jnp.maximum(n, 0), axis=0), 0)
        for n, m in zip(tree.nodes, tree.masks)
      )

  def embedding_ids(self, batch: Batch | TreeBatch) -> list[jax.Array]:
    """Per embedded type, each outermost slot's row of its table (the table's row count, out of
    range, for other slots: a scatter drops them); for a `TreeBatch`, every hop's slots, hop
    after hop."""
    if isinstance(batch, TreeBatch):
      rows = self.num_nodes
      ids = [jnp.where(m, n, rows) for n, m in zip(batch.blocks.nodes, batch.blocks.masks)]
      return [jnp.concatenate(ids)] if self._meta.embedded else []
    out = []
    nodes, mask = batch.blocks.nodes[-1], batch.blocks.masks[-1]
    for t in self._meta.embedded:
      lo, hi = self._meta.offsets[t], self._meta.offsets[t + 1]
      out.append(jnp.where(mask & (nodes >= lo) & (nodes < hi), nodes - lo, hi - lo))
    return out

  def init_embeddings(self, optimizer) -> list:
    """The states of a `jaxdata.host.sparse` optimizer for every embedding table."""
    return [optimizer.init(self.tables[t]) for t in self._meta.embedded]

  def update_embeddings(
    self, optimizer, states, batch: Batch, grads: Sequence, **kwargs
  ) -> jax.Array:
    """Applies `optimizer` (a `jaxdata.host.sparse` optimizer) to every embedding table from
    `grads`, one ``[slots, d]`` gradient per embedded type (of ``batch.inputs[t]``, in
    `embedded` order; for a `TreeBatch`, the gradients of ``batch.inputs``, a tuple per hop).
    Returns the summed update tokens (0 once written; `host.sparse`); `kwargs` go to
    ``optimizer.update`` (``axis_name``, ``copies``)."""
    token = jnp.int32(0)
    for t, state, ids, g in zip(self._meta.embedded, states, self.embedding_ids(batch), grads):
      g = jnp.concatenate(g) if isinstance(g, (tuple, list)) else g
      token = token + optimizer.update(self.tables[t], state, ids, g, **kwargs)
    return token

  # -- as an iterator --------------------------------------------------------------------------

  def batches(
    self,
    seeds: Mapping[str, Any] | Any,
    batch_size: int,
    *,
    seed: int = 0,
    shuffle: bool = True,
    drop_last: bool = False,
    num_epochs: int | None = 1,
    prefetch: int = 2,
    mesh: jax.sharding.Mesh | None = None,
  ) -> BatchIterator:
    """An iterator over `num_epochs` epochs (None: no end) of `prepare`d batches of `seeds`
    (global ids, or ``{node type: local ids}``), shuffled per epoch from `seed`; the last
    batch of an epoch is padded with -1 seeds, or dropped (`drop_last`). `prefetch` batches
    are dispatched ahead (JAX runs them while you compute). With learnable embeddings, call
    `complete` on a batch inside your step.

    Data parallel: with a `mesh`, a batch holds `batch_size` seeds per device of the mesh's
    first axis; device d samples its share with key ``fold_in(key, d)``, and every array of
    the batch is its devices' batches laid end to end along that axis (sharded over it): run
    your step under `jax.shard_map` with ``P(axis)`` for the batch (a `ShardedBatch`: its
    `batch` is the device's `Batch` there) and each device sees a batch of `batch_size`
    seeds. Every process of a multi-process job iterates alike (the same seeds and `seed`)
    and places its own devices' shares."""
    return BatchIterator(
      self,
      self.global_ids(seeds),
      batch_size,
      seed,
      shuffle,
      drop_last,
      num_epochs,
      prefetch,
      mesh,
    )

  # -- ownership -------------------------------------------------------------------------------

  def close(self) -> None:
    """Frees the host tables and graph the loader made (not those it was given)."""
    for x in getattr(self, "_owned", ()):
      x.close()
    self._owned = []

  def __enter__(self) -> Loader:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def __repr__(self) -> str:
    m = self._meta
    return (
      f"Loader({self.num_nodes} nodes of types {list(m.names)}, {m.num_relations} relations, "
      f"fanouts {list(m.fanouts)}, embedded {[m.names[t] for t in m.embedded]}"
      + (", tree)" if m.tree else ")")
    )


def _on_device(table: HostTable) -> jax.Array:
  """A host table's rows copied to the default device. A CPU device may alias a NumPy array's
  memory, and a table's is freed when it closes: there, a copy first. `jax.device_put`, not
  `jnp.asarray`: JAX stages a NumPy array through a jitted identity (`lax.stage`), whose output
  is a second device copy (papers100M's 53 GiB of features did not fit twice on an H200)."""
  rows = table.as_numpy()
  return jax.device_put(np.array(rows) if jax.default_backend() == "cpu" else rows)


def _flatten(loader: Loader):
  return (loader.graph, loader.tables, loader.caches, loader.labels), loader._meta


def _unflatten(meta: _Meta, children) -> Loader:
  """A view of a loader's arrays and tables that owns none of them (inside jit: placeholders)."""
  loader = Loader.__new__(Loader)
  loader._owned = []
  loader.graph, loader.tables, loader.caches, loader.labels = children
  loader._meta = meta
  return loader


jax.tree_util.register_pytree_node(Loader, _flatten, _unflatten)


class ShardedBatch:
  """The batches of a mesh's devices (`Loader.batches` with a mesh), as one pytree whose leaves
  are the devices' `Batch` leaves laid end to end along the mesh axis. Inside `jax.shard_map`
  (``P(axis)``), `batch` is the device's own `Batch`."""

  def __init__(self, treedef, leaves):
    self.treedef, self.leaves = treedef, list(leaves)

  @property
  def batch(self) -> Batch:
    return jax.tree.unflatten(self.treedef, self.leaves)


jax.tree_util.register_pytree_node(
  ShardedBatch, lambda b: (b.leaves, b.treedef), lambda t, leaves: ShardedBatch(t, leaves)
)


class BatchIterator(Iterator[Batch]):
  """`Loader.batches`: prepared batches of shuffled seeds, epoch after epoch.

  Batch i of epoch e holds the seeds ``permutation(seed, e)[i * B : (i + 1) * B]`` and is
  sampled with key ``fold_in(fold_in(key(seed), e), i)``: the sequence depends on `seed` only.
  `get_state()` says where the iterator stands (the next batch it yields); `set_state` puts an
  iterator there, so a run restored from a checkpoint sees the batches it would have seen.
  """

  def __init__(
    self, loader, seeds, batch_size, seed, shuffle, drop_last, num_epochs, prefetch, mesh=None
  ):
    if (
      isinstance(batch_size, bool)
      or not isinstance(batch_size, (int, np.integer))
      or batch_size < 1
    ):
      raise ValueError(f"Loader.batches: batch_size must be a positive int, got {batch_size!r}")
    if seeds.ndim != 1 or not len(seeds):
      raise ValueError("Loader.batches: give at least one seed (a 1-D array of ids)")

    self.loader, self.seeds = loader, seeds
    self.batch_size = int(batch_size) * (1 if mesh is None else mesh.shape[mesh.axis_names[0]])
    self.seed, self.shuffle, self.drop_last = int(seed), bool(shuffle), bool(drop_last)
    self.num_epochs, self.prefetch = num_epochs, max(int(prefetch), 0)
    if drop_last and len(seeds) < self.batch_size:
      raise ValueError(
        f"Loader.batches: {len(seeds)} seeds make no full batch of {self.batch_size}"
      )
    self._key = jax.random.key(self.seed)
    self._place = lambda seeds, key: (seeds, key)  # noqa: E731
    self._prepare = jax.jit(Loader.prepare)
    if mesh is not None:
      axis = mesh.axis_names[0]
      sharding = jax.sharding.NamedSharding
      whole, split = sharding(mesh, P()), sharding(mesh, P(axis))

      def per_device(loader, seeds, key):
        batch = loader.prepare(seeds, jax.random.fold_in(key, jax.lax.axis_index(axis)))
        return ShardedBatch(*jax.tree.flatten(batch)[::-1])

      body = jax.shard_map(
        per_device, mesh=mesh, in_specs=(P(), P(axis), P()), out_specs=P(axis), check_vma=False
      )
      self.loader = placement.put(loader, whole)
      self._prepare = jax.jit(body)
      self._place = lambda seeds, key: (  # noqa: E731
        placement.put(seeds, split),
        placement.put(key, whole),
      )
    self._epoch, self._index = 0, 0
    self._ahead: collections.deque = collections.deque()  # ((epoch, index), batch)
    self._order: tuple[int, np.ndarray] | None = None

  def __len__(self) -> int:
    """Batches per epoch."""
    n = len(self.seeds)
    return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

  @property
  def epoch(self) -> int:
    """The epoch of the next batch (0-based)."""
    return self._epoch

  def get_state(self) -> dict:
    """Where the iterator stands: ``{"epoch", "index", "seed"}`` (JSON-serialisable)."""
    return {"epoch": self._epoch, "index": self._index, "seed": self.seed}

  def set_state(self, state: Mapping) -> None:
    """Continues from `state` (`get_state` of an iterator over the same seeds and seed)."""
    if int(state["seed"]) != self.seed:
      raise ValueError(
        f"BatchIterator.set_state: the state is for seed {state['seed']}, not {self.seed}"
      )
    epoch, index = int(state["epoch"]), int(state["index"])
    if epoch < 0 or not 0 <= index <= len(self):
      raise ValueError(f"BatchIterator.set_state: no batch {index} of epoch {epoch}")
    self._epoch, self._index = epoch, index
    self._ahead.clear()

  def _seeds_of(self, epoch: int, index: int) -> np.ndarray:
    if self._order is None or self._order[0] != epoch:
      rng = np.random.default_rng([self.seed, epoch])
      self._order = (epoch, rng.permutation(self.seeds) if self.shuffle else self.seeds)
    part = self._order[1][index * self.batch_size : (index + 1) * self.batch_size]
    out = np.full(self.batch_size, -1, np.int32)
    out[: len(part)] = part
    return out

  def _position(self, ahead: int) -> tuple[int, int] | None:
    epoch, index = self._epoch, self._index + ahead
    per_epoch = len(self)
    epoch, index = epoch + index // per_epoch, index % per_epoch
    if self.num_epochs is not None and epoch >= self.num_epochs:
      return None
    return epoch, index

  def __next__(self) -> Batch:
    if self._position(0) is None:
      raise StopIteration
    # keep `prefetch` batches dispatched beyond the one returned now
    while len(self._ahead) <= self.prefetch:
      pos = self._position(len(self._ahead))
      if pos is None:
        break
      key = jax.random.fold_in(jax.random.fold_in(self._key, pos[0]), pos[1])
      batch = self._prepare(self.loader, *self._place(self._seeds_of(*pos), key))
      self._ahead.append((pos, batch))
    pos, batch = self._ahead.popleft()
    self._epoch, self._index = self._position(1) or (pos[0] + 1, 0)
    return batch


#: Embedding rows drawn per chunk by `initial_embeddings` (each chunk its own generator).
EMBED_CHUNK = 1 << 16


def initial_embeddings(
  rows: Sequence[int], dim: int | Sequence[int], seed: int, threads: int | None = None
) -> list[np.ndarray]:
  """float32 [rows_i, dim_i] tables of N(0, 1 / dim_i) entries, the distribution of `nnx.Embed`'s
  default init, drawn in host memory (NumPy, chunk by chunk on a thread pool; the values
  depend on `seed` only): mini-batch training's embedding tables never exist on the device."""
  dims = [int(dim)] * len(rows) if isinstance(dim, (int, np.integer)) else [int(d) for d in dim]
  seeds = np.random.SeedSequence([seed, 0x7AB1E5]).spawn(len(rows))
  out = [np.empty((n, d), np.float32) for n, d in zip(rows, dims)]

  def fill(x, part, ss):
    np.random.default_rng(ss).standard_normal(out=x[part], dtype=np.float32)
    x[part] *= np.float32(1 / np.sqrt(x.shape[1]))

  with ThreadPoolExecutor(threads or os.cpu_count() or 1) as pool:
    jobs = [
      pool.submit(fill, x, slice(a, a + EMBED_CHUNK), ss)
      for x, table_seed in zip(out, seeds)
      for a, ss in zip(range(0, len(x), EMBED_CHUNK), table_seed.spawn(-(-len(x) // EMBED_CHUNK)))
    ]
    for job in jobs:
      job.result()
  return out
