"""Graph construction in plain NumPy: the formulations the native builders must match.

`jaxdata.data.HeteroGraph` and `jaxdata.hector.GraphArrays` build their arrays with the
multithreaded native code of `xla_ffi/data/graph_build.cc` (through `jaxdata.data.graph_build`).
These are the NumPy versions they replaced, kept as the ground truth of tests (the results must
be equal bit for bit) and as the "NumPy" column of `probe_graph_build.py`. They are simple
and single-threaded; on a 64M-edge graph they take about a minute in all.
"""

from __future__ import annotations

import numpy as np


def edge_key(
  src: np.ndarray, dst: np.ndarray, etype: np.ndarray, num_nodes: int, num_relations: int
) -> np.ndarray | None:
  """One int64 per edge that orders edges by (etype, dst, src), or None if it would overflow."""
  n = max(num_nodes, 1)
  if max(num_relations, 1) * n * n >= 2**63:
    return None
  return (np.asarray(etype, np.int64) * n + dst) * n + src


def sort_order(
  src: np.ndarray, dst: np.ndarray, etype: np.ndarray, num_nodes: int, num_relations: int
) -> np.ndarray:
  """The stable permutation that sorts edges by (etype, dst, src)."""
  key = edge_key(src, dst, etype, num_nodes, num_relations)
  if key is not None:  # one stable sort of one key instead of three
    return np.argsort(key, kind="stable")
  return np.lexsort((src, dst, etype))


def is_sorted(src: np.ndarray, dst: np.ndarray, etype: np.ndarray) -> bool:
  """Whether the edges are sorted by (etype, dst, src)."""
  src, dst, etype = (np.asarray(a, np.int64) for a in (src, dst, etype))
  d_e, d_d, d_s = etype[1:] - etype[:-1], dst[1:] - dst[:-1], src[1:] - src[:-1]
  return not ((d_e < 0) | ((d_e == 0) & ((d_d < 0) | ((d_d == 0) & (d_s < 0))))).any()


def grouped(keys: np.ndarray, groups: int) -> tuple[np.ndarray, np.ndarray]:
  """(offsets int64[groups + 1], ids int64): the i with keys[i] == g are
  ids[offsets[g]:offsets[g + 1]], ascending: a CSR (keys = src) or CSC (keys = dst)."""
  counts = np.bincount(keys, minlength=groups)
  offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
  return offsets, np.argsort(keys, kind="stable")


def relation_offsets(etype: np.ndarray, num_relations: int) -> np.ndarray:
  """int64[R+1]: with edges sorted by etype, relation r's are [offsets[r], offsets[r + 1])."""
  return grouped(etype, num_relations)[0]


def mean_edge_norm(dst: np.ndarray, etype: np.ndarray) -> np.ndarray:
  """float32[E]: 1 / (edges of the same relation into the same node), edges sorted by
  (etype, dst): a run of equal (etype, dst) is one group."""
  e = len(dst)
  starts = np.flatnonzero(
    np.concatenate([[e > 0], (etype[1:] != etype[:-1]) | (dst[1:] != dst[:-1])])
  )
  lengths = np.diff(np.append(starts, e))
  return np.repeat((1.0 / lengths).astype(np.float32), lengths)


def unique_pairs(src: np.ndarray, etype: np.ndarray, num_nodes: int, num_relations: int):
  """The unique (src, relation) pairs of edges and the maps between edges and pairs.

  Returns pair[E], pair_offsets[P+1], pair_edges[E], pair_src[P], pair_etype[P],
  pair_rel_offsets[R+1], pair_csr_offsets[N+1], pair_csr_edges[P] (all int64): pairs sorted by
  (relation, source); edge e belongs to pair[e]; the edges of pair u are
  pair_edges[pair_offsets[u]:pair_offsets[u + 1]], ascending.
  """
  key = np.asarray(etype, np.int64) * max(num_nodes, 1) + np.asarray(src, np.int64)
  uniq, pair = np.unique(key, return_inverse=True)  # sorted by (relation, source)
  pair = pair.reshape(-1)
  p_src, p_etype = uniq % max(num_nodes, 1), uniq // max(num_nodes, 1)
  pair_offsets, pair_edges = grouped(pair, len(uniq))
  rel_offsets, _ = grouped(p_etype, num_relations)
  csr_offsets, csr_edges = grouped(p_src, num_nodes)
  return (pair, pair_offsets, pair_edges, p_src, p_etype, rel_offsets, csr_offsets, csr_edges)
