"""synthetic_mag: an ogbn-mag-like academic heterograph with a paper-classification task.

ogbn-mag (OGB's subset of the Microsoft Academic Graph) is the standard benchmark of
heterogeneous GNNs such as RGAT and HGT: four node types, four relations (eight with their
reverses), features of different widths, heavy-tailed degrees, and papers to classify. This
file draws a graph of its shape at any scale, in seconds, without a download:

    >>> ds = synthetic_mag(scale=1e-3, seed=0)
    >>> ds
    MagDataset('synthetic-mag', paper=736x128, author=1135x64, institution=9x32, \
field_of_study=60x48, num_edges=42222, num_relations=8, num_classes=349)
    >>> ds.graph.relation_names[:4]
    ('writes', 'cites', 'has_topic', 'affiliated_with')

At scale 1 the counts are ogbn-mag's: 1,939,743 nodes and 21,111,007 edges (42,222,014 with the
reverses). Node type t owns the global ids [node_type_offsets[t], node_type_offsets[t + 1]) in
the order of `NODE_TYPES`; relation r goes from type `relation_types[r][0]` to
`relation_types[r][2]`, reverses ("rev_writes", ...) after the four forward relations.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os

import numpy as np

from jaxdata.data import graph_build
from jaxdata.data.graph import HeteroGraph, _owned

NODE_TYPES = ("paper", "author", "institution", "field_of_study")
#: ogbn-mag's node counts.
NUM_NODES = {"paper": 736_389, "author": 1_134_649, "institution": 8_740, "field_of_study": 59_965}
#: (source type, name, destination type), in relation-id order.
RELATIONS = (
  ("author", "writes", "paper"),
  ("paper", "cites", "paper"),
  ("paper", "has_topic", "field_of_study"),
  ("author", "affiliated_with", "institution"),
)
#: ogbn-mag's edge counts per relation.
NUM_EDGES = {
  "writes": 7_145_660,
  "cites": 5_416_271,
  "has_topic": 7_505_078,
  "affiliated_with": 1_043_998,
}
#: Feature widths (ogbn-mag's papers have 128; its other types have none, these are ours).
FEATURE_DIMS = {"paper": 128, "author": 64, "institution": 32, "field_of_study": 48}
#: Zipf exponents of the popularity of each relation's (source, destination) end: the degree
#: of a node of rank k at that end is about proportional to (k + 1) ** -exponent.
EXPONENTS = {
  "writes": (0.8, 0.5),
  "cites": (0.5, 0.9),
  "has_topic": (0.3, 1.0),
  "affiliated_with": (0.3, 1.0),
}
#: The distance of a class's feature mean from the origin, in noise units, per node type: a
#: paper's own features say little about its class; its topics' features say much.
FEATURE_SIGNAL = {"paper": 0.5, "author": 0.5, "institution": 1.0, "field_of_study": 2.0}
#: The share of each relation's edges that stay inside the class of the end drawn first.
HOMOPHILY = 0.8
#: ogbn-mag's number of paper classes (venues).
NUM_CLASSES = 349
#: Which end of each relation is drawn first (the other follows its class).
_DRAW_ORDER = {"writes": "dst", "cites": "src", "has_topic": "src", "affiliated_with": "src"}
#: Edges per drawing chunk and feature rows per chunk: each chunk draws with its own generator
#: (spawned from the seed by chunk index), so the result depends on the seed, not on the
#: number of threads that draw the chunks.
EDGE_CHUNK = 1 << 19
FEATURE_CHUNK = 1 << 15


@dataclasses.dataclass(frozen=True, eq=False)
class MagDataset:
  """A heterograph with per-type features and labelled papers, as host NumPy arrays.

  Attributes:
    graph: the `HeteroGraph` (node types and offsets set; relations as `relation_types`).
    relation_types: (source type, name, destination type) of every relation of the graph.
    features: one float32[N_t, d_t] array per node type, in `graph.node_type_names` order.
    labels: int32[num_papers], the class of each paper (local paper ids: global id minus
      the paper offset, which is 0).
    num_classes: the number of classes.
    train_papers, val_papers, test_papers: sorted int64 local ids of the target type
      (disjoint).
    name: a short name.
    target: the node type classified (node type 0: "paper" in synthetic_mag; any type of a
      user's graph through `HeteroData.to_dataset`).
  """

  graph: HeteroGraph
  relation_types: tuple[tuple[str, str, str], ...]
  features: tuple[np.ndarray, ...]
  labels: np.ndarray
  num_classes: int
  train_papers: np.ndarray
  val_papers: np.ndarray
  test_papers: np.ndarray
  name: str = "synthetic-mag"
  target: str = "paper"

  def node_range(self, node_type: str) -> tuple[int, int]:
    """[first, last + 1) global ids of a node type."""
    t = self.graph.node_type_names.index(node_type)
    offsets = self.graph.node_type_offsets
    assert offsets is not None  # a MAG graph always has its node types' offsets
    return int(offsets[t]), int(offsets[t + 1])

  def __repr__(self) -> str:
    sizes = ", ".join(
      f"{t}={len(x)}x{x.shape[1]}" for t, x in zip(self.graph.node_type_names, self.features)
    )
    return (
      f"MagDataset({self.name!r}, {sizes}, num_edges={self.graph.num_edges}, "
      f"num_relations={self.graph.num_relations}, num_classes={self.num_classes})"
    )


def synthetic_mag(
  *,
  scale: float = 1.0,
  seed: int = 0,
  num_classes: int = NUM_CLASSES,
  homophily: float = HOMOPHILY,
  add_inverse: bool = True,
  split: tuple[float, float, float] = (0.85, 0.09, 0.06),
  threads: int | None = None,
) -> MagDataset:
  """An ogbn-mag-shaped graph with `scale` times its node and edge counts.

  How it is drawn (vectorised NumPy on a thread pool, chunk by chunk, each chunk with its own
  generator so that the result does not depend on the thread count; sorting and grouping in
  native threads; scale 1 takes 7 s on 2 busy cores; see probe_mag_scale.py for larger
  scales):

  - Every node of every type gets a class (equally many per class, in random order) and a rank
    (a random permutation). A paper's label is its class: the "subject" of the fields of study
    it is about.
  - Each relation draws the end listed first in `_DRAW_ORDER` by popularity, (rank + 1) **
    -exponent with the relation's exponent for that end (`EXPONENTS`), then the other end by
    popularity too, inside the first end's class with probability `homophily` and anywhere
    otherwise: a paper's topics, citations and authors are mostly of its class, an author's
    institutions mostly of the author's class. Self loops (citations) and repeated edges occur.
  - Features are `FEATURE_SIGNAL[t]` times a random unit vector per class and type, plus
    standard normal noise: a paper's own features tell its class only weakly, the mean of its
    topics' features well.

  Args:
    scale: the share of ogbn-mag's counts (> 0); every node type keeps at least one node. Tiny
      scales (1e-4: about 200 nodes and 4,000 edges) suit tests.
    seed: everything is a function of the arguments and this seed.
    num_classes: the number of classes (paper labels). A node type with fewer nodes than
      classes leaves some classes without nodes of that type; edges that would need one go
      anywhere.
    homophily: the share of edges drawn inside a class, in [0, 1].
    add_inverse: add the reverse of every relation ("rev_<name>"), as models on ogbn-mag do.
    split: the shares of papers in the train, validation and test sets (random, disjoint).
    threads: threads that draw (default: every core this process may use). The result does
      not depend on it.
  """
  if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
    raise ValueError(f"synthetic_mag: scale must be a positive number, got {scale!r}")
  if (
    isinstance(num_classes, bool)
    or not isinstance(num_classes, (int, np.integer))
    or num_classes < 1
  ):
    raise ValueError(f"synthetic_mag: num_classes must be a positive int, got {num_classes!r}")
  if not 0.0 <= homophily <= 1.0:
    raise ValueError(f"synthetic_mag: homophily must be in [0, 1], got {homophily}")
  if len(split) != 3 or min(split) < 0 or sum(split) > 1.0 + 1e-9:
    raise ValueError(f"synthetic_mag: split must be three shares summing to at most 1, got {split}")
  counts: dict[str, int] = {t: max(1, int(round(NUM_NODES[t] * scale))) for t in NODE_TYPES}
  offsets = np.cumsum([0] + [counts[t] for t in NODE_TYPES])
  offset: dict[str, int] = dict(zip(NODE_TYPES, offsets[:-1].tolist()))
  node_seed, edge_seed, feature_seed, split_seed = np.random.SeedSequence(seed).spawn(4)
  threads = _threads(threads)

  with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    # Node types in parallel (NumPy's generators and sorts release the GIL), then each
    # relation's two ends' samplers, then every chunk of every relation's edges.
    drawn = dict(
      zip(
        NODE_TYPES,
        pool.map(
          lambda t, ss: _nodes(counts[t], num_classes, np.random.default_rng(ss)),
          NODE_TYPES,
          node_seed.spawn(len(NODE_TYPES)),
        ),
      )
    )
    classes = {t: c for t, (c, _) in drawn.items()}
    ends = {(t, exp) for (s, name, d) in RELATIONS for t, exp in zip((s, d), EXPONENTS[name])}
    samplers = dict(
      zip(
        ends,
        pool.map(
          lambda end: _Sampler(drawn[end[0]][1], end[1], classes[end[0]], num_classes), ends
        ),
      )
    )
    drawn.clear()  # the ranks: the samplers have what they need
    pieces = []  # per relation: local (src, dst) int32, filled chunk by chunk
    jobs = []
    for ss, (src_type, name, dst_type) in zip(edge_seed.spawn(len(RELATIONS)), RELATIONS):
      num_edges = int(round(NUM_EDGES[name] * scale))
      src, dst = np.empty(num_edges, np.int32), np.empty(num_edges, np.int32)
      pieces.append((src, dst))
      src_end, dst_end = (samplers[t, e] for t, e in zip((src_type, dst_type), EXPONENTS[name]))
      if _DRAW_ORDER[name] == "src":
        first, second, first_classes = (src_end, src), (dst_end, dst), classes[src_type]
      else:
        first, second, first_classes = (dst_end, dst), (src_end, src), classes[dst_type]
      starts = range(0, num_edges, EDGE_CHUNK)
      for start, chunk_seed in zip(starts, ss.spawn(len(starts))):
        jobs.append(
          pool.submit(
            _draw_edges,
            first,
            second,
            first_classes,
            homophily,
            slice(start, min(start + EDGE_CHUNK, num_edges)),
            chunk_seed,
          )
        )
    for job in jobs:
      job.result()
    del jobs, samplers

    # Features, chunk by chunk of rows (each chunk its own generator), while the edges sort.
    features = []
    feature_jobs = []
    for t, ss in zip(NODE_TYPES, feature_seed.spawn(len(NODE_TYPES))):
      centroid_seed, row_seed = ss.spawn(2)
      rng = np.random.default_rng(centroid_seed)
      centroids = rng.standard_normal((num_classes, FEATURE_DIMS[t]))
      centroids *= FEATURE_SIGNAL[t] / np.linalg.norm(centroids, axis=1, keepdims=True)
      x = np.empty((counts[t], FEATURE_DIMS[t]), np.float32)
      starts = range(0, counts[t], FEATURE_CHUNK)
      for start, chunk_seed in zip(starts, row_seed.spawn(len(starts))):
        feature_jobs.append(
          pool.submit(
            _draw_features,
            x,
            centroids.astype(np.float32),
            classes[t],
            slice(start, min(start + FEATURE_CHUNK, counts[t])),
            chunk_seed,
          )
        )
      features.append(x)

    # Each relation sorted by (dst, src), forward and reverse (native radix sorts; they use
    # their own threads, so relation after relation).
    blocks = [
      _sorted_pairs(s, d, counts[s_type], offset[s_type], offset[d_type])
      for (s, d), (s_type, _, d_type) in zip(pieces, RELATIONS)
    ]
    if add_inverse:
      # The reverse of (s -> d) is (d -> s), sorted by (s, d).
      blocks += [
        _sorted_pairs(d, s, counts[d_type], offset[d_type], offset[s_type])
        for (s, d), (s_type, _, d_type) in zip(pieces, RELATIONS)
      ]
    del pieces
    relation_names = [name for _, name, _ in RELATIONS]
    relation_names += [f"rev_{name}" for name in relation_names] if add_inverse else []
    relation_types = RELATIONS + (
      tuple((d, f"rev_{n}", s) for s, n, d in RELATIONS) if add_inverse else ()
    )
    # Each block is sorted by (dst, src), so relation after relation they are sorted by
    # (etype, dst, src): built directly (the constructor checks the order), into arrays the
    # graph takes over instead of copying; the blocks are copied in parallel.
    total = sum(len(s) for s, _ in blocks)
    src, dst, etype = (np.empty(total, np.int32) for _ in range(3))
    bounds = np.cumsum([0] + [len(s) for s, _ in blocks])

    def place(r: int):
      a, b = bounds[r], bounds[r + 1]
      src[a:b], dst[a:b], etype[a:b] = blocks[r][0], blocks[r][1], r

    list(pool.map(place, range(len(blocks))))
    blocks.clear()
    for job in feature_jobs:
      job.result()
  graph = HeteroGraph(
    int(offsets[-1]),
    _owned(src),
    _owned(dst),
    _owned(etype),
    tuple(relation_names),
    NODE_TYPES,
    offsets,
    relation_types,
  )

  order = np.random.default_rng(split_seed).permutation(counts["paper"])
  sizes = [int(round(share * counts["paper"])) for share in split]
  ends = np.minimum(np.cumsum(sizes), counts["paper"])
  train, val, test = (np.sort(order[a:b]) for a, b in zip([0, *ends[:-1]], ends))
  return MagDataset(
    graph=graph,
    relation_types=relation_types,
    features=tuple(features),
    labels=classes["paper"].astype(np.int32),
    num_classes=int(num_classes),
    train_papers=train,
    val_papers=val,
    test_papers=test,
  )


def _sorted_pairs(
  src: np.ndarray, dst: np.ndarray, num_src: int, src_offset: int, dst_offset: int
) -> tuple[np.ndarray, np.ndarray]:
  """Local edge ends sorted by (dst, src), returned as global int32 ids.

  A parallel radix sort (`graph_build.sort_edges`, one relation); equal keys are equal edges,
  so stability does not matter.
  """
  num_nodes = max(num_src, int(dst.max(initial=-1)) + 1)
  src, dst, _ = graph_build.sort_edges(src, dst, np.zeros(len(src), np.int32), num_nodes, 1)
  src += np.int32(src_offset)
  dst += np.int32(dst_offset)
  return src, dst


def _threads(threads: int | None) -> int:
  """The drawing threads: `threads`, or every core this process may use."""
  if threads is None:
    try:
      return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
      return os.cpu_count() or 1
  if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or threads < 1:
    raise ValueError(f"synthetic_mag: threads must be a positive int or None, got {threads!r}")
  return int(threads)


def _nodes(
  num_nodes: int, num_classes: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
  """(classes, ranks) of one node type: class ids, as equally many per class as can be, in
  random order (int32), and a random permutation of popularity ranks."""
  classes = (np.arange(num_nodes) % num_classes).astype(np.int32)
  rng.shuffle(classes)
  return classes, rng.permutation(num_nodes)


def _draw_edges(
  first: tuple[_Sampler, np.ndarray],
  second: tuple[_Sampler, np.ndarray],
  first_classes: np.ndarray,
  homophily: float,
  part: slice,
  seed: np.random.SeedSequence,
) -> None:
  """One chunk of a relation's edges, `part` of its local (first end, second end) arrays: the
  first end by popularity, the second inside the first's class with probability `homophily`."""
  rng = np.random.default_rng(seed)
  (first_end, first_out), (second_end, second_out) = first, second
  # In ascending order: which node pairs with which does not depend on the order (each second
  # end depends on its first end's class only, or on nothing), and edges are sorted later.
  nodes = first_end.draw(part.stop - part.start, rng, shuffle=False)
  first_out[part] = nodes
  second_out[part] = second_end.draw_like(first_classes[nodes], homophily, rng)


def _draw_features(
  x: np.ndarray,
  centroids: np.ndarray,
  classes: np.ndarray,
  part: slice,
  seed: np.random.SeedSequence,
) -> None:
  """Rows `part` of a feature table: standard normal noise plus their class's centroid."""
  np.random.default_rng(seed).standard_normal(out=x[part], dtype=np.float32)
  x[part] += centroids[classes[part]]


class _Sampler:
  """Draws nodes of one type by popularity, (rank + 1) ** -exponent: anywhere or in a class.

  `cdf` is the popularity CDF inside each class, over the nodes sorted by class, shifted by the
  class id: class c's nodes sit between the values c and c + 1, so one search for
  `c + uniform` draws a node of class c.
  """

  def __init__(self, ranks: np.ndarray, exponent: float, classes: np.ndarray, num_classes: int):
    popularity = (ranks + 1.0) ** -exponent
    self.cumulative = np.cumsum(popularity)
    # nodes sorted by class, ascending inside a class (a stable counting sort, native)
    self.by_class = graph_build.group_by(classes, num_classes, threads=1)[1]
    sizes = np.bincount(classes, minlength=num_classes)
    self.ends = np.cumsum(sizes)
    self.empty = sizes == 0
    self.num_classes = num_classes
    sorted_classes = classes[self.by_class]
    mass = np.bincount(classes, weights=popularity, minlength=num_classes)
    before = np.concatenate([[0.0], np.cumsum(mass)[:-1]])
    within = np.cumsum(popularity[self.by_class]) - before[sorted_classes]
    self.cdf = sorted_classes + within / mass[sorted_classes]
    self.cdf[self.ends[~self.empty] - 1] = np.flatnonzero(~self.empty) + 1.0  # exact ends

  def draw(self, size: int, rng: np.random.Generator, shuffle: bool = True) -> np.ndarray:
    """int64[size] nodes drawn by popularity from all nodes, in random order (`shuffle`) or
    ascending.

    Searching sorted uniforms, then shuffling, walks the table in order (fast on large tables).
    """
    keys = rng.random(size)
    keys.sort()
    keys *= self.cumulative[-1]
    nodes = np.searchsorted(self.cumulative, keys, side="right")
    np.minimum(nodes, len(self.cumulative) - 1, out=nodes)
    if shuffle:
      rng.shuffle(nodes)
    return nodes

  def draw_like(
    self, classes: np.ndarray, homophily: float, rng: np.random.Generator
  ) -> np.ndarray:
    """One node per entry of `classes`: of that class with probability `homophily`, else any.

    Entries whose class has no node of this type are drawn from all nodes.
    """
    inside = (rng.random(len(classes)) < homophily) & ~self.empty[classes]
    nodes = np.empty(len(classes), np.int64)
    inside_classes = classes[inside]
    keys = inside_classes + rng.random(len(inside_classes))
    # Searching keys class by class keeps each search inside one class's stretch of the table
    # (cache-friendly); the result does not depend on the order. A counting sort by class.
    order = graph_build.group_by(inside_classes, self.num_classes, threads=1)[1]
    found = np.searchsorted(self.cdf, keys[order], side="right")
    np.minimum(found, self.ends[inside_classes[order]] - 1, out=found)  # c + u may round up
    picked = np.empty_like(found)
    picked[order] = self.by_class[found]
    nodes[inside] = picked
    nodes[~inside] = self.draw(len(classes) - len(picked), rng)
    return nodes
