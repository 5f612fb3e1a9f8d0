"""synthetic_mag's parallel drawing: the same graph for any thread count, ogbn-mag's counts,
and the statistics its docstring promises (popularity-driven degrees, homophily), checked
against the model's own expectations."""

import numpy as np
import pytest

from jaxdata.data import mag


@pytest.fixture
def small_chunks(monkeypatch):
  """Many chunks even on a small graph, so that the chunking is exercised."""
  monkeypatch.setattr(mag, "EDGE_CHUNK", 997)
  monkeypatch.setattr(mag, "FEATURE_CHUNK", 101)


def _arrays(ds):
  g = ds.graph
  return [
    g.src,
    g.dst,
    g.etype,
    *ds.features,
    ds.labels,
    ds.train_papers,
    ds.val_papers,
    ds.test_papers,
  ]


def test_the_graph_does_not_depend_on_the_thread_count(small_chunks):
  one = mag.synthetic_mag(scale=0.003, seed=5, num_classes=6, threads=1)
  for threads in (2, 3, 7):
    other = mag.synthetic_mag(scale=0.003, seed=5, num_classes=6, threads=threads)
    for a, b in zip(_arrays(one), _arrays(other)):
      np.testing.assert_array_equal(a, b)
  another_seed = mag.synthetic_mag(scale=0.003, seed=6, num_classes=6, threads=2)
  assert not np.array_equal(one.graph.src, another_seed.graph.src)
  assert not np.array_equal(one.features[1], another_seed.features[1])
  with pytest.raises(ValueError, match="threads must be a positive int"):
    mag.synthetic_mag(scale=0.001, threads=0)


def test_counts_are_ogbn_mags_times_the_scale(small_chunks):
  scale = 0.02
  ds = mag.synthetic_mag(scale=scale, seed=0, num_classes=8, threads=2)
  g = ds.graph
  assert [hi - lo for lo, hi in map(ds.node_range, mag.NODE_TYPES)] == [
    round(mag.NUM_NODES[t] * scale) for t in mag.NODE_TYPES
  ]
  assert (
    np.diff(g.relation_offsets).tolist()
    == [round(mag.NUM_EDGES[name] * scale) for _, name, _ in mag.RELATIONS] * 2
  )
  for t, x in zip(mag.NODE_TYPES, ds.features):
    assert x.shape[1] == mag.FEATURE_DIMS[t] and x.dtype == np.float32
  assert np.bincount(ds.labels).tolist() == [
    len(ds.labels) // 8 + (c < len(ds.labels) % 8) for c in range(8)
  ]


def test_homophily_and_popularity_match_the_model(small_chunks):
  classes, h = 8, 0.8
  ds = mag.synthetic_mag(scale=0.03, seed=1, num_classes=classes, homophily=h, threads=2)
  g = ds.graph
  # has_topic: papers drawn by popularity, their topic inside the paper's class w.p. h.
  r = g.relation_names.index("has_topic")
  block = slice(*g.relation_offsets[r : r + 2])
  papers, fields = g.src[block], g.dst[block] - ds.node_range("field_of_study")[0]
  fos = ds.features[3]
  # A field's class (not exported) is the majority class of its papers: most of its edges
  # were drawn inside its class.
  majority = np.array(
    [
      np.bincount(ds.labels[papers[fields == f]], minlength=classes).argmax()
      if (fields == f).any()
      else -1
      for f in range(len(fos))
    ]
  )
  seen = majority[fields] >= 0
  same = np.mean(ds.labels[papers[seen]] == majority[fields[seen]])
  assert same == pytest.approx(h + (1 - h) / classes, abs=0.02)
  # The papers' out-degrees in has_topic follow popularity (rank + 1) ** -0.3: the top 1% of
  # papers hold the share of edges the distribution gives them.
  n = ds.node_range("paper")[1]
  degrees = np.sort(np.bincount(papers, minlength=n))[::-1]
  popularity = np.arange(1, n + 1) ** -mag.EXPONENTS["has_topic"][0]
  top = n // 100
  want = popularity[:top].sum() / popularity.sum()
  assert degrees[:top].sum() / len(papers) == pytest.approx(want, rel=0.05)
  # writes: papers drawn first by popularity (rank + 1) ** -0.5: a heavier head.
  r = g.relation_names.index("writes")
  block = slice(*g.relation_offsets[r : r + 2])
  degrees = np.sort(np.bincount(g.dst[block], minlength=n))[::-1]
  popularity = np.arange(1, n + 1) ** -mag.EXPONENTS["writes"][1]
  want = popularity[:top].sum() / popularity.sum()
  assert degrees[:top].sum() / (block.stop - block.start) == pytest.approx(want, rel=0.05)
