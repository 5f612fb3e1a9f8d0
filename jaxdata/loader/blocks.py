"""sample_blocks: a mini-batch of a relational GNN, sampled from a typed graph in host memory.

One call, inside the jitted step, samples L hops outward from the seeds and returns the blocks
hector's layers run on (`jaxdata.hector.block`): hop h draws up to ``fanouts[h]`` in-edges of
every node of the frontier U_h (zero-copy from the pinned `HostGraph` on a GPU, on XLA's thread
pool on the CPU; the same sample for the same key), and U_{h+1} is U_h followed by the new nodes.
Every node of a frontier is sampled once, so a fanout at least as large as every in-degree
gives each destination all its in-edges, and the mini-batch computes exactly what the full
graph computes at the seeds.

    blocks = sample_blocks(graph, seeds, (10, 10), key)   # graph: HostGraph with etypes
    x = features_of(blocks.nodes[-1])                      # rows of U_L
    h = layer1(blocks.graphs[1], x)[:len(blocks.nodes[1])]
    out = layer2(blocks.graphs[0], h)[:len(blocks.nodes[0])]   # rows of the seeds
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdata.hector.block import block_graph, capacities, expand, frontier
from jaxdata.hector.runtime import GraphArrays
from jaxdata.host.cache import DeviceCache
from jaxdata.host.gather import host_gather
from jaxdata.host.graph import HostGraph
from jaxdata.host.sample import DeviceGraph, check_fanouts, check_seeds, sample_neighbors
from jaxdata.host.table import HostTable


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RelationalBlocks:
  """The sampled neighbourhood of a batch of seeds as hector blocks, in fixed shapes.

  Attributes:
    nodes: U_0 ... U_L: int32 global node ids, -1 in unused slots; U_0 holds the seeds (a
      repeated seed only once, in its first slot) and U_{h+1} starts with U_h.
    masks: bool, which slots hold a node.
    graphs: block h (a `GraphArrays` over the slots of U_{h+1}, its edges into the slots of
      U_h), for h = 0 ... L - 1: the model's first layer runs on ``graphs[-1]``.
  """

  nodes: tuple[jax.Array, ...]
  masks: tuple[jax.Array, ...]
  graphs: tuple[GraphArrays, ...]

  @property
  def num_hops(self) -> int:
    return len(self.graphs)


def sample_blocks(
  graph: HostGraph | DeviceGraph,
  seeds: Any,
  fanouts: Sequence[int],
  key: jax.Array,
  *,
  num_relations: int | None = None,
  norm: str = "mean",
) -> RelationalBlocks:
  """Samples `len(fanouts)` hops of in-edges (with their relations) around `seeds`.

  Args:
    graph: a `HostGraph` or `DeviceGraph` with per-edge relations (`etypes`).
    seeds: 1-D integer node ids of any integer dtype; negative ids are padding. A seed >=
      num_nodes is an error when `seeds` is concrete, padding under `jit` (checked in the dtype
      given, so an int64 id past int32 never wraps into another node).
    fanouts: in-edges drawn per node at each hop (positive ints), hop 0 next to the seeds.
    key: a JAX PRNG key; hop h uses ``fold_in(key, h)``.
    num_relations: the relations of the blocks, an int (default: the HostGraph's, and not
      fewer; needed for a DeviceGraph, which does not record it).
    norm: the blocks' edge norm ("mean": 1 / sampled in-edges of the same relation; "none").

  Returns:
    `RelationalBlocks`.
  """
  if not isinstance(graph, (HostGraph, DeviceGraph)):
    raise TypeError(
      f"sample_blocks: graph must be a HostGraph or DeviceGraph, got {type(graph).__name__}"
    )
  typed = getattr(graph, "etypes", None) is not None  # untyped: every edge has relation 0
  seeds = check_seeds(seeds, graph.num_nodes, "sample_blocks")
  hops = check_fanouts(fanouts, "sample_blocks", lambda f: list(capacities(seeds.shape[0], f)))
  if num_relations is None and not typed:
    num_relations = 1
  if num_relations is None:
    if not isinstance(graph, HostGraph):
      raise ValueError("sample_blocks: pass num_relations= for a DeviceGraph")
    num_relations = graph.num_relations
    assert num_relations is not None  # the graph has etypes: checked above
    if num_relations == 0:
      raise ValueError(
        "sample_blocks: the graph has no relations (and no edges); a block needs one: "
        "pass num_relations=1"
      )
  if isinstance(num_relations, (bool, np.bool_)) or not isinstance(
    num_relations, (int, np.integer)
  ):
    raise TypeError(f"sample_blocks: num_relations must be an int, got {num_relations!r}")
  num_relations = int(num_relations)
  known = graph.num_relations if isinstance(graph, HostGraph) else None
  if num_relations < 1 or (known is not None and num_relations < known):
    # fewer relations than the graph's would drop the edges of the others from the blocks
    raise ValueError(
      "sample_blocks: num_relations must be >= 1"
      + (f" and >= the graph's {known}" if known is not None else "")
      + f", got {num_relations}"
    )
  # Ids outside the graph are padding: mapped to -1 in the caller's dtype, before the int32 of
  # the blocks (a cast first would wrap 2**32 + 1 to node 1).
  seeds = jnp.where((seeds >= 0) & (seeds < graph.num_nodes), seeds, -1).astype(jnp.int32)
  nodes, mask = frontier(seeds)
  all_nodes, all_masks, graphs = [nodes], [mask], []
  # Named scopes: the parts of a step's device time (`jaxdata bench hetero --breakdown`).
  for hop, fanout in enumerate(hops):
    with jax.named_scope("sampling"):
      drawn = sample_neighbors(
        graph, jnp.where(mask, nodes, -1), (fanout,), jax.random.fold_in(key, hop)
      )
    shape = (nodes.shape[0], fanout)
    etypes = jnp.where(drawn.masks[1], 0, -1).astype(jnp.int32)
    if drawn.etypes is not None:
      etypes = drawn.etypes[1]
    with jax.named_scope("deduplication"):
      nodes, mask, edges = expand(
        nodes,
        mask,
        drawn.nodes[1].reshape(shape),
        drawn.masks[1].reshape(shape),
        etypes.reshape(shape),
      )
    with jax.named_scope("blocks"):
      graphs.append(
        block_graph(*edges, num_nodes=nodes.shape[0], num_relations=num_relations, norm=norm)
      )
    all_nodes.append(nodes)
    all_masks.append(mask)
  return RelationalBlocks(tuple(all_nodes), tuple(all_masks), tuple(graphs))


def gather_typed(
  tables: Sequence[HostTable | jax.Array],
  type_offsets: Sequence[int],
  nodes: jax.Array,
  mask: jax.Array,
  caches: Sequence[DeviceCache | None] | None = None,
) -> list[jax.Array]:
  """The rows of each node type's table for the slots of one frontier.

  Node type t owns the global ids ``[type_offsets[t], type_offsets[t + 1])`` and its rows are
  ``tables[t]`` (a `HostTable`, read with `host_gather`, or a device array). Returns one array
  per type, ``[len(nodes), d_t]``: a slot's row in its own type's array, zeros elsewhere and in
  unused slots; nothing is read for those. With `caches` (`type_caches`), a row that type t's
  `DeviceCache` holds comes from device memory and only the others are read from the host.
  """
  offsets = _type_offsets(type_offsets, "gather_typed")
  if len(offsets) != len(tables) + 1:
    raise ValueError(
      f"gather_typed: {len(tables)} tables need {len(tables) + 1} type offsets, got {len(offsets)}"
    )
  caches = [None] * len(tables) if caches is None else list(caches)
  if len(caches) != len(tables):
    raise ValueError(f"gather_typed: {len(caches)} caches for {len(tables)} tables")
  out = []
  for t, (table, cache) in enumerate(zip(tables, caches)):
    rows = offsets[t + 1] - offsets[t]
    if table.shape[0] != rows:
      raise ValueError(
        f"gather_typed: the table of node type {t} has {table.shape[0]} rows, "
        f"the type has {rows} nodes"
      )
    if cache is not None and cache.slots.shape[0] != rows:
      raise ValueError(
        f"gather_typed: the cache of node type {t} was built for "
        f"{cache.slots.shape[0]} rows, the type has {rows} nodes"
      )
    with jax.named_scope("gathers"):  # a part of the step's device time (bench --breakdown)
      mine = mask & (nodes >= offsets[t]) & (nodes < offsets[t + 1])
      local = jnp.where(mine, nodes - offsets[t], rows)  # rows: out of range, filled, not read
      if cache is not None:
        slot = cache.lookup(local, mine)
        local = jnp.where(slot >= 0, rows, local)  # a hit: nothing to read from the host
      if isinstance(table, HostTable):
        x = host_gather(table, local, mode="fill", fill_value=0)
      else:
        x = jnp.take(table, local, axis=0, mode="fill", fill_value=0)
      out.append(x if cache is None else cache.fill(slot, x))
  return out


def type_caches(
  graph: HostGraph, tables: Sequence[HostTable | None], type_offsets: Sequence[int], fraction: float
) -> list[DeviceCache | None]:
  """A `DeviceCache` per node type: `fraction` of each type's rows, those of its nodes with the
  most out-edges in `graph` (the most often sampled). None where `tables[t]` is None (a table
  that changes during training, such as a learnable embedding, must not be cached) and for a
  type without nodes."""
  offsets = _type_offsets(type_offsets, "type_caches")
  counts = DeviceCache.sampling_counts(graph)
  return [
    None
    if table is None or offsets[t + 1] == offsets[t]
    else DeviceCache.from_counts(
      counts[offsets[t] : offsets[t + 1]], table, fraction=fraction, what="type_caches"
    )
    for t, table in enumerate(tables)
  ]


def budget_fraction(tables: Sequence[HostTable | None], budget: int) -> float:
  """The largest share of every table's rows whose `type_caches` fit in `budget` bytes: a
  cache of table t holds ``fraction * rows_t`` rows plus an int32 slot per table row. 0.0 when
  not even the slots fit (no cache), at most 1.0. Tables that are None are not cached."""
  tables = [t for t in tables if t is not None and t.shape[0]]
  slots = sum(4 * t.shape[0] for t in tables)
  rows = sum(t.shape[0] * int(np.prod(t.shape[1:])) * np.dtype(t.dtype).itemsize for t in tables)
  if budget <= slots or not rows:
    return 0.0
  # capacity rounds to the nearest row (DeviceCache.from_counts): stay a row below per table
  spare = (
    budget - slots - sum(int(np.prod(t.shape[1:])) * np.dtype(t.dtype).itemsize for t in tables)
  )
  return float(min(1.0, max(0.0, spare / rows)))


def node_types(type_offsets: Sequence[int], nodes: jax.Array) -> jax.Array:
  """int32: the node type of each slot's node (-1 for unused slots, negative ids)."""
  bounds = jnp.asarray(np.asarray(_type_offsets(type_offsets, "node_types")[1:-1], np.int32))
  # a comparison per type boundary (few), not searchsorted's loop
  below = (nodes[:, None] >= bounds[None, :]).sum(axis=1, dtype=jnp.int32)
  return jnp.where(nodes >= 0, below, -1).astype(jnp.int32)


def _type_offsets(type_offsets: Sequence[int], what: str) -> tuple[int, ...]:
  """Node-type offsets as Python ints, non-decreasing and within int32 node ids (a run of
  consecutive types may start past 0); a float such as 2.5 is refused, not truncated into
  another type's range."""
  offsets = tuple(type_offsets)
  for o in offsets:
    if isinstance(o, (bool, np.bool_)) or not isinstance(o, (int, np.integer)):
      raise TypeError(f"{what}: type_offsets must be ints, got {o!r} in {offsets!r}")
  ints = tuple(int(o) for o in offsets)
  if (
    not ints
    or ints[0] < 0
    or any(b < a for a, b in zip(ints, ints[1:]))
    or ints[-1] > np.iinfo(np.int32).max
  ):
    raise ValueError(
      f"{what}: type_offsets must rise from >= 0 to at most 2**31 - 1, got {list(ints)}"
    )
  return ints
