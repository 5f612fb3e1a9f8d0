"""powerlaw_graph: a large homogeneous graph with power-law degrees and a node-classification task.

Mini-batch GNN training (GraphSAGE with neighbour sampling, as on ogbn-products or
ogbn-papers100M) is limited by how fast neighbourhoods and their feature rows are gathered, and
that depends on the shape of the graph: a few hubs with huge neighbourhoods, millions of nodes
with a handful. Benchmarks need such graphs at sizes no download offers in a test run (10
million nodes, 200 million edges, 10 GiB of features), built in well under a minute, with a
task a model can be seen to learn. This file builds them:

    >>> ds = powerlaw_graph(num_nodes=10_000_000, num_edges=200_000_000,  # doctest: +SKIP
    ...                     feature_dim=256, progress=True)

Everything is NumPy on the host, drawn in fixed chunks from independent random streams by a
pool of threads, so the result depends on the arguments and the seed only, never on the number
of threads.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import math
import os
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

from jaxdata.data.synthetic import _zipf_weights

#: Popularity of the node of rank k is proportional to (k + 1) ** -EXPONENT. At 10 million nodes
#: and 200 million edges this gives a largest in-degree near 900,000 and a median of 9.
EXPONENT = 0.75
#: The share of edges whose sender is drawn from the receiver's class.
HOMOPHILY = 0.8
#: The distance of a class's feature mean from the origin, in noise units.
FEATURE_SIGNAL = 0.75

_EDGE_CHUNK = 1 << 20  # edges drawn by one task (about 60 MiB of temporaries)
_FEATURE_CHUNK = 1 << 24  # feature values drawn by one task (64 MiB of float32)


@dataclasses.dataclass(frozen=True, eq=False)
class NodeDataset:
  """A homogeneous graph with node features, labels and splits, as host NumPy arrays.

  The graph is stored as in-neighbour CSR, the layout a message-passing layer reads: node v
  aggregates from `indices[indptr[v]:indptr[v + 1]]`. Arrays are kept as given (a caller's
  pinned feature buffer stays the same memory) behind read-only views.

  Example:
    >>> ds = powerlaw_graph(num_nodes=1000, num_edges=20_000, feature_dim=16)
    >>> ds.num_nodes, ds.num_edges, ds.feature_dim, len(ds.train_nodes)
    (1000, 20000, 16, 100)

  Attributes:
    indptr: int64[num_nodes + 1], the start of each node's in-neighbours in `indices`.
    indices: int32[num_edges]: the senders u of the edges u -> v, grouped by receiver v.
    features: float32[num_nodes, feature_dim].
    labels: int32[num_nodes], class ids in [0, num_classes).
    train_nodes, val_nodes, test_nodes: sorted int32 node ids of each split (disjoint).
    num_classes: the number of classes.
    name: a short name.
  """

  indptr: np.ndarray
  indices: np.ndarray
  features: np.ndarray
  labels: np.ndarray
  train_nodes: np.ndarray
  val_nodes: np.ndarray
  test_nodes: np.ndarray
  num_classes: int
  name: str

  def __post_init__(self):
    n = len(self.indptr) - 1
    expected = {
      "indptr": (np.int64, (n + 1,)),
      "indices": (np.int32, None),
      "features": (np.float32, None),
      "labels": (np.int32, (n,)),
      "train_nodes": (np.int32, None),
      "val_nodes": (np.int32, None),
      "test_nodes": (np.int32, None),
    }
    for what, (dtype, shape) in expected.items():
      array = getattr(self, what)
      if not isinstance(array, np.ndarray) or array.dtype != dtype:
        raise TypeError(
          f"NodeDataset: {what} must be a {np.dtype(dtype).name} array, got "
          f"{getattr(array, 'dtype', type(array).__name__)}"
        )
      if shape is not None and array.shape != shape:
        raise ValueError(f"NodeDataset: {what} must have shape {shape}, got {array.shape}")
      object.__setattr__(self, what, _read_only(array))
    if self.features.ndim != 2 or self.features.shape[0] != n:
      raise ValueError(
        f"NodeDataset: features must have shape (num_nodes={n}, F), got {self.features.shape}"
      )
    if self.indptr[0] != 0 or self.indptr[-1] != len(self.indices):
      raise ValueError(
        f"NodeDataset: indptr must run from 0 to len(indices)="
        f"{len(self.indices)}, got {self.indptr[0]} to {self.indptr[-1]}"
      )

  @property
  def num_nodes(self) -> int:
    return len(self.indptr) - 1

  @property
  def num_edges(self) -> int:
    return len(self.indices)

  @property
  def feature_dim(self) -> int:
    return self.features.shape[1]

  @property
  def nbytes(self) -> int:
    """Bytes held by all the arrays together."""
    return sum(
      getattr(self, f.name).nbytes
      for f in dataclasses.fields(self)
      if isinstance(getattr(self, f.name), np.ndarray)
    )

  def in_degrees(self) -> np.ndarray:
    """int64[num_nodes]: how many edges each node aggregates from."""
    return np.diff(self.indptr)

  def out_degrees(self) -> np.ndarray:
    """int64[num_nodes]: how many edges leave each node (a pass over `indices`).

    Counted in slices: np.bincount would otherwise copy all of `indices` to int64 first.
    """
    degrees = np.zeros(self.num_nodes, np.int64)
    for start in range(0, self.num_edges, 1 << 24):
      degrees += np.bincount(self.indices[start : start + (1 << 24)], minlength=self.num_nodes)
    return degrees

  def summary(self) -> str:
    """Sizes and degree statistics, a few lines for a log (reads every edge once)."""
    gib = lambda array: array.nbytes / 2**30  # noqa: E731
    lines = [
      repr(self),
      f"  graph {gib(self.indptr) + gib(self.indices):.2f} GiB, features "
      f"{gib(self.features):.2f} GiB, splits train/val/test {len(self.train_nodes)}/"
      f"{len(self.val_nodes)}/{len(self.test_nodes)}",
    ]
    for what, degrees in (("in", self.in_degrees()), ("out", self.out_degrees())):
      if len(degrees):
        lines.append(
          f"  {what}-degree min {degrees.min()} median {np.median(degrees):g} "
          f"mean {degrees.mean():.1f} max {degrees.max()}, "
          f"{np.mean(degrees == 0):.1%} of nodes without {what}-edges"
        )
    return "\n".join(lines)

  def __repr__(self) -> str:
    return (
      f"NodeDataset({self.name!r}, num_nodes={self.num_nodes}, "
      f"num_edges={self.num_edges}, feature_dim={self.feature_dim}, "
      f"num_classes={self.num_classes}, {self.nbytes / 2**30:.2f} GiB)"
    )


def powerlaw_graph(
  *,
  num_nodes: int = 100_000,
  num_edges: int = 2_000_000,
  feature_dim: int = 64,
  num_classes: int = 8,
  exponent: float = EXPONENT,
  homophily: float = HOMOPHILY,
  feature_signal: float = FEATURE_SIGNAL,
  train_fraction: float = 0.1,
  val_fraction: float = 0.05,
  test_fraction: float = 0.1,
  seed: int = 0,
  features_out: np.ndarray | None = None,
  name: str = "powerlaw",
  num_threads: int | None = None,
  progress: bool = False,
) -> NodeDataset:
  """A random graph with power-law degrees and a node-classification task GraphSAGE can learn.

  How it is drawn:

  - Every node gets a class (classes equally common) and a popularity from a Zipf-like law,
    (rank + 1) ** -exponent, over the nodes in random order.
  - Receivers are drawn by popularity: the in-degrees are one multinomial draw of `num_edges`
    over the nodes, which gives the CSR row pointers without sorting any edge.
  - Senders are drawn by popularity too: with probability `homophily` among the nodes of the
    receiver's class, otherwise among all nodes. So both in- and out-degrees are heavy-tailed,
    and a share `homophily + (1 - homophily) / num_classes` (about) of edges joins two nodes
    of the same class.
  - Features are `feature_signal` times a random unit vector per class, plus standard normal
    noise in every dimension.

  A node's own features therefore tell its class only a little better than chance, while the
  mean of its in-neighbours' features, where a share `homophily` of the class signal adds up
  and the noise averages out, tells it well: a mean-aggregator GraphSAGE has something to
  learn, and a model that ignores the graph does not. With the defaults, a nearest-centroid
  classifier gets about 30% of test nodes right from their own features (chance: 12.5%) and
  about 72% from their own features and their in-neighbours' mean.

  Edges are drawn independently, so repeated edges and self loops occur (as in real graphs;
  nothing is removed), and some nodes have no in-edges (their GraphSAGE neighbourhood is
  empty). The in-neighbours of a node come in random order, not sorted.

  Cost: besides the outputs, about one more copy of `indices` at most (tables over the nodes,
  and the temporaries of each thread's chunk of about a million edges). 10 million nodes, 200
  million edges and 256 features per node took 23 s for the graph and 63 s for the features
  (mostly 2.6 billion normal draws) on 2 busy cores, peaking at 10.7 GiB of which 9.5 GiB are
  the features; both parts scale with the number of cores. Pass `features_out` (say a NumPy
  view of pinned host memory) to have the features written there, block by block, instead of
  into a new array.

  Example:
    >>> ds = powerlaw_graph(num_nodes=10_000, num_edges=200_000, seed=1)
    >>> ds.indptr.dtype, ds.indices.dtype, ds.features.shape, ds.num_classes
    (dtype('int64'), dtype('int32'), (10000, 64), 8)

  Args:
    num_nodes, num_edges: sizes (num_nodes >= 1, num_edges >= 0).
    feature_dim: F, the width of the features (0 gives an empty [num_nodes, 0] array).
    num_classes: the number of classes, at most num_nodes.
    exponent: the Zipf exponent of popularity (>= 0); 0 gives an Erdos-Renyi-like graph.
    homophily: the share of edges whose sender is drawn from the receiver's class, in [0, 1].
    feature_signal: the distance of a class's feature mean from the origin, in noise units.
    train_fraction, val_fraction, test_fraction: the shares of nodes in each split (each in
      [0, 1), together at most 1), disjoint random sets.
    seed: everything is a function of the arguments and this non-negative int.
    features_out: an optional writable, C-contiguous float32[num_nodes, feature_dim] array to
      write the features into; the dataset's `features` is then a view of it.
    name: the dataset's name.
    num_threads: threads drawing edges and features (default: the CPUs this process may use,
      which inside a container can be fewer than the machine has); it changes the time
      taken, never the result.
    progress: show a rich progress bar over the steps "csr", "edges" and "features".
  """
  num_nodes = _integer(num_nodes, "num_nodes", 1, np.iinfo(np.int32).max)
  num_edges = _integer(num_edges, "num_edges", 0)
  feature_dim = _integer(feature_dim, "feature_dim", 0)
  num_classes = _integer(num_classes, "num_classes", 1, num_nodes)
  seed = _integer(seed, "seed", 0)
  num_threads = _integer(_usable_cpus() if num_threads is None else num_threads, "num_threads", 1)
  exponent = _real(exponent, "exponent", 0.0)
  homophily = _real(homophily, "homophily", 0.0, 1.0)
  feature_signal = _real(feature_signal, "feature_signal", 0.0)
  fractions = {
    what: _real(value, what, 0.0, 1.0, upper_open=True)
    for what, value in (
      ("train_fraction", train_fraction),
      ("val_fraction", val_fraction),
      ("test_fraction", test_fraction),
    )
  }
  if sum(fractions.values()) > 1.0 + 1e-9:
    raise ValueError(
      f"powerlaw_graph: train_fraction + val_fraction + test_fraction must be "
      f"<= 1, got {' + '.join(map(str, fractions.values()))}"
    )
  if not isinstance(name, str):
    raise TypeError(f"powerlaw_graph: name must be a str, got {name!r}")
  _check_features_out(features_out, (num_nodes, feature_dim))

  node_seed, edge_seed, feature_seed = np.random.SeedSequence(seed).spawn(3)
  rng = np.random.default_rng(node_seed)
  labels, by_class, class_sizes = _classes(num_nodes, num_classes, rng)
  popularity = _zipf_weights(num_nodes, exponent, rng)
  centroids = _centroids(num_classes, feature_dim, feature_signal, rng)
  train, val, test = _splits(num_nodes, fractions.values(), rng)
  with _steps(progress) as steps, concurrent.futures.ThreadPoolExecutor(num_threads) as pool:
    csr = steps.add_task("csr", total=1)
    indptr = _in_degree_pointers(popularity, num_edges, rng)
    steps.advance(csr)
    tables = _SenderTables.build(popularity, by_class, class_sizes)
    del popularity
    indices = _senders(indptr, labels, tables, homophily, edge_seed, pool, steps)
    del tables
    features = (
      features_out if features_out is not None else np.empty((num_nodes, feature_dim), np.float32)
    )
    _fill_features(features, labels, centroids, feature_seed, pool, steps)
  return NodeDataset(
    indptr=indptr,
    indices=indices,
    features=features,
    labels=labels,
    train_nodes=train,
    val_nodes=val,
    test_nodes=test,
    num_classes=num_classes,
    name=name,
  )


# -- nodes --------------------------------------------------------------------------------------


def _classes(num_nodes: int, num_classes: int, rng: np.random.Generator):
  """Class labels (equally many per class, in random order) and the nodes of each class.

  Returns (labels int32[N], by_class int32[N] holding the nodes of class 0, then of class 1,
  ..., class_sizes int64[C]).
  """
  order = rng.permutation(num_nodes)
  labels = np.empty(num_nodes, np.int32)
  labels[order] = np.arange(num_nodes, dtype=np.int32) % num_classes
  by_class = np.concatenate([order[c::num_classes] for c in range(num_classes)]).astype(np.int32)
  class_sizes = np.bincount(np.arange(num_nodes) % num_classes, minlength=num_classes)
  return labels, by_class, class_sizes


def _centroids(
  num_classes: int, feature_dim: int, signal: float, rng: np.random.Generator
) -> np.ndarray:
  """float32[C, F]: a random direction per class, scaled to length `signal`."""
  means = rng.standard_normal((num_classes, feature_dim))
  norms = np.linalg.norm(means, axis=1, keepdims=True)
  return (means * (signal / np.maximum(norms, 1e-12))).astype(np.float32)


def _splits(num_nodes: int, fractions, rng: np.random.Generator):
  """Disjoint random node sets with the given shares of the nodes, each sorted, int32."""
  order = rng.permutation(num_nodes).astype(np.int32)
  splits, start = [], 0
  for fraction in fractions:
    size = min(int(round(fraction * num_nodes)), num_nodes - start)
    splits.append(np.sort(order[start : start + size]))
    start += size
  return splits


# -- edges --------------------------------------------------------------------------------------


def _in_degree_pointers(
  popularity: np.ndarray, num_edges: int, rng: np.random.Generator
) -> np.ndarray:
  """int64[N + 1] CSR row pointers for `num_edges` receivers drawn by popularity.

  Drawing every receiver and sorting the edges by it would cost a sort of `num_edges` keys;
  the in-degrees of independent draws are one multinomial draw, which costs O(N).
  """
  indptr = np.zeros(len(popularity) + 1, np.int64)
  np.cumsum(rng.multinomial(num_edges, popularity), out=indptr[1:])
  return indptr


@dataclasses.dataclass(frozen=True)
class _SenderTables:
  """What drawing a sender of a given class by popularity needs.

  `cdf` is the popularity CDF inside each class, in `by_class` order, shifted by the class id:
  class c's nodes sit between the values c and c + 1, so one search for `c + uniform` draws a
  node of class c. A sender from all nodes is a class drawn by its share of the popularity
  (`class_cdf`), then a node of that class.
  """

  by_class: np.ndarray  # int32[N]
  cdf: np.ndarray  # float64[N]
  class_ends: np.ndarray  # int64[C]: one past the last position of each class in by_class
  class_cdf: np.ndarray  # float64[C]

  @classmethod
  def build(cls, popularity, by_class, class_sizes) -> _SenderTables:
    cdf = popularity[by_class]
    class_ends = np.cumsum(class_sizes)
    mass = np.empty(len(class_sizes))
    for c, (start, end) in enumerate(zip(class_ends - class_sizes, class_ends)):
      segment = cdf[start:end]
      np.cumsum(segment, out=segment)
      mass[c] = segment[-1]
      segment *= 1.0 / mass[c] if mass[c] > 0 else 0.0
      segment += c
      segment[-1] = c + 1  # exact class end, whatever the rounding
    return cls(by_class, cdf, class_ends, np.cumsum(mass / mass.sum()))

  def draw(self, classes: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """int32: one node of each given class, drawn by popularity within the class.

    The search runs over sorted keys, walking the table in order (several times faster than
    searching keys in random order in a table larger than the caches); the result goes back
    to the order of `classes`.
    """
    keys = rng.random(len(classes))
    keys += classes
    order = np.argsort(keys)
    found = np.searchsorted(self.cdf, keys[order], side="right")
    np.minimum(found, self.class_ends[classes[order]] - 1, out=found)  # c + u may round up
    nodes = np.empty(len(classes), np.int32)
    nodes[order] = self.by_class[found]
    return nodes

  def draw_classes(self, size: int, rng: np.random.Generator) -> np.ndarray:
    """int32[size]: classes drawn by their share of the popularity."""
    found = np.searchsorted(self.class_cdf, rng.random(size) * self.class_cdf[-1], side="right")
    return np.minimum(found, len(self.class_cdf) - 1).astype(np.int32)


def _senders(
  indptr: np.ndarray,
  labels: np.ndarray,
  tables: _SenderTables,
  homophily: float,
  seed: np.random.SeedSequence,
  pool,
  steps,
) -> np.ndarray:
  """int32[E]: the sender of every edge, in the receiver order `indptr` lays out.

  The receivers are cut into runs of consecutive nodes with about `_EDGE_CHUNK` edges each,
  every run drawn by one task from its own random stream, so the result does not depend on how
  many threads run the tasks.
  """
  num_nodes, num_edges = len(labels), int(indptr[-1])
  cuts = np.unique(
    np.concatenate(
      [[0], np.searchsorted(indptr, np.arange(_EDGE_CHUNK, num_edges, _EDGE_CHUNK)), [num_nodes]]
    )
  )
  indices = np.empty(num_edges, np.int32)
  task = steps.add_task("edges", total=num_edges)

  def draw(first: int, last: int, chunk_seed: np.random.SeedSequence) -> int:
    rng = np.random.default_rng(chunk_seed)
    start, stop = indptr[first], indptr[last]
    classes = np.repeat(labels[first:last], np.diff(indptr[first : last + 1]))
    mixed = np.flatnonzero(rng.random(stop - start) >= homophily)
    classes[mixed] = tables.draw_classes(len(mixed), rng)
    indices[start:stop] = tables.draw(classes, rng)
    return stop - start

  for done in pool.map(draw, cuts[:-1], cuts[1:], seed.spawn(len(cuts) - 1)):
    steps.advance(task, done)
  return indices


# -- features -----------------------------------------------------------------------------------


def _fill_features(
  out: np.ndarray,
  labels: np.ndarray,
  centroids: np.ndarray,
  seed: np.random.SeedSequence,
  pool,
  steps,
) -> None:
  """Write class centroid plus standard normal noise into `out`, a block of rows per task.

  Blocks have a fixed size (`_FEATURE_CHUNK` values) and their own random streams, so the
  result does not depend on the number of threads, and no block is ever held twice.
  """
  num_nodes, feature_dim = out.shape
  rows = max(1, _FEATURE_CHUNK // max(feature_dim, 1))
  starts = range(0, num_nodes, rows) if feature_dim else range(0)
  task = steps.add_task("features", total=num_nodes)

  def fill(start: int, block_seed: np.random.SeedSequence) -> int:
    block = out[start : start + rows]
    np.random.default_rng(block_seed).standard_normal(out=block, dtype=np.float32)
    block += centroids[labels[start : start + rows]]
    return len(block)

  for done in pool.map(fill, starts, seed.spawn(len(starts))):
    steps.advance(task, done)


# -- arguments and progress ---------------------------------------------------------------------


def _integer(value, name: str, minimum: int, maximum: int | None = None) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"powerlaw_graph: {name} must be an int, got {value!r}")
  if value < minimum or (maximum is not None and value > maximum):
    bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
    raise ValueError(f"powerlaw_graph: {name} must be {bounds}, got {value}")
  return int(value)


def _real(
  value, name: str, minimum: float, maximum: float = math.inf, *, upper_open: bool = False
) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
    raise TypeError(f"powerlaw_graph: {name} must be a number, got {value!r}")
  value = float(value)
  above = value >= maximum if upper_open else value > maximum
  if not math.isfinite(value) or value < minimum or above:
    bounds = f"[{minimum}, {maximum}{')' if upper_open else ']'}"
    raise ValueError(
      f"powerlaw_graph: {name} must be "
      f"{f'>= {minimum}' if maximum == math.inf else f'in {bounds}'}, got {value}"
    )
  return value


def _usable_cpus() -> int:
  if hasattr(os, "sched_getaffinity"):
    return max(1, len(os.sched_getaffinity(0)))
  return os.cpu_count() or 1


def _check_features_out(out, shape: tuple[int, int]) -> None:
  if out is None:
    return
  if not isinstance(out, np.ndarray) or out.dtype != np.float32:
    raise TypeError(
      f"powerlaw_graph: features_out must be a float32 NumPy array, got "
      f"{getattr(out, 'dtype', type(out).__name__)}"
    )
  if out.shape != shape:
    raise ValueError(
      f"powerlaw_graph: features_out must have shape (num_nodes, feature_dim)="
      f"{shape}, got {out.shape}"
    )
  if not out.flags.writeable or not out.flags.c_contiguous:
    raise ValueError("powerlaw_graph: features_out must be writable and C-contiguous")


class _Steps(Protocol):
  """What the build reads of rich's Progress: a task per step, advanced as it goes."""

  def add_task(self, description: str, *, total: int) -> Any: ...

  def advance(self, task: Any, /, advance: float = 1) -> None: ...


class _NoProgress:
  """Stands in for rich's Progress when no bar is wanted."""

  def add_task(self, description: str, total: int) -> int:
    return 0

  def advance(self, task: int, advance: float = 1) -> None:
    pass


@contextlib.contextmanager
def _steps(enabled: bool) -> Iterator[_Steps]:
  """A rich Progress showing each step (or a stand-in doing nothing)."""
  if not enabled:
    yield _NoProgress()
    return

  columns = (
    *Progress.get_default_columns()[:1],
    BarColumn(),
    MofNCompleteColumn(),
    TimeElapsedColumn(),
  )
  with Progress(*columns) as bar:
    yield bar


def _read_only(array: np.ndarray) -> np.ndarray:
  view = array.view()  # a read-only view leaves the caller's own array writable
  view.setflags(write=False)
  return view
