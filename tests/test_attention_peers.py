"""The plain-JAX RGAT and HGT layers (jaxdata/bench/attention_peers.py) and the ogbn-mag-like
generator (jaxdata/data/mag.py).

Every formulation is checked against a loop over nodes written from the semantics in the
module's docstring (NumPy for values; the same loop in jax.numpy, differentiated by jax.grad, for
gradients), against finite differences, and against PyTorch Geometric's RGATConv and HGTConv
holding the same weights (skipped where torch or torch_geometric is missing). Float64 throughout
except where dtypes are the point.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdata.bench import attention_peers as peers
from jaxdata.bench import rgnn_peers
from jaxdata.data import HeteroGraph, mag

TOL = dict(rtol=1e-9, atol=1e-11)


@pytest.fixture(autouse=True)
def on_cpu():
  """CPU tests: on a GPU machine JAX would default to the GPU (and TF32 matmuls)."""
  with jax.default_device(jax.devices("cpu")[0]):
    yield


@pytest.fixture
def torch():
  """torch with torch_geometric, or the test is skipped (the oracle extra)."""
  module = pytest.importorskip("torch")
  pytest.importorskip("torch_geometric")
  return module


def tree_allclose(got, want, **tol):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64), **tol)


# ------------------------------------------------------------------------------------------------
# Graphs


def random_edges(rng, num_nodes, num_edges, num_relations, *, used_relations=None,
                 dst_nodes=None, src_nodes=None):
  """Random edges plus a few self loops and repeated edges; only `dst_nodes` get in-edges."""
  used = np.arange(num_relations) if used_relations is None else np.asarray(used_relations)
  targets = np.arange(num_nodes) if dst_nodes is None else np.asarray(dst_nodes)
  sources = np.arange(num_nodes) if src_nodes is None else np.asarray(src_nodes)
  if num_edges == 0:
    return (np.zeros(0, np.int64),) * 3
  src, dst = rng.choice(sources, num_edges), rng.choice(targets, num_edges)
  etype = rng.choice(used, num_edges)
  loops = rng.choice(targets, 3)
  src = np.concatenate([src, loops, src[:4]])  # self loops, then repeats of the first edges
  dst = np.concatenate([dst, loops, dst[:4]])
  etype = np.concatenate([etype, rng.choice(used, 3), etype[:4]])
  return src, dst, etype


RGAT_GRAPHS = {
    # name: (num_nodes, num_edges, num_relations, used relations, nodes with in-edges)
    "three relations": (10, 30, 3, None, [0, 1, 2, 3, 4, 5, 6, 7]),  # 8, 9: no in-edges
    "empty relations": (12, 40, 5, [0, 3, 4], None),
    "isolated targets": (15, 25, 2, None, [2, 7, 11]),
    "no edges": (5, 0, 2, None, None),
    "tiny": (6, 8, 2, None, [0, 1, 2, 3, 4]),  # small enough to differentiate the loop
}


def rgat_case(graph, seed=0, d_in=5, d=3, heads=2, dtype=np.float64):
  num_nodes, num_edges, num_relations, used, targets = RGAT_GRAPHS[graph]
  rng = np.random.default_rng(seed)
  src, dst, etype = random_edges(rng, num_nodes, num_edges, num_relations, used_relations=used,
                                 dst_nodes=targets)
  edges = peers.Edges.build(src, dst, etype, num_nodes=num_nodes, num_relations=num_relations)
  x = rng.standard_normal((num_nodes, d_in))
  params = peers.RGATParams(rng.standard_normal((num_relations, d_in, heads * d)),
                            rng.standard_normal((num_relations, heads, d)),
                            rng.standard_normal((num_relations, heads, d)))
  ct = rng.standard_normal((num_nodes, heads * d))
  cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
  return edges, cast(x), jax.tree.map(cast, params), cast(ct)


def typed_graph(seed=0, sizes=(6, 4, 3), widths=(5, 4, 6), num_edges=40):
  """Three node types and four relations (r -> (src type, dst type)); type 2 gets no in-edges
  from relation 3 only, and one node of each destination type gets none at all."""
  rng = np.random.default_rng(seed)
  offsets = np.cumsum([0, *sizes])
  relations = [(0, 0), (1, 0), (0, 1), (2, 1)]  # (src type, dst type)
  src, dst, etype = [], [], []
  for r, (s, t) in enumerate(relations):
    ids = lambda k, n: offsets[k] + rng.integers(0, sizes[k] - (k == t), n)  # noqa: E731
    s_ids, d_ids = ids(s, num_edges // 4), ids(t, num_edges // 4)
    if s == t:  # self loops and a repeated edge
      s_ids[:2] = d_ids[:2]
    s_ids[-1], d_ids[-1] = s_ids[0], d_ids[0]
    src.append(s_ids), dst.append(d_ids), etype.append(np.full(len(s_ids), r))
  src, dst, etype = (np.concatenate(a) for a in (src, dst, etype))
  xs = [rng.standard_normal((n, w)) for n, w in zip(sizes, widths)]
  return src, dst, etype, xs, len(relations)


def random_hgt_params(rng, widths, num_relations, heads, d, d_out):
  f = heads * d
  per_type = lambda *shape: tuple(rng.standard_normal(s) * 0.5 for s in shape)  # noqa: E731
  return peers.HGTParams(
      k_w=per_type(*[(w, f) for w in widths]), k_b=per_type(*[(f,)] * len(widths)),
      q_w=per_type(*[(w, f) for w in widths]), q_b=per_type(*[(f,)] * len(widths)),
      v_w=per_type(*[(w, f) for w in widths]), v_b=per_type(*[(f,)] * len(widths)),
      a_w=per_type(*[(f, d_out)] * len(widths)), a_b=per_type(*[(d_out,)] * len(widths)),
      w_att=rng.standard_normal((num_relations, heads, d, d)) * 0.5,
      w_msg=rng.standard_normal((num_relations, heads, d, d)) * 0.5,
      mu=rng.uniform(0.5, 1.5, (num_relations, heads)), skip=rng.standard_normal(len(widths)))


def hgt_case(seed=0, heads=2, d=3, d_out=4, dtype=np.float64, **graph):
  """d_out = 4 = the width of type 1, so type 1 goes through the skip gate."""
  src, dst, etype, xs, num_relations = typed_graph(seed, **graph)
  rng = np.random.default_rng(seed + 100)
  params = random_hgt_params(rng, [x.shape[1] for x in xs], num_relations, heads, d, d_out)
  edges = peers.Edges.build(src, dst, etype, num_nodes=sum(len(x) for x in xs),
                            num_relations=num_relations)
  cts = [rng.standard_normal((len(x), d_out)) for x in xs]
  cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
  return edges, jax.tree.map(cast, xs), jax.tree.map(cast, params), jax.tree.map(cast, cts)


# ------------------------------------------------------------------------------------------------
# Loop references: node by node, head by head, edge by edge, in NumPy (xp=np) or jax.numpy


def softmax(scores, xp):
  scores = xp.stack(scores)
  weights = xp.exp(scores - xp.max(scores))
  return weights / xp.sum(weights)


def loop_rgat(src, dst, etype, x, params, xp=np):
  w, a_src, a_dst = params
  heads, d = a_src.shape[1:]
  rows = []
  for i in range(x.shape[0]):
    into = [e for e in range(len(dst)) if dst[e] == i]
    if not into:
      rows.append(xp.zeros(heads * d))
      continue
    per_head = []
    for h in range(heads):
      scores, messages = [], []
      for e in into:
        r = etype[e]
        h_src = (x[src[e]] @ w[r])[h * d:(h + 1) * d]
        h_dst = (x[i] @ w[r])[h * d:(h + 1) * d]
        s = a_src[r, h] @ h_src + a_dst[r, h] @ h_dst
        scores.append(xp.where(s > 0, s, 0.2 * s))
        messages.append(h_src)
      alpha = softmax(scores, xp)
      per_head.append(sum(alpha[k] * messages[k] for k in range(len(into))))
    rows.append(xp.concatenate(per_head))
  return xp.stack(rows)


def gelu(v, xp):
  erf = jax.scipy.special.erf if xp is jnp else np.vectorize(math.erf)
  return 0.5 * v * (1 + erf(v / math.sqrt(2)))


def loop_hgt(src, dst, etype, xs, p, xp=np):
  offsets = np.cumsum([0] + [len(x) for x in xs])
  heads, d = p.mu.shape[1], p.w_att.shape[-1]

  def node(v, ws, bs):  # a linear map of node v's features, by its type, as [H, d]
    t = int(np.searchsorted(offsets, v, side="right")) - 1
    return (xs[t][v - offsets[t]] @ ws[t] + bs[t]).reshape(heads, d)

  outs = []
  for t, x in enumerate(xs):
    rows = []
    for i in range(offsets[t], offsets[t + 1]):
      into = [e for e in range(len(dst)) if dst[e] == i]
      agg = []
      for h in range(heads):
        if not into:
          agg.append(xp.zeros(d))
          continue
        scores, messages = [], []
        for e in into:
          r, j = etype[e], src[e]
          k = node(j, p.k_w, p.k_b)[h] @ p.w_att[r, h]
          q = node(i, p.q_w, p.q_b)[h]
          scores.append(k @ q * p.mu[r, h] / math.sqrt(d))
          messages.append(node(j, p.v_w, p.v_b)[h] @ p.w_msg[r, h])
        alpha = softmax(scores, xp)
        agg.append(sum(alpha[k] * messages[k] for k in range(len(into))))
      y = gelu(xp.concatenate(agg), xp) @ p.a_w[t] + p.a_b[t]
      if y.shape[-1] == x.shape[-1]:
        gate = 1 / (1 + xp.exp(-p.skip[t]))
        y = gate * y + (1 - gate) * x[i - offsets[t]]
      rows.append(y)
    outs.append(xp.stack(rows))
  return outs


def as_numpy(tree):
  return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


def numpy_edges(edges):
  return [np.asarray(a) for a in edges]


# ------------------------------------------------------------------------------------------------
# Edge softmax


def test_edge_softmax_sums_to_one_and_survives_large_scores():
  rng = np.random.default_rng(0)
  dst = jnp.asarray(rng.integers(0, 6, 40))
  scores = jnp.asarray(rng.standard_normal((40, 3)) * 50 + 1000)  # exp(1000) overflows
  alpha = peers.edge_softmax(scores, dst, 8)
  assert np.all(np.isfinite(alpha)) and np.all(alpha >= 0)
  sums = jax.ops.segment_sum(alpha, dst, num_segments=8)
  want = np.where(np.bincount(np.asarray(dst), minlength=8) > 0, 1.0, 0.0)[:, None]
  np.testing.assert_allclose(sums, np.broadcast_to(want, sums.shape), rtol=1e-12, atol=1e-12)
  bf16 = peers.edge_softmax(scores.astype(jnp.bfloat16), dst, 8)
  assert bf16.dtype == jnp.float32  # the softmax runs in float32 for bfloat16 scores


def test_edges_build_sorts_and_checks():
  edges = peers.Edges.build([0, 1, 2], [1, 2, 0], [2, 0, 1], num_nodes=3, num_relations=3)
  np.testing.assert_array_equal(edges.etype, [0, 1, 2])
  np.testing.assert_array_equal(edges.src, [1, 2, 0])
  with pytest.raises(ValueError, match="num_nodes"):
    peers.Edges.build([0, 3], [1, 2], [0, 0], num_nodes=3, num_relations=1)
  with pytest.raises(ValueError, match="num_relations"):
    peers.Edges.build([0, 1], [1, 2], [0, 1], num_nodes=3, num_relations=1)


# ------------------------------------------------------------------------------------------------
# RGAT against the loop


@pytest.mark.parametrize("graph", list(RGAT_GRAPHS))
@pytest.mark.parametrize("name", list(peers.RGAT))
def test_rgat_matches_loop(name, graph):
  edges, x, params, _ = rgat_case(graph)
  got = jax.jit(peers.RGAT[name])(*edges, x, params)
  assert got.shape == (x.shape[0], params.w.shape[-1]) and got.dtype == jnp.float64
  want = loop_rgat(*numpy_edges(edges), as_numpy(x), as_numpy(params))
  np.testing.assert_allclose(got, want, **TOL)


def rgat_loss(fn, edges, ct):
  return lambda x, params: jnp.vdot(fn(*edges, x, params), ct)


_RGAT_LOOP_GRADS = {}


def rgat_loop_grads(graph):
  """jax.grad of the jax.numpy loop (computed once per graph)."""
  if graph not in _RGAT_LOOP_GRADS:
    edges, x, params, ct = rgat_case(graph, seed=1)
    loop = lambda *g, x, p: loop_rgat(*g, x, p, xp=jnp)  # noqa: E731
    loss = lambda x, p: jnp.vdot(loop(*numpy_edges(edges), x=x, p=p), ct)  # noqa: E731
    _RGAT_LOOP_GRADS[graph] = jax.grad(loss, argnums=(0, 1))(x, params)
  return _RGAT_LOOP_GRADS[graph]


@pytest.mark.parametrize("graph", ["tiny", "no edges"])
@pytest.mark.parametrize("name", list(peers.RGAT))
def test_rgat_gradients_match_loop(name, graph):
  edges, x, params, ct = rgat_case(graph, seed=1)
  got = jax.jit(jax.grad(rgat_loss(peers.RGAT[name], edges, ct), argnums=(0, 1)))(x, params)
  tree_allclose(got, rgat_loop_grads(graph), **TOL)


@pytest.mark.parametrize("graph", ["three relations", "empty relations", "isolated targets"])
def test_rgat_gradients_agree(graph):
  edges, x, params, ct = rgat_case(graph, seed=1)
  grads = [jax.jit(jax.grad(rgat_loss(fn, edges, ct), argnums=(0, 1)))(x, params)
           for fn in peers.RGAT.values()]
  for other in grads[1:]:
    tree_allclose(other, grads[0], **TOL)


def test_rgat_gradient_matches_finite_differences():
  edges, x, params, ct = rgat_case("three relations", seed=2)
  loss = jax.jit(rgat_loss(peers.rgat_ragged_dot, edges, ct))
  grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, params)
  rng = np.random.default_rng(3)
  direction = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape)), (x, params))
  eps = 1e-6
  shifted = lambda s: loss(*jax.tree.map(lambda a, v: a + s * eps * v,  # noqa: E731
                                         (x, params), direction))
  numeric = (shifted(1) - shifted(-1)) / (2 * eps)
  analytic = sum(jnp.vdot(g, v) for g, v in zip(jax.tree.leaves(grads),
                                                 jax.tree.leaves(direction)))
  np.testing.assert_allclose(analytic, numeric, rtol=1e-6)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 5e-2)])
@pytest.mark.parametrize("name", list(peers.RGAT))
def test_rgat_low_precision(name, dtype, tol):
  edges, x64, params64, ct64 = rgat_case("three relations", seed=4)
  want = peers.RGAT[name](*edges, x64, params64)
  x, params, ct = jax.tree.map(lambda a: a.astype(dtype), (x64, params64, ct64))
  fn = jax.jit(peers.RGAT[name], static_argnames="precision")
  got = fn(*edges, x, params, precision=jax.lax.Precision.HIGHEST)
  assert got.dtype == dtype
  scale = float(jnp.abs(want).max())
  np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=tol * scale, rtol=tol)
  grads = jax.grad(rgat_loss(peers.RGAT[name], edges, ct), argnums=(0, 1))(x, params)
  assert all(g.dtype == dtype for g in jax.tree.leaves(grads))
  assert all(np.isfinite(np.asarray(g, np.float32)).all() for g in jax.tree.leaves(grads))


def test_init_rgat_shapes_and_seed():
  p = peers.init_rgat(0, num_relations=3, in_features=5, head_features=4, heads=2)
  assert p.w.shape == (3, 5, 8) and p.a_src.shape == p.a_dst.shape == (3, 2, 4)
  assert p.w.dtype == jnp.float32 and p.heads == 2
  tree_allclose(p, peers.init_rgat(0, num_relations=3, in_features=5, head_features=4, heads=2),
                rtol=0, atol=0)
  assert not np.allclose(p.w, peers.init_rgat(1, num_relations=3, in_features=5,
                                              head_features=4, heads=2).w)


# ------------------------------------------------------------------------------------------------
# HGT against the loop


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", list(peers.HGT))
def test_hgt_matches_loop(name, seed):
  edges, xs, params, _ = hgt_case(seed)
  got = jax.jit(peers.HGT[name])(*edges, xs, params)
  want = loop_hgt(*numpy_edges(edges), as_numpy(xs), as_numpy(params))
  assert [g.shape for g in got] == [w.shape for w in want]
  tree_allclose(got, want, **TOL)


def test_hgt_loop_reference_sees_skip_and_empty_nodes():
  """The case exercises what it should: the skip gate on type 1 and nodes without in-edges."""
  edges, xs, params, _ = hgt_case(0)
  assert [x.shape[1] for x in xs] == [5, 4, 6] and params.a_w[1].shape[1] == 4
  dst = np.asarray(edges.dst)
  for first, last in ((0, 6), (6, 10), (10, 13)):
    assert not np.isin(np.arange(first, last), dst).all()  # some node of each type has none


_HGT_LOOP_GRADS = {}


@pytest.mark.parametrize("name", list(peers.HGT))
def test_hgt_gradients_match_loop(name):
  edges, xs, params, cts = hgt_case(seed=2, sizes=(4, 3, 2), num_edges=12)
  def loss(fn):
    return lambda xs, p: sum(jnp.vdot(o, c) for o, c in zip(fn(*edges, xs, p), cts))
  got = jax.jit(jax.grad(loss(peers.HGT[name]), argnums=(0, 1)))(xs, params)
  if "want" not in _HGT_LOOP_GRADS:
    loop = lambda *g: loop_hgt(*numpy_edges(edges), *g[3:], xp=jnp)  # noqa: E731
    _HGT_LOOP_GRADS["want"] = jax.grad(loss(loop), argnums=(0, 1))(xs, params)
  tree_allclose(got, _HGT_LOOP_GRADS["want"], **TOL)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 6e-2)])
@pytest.mark.parametrize("name", list(peers.HGT))
def test_hgt_low_precision(name, dtype, tol):
  edges, xs64, params64, _ = hgt_case(seed=3)
  want = peers.HGT[name](*edges, xs64, params64)
  xs, params = jax.tree.map(lambda a: a.astype(dtype), (xs64, params64))
  got = jax.jit(peers.HGT[name], static_argnames="precision")(
      *edges, xs, params, precision=jax.lax.Precision.HIGHEST)
  for g, w in zip(got, want):
    assert g.dtype == dtype
    np.testing.assert_allclose(np.asarray(g, np.float64), w,
                               atol=tol * float(jnp.abs(w).max()), rtol=tol)


def test_hgt_rejects_mismatched_types():
  edges, xs, params, _ = hgt_case()
  with pytest.raises(ValueError, match="node types"):
    peers.hgt_ragged_dot(*edges, xs[:2], params)
  with pytest.raises(ValueError, match="dtype"):
    peers.hgt_ragged_dot(*edges, [xs[0].astype(jnp.float32), *xs[1:]], params)


def test_init_hgt_shapes():
  p = peers.init_hgt(0, in_features=[5, 7], num_relations=3, head_features=4, heads=2,
                     out_features=6)
  assert [w.shape for w in p.k_w] == [(5, 8), (7, 8)] and p.a_w[1].shape == (8, 6)
  assert p.w_att.shape == p.w_msg.shape == (3, 2, 4, 4) and p.mu.shape == (3, 2)
  np.testing.assert_array_equal(p.mu, 1) and np.testing.assert_array_equal(p.skip, 1)
  assert p.heads == 2 and p.head_features == 4


# ------------------------------------------------------------------------------------------------
# The benchmark's adapters (rgnn_peers' Formulation, compiled ahead of time)


@pytest.mark.parametrize("name", list(peers.RGAT))
def test_rgat_formulation_compiles(name):
  edges, x, params, ct = rgat_case("empty relations", seed=5, dtype=np.float32)
  form = peers.rgat_formulation(name, edges, precision=jax.lax.Precision.HIGHEST)
  loss, (dx, dparams) = rgnn_peers.compile_step(form, x, params, ct).run()
  want = loop_rgat(*numpy_edges(edges), as_numpy(x), as_numpy(params))
  np.testing.assert_allclose(loss, np.vdot(want, ct), rtol=1e-4)
  assert dx.shape == x.shape and dparams.w.shape == params.w.shape


@pytest.mark.parametrize("name", list(peers.HGT))
def test_hgt_formulation_compiles(name):
  edges, xs, params, cts = hgt_case(seed=6, dtype=np.float32)
  form = peers.hgt_formulation(name, edges, precision=jax.lax.Precision.HIGHEST)
  loss, (dxs, _) = rgnn_peers.compile_step(form, xs, params, jnp.concatenate(cts)).run()
  want = loop_hgt(*numpy_edges(edges), as_numpy(xs), as_numpy(params))
  np.testing.assert_allclose(loss, sum(np.vdot(w, c) for w, c in zip(want, cts)), rtol=1e-4)
  assert [d.shape for d in dxs] == [x.shape for x in xs]


# ------------------------------------------------------------------------------------------------
# PyTorch Geometric


def pyg_rgat_graph(seed):
  rng = np.random.default_rng(seed)
  src, dst, etype = random_edges(rng, 20, 90, 4, used_relations=[0, 1, 3],
                                 dst_nodes=np.arange(15))  # 15..19: no in-edges
  return rng, src, dst, etype


@pytest.mark.parametrize("heads", [1, 3])
def test_rgat_matches_pyg(torch, heads):
  """PyG's q, k become our attention vectors; with heads > 1 their off-head blocks are zeroed."""
  from torch_geometric.nn import RGATConv
  rng, src, dst, etype = pyg_rgat_graph(heads)
  n, r, d_in, d = 20, 4, 6, 5
  torch.manual_seed(heads)
  conv = RGATConv(d_in, d, num_relations=r, heads=heads, dim=1, concat=True, bias=False,
                  attention_mode="additive-self-attention",
                  attention_mechanism="across-relation").double()
  if heads > 1:
    with pytest.raises(ValueError, match="mixes heads"):
      peers.rgat_params_from_pyg(conv)
    with torch.no_grad():
      mask = torch.zeros(heads * d, heads, dtype=torch.float64)
      for h in range(heads):
        mask[h * d:(h + 1) * d, h] = 1
      conv.q.mul_(mask), conv.k.mul_(mask)
  params = jax.tree.map(jnp.asarray, peers.rgat_params_from_pyg(conv))
  x, ct = rng.standard_normal((n, d_in)), rng.standard_normal((n, heads * d))

  xt = torch.from_numpy(x).requires_grad_(True)
  edge_index, edge_type = rgnn_peers.pyg_graph(src, dst, etype, torch.device("cpu"))
  want = conv(xt, edge_index, edge_type)
  (want * torch.from_numpy(ct)).sum().backward()

  edges = peers.Edges.build(src, dst, etype, num_nodes=n, num_relations=r)
  for name, fn in peers.RGAT.items():
    got = fn(*edges, jnp.asarray(x), params)
    np.testing.assert_allclose(got, want.detach().numpy(), **TOL, err_msg=name)
    dx, dparams = jax.grad(rgat_loss(fn, edges, jnp.asarray(ct)), argnums=(0, 1))(
        jnp.asarray(x), params)
    np.testing.assert_allclose(dx, xt.grad.numpy(), **TOL, err_msg=name)
    np.testing.assert_allclose(dparams.w, conv.weight.grad.numpy(), **TOL, err_msg=name)


def test_pyg_rgat_conv_holds_our_weights(torch):
  rng, src, dst, etype = pyg_rgat_graph(7)
  n, r, heads = 20, 4, 2
  p = peers.init_rgat(3, num_relations=r, in_features=6, head_features=5, heads=heads,
                      dtype=jnp.float64)
  with pytest.raises(ValueError, match="differ between relations"):
    peers.pyg_rgat_conv(p, device=torch.device("cpu"), dtype=torch.float64)
  p = p._replace(a_src=jnp.broadcast_to(p.a_src[:1], p.a_src.shape),
                 a_dst=jnp.broadcast_to(p.a_dst[:1], p.a_dst.shape))
  conv = peers.pyg_rgat_conv(p, device=torch.device("cpu"), dtype=torch.float64)
  x = rng.standard_normal((n, 6))
  want = conv(torch.from_numpy(x), *rgnn_peers.pyg_graph(src, dst, etype, torch.device("cpu")))
  edges = peers.Edges.build(src, dst, etype, num_nodes=n, num_relations=r)
  np.testing.assert_allclose(peers.rgat_ragged_dot(*edges, jnp.asarray(x), p),
                             want.detach().numpy(), **TOL)


def mag_case(torch, seed=0, heads=3, d=16, shuffle_metadata=False):
  """Tiny synthetic-mag, a randomly initialised HGTConv (random priors, skips and biases)."""
  from torch_geometric.nn import HGTConv
  ds = mag.synthetic_mag(scale=2e-4, seed=seed, num_classes=5)
  types, relations = ds.graph.node_type_names, list(ds.relation_types)
  metadata = list(relations)
  if shuffle_metadata:
    metadata = [metadata[i] for i in np.random.default_rng(seed).permutation(len(metadata))]
  torch.manual_seed(seed)
  in_channels = {t: x.shape[1] for t, x in zip(types, ds.features)}
  conv = HGTConv(in_channels, heads * d, (list(types), metadata), heads=heads).double()
  with torch.no_grad():
    for param in [*conv.p_rel.values(), *conv.skip.values()]:
      param.uniform_(-1.5, 1.5)
    for lin in [*conv.kqv_lin.lins.values(), *conv.out_lin.lins.values()]:
      lin.bias.uniform_(-0.5, 0.5)
  return ds, types, relations, metadata, conv


def pyg_hgt_reference(torch, conv, ds, types, relations, metadata, cts):
  xts = [torch.from_numpy(x.astype(np.float64)).requires_grad_(True) for x in ds.features]
  g = ds.graph
  x_dict, edge_index_dict = peers.pyg_hetero_inputs(g.src, g.dst, g.etype, xts, types, relations,
                                                    device=torch.device("cpu"))
  # HGTConv's k_rel assumes edge_index_dict iterates in metadata order (is_sorted=True).
  edge_index_dict = {rel: edge_index_dict[rel] for rel in metadata}
  out = conv(x_dict, edge_index_dict)
  sum((out[t] * torch.from_numpy(c)).sum() for t, c in zip(types, cts)).backward()
  return [out[t].detach().numpy() for t in types], [x.grad.numpy() for x in xts]


@pytest.mark.parametrize("shuffle_metadata", [False, True], ids=["ours", "shuffled"])
def test_hgt_matches_pyg(torch, shuffle_metadata):
  """On tiny synthetic-mag; out_channels 48 = the fields' width, so fields pass the skip gate."""
  ds, types, relations, metadata, conv = mag_case(torch, shuffle_metadata=shuffle_metadata)
  assert ds.features[types.index("field_of_study")].shape[1] == 48
  rng = np.random.default_rng(0)
  cts = [rng.standard_normal((len(x), 48)) for x in ds.features]
  want, want_dxs = pyg_hgt_reference(torch, conv, ds, types, relations, metadata, cts)

  params = jax.tree.map(jnp.asarray, peers.hgt_params_from_pyg(conv, types, relations))
  edges = peers.Edges.from_graph(ds.graph)
  xs = [jnp.asarray(x, jnp.float64) for x in ds.features]
  cts = [jnp.asarray(c) for c in cts]
  for name, fn in peers.HGT.items():
    loss = lambda xs, p: sum(jnp.vdot(o, c) for o, c in zip(fn(*edges, xs, p), cts))  # noqa
    (got, dxs) = (jax.jit(fn)(*edges, xs, params), jax.grad(loss)(xs, params))
    for t, g, w, dx, want_dx in zip(types, got, want, dxs, want_dxs):
      np.testing.assert_allclose(g, w, **TOL, err_msg=f"{name} {t}")
      np.testing.assert_allclose(dx, want_dx, **TOL, err_msg=f"{name} d{t}")


def test_pyg_hgt_conv_holds_our_weights(torch):
  ds = mag.synthetic_mag(scale=1e-4, seed=1, num_classes=3)
  types, relations = ds.graph.node_type_names, ds.relation_types
  params = random_hgt_params(np.random.default_rng(1), [x.shape[1] for x in ds.features],
                             len(relations), heads=2, d=8, d_out=16)
  conv = peers.pyg_hgt_conv(params, types, relations, device=torch.device("cpu"),
                            dtype=torch.float64)
  xts = [torch.from_numpy(x.astype(np.float64)) for x in ds.features]
  g = ds.graph
  want = conv(*peers.pyg_hetero_inputs(g.src, g.dst, g.etype, xts, types, relations,
                                       device=torch.device("cpu")))
  got = peers.hgt_transform_all_then_gather(
      *peers.Edges.from_graph(g), [jnp.asarray(x, jnp.float64) for x in ds.features],
      jax.tree.map(jnp.asarray, params))
  for t, o in zip(types, got):
    np.testing.assert_allclose(o, want[t].detach().numpy(), **TOL, err_msg=t)
  with pytest.raises(ValueError, match="d_out"):
    peers.pyg_hgt_conv(params._replace(a_w=tuple(w[:, :5] for w in params.a_w)), types,
                       relations)


# ------------------------------------------------------------------------------------------------
# synthetic_mag


def test_mag_sizes_types_and_relations():
  scale = 1e-3
  ds = mag.synthetic_mag(scale=scale, seed=0, num_classes=7)
  g = ds.graph
  assert isinstance(g, HeteroGraph)
  assert g.node_type_names == mag.NODE_TYPES
  counts = [max(1, round(mag.NUM_NODES[t] * scale)) for t in mag.NODE_TYPES]
  np.testing.assert_array_equal(g.node_type_offsets, np.cumsum([0, *counts]))
  assert g.relation_names == ("writes", "cites", "has_topic", "affiliated_with", "rev_writes",
                              "rev_cites", "rev_has_topic", "rev_affiliated_with")
  per_relation = [round(mag.NUM_EDGES[name] * scale) for _, name, _ in mag.RELATIONS]
  np.testing.assert_array_equal(np.diff(g.relation_offsets), per_relation * 2)
  assert ds.relation_types[4] == ("paper", "rev_writes", "author")
  for r, (s_type, name, d_type) in enumerate(ds.relation_types):
    assert g.relation_names[r] == name
    block = slice(*g.relation_offsets[r:r + 2])
    for ends, node_type in ((g.src[block], s_type), (g.dst[block], d_type)):
      first, last = ds.node_range(node_type)
      assert ends.min() >= first and ends.max() < last, (name, node_type)
  for t, x in zip(mag.NODE_TYPES, ds.features):
    assert x.dtype == np.float32 and x.shape == (ds.node_range(t)[1] - ds.node_range(t)[0],
                                                 mag.FEATURE_DIMS[t])
  assert ds.labels.dtype == np.int32 and len(ds.labels) == counts[0]
  assert ds.labels.min() >= 0 and ds.labels.max() < 7
  splits = [ds.train_papers, ds.val_papers, ds.test_papers]
  assert sum(map(len, splits)) == counts[0] == len(np.unique(np.concatenate(splits)))
  assert "synthetic-mag" in repr(ds)


def test_mag_reverses_mirror_forward_relations():
  ds = mag.synthetic_mag(scale=1e-3, seed=1, num_classes=5)
  g = ds.graph
  pairs = lambda r, a, b: sorted(zip(a[slice(*g.relation_offsets[r:r + 2])].tolist(),  # noqa
                                     b[slice(*g.relation_offsets[r:r + 2])].tolist()))
  for r in range(4):
    assert pairs(r, g.src, g.dst) == pairs(r + 4, g.dst, g.src)
  # HeteroGraph.from_edges(add_inverse=True) of the forward edges gives the same graph.
  forward = slice(0, g.relation_offsets[4])
  rebuilt = HeteroGraph.from_edges(g.src[forward], g.dst[forward], g.etype[forward],
                                   num_nodes=g.num_nodes, relation_names=g.relation_names[:4],
                                   add_inverse=True)
  for a in ("src", "dst", "etype"):
    np.testing.assert_array_equal(getattr(rebuilt, a), getattr(g, a))
  without = mag.synthetic_mag(scale=1e-3, seed=1, num_classes=5, add_inverse=False)
  assert without.graph.num_relations == 4 and len(without.relation_types) == 4
  np.testing.assert_array_equal(without.graph.src, g.src[forward])


def test_mag_is_deterministic_by_seed():
  a, b = (mag.synthetic_mag(scale=5e-4, seed=3, num_classes=4) for _ in range(2))
  c = mag.synthetic_mag(scale=5e-4, seed=4, num_classes=4)
  for name in ("src", "dst", "etype"):
    np.testing.assert_array_equal(getattr(a.graph, name), getattr(b.graph, name))
  for x, y in zip(a.features, b.features):
    np.testing.assert_array_equal(x, y)
  np.testing.assert_array_equal(a.labels, b.labels)
  np.testing.assert_array_equal(a.train_papers, b.train_papers)
  assert a.graph.num_edges == c.graph.num_edges
  assert not np.array_equal(a.graph.src, c.graph.src)
  assert not np.array_equal(a.features[0], c.features[0])


def test_mag_tiny_scales_and_empty_classes():
  """More classes than institutions: edges needing a missing class go anywhere."""
  ds = mag.synthetic_mag(scale=1e-4, num_classes=mag.NUM_CLASSES)
  first, last = ds.node_range("institution")
  assert last - first == 1
  assert ds.graph.num_edges == 2 * sum(round(mag.NUM_EDGES[n] * 1e-4) for _, n, _ in mag.RELATIONS)
  for bad in (dict(scale=0), dict(scale=-1.0), dict(num_classes=0), dict(homophily=1.5),
              dict(split=(0.9, 0.2, 0.0))):
    with pytest.raises(ValueError):
      mag.synthetic_mag(**bad)


def test_mag_degrees_are_heavy_tailed_and_labels_learnable():
  ds = mag.synthetic_mag(scale=0.01, seed=0, num_classes=8)
  g = ds.graph
  topics = slice(*g.relation_offsets[2:4])  # paper -has_topic-> field, sorted by field
  in_topic = np.bincount(g.dst[topics] - ds.node_range("field_of_study")[0])
  assert in_topic.max() > 20 * max(np.median(in_topic), 1)  # popular fields
  cited = np.bincount(g.dst[slice(*g.relation_offsets[1:3])])
  assert cited.max() > 20 * max(np.median(cited), 1)
  # A nearest-centroid classifier: the mean of a paper's topics' features tells its class much
  # better than its own features (the signal a relational model has to find).
  papers, fields = ds.features[0], ds.features[3]
  paper_ids = g.src[topics]
  field_ids = g.dst[topics] - ds.node_range("field_of_study")[0]
  counts = np.bincount(paper_ids, minlength=len(papers))[:, None]
  topic_mean = np.zeros((len(papers), fields.shape[1]))
  np.add.at(topic_mean, paper_ids, fields[field_ids])
  topic_mean /= np.maximum(counts, 1)

  def accuracy(x):
    train, test = ds.train_papers, ds.test_papers
    centroids = np.stack([x[train][ds.labels[train] == c].mean(0) for c in range(8)])
    guess = np.argmin(((x[test][:, None] - centroids) ** 2).sum(-1), axis=1)
    return np.mean(guess == ds.labels[test])

  own, neighbours = accuracy(papers), accuracy(topic_mean)
  assert neighbours > 0.8 and neighbours > own + 0.2, (own, neighbours)
