"""A NumPy stand-in for PyG's `NeighborLoader` on a heterograph, and PyG models fed by it.

PyG's own `NeighborLoader` needs pyg-lib or torch-sparse for its sampler, and the GPU machine
has neither, so `jaxdata bench hetero` feeds PyG with this sampler, which does what
NeighborLoader does on a `HeteroData` with ``num_neighbors=fanouts`` (``replace=False``,
``disjoint=False``, directed):

- hop h samples, for every node discovered at hop h - 1 (the seeds at hop 0) and for every
  edge type that ends in its node type, up to ``fanouts[h]`` of its in-edges of that type,
  uniformly without replacement (all of them when it has no more); a node keeps its first
  local id, new nodes are appended per type in the order they are found (the seeds first);
- the mini-batch holds every node found (features gathered with NumPy indexing) and every
  sampled edge, as ``edge_index`` per edge type in local ids, ``batch_size`` seeds first.

Draws use Floyd's algorithm (exactly ``fanout`` distinct in-edges), vectorised over the
nodes of a hop; the randomness is NumPy's, not pyg-lib's, so the samples are not PyG's own,
only distributed as they are.

    sampler = HeteroNeighborSampler(synthetic_mag(scale=1e-3))
    batch = sampler.sample(np.arange(64), (10, 10), np.random.default_rng(0))
    data = hetero_data(batch, dataset)          # torch_geometric.data.HeteroData, on the CPU
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxdata.data.mag import MagDataset


@dataclasses.dataclass
class SampledHetero:
  """One mini-batch as NeighborLoader returns it (NumPy, local ids per node type).

  Attributes:
    node_ids: per node type, the type-local ids of its nodes in the batch (``n_id``); the
      papers start with the seeds.
    num_sampled_nodes: per node type, how many of its nodes each round found (round 0: the
      seeds; round h + 1: found by hop h), as PyG's ``num_sampled_nodes``.
    edges: per relation, ``(src, dst)`` positions into ``node_ids`` of its source and
      destination types.
    edge_ids: per relation, each sampled edge's position in that relation's in-edge list
      (`HeteroNeighborSampler.csc`), as PyG's ``e_id`` is a position in its edge list.
    batch_size: the seeds (the first ``batch_size`` papers).
  """

  node_ids: list[np.ndarray]
  num_sampled_nodes: list[list[int]]
  edges: list[tuple[np.ndarray, np.ndarray]]
  edge_ids: list[np.ndarray]
  batch_size: int

  @property
  def num_edges(self) -> int:
    return int(sum(len(s) for s, _ in self.edges))

  @property
  def num_nodes(self) -> int:
    return int(sum(len(n) for n in self.node_ids))


class HeteroNeighborSampler:
  """NeighborLoader's sampling on `dataset`'s graph (see the module docstring).

  `csc[r] = (indptr, sources)`: relation r's in-edges by type-local destination id, sources as
  type-local ids of its source type. Not thread-safe: one sampler per thread.
  """

  def __init__(self, dataset: MagDataset, paper_type: str = "paper"):
    g = dataset.graph
    self.node_types = tuple(g.node_type_names)
    self.relation_types = tuple(tuple(r) for r in dataset.relation_types)
    offsets = np.asarray(g.node_type_offsets, np.int64)
    self.num_nodes = [int(offsets[t + 1] - offsets[t]) for t in range(len(self.node_types))]
    self.paper = self.node_types.index(paper_type)
    self.type_of = {name: t for t, name in enumerate(self.node_types)}
    ptr, edge_ids = g.csc()  # in-edges by global destination, ascending edge ids per node
    dst = np.repeat(np.arange(len(ptr) - 1, dtype=np.int64), np.diff(ptr))
    src, etype = np.asarray(g.src)[edge_ids], np.asarray(g.etype)[edge_ids]
    self.csc = []
    for r, (st, _, dt) in enumerate(self.relation_types):
      mine = etype == r  # keeps the destination order
      s, d = self.type_of[st], self.type_of[dt]
      local_dst = dst[mine] - offsets[d]
      indptr = np.zeros(self.num_nodes[d] + 1, np.int64)
      np.cumsum(np.bincount(local_dst, minlength=self.num_nodes[d]), out=indptr[1:])
      self.csc.append((indptr, (src[mine] - offsets[s]).astype(np.int64)))
    self._pos = [np.full(n, -1, np.int64) for n in self.num_nodes]

  def sample(
    self, seeds: np.ndarray, fanouts: Sequence[int], rng: np.random.Generator
  ) -> SampledHetero:
    """The mini-batch of `seeds` (type-local paper ids, distinct; negative ones dropped)."""
    seeds = np.asarray(seeds, np.int64)
    seeds = seeds[seeds >= 0]
    nt = len(self.node_types)
    found: list[list[np.ndarray]] = [[] for _ in range(nt)]
    count = [0] * nt
    try:
      self._add(self.paper, seeds, found, count)
      rounds = [[len(seeds) if t == self.paper else 0 for t in range(nt)]]
      edges = [[] for _ in self.relation_types]
      start = [0] * nt
      for fanout in fanouts:
        end = list(count)  # this hop samples the nodes the previous round found
        ids = [
          np.concatenate(found[t])[start[t] : end[t]]
          if end[t] > start[t]
          else np.zeros(0, np.int64)
          for t in range(nt)
        ]
        for r, (st, _, dt) in enumerate(self.relation_types):
          s, d = self.type_of[st], self.type_of[dt]
          if not len(ids[d]):
            continue
          e_ids, which = self.draw(r, ids[d], int(fanout), rng)
          src_pos = self._add(s, self.csc[r][1][e_ids], found, count)
          edges[r].append((src_pos, start[d] + which, e_ids))
        rounds.append([count[t] - end[t] for t in range(nt)])
        start = end
      node_ids = [np.concatenate(f) if f else np.zeros(0, np.int64) for f in found]
    finally:
      for t in range(nt):
        for f in found[t]:
          self._pos[t][f] = -1

    def cat(parts, k):
      return np.concatenate([p[k] for p in parts]) if parts else np.zeros(0, np.int64)

    return SampledHetero(
      node_ids,
      [[r[t] for r in rounds] for t in range(nt)],
      [(cat(e, 0), cat(e, 1)) for e in edges],
      [cat(e, 2) for e in edges],
      len(seeds),
    )

  def draw(
    self, relation: int, dst: np.ndarray, fanout: int, rng: np.random.Generator
  ) -> tuple[np.ndarray, np.ndarray]:
    """Up to `fanout` in-edges of relation `relation` into each of `dst` (type-local ids),
    uniformly without replacement: (positions in the relation's in-edge list, the index into
    `dst` of each edge's destination)."""
    indptr, _ = self.csc[relation]
    begin = indptr[dst]
    degree = indptr[dst + 1] - begin
    small = np.flatnonzero(degree <= fanout)  # all their in-edges
    cnt = degree[small]
    which_small = np.repeat(small, cnt)
    within = np.arange(int(cnt.sum()), dtype=np.int64) - np.repeat(np.cumsum(cnt) - cnt, cnt)
    large = np.flatnonzero(degree > fanout)  # Floyd: `fanout` distinct of `degree`
    n = degree[large]
    chosen = np.empty((len(large), fanout), np.int64)
    for k in range(fanout):
      j = n - fanout + k
      t = rng.integers(0, j + 1) if len(large) else np.zeros(0, np.int64)
      taken = (chosen[:, :k] == t[:, None]).any(axis=1)
      chosen[:, k] = np.where(taken, j, t)
    e_ids = np.concatenate([begin[which_small] + within, (begin[large][:, None] + chosen).ravel()])
    which = np.concatenate([which_small, np.repeat(large, fanout)])
    return e_ids, which

  def _add(self, t: int, ids: np.ndarray, found, count) -> np.ndarray:
    """Positions of `ids` (type t) in the batch, appending the new ones in order of first
    appearance."""
    pos = self._pos[t]
    p = pos[ids]
    missing = p < 0
    if missing.any():
      uniq, first = np.unique(ids[missing], return_index=True)
      new = uniq[np.argsort(first)]
      pos[new] = np.arange(count[t], count[t] + len(new))
      found[t].append(new)
      count[t] += len(new)
      p = pos[ids]
    return p


# ----------------------------------------------------------------------------- PyG's side
def hetero_data(batch: SampledHetero, dataset: MagDataset):
  """The batch as a `torch_geometric.data.HeteroData` on the CPU: ``x`` per node type (NumPy
  gather), ``edge_index`` per edge type (every relation present, possibly empty), ``y`` and
  ``batch_size`` on papers, as NeighborLoader builds it."""
  import torch  # pylint: disable=g-import-not-at-top
  from torch_geometric.data import HeteroData  # pylint: disable=g-import-not-at-top

  g = dataset.graph
  data = HeteroData()
  for t, name in enumerate(g.node_type_names):
    ids = batch.node_ids[t]
    data[name].x = torch.from_numpy(np.ascontiguousarray(dataset.features[t][ids]))
    data[name].n_id = torch.from_numpy(ids)
  papers = g.node_type_names.index("paper")
  data["paper"].y = torch.from_numpy(
    dataset.labels[batch.node_ids[papers][: batch.batch_size]].astype(np.int64)
  )
  data["paper"].batch_size = batch.batch_size
  for rel, (src, dst) in zip(dataset.relation_types, batch.edges):
    data[tuple(rel)].edge_index = torch.from_numpy(np.stack([src, dst]).astype(np.int64))
  return data


def pyg_model(kind: str, dataset: MagDataset, hidden: int, heads: int, seed: int = 0):
  """PyG's counterpart of `jaxdata.train.attention`'s classifier of `kind`, same widths.

  "hgt": HGTConv(every type's width -> hidden) -> HGTConv(hidden -> hidden) -> Linear on
  papers, as `HGTClassifier` (our HGT is PyG 2.8's HGTConv). "rgat": per-type Linear to
  hidden, then twice RGATConv (additive self-attention across relations, heads concatenated,
  bias) plus a self-loop Linear, ReLU, then a Linear on papers, as `RGATClassifier`. PyG's
  initialisation, seeded with `seed`.
  """
  import torch  # pylint: disable=g-import-not-at-top
  from torch_geometric.nn import HGTConv, RGATConv  # pylint: disable=g-import-not-at-top

  torch.manual_seed(seed)
  g = dataset.graph
  names = tuple(g.node_type_names)
  widths = {n: int(x.shape[1]) for n, x in zip(names, dataset.features)}
  relations = [tuple(r) for r in dataset.relation_types]
  classes = dataset.num_classes

  class HGT(torch.nn.Module):
    def __init__(self):
      super().__init__()
      metadata = (list(names), relations)
      self.conv1 = HGTConv(widths, hidden, metadata, heads=heads)
      self.conv2 = HGTConv(hidden, hidden, metadata, heads=heads)
      self.classify = torch.nn.Linear(hidden, classes)

    def forward(self, x_dict, edge_index_dict):
      h = self.conv2(self.conv1(x_dict, edge_index_dict), edge_index_dict)
      return self.classify(h["paper"])

  class RGAT(torch.nn.Module):
    def __init__(self):
      super().__init__()
      self.embed = torch.nn.ModuleDict({n: torch.nn.Linear(widths[n], hidden) for n in names})
      self.convs = torch.nn.ModuleList(
        [
          RGATConv(
            hidden,
            hidden // heads,
            num_relations=len(relations),
            heads=heads,
            concat=True,
            bias=True,
            attention_mode="additive-self-attention",
            attention_mechanism="across-relation",
          )
          for _ in range(2)
        ]
      )
      self.roots = torch.nn.ModuleList(
        [torch.nn.Linear(hidden, hidden, bias=False) for _ in range(2)]
      )
      self.classify = torch.nn.Linear(hidden, classes)

    def forward(self, x_dict, edge_index_dict):
      # HeteroData.to_homogeneous's layout: node types one after another, papers first.
      xs = [self.embed[n](x_dict[n]) for n in names]
      offsets = dict(zip(names, np.cumsum([0] + [int(x.shape[0]) for x in xs]).tolist()))
      x = torch.cat(xs)
      index, etype = [], []
      for r, rel in enumerate(relations):
        ei = edge_index_dict[rel]
        shift = torch.tensor([[offsets[rel[0]]], [offsets[rel[2]]]], device=ei.device)
        index.append(ei + shift)
        etype.append(torch.full((ei.shape[1],), r, dtype=torch.long, device=ei.device))
      index, etype = torch.cat(index, 1), torch.cat(etype)
      for conv, root in zip(self.convs, self.roots):
        x = torch.relu(conv(x, index, etype) + root(x))
      return self.classify(x[: offsets[names[1]]])

  if kind == "hgt":
    return HGT()
  if kind == "rgat":
    return RGAT()
  raise ValueError(f"pyg_model: kind must be 'hgt' or 'rgat', got {kind!r}")
