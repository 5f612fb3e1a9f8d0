"""Sampled blocks as hector graphs, built on the device inside a jitted step.

A mini-batch of a relational GNN with L layers samples L hops outward from its seeds. Hop h
starts from a *frontier* U_h (unique node ids; U_0 is the seeds) and draws in-edges of every
frontier node; U_{h+1} is U_h followed by the new nodes those edges reach. Layer l of the model
runs on block h = L - 1 - l: a graph over the nodes U_{h+1} whose edges all end in its prefix
U_h, the layout DGL's blocks use (the destinations are the first rows of the sources). A layer
therefore runs unchanged on a block: it reads the rows of U_{h+1} and returns a row for each,
of which the first ``len(U_h)`` are the ones the next layer (or the loss) reads.

Everything has a fixed shape, so a jitted step compiles once: U_h has ``capacity[h]`` slots,
the unused ones masked, and the last slot of every frontier is always unused (the *padding
node*): padding edges are re-pointed at it with norm 0 and no relation, which keeps every
node id in range, so a block is a valid `GraphArrays` whether its arrays are concrete or
traced; they are its *unused* edges, which no kernel visits, and would touch only the padding
node's row, which nothing reads. Compact materialization works per block (its unique (source,
relation) pairs are computed here, padded to one per edge; the unused pairs hold no relation
either).

    nodes, mask = frontier(seeds)                                   # U_0
    nbrs, nbr_mask, nbr_etype = ...  # [len(nodes), fanout] in-neighbours and their relations
    nodes1, mask1, edges = expand(nodes, mask, nbrs, nbr_mask, nbr_etype)
    graph = block_graph(*edges, num_nodes=len(nodes1), num_relations=R)
    h = layer(graph, x1)[:len(nodes)]                              # rows of U_0

All of it is jnp: it runs on the device that runs the step, with no host round trip.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxdata.hector.runtime import GraphArrays

_NORMS = ("mean", "none")


def capacities(batch_size: int, fanouts) -> tuple[int, ...]:
  """The slots of U_0 ... U_L for `batch_size` seeds and `fanouts` per hop: U_0 holds the seeds
  and a padding slot; U_{h+1} holds U_h, `fanouts[h]` neighbour slots per slot of U_h, and its
  own padding slot."""
  caps = [int(batch_size) + 1]
  for f in fanouts:
    caps.append(caps[-1] * (1 + int(f)) + 1)
  return tuple(caps)


def frontier(seeds: jax.Array) -> tuple[jax.Array, jax.Array]:
  """U_0 from a batch of seeds (negative: padding): (ids int32[B + 1], mask bool[B + 1]).

  Repeated seeds are masked after their first occurrence (a frontier holds each node once).
  Seeds outside the int32 range are padding too: they are mapped to -1 in the dtype given,
  before the cast to int32 (which would wrap 2**32 + 1 to node 1).
  """
  given = seeds if isinstance(seeds, jax.Array) else np.asarray(seeds)
  dtype = given.dtype
  if not np.issubdtype(dtype, np.integer):
    raise TypeError(f"hector.block.frontier: seeds must be integers, got dtype {dtype}")
  if given.ndim != 1:
    raise ValueError(f"hector.block.frontier: seeds must be 1-D, got shape {given.shape}")
  top = np.iinfo(np.int32).max
  if isinstance(given, np.ndarray):
    # padded before JAX sees them: with x64 off, jnp.asarray would wrap 64-bit ids
    ids32 = jnp.asarray(np.where((given >= 0) & (given <= top), given, -1).astype(np.int32))
  elif np.dtype(dtype).itemsize >= 4 and dtype != jnp.int32:
    ids32 = jnp.where((given >= 0) & (given <= jnp.asarray(top, dtype)), given, -1)
  else:
    ids32 = given
  ids32 = ids32.astype(jnp.int32)
  ids = jnp.concatenate([ids32, jnp.full((1,), -1, jnp.int32)])
  first = _first_occurrence(ids, ids >= 0)
  return jnp.where(first, ids, -1), first


def _as_int32(a) -> tuple[jax.Array, jax.Array | None]:
  """Ids as int32, and where that cast could wrap (wider integers), which of them int32 holds:
  an id past it must become an invalid edge, not wrap into another node (2**32 + 1 into 1).
  Checked in the dtype given: a NumPy array before JAX sees it (with x64 off, jnp.asarray
  would wrap it first)."""
  info = np.iinfo(np.int32)
  if not isinstance(a, jax.Array):
    a = np.asarray(a)
    if np.issubdtype(a.dtype, np.integer) and a.dtype.itemsize >= 4 and a.dtype != np.int32:
      fits = (a >= info.min) & (a <= info.max)
      return jnp.asarray(np.where(fits, a, 0).astype(np.int32)), jnp.asarray(fits)
    return jnp.asarray(a).astype(jnp.int32), None
  if jnp.issubdtype(a.dtype, jnp.integer) and a.dtype.itemsize >= 4 and a.dtype != jnp.int32:
    low = max(info.min, int(jnp.iinfo(a.dtype).min))
    fits = (a >= jnp.asarray(low, a.dtype)) & (a <= jnp.asarray(info.max, a.dtype))
    return jnp.where(fits, a, 0).astype(jnp.int32), fits
  return a.astype(jnp.int32), None


def _first_occurrence(ids: jax.Array, valid: jax.Array) -> jax.Array:
  """bool[M]: valid and no valid entry before it has the same id."""
  rep = _representative(ids, valid)
  return valid & (rep == jnp.arange(ids.shape[0]))


def _representative(ids: jax.Array, valid: jax.Array) -> jax.Array:
  """int32[M]: for each entry, the position of the first entry with its id (valid entries only;
  invalid entries get positions of their own group of invalid entries, never used)."""
  m = ids.shape[0]
  key = jnp.where(valid, ids, jnp.iinfo(jnp.int32).max)
  sorted_key, order = _sort(key)
  starts = jnp.concatenate([jnp.ones((1,), bool), sorted_key[1:] != sorted_key[:-1]])
  group_start = jax.lax.cummax(jnp.where(starts, jnp.arange(m, dtype=jnp.int32), 0))
  # A stable sort keeps equal ids in their original order: a group's first is its smallest
  # position.
  return jnp.zeros((m,), jnp.int32).at[order].set(order[group_start], unique_indices=True)


def _sort(key: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(key sorted, int32 positions that sort it), stably: one key and its positions, the sort a
  GPU runs as one radix sort (several keys take XLA's much slower comparison sort)."""
  iota = jax.lax.iota(jnp.int32, key.shape[0])
  sorted_key, order = jax.lax.sort((key, iota), num_keys=1, is_stable=True)
  return sorted_key, order


def _order(major: jax.Array, majors: int, minor: jax.Array, minors: int) -> jax.Array:
  """int32 positions that sort by (major, minor), stably, for ids in ``[0, majors)`` and
  ``[0, minors)``: one radix sort of the composite key where it fits int32, else a lexsort."""
  if majors * minors < 2**31:
    return _sort(major * minors + minor)[1]
  return jnp.lexsort((minor, major)).astype(jnp.int32)


def _offsets(sorted_keys: jax.Array, groups: int) -> jax.Array:
  """int32[groups + 1]: entry g counts the ascending `sorted_keys` below g (`searchsorted` of
  ``arange(groups + 1)``) from a scatter of each run's start and a scan. `jnp.searchsorted`
  is a loop of ~log2(n) steps, and a loop on a GPU costs a launch and a wait per step."""
  e = sorted_keys.shape[0]
  if e == 0:
    return jnp.zeros((groups + 1,), jnp.int32)
  starts = jnp.concatenate([jnp.ones((1,), bool), sorted_keys[1:] != sorted_keys[:-1]])
  at = jnp.where(starts & (sorted_keys >= 0), jnp.minimum(sorted_keys, groups), groups + 1)
  first = (
    jnp.full((groups + 1,), e, jnp.int32).at[at].min(jnp.arange(e, dtype=jnp.int32), mode="drop")
  )
  return jax.lax.cummin(first, reverse=True)


def expand(
  nodes: jax.Array,
  mask: jax.Array,
  neighbours: jax.Array,
  neighbour_mask: jax.Array,
  neighbour_etype: jax.Array,
):
  """One hop: U_{h+1} from U_h and the in-edges sampled for it.

  Args:
    nodes, mask: U_h, int32[C] global ids and bool[C] (valid ids unique; slot C - 1 unused).
    neighbours, neighbour_mask: int32[C, f] the source of every sampled in-edge of each slot,
      bool[C, f] which are real (a masked frontier slot's neighbours are ignored).
    neighbour_etype: int32[C, f] each sampled edge's relation.

  Returns:
    (nodes1, mask1, edges): U_{h+1} as int32[C * (1 + f) + 1] ids (U_h first, in its slots) and
    its mask; edges = (src, dst, etype, valid), int32[C * f] each plus bool, as slots of U_{h+1}
    (src) and U_h (dst): the arguments of `block_graph`.
  """
  c, f = neighbours.shape
  if nodes.shape != (c,) or mask.shape != (c,):
    raise ValueError(
      f"hector.block.expand: nodes and mask must be [{c}] like neighbours' first "
      f"axis, got {nodes.shape} and {mask.shape}"
    )
  if neighbour_mask.shape != (c, f) or neighbour_etype.shape != (c, f):
    raise ValueError(
      f"hector.block.expand: neighbour_mask and neighbour_etype must be "
      f"{(c, f)}, got {neighbour_mask.shape} and {neighbour_etype.shape}"
    )
  edge_valid = (neighbour_mask & mask[:, None]).reshape(-1)
  cand = jnp.concatenate([jnp.where(mask, nodes, -1), neighbours.reshape(-1)]).astype(jnp.int32)
  valid = jnp.concatenate([mask, edge_valid])
  rep = _representative(cand, valid)
  pos = jnp.arange(cand.shape[0], dtype=jnp.int32)
  new = valid & (rep == pos) & (pos >= c)
  slot = jnp.where(pos < c, pos, c + jnp.cumsum(new.astype(jnp.int32)) - 1)
  local = slot[rep]
  size = c * (1 + f) + 1
  nodes1 = jnp.full((size,), -1, jnp.int32).at[:c].set(jnp.where(mask, nodes, -1))
  nodes1 = nodes1.at[jnp.where(new, slot, size)].set(cand, mode="drop")
  src = jnp.where(edge_valid, local[c:], 0)
  # an iota, not jnp.repeat of an arange: XLA constant-folds the repeat's gather, which at a
  # full fanout (7.9M slots) took 122 s of compile time on the H200 (probe_full_fanout.py)
  dst = jax.lax.broadcasted_iota(jnp.int32, (c, f), 0).reshape(-1)
  etype = jnp.where(edge_valid, neighbour_etype.reshape(-1).astype(jnp.int32), 0)
  return nodes1, nodes1 >= 0, (src, dst, etype, edge_valid)


def block_graph(
  src,
  dst,
  etype,
  valid,
  *,
  num_nodes: int,
  num_relations: int,
  norm: str = "mean",
  node_type_offsets=None,
) -> GraphArrays:
  """A `GraphArrays` from a padded list of typed edges, built with jnp (traceable).

  Args:
    src, dst, etype: int[E] ends and relation of each edge, in any order.
    valid: bool[E]; an invalid edge becomes a padding edge from and to node ``num_nodes - 1``
      (the padding node) with no relation (``num_relations``: an unused edge, past
      ``rel_offsets[R]``, that no kernel visits) and norm 0.
    num_nodes: N, static; node N - 1 must be a padding row (no valid edge may touch it).
    num_relations: R, static.
    norm: "mean" (1 / valid edges of the same relation into the same node, the RGCN paper's
      1 / c_{i,r}) or "none" (1 for valid edges); padding edges get 0 either way.
    node_type_offsets: passed through to `GraphArrays` (static).

  Valid ids must be in range (``[0, N - 1)`` for src/dst, ``[0, R)`` for etype); under `jit`
  they cannot be checked, and out-of-range ones are dropped by the kernels (GraphArrays' rule).
  The unique (source, relation) pairs are padded to one per edge: the unused pairs are
  ``(N - 1, R)``, with no edges and no relation, after ``pair_rel_offsets[R]``.
  """
  if norm not in _NORMS:
    raise ValueError(f"hector.block_graph: norm must be one of {_NORMS}, got {norm!r}")
  for name, v in (("num_nodes", num_nodes), ("num_relations", num_relations)):
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
      raise TypeError(f"hector.block_graph: {name} must be an int, got {v!r}")
  n, r = int(num_nodes), int(num_relations)
  if n < 1 or r < 1:
    raise ValueError(
      f"hector.block_graph: num_nodes and num_relations must be >= 1 (one "
      f"node is the padding node), got {n} and {r}"
    )
  valid = jnp.asarray(valid).astype(bool)
  ids = []
  for a in (src, dst, etype):
    a, fits = _as_int32(a)
    ids.append(a)
    if fits is not None:
      valid = valid & fits
  src, dst, etype = ids
  e = src.shape[0]
  for name, a in (("dst", dst), ("etype", etype), ("valid", valid)):
    if a.shape != (e,):
      raise ValueError(
        f"hector.block_graph: {name} must have the shape of src {(e,)}, got {a.shape}"
      )
  pad = n - 1
  # A padding edge is an unused edge (`GraphArrays`): no relation, so it sorts last, past
  # rel_offsets[R], the CSR and CSC views list it after their groups, and no kernel visits it.
  src, dst = jnp.where(valid, src, pad), jnp.where(valid, dst, pad)
  etype = jnp.where(valid, etype, r)
  i32 = jnp.int32

  # Edges sorted by (relation, destination), in their given order within.
  order = _order(etype, r + 1, dst, n)
  src, dst, etype, valid = src[order], dst[order], etype[order], valid[order]
  rel_offsets = _offsets(etype, r)

  def grouped(keys, groups):
    sorted_keys, ids = _sort(keys)
    return _offsets(sorted_keys, groups), ids

  csr_offsets, csr_edges = grouped(jnp.where(valid, src, n), n)
  csc_offsets, csc_edges = grouped(jnp.where(valid, dst, n), n)

  # Norm: runs of equal (relation, destination) are contiguous in this order.
  ends = (
    jnp.concatenate([jnp.ones((1,), bool), (etype[1:] != etype[:-1]) | (dst[1:] != dst[:-1])])
    if e
    else jnp.zeros((0,), bool)
  )
  if norm == "mean":
    # A run's length from its ends (scans), not a segment_sum: the padding edges are one run,
    # often most of a block's edges, and a scatter-add of millions of them into one element
    # serializes on a GPU. A run is all valid or all padding (no valid edge touches node N - 1).
    pos = jnp.arange(e, dtype=i32)
    last = jnp.concatenate([ends[1:], jnp.ones((min(e, 1),), bool)])
    first_of_run = jax.lax.cummax(jnp.where(ends, pos, 0))
    last_of_run = jax.lax.cummin(jnp.where(last, pos, e), reverse=True)
    count = (last_of_run - first_of_run + 1).astype(jnp.float32)
    edge_norm = jnp.where(valid, 1.0 / count, 0.0)
  else:
    edge_norm = valid.astype(jnp.float32)

  # Unique (source, relation) pairs, sorted by (relation, source); unused pairs after them.
  pair_edges = _order(etype, r + 1, src, n)
  ps, pe = src[pair_edges], etype[pair_edges]
  starts = (
    jnp.concatenate([jnp.ones((1,), bool), (ps[1:] != ps[:-1]) | (pe[1:] != pe[:-1])])
    if e
    else jnp.zeros((0,), bool)
  )
  pair_sorted = jnp.cumsum(starts.astype(i32)) - 1
  pair = jnp.zeros((e,), i32).at[pair_edges].set(pair_sorted, unique_indices=True)  # a permutation
  num_pairs = e  # static: one per edge at most
  used = jnp.arange(num_pairs, dtype=i32) < (pair_sorted[-1] + 1 if e else 0)
  # One writer per pair, its first edge: every edge of a pair would write the same value, but
  # the padding edges are one pair, often most of a block's edges, and a GPU scatter with that
  # many repeats of one index serializes on it.
  first = jnp.where(starts, pair_sorted, num_pairs)
  pair_src = jnp.full((num_pairs,), pad, i32).at[first].set(ps, mode="drop")
  pair_etype = jnp.full((num_pairs,), r, i32).at[first].set(pe, mode="drop")
  # unused pairs: no relation (`GraphArrays`), past pair_rel_offsets[R], so no kernel works on them
  pair_src, pair_etype = jnp.where(used, pair_src, pad), jnp.where(used, pair_etype, r)
  pair_offsets = _offsets(pair_sorted, num_pairs)
  pair_rel_offsets = _offsets(pair_etype, r)
  pair_csr_offsets, pair_csr_edges = grouped(pair_src, n)

  types = None if node_type_offsets is None else tuple(int(t) for t in node_type_offsets)
  return GraphArrays(
    src,
    dst,
    etype,
    edge_norm.astype(jnp.float32),
    rel_offsets,
    csr_offsets,
    csr_edges,
    csc_offsets,
    csc_edges,
    pair,
    pair_offsets,
    pair_edges,
    pair_src,
    pair_etype,
    pair_rel_offsets,
    pair_csr_offsets,
    pair_csr_edges,
    n,
    r,
    types,
  )


def edges_numpy(graph: GraphArrays) -> tuple[np.ndarray, ...]:
  """(src, dst, etype, norm) of a block's valid edges as NumPy arrays (norm > 0), for tests and
  inspection."""
  norm = np.asarray(graph.norm)
  keep = norm > 0
  return tuple(np.asarray(a)[keep] for a in (graph.src, graph.dst, graph.etype)) + (norm[keep],)
