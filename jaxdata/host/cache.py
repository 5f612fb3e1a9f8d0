"""DeviceCache: the most-sampled rows of a host table, kept in device memory.

Neighbour sampling on a power-law graph does not read nodes evenly: a node turns up as a
sampled neighbour about as often as it appears in neighbour lists, i.e. in proportion to its
out-degree, so a small share of the nodes accounts for most of the rows a batch gathers. Keeping
those rows in device memory and reading only the rest over PCIe (the "GPU cache" of DGL's UVA
path, PaGraph and GNNLab) cuts the bytes a GPU-centric pipeline moves, for as much device
memory as one is willing to give.

    >>> cache = DeviceCache.build(graph, graph.features, fraction=0.2)   # top 20% by out-degree
    >>> feats = blocks.gather(graph.features, cache=cache)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxdata.host.graph import HostGraph
from jaxdata.host.table import HostTable


class DeviceCache(NamedTuple):
  """Rows of a host table held on the device, and where each table row sits among them.

  Attributes:
    slots: int32 [table rows]: the row of `rows` holding table row i, or -1 (not cached).
    rows: [capacity, columns] in the table's dtype.
  """

  slots: jax.Array
  rows: jax.Array

  @classmethod
  def build(
    cls,
    graph: HostGraph,
    table: HostTable,
    *,
    fraction: float | None = None,
    capacity: int | None = None,
    device: Any = None,
  ) -> DeviceCache:
    """Caches the rows of the nodes with the highest out-degree (most often sampled).

    Give the size as a `fraction` of the table's rows or as a row `capacity`.
    """
    if table.shape[0] != graph.num_nodes:
      raise ValueError(
        f"DeviceCache.build: the table has {table.shape[0]} rows, the graph {graph.num_nodes} nodes"
      )
    return cls.from_counts(
      cls.sampling_counts(graph),
      table,
      fraction=fraction,
      capacity=capacity,
      device=device,
      what="DeviceCache.build",
    )

  @staticmethod
  def sampling_counts(graph: HostGraph) -> np.ndarray:
    """How often neighbour sampling reads each node: its number of out-edges, i.e. its
    entries in the graph's neighbour lists."""
    return np.bincount(graph.indices.as_numpy()[: graph.num_edges, 0], minlength=graph.num_nodes)

  @classmethod
  def from_counts(
    cls,
    counts: Any,
    table: HostTable,
    *,
    fraction: float | None = None,
    capacity: int | None = None,
    device: Any = None,
    what: str = "DeviceCache.from_counts",
  ) -> DeviceCache:
    """Caches the rows with the highest `counts` (how often each row is expected to be read:
    a node's out-degree for neighbour sampling), `fraction` of the rows or `capacity` rows.

    For a typed graph, one cache per node type's table: `counts` are that type's nodes'
    out-degrees (`jaxdata.loader.blocks.type_caches` builds them all).
    """
    counts = np.asarray(counts)
    if (fraction is None) == (capacity is None):
      raise ValueError(f"{what}: give exactly one of fraction and capacity")
    if counts.shape != (table.shape[0],):
      raise ValueError(
        f"{what}: {counts.shape[0] if counts.ndim == 1 else counts.shape} "
        f"counts for a table of {table.shape[0]} rows"
      )
    if capacity is not None and (
      isinstance(capacity, (bool, np.bool_)) or not isinstance(capacity, (int, np.integer))
    ):
      raise TypeError(f"{what}: capacity must be an integer, got {capacity!r}")
    if fraction is not None:
      if not isinstance(fraction, (int, float, np.integer, np.floating)) or isinstance(
        fraction, (bool, np.bool_)
      ):
        raise TypeError(f"{what}: fraction must be a number, got {fraction!r}")
      if not 0 < fraction <= 1:
        raise ValueError(f"{what}: fraction must be in (0, 1], got {fraction}")
      capacity = max(1, int(round(fraction * len(counts))))
    assert capacity is not None  # given, or computed from the fraction just above
    if not 1 <= capacity <= len(counts):
      raise ValueError(f"{what}: capacity must be in [1, {len(counts)}], got {capacity}")
    chosen = (
      np.sort(np.argpartition(-counts, capacity - 1)[:capacity])
      if capacity < len(counts)
      else np.arange(len(counts))
    )
    slots = np.full(len(counts), -1, np.int32)
    slots[chosen] = np.arange(capacity, dtype=np.int32)
    rows = table.as_numpy()[chosen]  # a copy, ascending rows
    return cls(jax.device_put(slots, device), jax.device_put(rows, device))

  def lookup(self, rows: jax.Array, valid: jax.Array) -> jax.Array:
    """Where each of `rows` (table rows) sits in the cache: its row of `rows`, -1 where it is
    not cached or not `valid`."""
    n = self.slots.shape[0]
    return jnp.where(valid, jnp.take(self.slots, jnp.clip(rows, 0, n - 1)), -1)

  def fill(self, slots: jax.Array, read: jax.Array) -> jax.Array:
    """`read` (rows gathered elsewhere) with the rows whose `slots` (from `lookup`) hold one
    replaced by the cached row."""
    return jnp.where(
      (slots >= 0)[:, None], jnp.take(self.rows, jnp.maximum(slots, 0), axis=0), read
    )

  @property
  def capacity(self) -> int:
    return self.rows.shape[0]

  @property
  def nbytes(self) -> int:
    return self.rows.nbytes + self.slots.nbytes
