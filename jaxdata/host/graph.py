"""HostGraph: a graph's structure, edge relations and node features in host memory that the GPU
reads directly."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxdata.host.table import HostTable


class HostGraph:
  """A graph's in-neighbour CSR, and optionally its node features, in (pinned) host memory.

  The neighbours of node v are the nodes u with an edge u -> v: the nodes v aggregates messages
  from, and what `sample_neighbors` draws. `indptr` (int64, num_nodes + 1) and `indices` (int32,
  num_edges) live in two `HostTable`s, so with a GPU the sampling kernel reads them straight over
  PCIe (zero-copy) and the graph may be far larger than GPU memory.

  A relational (heterogeneous) graph also has `etypes`: the relation of every edge, aligned with
  `indices`, in a third (pinned) int32 table; `sample_neighbors` then reports the relation of
  every edge it draws (`Blocks.etypes`). Relations are numbered 0 .. num_relations - 1.

  A HostGraph is a pytree of its tables (their handles are its leaves, their shapes and dtypes
  its static part, like `HostTable`): pass it to `jit` or close over it; graphs of one size
  share an executable and none is held alive by one. It owns its structure tables and the
  feature table it made from an array; a `HostTable` passed in as `features` stays the caller's
  to close. `close()` (or a `with` block) releases what it owns. A graph with no edges is
  allowed (every node has no neighbours). Copying a HostGraph (`copy.copy`) is refused: build
  another one from the same arrays.

  Example:
    >>> with HostGraph.from_edges(senders=[0, 1, 2], receivers=[1, 2, 0], num_nodes=3,
    ...                           features=np.eye(3, dtype=np.float32)) as g:
    ...   blocks = sample_neighbors(g, jnp.array([0, 1]), fanouts=(2,), key=jax.random.key(0))
    >>> # node 1 hears node 0 through relations 0 and 1 (two edges), node 2 through relation 0
    >>> with HostGraph.from_edges([0, 0, 2], [1, 1, 1], etypes=[0, 1, 0]) as typed:
    ...   blocks = sample_neighbors(typed, jnp.array([1]), (2,), jax.random.key(0))
    ...   # blocks.etypes[1]: the relations of the two edges drawn for node 1

  Args:
    indptr: int array [num_nodes + 1], non-decreasing from 0 to num_edges.
    indices: int array [num_edges] of node ids in [0, num_nodes) (may be empty).
    features: node features, [num_nodes, dim]: a HostTable (not owned) or an array (copied
      into a new, owned HostTable).
    etypes: the relation of every edge, int array [num_edges] aligned with `indices`, values
      in [0, num_relations) (None: an untyped graph). Copied into a new, owned int32 table.
    num_relations: how many relations there are (default: max(etypes) + 1; give it when the
      last relations have no edges). Only with `etypes`.
    pinned: as for `HostTable` (default: when a GPU is visible).
  """

  def __init__(
    self,
    indptr: Any,
    indices: Any,
    *,
    features: Any = None,
    etypes: Any = None,
    num_relations: int | None = None,
    pinned: bool | None = None,
  ):
    self._owned: list[HostTable] = []
    self._indptr = self._indices = self._features = self._etypes = None
    indptr = _as_int_array(indptr, "indptr")
    indices = _as_int_array(indices, "indices")
    _check_csr(indptr, indices)
    self._num_nodes = len(indptr) - 1
    self._num_edges = len(indices)
    etypes, self._num_relations = _check_etypes(etypes, num_relations, self._num_edges)
    if not len(indices):
      indices = np.zeros(1, np.int32)  # a table has at least one row; indptr never reaches it
      if etypes is not None:
        etypes = np.zeros(1, np.int32)  # one row per row of indices
    try:
      self._indptr = self._own(
        HostTable(indptr.astype(np.int64, copy=False).reshape(-1, 1), pinned=pinned)
      )
      self._indices = self._own(
        HostTable(indices.astype(np.int32, copy=False).reshape(-1, 1), pinned=pinned)
      )
      self._features = None
      if etypes is not None:
        self._etypes = self._own(
          HostTable(etypes.astype(np.int32, copy=False).reshape(-1, 1), pinned=pinned)
        )
      if features is not None:
        if not isinstance(features, HostTable):
          features = self._own(HostTable(features, pinned=pinned))
        if features.closed:
          raise ValueError(f"HostGraph: features {features!r} is closed")
        if features.shape[0] != self._num_nodes:
          raise ValueError(
            f"HostGraph: features has {features.shape[0]} rows, the graph {self._num_nodes} nodes"
          )
        self._features = features
    except BaseException:
      self.close()
      raise

  def _own(self, table: HostTable) -> HostTable:
    self._owned.append(table)
    return table

  # -- construction -------------------------------------------------------------------------

  @classmethod
  def from_edges(
    cls,
    senders: Any,
    receivers: Any,
    num_nodes: int | None = None,
    *,
    features: Any = None,
    etypes: Any = None,
    num_relations: int | None = None,
    pinned: bool | None = None,
  ) -> HostGraph:
    """The graph with an edge senders[e] -> receivers[e] for every e (duplicates kept), of
    relation etypes[e] if given.

    Neighbour lists keep the edges' order within each receiver (a stable counting sort). Two
    edges between the same nodes with different relations are two edges.
    """
    senders = _as_int_array(senders, "senders", "HostGraph.from_edges")
    receivers = _as_int_array(receivers, "receivers", "HostGraph.from_edges")
    if senders.shape != receivers.shape or senders.ndim != 1:
      raise ValueError(
        f"HostGraph.from_edges: senders {senders.shape} and receivers "
        f"{receivers.shape} must be 1-D arrays of one length"
      )
    if num_nodes is None:
      num_nodes = max([int(a.max()) for a in (senders, receivers) if a.size] + [-1]) + 1
    if isinstance(num_nodes, (bool, np.bool_)) or not isinstance(num_nodes, (int, np.integer)):
      raise TypeError(f"HostGraph.from_edges: num_nodes must be an integer, got {num_nodes!r}")
    num_nodes = int(num_nodes)
    if num_nodes < 1:
      raise ValueError("HostGraph.from_edges: the graph is empty (no nodes)")
    if num_nodes > np.iinfo(np.int32).max:  # before the counts array of that size is made
      raise ValueError(f"HostGraph.from_edges: {num_nodes} nodes do not fit int32 node ids")
    for name, a in (("senders", senders), ("receivers", receivers)):
      if a.size and (int(a.min()) < 0 or int(a.max()) >= num_nodes):
        raise ValueError(f"HostGraph.from_edges: {name} holds ids outside [0, {num_nodes})")
    counts = np.bincount(receivers, minlength=num_nodes)
    indptr = np.zeros(num_nodes + 1, np.int64)
    np.cumsum(counts, out=indptr[1:])
    order = np.argsort(receivers, kind="stable")
    if etypes is not None:
      etypes = _as_int_array(etypes, "etypes", "HostGraph.from_edges")
      if etypes.shape != senders.shape:
        raise ValueError(
          f"HostGraph.from_edges: etypes {etypes.shape} must have one entry per "
          f"edge, {senders.shape}"
        )
      etypes = etypes[order]
    return cls(
      indptr,
      senders[order].astype(np.int32),
      features=features,
      etypes=etypes,
      num_relations=num_relations,
      pinned=pinned,
    )

  @classmethod
  def from_hetero(cls, graph: Any, *, pinned: bool | None = None) -> HostGraph:
    """A `jaxdata.data.HeteroGraph`'s in-edges grouped by destination, with their relations:
    the layout relational sampling reads (`jaxdata.loader.sample_blocks`). The grouping is the
    graph's own CSC (native, multithreaded)."""
    offsets, edge_ids = graph.csc()
    return cls(
      offsets,
      graph.src[edge_ids],
      etypes=graph.etype[edge_ids],
      num_relations=graph.num_relations,
      pinned=pinned,
    )

  @classmethod
  def from_jraph(
    cls,
    graph: Any,
    *,
    features: Any = None,
    etypes: Any = None,
    num_relations: int | None = None,
    pinned: bool | None = None,
  ) -> HostGraph:
    """From a `jraph.GraphsTuple` (all its graphs as one): edges senders -> receivers.

    `features` defaults to `graph.nodes` when that is a 2-D array; `etypes`, if given, is the
    relation of every edge in `graph.senders`' order.
    """
    if features is None and getattr(graph.nodes, "ndim", 0) == 2:
      features = np.asarray(graph.nodes)
    return cls.from_edges(
      np.asarray(graph.senders),
      np.asarray(graph.receivers),
      int(np.sum(graph.n_node)),
      features=features,
      etypes=etypes,
      num_relations=num_relations,
      pinned=pinned,
    )

  # -- properties ---------------------------------------------------------------------------

  @property
  def num_nodes(self) -> int:
    return self._num_nodes

  @property
  def num_edges(self) -> int:
    return self._num_edges

  @property
  def indptr(self) -> HostTable:
    """The CSR's row pointers: a HostTable of shape (num_nodes + 1, 1), int64."""
    self._check_open("indptr")
    assert self._indptr is not None  # set while the graph is open
    return self._indptr

  @property
  def indices(self) -> HostTable:
    """The CSR's neighbour ids: a HostTable of shape (max(num_edges, 1), 1), int32 (a graph
    with no edges has one unused row)."""
    self._check_open("indices")
    assert self._indices is not None  # set while the graph is open
    return self._indices

  @property
  def etypes(self) -> HostTable | None:
    """The relation of every edge, aligned with `indices`: a HostTable of shape
    (max(num_edges, 1), 1), int32; None for an untyped graph."""
    self._check_open("etypes")
    return self._etypes

  @property
  def num_relations(self) -> int | None:
    """How many relations the edges are typed with (None: an untyped graph)."""
    return self._num_relations

  @property
  def features(self) -> HostTable | None:
    self._check_open("features")
    return self._features

  @property
  def closed(self) -> bool:
    return self._indices is None or self._indices.closed

  def in_degrees(self) -> np.ndarray:
    """Number of neighbours of every node (int64 [num_nodes])."""
    return np.diff(self.indptr.as_numpy()[:, 0])

  def __repr__(self) -> str:
    indices = self._indices
    state = (
      "closed" if self.closed or indices is None else ("pinned" if indices.pinned else "unpinned")
    )
    feats = (
      ""
      if self.closed or self._features is None
      else (f", features={self._features.shape[1]}x{self._features.dtype.name}")
    )
    rels = "" if self._num_relations is None else f", relations={self._num_relations}"
    return f"HostGraph(nodes={self._num_nodes}, edges={self._num_edges}{rels}{feats}, {state})"

  # -- lifetime -----------------------------------------------------------------------------

  def __copy__(self) -> HostGraph:
    raise TypeError(
      "HostGraph cannot be copied (a copy would share the tables it owns and "
      "closing one would close the other): build another HostGraph from the same "
      "arrays, e.g. HostGraph(g.indptr.as_numpy()[:, 0], ...)"
    )

  def __deepcopy__(self, memo: dict) -> HostGraph:
    return self.__copy__()

  def close(self) -> None:
    """Releases the tables this graph owns. Safe to call twice."""
    for table in self._owned:
      table.close()
    self._owned = []
    self._indptr = self._indices = self._features = self._etypes = None

  def __enter__(self) -> HostGraph:
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()

  def _check_open(self, what: str) -> None:
    if self.closed:
      raise ValueError(f"{what}: {self!r} is closed")


def _as_int_array(a: Any, name: str, what: str = "HostGraph") -> np.ndarray:
  """An integer NumPy array; an empty list (NumPy's float64) counts as an empty int64 one."""
  a = np.asarray(a)
  if a.size == 0 and not np.issubdtype(a.dtype, np.integer):
    return a.astype(np.int64)
  if not np.issubdtype(a.dtype, np.integer):
    raise TypeError(f"{what}: {name} must be integers, got {a.dtype}")
  return a


def _check_etypes(
  etypes: Any, num_relations: Any, num_edges: int
) -> tuple[np.ndarray | None, int | None]:
  """The relations as an int array and their number, checked; (None, None) for no etypes."""
  if etypes is None:
    if num_relations is not None:
      raise ValueError("HostGraph: num_relations given without etypes")
    return None, None
  etypes = _as_int_array(etypes, "etypes")
  if etypes.shape != (num_edges,):
    raise ValueError(
      f"HostGraph: etypes must have one entry per edge ({num_edges}), got shape {etypes.shape}"
    )
  if etypes.size and int(etypes.min()) < 0:
    raise ValueError(f"HostGraph: etypes must be >= 0, got {int(etypes.min())}")
  if etypes.size and int(etypes.max()) > np.iinfo(np.int32).max:
    raise ValueError(f"HostGraph: etypes {int(etypes.max())} does not fit int32")
  found = int(etypes.max()) + 1 if etypes.size else 0
  if num_relations is None:
    return etypes, found
  if isinstance(num_relations, (bool, np.bool_)) or not isinstance(
    num_relations, (int, np.integer)
  ):
    raise TypeError(f"HostGraph: num_relations must be an integer, got {num_relations!r}")
  if num_relations > np.iinfo(np.int32).max:
    raise ValueError(f"HostGraph: num_relations {num_relations} does not fit int32")
  if num_relations < found:
    raise ValueError(
      f"HostGraph: num_relations is {num_relations}, but etypes holds relation {found - 1}"
    )
  return etypes, int(num_relations)


def check_in_degrees(degrees: Any, what: str) -> None:
  """Every node has at most 2**31 - 1 in-edges: the samplers draw int32 positions among a
  node's in-edges (xla_ffi/host/sample.h), which a larger degree would wrap."""
  most = int(degrees.max()) if degrees.size else 0
  if most > np.iinfo(np.int32).max:
    raise ValueError(
      f"{what}: a node has {most} in-edges; sampling supports at most 2**31 - 1 per node"
    )


def _check_csr(indptr: np.ndarray, indices: np.ndarray) -> None:
  if indptr.ndim != 1 or indices.ndim != 1:
    raise ValueError(f"HostGraph: indptr {indptr.shape} and indices {indices.shape} must be 1-D")
  if len(indptr) < 2:
    raise ValueError("HostGraph: the graph is empty (no nodes)")
  num_nodes = len(indptr) - 1
  if num_nodes > np.iinfo(np.int32).max:
    raise ValueError(f"HostGraph: {num_nodes} nodes do not fit int32 node ids")
  degrees = np.diff(indptr)
  if indptr[0] != 0 or indptr[-1] != len(indices) or np.any(degrees < 0):
    raise ValueError("HostGraph: indptr must rise from 0 to len(indices) without decreasing")
  check_in_degrees(degrees, "HostGraph")
  if len(indices) and (indices.min() < 0 or indices.max() >= num_nodes):
    raise ValueError(f"HostGraph: indices holds node ids outside [0, {num_nodes})")


def _flatten(g: HostGraph) -> tuple[tuple[Any, ...], tuple[int, int, int | None]]:
  # The tables are the children (each a handle leaf with its shape and dtype static); nothing
  # that names this graph is static, so a jitted function does not keep it alive.
  return (
    (g._indptr, g._indices, g._features, g._etypes),
    (g._num_nodes, g._num_edges, g._num_relations),
  )


def _unflatten(aux: tuple[int, int, int | None], children: tuple[Any, ...]) -> HostGraph:
  """A view of a graph's tables that owns none of them (inside jit: placeholders)."""
  g = HostGraph.__new__(HostGraph)
  g._owned = []
  g._indptr, g._indices, g._features, g._etypes = children
  g._num_nodes, g._num_edges, g._num_relations = aux
  return g


jax.tree_util.register_pytree_node(HostGraph, _flatten, _unflatten)
