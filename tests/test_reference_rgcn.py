"""The plain-JAX RGCN formulations (jaxdata/reference/rgcn.py, timed by
examples/benchmarks/rgnn_peers.py) against a loop over edges."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import rgnn_peers as peers
from jaxdata.reference import rgcn as rgcn_ref


@pytest.fixture(autouse=True)
def on_cpu():
  """CPU tests: on a GPU machine JAX would default to the GPU (and TF32 matmuls)."""
  with jax.default_device(jax.devices("cpu")[0]):
    yield


def random_graph(rng, num_nodes, num_edges, num_relations, *, used_relations=None, dst_nodes=None):
  """Random edges; only `used_relations` relations get edges, only `dst_nodes` nodes in-edges."""
  used = np.arange(num_relations) if used_relations is None else np.asarray(used_relations)
  targets = np.arange(num_nodes) if dst_nodes is None else np.asarray(dst_nodes)
  src = rng.integers(0, num_nodes, num_edges)
  dst = rng.choice(targets, num_edges)
  etype = rng.choice(used, num_edges) if num_edges else np.zeros(0, np.int64)
  return src, dst, etype


def loop_norm(dst, etype):
  counts = {}
  for d, r in zip(dst, etype):
    counts[d, r] = counts.get((d, r), 0) + 1
  return np.array([1.0 / counts[d, r] for d, r in zip(dst, etype)])


def loop_message(src, dst, etype, norm, num_nodes, x, w):
  """out[dst] += norm * x[src] @ W[etype], edge by edge (x None: W[etype, src])."""
  out = np.zeros((num_nodes, w.shape[-1]))
  for s, d, r, c in zip(src, dst, etype, norm):
    out[d] += c * (w[r, s] if x is None else x[s] @ w[r])
  return out


def loop_grads(src, dst, etype, norm, x, w, ct):
  """d/dx and d/dW of sum(out * ct), edge by edge."""
  dx = None if x is None else np.zeros_like(x)
  dw = np.zeros_like(w)
  for s, d, r, c in zip(src, dst, etype, norm):
    if x is None:
      dw[r, s] += c * ct[d]
    else:
      dx[s] += c * w[r] @ ct[d]
      dw[r] += c * np.outer(x[s], ct[d])
  return dx, dw


GRAPHS = {
  # name: (num_nodes, num_edges, num_relations, used relations, nodes with in-edges)
  "one relation": (9, 30, 1, None, None),
  "three relations": (12, 50, 3, None, None),
  "empty relations": (15, 60, 7, [0, 2, 3, 6], None),  # 1, 4, 5 have no edges
  "trailing empty": (10, 40, 5, [0, 1], None),
  "leading empty": (10, 40, 5, [3, 4], None),
  "isolated targets": (20, 45, 4, None, [1, 5, 6, 11, 19]),  # most nodes get no in-edges
  "no edges": (6, 0, 3, None, None),
}


def build(name, seed=0, d_in=5, d_out=4, featureless=False):
  num_nodes, num_edges, num_relations, used, targets = GRAPHS[name]
  rng = np.random.default_rng(seed)
  src, dst, etype = random_graph(
    rng, num_nodes, num_edges, num_relations, used_relations=used, dst_nodes=targets
  )
  edges = rgcn_ref.EdgeArrays.build(
    src, dst, etype, num_nodes=num_nodes, num_relations=num_relations, dtype=np.float64
  )
  x = None if featureless else rng.standard_normal((num_nodes, d_in))
  w = rng.standard_normal((num_relations, num_nodes if featureless else d_in, d_out))
  ct = rng.standard_normal((num_nodes, d_out))
  return edges, num_nodes, x, w, ct


def as_numpy(edges):
  return [np.asarray(a) for a in edges]


def test_norm_is_per_relation_mean():
  rng = np.random.default_rng(3)
  src, dst, etype = random_graph(rng, 8, 100, 3)
  got = rgcn_ref.mean_norm(dst, etype, 8, 3)
  np.testing.assert_allclose(got, loop_norm(dst, etype), rtol=1e-6)
  # Summing norm over the edges of one (dst, relation) pair gives one.
  sums = {}
  for d, r, c in zip(dst, etype, got):
    sums[d, r] = sums.get((d, r), 0.0) + c
  np.testing.assert_allclose(list(sums.values()), 1.0, rtol=1e-6)


def test_edges_sorted_by_relation():
  rng = np.random.default_rng(4)
  src, dst, etype = random_graph(rng, 10, 60, 6)
  edges = rgcn_ref.EdgeArrays.build(src, dst, etype, num_nodes=10, num_relations=6)
  e = np.asarray(edges.etype)
  assert np.all(e[1:] >= e[:-1])
  # The same multiset of edges, each with its norm.
  want = sorted(zip(src, dst, etype, loop_norm(dst, etype)))
  got = sorted(zip(*as_numpy(edges)))
  np.testing.assert_allclose(np.array(got, float), np.array(want, float), rtol=1e-6)


@pytest.mark.parametrize(
  "bad",
  [
    dict(src=[0, 10], dst=[1, 2], etype=[0, 0]),  # src out of range
    dict(src=[0, 1], dst=[1, -1], etype=[0, 0]),  # dst negative
    dict(src=[0, 1], dst=[1, 2], etype=[0, 3]),  # relation out of range
    dict(src=[0, 1], dst=[1], etype=[0, 0]),  # lengths differ
  ],
)
def test_build_rejects_bad_edges(bad):
  with pytest.raises(ValueError):
    rgcn_ref.EdgeArrays.build(**bad, num_nodes=10, num_relations=3)


@pytest.mark.parametrize("graph", list(GRAPHS))
@pytest.mark.parametrize("name", list(rgcn_ref.PLAIN_JAX))
def test_formulation_matches_loop(name, graph):
  edges, n, x, w, ct = build(graph)
  fn = jax.jit(rgcn_ref.PLAIN_JAX[name], static_argnums=4)
  got = fn(*edges, n, jnp.asarray(x), jnp.asarray(w))
  assert got.shape == (n, w.shape[-1]) and got.dtype == jnp.float64
  np.testing.assert_allclose(got, loop_message(*as_numpy(edges), n, x, w), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("graph", list(GRAPHS))
@pytest.mark.parametrize("name", list(rgcn_ref.PLAIN_JAX))
def test_gradients_match_loop(name, graph):
  edges, n, x, w, ct = build(graph, seed=1)
  fn = rgcn_ref.PLAIN_JAX[name]
  loss = lambda x, w: jnp.vdot(fn(*edges, n, x, w), ct)  # noqa: E731
  dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(jnp.asarray(x), jnp.asarray(w))
  want_dx, want_dw = loop_grads(*as_numpy(edges), x, w, ct)
  np.testing.assert_allclose(dx, want_dx, rtol=1e-10, atol=1e-12)
  np.testing.assert_allclose(dw, want_dw, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
  "graph", ["three relations", "empty relations", "isolated targets", "no edges"]
)
@pytest.mark.parametrize(
  "fn",
  [rgcn_ref.featureless, rgcn_ref.transform_all_then_gather],
  ids=["featureless", "transform-all-then-gather"],
)
def test_featureless_matches_loop(fn, graph):
  edges, n, _, w, ct = build(graph, seed=2, featureless=True)
  got = jax.jit(fn, static_argnums=4)(*edges, n, None, jnp.asarray(w))
  np.testing.assert_allclose(
    got, loop_message(*as_numpy(edges), n, None, w), rtol=1e-10, atol=1e-12
  )
  dw = jax.grad(lambda w: jnp.vdot(fn(*edges, n, None, w), ct))(jnp.asarray(w))
  np.testing.assert_allclose(
    dw, loop_grads(*as_numpy(edges), None, w, ct)[1], rtol=1e-10, atol=1e-12
  )


def test_featureless_is_the_identity_feature_layer():
  """x = one-hot node ids through any formulation equals the featureless layer."""
  edges, n, _, w, _ = build("empty relations", seed=5, featureless=True)
  want = rgcn_ref.featureless(*edges, n, None, jnp.asarray(w))
  for fn in rgcn_ref.PLAIN_JAX.values():
    np.testing.assert_allclose(
      fn(*edges, n, jnp.eye(n), jnp.asarray(w)), want, rtol=1e-10, atol=1e-12
    )


@pytest.mark.parametrize("fn", [rgcn_ref.ragged_dot, rgcn_ref.per_edge_weights])
def test_needs_features(fn):
  edges, n, _, w, _ = build("three relations", featureless=True)
  with pytest.raises(ValueError, match="featureless"):
    fn(*edges, n, None, jnp.asarray(w))
  with pytest.raises(ValueError, match="x=None"):
    rgcn_ref.featureless(*edges, n, jnp.ones((n, 2)), jnp.asarray(w))


def test_full_layer_adds_self_loop_and_bias():
  edges, n, x, w, _ = build("three relations", seed=6)
  rng = np.random.default_rng(6)
  w_self, bias = rng.standard_normal((x.shape[1], w.shape[2])), rng.standard_normal(w.shape[2])
  got = rgcn_ref.full_layer(
    rgcn_ref.ragged_dot,
    *edges,
    n,
    jnp.asarray(x),
    jnp.asarray(w),
    jnp.asarray(w_self),
    jnp.asarray(bias),
  )
  want = loop_message(*as_numpy(edges), n, x, w) + x @ w_self + bias
  np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", list(rgcn_ref.PLAIN_JAX))
def test_float32_step_compiles_with_memory_analysis(name):
  """The benchmark's path: a Formulation, compiled ahead of time, timed once."""
  edges, n, x, w, ct = build("empty relations", seed=7)
  edges = edges._replace(norm=edges.norm.astype(jnp.float32))
  f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
  form = peers.plain_jax(name, edges, n, precision=jax.lax.Precision.HIGHEST)
  compiled = peers.compile_step(form, f32(x), f32(w), f32(ct))
  assert compiled.bytes is None or compiled.bytes > 0
  (loss, (dx, dw)) = compiled.run()
  want_dx, want_dw = loop_grads(*as_numpy(edges), x, w, ct)
  np.testing.assert_allclose(dx, want_dx, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(dw, want_dw, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(loss, np.vdot(loop_message(*as_numpy(edges), n, x, w), ct), rtol=1e-4)
  timing = peers.time_jax(compiled, repeats=1, warmup=0)
  assert timing.seconds > 0


# ------------------------------------------------------------------------------------------------
# The benchmark around them (examples/benchmarks/rgnn.py), on tiny inputs


def test_fallback_synthetic_graph_is_heavy_tailed():
  from benchmarks import rgnn

  src, dst, etype = rgnn.synthetic_graph(5_000, 100_000, 200, seed=1)
  assert src.shape == dst.shape == etype.shape == (100_000,)
  assert src.max() < 5_000 and dst.max() < 5_000 and etype.max() < 200
  sizes = np.bincount(etype, minlength=200)
  assert sizes.min() >= 1  # every relation has an edge
  assert sizes.max() > 20 * np.median(sizes)  # a few relations dominate
  indeg = np.bincount(dst, minlength=5_000)
  assert indeg.max() > 20 * max(np.median(indeg), 1)  # hubs


def test_missing_archive_is_a_note(tmp_path):
  from benchmarks import rgnn

  graph, why = rgnn.load_graph("aifb", data_dir=str(tmp_path), quick=True)
  assert graph is None and "aifb.tgz is missing" in why


def test_run_reports_oom_instead_of_crashing(monkeypatch):
  from benchmarks import rgnn

  monkeypatch.setattr(
    rgnn, "QUICK_SYNTHETIC", dict(num_nodes=300, num_edges=2_000, num_relations=20)
  )
  with jax.default_device(jax.devices("cpu")[0]):
    free = rgnn.available_bytes(jax.devices("cpu")[0])
    monkeypatch.setattr(rgnn, "available_bytes", lambda device: 1 << 20)  # 1 MiB "free"
    results, notes, graphs = rgnn.run(
      ["synthetic"],
      [8],
      quick=True,
      repeats=1,
      formulations=["transform-all-then-gather", "ragged_dot", "per-edge weights"],
    )
  assert free > 1 << 20
  by_name = {r.formulation: r for r in results}
  assert by_name["ragged_dot"].status.startswith("OOM (est.")  # [R, E, d] > 1 MiB
  assert by_name["transform-all-then-gather"].ok and by_name["transform-all-then-gather"].seconds
  assert any("ragged_dot: not run" in n for n in notes)
  header, rows = rgnn.table_rows(results)
  assert header[:4] == ["graph", "dim", "formulation", "fwd+bwd ms"]
  text = rgnn.markdown(results, notes, graphs, "jaxdata bench rgnn --quick")
  assert "Command: `jaxdata bench rgnn --quick`" in text and "ragged_dot: not run" in text
