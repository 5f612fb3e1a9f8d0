"""jaxdata.data.powerlaw: the CSR is valid, the result is deterministic, degrees are heavy-tailed,
the graph is as homophilous as asked, and the task is learnable from the neighbourhood only."""

import numpy as np
import pytest

from jaxdata.data import powerlaw
from jaxdata.data.powerlaw import NodeDataset, powerlaw_graph

SMALL = dict(num_nodes=5_000, num_edges=60_000, feature_dim=8, num_classes=4)
MEDIUM = dict(num_nodes=20_000, num_edges=400_000, feature_dim=4)


@pytest.fixture(scope="module")
def default():
  """The default-size dataset (100,000 nodes, 2 million edges), built once."""
  return powerlaw_graph()


def _arrays(ds: NodeDataset) -> dict:
  return {
    name: getattr(ds, name)
    for name in (
      "indptr",
      "indices",
      "features",
      "labels",
      "train_nodes",
      "val_nodes",
      "test_nodes",
    )
  }


def _assert_valid(ds: NodeDataset):
  assert ds.indptr.dtype == np.int64 and ds.indices.dtype == np.int32
  assert ds.features.dtype == np.float32 and ds.labels.dtype == np.int32
  assert ds.indptr.shape == (ds.num_nodes + 1,) and ds.labels.shape == (ds.num_nodes,)
  assert ds.features.shape == (ds.num_nodes, ds.feature_dim)
  assert ds.indptr[0] == 0 and ds.indptr[-1] == ds.num_edges == len(ds.indices)
  assert np.all(np.diff(ds.indptr) >= 0)
  if ds.num_edges:
    assert 0 <= ds.indices.min() and ds.indices.max() < ds.num_nodes
  assert 0 <= ds.labels.min() and ds.labels.max() < ds.num_classes


# -- the CSR and the splits ---------------------------------------------------------------------


@pytest.mark.parametrize(
  "kwargs",
  [
    SMALL,
    dict(SMALL, num_edges=0),
    dict(SMALL, feature_dim=0),
    dict(SMALL, exponent=0.0),
    dict(num_nodes=1, num_edges=10, num_classes=1, feature_dim=3),
    dict(SMALL, num_classes=7, homophily=1.0),
  ],
)
def test_csr_is_valid(kwargs):
  ds = powerlaw_graph(**kwargs)
  _assert_valid(ds)
  assert (ds.num_nodes, ds.num_edges, ds.feature_dim) == (
    kwargs["num_nodes"],
    kwargs["num_edges"],
    kwargs["feature_dim"],
  )
  assert np.all(
    np.bincount(ds.labels, minlength=ds.num_classes) >= ds.num_nodes // ds.num_classes
  )  # classes equally common


def test_splits_are_disjoint_sorted_and_sized(default):
  n = default.num_nodes
  splits = (default.train_nodes, default.val_nodes, default.test_nodes)
  assert [len(s) for s in splits] == [round(0.1 * n), round(0.05 * n), round(0.1 * n)]
  for s in splits:
    assert s.dtype == np.int32 and np.all(np.diff(s) > 0)
  assert len(np.unique(np.concatenate(splits))) == sum(len(s) for s in splits)
  whole = powerlaw_graph(**SMALL, train_fraction=0.5, val_fraction=0.25, test_fraction=0.25)
  assert np.array_equal(
    np.sort(np.concatenate([whole.train_nodes, whole.val_nodes, whole.test_nodes])),
    np.arange(whole.num_nodes),
  )


def test_arrays_are_read_only_and_repr_reports_sizes(default):
  with pytest.raises(ValueError):
    default.indices[0] = 0
  assert "num_nodes=100000" in repr(default) and "GiB" in repr(default)
  summary = default.summary()
  assert "in-degree" in summary and "out-degree" in summary and "median" in summary


# -- determinism ----------------------------------------------------------------------------------


def test_same_seed_same_arrays_different_seed_different_arrays():
  first, again, other = (powerlaw_graph(**SMALL, seed=s) for s in (3, 3, 4))
  for name, array in _arrays(first).items():
    assert np.array_equal(array, _arrays(again)[name]), name
  for name in ("indptr", "indices", "features", "labels"):
    assert not np.array_equal(_arrays(first)[name], _arrays(other)[name]), name


def test_result_does_not_depend_on_thread_count(monkeypatch):
  monkeypatch.setattr(powerlaw, "_EDGE_CHUNK", 4_000)  # many chunks of edges and of features
  monkeypatch.setattr(powerlaw, "_FEATURE_CHUNK", 3_000)
  one, four = (powerlaw_graph(**SMALL, num_threads=t) for t in (1, 4))
  for name, array in _arrays(one).items():
    assert np.array_equal(array, _arrays(four)[name]), name


def test_features_out_is_filled_in_place_with_the_same_values(monkeypatch):
  monkeypatch.setattr(powerlaw, "_FEATURE_CHUNK", 3_000)
  out = np.full((SMALL["num_nodes"], SMALL["feature_dim"]), np.nan, np.float32)
  into = powerlaw_graph(**SMALL, features_out=out)
  fresh = powerlaw_graph(**SMALL)
  assert np.shares_memory(into.features, out)
  assert np.array_equal(out, fresh.features)
  out[0, 0] = 1.0  # the caller's buffer stays writable


def test_progress_bar_runs(capsys):
  ds = powerlaw_graph(**SMALL, progress=True)
  _assert_valid(ds)


# -- the shape of the graph -----------------------------------------------------------------------


def test_degrees_are_heavy_tailed():
  ds = powerlaw_graph(**MEDIUM)
  assert np.array_equal(ds.out_degrees(), np.bincount(ds.indices, minlength=ds.num_nodes))
  for degrees in (ds.in_degrees(), ds.out_degrees()):  # receivers and senders alike
    assert degrees.max() > 20 * np.median(degrees)
    assert np.median(degrees) < degrees.mean()  # most nodes have fewer edges than average
  flat = powerlaw_graph(**MEDIUM, exponent=0.0).in_degrees()
  assert flat.max() < 3 * np.median(flat)  # exponent 0: Poisson degrees, no hubs


@pytest.mark.parametrize("homophily", [0.0, 0.3, 0.8])
def test_share_of_same_class_edges_matches_homophily(homophily):
  ds = powerlaw_graph(**MEDIUM, homophily=homophily)
  receivers = np.repeat(ds.labels, ds.in_degrees())
  same = np.mean(ds.labels[ds.indices] == receivers)
  # Edges are independent: a share `homophily` is same-class by construction, and each other
  # one is with probability sum_c mass_c**2 (mass_c: class c's share of the popularity), which
  # is 1/C plus the variance of the class masses (about 1e-3 at this size). Binomial noise over
  # 400,000 edges is below 1e-3: a tolerance of 1e-2 is loose for this and tight for homophily.
  assert same == pytest.approx(homophily + (1 - homophily) / ds.num_classes, abs=1e-2)


def test_full_homophily_joins_only_nodes_of_one_class():
  ds = powerlaw_graph(**SMALL, homophily=1.0)
  assert np.array_equal(ds.labels[ds.indices], np.repeat(ds.labels, ds.in_degrees()))


# -- the task -------------------------------------------------------------------------------------


def _own_and_neighbour_mean(ds: NodeDataset, nodes: np.ndarray):
  """(own features, mean of in-neighbours' features; zeros without in-neighbours) of `nodes`."""
  starts, lengths = ds.indptr[nodes], np.diff(ds.indptr)[nodes]
  first = np.cumsum(lengths) - lengths
  edges = np.repeat(starts - first, lengths) + np.arange(lengths.sum())
  rows = ds.features[ds.indices[edges]].astype(np.float64)
  sums = np.zeros((len(nodes), ds.feature_dim))
  sums[lengths > 0] = np.add.reduceat(rows, first[lengths > 0])
  return ds.features[nodes].astype(np.float64), sums / np.maximum(lengths, 1)[:, None]


def _nearest_centroid_accuracy(train_x, train_y, test_x, test_y, num_classes) -> float:
  """Nearest class mean after scaling every column to unit within-class spread (on train)."""
  centroids = np.stack([train_x[train_y == c].mean(0) for c in range(num_classes)])
  scale = (train_x - centroids[train_y]).std(0)
  distances = (((test_x / scale)[:, None, :] - (centroids / scale)[None]) ** 2).sum(-1)
  return float(np.mean(distances.argmin(1) == test_y))


def test_neighbourhood_predicts_the_class_and_own_features_only_weakly(default):
  own_train, mean_train = _own_and_neighbour_mean(default, default.train_nodes)
  own_test, mean_test = _own_and_neighbour_mean(default, default.test_nodes)
  y_train, y_test = default.labels[default.train_nodes], default.labels[default.test_nodes]
  c = default.num_classes
  own = _nearest_centroid_accuracy(own_train, y_train, own_test, y_test, c)
  both = _nearest_centroid_accuracy(
    np.hstack([own_train, mean_train]), y_train, np.hstack([own_test, mean_test]), y_test, c
  )
  chance = 1 / c
  # 10,000 test nodes: an accuracy's standard error is below 0.005.
  assert own > chance + 0.05  # the own features carry a little signal...
  assert both > own + 0.2  # ...the neighbourhood much more...
  assert both > 4 * chance  # ...enough to classify most nodes


# -- arguments ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    (dict(num_nodes=0), ValueError, "num_nodes"),
    (dict(num_nodes=2.5), TypeError, "num_nodes"),
    (dict(num_nodes=True), TypeError, "num_nodes"),
    (dict(num_edges=-1), ValueError, "num_edges"),
    (dict(feature_dim=-1), ValueError, "feature_dim"),
    (dict(num_nodes=4, num_classes=5), ValueError, "num_classes"),
    (dict(num_classes=0), ValueError, "num_classes"),
    (dict(exponent=-0.5), ValueError, "exponent"),
    (dict(homophily=1.5), ValueError, "homophily"),
    (dict(homophily="high"), TypeError, "homophily"),
    (dict(feature_signal=float("nan")), ValueError, "feature_signal"),
    (dict(train_fraction=1.0), ValueError, "train_fraction"),
    (dict(val_fraction=-0.1), ValueError, "val_fraction"),
    (
      dict(train_fraction=0.6, val_fraction=0.3, test_fraction=0.3),
      ValueError,
      "train_fraction \\+ val_fraction \\+ test_fraction",
    ),
    (dict(seed=-1), ValueError, "seed"),
    (dict(num_threads=0), ValueError, "num_threads"),
    (dict(name=3), TypeError, "name"),
    (dict(features_out=[[0.0]]), TypeError, "features_out"),
    (dict(features_out=np.zeros((10, 4), np.float64)), TypeError, "features_out"),
    (dict(features_out=np.zeros((10, 5), np.float32)), ValueError, "features_out"),
    (dict(features_out=np.zeros((4, 10), np.float32).T), ValueError, "features_out"),
  ],
)
def test_bad_arguments_raise_naming_the_argument(kwargs, error, match):
  base = dict(num_nodes=10, num_edges=20, feature_dim=4, num_classes=2)
  with pytest.raises(error, match=match):
    powerlaw_graph(**{**base, **kwargs})


def test_read_only_features_out_is_refused():
  out = np.zeros((10, 4), np.float32)
  out.setflags(write=False)
  with pytest.raises(ValueError, match="features_out must be writable"):
    powerlaw_graph(num_nodes=10, num_edges=20, feature_dim=4, num_classes=2, features_out=out)
