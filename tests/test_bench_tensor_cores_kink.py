"""`jaxdata bench tensor-cores`'s float32-exact check for RGAT at the leaky ReLU's kink (CPU).

The float64 scores and the kink edges against a per-edge NumPy computation written here (W[r]
applied to each edge's rows, the attention vectors not folded into W); then a graph built so
that one edge's score is exactly 0 in float64 and in float32, where hector (slope 0.2 at 0) and
JAX's leaky ReLU (slope 1 at 0) take different slopes: the bench's check leaves out that edge's
two end nodes and says so, and still fails when another node's dx is off by 1e-3.
"""

import numpy as np
import pytest

from benchmarks import rgnn
from benchmarks import rgnn_attention as ra
from benchmarks import tensor_cores as tc
from jaxdata.data import HeteroGraph
from jaxdata.reference import attention as attention_ref

HEADS, HEAD_FEATURES = 2, 4
DIM = HEADS * HEAD_FEATURES


def _scores_per_edge(src, dst, etype, x, p):
  """z[e, h] = a_src[r, h] . (x[src] W[r])[h] + a_dst[r, h] . (x[dst] W[r])[h], edge by edge in
  float64, the messages formed before the attention vectors are applied."""
  x, w = np.asarray(x, np.float64), np.asarray(p.w, np.float64)
  a_src, a_dst = np.asarray(p.a_src, np.float64), np.asarray(p.a_dst, np.float64)
  z = np.zeros((len(src), HEADS))
  for e, (s, d, r) in enumerate(zip(src, dst, etype)):
    hs = (x[s] @ w[r]).reshape(HEADS, -1)
    hd = (x[d] @ w[r]).reshape(HEADS, -1)
    z[e] = (hs * a_src[r]).sum(-1) + (hd * a_dst[r]).sum(-1)
  return z


def _random_params(rng, relations, dtype=np.float32):
  return attention_ref.RGATParams(
    rng.standard_normal((relations, DIM, DIM)).astype(dtype) / 3,
    rng.standard_normal((relations, HEADS, HEAD_FEATURES)).astype(dtype),
    rng.standard_normal((relations, HEADS, HEAD_FEATURES)).astype(dtype),
  )


def _dyadic(rng, shape, denominator):
  """Small multiples of 1 / denominator: every product and sum of them below is exact in float32."""
  return (rng.integers(-4, 5, shape) / denominator).astype(np.float32)


def test_kink_edges_and_their_ends_match_a_per_edge_numpy_computation():
  rng = np.random.default_rng(3)
  n, e, r = 50, 400, 5
  src, dst, etype = rng.integers(0, n, e), rng.integers(0, n, e), rng.integers(0, r, e)  # unsorted
  x = rng.standard_normal((n, DIM)).astype(np.float32)
  p = _random_params(rng, r)
  # relation 0's destination vector is minus its source vector and nodes 0 and 1 have the same
  # features: relation-0 edges among {0, 1} score exactly 0 (z64 = 0)
  p = p._replace(a_dst=p.a_dst.copy())
  p.a_dst[0] = -p.a_src[0]
  x[1] = x[0]
  exact_zero = [7, 8, 9]
  src[exact_zero], dst[exact_zero], etype[exact_zero] = [0, 1, 1], [1, 0, 1], [0, 0, 0]
  loose = np.isin(src, [0, 1]) & np.isin(dst, [0, 1]) & (etype == 0)
  assert sorted(np.flatnonzero(loose)) == exact_zero

  want = _scores_per_edge(src, dst, etype, x, p)
  z = attention_ref.rgat_scores_float64(src, dst, etype, x, p)
  assert z.dtype == np.float64 and z.shape == (e, HEADS)
  np.testing.assert_allclose(z, want, rtol=1e-12, atol=1e-12 * np.abs(want).max())

  top = np.abs(want).max()
  for tol in (tc.KINK, 0.01, 0.1):
    kink = tc.rgat_kink(src, dst, etype, x, p, tol)
    edges = [i for i in range(e) if min(abs(want[i, 0]), abs(want[i, 1])) <= tol * top]
    assert set(exact_zero) <= set(edges)
    if tol > tc.KINK:
      assert len(edges) > len(exact_zero) + 5  # the looser bars select random edges too
    assert kink.edges.tolist() == edges, tol
    assert kink.nodes.tolist() == sorted({int(v) for i in edges for v in (src[i], dst[i])})
    assert kink.seconds >= 0


def test_kink_edges_rejects_what_is_not_edges_by_heads():
  with pytest.raises(ValueError, match=r"kink_edges: scores must be \[E, H\]"):
    tc.kink_edges(np.zeros(5))
  with pytest.raises(ValueError, match="rgat_scores_float64: etype must be in"):
    p = _random_params(np.random.default_rng(0), 2)
    attention_ref.rgat_scores_float64([0], [1], [2], np.zeros((3, DIM)), p)


def _case_with_an_edge_at_the_kink(seed=0):
  """(case, (x, params, ct), the kink edge's (src, dst)): a random graph plus the edge 0 -> 1 of
  relation 0, whose score is exactly 0 in any arithmetic (dyadic x rows, W[0] and a[0];
  a_dst[0] = -a_src[0]; x[0] = x[1]), no other relation-0 edge that would score 0 (self-loops),
  and a few more in-edges of node 1 so that its softmax
  gives that score a gradient."""
  rng = np.random.default_rng(seed)
  n, e, r = 60, 500, 4
  src, dst, etype = rng.integers(0, n, e), rng.integers(0, n, e), rng.integers(0, r, e)
  # relation 0's self-loops, and its edges among {0, 1}, would score 0 too
  drop = ((np.isin(src, [0, 1]) & np.isin(dst, [0, 1])) | (src == dst)) & (etype == 0)
  src, dst, etype = src[~drop], dst[~drop], etype[~drop]
  more = rng.integers(2, n, 6)
  src = np.concatenate([src, [0], more])
  dst = np.concatenate([dst, [1], np.ones(6, np.int64)])
  etype = np.concatenate([etype, [0], rng.integers(0, r, 6)])
  g = HeteroGraph.from_edges(
    src, dst, etype, num_nodes=n, relation_names=[f"r{i}" for i in range(r)]
  )
  case = ra.Case(rgnn.Graph.from_hetero("kink", g, "test_bench_tensor_cores_kink"))
  x = rng.standard_normal((n, DIM)).astype(np.float32)
  x[0] = x[1] = _dyadic(rng, DIM, 2)
  p = _random_params(rng, r)
  p.w[0] = _dyadic(rng, (DIM, DIM), 8)
  p.a_src[0] = _dyadic(rng, (HEADS, HEAD_FEATURES), 4)
  p.a_dst[0] = -p.a_src[0]
  ct = rng.standard_normal((n, DIM)).astype(np.float32)
  return case, (x, p, ct), (0, 1)


def test_rgat_verdict_leaves_out_the_ends_of_an_edge_at_the_kink(monkeypatch):
  case, arrays, (u, v) = _case_with_an_edge_at_the_kink()
  monkeypatch.setattr(ra, "case_arrays", lambda *args, **kwargs: arrays)
  plain = tc.Row("transform-all-then-gather", "float32", "default")
  monkeypatch.setattr(tc, "rows", lambda *args: (tc.BASELINE, plain))
  seen = []
  check = tc.check_exact

  def keep(*args, **kwargs):
    seen.append(args)
    return check(*args, **kwargs)

  monkeypatch.setattr(tc, "check_exact", keep)
  notes = []
  measured = tc.measure_case("rgat", case, DIM, heads=HEADS, repeats=1, notes=notes)
  assert not notes, notes

  g = case.graph
  kink = measured.exact.kink
  at = np.flatnonzero((g.src == u) & (g.dst == v) & (g.etype == 0))
  assert kink.edges.tolist() == at.tolist() and kink.nodes.tolist() == [u, v]
  verdict = tc.bars(measured, measured.row(tc.BASELINE))
  assert verdict.startswith("float32-exact: met (dx vs transform-all-then-gather at highest: "), (
    verdict
  )
  assert "leaving out the 2 end nodes of 1 edge at the leaky ReLU's kink)" in verdict

  # the two float32 computations do disagree at the kink, and only there
  ((dx, ref, name, _),) = seen
  dx, ref = np.asarray(dx, np.float64), np.asarray(ref, np.float64)
  top = np.abs(ref).max()
  err = np.abs(dx - ref).max(axis=1) / top
  assert err[[u, v]].min() > 1e-3, err[[u, v]]
  others = np.ones(g.num_nodes, bool)
  others[[u, v]] = False
  assert err[others].max() <= tc.EXACT
  everywhere = tc.check_exact(dx, ref, name)
  assert not everywhere.met and everywhere.compared == g.num_nodes
  assert everywhere.verdict().startswith("float32-exact: not met (")
  assert "kink" not in everywhere.verdict()
  assert measured.exact.compared == g.num_nodes - 2
  assert measured.exact.error == pytest.approx(
    err[others].max() * top / np.abs(ref[others]).max(), rel=1e-3, abs=1e-9
  )

  # a node away from the kink off by 1e-3 of max |dx_1|: not met, whatever was left out
  away = int(np.flatnonzero(others)[np.argmax(np.abs(ref[others]).max(axis=1))])
  off = dx.copy()
  off[away, 0] += 1e-3 * np.abs(ref[others]).max()
  wrong = tc.check_exact(off, ref, name, kink)
  assert not wrong.met and wrong.error == pytest.approx(1e-3, rel=0.05)
  assert wrong.verdict().startswith("float32-exact: not met (dx vs transform-all-then-gather")
  assert "leaving out the 2 end nodes of 1 edge at the leaky ReLU's kink" in wrong.verdict()


def test_verdict_without_kink_edges_and_for_rgcn():
  dx = np.ones((4, 2))
  none = tc.Kink(np.zeros(0, np.int64), np.zeros(0, np.int64))
  assert tc.check_exact(dx, dx, "ragged_dot", none).verdict() == (
    "float32-exact: met (dx vs ragged_dot at highest: 0.0e+00, no edge at the leaky ReLU's kink)"
  )
  assert tc.check_exact(dx, dx, "ragged_dot").verdict() == (
    "float32-exact: met (dx vs ragged_dot at highest: 0.0e+00)"
  )
  every = tc.Kink(np.arange(2), np.arange(4))
  out = tc.check_exact(dx, dx, "ragged_dot", every)
  assert not out.met and out.verdict().startswith("float32-exact: not checked (every node")
