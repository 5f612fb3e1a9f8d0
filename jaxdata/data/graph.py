"""HeteroGraph: a directed multigraph with typed edges (relations), held as NumPy arrays."""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np

from jaxdata.data import graph_build

_INT32_MAX = np.iinfo(np.int32).max
_NORM_KINDS = ("mean", "none")


def _read_only(array: np.ndarray) -> np.ndarray:
  view = array.view()
  view.setflags(write=False)
  return view


def _index_array(values: Any, what: str) -> np.ndarray:
  """`values` as a 1-D int32 or int64 array (other integer types become int64; int32 and
  int64 are kept, not copied); TypeError for non-integers, ValueError for other shapes."""
  if isinstance(values, _Owned):
    return values.array
  return graph_build.index_array(values, what)


def _check_unique_names(names: Sequence[str], what: str) -> None:
  """ValueError naming the first name that occurs twice: a relation is looked up by its name."""
  seen = set()
  for name in names:
    if name in seen:
      raise ValueError(f"{what}: the name {name!r} is used by two relations")
    seen.add(name)


def _check_range(array: np.ndarray, upper: int, what: str, bound: str) -> None:
  if array.size and (array.min() < 0 or array.max() >= upper):
    bad = array[(array < 0) | (array >= upper)][0]
    raise ValueError(f"{what}: value {bad} is outside [0, {bound}={upper})")


@dataclasses.dataclass(frozen=True)
class _Owned:
  """An int32 array that from_edges built and nobody else holds: the constructor keeps it as
  it is instead of copying it (a 64M-edge graph's arrays are 768 MB)."""

  array: np.ndarray


def _owned(a: np.ndarray) -> np.ndarray:
  """`a` wrapped as `_Owned`, for a HeteroGraph field: `__post_init__` unwraps it, so the field
  holds an ndarray once the graph exists (the cast says so to the type checker)."""
  return cast(np.ndarray, _Owned(a))


def _relation_types(
  value: Any, relation_names: tuple[str, ...], node_type_names: tuple[str, ...], who: str
) -> tuple[tuple[str, str, str], ...] | None:
  """`value` checked as one (source type, relation, destination type) per relation, or None."""
  if value is None:
    if len(node_type_names) == 1:  # one node type: every relation joins it to itself
      return tuple((node_type_names[0], r, node_type_names[0]) for r in relation_names)
    return None
  types = tuple(tuple(str(x) for x in t) if isinstance(t, (tuple, list)) else t for t in value)
  if len(types) != len(relation_names):
    raise ValueError(
      f"{who}: relation_types must have one entry per relation "
      f"({len(relation_names)}), got {len(types)}"
    )
  for t in types:
    if not isinstance(t, tuple) or len(t) != 3:
      raise ValueError(
        f"{who}: relation_types entries must be (source type, relation, "
        f"destination type), got {t!r}"
      )
    for node_type in (t[0], t[2]):
      if node_type not in node_type_names:
        raise ValueError(
          f"{who}: relation_types entry {t!r} names the unknown node type "
          f"{node_type!r}; node types: {list(node_type_names)}"
        )
  return cast(tuple[tuple[str, str, str], ...], types)  # each entry checked above


@dataclasses.dataclass(frozen=True, eq=False)
class HeteroGraph:
  """A directed multigraph whose edges have a relation type, as flat NumPy arrays.

  Edge e goes from node `src[e]` to node `dst[e]` with relation `etype[e]`. Edges are kept sorted
  by (etype, dst, src), so the edges of one relation are a contiguous block
  (`relation_offsets`) and, inside it, the edges into one node are contiguous too: the layout
  relational GNN kernels want for per-relation aggregation. Self loops and repeated edges are
  allowed. Nodes may be split into types: nodes of type t are the ids
  `[node_type_offsets[t], node_type_offsets[t + 1])`.

  The graph is immutable; derived arrays (`csr`, `csc`, `edge_norm`, `relation_offsets`,
  `in_degree`) are computed once, on first use, and returned read-only. Sorting and grouping run
  in native, multithreaded code (`jaxdata.data.graph_build`): a 64M-edge graph builds in seconds.

  Build one with `HeteroGraph.from_edges` (validates and sorts), `from_typed_edges` (per-type
  edge dicts, the shape of PyG's `HeteroData` and DGL's heterographs), `from_edge_list` (a text
  file) or `from_jraph`; the constructor itself checks its arguments but expects sorted edges.

  Example:
    >>> g = HeteroGraph.from_edges([0, 1, 2], [1, 2, 0], [0, 0, 1],
    ...                            relation_names=("cites", "writes"), add_inverse=True)
    >>> g.num_nodes, g.num_edges, g.relation_names
    (3, 6, ('cites', 'writes', 'rev_cites', 'rev_writes'))
    >>> g.edge_norm()          # 1 / (edges of the same relation into the same node)
    array([1., 1., 1., 1., 1., 1.], dtype=float32)

  Attributes:
    num_nodes: number of nodes N; ids are 0 .. N-1.
    src, dst: int32[E] end points of each edge.
    etype: int32[E] relation of each edge, in [0, R).
    relation_names: R names, one per relation.
    node_type_names: T names, one per node type.
    node_type_offsets: int64[T+1] first id of each node type, then N; None for a single type.
    relation_types: (source type, relation, destination type) of each relation, when known (set
      by `from_typed_edges`; filled in for a graph of one node type; else None).
  """

  num_nodes: int
  src: np.ndarray
  dst: np.ndarray
  etype: np.ndarray
  relation_names: tuple[str, ...]
  node_type_names: tuple[str, ...] = ("node",)
  node_type_offsets: np.ndarray | None = None
  relation_types: tuple[tuple[str, str, str], ...] | None = None

  def __post_init__(self):
    set_ = functools.partial(object.__setattr__, self)
    if isinstance(self.num_nodes, bool) or not isinstance(self.num_nodes, (int, np.integer)):
      raise TypeError(f"HeteroGraph: num_nodes must be an int, got {self.num_nodes!r}")
    num_nodes = int(self.num_nodes)
    if not 0 <= num_nodes <= _INT32_MAX:
      raise ValueError(f"HeteroGraph: num_nodes must be in [0, 2**31), got {num_nodes}")
    set_("num_nodes", num_nodes)
    if isinstance(self.relation_names, str):
      raise TypeError("HeteroGraph: relation_names must be a sequence of names, not a string")
    set_("relation_names", tuple(str(n) for n in self.relation_names))
    _check_unique_names(self.relation_names, "HeteroGraph: relation_names")
    if isinstance(self.node_type_names, str):
      raise TypeError("HeteroGraph: node_type_names must be a sequence of names, not a string")
    set_("node_type_names", tuple(str(n) for n in self.node_type_names))
    if not self.node_type_names:
      raise ValueError("HeteroGraph: node_type_names must name at least one node type")

    arrays, owned = {}, {}
    for name in ("src", "dst", "etype"):
      owned[name] = isinstance(getattr(self, name), _Owned)
      arrays[name] = _index_array(getattr(self, name), f"HeteroGraph: {name}")
    src, dst, etype = arrays["src"], arrays["dst"], arrays["etype"]
    if not len(src) == len(dst) == len(etype):
      raise ValueError(
        f"HeteroGraph: src, dst and etype must have one length; got "
        f"{len(src)}, {len(dst)}, {len(etype)}"
      )
    if len(src) > _INT32_MAX:
      raise ValueError(f"HeteroGraph: at most 2**31 - 1 edges, got {len(src)}")
    _check_range(src, num_nodes, "HeteroGraph: src", "num_nodes")
    _check_range(dst, num_nodes, "HeteroGraph: dst", "num_nodes")
    _check_range(etype, len(self.relation_names), "HeteroGraph: etype", "len(relation_names)")
    if not graph_build.edges_sorted(src, dst, etype):
      raise ValueError(
        "HeteroGraph: edges must be sorted by (etype, dst, src); "
        "use HeteroGraph.from_edges to sort them"
      )
    for name, array in arrays.items():  # a copy, unless from_edges handed over its own arrays
      set_(name, _read_only(array if owned[name] else array.astype(np.int32)))

    if self.node_type_offsets is None:
      if len(self.node_type_names) != 1:
        raise ValueError(
          f"HeteroGraph: node_type_offsets is needed for {len(self.node_type_names)} node types"
        )
    else:
      offsets = _index_array(self.node_type_offsets, "HeteroGraph: node_type_offsets")
      if len(offsets) != len(self.node_type_names) + 1:
        raise ValueError(
          f"HeteroGraph: node_type_offsets must have len(node_type_names) + 1 = "
          f"{len(self.node_type_names) + 1} entries, got {len(offsets)}"
        )
      if offsets[0] != 0 or offsets[-1] != num_nodes or (np.diff(offsets) < 0).any():
        raise ValueError(
          f"HeteroGraph: node_type_offsets must rise from 0 to num_nodes="
          f"{num_nodes}, got {offsets.tolist()}"
        )
      set_("node_type_offsets", _read_only(offsets))
    set_(
      "relation_types",
      _relation_types(
        self.relation_types, self.relation_names, self.node_type_names, "HeteroGraph"
      ),
    )

  # -- sizes ----------------------------------------------------------------------------------

  @property
  def num_edges(self) -> int:
    return len(self.src)

  @property
  def num_relations(self) -> int:
    return len(self.relation_names)

  @property
  def num_node_types(self) -> int:
    return len(self.node_type_names)

  def __repr__(self) -> str:
    types = f", node_types={self.num_node_types}" if self.num_node_types > 1 else ""
    return (
      f"HeteroGraph(num_nodes={self.num_nodes}, num_edges={self.num_edges}, "
      f"num_relations={self.num_relations}{types})"
    )

  # -- derived arrays (computed once) ----------------------------------------------------------

  @functools.cached_property
  def relation_offsets(self) -> np.ndarray:
    """int64[R+1]: the edges of relation r are `[offsets[r], offsets[r + 1])`."""
    # Edges are sorted by etype: relation r starts at the first edge whose etype is >= r.
    bounds = np.arange(
      self.num_relations + 1, dtype=np.int32 if self.num_relations < _INT32_MAX else np.int64
    )
    return _read_only(np.searchsorted(self.etype, bounds, side="left").astype(np.int64))

  @functools.cached_property
  def _csr(self) -> tuple[np.ndarray, np.ndarray]:
    return self._grouped(self.src)

  @functools.cached_property
  def _csc(self) -> tuple[np.ndarray, np.ndarray]:
    return self._grouped(self.dst)

  @functools.cached_property
  def _norms(self) -> dict[str, np.ndarray]:
    return {}

  def _grouped(self, node: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    offsets, edge_ids = graph_build.group_by(node, self.num_nodes)  # a parallel counting sort
    return _read_only(offsets), _read_only(edge_ids)

  def csr(self) -> tuple[np.ndarray, np.ndarray]:
    """Out-edges by source node: `edge_ids[offsets[v]:offsets[v + 1]]` are the edges leaving v.

    Returns (offsets int64[N+1], edge_ids int32[E]); inside a node's group the edge ids ascend,
    so they are also ordered by (etype, dst, src).
    """
    return self._csr

  def csc(self) -> tuple[np.ndarray, np.ndarray]:
    """In-edges by destination node: `edge_ids[offsets[v]:offsets[v + 1]]` enter v.

    Returns (offsets int64[N+1], edge_ids int32[E]), edge ids ascending inside a node's group.
    """
    return self._csc

  def in_degree(self) -> np.ndarray:
    """int64[N]: the number of edges into each node, over all relations."""
    return np.diff(self._csc[0])

  def edge_norm(self, kind: str = "mean") -> np.ndarray:
    """float32[E]: a constant per edge that scales its message.

    "mean" gives `1 / c[dst[e], etype[e]]`, where `c[v, r]` counts the edges of relation r into
    node v: summing messages times this norm averages them per relation, the RGCN paper's
    `1 / c_{i,r}`. "none" gives ones.
    """
    if kind not in _NORM_KINDS:
      raise ValueError(f"edge_norm: kind must be one of {_NORM_KINDS}, got {kind!r}")
    if kind not in self._norms:
      if kind == "none":
        norm = np.ones(self.num_edges, np.float32)
      else:
        # Edges are sorted by (etype, dst): a run of equal (etype, dst) is one c[v, r] group.
        norm = graph_build.mean_edge_norm(self.dst, self.etype)
      self._norms[kind] = _read_only(norm)
    return self._norms[kind]

  # -- construction ---------------------------------------------------------------------------

  @classmethod
  def from_edges(
    cls,
    src: Any,
    dst: Any,
    etype: Any,
    *,
    num_nodes: int | None = None,
    relation_names: Sequence[str] | None = None,
    add_inverse: bool = False,
    node_type_names: Sequence[str] = ("node",),
    node_type_offsets: Any = None,
    relation_types: Sequence[tuple[str, str, str]] | None = None,
  ) -> HeteroGraph:
    """Builds a graph from edge arrays in any order: checks them, then sorts by (etype, dst, src).

    The sort is a parallel radix sort in native code (`graph_build.sort_edges`); the result
    equals a stable NumPy sort's (`jaxdata.reference.graph.sort_order`).

    Example:
      >>> g = HeteroGraph.from_edges(src=[2, 0], dst=[0, 1], etype=[1, 0])
      >>> g.src, g.etype, g.relation_names
      (array([0, 2], dtype=int32), array([0, 1], dtype=int32), ('r0', 'r1'))

    Args:
      src, dst, etype: 1-D integer arrays of one length.
      num_nodes: N; default: the last entry of node_type_offsets if given, else the largest node
        id plus one.
      relation_names: one name per relation; default "r0", "r1", ... for max(etype) + 1
        relations.
      add_inverse: also add each edge reversed, (dst, src, etype + R), as relation
        "rev_<name>", so messages can flow both ways (R becomes 2R).
      node_type_names, node_type_offsets: node types, as in the class.
      relation_types: (source type, relation, destination type) of each given relation, as in
        the class; with add_inverse, the reverse of (s, r, d) is (d, "rev_<r>", s).
    """
    src = _index_array(src, "from_edges: src")
    dst = _index_array(dst, "from_edges: dst")
    etype = _index_array(etype, "from_edges: etype")
    if not len(src) == len(dst) == len(etype):
      raise ValueError(
        f"from_edges: src, dst and etype must have one length; got "
        f"{len(src)}, {len(dst)}, {len(etype)}"
      )
    if num_nodes is None:
      if node_type_offsets is not None:
        num_nodes = int(np.asarray(node_type_offsets)[-1])
      else:
        num_nodes = int(max(src.max(initial=-1), dst.max(initial=-1))) + 1
    elif isinstance(num_nodes, bool) or not isinstance(num_nodes, (int, np.integer)):
      raise TypeError(f"from_edges: num_nodes must be an int, got {num_nodes!r}")
    elif num_nodes < 0:
      raise ValueError(f"from_edges: num_nodes must be >= 0, got {num_nodes}")
    if num_nodes > _INT32_MAX:
      raise ValueError(f"from_edges: num_nodes must be in [0, 2**31), got {num_nodes}")
    _check_range(src, num_nodes, "from_edges: src", "num_nodes")
    _check_range(dst, num_nodes, "from_edges: dst", "num_nodes")
    if relation_names is None:
      relation_names = tuple(f"r{i}" for i in range(int(etype.max(initial=-1)) + 1))
    elif isinstance(relation_names, str):
      raise TypeError("from_edges: relation_names must be a sequence of names, not a string")
    relation_names = tuple(str(n) for n in relation_names)
    _check_unique_names(relation_names, "from_edges: relation_names")
    _check_range(etype, len(relation_names), "from_edges: etype", "len(relation_names)")
    types = None
    if relation_types is not None:
      types = _relation_types(relation_types, relation_names, tuple(node_type_names), "from_edges")
    if add_inverse:
      num = len(relation_names)
      if 2 * num > _INT32_MAX:
        etype = etype.astype(np.int64)
      src, dst = np.concatenate([src, dst]), np.concatenate([dst, src])
      etype = np.concatenate([etype, etype + etype.dtype.type(num)])
      inverse = tuple(f"rev_{n}" for n in relation_names)
      given = set(relation_names)
      for name, n in zip(inverse, relation_names):
        if name in given:
          raise ValueError(
            f"from_edges: add_inverse names the inverse of relation {n!r} {name!r}, which is "
            f"already a given relation; rename it or pass add_inverse=False and give the "
            f"inverse relations yourself"
          )
      relation_names = relation_names + inverse
      if types is not None:
        types += tuple((d, f"rev_{r}", s) for s, r, d in types)
    if len(src) > _INT32_MAX:
      raise ValueError(f"from_edges: at most 2**31 - 1 edges, got {len(src)}")
    src, dst, etype = graph_build.sort_edges(src, dst, etype, num_nodes, len(relation_names))
    return cls(
      num_nodes,
      _owned(src),
      _owned(dst),
      _owned(etype),
      relation_names,
      tuple(node_type_names),
      node_type_offsets,
      types,
    )

  @classmethod
  def from_typed_edges(
    cls,
    edges: Mapping[tuple[str, str, str], tuple[Any, Any]],
    num_nodes: Mapping[str, int],
    *,
    add_inverse: bool = True,
  ) -> HeteroGraph:
    """Builds a graph with node types from edges given per (source type, relation, destination
    type), with ids local to their node type: the shape of PyG's `HeteroData` edge stores and
    DGL's heterograph dicts.

    Node types get contiguous global id ranges in the order of `num_nodes`
    (`node_type_offsets`); local id i of type t is global id `node_type_offsets[t] + i`
    (`global_ids` and `local_ids` convert). Relations get ids in the order of `edges`. A
    relation is named by its middle name when no other key uses that name, else by
    "src_type:relation:dst_type" (PyG's ("author", "writes", "paper") and ("author", "writes",
    "book") become "author:writes:paper" and "author:writes:book"). `relation_types` keeps the
    keys themselves, so samplers and layers know which node types each relation joins.

    Example:
      >>> g = HeteroGraph.from_typed_edges(
      ...     {("author", "writes", "paper"): ([0, 1, 1], [0, 0, 1]),
      ...      ("paper", "cites", "paper"): ([1], [0])},
      ...     num_nodes={"paper": 2, "author": 2})
      >>> g.relation_names
      ('writes', 'cites', 'rev_writes', 'rev_cites')
      >>> g.relation_types[2], g.node_type_offsets.tolist()
      (('paper', 'rev_writes', 'author'), [0, 2, 4])
      >>> g.global_ids("author", [0, 1]).tolist()
      [2, 3]

    Args:
      edges: {(source type, relation, destination type): (src ids, dst ids)}, 1-D integer
        arrays of one length, ids in [0, num_nodes[type]); or a ``[2, E]`` array (PyG's
        ``edge_index_dict``: NumPy, JAX, or torch on the CPU).
      num_nodes: {node type: number of nodes}, every node type of the graph (also those that no
        edge touches).
      add_inverse: also add each relation reversed as "rev_<name>", of type (destination type,
        "rev_<relation>", source type), as models on typed graphs do.

    Raises:
      TypeError: a key that is not three names, ids that are not integers, a count that is not
        an int.
      ValueError: an unknown node type in a key, a negative count, src and dst of different
        lengths, ids outside their type's range, repeated keys, more than 2**31 - 1 nodes.
    """
    who = "from_typed_edges"
    if not isinstance(num_nodes, Mapping):
      raise TypeError(
        f"{who}: num_nodes must be a mapping {{node type: count}}, got {type(num_nodes).__name__}"
      )
    if not isinstance(edges, Mapping):
      raise TypeError(
        f"{who}: edges must be a mapping {{(src_type, relation, dst_type): "
        f"(src, dst)}}, got {type(edges).__name__}"
      )
    if not num_nodes:
      raise ValueError(f"{who}: num_nodes must name at least one node type")
    counts = {}
    for node_type, count in num_nodes.items():
      if not isinstance(node_type, str):
        raise TypeError(f"{who}: node types must be strings, got {node_type!r}")
      if isinstance(count, bool) or not isinstance(count, (int, np.integer)):
        raise TypeError(f"{who}: num_nodes[{node_type!r}] must be an int, got {count!r}")
      if count < 0:
        raise ValueError(f"{who}: num_nodes[{node_type!r}] must be >= 0, got {count}")
      counts[node_type] = int(count)
    type_names = tuple(counts)
    # Summed in Python ints: counts near 2**63 would wrap in int64 and be reported wrongly.
    bounds = [0]
    for t in type_names:
      bounds.append(bounds[-1] + counts[t])
    if bounds[-1] > _INT32_MAX:
      raise ValueError(f"{who}: at most 2**31 - 1 nodes in all, got {bounds[-1]}")
    offsets = np.asarray(bounds, np.int64)
    offset = dict(zip(type_names, bounds[:-1]))

    keys, srcs, dsts = [], [], []
    for key, pair in edges.items():
      if not isinstance(key, tuple) or len(key) != 3 or not all(isinstance(k, str) for k in key):
        raise TypeError(
          f"{who}: edge keys must be (src_type, relation, dst_type) name triples, got {key!r}"
        )
      for node_type in (key[0], key[2]):
        if node_type not in counts:
          raise ValueError(
            f"{who}: edge key {key!r} names the unknown node type "
            f"{node_type!r}; node types (num_nodes): {list(type_names)}"
          )
      if not isinstance(pair, (tuple, list, str, bytes)) and np.shape(pair)[:1] == (2,):
        pair = (pair[0], pair[1])  # an edge_index of shape [2, E] (PyG's edge_index_dict)
      if isinstance(pair, (str, bytes)) or not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise TypeError(
          f"{who}: edges[{key!r}] must be a pair (src ids, dst ids) or a [2, E] array"
        )
      src = _index_array(pair[0], f"{who}: src ids of {key!r}")
      dst = _index_array(pair[1], f"{who}: dst ids of {key!r}")
      if len(src) != len(dst):
        raise ValueError(
          f"{who}: src and dst ids of {key!r} have different lengths ({len(src)} and {len(dst)})"
        )
      _check_range(src, counts[key[0]], f"{who}: src ids of {key!r}", f"num_nodes[{key[0]!r}]")
      _check_range(dst, counts[key[2]], f"{who}: dst ids of {key!r}", f"num_nodes[{key[2]!r}]")
      keys.append(key)
      # Local ids to global ones (int64 here; from_edges sorts them into int32).
      srcs.append(src.astype(np.int64) + offset[key[0]])
      dsts.append(dst.astype(np.int64) + offset[key[2]])
    uses = collections.Counter(relation for _, relation, _ in keys)
    names = [k[1] if uses[k[1]] == 1 else ":".join(k) for k in keys]
    if len(set(names)) != len(names):  # only a key given twice can collide
      raise ValueError(f"{who}: repeated edge keys in {keys}")
    if add_inverse:  # from_edges names the inverse of relation n "rev_<n>"
      given = dict(zip(names, keys))
      for name, key in zip(names, keys):
        if f"rev_{name}" in given:
          raise ValueError(
            f"{who}: the generated inverse of {key!r} would be named 'rev_{name}', like the "
            f"given relation {given[f'rev_{name}']!r}; rename one, or pass add_inverse=False "
            f"and give the inverse relations yourself"
          )
    etype = np.repeat(np.arange(len(keys), dtype=np.int32), [len(x) for x in srcs])
    empty = np.zeros(0, np.int64)
    return cls.from_edges(
      np.concatenate(srcs) if srcs else empty,
      np.concatenate(dsts) if dsts else empty,
      etype,
      num_nodes=int(offsets[-1]),
      relation_names=names,
      add_inverse=add_inverse,
      node_type_names=type_names,
      node_type_offsets=offsets,
      relation_types=keys,
    )

  # -- node types -----------------------------------------------------------------------------

  def _type_offsets(self) -> np.ndarray:
    t = self.node_type_offsets
    return np.array([0, self.num_nodes], np.int64) if t is None else t

  def node_type_range(self, node_type: str) -> tuple[int, int]:
    """[first, last + 1): the global ids of a node type."""
    if node_type not in self.node_type_names:
      raise ValueError(
        f"HeteroGraph: unknown node type {node_type!r}; node types: {list(self.node_type_names)}"
      )
    t = self.node_type_names.index(node_type)
    offsets = self._type_offsets()
    return int(offsets[t]), int(offsets[t + 1])

  def global_ids(self, node_type: str, local_ids: Any) -> np.ndarray:
    """int64: the global ids of nodes of `node_type` given by their ids local to the type."""
    first, end = self.node_type_range(node_type)
    local = _index_array(local_ids, "global_ids: local_ids")
    _check_range(local, end - first, "global_ids: local_ids", f"nodes of {node_type!r}")
    return local.astype(np.int64) + first

  def local_ids(self, global_ids: Any) -> tuple[np.ndarray, np.ndarray]:
    """(node type index int32, local id int64) of each global id: the inverse of `global_ids`
    (`node_type_names[type]` names the type)."""
    ids = _index_array(global_ids, "local_ids: global_ids")
    _check_range(ids, self.num_nodes, "local_ids: global_ids", "num_nodes")
    offsets = self._type_offsets()
    # side="right": an empty type (equal offsets) is skipped, ids go to the type that owns them
    types = (np.searchsorted(offsets, ids, side="right") - 1).astype(np.int32)
    return types, ids.astype(np.int64) - offsets[types]

  @classmethod
  def from_edge_list(
    cls, path: str | os.PathLike, *, add_inverse: bool = True, delimiter: str | None = None
  ) -> tuple[HeteroGraph, list[str]]:
    """Reads a text file with one edge per line, "head relation tail" (knowledge-graph style).

    Tokens are separated by `delimiter` (default: any run of whitespace, tabs included). Blank
    lines and lines whose first non-blank character is '#' are skipped (a '#' later in a line is
    part of a name: IRIs have fragments). Node and relation names get ids in order of first
    appearance (a line's head before its tail).

    Example:
      >>> # kg.txt:  alice knows bob \\n bob likes carol
      >>> g, names = HeteroGraph.from_edge_list("kg.txt")
      >>> names, g.relation_names
      (['alice', 'bob', 'carol'], ('knows', 'likes', 'rev_knows', 'rev_likes'))

    Returns:
      (graph, node_names) where node_names[i] is the name of node i.
    """
    path = os.fspath(path)
    with open(path, encoding="utf-8") as f:
      lines = f.read().splitlines()
    heads, relations, tails = [], [], []
    for number, line in enumerate(lines, 1):
      stripped = line.strip()
      if not stripped or stripped[0] == "#":
        continue
      tokens = stripped.split(delimiter)
      if delimiter is not None:
        tokens = [t.strip() for t in tokens]
      if len(tokens) != 3 or not all(tokens):
        raise ValueError(
          f"from_edge_list: {path}:{number}: expected 'head relation tail', got {line!r}"
        )
      heads.append(tokens[0])
      relations.append(tokens[1])
      tails.append(tokens[2])
    # dict.fromkeys keeps first appearances in order; mapping through a dict runs at C speed.
    interleaved = [name for pair in zip(heads, tails) for name in pair]
    node_names = list(dict.fromkeys(interleaved))
    relation_names = list(dict.fromkeys(relations))
    node_id = {name: i for i, name in enumerate(node_names)}
    relation_id = {name: i for i, name in enumerate(relation_names)}
    src = np.fromiter(map(node_id.__getitem__, heads), np.int64, len(heads))
    dst = np.fromiter(map(node_id.__getitem__, tails), np.int64, len(tails))
    etype = np.fromiter(map(relation_id.__getitem__, relations), np.int64, len(relations))
    graph = cls.from_edges(
      src,
      dst,
      etype,
      num_nodes=len(node_names),
      relation_names=relation_names,
      add_inverse=add_inverse,
    )
    return graph, node_names

  # -- jraph ----------------------------------------------------------------------------------

  def to_jraph(self):
    """This graph as a single `jraph.GraphsTuple` (host NumPy arrays; `jax.device_put` them).

    senders=src, receivers=dst, edges={"etype": etype}, no node features; ``globals`` holds the
    names (``"relation_names"``, ``"node_type_names"``, ``"node_type_offsets"`` and, when known,
    ``"relation_types"`` as "src|relation|dst"), so `from_jraph` gives this graph back.
    """
    import jraph  # optional (the jraph extra)

    names = {
      "relation_names": self.relation_names,
      "node_type_names": self.node_type_names,
    }
    if self.relation_types is not None:
      names["relation_types"] = tuple("|".join(k) for k in self.relation_types)
    offsets = self.node_type_offsets
    glob = {k: np.array([list(v)], dtype=object) for k, v in names.items()}
    glob["node_type_offsets"] = np.asarray(
      [self.num_nodes] if offsets is None else offsets, np.int64
    )[None]
    # jraph annotates its fields as jnp.ndarray; it holds NumPy arrays as well
    return jraph.GraphsTuple(
      nodes=None,
      edges={"etype": np.asarray(self.etype)},
      senders=np.asarray(self.src),  # pyright: ignore[reportArgumentType]
      receivers=np.asarray(self.dst),  # pyright: ignore[reportArgumentType]
      n_node=np.array([self.num_nodes], np.int32),  # pyright: ignore[reportArgumentType]
      n_edge=np.array([self.num_edges], np.int32),  # pyright: ignore[reportArgumentType]
      globals=glob,  # pyright: ignore[reportArgumentType]
    )

  @classmethod
  def from_jraph(
    cls, graphs_tuple: Any, *, etype_key: str = "etype", relation_names: Sequence[str] | None = None
  ) -> HeteroGraph:
    """Builds a graph from a `jraph.GraphsTuple` whose `edges[etype_key]` holds edge types.

    A batch of several graphs becomes one graph (jraph's node ids are already global over the
    batch). With `edges=None` every edge gets relation 0. The names and node types `to_jraph`
    writes in ``globals`` are restored; `relation_names` overrides the relation names.
    """
    edges = graphs_tuple.edges
    senders = np.asarray(graphs_tuple.senders)
    if edges is None:
      etype = np.zeros(senders.shape, np.int64)
    elif isinstance(edges, Mapping):
      if etype_key not in edges:
        raise ValueError(
          f"from_jraph: etype_key {etype_key!r} is not in the edges; keys: {sorted(edges)}"
        )
      etype = np.asarray(edges[etype_key])
    else:
      raise TypeError(
        f"from_jraph: edges must be a mapping holding {etype_key!r} or None, got "
        f"{type(edges).__name__}"
      )
    glob = graphs_tuple.globals if isinstance(graphs_tuple.globals, Mapping) else {}
    saved = lambda key: [str(v) for v in np.asarray(glob[key])[0]] if key in glob else None  # noqa: E731
    types: dict[str, Any] = {}
    if "node_type_names" in glob and "node_type_offsets" in glob:
      types["node_type_names"] = saved("node_type_names")
      offsets = np.asarray(glob["node_type_offsets"])[0]
      types["node_type_offsets"] = offsets if len(offsets) > 1 else None
    if "relation_types" in glob:
      types["relation_types"] = [tuple(k.split("|")) for k in saved("relation_types") or ()]
    num_nodes = int(np.sum(np.asarray(graphs_tuple.n_node)))
    return cls.from_edges(
      senders,
      np.asarray(graphs_tuple.receivers),
      etype,
      num_nodes=num_nodes,
      relation_names=relation_names if relation_names is not None else saved("relation_names"),
      **types,
    )
