"""Destination partitions of a relational graph: full-graph training over several devices.

A graph too large for one device trains on K of them by splitting its *destinations*: part k
owns the contiguous node range ``[k * rows, (k + 1) * rows)`` and every edge into those nodes,
whatever its source. A layer on part k reads the rows of every node (each layer's input is
all-gathered over the devices) and writes the rows of the nodes it owns, so K parts together
compute exactly what one layer computes on the whole graph, and the next layer's input is again
the parts' outputs gathered in order.

Each part is a `GraphArrays` over the same padded node space of ``K * rows`` ids (global ids,
unchanged), with ``rows = ceil((N + 1) / K)`` so that its last id, ``K * rows - 1``, is never a
real node: it is the *padding node*. All parts have the same shapes, so their arrays stack along
a device axis and one jitted program runs on every device: the edges of a part are padded to the
largest part's count with edges from and to the padding node (relation 0, norm 0; they touch only
the padding node's row, which nothing reads), and its unique (source, relation) pairs to the
largest count with unused pairs (``(padding node, R)``: no edges, no relation, past
``pair_rel_offsets[R]``; `GraphArrays`). Norms are the whole graph's
(a part holds every in-edge of its destinations, so "mean" is the same either way).

    parts = partition(hetero_graph, 4)                 # host NumPy, stacked [4, ...] arrays
    arrays = jax.device_put(parts.arrays, NamedSharding(mesh, P("data")))
    def per_device(arrays, x_own):                     # inside shard_map over "data"
      graph = parts.local(arrays)                      # this device's GraphArrays
      x = jax.lax.all_gather(x_own, "data", tiled=True)   # [K * rows, d]: every source row
      start = jax.lax.axis_index("data") * parts.rows
      return jax.lax.dynamic_slice_in_dim(layer(graph, x), start, parts.rows)

What a device holds: its part's edges (about E / K, plus padding) with the node-indexed views
(``3 (K * rows + 1)`` int32 offsets), and, during a layer, the gathered input and the layer's
output over all ``K * rows`` rows (only its own rows of the output are non-zero).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxdata.data import HeteroGraph
from jaxdata.hector.runtime import _FIELDS, GraphArrays

#: GraphArrays' array fields, in their order (the keys of `Partitions.arrays`).
FIELDS = tuple(_FIELDS)


@dataclasses.dataclass(frozen=True)
class Partitions:
  """K destination parts of one graph, padded to equal shapes (see the module's docstring).

  Attributes:
    arrays: GraphArrays' field name -> NumPy ``[K, length]``: row k is part k's array. Shard
      them over a device axis (``P("data")``) and rebuild each device's graph with `local`.
    num_parts: K.
    rows: destination nodes each part owns (the last part's range includes the padding).
    num_nodes: N, the graph's real nodes; ids ``N .. K * rows - 1`` are padding rows.
    num_relations: R.
    node_type_offsets: the graph's node-type offsets with the last type stretched over the
      padding rows (None for one node type).
  """

  arrays: dict[str, np.ndarray]
  num_parts: int
  rows: int
  num_nodes: int
  num_relations: int
  node_type_offsets: tuple[int, ...] | None = None

  @property
  def padded_nodes(self) -> int:
    """``K * rows``: the rows of every part's node space (and of a gathered layer input)."""
    return self.num_parts * self.rows

  @property
  def padding_node(self) -> int:
    return self.padded_nodes - 1

  def owned(self, k: int) -> tuple[int, int]:
    """``(start, stop)``: the real destination nodes part k owns (may be empty)."""
    if not 0 <= k < self.num_parts:
      raise ValueError(f"Partitions.owned: part must be in [0, {self.num_parts}), got {k}")
    return min(k * self.rows, self.num_nodes), min((k + 1) * self.rows, self.num_nodes)

  def local(self, arrays: dict) -> GraphArrays:
    """One part's `GraphArrays` from its arrays: each ``[length]``, or ``[1, length]`` (a
    device's block of the stacked arrays inside `shard_map`). Works on tracers."""
    fields = {}
    for f in FIELDS:
      a = arrays[f]
      if a.ndim == 2:
        if a.shape[0] != 1:
          raise ValueError(
            f"Partitions.local: {f} must be one part's block [1, length], got shape {a.shape}"
          )
        a = a[0]
      fields[f] = a
    return GraphArrays(
      **fields,
      num_nodes=self.padded_nodes,
      num_relations=self.num_relations,
      node_type_offsets=self.node_type_offsets,
    )

  def graph(self, k: int) -> GraphArrays:
    """Part k's `GraphArrays` (NumPy arrays, validated), e.g. to run it outside a mesh."""
    if not 0 <= k < self.num_parts:
      raise ValueError(f"Partitions.graph: part must be in [0, {self.num_parts}), got {k}")
    return self.local({f: a[k] for f, a in self.arrays.items()})

  def pad_rows(self, x) -> np.ndarray:
    """`x` (``[N, ...]``, NumPy) with zero rows appended up to ``K * rows``: a layer input
    laid out as the parts' node space (e.g. input features)."""
    x = np.asarray(x)
    if x.shape[0] != self.num_nodes:
      raise ValueError(
        f"Partitions.pad_rows: x must have {self.num_nodes} rows (the graph's "
        f"nodes), got shape {x.shape}"
      )
    pad = np.zeros((self.padded_nodes - self.num_nodes,) + x.shape[1:], x.dtype)
    return np.concatenate([x, pad])

  def edges_per_part(self) -> int:
    """Edge slots per part (the largest part's edge count, plus padding room)."""
    return self.arrays["src"].shape[1]

  def all_gather_bytes(self, widths, itemsize: int = 4) -> int:
    """Bytes one device receives per step for all-gathered layer inputs of the given widths
    (forward; the backward's reduce-scatter of their gradients moves as many again)."""
    return sum((self.num_parts - 1) * self.rows * int(w) * itemsize for w in widths)


def partition(graph, num_parts: int, *, norm: str | np.ndarray = "mean") -> Partitions:
  """Splits a `jaxdata.data.HeteroGraph` into `num_parts` destination parts of equal shapes.

  Args:
    graph: the whole graph (edges sorted by (etype, dst, src), as HeteroGraph keeps them).
    num_parts: K >= 1, the devices the graph is spread over.
    norm: the per-edge normalizer of the whole graph: "mean" (the RGCN paper's 1 / c_{i,r},
      `GraphArrays.from_graph`'s default), "none", or a float array with one value per edge.

  Returns:
    `Partitions`; part k's arrays equal `GraphArrays.from_graph` of the edges into its nodes
    (with the padding edges and pairs described in the module's docstring).
  """
  k = int(num_parts)
  if isinstance(num_parts, bool) or k < 1 or k != num_parts:
    raise ValueError(f"hector.partition: num_parts must be an int >= 1, got {num_parts!r}")
  n, r = int(graph.num_nodes), int(graph.num_relations)
  if r < 1:
    raise ValueError("hector.partition: the graph has no relations")
  rows = -(-(n + 1) // k)
  padded = k * rows
  if padded >= 2**31:
    raise ValueError(f"hector.partition: {padded} padded nodes do not fit int32 ids")
  full_norm = graph.edge_norm(norm) if isinstance(norm, str) else np.asarray(norm, np.float32)
  if full_norm.shape != (graph.num_edges,):
    raise ValueError(
      f"hector.partition: norm must have one value per edge ({graph.num_edges}),"
      f" got shape {full_norm.shape}"
    )
  dst = np.asarray(graph.dst)
  owner = dst // rows
  counts = np.bincount(owner, minlength=k)
  slots = int(counts.max()) + 1 if graph.num_edges else 1  # room for one padding edge at least
  types = graph.node_type_offsets
  if types is not None:
    types = tuple(int(t) for t in types[:-1]) + (padded,)
  cpu = jax.local_devices(backend="cpu")[0]  # this process's own (another's cannot be read)
  parts = []
  for part in range(k):
    keep = owner == part
    # Edges stay sorted by (etype, dst, src); padding edges (relation 0, dst = the padding
    # node, the largest id) go at the end of relation 0.
    src, d, et, nm = (np.asarray(a)[keep] for a in (graph.src, dst, graph.etype, full_norm))
    extra = slots - len(src)
    at = int(np.searchsorted(et, 1))
    src = np.insert(src, at, np.full(extra, padded - 1, np.int32))
    d = np.insert(d, at, np.full(extra, padded - 1, np.int32))
    et = np.insert(et, at, np.zeros(extra, np.int32))
    nm = np.insert(nm, at, np.zeros(extra, np.float32))
    g = HeteroGraph(
      num_nodes=padded,
      src=src,
      dst=d,
      etype=et,
      relation_names=graph.relation_names,
      node_type_names=graph.node_type_names if types else ("node",),
      node_type_offsets=None if types is None else np.asarray(types),
    )
    ga = GraphArrays.from_graph(g, norm=nm, device=cpu)
    parts.append({f: np.asarray(getattr(ga, f)) for f in FIELDS})
  num_pairs = max(len(p["pair_src"]) for p in parts)
  stacked = {f: np.stack([_pad_pairs(p, num_pairs, padded, r)[f] for p in parts]) for f in FIELDS}
  out = Partitions(stacked, k, rows, n, r, types)
  for part in range(k):  # equal shapes by construction; this checks every value of each part
    out.graph(part)
  return out


def _pad_pairs(p: dict, num_pairs: int, padded: int, r: int) -> dict:
  """Part arrays `p` with unused pairs ``(padding node, R)`` (no edges, no relation:
  `GraphArrays`) appended up to `num_pairs`: they sort last, past ``pair_rel_offsets[R]``, so
  the kernels over pairs skip them, and only the pair CSR's final offset moves."""
  extra = num_pairs - len(p["pair_src"])
  if extra == 0:
    return p
  p = dict(p)
  e = len(p["src"])
  i32 = np.int32
  p["pair_offsets"] = np.concatenate([p["pair_offsets"], np.full(extra, e, i32)])
  p["pair_src"] = np.concatenate([p["pair_src"], np.full(extra, padded - 1, i32)])
  p["pair_etype"] = np.concatenate([p["pair_etype"], np.full(extra, r, i32)])
  p["pair_csr_offsets"] = p["pair_csr_offsets"].copy()
  p["pair_csr_offsets"][padded] = num_pairs
  old = num_pairs - extra
  p["pair_csr_edges"] = np.concatenate([p["pair_csr_edges"], np.arange(old, num_pairs, dtype=i32)])
  return p
