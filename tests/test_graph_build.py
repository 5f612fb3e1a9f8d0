"""Graph construction: the native builders (jaxdata.data.graph_build) against the NumPy
formulations of jaxdata.reference.graph, bit for bit; HeteroGraph.from_typed_edges against a
hand-built flat graph; errors that name the problem."""

import numpy as np
import pytest
from isolation import own_threads

from jaxdata.data import HeteroGraph, graph_build, synthetic_mag
from jaxdata.reference import graph as ref


def _random_edges(e, n, r, dtype, seed):
  """Uniform ends; relation 0 gets about half of the edges (a run larger than a thread's share,
  sorted by all threads), the others share the rest (runs sorted one per thread)."""
  rng = np.random.default_rng(seed)
  draw = lambda hi: rng.integers(0, max(hi, 1), e).astype(dtype)  # noqa: E731
  etype = draw(r)
  etype[rng.random(e) < 0.5] = 0
  return draw(n), draw(n), etype


# (edges, nodes, relations): empty graphs, one node (all self loops), many duplicates, relations
# with no edges, and sizes past the 64K items a thread gets, so several threads split the work.
CASES = [
  (0, 0, 0),
  (0, 5, 3),
  (1, 1, 1),
  (50, 1, 1),
  (1000, 3, 2),
  (300, 20, 64),
  (70_000, 7, 3),
  (200_000, 50_000, 500),
  (150_000, 300, 1),
  (400_000, 1000, 3),
]


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("e,n,r", CASES)
def test_native_builders_equal_the_numpy_reference(e, n, r, dtype):
  src, dst, etype = _random_edges(e, n, r, dtype, seed=e + n + r)
  order = ref.sort_order(src, dst, etype, n, r)
  for threads in (1, 3, 0):
    s, d, t, o = graph_build.sort_edges(src, dst, etype, n, r, return_order=True, threads=threads)
    assert all(a.dtype == np.int32 for a in (s, d, t, o))
    np.testing.assert_array_equal(o, order)
    np.testing.assert_array_equal(s, src[order])
    np.testing.assert_array_equal(d, dst[order])
    np.testing.assert_array_equal(t, etype[order])
    assert graph_build.edges_sorted(s, d, t, threads=threads)

    for keys in (s, d, src):
      offsets, ids = graph_build.group_by(keys, n, threads=threads)
      want_offsets, want_ids = ref.grouped(keys, n)
      assert offsets.dtype == np.int64 and ids.dtype == np.int32
      np.testing.assert_array_equal(offsets, want_offsets)
      np.testing.assert_array_equal(ids, want_ids)

    np.testing.assert_array_equal(
      graph_build.mean_edge_norm(d, t, threads=threads), ref.mean_edge_norm(d, t)
    )
    got = graph_build.unique_pairs(s, t, n, r, threads=threads)
    want = ref.unique_pairs(s, t, n, r)
    assert [a.dtype for a in got] == [
      np.int32,
      np.int64,
      np.int32,
      np.int32,
      np.int32,
      np.int64,
      np.int64,
      np.int32,
    ]
    for name, a, b in zip(
      (
        "pair",
        "pair_offsets",
        "pair_edges",
        "pair_src",
        "pair_etype",
        "pair_rel_offsets",
        "pair_csr_offsets",
        "pair_csr_edges",
      ),
      got,
      want,
    ):
      np.testing.assert_array_equal(a, b, err_msg=name)
    # unsorted input too: unique_pairs takes edges in any order
    for a, b in zip(
      graph_build.unique_pairs(src, etype, n, r, threads=threads),
      ref.unique_pairs(src, etype, n, r),
    ):
      np.testing.assert_array_equal(a, b)


def test_the_sort_handles_keys_wider_than_64_bits():
  """2**30 + 5 nodes and 9 relations need 31 + 31 + 4 bits: the reference falls back to lexsort,
  the native sort to (dst, src) then etype; 2**31 - 1 nodes and 4 relations use all 64 bits."""
  for n, r in ((2**30 + 5, 9), (2**31 - 1, 4), (2**31 - 1, 2**31 - 1)):
    rng = np.random.default_rng(n % 1000 + r)
    e = 100_000
    src, dst = rng.integers(0, n, e), rng.integers(0, n, e)
    src[:1000], dst[:1000] = n - 1, 0  # extremes and duplicates
    etype = rng.integers(0, r, e)
    assert ref.edge_key(src, dst, etype, n, r) is None  # the reference's overflow path
    order = ref.sort_order(src, dst, etype, n, r)
    s, d, t, o = graph_build.sort_edges(src, dst, etype, n, r, return_order=True)
    np.testing.assert_array_equal(o, order)
    np.testing.assert_array_equal(s, src[order])
    np.testing.assert_array_equal(d, dst[order])
    np.testing.assert_array_equal(t, etype[order])


def test_sorted_check_and_norm_agree_with_the_reference_on_unsorted_edges():
  rng = np.random.default_rng(1)
  s, d, t = graph_build.sort_edges(*_random_edges(100_000, 1000, 5, np.int64, 1), 1000, 5)
  assert graph_build.edges_sorted(s, d, t) and ref.is_sorted(s, d, t)
  for where in (1, 50_000, 65_536, 99_999):  # one swapped pair, also at a thread boundary
    for a in (s, d, t):
      b = a.copy()
      b[where - 1], b[where] = a[where], a[where - 1]
      args = [b if x is a else x for x in (s, d, t)]
      assert graph_build.edges_sorted(*args) == ref.is_sorted(*args)
  with pytest.raises(ValueError, match=r"mean_edge_norm: edges must be sorted by \(etype, dst\)"):
    graph_build.mean_edge_norm(rng.permutation(d), t)


def test_builders_reject_bad_ids_naming_the_argument():
  ok = np.array([0, 1, 2])
  with pytest.raises(ValueError, match=r"sort_edges: dst: value 3 is outside \[0, num_nodes=3\)"):
    graph_build.sort_edges(ok, np.array([0, 3, 1]), ok * 0, 3, 1)
  with pytest.raises(ValueError, match=r"sort_edges: etype: value -1 is outside"):
    graph_build.sort_edges(ok, ok, np.array([0, -1, 0]), 3, 1)
  with pytest.raises(ValueError, match=r"group_by: keys: value 5 is outside \[0, num_groups=4\)"):
    graph_build.group_by(np.array([0, 5], np.int32), 4)
  with pytest.raises(ValueError, match=r"unique_pairs: src: value 9 is outside"):
    graph_build.unique_pairs(np.array([9]), np.array([0]), 3, 1)
  with pytest.raises(ValueError, match="one length"):
    graph_build.sort_edges(ok, ok[:2], ok, 3, 1)
  with pytest.raises(TypeError, match="sort_edges: src: expected integers"):
    graph_build.sort_edges(ok * 1.0, ok, ok, 3, 1)
  with pytest.raises(ValueError, match=r"num_nodes must be in \[0, 2\*\*31\)"):
    graph_build.sort_edges(ok, ok, ok * 0, 2**31, 1)
  # other integer types are converted, not rejected
  s, _, _ = graph_build.sort_edges(ok.astype(np.uint16), ok.astype(np.int8), ok * 0, 3, 1)
  np.testing.assert_array_equal(s, ok)


def test_builders_leave_no_threads_behind():
  src, dst, etype = _random_edges(400_000, 10_000, 20, np.int32, 2)
  graph_build.sort_edges(src, dst, etype, 10_000, 20, threads=4)
  graph_build.unique_pairs(src, etype, 10_000, 20, threads=4)
  assert own_threads() == 0


def test_hetero_graph_derived_arrays_equal_the_reference():
  src, dst, etype = _random_edges(120_000, 2_000, 40, np.int32, 3)
  g = HeteroGraph.from_edges(
    src, dst, etype, num_nodes=2_000, relation_names=[f"r{i}" for i in range(40)], add_inverse=True
  )
  s2, d2, t2 = (np.concatenate(p) for p in ((src, dst), (dst, src), (etype, etype + 40)))
  order = ref.sort_order(s2, d2, t2, 2_000, 80)
  np.testing.assert_array_equal(g.src, s2[order])
  np.testing.assert_array_equal(g.etype, t2[order])
  np.testing.assert_array_equal(g.relation_offsets, ref.relation_offsets(g.etype, 80))
  for (offsets, ids), keys in ((g.csr(), g.src), (g.csc(), g.dst)):
    want = ref.grouped(keys, 2_000)
    np.testing.assert_array_equal(offsets, want[0])
    np.testing.assert_array_equal(ids, want[1])
  np.testing.assert_array_equal(g.edge_norm(), ref.mean_edge_norm(g.dst, g.etype))


def test_graph_arrays_from_graph_pass_the_full_value_check():
  from jaxdata.hector import runtime

  src, dst, etype = _random_edges(80_000, 3_000, 7, np.int64, 4)
  g = HeteroGraph.from_edges(src, dst, etype, num_nodes=3_000, add_inverse=True)
  ga = runtime.GraphArrays.from_graph(g)
  runtime._check_values(ga)  # what the constructor skips for arrays from the native builders
  for got, want in zip(
    [
      ga.pair,
      ga.pair_offsets,
      ga.pair_edges,
      ga.pair_src,
      ga.pair_etype,
      ga.pair_rel_offsets,
      ga.pair_csr_offsets,
      ga.pair_csr_edges,
    ],
    ref.unique_pairs(g.src, g.etype, g.num_nodes, g.num_relations),
  ):
    np.testing.assert_array_equal(np.asarray(got), want)


# -- typed construction ---------------------------------------------------------------------------

NUM = {"paper": 4, "author": 3, "venue": 0, "topic": 2}
EDGES = {
  ("author", "writes", "paper"): ([0, 2, 2, 1], [3, 0, 0, 1]),
  ("paper", "cites", "paper"): (np.array([1, 3], np.int32), np.array([0, 0], np.int32)),
  ("paper", "about", "topic"): ([], []),
  ("paper", "has", "topic"): ([0, 3], [1, 1]),
  ("author", "has", "topic"): ([2], [0]),
}


def test_typed_edges_equal_a_hand_built_flat_graph():
  g = HeteroGraph.from_typed_edges(EDGES, NUM)
  # papers 0..3, authors 4..6, no venues, topics 7..8
  names = ("writes", "cites", "about", "paper:has:topic", "author:has:topic")
  flat = HeteroGraph.from_edges(
    [4, 6, 6, 5, 1, 3, 0, 3, 6],
    [3, 0, 0, 1, 0, 0, 8, 8, 7],
    [0, 0, 0, 0, 1, 1, 3, 3, 4],
    num_nodes=9,
    relation_names=names,
    add_inverse=True,
    node_type_names=("paper", "author", "venue", "topic"),
    node_type_offsets=[0, 4, 7, 7, 9],
  )
  for f in ("src", "dst", "etype", "node_type_offsets"):
    np.testing.assert_array_equal(getattr(g, f), getattr(flat, f), err_msg=f)
  assert g.relation_names == flat.relation_names == names + tuple(f"rev_{n}" for n in names)
  assert g.node_type_names == ("paper", "author", "venue", "topic")
  assert g.relation_types == tuple(EDGES) + (
    ("paper", "rev_writes", "author"),
    ("paper", "rev_cites", "paper"),
    ("topic", "rev_about", "paper"),
    ("topic", "rev_has", "paper"),
    ("topic", "rev_has", "author"),
  )
  assert np.diff(g.relation_offsets).tolist() == [4, 2, 0, 2, 1] * 2
  one_way = HeteroGraph.from_typed_edges(EDGES, NUM, add_inverse=False)
  assert one_way.num_edges == 9 and one_way.relation_types == tuple(EDGES)


def test_typed_edges_take_pyg_edge_index_arrays():
  """PyG's edge_index_dict: one [2, E] array per key (NumPy or torch), the same graph."""
  torch = pytest.importorskip("torch")
  want = HeteroGraph.from_typed_edges(EDGES, NUM)
  for wrap in (np.array, torch.tensor):
    got = HeteroGraph.from_typed_edges({k: wrap(np.stack(v)) for k, v in EDGES.items()}, NUM)
    for f in ("src", "dst", "etype"):
      np.testing.assert_array_equal(getattr(got, f), getattr(want, f), err_msg=f)
  with pytest.raises(TypeError, match=r"a pair \(src ids, dst ids\) or a \[2, E\] array"):
    HeteroGraph.from_typed_edges({("paper", "cites", "paper"): np.zeros((3, 2), int)}, NUM)


def test_typed_ids_map_both_ways():
  g = HeteroGraph.from_typed_edges(EDGES, NUM)
  assert g.node_type_range("topic") == (7, 9) and g.node_type_range("venue") == (7, 7)
  np.testing.assert_array_equal(g.global_ids("author", [0, 2]), [4, 6])
  types, local = g.local_ids(np.arange(9))
  assert [g.node_type_names[t] for t in types] == ["paper"] * 4 + ["author"] * 3 + ["topic"] * 2
  np.testing.assert_array_equal(local, [0, 1, 2, 3, 0, 1, 2, 0, 1])
  for t in ("paper", "author", "topic"):
    ids = np.arange(NUM[t])
    back_types, back = g.local_ids(g.global_ids(t, ids))
    np.testing.assert_array_equal(back, ids)
    assert set(back_types.tolist()) <= {g.node_type_names.index(t)}
  with pytest.raises(ValueError, match=r"global_ids: local_ids: value 3 is outside"):
    g.global_ids("author", [3])
  with pytest.raises(ValueError, match="unknown node type 'venues'"):
    g.global_ids("venues", [0])
  with pytest.raises(ValueError, match=r"local_ids: global_ids: value 9 is outside"):
    g.local_ids([9])
  # one node type: the whole range, and relation types joining it to itself
  plain = HeteroGraph.from_edges([0, 1], [1, 0], [0, 0])
  assert plain.node_type_range("node") == (0, 2)
  assert plain.relation_types == (("node", "r0", "node"),)


def test_typed_edges_errors_name_the_problem():
  build = HeteroGraph.from_typed_edges
  with pytest.raises(
    ValueError,
    match=r"\('author', 'writes', 'book'\) names the unknown node "
    r"type 'book'",
  ):
    build({("author", "writes", "book"): ([0], [0])}, NUM)
  with pytest.raises(
    ValueError,
    match=r"dst ids of \('author', 'writes', 'paper'\): value 4 is "
    r"outside \[0, num_nodes\['paper'\]=4\)",
  ):
    build({("author", "writes", "paper"): ([0], [4])}, NUM)
  with pytest.raises(ValueError, match=r"src ids of .*: value -1 is outside"):
    build({("author", "writes", "paper"): ([-1], [0])}, NUM)
  with pytest.raises(ValueError, match=r"num_nodes\['paper'\] must be >= 0, got -1"):
    build({}, {"paper": -1})
  with pytest.raises(TypeError, match=r"num_nodes\['paper'\] must be an int"):
    build({}, {"paper": 2.0})
  with pytest.raises(ValueError, match=r"src and dst ids of .* have different lengths \(2 and 1\)"):
    build({("author", "writes", "paper"): ([0, 1], [0])}, NUM)
  with pytest.raises(TypeError, match=r"src ids of .*: expected integers, got dtype float64"):
    build({("author", "writes", "paper"): ([0.5], [0])}, NUM)
  with pytest.raises(TypeError, match="name triples"):
    build({("author", "paper"): ([0], [0])}, NUM)
  with pytest.raises(TypeError, match=r"must be a pair \(src ids, dst ids\)"):
    build({("author", "writes", "paper"): [0, 1, 2]}, NUM)
  with pytest.raises(ValueError, match="at most 2\\*\\*31 - 1 nodes"):
    build({}, {"a": 2**30, "b": 2**30})


def test_synthetic_mag_relation_types_are_the_graphs():
  ds = synthetic_mag(scale=1e-4, seed=0)
  assert ds.graph.relation_types == ds.relation_types
  assert ds.graph.relation_names == tuple(r for _, r, _ in ds.relation_types)
