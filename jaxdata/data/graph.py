"""HeteroGraph: a directed multigraph with typed edges (relations), held as NumPy arrays."""
from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

_INT32_MAX = np.iinfo(np.int32).max
_NORM_KINDS = ("mean", "none")


def _read_only(array: np.ndarray) -> np.ndarray:
  view = array.view()
  view.setflags(write=False)
  return view


def _index_array(values: Any, what: str) -> np.ndarray:
  """`values` as a 1-D int64 array; TypeError for non-integers, ValueError for other shapes."""
  array = np.asarray(values)
  if array.size == 0 and array.dtype.kind in "f":  # np.asarray([]) is float64
    array = array.astype(np.int64)
  if array.dtype.kind not in "iu":
    raise TypeError(f"{what}: expected integers, got dtype {array.dtype}")
  if array.ndim != 1:
    raise ValueError(f"{what}: expected a 1-D array, got shape {array.shape}")
  return array.astype(np.int64, copy=False)


def _check_range(array: np.ndarray, upper: int, what: str, bound: str) -> None:
  if array.size and (array.min() < 0 or array.max() >= upper):
    bad = array[(array < 0) | (array >= upper)][0]
    raise ValueError(f"{what}: value {bad} is outside [0, {bound}={upper})")


def _edge_key(src: np.ndarray, dst: np.ndarray, etype: np.ndarray, num_nodes: int,
              num_relations: int) -> np.ndarray | None:
  """One int64 per edge that orders edges by (etype, dst, src), or None if it would overflow."""
  n = max(num_nodes, 1)
  if max(num_relations, 1) * n * n >= 2**63:
    return None
  return (etype.astype(np.int64) * n + dst) * n + src


def _sort_order(src: np.ndarray, dst: np.ndarray, etype: np.ndarray, num_nodes: int,
                num_relations: int) -> np.ndarray:
  """The stable permutation that sorts edges by (etype, dst, src)."""
  key = _edge_key(src, dst, etype, num_nodes, num_relations)
  if key is not None:  # one stable sort of one key instead of three
    return np.argsort(key, kind="stable")
  return np.lexsort((src, dst, etype))


def _is_sorted(src: np.ndarray, dst: np.ndarray, etype: np.ndarray, num_nodes: int,
               num_relations: int) -> bool:
  key = _edge_key(src, dst, etype, num_nodes, num_relations)
  if key is not None:
    return bool((key[1:] >= key[:-1]).all())
  d_e, d_d, d_s = etype[1:] - etype[:-1], dst[1:] - dst[:-1], src[1:] - src[:-1]
  return not ((d_e < 0) | ((d_e == 0) & ((d_d < 0) | ((d_d == 0) & (d_s < 0))))).any()


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
  `in_degree`) are computed once, on first use, and returned read-only.

  Build one with `HeteroGraph.from_edges` (validates and sorts), `from_edge_list` (a text file)
  or `from_jraph`; the constructor itself checks its arguments but expects sorted edges.

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
  """

  num_nodes: int
  src: np.ndarray
  dst: np.ndarray
  etype: np.ndarray
  relation_names: tuple[str, ...]
  node_type_names: tuple[str, ...] = ("node",)
  node_type_offsets: np.ndarray | None = None

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
    if isinstance(self.node_type_names, str):
      raise TypeError("HeteroGraph: node_type_names must be a sequence of names, not a string")
    set_("node_type_names", tuple(str(n) for n in self.node_type_names))
    if not self.node_type_names:
      raise ValueError("HeteroGraph: node_type_names must name at least one node type")

    arrays = {}
    for name in ("src", "dst", "etype"):
      array = _index_array(getattr(self, name), f"HeteroGraph: {name}")
      arrays[name] = array
    src, dst, etype = arrays["src"], arrays["dst"], arrays["etype"]
    if not len(src) == len(dst) == len(etype):
      raise ValueError(f"HeteroGraph: src, dst and etype must have one length; got "
                       f"{len(src)}, {len(dst)}, {len(etype)}")
    if len(src) > _INT32_MAX:
      raise ValueError(f"HeteroGraph: at most 2**31 - 1 edges, got {len(src)}")
    _check_range(src, num_nodes, "HeteroGraph: src", "num_nodes")
    _check_range(dst, num_nodes, "HeteroGraph: dst", "num_nodes")
    _check_range(etype, len(self.relation_names), "HeteroGraph: etype", "len(relation_names)")
    if not _is_sorted(src, dst, etype, num_nodes, len(self.relation_names)):
        raise ValueError("HeteroGraph: edges must be sorted by (etype, dst, src); "
                         "use HeteroGraph.from_edges to sort them")
    for name, array in arrays.items():
      set_(name, _read_only(array.astype(np.int32)))

    if self.node_type_offsets is None:
      if len(self.node_type_names) != 1:
        raise ValueError(f"HeteroGraph: node_type_offsets is needed for "
                         f"{len(self.node_type_names)} node types")
    else:
      offsets = _index_array(self.node_type_offsets, "HeteroGraph: node_type_offsets")
      if len(offsets) != len(self.node_type_names) + 1:
        raise ValueError(f"HeteroGraph: node_type_offsets must have len(node_type_names) + 1 = "
                         f"{len(self.node_type_names) + 1} entries, got {len(offsets)}")
      if offsets[0] != 0 or offsets[-1] != num_nodes or (np.diff(offsets) < 0).any():
        raise ValueError(f"HeteroGraph: node_type_offsets must rise from 0 to num_nodes="
                         f"{num_nodes}, got {offsets.tolist()}")
      set_("node_type_offsets", _read_only(offsets))

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
    return (f"HeteroGraph(num_nodes={self.num_nodes}, num_edges={self.num_edges}, "
            f"num_relations={self.num_relations}{types})")

  # -- derived arrays (computed once) ----------------------------------------------------------

  @functools.cached_property
  def relation_offsets(self) -> np.ndarray:
    """int64[R+1]: the edges of relation r are `[offsets[r], offsets[r + 1])`."""
    counts = np.bincount(self.etype, minlength=self.num_relations)
    return _read_only(np.concatenate([[0], np.cumsum(counts)]).astype(np.int64))

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
    counts = np.bincount(node, minlength=self.num_nodes)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    edge_ids = np.argsort(node, kind="stable").astype(np.int32)
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
        e = self.num_edges
        starts = np.flatnonzero(np.concatenate(
            [[e > 0], (self.etype[1:] != self.etype[:-1]) | (self.dst[1:] != self.dst[:-1])]))
        lengths = np.diff(np.append(starts, e))
        norm = np.repeat((1.0 / lengths).astype(np.float32), lengths)
      self._norms[kind] = _read_only(norm)
    return self._norms[kind]

  # -- construction ---------------------------------------------------------------------------

  @classmethod
  def from_edges(cls, src: Any, dst: Any, etype: Any, *, num_nodes: int | None = None,
                 relation_names: Sequence[str] | None = None, add_inverse: bool = False,
                 node_type_names: Sequence[str] = ("node",),
                 node_type_offsets: Any = None) -> HeteroGraph:
    """Builds a graph from edge arrays in any order: checks them, then sorts by (etype, dst, src).

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
    """
    src = _index_array(src, "from_edges: src")
    dst = _index_array(dst, "from_edges: dst")
    etype = _index_array(etype, "from_edges: etype")
    if not len(src) == len(dst) == len(etype):
      raise ValueError(f"from_edges: src, dst and etype must have one length; got "
                       f"{len(src)}, {len(dst)}, {len(etype)}")
    if num_nodes is None:
      if node_type_offsets is not None:
        num_nodes = int(np.asarray(node_type_offsets)[-1])
      else:
        num_nodes = int(max(src.max(initial=-1), dst.max(initial=-1))) + 1
    elif isinstance(num_nodes, bool) or not isinstance(num_nodes, (int, np.integer)):
      raise TypeError(f"from_edges: num_nodes must be an int, got {num_nodes!r}")
    elif num_nodes < 0:
      raise ValueError(f"from_edges: num_nodes must be >= 0, got {num_nodes}")
    _check_range(src, num_nodes, "from_edges: src", "num_nodes")
    _check_range(dst, num_nodes, "from_edges: dst", "num_nodes")
    if relation_names is None:
      relation_names = tuple(f"r{i}" for i in range(int(etype.max(initial=-1)) + 1))
    elif isinstance(relation_names, str):
      raise TypeError("from_edges: relation_names must be a sequence of names, not a string")
    relation_names = tuple(str(n) for n in relation_names)
    _check_range(etype, len(relation_names), "from_edges: etype", "len(relation_names)")
    if add_inverse:
      num = len(relation_names)
      src, dst = np.concatenate([src, dst]), np.concatenate([dst, src])
      etype = np.concatenate([etype, etype + num])
      relation_names = relation_names + tuple(f"rev_{n}" for n in relation_names)
    order = _sort_order(src, dst, etype, num_nodes, len(relation_names))
    return cls(num_nodes, src[order], dst[order], etype[order], relation_names,
               tuple(node_type_names), node_type_offsets)

  @classmethod
  def from_edge_list(cls, path: str | os.PathLike, *, add_inverse: bool = True,
                     delimiter: str | None = None) -> tuple[HeteroGraph, list[str]]:
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
        raise ValueError(f"from_edge_list: {path}:{number}: expected 'head relation tail', "
                         f"got {line!r}")
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
    graph = cls.from_edges(src, dst, etype, num_nodes=len(node_names),
                           relation_names=relation_names, add_inverse=add_inverse)
    return graph, node_names

  # -- jraph ----------------------------------------------------------------------------------

  def to_jraph(self):
    """This graph as a single `jraph.GraphsTuple` (host NumPy arrays; `jax.device_put` them).

    senders=src, receivers=dst, edges={"etype": etype}, no node or global features.
    """
    import jraph  # an optional dependency
    return jraph.GraphsTuple(
        nodes=None, edges={"etype": np.asarray(self.etype)}, senders=np.asarray(self.src),
        receivers=np.asarray(self.dst), n_node=np.array([self.num_nodes], np.int32),
        n_edge=np.array([self.num_edges], np.int32), globals=None)

  @classmethod
  def from_jraph(cls, graphs_tuple: Any, *, etype_key: str = "etype",
                 relation_names: Sequence[str] | None = None) -> HeteroGraph:
    """Builds a graph from a `jraph.GraphsTuple` whose `edges[etype_key]` holds edge types.

    A batch of several graphs becomes one graph (jraph's node ids are already global over the
    batch). With `edges=None` every edge gets relation 0.
    """
    edges = graphs_tuple.edges
    senders = np.asarray(graphs_tuple.senders)
    if edges is None:
      etype = np.zeros(senders.shape, np.int64)
    elif isinstance(edges, Mapping):
      if etype_key not in edges:
        raise ValueError(f"from_jraph: etype_key {etype_key!r} is not in the edges; keys: "
                         f"{sorted(edges)}")
      etype = np.asarray(edges[etype_key])
    else:
      raise TypeError(f"from_jraph: edges must be a mapping holding {etype_key!r} or None, got "
                      f"{type(edges).__name__}")
    num_nodes = int(np.sum(np.asarray(graphs_tuple.n_node)))
    return cls.from_edges(senders, np.asarray(graphs_tuple.receivers), etype,
                          num_nodes=num_nodes, relation_names=relation_names)
