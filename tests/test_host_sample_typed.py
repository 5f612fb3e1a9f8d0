"""Typed (relational) neighbour sampling: HostGraph etypes, Blocks.etypes, on every platform.

The strongest check is a NumPy re-implementation of the sampler's documented draw (sample.h:
SplitMix64 counters, Floyd's algorithm, `fold_in(key, hop)` per hop), written here from that
description, run on a CSR built here from the edge list: for a key it must give exactly the
kernel's nodes, masks and relations. Beside it: typed nodes and masks equal the untyped sample,
every (parent, node, relation) is an edge of the graph, a pair joined by several relations shows
each in proportion to its edges, CPU and GPU agree, jit and vmap, and bad input.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from handle_errors import assert_handle_error

from jaxdata.host import Blocks, DeviceGraph, HostGraph, HostTable, host_gather, sample_neighbors

P_MIN = 1e-3  # chi-square p-value threshold; every statistical test below uses a fixed seed
NUM_RELATIONS = 5

# -- a NumPy reference of the draw -----------------------------------------------------------------

MASK64 = (1 << 64) - 1


def mix64(z):
  """SplitMix64's finalizer, on Python ints modulo 2**64."""
  z = (z + 0x9E3779B97F4A7C15) & MASK64
  z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
  z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
  return z ^ (z >> 31)


def below(row_key, t, m):
  """Draw t of a row's stream as an integer in [0, m): the high half of draw * m."""
  return (mix64((row_key + (t + 1) * 0xD1B54A32D192ED03) & MASK64) * m) >> 64


def positions(row_key, degree, fanout, replace):
  """Offsets into a node's neighbour list, one per slot, -1 for an unused slot."""
  if degree == 0:
    return [-1] * fanout
  if replace:
    return [below(row_key, s, degree) for s in range(fanout)]
  if degree <= fanout:
    return list(range(degree)) + [-1] * (fanout - degree)
  taken = []
  for s in range(fanout):  # Floyd: j = d - k + s, draw t in [0, j]; t unless taken, else j
    j = degree - fanout + s
    t = below(row_key, s, j + 1)
    taken.append(j if t in taken else t)
  return taken


def reference_sample(indptr, indices, etypes, seeds, fanouts, key, replace=False):
  """(nodes, masks, relations) per hop, as sample_neighbors documents them, from a CSR."""
  num_nodes = len(indptr) - 1
  seeds = np.asarray(seeds, np.int64)
  ok = (seeds >= 0) & (seeds < num_nodes)
  nodes, masks = [np.where(ok, seeds, -1).astype(np.int32)], [ok]
  rels = [np.full(len(seeds), -1, np.int32)]
  for hop, fanout in enumerate(fanouts):
    w = np.asarray(jax.random.bits(jax.random.fold_in(key, hop), (2,), jnp.uint32))
    key64 = (int(w[0]) << 32) | int(w[1])
    kids, kid_rels = [], []
    for row, v in enumerate(nodes[-1].tolist()):
      first = int(indptr[v]) if v >= 0 else 0
      degree = int(indptr[v + 1]) - first if v >= 0 else 0
      for p in positions(mix64(key64 ^ mix64(row)), degree, fanout, replace):
        kids.append(int(indices[first + p]) if p >= 0 else -1)
        kid_rels.append(int(etypes[first + p]) if p >= 0 else -1)
    kids = np.array(kids, np.int32).reshape(-1)
    nodes.append(kids)
    masks.append(kids >= 0)
    rels.append(np.array(kid_rels, np.int32).reshape(-1))
  return nodes, masks, rels


def csr_reference(senders, receivers, etypes, num_nodes):
  """Neighbour lists (with relations) in edge order, by a plain loop."""
  lists = [[] for _ in range(num_nodes)]
  for u, v, r in zip(
    np.asarray(senders).tolist(), np.asarray(receivers).tolist(), np.asarray(etypes).tolist()
  ):
    lists[v].append((u, r))
  indptr = np.cumsum([0] + [len(x) for x in lists])
  indices = np.array([u for x in lists for u, _ in x], np.int64)
  rels = np.array([r for x in lists for _, r in x], np.int64)
  return indptr, indices, rels


class TypedEdgeSet:
  """The multiset of typed edges (u -> v, r): how many there are of each."""

  def __init__(self, senders, receivers, etypes, num_nodes):
    self.n = num_nodes
    self.keys, self.counts = np.unique(self.key(receivers, senders, etypes), return_counts=True)
    self.degree = np.bincount(np.asarray(receivers), minlength=num_nodes)

  def key(self, v, u, r):
    return (
      np.asarray(v, np.int64) * self.n + np.asarray(u, np.int64)
    ) * NUM_RELATIONS + np.asarray(r, np.int64)

  def multiplicity(self, v, u, r):
    keys = self.key(v, u, r)
    pos = np.minimum(np.searchsorted(self.keys, keys), len(self.keys) - 1)
    return np.where(self.keys[pos] == keys, self.counts[pos], 0)


def typed_edges(rng, num_nodes, num_edges):
  """Random edges with duplicates, relations 0..NUM_RELATIONS-1, hubs and nodes without edges;
  some pairs are joined by edges of two or three relations."""
  receivers = rng.integers(0, num_nodes, num_edges)
  receivers[: num_edges // 5] = rng.integers(0, 8, num_edges // 5)  # hubs
  receivers = receivers[receivers % 7 != 3]  # nodes without neighbours
  senders = rng.integers(0, num_nodes, len(receivers))
  etypes = rng.integers(0, NUM_RELATIONS, len(receivers))
  # Repeat some edges under other relations (and some under the same one: true duplicates).
  again = rng.choice(len(receivers), len(receivers) // 4, replace=False)
  senders = np.concatenate([senders, senders[again]])
  receivers = np.concatenate([receivers, receivers[again]])
  etypes = np.concatenate([etypes, rng.integers(0, NUM_RELATIONS, len(again))])
  perm = rng.permutation(len(senders))
  return senders[perm], receivers[perm], etypes[perm]


@pytest.fixture(scope="module")
def typed_data():
  rng = np.random.default_rng(0)
  num_nodes = 1500
  senders, receivers, etypes = typed_edges(rng, num_nodes, 12_000)
  return senders, receivers, etypes, num_nodes, TypedEdgeSet(senders, receivers, etypes, num_nodes)


def on_cpu(fn, *args, **kwargs):
  with jax.default_device(jax.devices("cpu")[0]):
    return jax.block_until_ready(fn(*args, **kwargs))


def arrays(blocks):
  return [np.asarray(x) for x in blocks.nodes + blocks.masks + (blocks.etypes or ())]


def assert_same_blocks(a, b):
  assert a.fanouts == b.fanouts and (a.etypes is None) == (b.etypes is None)
  for x, y in zip(arrays(a), arrays(b)):
    np.testing.assert_array_equal(x, y)


def some_seeds(rng, num_nodes, size):
  seeds = rng.integers(-1, num_nodes, size).astype(np.int32)  # -1: padding
  seeds[:6] = [0, 1, 3, 3, -1, num_nodes - 1]  # hubs, a repeat, a node without neighbours
  return seeds


def make_graph(kind, senders, receivers, etypes, num_nodes):
  """(the graph to sample, the HostGraph to close)."""
  host = HostGraph.from_edges(
    senders, receivers, num_nodes, etypes=etypes, num_relations=NUM_RELATIONS
  )
  return (host if kind == "host" else DeviceGraph.from_host(host)), host


# -- the draw, against the reference ---------------------------------------------------------------


@pytest.mark.parametrize("kind", ["host", "device"])
@pytest.mark.parametrize("replace", [False, True])
@pytest.mark.parametrize("fanouts", [(4,), (6, 3)])
def test_typed_sample_equals_the_numpy_reference_draw(device, typed_data, kind, replace, fanouts):
  senders, receivers, etypes, num_nodes, _ = typed_data
  seeds = some_seeds(np.random.default_rng(1), num_nodes, 120)
  key = jax.random.key(11)
  indptr, indices, rels = csr_reference(senders, receivers, etypes, num_nodes)
  want = reference_sample(indptr, indices, rels, seeds, fanouts, key, replace)
  graph, host = make_graph(kind, senders, receivers, etypes, num_nodes)
  with host:
    got = jax.block_until_ready(
      sample_neighbors(graph, jnp.asarray(seeds), fanouts, key, replace=replace)
    )
    cpu = on_cpu(sample_neighbors, graph, jnp.asarray(seeds), fanouts, key, replace=replace)
  assert isinstance(got, Blocks) and got.etypes is not None
  assert len(got.etypes) == len(fanouts) + 1
  for hop in range(len(fanouts) + 1):
    np.testing.assert_array_equal(np.asarray(got.nodes[hop]), want[0][hop], err_msg=f"hop {hop}")
    np.testing.assert_array_equal(np.asarray(got.masks[hop]), want[1][hop], err_msg=f"hop {hop}")
    np.testing.assert_array_equal(np.asarray(got.etypes[hop]), want[2][hop], err_msg=f"hop {hop}")
    assert got.etypes[hop].dtype == jnp.int32 and got.etypes[hop].devices() == {device}
  assert_same_blocks(got, cpu)  # the same draws on every platform


@pytest.mark.parametrize("replace", [False, True])
def test_nodes_and_masks_equal_the_untyped_sample(device, typed_data, replace):
  senders, receivers, etypes, num_nodes, _ = typed_data
  seeds = jnp.asarray(some_seeds(np.random.default_rng(2), num_nodes, 300))
  with (
    HostGraph.from_edges(senders, receivers, num_nodes, etypes=etypes) as typed,
    HostGraph.from_edges(senders, receivers, num_nodes) as plain,
  ):
    for graphs in ((typed, plain), (DeviceGraph.from_host(typed), DeviceGraph.from_host(plain))):
      a = sample_neighbors(graphs[0], seeds, (5, 2), jax.random.key(3), replace=replace)
      b = sample_neighbors(graphs[1], seeds, (5, 2), jax.random.key(3), replace=replace)
      assert b.etypes is None and a.etypes is not None
      for x, y in zip(a.nodes + a.masks, b.nodes + b.masks):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("replace", [False, True])
def test_every_sampled_edge_is_an_edge_of_its_relation(device, typed_data, replace):
  senders, receivers, etypes, num_nodes, edges = typed_data
  seeds = some_seeds(np.random.default_rng(4), num_nodes, 2000)
  fanouts = (8, 3)
  with HostGraph.from_edges(senders, receivers, num_nodes, etypes=etypes) as g:
    blocks = jax.block_until_ready(
      sample_neighbors(g, jnp.asarray(seeds), fanouts, jax.random.key(4), replace=replace)
    )
  for hop, f in enumerate(fanouts):
    parents = np.asarray(blocks.nodes[hop])
    kids, kmask = (np.asarray(a).reshape(-1, f) for a in blocks.neighbours(hop))
    rels = np.asarray(blocks.relations(hop))
    np.testing.assert_array_equal(rels[~kmask], -1)  # padding has no relation
    assert np.all(np.asarray(blocks.etypes[0]) == -1)  # nor have the seeds
    rows, cols = np.nonzero(kmask)
    v, u, r = parents[rows], kids[rows, cols], rels[rows, cols]
    assert np.all((r >= 0) & (r < NUM_RELATIONS))
    mult = edges.multiplicity(v, u, r)
    assert np.all(mult > 0), (
      f"hop {hop + 1}: {int(np.sum(mult == 0))} (node, relation) pairs are not edges of the graph"
    )
    if not replace:  # every typed edge at most once per row
      keys, times = np.unique(np.stack([rows, u, r]), axis=1, return_counts=True)
      assert np.all(times <= edges.multiplicity(parents[keys[0]], keys[1], keys[2]))


@pytest.mark.parametrize("fanout,replace", [(1, False), (3, False), (3, True)])
def test_a_pair_joined_by_several_relations_shows_each_in_proportion(device, fanout, replace):
  # Node 0's five in-edges: from 5 by relations 0, 0 and 1; from 7 by 2; from 8 by 1.
  senders = np.array([5, 8, 5, 7, 5, 0, 1])
  receivers = np.array([0, 0, 0, 0, 0, 1, 2])
  etypes = np.array([0, 1, 1, 2, 0, 3, 4])
  categories = {(5, 0): 2, (5, 1): 1, (7, 2): 1, (8, 1): 1}  # (node, relation): edges
  rows = 20_000
  with HostGraph.from_edges(senders, receivers, 9, etypes=etypes) as g:
    picks = jax.block_until_ready(
      [
        sample_neighbors(
          g, jnp.zeros(rows, jnp.int32), (fanout,), jax.random.key(k), replace=replace
        )
        for k in range(2)
      ]
    )  # before the graph closes
  kids = np.concatenate([np.asarray(b.nodes[1]) for b in picks])
  rels = np.concatenate([np.asarray(b.etypes[1]) for b in picks])
  assert np.all(kids >= 0)
  seen = {(int(a), int(b)) for a, b in np.unique(np.stack([kids, rels]), axis=1).T}
  assert seen == set(categories), seen  # both relations of 5 show, nothing else does
  counts = np.array([np.sum((kids == u) & (rels == r)) for u, r in categories])
  mult = np.array(list(categories.values()))
  # Each edge is in a row's sample with probability fanout / 5 (with replacement: each slot
  # draws it with probability 1 / 5), so a pair in proportion to its edges of that relation.
  expected = 2 * rows * fanout * mult / mult.sum()
  assert scipy.stats.chisquare(counts, expected).pvalue > P_MIN, (counts, expected)
  if not replace:  # (5, 0) is two edges: both in a row sometimes, never three
    per_row = ((kids == 5) & (rels == 0)).reshape(-1, fanout).sum(1)
    assert per_row.max() == min(2, fanout)


def test_cpu_and_gpu_agree_on_many_rows(device, typed_data):
  senders, receivers, etypes, num_nodes, _ = typed_data
  seeds = np.random.default_rng(5).integers(0, num_nodes, 20_000)
  with HostGraph.from_edges(senders, receivers, num_nodes, etypes=etypes) as g:
    dg = DeviceGraph.from_host(g)
    for graph in (g, dg):
      here = jax.block_until_ready(sample_neighbors(graph, seeds, (10, 3), jax.random.key(5)))
      cpu = on_cpu(sample_neighbors, graph, seeds, (10, 3), jax.random.key(5))
      assert_same_blocks(here, cpu)
    assert_same_blocks(
      sample_neighbors(g, seeds, (10, 3), jax.random.key(5)),
      sample_neighbors(dg, seeds, (10, 3), jax.random.key(5)),
    )


# -- transformations -------------------------------------------------------------------------------


def test_jit_matches_eager(device, typed_data):
  senders, receivers, etypes, num_nodes, _ = typed_data
  seeds = jnp.arange(-3, 60)
  with HostGraph.from_edges(senders, receivers, num_nodes, etypes=etypes) as g:
    eager = sample_neighbors(g, seeds, (4, 2), jax.random.key(9))
    as_argument = jax.jit(sample_neighbors, static_argnums=(2,))(
      g, seeds, (4, 2), jax.random.key(9)
    )
    closed_over = jax.jit(lambda s, k: sample_neighbors(g, s, (4, 2), k))(seeds, jax.random.key(9))
    dg = DeviceGraph.from_host(g)
    device_jit = jax.jit(sample_neighbors, static_argnums=(2,))(
      dg, seeds, (4, 2), jax.random.key(9)
    )
    jax.block_until_ready((eager, as_argument, closed_over, device_jit))
  for other in (as_argument, closed_over, device_jit):
    assert_same_blocks(eager, other)


def test_vmap_over_keys_and_seeds(device, typed_data):
  senders, receivers, etypes, num_nodes, _ = typed_data
  keys = jax.random.split(jax.random.key(10), 4)
  seeds = jnp.arange(40).reshape(4, 10) * 7 - 3
  with HostGraph.from_edges(senders, receivers, num_nodes, etypes=etypes) as g:
    by_key = jax.jit(jax.vmap(lambda k: sample_neighbors(g, seeds[0], (3, 2), k)))(keys)
    by_both = jax.jit(jax.vmap(lambda s, k: sample_neighbors(g, s, (3, 2), k)))(seeds, keys)
    single = jax.jit(lambda s, k: sample_neighbors(g, s, (3, 2), k))
    one = [single(seeds[i], keys[i]) for i in range(4)]
    first = [single(seeds[0], keys[i]) for i in range(4)]
    jax.block_until_ready((by_key, by_both, one, first))  # all of them before the graph closes
  assert by_key.etypes[1].shape == (4, 30)

  def pick(b, i):
    return jax.tree.map(lambda x: x[i], b)  # Blocks is a pytree

  for i in range(4):
    assert_same_blocks(pick(by_key, i), first[i])
    assert_same_blocks(pick(by_both, i), one[i])
  assert np.any(np.asarray(by_key.etypes[1][0]) != np.asarray(by_key.etypes[1][1]))


# -- Blocks ----------------------------------------------------------------------------------------


def test_blocks_carry_etypes_as_pytree_data(device):
  with (
    HostGraph.from_edges([1, 2, 2, 0], [0, 0, 0, 1], 3, etypes=[0, 1, 2, 0]) as g,
    HostGraph.from_edges([1], [0], 3) as untyped,
  ):
    blocks = sample_neighbors(g, jnp.array([0, 1]), (3,), jax.random.key(0))
    plain = sample_neighbors(untyped, jnp.array([0, 1]), (3,), jax.random.key(0))
    jax.block_until_ready((blocks, plain))
  leaves, treedef = jax.tree.flatten(blocks)
  assert len(leaves) == 6 and len(jax.tree.leaves(plain)) == 4  # etypes are data, not static
  rebuilt = jax.tree.unflatten(treedef, leaves)
  assert_same_blocks(rebuilt, blocks)
  through_jit = jax.jit(lambda b: b)(blocks)
  assert_same_blocks(through_jit, blocks)
  # node 0's in-edges (1, r0), (2, r1), (2, r2): all three kept, in CSR order
  np.testing.assert_array_equal(np.asarray(blocks.relations(0)), [[0, 1, 2], [0, -1, -1]])
  np.testing.assert_array_equal(np.asarray(blocks.neighbours(0)[0]), [[1, 2, 2], [0, -1, -1]])
  with pytest.raises(ValueError, match="Blocks.relations: .* without etypes"):
    plain.relations(0)


def test_to_jraph_carries_the_relations(device):
  pytest.importorskip("jraph")
  with (
    HostGraph.from_edges([1, 2, 2, 0], [0, 0, 0, 1], 3, etypes=[0, 1, 2, 0]) as g,
    HostGraph.from_edges([1], [0], 3) as plain,
  ):
    blocks = sample_neighbors(g, jnp.array([0, 1]), (3,), jax.random.key(0))
    untyped = sample_neighbors(plain, jnp.array([0]), (1,), jax.random.key(0))
    jax.block_until_ready((blocks, untyped))
  graph = blocks.to_jraph(0)
  np.testing.assert_array_equal(np.asarray(graph.edges["etype"]), np.asarray(blocks.etypes[1]))
  assert "etype" not in untyped.to_jraph(0).edges


def test_empty_seed_batch_and_a_typed_graph_without_edges(device):
  with HostGraph.from_edges([], [], num_nodes=4, etypes=[]) as empty:
    assert empty.num_relations == 0 and empty.etypes.shape == (1, 1)
    blocks = sample_neighbors(empty, jnp.array([0, 3, -1]), (2,), jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(blocks.etypes[1]), np.full(6, -1))
    none = sample_neighbors(empty, jnp.zeros((0,), jnp.int32), (2, 2), jax.random.key(0))
    assert [e.shape for e in none.etypes] == [(0,), (0,), (0,)]
    same = sample_neighbors(
      DeviceGraph.from_host(empty), jnp.array([0, 3, -1]), (2,), jax.random.key(0)
    )
    assert_same_blocks(same, blocks)


# -- HostGraph -------------------------------------------------------------------------------------


def test_from_edges_orders_the_relations_with_the_csr(typed_data):
  senders, receivers, etypes, num_nodes, _ = typed_data
  indptr, indices, rels = csr_reference(senders, receivers, etypes, num_nodes)
  for make in (
    lambda: HostGraph.from_edges(senders, receivers, num_nodes, etypes=etypes),
    lambda: HostGraph(indptr, indices, etypes=rels),
  ):
    with make() as g:
      assert g.num_relations == NUM_RELATIONS
      assert g.etypes.shape == (g.num_edges, 1) and g.etypes.dtype == np.int32
      assert g.etypes.pinned == g.indices.pinned
      np.testing.assert_array_equal(g.indices.as_numpy()[:, 0], indices)
      np.testing.assert_array_equal(g.etypes.as_numpy()[:, 0], rels)
      assert "relations=5" in repr(g)
      dg = DeviceGraph.from_host(g)
      np.testing.assert_array_equal(np.asarray(dg.etypes), rels)
      assert dg.etypes.dtype == jnp.int32
  with HostGraph.from_edges(senders, receivers, num_nodes) as g:
    assert g.etypes is None and g.num_relations is None and "relations" not in repr(g)
    assert DeviceGraph.from_host(g).etypes is None


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.int64, np.uint64])
def test_etypes_of_every_integer_dtype_and_an_explicit_num_relations(dtype):
  with HostGraph.from_edges(
    [0, 1, 2], [1, 2, 0], 3, etypes=np.array([2, 0, 1], dtype), num_relations=np.int64(7)
  ) as g:
    assert g.num_relations == 7 and isinstance(g.num_relations, int)
    np.testing.assert_array_equal(g.etypes.as_numpy()[:, 0], [1, 2, 0])  # receiver order


def test_from_jraph_takes_etypes():
  jraph = pytest.importorskip("jraph")
  rng = np.random.default_rng(16)
  senders, receivers = rng.integers(0, 12, 40), rng.integers(0, 12, 40)
  etypes = rng.integers(0, 3, 40)
  gt = jraph.GraphsTuple(
    nodes=None,
    edges=None,
    senders=jnp.asarray(senders),
    receivers=jnp.asarray(receivers),
    n_node=jnp.array([5, 7]),
    n_edge=jnp.array([20, 20]),
    globals=None,
  )
  _, _, rels = csr_reference(senders, receivers, etypes, 12)
  with HostGraph.from_jraph(gt, etypes=etypes, num_relations=4) as g:
    assert g.num_relations == 4
    np.testing.assert_array_equal(g.etypes.as_numpy()[:, 0], rels)


def test_close_releases_the_etypes_table():
  g = HostGraph.from_edges([0, 1], [1, 0], 2, etypes=[1, 0])
  table = g.etypes
  g.close()
  assert table.closed and g.closed
  with pytest.raises(ValueError, match="etypes: .* is closed"):
    g.etypes  # noqa: B018


# -- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "etypes,num_relations,error,match",
  [
    ([0, 1], None, ValueError, r"etypes must have one entry per edge \(3\)"),
    ([0, 1, 2, 3], None, ValueError, "one entry per edge"),
    ([[0], [1], [2]], None, ValueError, "one entry per edge"),
    ([0, -1, 2], None, ValueError, "etypes must be >= 0, got -1"),
    ([0.0, 1.0, 2.0], None, TypeError, "etypes must be integers"),
    ([True, False, True], None, TypeError, "etypes must be integers"),
    (np.array([0, 2**31, 1], np.int64), None, ValueError, "does not fit int32"),
    ([0, 4, 1], 3, ValueError, "num_relations is 3, but etypes holds relation 4"),
    ([0, 1, 1], 2.0, TypeError, "num_relations must be an integer"),
    (None, 3, ValueError, "num_relations given without etypes"),
  ],
)
def test_bad_etypes(etypes, num_relations, error, match):
  with pytest.raises(error, match=match):
    HostGraph(
      np.array([0, 1, 2, 3]), np.array([1, 2, 0]), etypes=etypes, num_relations=num_relations
    )
  if etypes is not None and np.shape(etypes)[:1] != (3,):
    match = "etypes .* one entry per edge"
  with pytest.raises(error, match=match):
    HostGraph.from_edges([1, 2, 0], [0, 1, 2], 3, etypes=etypes, num_relations=num_relations)


def test_bad_device_graph_etypes():
  with HostGraph.from_edges([0, 1, 2], [1, 2, 0], 3, etypes=[0, 1, 0]) as g:
    dg = DeviceGraph.from_host(g)
  with pytest.raises(TypeError, match="sample_neighbors: DeviceGraph.etypes must be an integer"):
    sample_neighbors(
      dg._replace(etypes=dg.etypes.astype(jnp.float32)), jnp.array([0]), (2,), jax.random.key(0)
    )
  with pytest.raises(ValueError, match="sample_neighbors: DeviceGraph.etypes .* one entry per"):
    sample_neighbors(dg._replace(etypes=dg.etypes[:2]), jnp.array([0]), (2,), jax.random.key(0))


@pytest.fixture
def small_typed():
  with HostGraph.from_edges([0, 1, 2], [1, 2, 0], 3, etypes=[0, 1, 0]) as g:
    yield g


@pytest.mark.parametrize(
  "fanouts,error,match",
  [((0,), ValueError, ">= 1"), ((3, -1), ValueError, ">= 1"), ((2.0,), TypeError, "Python ints")],
)
def test_bad_fanouts_and_seeds_of_a_typed_graph(small_typed, fanouts, error, match):
  key = jax.random.key(0)
  with pytest.raises(error, match=f"sample_neighbors: .*{match}"):
    sample_neighbors(small_typed, jnp.array([0]), fanouts, key)
  with pytest.raises(TypeError, match="sample_neighbors: seeds must be integers"):
    sample_neighbors(small_typed, jnp.array([0.0]), (2,), key)
  with pytest.raises(ValueError, match="sample_neighbors: seed 3 is outside"):
    sample_neighbors(small_typed, jnp.array([3]), (2,), key)


def test_a_closed_typed_graph(device):
  g = HostGraph.from_edges([0, 1, 2], [1, 2, 0], 3, etypes=[0, 1, 0])
  compiled = jax.jit(lambda s, k: sample_neighbors(g, s, (2,), k))
  jax.block_until_ready(compiled(jnp.array([0]), jax.random.key(0)))
  g.close()
  with pytest.raises(ValueError, match="sample_neighbors: .* is closed"):
    sample_neighbors(g, jnp.array([0]), (2,), jax.random.key(0))
  with HostTable(np.ones((1, 1), np.float32)) as probe:
    assert_handle_error(
      lambda: compiled(jnp.array([0]), jax.random.key(0)),
      "is closed",
      then=lambda: host_gather(probe, jnp.array([0])),
      untouched=lambda b: (
        not np.asarray(b.masks[1]).any() and np.all(np.asarray(b.etypes[1]) == -1)
      ),
    )


def _raw_typed_sample(g, etypes_handle, nodes, fanout, relations=True):
  shape = (nodes.shape[0], fanout)
  outs = (jax.ShapeDtypeStruct(shape, jnp.int32), jax.ShapeDtypeStruct(shape, bool))
  if relations:
    outs += (jax.ShapeDtypeStruct(shape, jnp.int32),)
  return jax.ffi.ffi_call("jaxdata_host_sample", outs)(
    g.indptr.handle,
    g.indices.handle,
    nodes,
    jnp.zeros(2, jnp.uint32),
    jnp.asarray(etypes_handle, jnp.int32),
    num_nodes=np.int64(g.num_nodes),
    num_edges=np.int64(g.indices.shape[0]),
    fanout=np.int64(fanout),
    replace=np.int32(0),
  )


def test_a_bad_etypes_handle_reads_nothing(device, small_typed):
  nodes = jnp.array([0, 1, 2, 0], jnp.int32)
  with (
    HostTable(np.ones((1, 1), np.float32)) as probe,
    HostTable(np.zeros((5, 1), np.int32)) as wrong_rows,
  ):
    gone = HostTable(np.zeros((3, 1), np.int32))
    gone_id = gone.table_id
    gone.close()
    for handle, match in ((gone_id, "is closed"), (wrong_rows.table_id, "5 rows")):
      assert_handle_error(
        functools.partial(_raw_typed_sample, small_typed, handle, nodes, 2),
        match,
        then=lambda: host_gather(probe, jnp.array([0])),
        untouched=lambda r: not np.asarray(r[1]).any() and np.all(np.asarray(r[2]) == -1),
      )
    got = _raw_typed_sample(small_typed, small_typed.etypes.handle, nodes, 2)  # the real one
    assert np.asarray(got[1]).sum() == 4 and np.all(np.asarray(got[2])[np.asarray(got[1])] >= 0)


def test_etypes_without_the_relations_output_is_refused(device, small_typed):
  with pytest.raises(Exception, match="etypes and the relations output must be passed together"):
    jax.block_until_ready(
      _raw_typed_sample(
        small_typed, small_typed.etypes.handle, jnp.array([0], jnp.int32), 2, relations=False
      )
    )
