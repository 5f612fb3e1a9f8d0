"""synthetic_entities: a heavy-tailed relational graph with a node-classification task of any size.

Real knowledge graphs have a few hub nodes and many rare ones, and a few frequent relations and
many rare ones; benchmarks of relational GNN kernels need both, at sizes the RDF benchmarks do
not reach. The task is built so that the neighbourhood, seen through typed relations, carries
the class, and the node's own features carry it only weakly.
"""

from __future__ import annotations

import numpy as np

from jaxdata.data.dataset import EntityDataset
from jaxdata.data.graph import HeteroGraph

#: Popularity of the node of rank k (and frequency of relation k) is proportional to
#: (k + 1) ** -exponent: Zipf-like, so degrees and relation sizes are heavy-tailed.
NODE_EXPONENT = 0.75
RELATION_EXPONENT = 1.0


def _zipf_weights(n: int, exponent: float, rng: np.random.Generator) -> np.ndarray:
  """Zipf-like weights over n items in random order, summing to one."""
  weights = np.arange(1, n + 1, dtype=np.float64) ** -exponent
  return rng.permutation(weights / weights.sum())


def _draw(cumulative: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
  """`size` independent draws of an index with probabilities given by their running sum.

  Searching sorted uniforms and shuffling the result is the same distribution as searching
  unsorted ones, and several times faster on large tables (the searches walk memory in order).
  """
  draws = np.searchsorted(cumulative, np.sort(rng.random(size)) * cumulative[-1], side="right")
  draws = np.minimum(draws, len(cumulative) - 1)
  rng.shuffle(draws)
  return draws


def _positive_int(value, name: str, minimum: int = 1) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"synthetic_entities: {name} must be an int, got {value!r}")
  if value < minimum:
    raise ValueError(f"synthetic_entities: {name} must be >= {minimum}, got {value}")
  return int(value)


def synthetic_entities(
  *,
  num_nodes: int = 20_000,
  num_edges: int = 200_000,
  num_relations: int = 50,
  num_classes: int = 4,
  feature_dim: int = 32,
  train_fraction: float = 0.1,
  test_fraction: float = 0.1,
  seed: int = 0,
  name: str = "synthetic",
  edge_signal: float = 0.8,
  feature_signal: float = 0.8,
) -> EntityDataset:
  """A random relational graph with a node-classification task that a relational GNN can learn.

  How it is drawn (all vectorised; 2 million edges and 500 relations take about a second):

  - Every node gets a class (classes equally common) and a popularity from a Zipf-like law in
    random order, so a few hubs have thousands of edges and most nodes have a handful.
  - Every relation gets a frequency from a Zipf-like law (relation 0 is the most common) and a
    random permutation `perm_r` of the classes.
  - Each edge picks its relation by frequency and its source node by popularity. With
    probability `edge_signal` its destination is a node of class `perm_r(class(source))`,
    otherwise any node; either way chosen by popularity.
  - Features are a weak code of the class: `feature_signal` times a random unit vector per
    class, plus standard normal noise in every dimension.

  So a node's class is written, relation by relation, in the classes of the nodes that send it
  edges; a model has to read it through the neighbours' (noisy) features, each relation mapping
  classes differently, and averaging over many neighbours removes the noise, while the node's
  own features alone classify it only a little better than chance. Messages flow from `src` to
  `dst`, so the signal sits in the in-edges; no inverse relations are added, so that the
  graph has exactly `num_edges` edges and `num_relations` relations (use
  `HeteroGraph.from_edges(..., add_inverse=True)` on the graph's arrays to add them: the
  out-edges carry the signal too, through the inverse permutations). Self loops and repeated
  edges occur, as in real graphs.

  Example:
    >>> ds = synthetic_entities(num_nodes=1000, num_edges=10_000, num_relations=8, seed=1)
    >>> ds.graph, ds.features.shape, len(ds.train_idx)
    (HeteroGraph(num_nodes=1000, num_edges=10000, num_relations=8), (1000, 32), 100)

  Args:
    num_nodes, num_edges, num_relations, num_classes: sizes (num_nodes >= num_classes >= 2).
    feature_dim: F, the width of the features; 0 gives a featureless dataset (features=None).
    train_fraction, test_fraction: the shares of nodes labelled for training and for testing
      (disjoint random sets).
    seed: everything is a function of the arguments and this seed.
    name: the dataset's name.
    edge_signal: the share of edges that follow their relation's class permutation.
    feature_signal: the distance of a class's feature mean from the origin, in noise units.
  """
  num_nodes = _positive_int(num_nodes, "num_nodes")
  num_edges = _positive_int(num_edges, "num_edges", 0)
  num_relations = _positive_int(num_relations, "num_relations")
  num_classes = _positive_int(num_classes, "num_classes", 2)
  feature_dim = _positive_int(feature_dim, "feature_dim", 0)
  if num_classes > num_nodes:
    raise ValueError(f"synthetic_entities: num_classes={num_classes} exceeds num_nodes={num_nodes}")
  for what, value in (
    ("train_fraction", train_fraction),
    ("test_fraction", test_fraction),
    ("edge_signal", edge_signal),
  ):
    if not 0.0 <= value <= 1.0:
      raise ValueError(f"synthetic_entities: {what} must be in [0, 1], got {value}")
  if train_fraction + test_fraction > 1.0:
    raise ValueError(
      f"synthetic_entities: train_fraction + test_fraction must be <= 1, got "
      f"{train_fraction} + {test_fraction}"
    )
  if feature_signal < 0:
    raise ValueError(f"synthetic_entities: feature_signal must be >= 0, got {feature_signal}")
  rng = np.random.default_rng(seed)

  # Nodes: a class each (equally many per class), a popularity each.
  node_class = rng.permutation(np.arange(num_nodes) % num_classes)
  popularity = _zipf_weights(num_nodes, NODE_EXPONENT, rng)
  cumulative = np.cumsum(popularity)
  # The nodes of each class in one array, and the popularity CDF inside each class shifted by
  # the class id, so that one searchsorted draws a node of a given class: class c's nodes sit
  # between the values c and c + 1.
  by_class = np.argsort(node_class, kind="stable")
  class_mass = np.bincount(node_class, weights=popularity, minlength=num_classes)
  class_of_sorted = node_class[by_class]
  within = np.cumsum(popularity[by_class])
  within -= np.concatenate([[0.0], np.cumsum(class_mass)[:-1]])[class_of_sorted]
  class_cdf = class_of_sorted + within / class_mass[class_of_sorted]
  class_cdf[np.cumsum(np.bincount(node_class, minlength=num_classes)) - 1] = np.arange(
    1, num_classes + 1
  )  # exact class ends: rounding must not move a draw to the next class

  # Relations: a Zipf-like frequency each (relation 0 the most common), a class permutation each.
  relation_weights = np.arange(1, num_relations + 1, dtype=np.float64) ** -RELATION_EXPONENT
  relation_cdf = np.cumsum(relation_weights / relation_weights.sum())
  permutations = np.argsort(rng.random((num_relations, num_classes)), axis=1)

  # Edges: relation by frequency, source by popularity; destination by popularity, in the
  # class the relation maps the source's class to (with probability edge_signal) or anywhere.
  etype = np.minimum(
    np.searchsorted(relation_cdf, rng.random(num_edges), side="right"), num_relations - 1
  )
  src = _draw(cumulative, num_edges, rng)
  follows = rng.random(num_edges) < edge_signal
  dst = np.empty(num_edges, np.int64)
  target = permutations[etype[follows], node_class[src[follows]]]
  dst[follows] = by_class[
    np.minimum(
      np.searchsorted(class_cdf, target + rng.random(len(target)), side="right"), num_nodes - 1
    )
  ]
  dst[~follows] = _draw(cumulative, num_edges - len(target), rng)
  graph = HeteroGraph.from_edges(
    src, dst, etype, num_nodes=num_nodes, relation_names=[f"r{r}" for r in range(num_relations)]
  )

  # Features: a weak class code plus noise.
  features = None
  if feature_dim:
    means = rng.standard_normal((num_classes, feature_dim))
    means *= feature_signal / np.linalg.norm(means, axis=1, keepdims=True)
    features = (means[node_class] + rng.standard_normal((num_nodes, feature_dim))).astype(
      np.float32
    )

  # Labelled nodes: disjoint random train and test sets.
  order = rng.permutation(num_nodes)
  num_train = int(round(train_fraction * num_nodes))
  num_test = min(int(round(test_fraction * num_nodes)), num_nodes - num_train)
  train_idx = np.sort(order[:num_train])
  test_idx = np.sort(order[num_train : num_train + num_test])
  return EntityDataset(
    name=name,
    graph=graph,
    num_classes=num_classes,
    train_idx=train_idx,
    train_y=node_class[train_idx],
    test_idx=test_idx,
    test_y=node_class[test_idx],
    class_names=tuple(f"c{c}" for c in range(num_classes)),
    features=features,
  )
