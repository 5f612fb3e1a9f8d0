"""HeteroData: a heterograph as a user brings it, with node data per type.

In the spirit of PyG's `HeteroData`: edges per ``(src_type, relation, dst_type)`` with ids local
to their node type, and per node type its arrays — features ``"x"``, integer labels ``"y"``
(negative: none), split masks ``"train_mask"``, ``"val_mask"``, ``"test_mask"``, and anything
else a user keeps with the nodes. Everything jaxdata builds for training derives from it: the
typed graph (`graph`), the trainers' dataset (`to_dataset`) and the mini-batch loader
(`jaxdata.loader.Loader.from_data`).
It converts losslessly to and from PyG's `HeteroData` (`to_pyg`, `from_pyg`), DGL-style dicts
(`to_dgl_dict`, `from_dgl_dict`) and a `jraph.GraphsTuple` (`to_jraph`, `from_jraph`).

    >>> import numpy as np
    >>> data = HeteroData(
    ...     {("author", "writes", "paper"): ([0, 1, 1], [0, 0, 1])},
    ...     x={"paper": np.ones((2, 4), np.float32)}, y={"paper": [1, 0]},
    ...     num_nodes={"author": 2})
    >>> data
    HeteroData(author=2 [], paper=2 [x, y]; ('author', 'writes', 'paper')=3)
    >>> data.graph().relation_names
    ('writes', 'rev_writes')

Arrays stay as given where they can (a memory-mapped ``.npy`` stays on disk until read).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxdata.data.graph import HeteroGraph
from jaxdata.data.mag import MagDataset

EdgeType = tuple[str, str, str]
#: The node arrays with a meaning to jaxdata (others are kept and converted as they are).
FEATURES, LABELS = "x", "y"
SPLITS = ("train", "val", "test")


def _edge_type(key: Any) -> EdgeType:
  if not (isinstance(key, tuple) and len(key) == 3 and all(isinstance(k, str) for k in key)):
    raise TypeError(
      f"HeteroData: an edge type is a (src_type, relation, dst_type) tuple of str, got {key!r}"
    )
  return key


def _edge_index(value: Any, key: EdgeType) -> np.ndarray:
  """int64 [2, E] from (src, dst), a [2, E] array or tensor, or a [E, 2] array."""
  if isinstance(value, tuple) and len(value) == 2:
    src, dst = (np.asarray(_numpy(v)).reshape(-1) for v in value)
    if src.shape != dst.shape:
      raise ValueError(
        f"HeteroData: edges[{key!r}]: {src.size} sources and {dst.size} destinations"
      )
    index = np.stack([src, dst]) if src.size else np.zeros((2, 0), np.int64)
  else:
    index = np.asarray(_numpy(value))
    if index.ndim == 2 and index.shape[0] != 2 and index.shape[1] == 2:
      index = index.T
    if index.ndim != 2 or index.shape[0] != 2:
      raise ValueError(
        f"HeteroData: edges[{key!r}] must be (src, dst) or a [2, E] array, got shape {index.shape}"
      )
  if index.size and not np.issubdtype(index.dtype, np.integer):
    raise TypeError(f"HeteroData: edges[{key!r}] must hold integer node ids, got {index.dtype}")
  return index.astype(np.int64, copy=False)


def _numpy(value: Any) -> Any:
  """A torch tensor's NumPy array (on the CPU); anything else as it is."""
  if hasattr(value, "detach") and hasattr(value, "cpu"):
    return value.detach().cpu().numpy()
  return value


class HeteroData:
  """A heterogeneous graph: edges per relation and arrays per node type.

  Args:
    edges: ``{(src_type, relation, dst_type): edges}``, each as ``(src, dst)``, a ``[2, E]``
      array (PyG's ``edge_index``, a torch tensor too) or an ``[E, 2]`` array; ids local to
      each node type.
    num_nodes: ``{node type: count}``; a type's count defaults to its arrays' rows, else to
      its largest id in the edges plus one. The order of node types is that of `num_nodes`,
      then of the arrays, then of the edges.
    x, y: ``{node type: array}`` features (``[N_t, d]``) and integer labels (``[N_t]``,
      negative: no label).
    train, val, test: ``{node type: ids or boolean mask}``, stored as masks.
    **node_data: more ``{node type: array}`` by name, kept with the nodes.

  Mistakes raise ValueError or TypeError naming the argument and the node or edge type.
  """

  def __init__(
    self,
    edges: Mapping[EdgeType, Any] | None = None,
    *,
    num_nodes: Mapping[str, int] | None = None,
    x: Mapping[str, Any] | None = None,
    y: Mapping[str, Any] | None = None,
    train: Mapping[str, Any] | None = None,
    val: Mapping[str, Any] | None = None,
    test: Mapping[str, Any] | None = None,
    **node_data: Mapping[str, Any],
  ):
    self.edges: dict[EdgeType, np.ndarray] = {
      _edge_type(k): _edge_index(v, k) for k, v in (edges or {}).items()
    }
    arrays: dict[str, Mapping[str, Any]] = dict(node_data)
    for name, given in ((FEATURES, x), (LABELS, y)):
      if given is not None:
        arrays[name] = given
    order = list(num_nodes or {})
    for name, per_type in arrays.items():
      if not isinstance(per_type, Mapping):
        raise TypeError(f"HeteroData: {name} must be a dict {{node type: array}}, got {per_type!r}")
      order += list(per_type)
    for s, _, d in self.edges:
      order += [s, d]
    for split in (train, val, test):
      order += list(split or {})
    types = list(dict.fromkeys(order))
    for t in types:
      if not isinstance(t, str):
        raise TypeError(f"HeteroData: node types are str, got {t!r}")
    counts: dict[str, int | None] = {t: None for t in types}
    for t, n in (num_nodes or {}).items():
      if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"HeteroData: num_nodes[{t!r}] must be a count >= 0, got {n!r}")
      counts[t] = int(n)
    self.nodes: dict[str, dict[str, Any]] = {t: {} for t in types}
    for name, per_type in arrays.items():
      for t, value in per_type.items():
        value = _numpy(value)
        value = value if isinstance(value, np.ndarray) else np.asarray(value)
        if value.ndim == 0:
          raise ValueError(f"HeteroData: {name}[{t!r}] must have a row per node, got a scalar")
        if counts[t] is None:
          counts[t] = len(value)
        self.nodes[t][name] = value
    for (s, _, d), index in self.edges.items():
      for t, ids in ((s, index[0]), (d, index[1])):
        if counts[t] is None:
          counts[t] = int(ids.max()) + 1 if ids.size else 0
    self.num_nodes: dict[str, int] = {t: int(counts[t] or 0) for t in types}
    for name, split in zip(SPLITS, (train, val, test)):
      for t, value in (split or {}).items():
        self.nodes[t][f"{name}_mask"] = self._mask(value, t, name)
    self._check()

  def _mask(self, value: Any, node_type: str, name: str) -> np.ndarray:
    value = np.asarray(_numpy(value))
    n = self.num_nodes[node_type]
    if value.dtype == bool:
      return value
    if value.size and not np.issubdtype(value.dtype, np.integer):
      raise TypeError(f"HeteroData: {name}[{node_type!r}] must be node ids or a boolean mask")
    if value.size and (value.min() < 0 or value.max() >= n):
      raise ValueError(
        f"HeteroData: {name}[{node_type!r}] holds ids outside [0, {n}) of node type {node_type!r}"
      )
    mask = np.zeros(n, bool)
    mask[value.astype(np.int64)] = True
    return mask

  def _check(self) -> None:
    for t, arrays in self.nodes.items():
      n = self.num_nodes[t]
      for name, value in arrays.items():
        if len(value) != n:
          arg = name.removesuffix("_mask") if name.endswith("_mask") else name
          raise ValueError(
            f"HeteroData: {arg}[{t!r}] has {len(value)} rows, node type {t!r} has {n} nodes"
          )
      y = arrays.get(LABELS)
      if y is not None and (y.ndim != 1 or (y.size and not np.issubdtype(y.dtype, np.integer))):
        raise TypeError(
          f"HeteroData: y[{t!r}] must be one integer label per node, got {y.dtype} {y.shape}"
        )
      x = arrays.get(FEATURES)
      if x is not None and x.ndim != 2:
        raise ValueError(f"HeteroData: x[{t!r}] must be [nodes, features], got shape {x.shape}")
    for key, index in self.edges.items():
      for end, t, ids in (("source", key[0], index[0]), ("destination", key[2], index[1])):
        n = self.num_nodes[t]
        if ids.size and (ids.min() < 0 or ids.max() >= n):
          raise ValueError(
            f"HeteroData: edges[{key!r}] has {end} ids outside [0, {n}) of node type {t!r}"
          )

  # -- what it holds ------------------------------------------------------------------------------

  @property
  def node_types(self) -> tuple[str, ...]:
    return tuple(self.num_nodes)

  @property
  def edge_types(self) -> tuple[EdgeType, ...]:
    return tuple(self.edges)

  def _by_type(self, name: str) -> dict[str, Any]:
    return {t: a[name] for t, a in self.nodes.items() if name in a}

  @property
  def x_dict(self) -> dict[str, Any]:
    """``{node type: features}`` of the types that have features."""
    return self._by_type(FEATURES)

  @property
  def y_dict(self) -> dict[str, np.ndarray]:
    return self._by_type(LABELS)

  @property
  def edge_index_dict(self) -> dict[EdgeType, np.ndarray]:
    return dict(self.edges)

  def split(self, name: str) -> dict[str, np.ndarray]:
    """``{node type: int64 ids}`` of split `name` ("train", "val" or "test")."""
    if name not in SPLITS:
      raise ValueError(f"HeteroData.split: name must be one of {SPLITS}, got {name!r}")
    return {t: np.flatnonzero(m) for t, m in self._by_type(f"{name}_mask").items()}

  def __repr__(self) -> str:
    types = ", ".join(f"{t}={n} [{', '.join(self.nodes[t])}]" for t, n in self.num_nodes.items())
    edges = ", ".join(f"{k}={v.shape[1]}" for k, v in self.edges.items())
    return f"HeteroData({types}; {edges})"

  def __eq__(self, other: object) -> bool:
    if not isinstance(other, HeteroData):
      return NotImplemented

    def same(a, b) -> bool:  # the same keys, and arrays equal in value and dtype
      return a.keys() == b.keys() and all(
        np.array_equal(a[k], b[k]) and np.asarray(a[k]).dtype == np.asarray(b[k]).dtype for k in a
      )

    return (
      list(self.num_nodes.items()) == list(other.num_nodes.items())
      and list(self.edges) == list(other.edges)
      and same(self.edges, other.edges)
      and all(same(self.nodes[t], other.nodes[t]) for t in self.nodes)
    )

  __hash__ = None  # type: ignore[assignment]

  # -- what jaxdata builds from it ------------------------------------------------------------

  def graph(self, *, add_inverse: bool = True, first: str | None = None) -> HeteroGraph:
    """The typed graph (`HeteroGraph.from_typed_edges`): node types in this order (type `first`
    moved ahead of the others), relations in the order of `edges`, reverse relations added
    unless ``add_inverse=False``."""
    order = sorted(self.num_nodes, key=lambda t: t != first)  # stable: `first`, then the rest
    return HeteroGraph.from_typed_edges(
      {k: (v[0], v[1]) for k, v in self.edges.items()},
      {t: self.num_nodes[t] for t in order},
      add_inverse=add_inverse,
    )

  def to_dataset(self, target: str, *, name: str = "data", add_inverse: bool = True):
    """The trainers' dataset (`jaxdata.data.mag.MagDataset`) for classifying the nodes of
    type `target`: node types reordered with `target` first (the trainers' convention), its
    labels and splits, float32 features (a type without features gets none: width 0; give it
    learnable embeddings with the trainers' ``--embed``)."""
    if target not in self.num_nodes:
      raise ValueError(
        f"HeteroData.to_dataset: target {target!r} is not a node type; the types are "
        f"{list(self.num_nodes)}"
      )
    y = self.nodes[target].get(LABELS)
    if y is None:
      raise ValueError(f"HeteroData.to_dataset: the target type {target!r} has no labels (y)")
    splits = {s: self.nodes[target].get(f"{s}_mask") for s in SPLITS}
    if splits["train"] is None:
      raise ValueError(f"HeteroData.to_dataset: the target type {target!r} has no train split")
    graph = self.graph(add_inverse=add_inverse, first=target)
    features = tuple(
      np.asarray(self.nodes[t].get(FEATURES, np.zeros((self.num_nodes[t], 0))), np.float32)
      for t in graph.node_type_names
    )
    labels = np.asarray(y)
    known = labels[labels >= 0]
    ids = {
      s: np.flatnonzero(m) if m is not None else np.zeros(0, np.int64) for s, m in splits.items()
    }
    unlabelled = [s for s, i in ids.items() if i.size and (labels[i] < 0).any()]
    if unlabelled:
      raise ValueError(
        f"HeteroData.to_dataset: the {unlabelled[0]} split of {target!r} holds nodes without a "
        "label (y < 0)"
      )
    return MagDataset(
      graph=graph,
      relation_types=tuple(graph.relation_types or ()),
      features=features,
      labels=np.where(labels >= 0, labels, 0).astype(np.int32),
      num_classes=int(known.max()) + 1 if known.size else 1,
      train_papers=ids["train"],
      val_papers=ids["val"],
      test_papers=ids["test"],
      name=name,
      target=target,
    )

  # -- conversions ----------------------------------------------------------------------------

  def to_pyg(self):
    """This graph as a `torch_geometric.data.HeteroData` (needs torch and PyG): every node
    array under its name, ``num_nodes`` per type, ``edge_index`` per edge type."""
    import torch  # optional (the oracle extra)
    from torch_geometric.data import HeteroData as PygHeteroData  # optional, as torch

    out = PygHeteroData()
    for t, n in self.num_nodes.items():
      out[t].num_nodes = n
      for name, value in self.nodes[t].items():
        out[t][name] = torch.from_numpy(np.array(value))
    for key, index in self.edges.items():
      out[key].edge_index = torch.from_numpy(np.array(index))
    return out

  @classmethod
  def from_pyg(cls, data: Any) -> HeteroData:
    """From a `torch_geometric.data.HeteroData`: its node types (with ``num_nodes``), every
    node attribute with a row per node, and every edge type's ``edge_index``. Edge
    attributes other than ``edge_index`` are refused (this container has none)."""
    num_nodes = {t: int(data[t].num_nodes) for t in data.node_types}
    arrays: dict[str, dict[str, Any]] = {}
    for t in data.node_types:
      for name, value in data[t].items():
        if name == "num_nodes":
          continue
        arrays.setdefault(name, {})[t] = np.asarray(_numpy(value))
    edges = {}
    for key in data.edge_types:
      extra = sorted(set(data[key].keys()) - {"edge_index"})
      if extra:
        raise ValueError(
          f"HeteroData.from_pyg: edge type {key} has attributes {extra}; only edge_index converts"
        )
      edges[tuple(key)] = data[key].edge_index
    data_x, data_y = arrays.pop(FEATURES, None), arrays.pop(LABELS, None)
    return cls(edges, num_nodes=num_nodes, x=data_x, y=data_y, **arrays)

  def to_dgl_dict(self) -> dict[str, Any]:
    """DGL-style dicts: ``{"num_nodes_dict", "data_dict": {edge type: (src, dst)}, "ndata":
    {name: {node type: array}}}`` (``dgl.heterograph(data_dict, num_nodes_dict)`` takes the
    first two; ``g.nodes[t].data[name] = array`` the rest)."""
    ndata: dict[str, dict[str, Any]] = {}
    for t, arrays in self.nodes.items():
      for name, value in arrays.items():
        ndata.setdefault(name, {})[t] = value
    return {
      "num_nodes_dict": dict(self.num_nodes),
      "data_dict": {k: (v[0], v[1]) for k, v in self.edges.items()},
      "ndata": ndata,
    }

  @classmethod
  def from_dgl_dict(cls, d: Mapping[str, Any]) -> HeteroData:
    """The inverse of `to_dgl_dict`."""
    ndata = dict(d.get("ndata", {}))
    return cls(
      d["data_dict"],
      num_nodes=d.get("num_nodes_dict"),
      x=ndata.pop(FEATURES, None),
      y=ndata.pop(LABELS, None),
      **ndata,
    )

  def to_jraph(self):
    """One `jraph.GraphsTuple` (host NumPy arrays): global node ids in type order, senders
    and receivers over them, ``edges["etype"]`` the index of each edge's type; ``nodes`` holds
    ``"type"`` (each node's type index) and, per node array and type, ``"name/type"``: the
    type's rows at its nodes, zeros elsewhere; ``globals`` the names (``"node_types"``,
    ``"edge_types"`` as "src|relation|dst"), so `from_jraph` restores everything."""
    import jraph  # optional (the jraph extra)

    offsets = np.concatenate([[0], np.cumsum(list(self.num_nodes.values()))]).astype(np.int64)
    start = dict(zip(self.num_nodes, offsets[:-1]))
    total = int(offsets[-1])
    nodes: dict[str, np.ndarray] = {
      "type": np.repeat(
        np.arange(len(self.num_nodes), dtype=np.int32), list(self.num_nodes.values())
      )
    }
    for t, arrays in self.nodes.items():
      for name, value in arrays.items():
        value = np.asarray(value)
        full = np.zeros((total, *value.shape[1:]), value.dtype)
        full[start[t] : start[t] + len(value)] = value
        nodes[f"{name}/{t}"] = full
    senders = [index[0] + start[s] for (s, _, _), index in self.edges.items()]
    receivers = [index[1] + start[d] for (_, _, d), index in self.edges.items()]
    etype = [np.full(index.shape[1], i, np.int32) for i, index in enumerate(self.edges.values())]
    cat = lambda parts, dtype: np.concatenate(parts) if parts else np.zeros(0, dtype)  # noqa: E731
    return jraph.GraphsTuple(
      nodes=nodes,  # pyright: ignore[reportArgumentType]
      edges={"etype": cat(etype, np.int32)},  # pyright: ignore[reportArgumentType]
      senders=cat(senders, np.int64),  # pyright: ignore[reportArgumentType]
      receivers=cat(receivers, np.int64),  # pyright: ignore[reportArgumentType]
      n_node=np.array([total], np.int64),  # pyright: ignore[reportArgumentType]
      n_edge=np.array([sum(i.shape[1] for i in self.edges.values())], np.int64),  # pyright: ignore[reportArgumentType]
      globals={  # pyright: ignore[reportArgumentType]
        "node_types": np.array([list(self.num_nodes)], dtype=object),
        "edge_types": np.array([["|".join(k) for k in self.edges]], dtype=object),
      },
    )

  @classmethod
  def from_jraph(cls, g: Any) -> HeteroData:
    """The inverse of `to_jraph` (a GraphsTuple it made, or one laid out the same way)."""
    try:
      names = [str(t) for t in np.asarray(g.globals["node_types"])[0]]
      edge_types = [tuple(str(e).split("|")) for e in np.asarray(g.globals["edge_types"])[0]]
      kinds = np.asarray(g.nodes["type"])
    except (KeyError, TypeError, IndexError) as e:
      raise ValueError(
        "HeteroData.from_jraph: the GraphsTuple lacks the names and node types to_jraph writes "
        f"(globals 'node_types' and 'edge_types', nodes 'type'): {e}"
      ) from None
    counts = np.bincount(kinds, minlength=len(names))
    start = np.concatenate([[0], np.cumsum(counts)])
    etype = np.asarray(g.edges["etype"])
    senders, receivers = np.asarray(g.senders), np.asarray(g.receivers)
    edges = {}
    for i, key in enumerate(edge_types):
      pick = etype == i
      s, d = names.index(key[0]), names.index(key[2])
      edges[key] = np.stack([senders[pick] - start[s], receivers[pick] - start[d]])
    arrays: dict[str, dict[str, Any]] = {}
    for k, value in g.nodes.items():
      if k == "type":
        continue
      name, t = k.rsplit("/", 1)
      i = names.index(t)
      arrays.setdefault(name, {})[t] = np.asarray(value)[start[i] : start[i + 1]]
    num_nodes = dict(zip(names, (int(c) for c in counts)))
    data_x, data_y = arrays.pop(FEATURES, None), arrays.pop(LABELS, None)
    return cls(edges, num_nodes=num_nodes, x=data_x, y=data_y, **arrays)
