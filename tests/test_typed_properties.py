"""Properties of typed graph building and sampling, against NumPy, with x64 on and off.

Hypothesis draws tiny typed graphs (node types, relations, local ids in any integer dtype),
seeds (padding, repeats, ids past the graph and past int32) and fanouts; every case either
agrees with a NumPy reference or raises a clear error: never a silent wrong answer. Shapes
stay tiny and the seed batch has one length, so the eager ops compile once per x64 mode and
each test runs in seconds.
"""

import collections
import re

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxdata.data.graph import HeteroGraph
from jaxdata.hector.block import edges_numpy
from jaxdata.host.graph import HostGraph
from jaxdata.host.sample import sample_neighbors
from jaxdata.loader.blocks import sample_blocks

BATCH = 4  # seeds per call: one length for every example
MAX_RELATIONS = 6  # typed_edges draws at most 3 relations, and their inverses
FANOUTS = [(1,), (3,), (2, 2)]  # sample_neighbors' (cheap to compile)
BLOCK_FANOUTS = (3, 2)  # sample_blocks' ops compile in seconds per fanouts: one choice
ID_DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
SETTINGS = settings(
  max_examples=25,
  deadline=None,
  derandomize=True,
  suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def _x64(on: bool):
  if on:
    return jax.enable_x64(True)
  return jax.enable_x64(False) if hasattr(jax, "enable_x64") else jax.experimental.disable_x64()


@pytest.fixture(params=[True, False], ids=["x64", "x32"])
def x64(request):
  with _x64(request.param):
    yield request.param


@st.composite
def typed_edges(draw, min_nodes: int = 0):
  """(edges {(src type, relation, dst type): (src ids, dst ids)}, num_nodes {type: count})."""
  types = [f"t{i}" for i in range(draw(st.integers(1, 3)))]
  counts = {t: draw(st.integers(0, 4)) for t in types}
  if sum(counts.values()) < min_nodes:
    counts[types[0]] += min_nodes
  edges = {}
  for k in range(draw(st.integers(0, 3))):
    s, d = draw(st.sampled_from(types)), draw(st.sampled_from(types))
    if not counts[s] or not counts[d]:
      continue
    m = draw(st.integers(0, 6))
    dtype = np.dtype(draw(st.sampled_from(ID_DTYPES)))
    ids = st.lists(st.integers(0, counts[s] - 1), min_size=m, max_size=m)
    dst_ids = st.lists(st.integers(0, counts[d] - 1), min_size=m, max_size=m)
    edges[(s, f"r{k}", d)] = (np.array(draw(ids), dtype), np.array(draw(dst_ids), dtype))
  return edges, counts


def reference_edges(edges, counts, add_inverse):
  """The global (src, dst, relation) triples from_typed_edges must hold, sorted."""
  offsets = dict(zip(counts, np.cumsum([0] + list(counts.values()))[:-1].tolist()))
  out = []
  for r, ((s, _, d), (a, b)) in enumerate(edges.items()):
    for u, v in zip(a.tolist(), b.tolist()):
      out.append((offsets[s] + u, offsets[d] + v, r))
      if add_inverse:
        out.append((offsets[d] + v, offsets[s] + u, len(edges) + r))
  return sorted(out)


@SETTINGS
@given(data=typed_edges(), add_inverse=st.booleans(), bad=st.sampled_from([None, 1, 2**63 + 1]))
def test_from_typed_edges_holds_the_numpy_edges_or_refuses(data, add_inverse, bad):
  edges, counts = data
  if bad is not None and edges:  # one id past its type, in uint64 so 2**63 + 1 keeps its value
    key = next(iter(edges))
    src, dst = edges[key]
    value = counts[key[0]] - 1 + bad
    edges[key] = (
      np.concatenate([src.astype(np.uint64), np.array([value], np.uint64)]),
      np.append(dst.astype(np.int64), 0),
    )
    with pytest.raises(ValueError, match=f"src ids of {re.escape(str(key))}: value {value} "):
      HeteroGraph.from_typed_edges(edges, counts, add_inverse=add_inverse)
    return
  g = HeteroGraph.from_typed_edges(edges, counts, add_inverse=add_inverse)
  got = sorted(zip(g.src.tolist(), g.dst.tolist(), g.etype.tolist()))
  assert got == reference_edges(edges, counts, add_inverse)
  assert len(set(g.relation_names)) == g.num_relations == len(edges) * (1 + add_inverse)
  assert g.node_type_offsets.tolist() == np.cumsum([0] + list(counts.values())).tolist()


@st.composite
def sampling_case(draw):
  edges, counts = draw(typed_edges(min_nodes=1))
  n = sum(counts.values())
  dtype = np.dtype(draw(st.sampled_from(ID_DTYPES)))
  info = np.iinfo(dtype)
  past = [v for v in (n + 2, 2**31, 2**32 + 1, 2**63 - 1) if v <= info.max]
  low = max(-3, int(info.min))
  seeds = draw(st.lists(st.integers(low, n - 1), min_size=BATCH, max_size=BATCH))
  if past and draw(st.integers(0, 3)) == 0:  # a quarter of the cases: one id past the graph
    seeds[draw(st.integers(0, BATCH - 1))] = draw(st.sampled_from(past))
  return edges, counts, np.array(seeds, dtype), draw(st.sampled_from(FANOUTS)), draw(st.integers())


def _in_edges(g: HeteroGraph):
  """{node: Counter of (source, relation)} of the whole graph."""
  into = collections.defaultdict(collections.Counter)
  for s, d, r in zip(g.src.tolist(), g.dst.tolist(), g.etype.tolist()):
    into[d][(s, r)] += 1
  return into


def _check_draw(into, node: int, drawn: list[tuple[int, int]], fanout: int):
  """Without replacement: min(degree, fanout) distinct in-edges of `node`, all of them when
  the fanout covers its degree."""
  have = into[node]
  degree = sum(have.values())
  assert len(drawn) == min(degree, fanout)
  got = collections.Counter(drawn)
  assert all(got[e] <= have[e] for e in got), (node, drawn, have)
  if fanout >= degree:
    assert got == have


@SETTINGS
@given(case=sampling_case())
def test_sample_neighbors_draws_in_edges_or_refuses(x64, case):
  edges, counts, seeds, fanouts, seed = case
  g = HeteroGraph.from_typed_edges(edges, counts)
  with HostGraph.from_hetero(g) as host:
    if (seeds.astype(object) >= g.num_nodes).any():
      with pytest.raises(ValueError, match="sample_neighbors: seed .* is outside"):
        sample_neighbors(host, seeds, fanouts, jax.random.key(seed % 2**32))
      return
    blocks = sample_neighbors(host, seeds, fanouts, jax.random.key(seed % 2**32))
  into = _in_edges(g)
  valid = seeds.astype(object) >= 0
  np.testing.assert_array_equal(blocks.masks[0], valid)
  np.testing.assert_array_equal(blocks.nodes[0], np.where(valid, seeds.astype(np.int64), -1))
  for hop, f in enumerate(fanouts):
    parents, pmask = np.asarray(blocks.nodes[hop]), np.asarray(blocks.masks[hop])
    nbrs, mask = (np.asarray(a) for a in blocks.neighbours(hop))
    rels = np.asarray(blocks.relations(hop))
    for i, (p, ok) in enumerate(zip(parents.tolist(), pmask.tolist())):
      if not ok:
        assert not mask[i].any()
        continue
      _check_draw(
        into, p, [(int(s), int(r)) for s, r in zip(nbrs[i][mask[i]], rels[i][mask[i]])], f
      )


@SETTINGS
@given(case=sampling_case())
def test_sample_blocks_hold_sampled_in_edges_or_refuse(x64, case):
  edges, counts, seeds, _, seed = case
  fanouts = BLOCK_FANOUTS
  g = HeteroGraph.from_typed_edges(edges, counts)
  with HostGraph.from_hetero(g) as host:
    if (seeds.astype(object) >= g.num_nodes).any():
      with pytest.raises(ValueError, match="sample_blocks: seed .* is outside"):
        sample_blocks(host, seeds, fanouts, jax.random.key(seed % 2**32))
      return
    # one relation count for every graph: the blocks' shapes, and so their compiled ops, depend
    # on it
    blocks = sample_blocks(
      host, seeds, fanouts, jax.random.key(seed % 2**32), num_relations=MAX_RELATIONS
    )
  into = _in_edges(g)
  first = list(dict.fromkeys(int(s) for s in seeds.astype(object) if s >= 0))
  nodes0 = np.asarray(blocks.nodes[0])
  assert sorted(nodes0[nodes0 >= 0].tolist()) == sorted(first)
  for h, f in enumerate(fanouts):
    dst_nodes, src_nodes = np.asarray(blocks.nodes[h]), np.asarray(blocks.nodes[h + 1])
    src_valid = src_nodes[src_nodes >= 0]
    assert len(set(src_valid.tolist())) == len(src_valid)  # a frontier holds a node once
    np.testing.assert_array_equal(
      src_nodes[: len(dst_nodes)][dst_nodes >= 0], dst_nodes[dst_nodes >= 0]
    )
    src, dst, rel, norm = edges_numpy(blocks.graphs[h])
    per_dst = collections.defaultdict(list)
    for s, d, r in zip(src.tolist(), dst.tolist(), rel.tolist()):
      assert src_nodes[s] >= 0 and dst_nodes[d] >= 0
      per_dst[int(dst_nodes[d])].append((int(src_nodes[s]), r))
    for d in dst_nodes[dst_nodes >= 0].tolist():
      _check_draw(into, d, per_dst[d], f)
    # "mean": 1 / the sampled edges of the same relation into the same node
    count = collections.Counter(zip(dst.tolist(), rel.tolist()))
    np.testing.assert_allclose(norm, [1 / count[k] for k in zip(dst.tolist(), rel.tolist())])
