"""jaxdata.data: HeteroGraph against brute-force references, loaders, the synthetic generator."""

import collections
import gzip
import io
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxdata.data import EntityDataset, HeteroGraph, load_entities, synthetic_entities
from jaxdata.data.rdf import parse_ntriples

DATA = Path(
  os.environ.get("JAXDATA_DATA_DIR")
  or (Path(__file__).parents[1] / ".." / "shared" / "data").resolve()
)


# -- HeteroGraph against plain-Python references ------------------------------------------------


@st.composite
def edge_lists(draw):
  """(num_nodes, num_relations, [(src, dst, etype), ...]) for a small random multigraph."""
  n = draw(st.integers(1, 9))
  r = draw(st.integers(1, 4))
  triples = draw(
    st.lists(
      st.tuples(st.integers(0, n - 1), st.integers(0, n - 1), st.integers(0, r - 1)), max_size=40
    )
  )
  return n, r, triples


def _build(n, r, triples, **kwargs):
  src, dst, etype = (
    (np.array(column, np.int64) for column in zip(*triples)) if triples else ([], [], [])
  )
  return HeteroGraph.from_edges(
    src, dst, etype, num_nodes=n, relation_names=[f"rel{i}" for i in range(r)], **kwargs
  )


def _triples(g):
  return list(zip(g.src.tolist(), g.dst.tolist(), g.etype.tolist()))


@settings(max_examples=60, deadline=None)
@given(edge_lists())
def test_from_edges_sorts_a_permutation_of_the_input(case):
  n, r, triples = case
  g = _build(n, r, triples)
  assert (g.num_nodes, g.num_edges, g.num_relations) == (n, len(triples), r)
  assert g.src.dtype == g.dst.dtype == g.etype.dtype == np.int32
  got = _triples(g)
  assert sorted(got) == sorted(triples)  # the same multiset of edges
  assert got == sorted(triples, key=lambda t: (t[2], t[1], t[0]))  # ordered by (etype, dst, src)


@settings(max_examples=60, deadline=None)
@given(edge_lists())
def test_derived_arrays_match_brute_force(case):
  n, r, triples = case
  g = _build(n, r, triples)
  edges = _triples(g)
  # relation_offsets: the edges of relation k are a block of the sorted edge list.
  offsets = g.relation_offsets
  assert offsets.dtype == np.int64 and len(offsets) == r + 1
  for k in range(r):
    assert [e for e, (_, _, t) in enumerate(edges) if t == k] == list(
      range(offsets[k], offsets[k + 1])
    )
  # csr / csc: each node's edges, ascending edge ids.
  for method, end in ((g.csr, 0), (g.csc, 1)):
    node_offsets, edge_ids = method()
    assert node_offsets.dtype == np.int64 and edge_ids.dtype == np.int32
    for v in range(n):
      expected = [e for e, t in enumerate(edges) if t[end] == v]
      assert edge_ids[node_offsets[v] : node_offsets[v + 1]].tolist() == expected
  # edge_norm: 1 / number of edges of the same relation into the same node.
  c = collections.Counter((d, t) for _, d, t in edges)
  np.testing.assert_allclose(g.edge_norm("mean"), [1.0 / c[(d, t)] for _, d, t in edges], rtol=1e-6)
  assert g.edge_norm().dtype == np.float32
  np.testing.assert_array_equal(g.edge_norm("none"), np.ones(len(edges), np.float32))
  into = collections.Counter(d for _, d, _ in edges)
  assert g.in_degree().tolist() == [into[v] for v in range(n)]


@settings(max_examples=40, deadline=None)
@given(edge_lists())
def test_add_inverse_appends_reversed_edges(case):
  n, r, triples = case
  g = _build(n, r, triples, add_inverse=True)
  expected = triples + [(d, s, t + r) for s, d, t in triples]
  assert sorted(_triples(g)) == sorted(expected)
  assert g.relation_names == tuple(f"rel{i}" for i in range(r)) + tuple(
    f"rev_rel{i}" for i in range(r)
  )


def test_derived_arrays_are_cached_and_read_only():
  g = HeteroGraph.from_edges([0, 1, 2, 2], [1, 2, 0, 0], [0, 1, 1, 1])
  assert g.csr() is g.csr() and g.edge_norm() is g.edge_norm()
  for array in (g.src, g.dst, g.etype, *g.csr(), *g.csc(), g.edge_norm(), g.relation_offsets):
    assert not array.flags.writeable
  np.testing.assert_allclose(g.edge_norm(), [1, 0.5, 0.5, 1])  # sorted: 0->1, 2->0 twice, 1->2
  assert repr(g) == "HeteroGraph(num_nodes=3, num_edges=4, num_relations=2)"


def test_defaults_and_node_types():
  g = HeteroGraph.from_edges([0, 3], [1, 4], [2, 0])
  assert g.num_nodes == 5 and g.relation_names == ("r0", "r1", "r2")
  assert g.node_type_names == ("node",) and g.num_node_types == 1 and g.node_type_offsets is None
  typed = HeteroGraph.from_edges(
    [0, 3], [1, 4], [0, 0], node_type_names=("a", "b"), node_type_offsets=[0, 2, 6]
  )
  assert typed.num_nodes == 6 and typed.num_node_types == 2
  assert typed.node_type_offsets.tolist() == [0, 2, 6]
  empty = HeteroGraph.from_edges([], [], [], num_nodes=3, relation_names=["x"])
  assert empty.num_edges == 0 and empty.csr()[0].tolist() == [0, 0, 0, 0]
  assert empty.edge_norm().shape == (0,)


def test_bad_input_names_the_argument():
  with pytest.raises(ValueError, match="one length"):
    HeteroGraph.from_edges([0, 1], [1], [0, 0])
  with pytest.raises(TypeError, match="src"):
    HeteroGraph.from_edges([0.5], [1], [0])
  with pytest.raises(TypeError, match="etype"):
    HeteroGraph.from_edges([0], [1], [True])
  with pytest.raises(ValueError, match="src: expected a 1-D"):
    HeteroGraph.from_edges([[0]], [[1]], [[0]])
  with pytest.raises(ValueError, match="src"):
    HeteroGraph.from_edges([-1], [1], [0])
  with pytest.raises(ValueError, match="dst.*num_nodes=2"):
    HeteroGraph.from_edges([0], [2], [0], num_nodes=2)
  with pytest.raises(ValueError, match="etype.*len.relation_names.=1"):
    HeteroGraph.from_edges([0], [1], [1], relation_names=["only"])
  with pytest.raises(TypeError, match="num_nodes"):
    HeteroGraph.from_edges([0], [1], [0], num_nodes=2.0)
  with pytest.raises(TypeError, match="relation_names"):
    HeteroGraph.from_edges([0], [1], [0], relation_names="r")
  with pytest.raises(ValueError, match="sorted"):
    HeteroGraph(3, np.array([0, 0]), np.array([2, 1]), np.array([0, 0]), ("r",))
  with pytest.raises(ValueError, match="node_type_offsets"):
    HeteroGraph.from_edges(
      [0], [1], [0], num_nodes=3, node_type_names=("a", "b"), node_type_offsets=[0, 2, 4]
    )
  with pytest.raises(ValueError, match="node_type_offsets"):
    HeteroGraph(2, np.array([0]), np.array([1]), np.array([0]), ("r",), ("a", "b"))
  with pytest.raises(ValueError, match="kind"):
    HeteroGraph.from_edges([0], [1], [0]).edge_norm("sum")


# -- edge lists and jraph -----------------------------------------------------------------------


def test_from_edge_list_round_trip(tmp_path):
  path = tmp_path / "kg.txt"
  path.write_text(
    "# a comment\n"
    "alice knows bob\n"
    "\n"
    "bob\tlikes  carol   \n"
    "   # indented comment\n"
    "http://x#dave knows alice\n"
    "alice knows bob\n"
  )
  g, names = HeteroGraph.from_edge_list(path, add_inverse=False)
  assert names == ["alice", "bob", "carol", "http://x#dave"]
  assert g.relation_names == ("knows", "likes")
  named = sorted((names[s], g.relation_names[t], names[d]) for s, d, t in _triples(g))
  assert named == sorted(
    [
      ("alice", "knows", "bob"),
      ("bob", "likes", "carol"),
      ("http://x#dave", "knows", "alice"),
      ("alice", "knows", "bob"),
    ]
  )
  g2, names2 = HeteroGraph.from_edge_list(str(path))  # add_inverse=True by default
  assert names2 == names and g2.num_edges == 8 and g2.num_relations == 4
  assert g2.relation_names[2:] == ("rev_knows", "rev_likes")


def test_from_edge_list_with_delimiter_and_bad_lines(tmp_path):
  path = tmp_path / "kg.tsv"
  path.write_text("New York\tcity of\tUSA\nParis\tcity of\tFrance\n")
  g, names = HeteroGraph.from_edge_list(path, delimiter="\t", add_inverse=False)
  assert names == ["New York", "USA", "Paris", "France"] and g.relation_names == ("city of",)
  path.write_text("a r b\na r\n")
  with pytest.raises(ValueError, match=r"kg.tsv:2"):
    HeteroGraph.from_edge_list(path)


def test_jraph_round_trip():
  jraph = pytest.importorskip("jraph")
  g = HeteroGraph.from_edges(
    [0, 1, 2, 4], [1, 2, 0, 4], [1, 0, 1, 2], relation_names=["a", "b", "c"]
  )
  t = g.to_jraph()
  assert isinstance(t, jraph.GraphsTuple)
  np.testing.assert_array_equal(t.senders, g.src)
  np.testing.assert_array_equal(t.receivers, g.dst)
  np.testing.assert_array_equal(t.edges["etype"], g.etype)
  assert t.n_node.tolist() == [5] and t.n_edge.tolist() == [4] and t.nodes is None
  back = HeteroGraph.from_jraph(t)  # the names travel in globals
  assert back.num_nodes == g.num_nodes and back.relation_names == g.relation_names
  assert _triples(back) == _triples(g)
  bare = HeteroGraph.from_jraph(t._replace(globals=None))  # a GraphsTuple from elsewhere
  assert bare.relation_names == ("r0", "r1", "r2") and _triples(bare) == _triples(g)
  renamed = HeteroGraph.from_jraph(t, relation_names=["x", "y", "z"])
  assert renamed.relation_names == ("x", "y", "z")
  with pytest.raises(ValueError, match="etype_key"):
    HeteroGraph.from_jraph(t, etype_key="type")


def test_jraph_round_trip_keeps_node_types_and_relation_types():
  pytest.importorskip("jraph")
  g = HeteroGraph.from_typed_edges(
    {
      ("paper", "cites", "paper"): ([0, 1, 2], [1, 2, 0]),
      ("author", "writes", "paper"): ([0, 1, 1], [2, 0, 1]),
    },
    num_nodes={"paper": 3, "author": 2},
    add_inverse=True,
  )
  back = HeteroGraph.from_jraph(g.to_jraph())
  assert back.relation_names == g.relation_names and back.relation_types == g.relation_types
  assert back.node_type_names == g.node_type_names
  np.testing.assert_array_equal(back.node_type_offsets, g.node_type_offsets)
  for field in ("src", "dst", "etype"):
    np.testing.assert_array_equal(getattr(back, field), getattr(g, field))


# -- RDF ----------------------------------------------------------------------------------------


def test_parse_ntriples_terms():
  lines = [
    '<http://a> <http://p> "caf\\u00e9 \\"x\\"\\n"@EN-gb .',
    "# comment",
    "",
    '_:b1 <http://p> "1"^^<http://www.w3.org/2001/XMLSchema#integer> .\r',
    "<http://a> <http://q> _:b.1.",
    '<http://\\u0041> <http://p> "plain" . # trailing comment',
  ]
  s, p, o = parse_ntriples(lines)
  assert s == ["<http://a>", "_:b1", "<http://a>", "<http://A>"]
  assert p == ["http://p", "http://p", "http://q", "http://p"]
  assert o == [
    '"café \\"x\\"\\n"@en-gb',
    '"1"^^<http://www.w3.org/2001/XMLSchema#integer>',
    "_:b.1",
    '"plain"',
  ]
  with pytest.raises(ValueError, match="test.nt:2"):
    parse_ntriples(["<a> <p> <b> .", "<a> <p> ."], "test.nt")


def _archive(path, members):
  with tarfile.open(path, "w:gz") as tar:
    for name, data in members.items():
      info = tarfile.TarInfo(name)
      info.size = len(data)
      tar.addfile(info, io.BytesIO(data))


def test_load_entities_on_a_hand_made_archive(tmp_path):
  nt = "\n".join(
    [
      "<http://e/a> <http://p/knows> <http://e/b> .",
      "<http://e/a> <http://p/knows> <http://e/b> .",  # repeated statement: one edge
      '<http://e/b> <http://p/name> "http://e/a" .',  # a literal, not the IRI <http://e/a>
      '<http://e/c> <http://p/name> "http://e/a"@en .',
      "<http://e/c> <http://p/knows> _:x .",
      "_:x <http://p/knows> <http://e/c> .",
      "",
    ]
  ).encode()
  train = b"person\tid\tlabel_group\nhttp://e/a\t1\tg2\nhttp://e/b\t2\tg1\n"
  test = b"person\tid\tlabel_group\nhttp://e/c\t3\tg2\n"
  path = tmp_path / "toy.tgz"
  _archive(
    path,
    {
      "./toy_stripped.nt.gz": gzip.compress(nt),
      "./trainingSet.tsv": train,
      "./testSet.tsv": test,
      "./README.txt": b"toy",
    },
  )
  ds = load_entities(path)
  assert isinstance(ds, EntityDataset) and ds.name == "toy" and ds.features is None
  names = ds.node_names
  assert sorted(names) == sorted(
    ["<http://e/a>", "<http://e/b>", "<http://e/c>", "_:x", '"http://e/a"', '"http://e/a"@en']
  )
  g = ds.graph
  assert g.relation_names == (
    "http://p/knows",
    "http://p/name",
    "rev_http://p/knows",
    "rev_http://p/name",
  )
  named = sorted((names[s], g.relation_names[t], names[d]) for s, d, t in _triples(g))
  forward = [
    ("<http://e/a>", "http://p/knows", "<http://e/b>"),
    ("<http://e/b>", "http://p/name", '"http://e/a"'),
    ("<http://e/c>", "http://p/name", '"http://e/a"@en'),
    ("<http://e/c>", "http://p/knows", "_:x"),
    ("_:x", "http://p/knows", "<http://e/c>"),
  ]
  assert named == sorted(forward + [(o, "rev_" + p, s) for s, p, o in forward])
  assert ds.class_names == ("g1", "g2") and ds.num_classes == 2
  assert [names[i] for i in ds.train_idx] == ["<http://e/a>", "<http://e/b>"]
  assert ds.train_y.tolist() == [1, 0] and ds.test_y.tolist() == [1]
  assert [names[i] for i in ds.test_idx] == ["<http://e/c>"]


def test_load_entities_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="no archive"):
    load_entities(tmp_path / "missing.tgz")
  (tmp_path / "junk.tgz").write_bytes(b"not an archive")
  with pytest.raises(ValueError, match="not a .*tar archive"):
    load_entities(tmp_path / "junk.tgz")
  _archive(tmp_path / "partial.tgz", {"./README.txt": b"x", "./trainingSet.tsv": b"a\n"})
  with pytest.raises(ValueError, match=r"lacks .*\.nt\.gz.*testSet\.tsv"):
    load_entities(tmp_path / "partial.tgz")
  nt = gzip.compress(b"<http://e/a> <http://p> <http://e/b> .\n")
  labels = b"x\tlabel_y\nhttp://e/zzz\t1\n"
  _archive(
    tmp_path / "stranger.tgz",
    {"g_stripped.nt.gz": nt, "trainingSet.tsv": labels, "testSet.tsv": b"x\tlabel_y\n"},
  )
  with pytest.raises(ValueError, match="http://e/zzz"):
    load_entities(tmp_path / "stranger.tgz")


# Counts from /work/shared/data/README.md (they equal PyG's Entities); split sizes from the TSVs.
RDF_EXPECTED = {
  "aifb": dict(nodes=8285, predicates=45, edges=58086, classes=4, train=140, test=36),
  "mutag": dict(nodes=23644, predicates=23, edges=148454, classes=2, train=272, test=68),
}


@pytest.fixture(scope="module", params=sorted(RDF_EXPECTED))
def rdf(request):
  path = DATA / f"{request.param}.tgz"
  if not path.exists():
    pytest.skip(f"{path} is not here")
  return request.param, path, load_entities(path)


def test_rdf_counts_and_splits(rdf):
  name, path, ds = rdf
  want = RDF_EXPECTED[name]
  g = ds.graph
  assert ds.name == name
  assert (g.num_nodes, g.num_relations, g.num_edges) == (
    want["nodes"],
    2 * want["predicates"],
    want["edges"],
  )
  assert ds.num_classes == want["classes"] == len(ds.class_names)
  assert (len(ds.train_idx), len(ds.test_idx)) == (want["train"], want["test"])
  assert len(np.intersect1d(ds.train_idx, ds.test_idx)) == 0
  assert set(ds.train_y.tolist()) | set(ds.test_y.tolist()) == set(range(ds.num_classes))
  assert list(ds.class_names) == sorted(ds.class_names)
  assert all(ds.node_names[i].startswith("<") for i in np.concatenate([ds.train_idx, ds.test_idx]))
  # Every node has an edge, and the relation names are the predicates of the raw file.
  assert (g.in_degree() > 0).all()
  with tarfile.open(path) as tar:
    member = next(m for m in tar.getmembers() if m.name.endswith(".nt.gz"))
    raw = gzip.decompress(tar.extractfile(member).read()).decode()
  predicates = {line.split()[1][1:-1] for line in raw.splitlines() if line.strip()}
  assert set(g.relation_names[: want["predicates"]]) == predicates


def test_rdf_inverse_relations_reverse_their_forward_relation(rdf):
  _, _, ds = rdf
  g = ds.graph
  half = g.num_relations // 2
  assert g.relation_names[half:] == tuple("rev_" + n for n in g.relation_names[:half])
  off = g.relation_offsets
  for r in range(half):
    fwd = slice(off[r], off[r + 1])
    inv = slice(off[r + half], off[r + half + 1])
    forward = np.stack([g.src[fwd], g.dst[fwd]], 1)
    backward = np.stack([g.dst[inv], g.src[inv]], 1)
    np.testing.assert_array_equal(np.unique(forward, axis=0), np.unique(backward, axis=0))
    assert len(np.unique(forward, axis=0)) == len(forward)  # a set of triples: no repeats


def test_rdf_load_is_deterministic(rdf):
  _, path, ds = rdf
  again = load_entities(path)
  for field in ("src", "dst", "etype"):
    np.testing.assert_array_equal(getattr(again.graph, field), getattr(ds.graph, field))
  np.testing.assert_array_equal(again.train_idx, ds.train_idx)
  np.testing.assert_array_equal(again.test_y, ds.test_y)


# -- synthetic ----------------------------------------------------------------------------------


def test_synthetic_sizes_determinism_and_heavy_tails():
  kwargs = dict(
    num_nodes=5000,
    num_edges=60_000,
    num_relations=40,
    num_classes=3,
    feature_dim=8,
    train_fraction=0.2,
    test_fraction=0.3,
  )
  ds = synthetic_entities(**kwargs, seed=3)
  g = ds.graph
  assert (g.num_nodes, g.num_edges, g.num_relations) == (5000, 60_000, 40)
  assert ds.features.shape == (5000, 8) and ds.features.dtype == np.float32
  assert (len(ds.train_idx), len(ds.test_idx)) == (1000, 1500)
  assert len(np.intersect1d(ds.train_idx, ds.test_idx)) == 0
  assert ds.num_classes == 3 and set(ds.train_y.tolist()) == {0, 1, 2}
  same = synthetic_entities(**kwargs, seed=3)
  other = synthetic_entities(**kwargs, seed=4)
  for field in ("src", "dst", "etype"):
    np.testing.assert_array_equal(getattr(same.graph, field), getattr(g, field))
  np.testing.assert_array_equal(same.features, ds.features)
  np.testing.assert_array_equal(same.train_y, ds.train_y)
  assert not np.array_equal(other.graph.src, g.src)
  # Heavy tails: hub nodes and a dominant relation, next to rare ones.
  in_degree = g.in_degree()
  out_degree = np.bincount(g.src, minlength=g.num_nodes)
  assert in_degree.max() > 30 * in_degree.mean() and out_degree.max() > 30 * out_degree.mean()
  per_relation = np.diff(g.relation_offsets)
  assert per_relation.max() > 20 * per_relation.min() > 0
  assert synthetic_entities(num_nodes=50, num_edges=10, feature_dim=0).features is None


def _nearest_class_mean_accuracy(ds):
  means = np.stack(
    [ds.features[ds.train_idx[ds.train_y == c]].mean(0) for c in range(ds.num_classes)]
  )
  distance = ((ds.features[ds.test_idx, None, :] - means[None]) ** 2).sum(-1)
  return (distance.argmin(1) == ds.test_y).mean()


def _typed_neighbour_vote_accuracy(ds):
  """Naive Bayes on the labels of a node's in-neighbours, per relation, fitted on train nodes."""
  g, c = ds.graph, ds.num_classes
  label = np.full(g.num_nodes, -1)
  label[ds.train_idx], label[ds.test_idx] = ds.train_y, ds.test_y
  is_train = np.zeros(g.num_nodes, bool)
  is_train[ds.train_idx] = True
  known = label[g.src] >= 0
  fit = known & is_train[g.dst]
  counts = np.ones((g.num_relations, c, c))  # [relation, class of dst, class of src], smoothed
  np.add.at(counts, (g.etype[fit], label[g.dst[fit]], label[g.src[fit]]), 1)
  log_p = np.log(counts / counts.sum(2, keepdims=True))
  score = np.zeros((g.num_nodes, c))
  np.add.at(score, g.dst[known], log_p[g.etype[known], :, label[g.src[known]]])
  return (score[ds.test_idx].argmax(1) == ds.test_y).mean()


def test_synthetic_signal_is_in_the_typed_neighbourhood_not_the_features():
  ds = synthetic_entities(
    num_nodes=10_000,
    num_edges=100_000,
    num_relations=30,
    num_classes=4,
    train_fraction=0.5,
    test_fraction=0.5,
    seed=1,
  )
  from_features = _nearest_class_mean_accuracy(ds)
  from_neighbours = _typed_neighbour_vote_accuracy(ds)
  assert 0.3 < from_features < 0.6  # above chance (0.25), far from solved
  assert from_neighbours > 0.85
  assert from_neighbours > from_features + 0.25


def test_synthetic_two_million_edges():
  ds = synthetic_entities(num_nodes=200_000, num_edges=2_000_000, num_relations=500, feature_dim=4)
  g = ds.graph
  assert (g.num_edges, g.num_relations) == (2_000_000, 500)
  assert (np.diff(g.relation_offsets) > 0).all()


def test_synthetic_bad_arguments():
  with pytest.raises(ValueError, match="num_classes"):
    synthetic_entities(num_classes=1)
  with pytest.raises(TypeError, match="num_nodes"):
    synthetic_entities(num_nodes=1e4)
  with pytest.raises(ValueError, match="train_fraction \\+ test_fraction"):
    synthetic_entities(train_fraction=0.6, test_fraction=0.5)
  with pytest.raises(ValueError, match="edge_signal"):
    synthetic_entities(edge_signal=1.5)
