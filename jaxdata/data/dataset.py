"""EntityDataset: a graph with some of its nodes labelled, split into train and test sets."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxdata.data.graph import HeteroGraph


@dataclasses.dataclass(frozen=True, eq=False)
class EntityDataset:
  """A node-classification task: a `HeteroGraph`, labelled train and test nodes, classes.

  This is the shape of the RGCN paper's entity-classification benchmarks (`load_entities`) and
  of `synthetic_entities`. Labels are class ids in [0, num_classes); `class_names[c]` names
  class c. Arrays are converted to their documented dtypes and made read-only.

  Example:
    >>> ds = load_entities("/data/aifb.tgz")
    >>> ds.graph.num_nodes, ds.num_classes, len(ds.train_idx), len(ds.test_idx)
    (8285, 4, 140, 36)

  Attributes:
    name: a short name ("aifb", "synthetic", ...).
    graph: the graph.
    num_classes: the number of classes.
    train_idx, test_idx: int64 node ids of the labelled nodes of each split (disjoint).
    train_y, test_y: int32 class ids of those nodes.
    class_names: num_classes names.
    features: float32[N, F] input node features, or None for featureless graphs (RDF), where a
      model learns an embedding per node instead.
    node_names: optional name of each node (for RDF: the N-Triples term), or None.
  """

  name: str
  graph: HeteroGraph
  num_classes: int
  train_idx: np.ndarray
  train_y: np.ndarray
  test_idx: np.ndarray
  test_y: np.ndarray
  class_names: tuple[str, ...]
  features: np.ndarray | None = None
  node_names: tuple[str, ...] | None = dataclasses.field(default=None, repr=False)

  def __post_init__(self):
    set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
    if not isinstance(self.graph, HeteroGraph):
      raise TypeError(
        f"EntityDataset: graph must be a HeteroGraph, got {type(self.graph).__name__}"
      )
    n = self.graph.num_nodes
    set_("class_names", tuple(str(c) for c in self.class_names))
    if isinstance(self.num_classes, bool) or not isinstance(self.num_classes, (int, np.integer)):
      raise TypeError(f"EntityDataset: num_classes must be an int, got {self.num_classes!r}")
    set_("num_classes", int(self.num_classes))
    if len(self.class_names) != self.num_classes:
      raise ValueError(
        f"EntityDataset: class_names has {len(self.class_names)} names for "
        f"num_classes={self.num_classes}"
      )
    for split in ("train", "test"):
      idx = np.asarray(getattr(self, f"{split}_idx"))
      y = np.asarray(getattr(self, f"{split}_y"))
      for what, array in ((f"{split}_idx", idx), (f"{split}_y", y)):
        if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
          raise TypeError(
            f"EntityDataset: {what} must be a 1-D integer array, got "
            f"{array.dtype} of shape {array.shape}"
          )
      if len(idx) != len(y):
        raise ValueError(
          f"EntityDataset: {split}_idx and {split}_y differ in length: {len(idx)} != {len(y)}"
        )
      if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise ValueError(f"EntityDataset: {split}_idx has node ids outside [0, {n})")
      if y.size and (y.min() < 0 or y.max() >= self.num_classes):
        raise ValueError(f"EntityDataset: {split}_y has classes outside [0, {self.num_classes})")
      set_(f"{split}_idx", _read_only(idx.astype(np.int64)))
      set_(f"{split}_y", _read_only(y.astype(np.int32)))
    if np.intersect1d(self.train_idx, self.test_idx).size:
      raise ValueError("EntityDataset: train_idx and test_idx share nodes")
    if self.features is not None:
      features = np.asarray(self.features, np.float32)
      if features.ndim != 2 or features.shape[0] != n:
        raise ValueError(
          f"EntityDataset: features must have shape (num_nodes={n}, F), got {features.shape}"
        )
      set_("features", _read_only(features))
    if self.node_names is not None:
      set_("node_names", tuple(self.node_names))
      if len(self.node_names) != n:
        raise ValueError(
          f"EntityDataset: node_names has {len(self.node_names)} names for {n} nodes"
        )

  def __repr__(self) -> str:
    features = "None" if self.features is None else f"float32{list(self.features.shape)}"
    return (
      f"EntityDataset({self.name!r}, num_nodes={self.graph.num_nodes}, "
      f"num_edges={self.graph.num_edges}, num_relations={self.graph.num_relations}, "
      f"num_classes={self.num_classes}, train={len(self.train_idx)}, "
      f"test={len(self.test_idx)}, features={features})"
    )


def _read_only(array: np.ndarray) -> np.ndarray:
  view = array.view()  # a read-only view leaves the caller's own array writable
  view.setflags(write=False)
  return view
