"""HostGraph and sample_neighbors against a NumPy edge-set reference, on every platform available.

Every sampled neighbour must be a real in-neighbour, every edge is drawn at most once without
replacement, the fanout and padding rules hold hop by hop, the sample depends only on the key
(and is the same on CPU and GPU), and it is uniform (chi-square tests with fixed seeds).
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from handle_errors import assert_handle_error

from jaxdata.host import Blocks, DeviceGraph, HostGraph, HostTable, host_gather, sample_neighbors

P_MIN = 1e-3  # chi-square p-value threshold; every statistical test below uses a fixed seed


# -- a NumPy reference -----------------------------------------------------------------------------


def random_edges(rng, num_nodes, num_edges, duplicates=False):
  """Shuffled edges senders -> receivers with in-degrees from 0 (every 7th node) to large (hubs)."""
  receivers = rng.integers(0, num_nodes, num_edges)
  receivers[: num_edges // 5] = rng.integers(0, 8, num_edges // 5)  # a few hubs
  receivers = receivers[receivers % 7 != 3]  # nodes without neighbours
  senders = rng.integers(0, num_nodes, receivers.shape[0])
  if not duplicates:
    keys = np.unique(receivers.astype(np.int64) * num_nodes + senders)
    receivers, senders = keys // num_nodes, keys % num_nodes
  perm = rng.permutation(receivers.shape[0])
  return senders[perm], receivers[perm]


class EdgeSet:
  """The multiset of edges u -> v, keyed v * num_nodes + u, and every node's in-degree."""

  def __init__(self, senders, receivers, num_nodes):
    self.num_nodes = num_nodes
    keys = np.asarray(receivers, np.int64) * num_nodes + np.asarray(senders, np.int64)
    self.keys, self.counts = np.unique(keys, return_counts=True)
    self.degree = np.bincount(np.asarray(receivers), minlength=num_nodes)

  def multiplicity(self, v, u):
    """How many edges u -> v there are (0 for none), elementwise."""
    keys = np.asarray(v, np.int64) * self.num_nodes + np.asarray(u, np.int64)
    pos = np.minimum(np.searchsorted(self.keys, keys), len(self.keys) - 1)
    return np.where(self.keys[pos] == keys, self.counts[pos], 0)


def csr_reference(senders, receivers, num_nodes):
  """Neighbour lists in edge order, by a plain loop."""
  lists = [[] for _ in range(num_nodes)]
  for u, v in zip(np.asarray(senders).tolist(), np.asarray(receivers).tolist()):
    lists[v].append(u)
  indptr = np.cumsum([0] + [len(x) for x in lists])
  return indptr, np.array([u for x in lists for u in x], np.int64)


def check_blocks(blocks, seeds, fanouts, edges, replace=False):
  """Every structural promise of `sample_neighbors`, checked against the edge multiset."""
  assert isinstance(blocks, Blocks) and blocks.fanouts == tuple(fanouts)
  assert len(blocks.nodes) == len(blocks.masks) == len(fanouts) + 1
  nodes = [np.asarray(n) for n in blocks.nodes]
  masks = [np.asarray(m) for m in blocks.masks]
  seeds = np.asarray(seeds)
  size = len(seeds)
  for hop in range(len(fanouts) + 1):
    assert nodes[hop].shape == masks[hop].shape == (size,), hop
    assert nodes[hop].dtype == np.int32 and masks[hop].dtype == np.bool_
    assert np.all(nodes[hop][~masks[hop]] == -1), f"hop {hop}: padding is not -1"
    assert np.all(nodes[hop][masks[hop]] >= 0)
    if hop < len(fanouts):
      size *= fanouts[hop]
  seed_ok = (seeds >= 0) & (seeds < edges.num_nodes)
  np.testing.assert_array_equal(masks[0], seed_ok)
  np.testing.assert_array_equal(nodes[0], np.where(seed_ok, seeds, -1))
  for hop, f in enumerate(fanouts):
    parents, pmask = nodes[hop], masks[hop]
    kids, kmask = nodes[hop + 1].reshape(-1, f), masks[hop + 1].reshape(-1, f)
    # The slots of a padding node are padding: the whole subtree below a padded seed is empty.
    assert not kmask[~pmask].any(), f"hop {hop + 1}: slots below padding are not padding"
    degree = np.where(pmask, edges.degree[np.maximum(parents, 0)], 0)
    want = np.where(degree > 0, f, 0) if replace else np.minimum(degree, f)
    np.testing.assert_array_equal(kmask.sum(1), want, err_msg=f"hop {hop + 1}: fanout")
    rows, cols = np.nonzero(kmask)
    parent, kid = parents[rows], kids[rows, cols]
    mult = edges.multiplicity(parent, kid)
    assert np.all(mult > 0), (
      f"hop {hop + 1}: {int(np.sum(mult == 0))} sampled nodes are not neighbours of their parent"
    )
    if not replace:  # every edge at most once: an id at most as often as it has edges
      pairs, times = np.unique(np.stack([rows, kid]), axis=1, return_counts=True)
      assert np.all(times <= edges.multiplicity(parents[pairs[0]], pairs[1])), (
        f"hop {hop + 1}: an edge was drawn twice without replacement"
      )


def on_cpu(fn, *args, **kwargs):
  with jax.default_device(jax.devices("cpu")[0]):
    return jax.block_until_ready(fn(*args, **kwargs))


def assert_same_blocks(a, b):
  assert a.fanouts == b.fanouts
  for x, y in zip(a.nodes + a.masks, b.nodes + b.masks):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def graph_data():
  rng = np.random.default_rng(0)
  num_nodes = 3000
  senders, receivers = random_edges(rng, num_nodes, 30_000)
  return senders, receivers, num_nodes, EdgeSet(senders, receivers, num_nodes)


# -- structure -------------------------------------------------------------------------------------


@pytest.mark.parametrize("replace", [False, True])
@pytest.mark.parametrize("fanouts", [(1,), (5,), (4, 3), (25, 2, 2)])
def test_samples_are_neighbours_with_fanout_and_padding(device, graph_data, fanouts, replace):
  senders, receivers, num_nodes, edges = graph_data
  rng = np.random.default_rng(len(fanouts))
  seeds = rng.integers(-1, num_nodes, 200).astype(np.int32)  # -1: padding
  seeds[:8] = [0, 1, 2, 3, 3, -1, num_nodes - 1, 7]  # hubs, a repeat, a node without neighbours
  assert edges.degree[3] == 0 and edges.degree[0] > 40
  with HostGraph.from_edges(senders, receivers, num_nodes) as g:
    blocks = jax.block_until_ready(
      sample_neighbors(g, jnp.asarray(seeds), fanouts, jax.random.key(1), replace=replace)
    )
    cpu = on_cpu(
      sample_neighbors, g, jnp.asarray(seeds), fanouts, jax.random.key(1), replace=replace
    )
  check_blocks(blocks, seeds, fanouts, edges, replace)
  assert all(n.devices() == {device} for n in blocks.nodes + blocks.masks)
  assert_same_blocks(blocks, cpu)  # the same draws on every platform


def test_many_seeds_use_the_thread_pool(device, graph_data):
  senders, receivers, num_nodes, edges = graph_data
  seeds = np.random.default_rng(2).integers(0, num_nodes, 20_000)
  with HostGraph.from_edges(senders, receivers, num_nodes) as g:
    blocks = jax.block_until_ready(sample_neighbors(g, seeds, (10, 3), jax.random.key(2)))
    cpu = on_cpu(sample_neighbors, g, seeds, (10, 3), jax.random.key(2))
  check_blocks(blocks, seeds, (10, 3), edges)
  assert_same_blocks(blocks, cpu)


def test_duplicate_edges_are_each_drawn_at_most_once(device):
  # Node 0's neighbours: 5 by three edges, 7 by one, 8 by two (6 edges); fanout 4.
  senders = np.array([5, 8, 5, 7, 5, 8, 0, 1, 2])
  receivers = np.array([0, 0, 0, 0, 0, 0, 1, 2, 3])
  edges = EdgeSet(senders, receivers, 9)
  seeds = np.zeros(20_000, np.int32)
  with HostGraph.from_edges(senders, receivers, 9) as g:
    blocks = sample_neighbors(g, seeds, (4,), jax.random.key(3))
    full = sample_neighbors(g, seeds[:10], (6,), jax.random.key(3))
    check_blocks(blocks, seeds, (4,), edges)
    check_blocks(full, seeds[:10], (6,), edges)
    kids = np.asarray(blocks.nodes[1]).reshape(-1, 4)
    # degree <= fanout keeps every edge: the full multiset, duplicates included
    for row in np.asarray(full.nodes[1]).reshape(-1, 6):
      assert sorted(row.tolist()) == [5, 5, 5, 7, 8, 8]
  # Positions, not ids, are distinct: id 5 appears three times in some rows (p = 1/5 per row).
  fives = (kids == 5).sum(1)
  assert fives.max() == 3 and 0.18 < np.mean(fives == 3) < 0.22
  # Each edge is included with probability 4/6: ids in proportion to their edge counts.
  counts = np.array([(kids == u).sum() for u in (5, 7, 8)])
  expected = len(kids) * 4 / 6 * np.array([3, 1, 2])
  assert scipy.stats.chisquare(counts, expected).pvalue > P_MIN, counts


def test_padded_and_out_of_range_seeds_under_jit(device, graph_data):
  senders, receivers, num_nodes, edges = graph_data
  seeds = jnp.array([-1, 5, -7, num_nodes, num_nodes + 100, 2**31 - 1, 0], jnp.int32)
  with HostGraph.from_edges(senders, receivers, num_nodes) as g:
    sample = jax.jit(sample_neighbors, static_argnums=(2,))
    blocks = jax.block_until_ready(sample(g, seeds, (3, 2), jax.random.key(4)))
  # Under jit a seed >= num_nodes cannot be checked and is padding, as is every slot below it.
  check_blocks(blocks, np.asarray(seeds), (3, 2), edges)
  np.testing.assert_array_equal(np.asarray(blocks.masks[0]), [0, 1, 0, 0, 0, 0, 1])
  assert not np.asarray(blocks.masks[1]).reshape(7, 3)[[0, 2, 3, 4, 5]].any()
  assert not np.asarray(blocks.masks[2]).reshape(7, 6)[[0, 2, 3, 4, 5]].any()


@pytest.mark.parametrize("seed_dtype", [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint32])
def test_seed_dtypes(device, seed_dtype):
  num_nodes = 120  # fits every seed dtype (see the test below for graphs that do not)
  senders, receivers = random_edges(np.random.default_rng(3), num_nodes, 1000)
  edges = EdgeSet(senders, receivers, num_nodes)
  seeds = np.array([0, 1, 2, 100, 119], seed_dtype)
  with HostGraph.from_edges(senders, receivers, num_nodes) as g:
    blocks = sample_neighbors(g, jnp.asarray(seeds), (4,), jax.random.key(5))
    as_int32 = sample_neighbors(g, jnp.asarray(seeds.astype(np.int32)), (4,), jax.random.key(5))
    check_blocks(blocks, seeds.astype(np.int64), (4,), edges)
    assert_same_blocks(blocks, as_int32)


@pytest.mark.parametrize(
  "seed_dtype,num_nodes", [(np.int8, 200), (np.uint8, 256), (np.int16, 40_000), (np.uint16, 65_536)]
)
def test_narrow_seed_dtypes_in_a_graph_larger_than_they_count(device, seed_dtype, num_nodes):
  # num_nodes does not fit the seeds' dtype: the range check must not wrap it around.
  senders = np.arange(num_nodes)
  receivers = (senders + 1) % num_nodes  # node v's only neighbour is v - 1
  seeds = np.array([0, 1, 2, 100], seed_dtype)
  with HostGraph.from_edges(senders, receivers, num_nodes) as g:
    blocks = sample_neighbors(g, jnp.asarray(seeds), (1,), jax.random.key(0))
    jitted = jax.jit(lambda s: sample_neighbors(g, s, (1,), jax.random.key(0)))(jnp.asarray(seeds))
  for b in (blocks, jitted):
    np.testing.assert_array_equal(np.asarray(b.masks[0]), [True] * 4)
    np.testing.assert_array_equal(np.asarray(b.nodes[0]), seeds.astype(np.int32))
    np.testing.assert_array_equal(np.asarray(b.nodes[1]), [num_nodes - 1, 0, 1, 99])


def test_empty_seed_batch(device, graph_data):
  senders, receivers, num_nodes, _ = graph_data
  with HostGraph.from_edges(senders, receivers, num_nodes) as g:
    blocks = sample_neighbors(g, jnp.zeros((0,), jnp.int32), (3, 2), jax.random.key(0))
  assert [n.shape for n in blocks.nodes] == [(0,), (0,), (0,)]


def test_multi_hop_layout_and_neighbours_helper(device, graph_data):
  senders, receivers, num_nodes, edges = graph_data
  seeds = jnp.array([0, 1, 9, 10, -1])
  fanouts = (3, 4, 2)
  with HostGraph.from_edges(senders, receivers, num_nodes) as g:
    blocks = sample_neighbors(g, seeds, fanouts, jax.random.key(6))
  assert blocks.num_hops == 3
  assert [n.shape[0] for n in blocks.nodes] == [5, 15, 60, 120]
  for hop, f in enumerate(fanouts):
    kids, kmask = blocks.neighbours(hop)
    assert kids.shape == kmask.shape == (blocks.nodes[hop].shape[0], f)
    parents = np.asarray(blocks.nodes[hop])
    for i in range(len(parents)):  # node i's slots are entries i*f .. (i+1)*f of the next hop
      np.testing.assert_array_equal(
        np.asarray(kids[i]), np.asarray(blocks.nodes[hop + 1])[i * f : (i + 1) * f]
      )
      valid = np.asarray(kids[i])[np.asarray(kmask[i])]
      assert np.all(edges.multiplicity(np.full(len(valid), parents[i]), valid) > 0)


# -- keys ------------------------------------------------------------------------------------------


def test_same_key_same_sample_other_key_other_sample(device, graph_data):
  senders, receivers, num_nodes, _ = graph_data
  seeds = jnp.arange(0, 400)
  with HostGraph.from_edges(senders, receivers, num_nodes) as g:
    run = lambda k, r=False: sample_neighbors(g, seeds, (3, 3), k, replace=r)  # noqa: E731
    a, b = run(jax.random.key(7)), run(jax.random.key(7))
    raw = run(jax.random.PRNGKey(7))  # a raw uint32 key with the same bits
    c = run(jax.random.key(8))
    d = run(jax.random.key(7), True)
    cpu = on_cpu(run, jax.random.key(8))
  assert_same_blocks(a, b)
  assert_same_blocks(a, raw)
  assert_same_blocks(c, cpu)
  for other in (c, d):
    for hop in (1, 2):  # masks depend only on degrees, the nodes on the key
      assert np.mean(np.asarray(a.nodes[hop]) != np.asarray(other.nodes[hop])) > 0.3
  # Without replacement, which slots are used depends only on the degrees, not on the key.
  np.testing.assert_array_equal(np.asarray(a.masks[1]), np.asarray(c.masks[1]))


def test_jit_matches_eager(device, graph_data):
  senders, receivers, num_nodes, edges = graph_data
  seeds = jnp.arange(-3, 60)
  with HostGraph.from_edges(senders, receivers, num_nodes) as g:
    eager = sample_neighbors(g, seeds, (4, 2), jax.random.key(9))
    jitted = jax.jit(sample_neighbors, static_argnums=(2,), static_argnames="replace")(
      g, seeds, (4, 2), jax.random.key(9), replace=False
    )
    closed_over = jax.jit(lambda s, k: sample_neighbors(g, s, (4, 2), k))(seeds, jax.random.key(9))
    jax.block_until_ready((jitted, closed_over))
  assert_same_blocks(eager, jitted)
  assert_same_blocks(eager, closed_over)
  check_blocks(jitted, np.asarray(seeds), (4, 2), edges)


def test_vmap_over_keys_and_seeds(device, graph_data):
  senders, receivers, num_nodes, edges = graph_data
  keys = jax.random.split(jax.random.key(10), 4)
  seeds = jnp.arange(40).reshape(4, 10) * 7 - 3
  with HostGraph.from_edges(senders, receivers, num_nodes) as g:
    by_key = jax.jit(jax.vmap(lambda k: sample_neighbors(g, seeds[0], (3, 2), k)))(keys)
    by_both = jax.jit(jax.vmap(lambda s, k: sample_neighbors(g, s, (3, 2), k)))(seeds, keys)
    single = jax.jit(lambda s, k: sample_neighbors(g, s, (3, 2), k))
    one = [single(seeds[i], keys[i]) for i in range(4)]
    first = [single(seeds[0], keys[i]) for i in range(4)]
    jax.block_until_ready((by_key, by_both, one, first))  # all of them before the graph closes

  def pick(b, i):
    return Blocks(tuple(n[i] for n in b.nodes), tuple(m[i] for m in b.masks), b.fanouts)

  for i in range(4):
    assert_same_blocks(pick(by_key, i), first[i])
    assert_same_blocks(pick(by_both, i), one[i])
    check_blocks(one[i], np.asarray(seeds[i]), (3, 2), edges)
  assert np.any(np.asarray(by_key.nodes[1][0]) != np.asarray(by_key.nodes[1][1]))


# -- uniformity (fixed seeds; a sound test rejects a correct sampler with probability P_MIN) -------


def star_graph(degree, extra=3):
  """Node 0 with in-neighbours 1..degree, plus a few unrelated edges."""
  senders = np.concatenate([np.arange(1, degree + 1), np.zeros(extra, np.int64)])
  receivers = np.concatenate([np.zeros(degree, np.int64), np.arange(1, extra + 1)])
  return HostGraph.from_edges(senders, receivers, max(degree, extra) + 1)


def draw_rows(g, fanout, rows, keys, replace=False):
  """`rows` samples of node 0 per key, stacked: [rows * keys, fanout] neighbour ids."""
  seeds = jnp.zeros(rows, jnp.int32)
  out = [
    sample_neighbors(g, seeds, (fanout,), jax.random.key(k), replace=replace).nodes[1]
    for k in range(keys)
  ]
  return np.asarray(jnp.concatenate(out)).reshape(-1, fanout)


@pytest.mark.parametrize("degree,fanout", [(10, 3), (1000, 10), (6, 5)])
def test_inclusion_is_uniform_without_replacement(device, degree, fanout):
  with star_graph(degree) as g:
    kids = draw_rows(g, fanout, 20_000, 5)
  assert np.all((kids >= 1) & (kids <= degree))
  assert np.all(np.diff(np.sort(kids, 1), axis=1) > 0)  # no neighbour twice
  counts = np.bincount(kids.reshape(-1) - 1, minlength=degree)
  n = len(kids)
  freq = counts / n
  # Pearson's statistic on the picks: without replacement the counts vary less than under the
  # multinomial it assumes, so the test is conservative.
  assert scipy.stats.chisquare(counts).pvalue > P_MIN, freq
  sigma = np.sqrt(fanout / degree * (1 - fanout / degree) / n)
  assert np.all(np.abs(freq - fanout / degree) < 6 * sigma), freq


@pytest.mark.parametrize("degree,fanout", [(5, 2), (6, 3), (7, 6), (4, 1)])
def test_every_subset_is_equally_likely(device, degree, fanout):
  subsets = {s: i for i, s in enumerate(itertools.combinations(range(1, degree + 1), fanout))}
  with star_graph(degree) as g:
    kids = draw_rows(g, fanout, 10_000, 5)
  counts = np.zeros(len(subsets), np.int64)
  for row in np.sort(kids, 1):
    counts[subsets[tuple(row.tolist())]] += 1
  assert counts.min() > 0
  result = scipy.stats.chisquare(counts)
  assert result.pvalue > P_MIN, (counts, result)


def test_with_replacement_is_uniform_and_independent(device):
  degree, fanout = 10, 3
  with star_graph(degree) as g:
    kids = draw_rows(g, fanout, 20_000, 5, replace=True) - 1
  n = len(kids)
  assert np.all((kids >= 0) & (kids < degree))
  assert scipy.stats.chisquare(np.bincount(kids.reshape(-1), minlength=degree)).pvalue > P_MIN
  for a, b in ((0, 1), (1, 2), (0, 2)):  # pairs of slots: all 100 combinations equally likely
    pairs = np.bincount(kids[:, a] * degree + kids[:, b], minlength=degree * degree)
    assert scipy.stats.chisquare(pairs).pvalue > P_MIN, (a, b)
  # With replacement, repeats happen: P(some neighbour twice in 3 draws of 10) = 0.28.
  repeats = np.mean(
    (kids[:, 0] == kids[:, 1]) | (kids[:, 1] == kids[:, 2]) | (kids[:, 0] == kids[:, 2])
  )
  assert abs(repeats - 0.28) < 6 * np.sqrt(0.28 * 0.72 / n), repeats


def test_with_replacement_of_a_low_degree_node_fills_every_slot(device):
  with star_graph(2, extra=0) as g:  # nodes 1 and 2 have no neighbours
    kids = draw_rows(g, 8, 5000, 2, replace=True)
    lone = sample_neighbors(g, jnp.array([1, 0]), (8,), jax.random.key(0), replace=True)
  assert np.all((kids == 1) | (kids == 2))
  assert scipy.stats.chisquare(np.bincount(kids.reshape(-1))[1:]).pvalue > P_MIN
  assert not np.asarray(lone.masks[1])[:8].any()  # node 1 has no neighbours: nothing drawn
  assert np.asarray(lone.masks[1])[8:].all()


def test_rows_of_one_batch_are_independent(device):
  # Two copies of node 0 side by side in one batch: their samples are independent.
  degree = 8
  with star_graph(degree) as g:
    kids = draw_rows(g, 1, 40_000, 2) - 1
  pairs = kids.reshape(-1, 2)
  table = np.bincount(pairs[:, 0] * degree + pairs[:, 1], minlength=degree**2)
  assert scipy.stats.chisquare(table).pvalue > P_MIN


# -- Blocks ----------------------------------------------------------------------------------------


def test_gather_equals_take_with_zero_padding(device, graph_data):
  senders, receivers, num_nodes, _ = graph_data
  feats = np.random.default_rng(11).standard_normal((num_nodes, 6)).astype(np.float32)
  seeds = jnp.array([0, 3, -1, 17, num_nodes - 1])
  with HostGraph.from_edges(senders, receivers, num_nodes, features=feats) as g:
    blocks = sample_neighbors(g, seeds, (4, 3), jax.random.key(12))
    rows = blocks.gather(g.features)
    jitted = jax.jit(lambda b: b.gather(g.features))(blocks)
    jax.block_until_ready((rows, jitted))
  assert len(rows) == 3
  for n, m, got, got_jit in zip(blocks.nodes, blocks.masks, rows, jitted):
    n, m = np.asarray(n), np.asarray(m)
    want = np.where(m[:, None], np.asarray(jnp.take(jnp.asarray(feats), jnp.asarray(n), axis=0)), 0)
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(np.asarray(got_jit), want)
    assert got.dtype == np.float32 and got.devices() == {device}


@pytest.mark.parametrize("hop", [0, 1])
def test_to_jraph_segment_sum_equals_reshape_aggregation(device, graph_data, hop):
  jraph = pytest.importorskip("jraph")  # the [test] extra; a bare GPU machine may lack it
  senders, receivers, num_nodes, _ = graph_data
  feats = np.random.default_rng(13).standard_normal((num_nodes, 5)).astype(np.float32)
  fanouts = (3, 4)
  with HostGraph.from_edges(senders, receivers, num_nodes, features=feats) as g:
    blocks = sample_neighbors(g, jnp.array([0, 3, -1, 8, 21]), fanouts, jax.random.key(14))
    rows = blocks.gather(g.features)
  dst, src = rows[hop], rows[hop + 1]
  f = fanouts[hop]
  graph = blocks.to_jraph(hop, node_features=jnp.concatenate([dst, src]))
  assert isinstance(graph, jraph.GraphsTuple)
  n_dst, n_src = dst.shape[0], src.shape[0]
  assert int(graph.n_node[0]) == n_dst + n_src and int(graph.n_edge[0]) == n_src
  ids, mask = np.asarray(graph.nodes["id"]), np.asarray(graph.nodes["mask"])
  np.testing.assert_array_equal(ids[np.asarray(graph.senders)], np.asarray(blocks.nodes[hop + 1]))
  np.testing.assert_array_equal(
    ids[np.asarray(graph.receivers)], np.repeat(np.asarray(blocks.nodes[hop]), f)
  )
  np.testing.assert_array_equal(mask[:n_dst], np.asarray(blocks.masks[hop]))

  @jax.jit
  def aggregate(graph):
    messages = graph.nodes["features"][graph.senders] * graph.edges["mask"][:, None]
    return jraph.segment_sum(messages, graph.receivers, num_segments=n_dst)

  want = (src.reshape(n_dst, f, -1) * blocks.masks[hop + 1].reshape(n_dst, f, 1)).sum(1)
  np.testing.assert_allclose(np.asarray(aggregate(graph)), np.asarray(want), rtol=1e-6, atol=1e-6)


# -- HostGraph -------------------------------------------------------------------------------------


@pytest.mark.parametrize("duplicates", [False, True])
def test_from_edges_builds_the_csr(duplicates):
  rng = np.random.default_rng(15)
  senders, receivers = random_edges(rng, 200, 2000, duplicates)
  indptr, indices = csr_reference(senders, receivers, 230)  # 30 nodes past the last id
  with HostGraph.from_edges(senders, receivers, 230) as g:
    assert g.num_nodes == 230 and g.num_edges == len(senders)
    assert g.indptr.shape == (231, 1) and g.indptr.dtype == np.int64
    assert g.indices.shape == (len(senders), 1) and g.indices.dtype == np.int32
    np.testing.assert_array_equal(g.indptr.as_numpy()[:, 0], indptr)
    np.testing.assert_array_equal(g.indices.as_numpy()[:, 0], indices)  # edge order kept
    np.testing.assert_array_equal(g.in_degrees(), np.bincount(receivers, minlength=230))
  with HostGraph.from_edges(senders.tolist(), receivers.tolist()) as g:  # num_nodes inferred
    assert g.num_nodes == max(senders.max(), receivers.max()) + 1


@pytest.mark.parametrize(
  "dtype", [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
)
@pytest.mark.parametrize("num_nodes", [None, 9])
def test_from_edges_takes_every_integer_dtype(dtype, num_nodes):
  senders = np.array([3, 0, 7, 1, 3], dtype)
  receivers = np.array([0, 0, 2, 7, 2], dtype)
  indptr, indices = csr_reference(senders, receivers, 9 if num_nodes else 8)
  with HostGraph.from_edges(senders, receivers, num_nodes) as g:
    np.testing.assert_array_equal(g.indptr.as_numpy()[:, 0], indptr)
    np.testing.assert_array_equal(g.indices.as_numpy()[:, 0], indices)


def test_constructor_takes_a_csr():
  indptr, indices = np.array([0, 2, 2, 3]), np.array([1, 2, 0])
  with HostGraph(indptr, indices) as g:
    blocks = sample_neighbors(g, jnp.array([0, 1, 2]), (2,), jax.random.key(0))
    np.testing.assert_array_equal(np.sort(np.asarray(blocks.nodes[1])[:2]), [1, 2])
    np.testing.assert_array_equal(np.asarray(blocks.masks[1]), [1, 1, 0, 0, 1, 0])
    np.testing.assert_array_equal(np.asarray(blocks.nodes[1])[4], 0)


def test_from_jraph_builds_the_csr_and_takes_the_node_features():
  jraph = pytest.importorskip("jraph")  # the [test] extra; a bare GPU machine may lack it
  rng = np.random.default_rng(16)
  n_node = np.array([7, 5, 9])
  total = int(n_node.sum())
  senders = rng.integers(0, total, 60)
  receivers = rng.integers(0, total, 60)
  nodes = rng.standard_normal((total, 3)).astype(np.float32)
  gt = jraph.GraphsTuple(
    nodes=jnp.asarray(nodes),
    edges=None,
    senders=jnp.asarray(senders),
    receivers=jnp.asarray(receivers),
    n_node=jnp.asarray(n_node),
    n_edge=jnp.array([20, 20, 20]),
    globals=None,
  )
  indptr, indices = csr_reference(senders, receivers, total)
  with HostGraph.from_jraph(gt) as g:
    assert g.num_nodes == total
    np.testing.assert_array_equal(g.indptr.as_numpy()[:, 0], indptr)
    np.testing.assert_array_equal(g.indices.as_numpy()[:, 0], indices)
    np.testing.assert_array_equal(g.features.as_numpy(), nodes)
  with HostGraph.from_jraph(gt._replace(nodes={"x": nodes})) as g:
    assert g.features is None


def test_features_table_passed_in_stays_open():
  with HostTable(np.ones((3, 2), np.float32)) as table:
    g = HostGraph.from_edges([0, 1], [1, 2], 3, features=table)
    assert g.features is table
    g.close()
    g.close()  # twice is fine
    assert g.closed and not table.closed
    assert "closed" in repr(g)


# -- bad input -------------------------------------------------------------------------------------


@pytest.fixture
def small_graph():
  with HostGraph.from_edges([0, 1, 2], [1, 2, 0], 3) as g:
    yield g


def test_bad_seeds(small_graph):
  key = jax.random.key(0)
  with pytest.raises(ValueError, match="seed 3 is outside"):
    sample_neighbors(small_graph, jnp.array([0, 3]), (2,), key)
  with pytest.raises(ValueError, match="seed 5 is outside"):
    sample_neighbors(small_graph, [1, 5], (2,), key)
  with pytest.raises(TypeError, match="seeds must be integers"):
    sample_neighbors(small_graph, jnp.array([0.0, 1.0]), (2,), key)
  with pytest.raises(TypeError, match="seeds must be integers"):
    sample_neighbors(small_graph, np.array([True]), (2,), key)
  with pytest.raises(ValueError, match="seeds must be 1-D"):
    sample_neighbors(small_graph, jnp.zeros((2, 2), jnp.int32), (2,), key)


@pytest.mark.parametrize(
  "fanouts,error,match",
  [
    ((0,), ValueError, ">= 1"),
    ((3, -1), ValueError, ">= 1"),
    ((), ValueError, "empty"),
    ((2.0,), TypeError, "Python ints"),
    ((True,), TypeError, "Python ints"),
    (None, TypeError, "sequence of ints"),
  ],
)
def test_bad_fanouts(small_graph, fanouts, error, match):
  with pytest.raises(error, match=match):
    sample_neighbors(small_graph, jnp.array([0]), fanouts, jax.random.key(0))


def test_a_single_int_fanout_is_one_hop(small_graph):
  blocks = sample_neighbors(small_graph, jnp.array([0]), 2, jax.random.key(0))
  assert blocks.fanouts == (2,)


def test_bad_graphs():
  with pytest.raises(ValueError, match="no nodes"):
    HostGraph.from_edges([], [], num_nodes=0)
  with pytest.raises(ValueError, match="no nodes"):
    HostGraph.from_edges(np.array([], np.int64), np.array([], np.int64))
  with pytest.raises(ValueError, match="no nodes"):
    HostGraph(np.array([0]), np.array([], np.int32))
  with pytest.raises(ValueError, match="outside"):
    HostGraph.from_edges([0, 5], [1, 1], num_nodes=3)
  with pytest.raises(ValueError, match="outside"):
    HostGraph.from_edges([0, -1], [1, 1])
  with pytest.raises(TypeError, match="senders must be integers"):
    HostGraph.from_edges([0.0, 1.0], [1, 0])
  with pytest.raises(ValueError, match="one length"):
    HostGraph.from_edges([0, 1], [1])
  with pytest.raises(ValueError, match="indptr must rise"):
    HostGraph(np.array([0, 2, 1, 3]), np.array([0, 1, 2]))
  with pytest.raises(ValueError, match="indptr must rise"):
    HostGraph(np.array([0, 1, 2]), np.array([0, 1, 1]))
  with pytest.raises(ValueError, match="outside"):
    HostGraph(np.array([0, 1, 2]), np.array([0, 2]))


@pytest.mark.parametrize(
  "edges", [([], []), (np.array([], np.int64), np.array([], np.int32))], ids=["lists", "arrays"]
)
def test_a_graph_without_edges_samples_only_padding(device, edges):
  # Empty Python lists are float64 to NumPy: they must still mean "no edges", not a cast error.
  with HostGraph.from_edges(*edges, num_nodes=5, features=np.eye(5, dtype=np.float32)) as g:
    assert g.num_nodes == 5 and g.num_edges == 0
    np.testing.assert_array_equal(g.in_degrees(), np.zeros(5))
    blocks = sample_neighbors(g, jnp.array([0, 4, -1]), (3,), jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(blocks.nodes[1]), np.full(9, -1))
    assert not np.asarray(blocks.masks[1]).any()
    feats = jax.block_until_ready(blocks.gather(g.features))
    np.testing.assert_array_equal(
      np.asarray(feats[0]),
      np.eye(5, dtype=np.float32)[[0, 4, 0]] * np.array([[1], [1], [0]], np.float32),
    )
    dg = DeviceGraph.from_host(g)
    same = sample_neighbors(dg, jnp.array([0, 4, -1]), (3,), jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(same.nodes[1]), np.asarray(blocks.nodes[1]))


def test_features_of_the_wrong_row_count():
  with pytest.raises(ValueError, match="features has 4 rows, the graph 3 nodes"):
    HostGraph.from_edges([0, 1], [1, 2], 3, features=np.ones((4, 2), np.float32))
  with HostTable(np.ones((2, 2), np.float32)) as table:
    with pytest.raises(ValueError, match="features has 2 rows"):
      HostGraph.from_edges([0, 1], [1, 2], 3, features=table)
    assert not table.closed  # the caller's table survives the failed construction


def test_not_a_graph_and_closed_graph():
  with pytest.raises(TypeError, match="must be a HostGraph"):
    sample_neighbors(np.array([0, 1, 2]), jnp.array([0]), (2,), jax.random.key(0))
  g = HostGraph.from_edges([0, 1, 2], [1, 2, 0], 3)
  compiled = jax.jit(lambda s, k: sample_neighbors(g, s, (2,), k))
  jax.block_until_ready(compiled(jnp.array([0]), jax.random.key(0)))
  g.close()
  with pytest.raises(ValueError, match="is closed"):
    sample_neighbors(g, jnp.array([0]), (2,), jax.random.key(0))
  with pytest.raises(ValueError, match="is closed"):
    g.indptr  # noqa: B018
  with HostTable(np.ones((1, 1), np.float32)) as probe:  # a later host call, for a GPU's report
    assert_handle_error(
      lambda: compiled(jnp.array([0]), jax.random.key(0)),
      "is closed",
      then=lambda: host_gather(probe, jnp.array([0])),
      untouched=lambda blocks: not np.asarray(blocks.masks[1]).any(),
    )


def test_gathering_from_a_table_smaller_than_the_graph_is_an_error(device):
  # Node 9 is a real neighbour; a 5-row table would silently give it a row of zeros.
  with (
    HostGraph.from_edges([9, 9, 1], [0, 1, 9], 10) as g,
    HostTable(np.ones((5, 2), np.float32)) as small,
    HostTable(np.arange(20, dtype=np.float32).reshape(10, 2)) as full,
  ):
    blocks = sample_neighbors(g, jnp.array([0, 1]), (2,), jax.random.key(0))
    for unique in (False, True):
      with pytest.raises(ValueError, match="Blocks.gather: the table has 5 rows.* 10 nodes"):
        blocks.gather(small, unique=unique)
      with pytest.raises(ValueError, match="Blocks.gather: the table has 5 rows"):
        jax.jit(functools.partial(Blocks.gather, table=small, unique=unique))(blocks)
    got = jax.block_until_ready(blocks.gather(full))
    want = [
      np.where(np.asarray(m)[:, None], np.take(full.as_numpy(), np.maximum(n, 0), axis=0), 0)
      for n, m in zip(blocks.nodes, blocks.masks)
    ]
    for x, y in zip(got, want):
      np.testing.assert_array_equal(np.asarray(x), y)
    assert 9 in np.asarray(blocks.nodes[1])


def test_device_cache_serves_the_same_rows_and_refuses_bad_sizes(device):
  from jaxdata.host import DeviceCache

  rng = np.random.default_rng(3)
  feats = rng.standard_normal((30, 3)).astype(np.float32)
  with HostGraph.from_edges(
    rng.integers(0, 30, 120), rng.integers(0, 30, 120), 30, features=feats
  ) as g:
    blocks = sample_neighbors(g, jnp.arange(8), (4, 2), jax.random.key(1))
    plain = blocks.gather(g.features)
    for size in (dict(fraction=0.2), dict(capacity=7), dict(capacity=30)):
      cache = DeviceCache.build(g, g.features, **size)
      for x, y in zip(blocks.gather(g.features, cache=cache), plain):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    for bad, error in (
      (dict(capacity=2.5), TypeError),
      (dict(capacity=True), TypeError),
      (dict(fraction="half"), TypeError),
      (dict(capacity=0), ValueError),
      (dict(fraction=1.5), ValueError),
      (dict(), ValueError),
    ):
      with pytest.raises(error, match="DeviceCache.build"):
        DeviceCache.build(g, g.features, **bad)
