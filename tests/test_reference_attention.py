"""The plain-JAX RGAT and HGT layers (jaxdata/reference/attention.py) and the ogbn-mag-like
generator (jaxdata/data/mag.py).

Every formulation is checked against a loop over nodes written from the semantics in the
module's docstring (values), against a dense masked-attention reference in jax.numpy (values
and gradients; itself checked against the loop), against finite differences, and against
PyTorch Geometric's RGATConv and HGTConv holding the same weights (skipped where torch or
torch_geometric is missing). Float64 throughout except where dtypes are the point.

XLA's CPU compiles dominate the time here, so each layer goes through one jitted
`step(name, edges, x, params, ct) -> (out, grads)` whose edges are arguments, compiled once per
shape for all the tests of that shape, without LLVM's optimisations.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import rgnn_peers as peers
from jaxdata.data import HeteroGraph, mag
from jaxdata.reference import attention as attention_ref

try:  # the PyG peers; without torch and torch_geometric the tests that need them skip
  from jaxdata.reference import pyg as pyg_ref
except ImportError:
  pyg_ref = None

TOL = dict(rtol=1e-9, atol=1e-11)
HIGHEST = jax.lax.Precision.HIGHEST
#: XLA's CPU backend spends most of this file's time compiling; its LLVM optimisations buy
#: nothing on graphs of a few dozen edges and take nearly half of that time.
jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


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


@functools.partial(jit, static_argnames=("name", "precision"))
def rgat_step(name, edges, x, params, ct, precision=None):
  """RGAT[name]'s output and the gradients of sum(out * ct) in x and params."""

  def loss(x, params):
    out = attention_ref.RGAT[name](*edges, x, params, precision=precision)
    return jnp.vdot(out, ct.astype(out.dtype)), out

  (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, params)
  return out, grads


@functools.partial(jit, static_argnames=("name", "precision"))
def hgt_step(name, edges, xs, params, cts, precision=None):
  """HGT[name]'s per-type outputs and the gradients of sum_t sum(out_t * ct_t)."""

  def loss(xs, params):
    outs = attention_ref.HGT[name](*edges, xs, params, precision=precision)
    return sum(jnp.vdot(o, c.astype(o.dtype)) for o, c in zip(outs, cts)), outs

  (_, outs), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(xs, params)
  return outs, grads


@functools.partial(jit, static_argnames=("name", "precision"))
def hgt_forward(name, edges, xs, params, precision=None):
  """HGT[name]'s per-type outputs (a forward compiles in a third of a step's time)."""
  return attention_ref.HGT[name](*edges, xs, params, precision=precision)


# ------------------------------------------------------------------------------------------------
# Graphs


def random_edges(rng, num_nodes, num_edges, num_relations, *, used_relations=None, dst_nodes=None):
  """Random edges plus 3 self loops and 4 repeated edges; only `dst_nodes` get in-edges."""
  used = np.arange(num_relations) if used_relations is None else np.asarray(used_relations)
  targets = np.arange(num_nodes) if dst_nodes is None else np.asarray(dst_nodes)
  if num_edges == 0:
    return (np.zeros(0, np.int64),) * 3
  src, dst = rng.integers(0, num_nodes, num_edges), rng.choice(targets, num_edges)
  etype = rng.choice(used, num_edges)
  loops = rng.choice(targets, 3)
  src = np.concatenate([src, loops, src[:4]])  # self loops, then repeats of the first edges
  dst = np.concatenate([dst, loops, dst[:4]])
  etype = np.concatenate([etype, rng.choice(used, 3), etype[:4]])
  return src, dst, etype


RGAT_GRAPHS = {
  # name: (num_nodes, num_edges, num_relations, used relations, nodes with in-edges)
  "mixed": (14, 40, 5, [0, 2, 3], np.arange(11)),  # relations 1, 4 and nodes 11-13: none
  "no edges": (5, 0, 5, None, None),
}


def rgat_case(graph="mixed", seed=0, d_in=5, d=3, heads=2, dtype=np.float64):
  num_nodes, num_edges, num_relations, used, targets = RGAT_GRAPHS[graph]
  rng = np.random.default_rng(seed)
  src, dst, etype = random_edges(
    rng, num_nodes, num_edges, num_relations, used_relations=used, dst_nodes=targets
  )
  edges = attention_ref.Edges.build(
    src, dst, etype, num_nodes=num_nodes, num_relations=num_relations
  )
  x = rng.standard_normal((num_nodes, d_in))
  params = attention_ref.RGATParams(
    rng.standard_normal((num_relations, d_in, heads * d)),
    rng.standard_normal((num_relations, heads, d)),
    rng.standard_normal((num_relations, heads, d)),
  )
  ct = rng.standard_normal((num_nodes, heads * d))
  cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
  return edges, cast(x), jax.tree.map(cast, params), cast(ct)


def typed_graph(seed=0, sizes=(6, 4, 3), widths=(5, 4, 6), num_edges=40):
  """Three node types, four relations ((src type, dst type) below) with self loops and repeated
  edges; type 2 is nobody's destination, and the last node of types 0 and 1 gets no edge."""
  rng = np.random.default_rng(seed)
  offsets = np.cumsum([0, *sizes])
  relations = [(0, 0), (1, 0), (0, 1), (2, 1)]
  src, dst, etype = [], [], []
  for r, (s, t) in enumerate(relations):
    s_ids = offsets[s] + rng.integers(0, sizes[s] - (s == t), num_edges // 4)
    d_ids = offsets[t] + rng.integers(0, sizes[t] - 1, num_edges // 4)
    if s == t:
      s_ids[:2] = d_ids[:2]
    s_ids[-1], d_ids[-1] = s_ids[0], d_ids[0]
    src.append(s_ids), dst.append(d_ids), etype.append(np.full(len(s_ids), r))
  src, dst, etype = (np.concatenate(a) for a in (src, dst, etype))
  xs = [rng.standard_normal((n, w)) for n, w in zip(sizes, widths)]
  return src, dst, etype, xs, len(relations)


def random_hgt_params(rng, widths, num_relations, heads, d, d_out):
  f = heads * d
  per_type = lambda shapes: tuple(rng.standard_normal(s) * 0.5 for s in shapes)  # noqa: E731
  return attention_ref.HGTParams(
    k_w=per_type([(w, f) for w in widths]),
    k_b=per_type([(f,)] * len(widths)),
    q_w=per_type([(w, f) for w in widths]),
    q_b=per_type([(f,)] * len(widths)),
    v_w=per_type([(w, f) for w in widths]),
    v_b=per_type([(f,)] * len(widths)),
    a_w=per_type([(f, d_out)] * len(widths)),
    a_b=per_type([(d_out,)] * len(widths)),
    w_att=rng.standard_normal((num_relations, heads, d, d)) * 0.5,
    w_msg=rng.standard_normal((num_relations, heads, d, d)) * 0.5,
    mu=rng.uniform(0.5, 1.5, (num_relations, heads)),
    skip=rng.standard_normal(len(widths)),
  )


def hgt_case(seed=0, heads=2, d=3, d_out=4, dtype=np.float64):
  """d_out = 4 = the width of type 1, so type 1 goes through the skip gate."""
  src, dst, etype, xs, num_relations = typed_graph(seed)
  rng = np.random.default_rng(seed + 100)
  params = random_hgt_params(rng, [x.shape[1] for x in xs], num_relations, heads, d, d_out)
  edges = attention_ref.Edges.build(
    src, dst, etype, num_nodes=sum(len(x) for x in xs), num_relations=num_relations
  )
  cts = [rng.standard_normal((len(x), d_out)) for x in xs]
  cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
  return edges, jax.tree.map(cast, xs), jax.tree.map(cast, params), jax.tree.map(cast, cts)


# ------------------------------------------------------------------------------------------------
# References. Loops: node by node, head by head, edge by edge, in NumPy (values). Dense: masked
# attention over all (relation, destination, source) triples in jax.numpy, the way one writes
# it without any sparse structure (a repeated edge counts as often as it occurs); jit-able and
# differentiable, so it gives reference gradients, and checked against the loops.


def softmax(scores):
  weights = np.exp(np.array(scores) - max(scores))
  return weights / weights.sum()


def loop_rgat(src, dst, etype, x, params):
  w, a_src, a_dst = params
  heads, d = a_src.shape[1:]
  out = np.zeros((x.shape[0], heads * d))
  for i in range(x.shape[0]):
    into = [e for e in range(len(dst)) if dst[e] == i]
    for h in range(heads):
      scores, messages = [], []
      for e in into:
        r = etype[e]
        h_src = (x[src[e]] @ w[r])[h * d : (h + 1) * d]
        h_dst = (x[i] @ w[r])[h * d : (h + 1) * d]
        s = a_src[r, h] @ h_src + a_dst[r, h] @ h_dst
        scores.append(s if s > 0 else 0.2 * s)
        messages.append(h_src)
      if into:
        out[i, h * d : (h + 1) * d] = softmax(scores) @ np.array(messages)
  return out


def gelu(v):
  return 0.5 * v * (1 + np.vectorize(math.erf)(v / math.sqrt(2)))


def loop_hgt(src, dst, etype, xs, p):
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
      agg = np.zeros((heads, d))
      for h in range(heads):
        scores, messages = [], []
        for e in into:
          r, j = etype[e], src[e]
          k = node(j, p.k_w, p.k_b)[h] @ p.w_att[r, h]
          scores.append(k @ node(i, p.q_w, p.q_b)[h] * p.mu[r, h] / math.sqrt(d))
          messages.append(node(j, p.v_w, p.v_b)[h] @ p.w_msg[r, h])
        if into:
          agg[h] = softmax(scores) @ np.array(messages)
      y = gelu(agg.reshape(-1)) @ p.a_w[t] + p.a_b[t]
      if y.shape[-1] == x.shape[-1]:
        gate = 1 / (1 + np.exp(-p.skip[t]))
        y = gate * y + (1 - gate) * x[i - offsets[t]]
      rows.append(y)
    outs.append(np.stack(rows))
  return outs


def edge_counts(edges, num_relations, num_nodes):
  """count[r, i, j]: how many edges j -> i of relation r (NumPy, outside any trace)."""
  count = np.zeros((num_relations, num_nodes, num_nodes))
  np.add.at(count, (np.asarray(edges.etype), np.asarray(edges.dst), np.asarray(edges.src)), 1)
  return count


def dense_attention(scores, count, messages):
  """scores [R, N_i, N_j, H], count [R, N_i, N_j], messages [R, N_j, H, d] -> [N_i, H*d]."""
  edge = (count > 0)[..., None]
  top = jnp.max(jnp.where(edge, scores, -jnp.inf), axis=(0, 2), keepdims=True)
  top = jax.lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0.0))
  weights = count[..., None] * jnp.where(edge, jnp.exp(jnp.where(edge, scores - top, 0.0)), 0.0)
  total = jnp.sum(weights, axis=(0, 2), keepdims=True)
  alpha = weights / jnp.where(total > 0, total, 1.0)
  out = jnp.einsum("rijh,rjhd->ihd", alpha, messages)
  return out.reshape(out.shape[0], -1)


def dense_rgat(count, x, params):
  w, a_src, a_dst = params
  r, heads, d = a_src.shape
  h = jnp.einsum("nk,rkf->rnf", x, w).reshape(r, -1, heads, d)
  s_src = jnp.einsum("rjhd,rhd->rjh", h, a_src)
  s_dst = jnp.einsum("rihd,rhd->rih", h, a_dst)
  scores = jax.nn.leaky_relu(s_dst[:, :, None] + s_src[:, None], 0.2)
  return dense_attention(scores, count, h)


def dense_hgt(count, xs, p):
  heads, d = p.mu.shape[1], p.w_att.shape[-1]
  project = lambda ws, bs: jnp.concatenate(  # noqa: E731
    [x @ w + b for x, w, b in zip(xs, ws, bs)]
  ).reshape(-1, heads, d)
  k, q, v = project(p.k_w, p.k_b), project(p.q_w, p.q_b), project(p.v_w, p.v_b)
  k_r = jnp.einsum("jhd,rhde->rjhe", k, p.w_att)
  scores = jnp.einsum("rjhe,ihe->rijh", k_r, q) * p.mu[:, None, None] / math.sqrt(d)
  agg = dense_attention(scores, count, jnp.einsum("jhd,rhde->rjhe", v, p.w_msg))
  outs, start = [], 0
  for t, x in enumerate(xs):
    y = jax.nn.gelu(agg[start : start + len(x)], approximate=False) @ p.a_w[t] + p.a_b[t]
    start += len(x)
    if y.shape[-1] == x.shape[-1]:
      gate = jax.nn.sigmoid(p.skip[t])
      y = gate * y + (1 - gate) * x
    outs.append(y)
  return outs


def as_numpy(tree):
  return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


def numpy_edges(edges):
  return [np.asarray(a) for a in edges]


@jit
def dense_rgat_step(count, x, params, ct):
  def loss(x, params):
    out = dense_rgat(count, x, params)
    return jnp.vdot(out, ct), out

  (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, params)
  return out, grads


@jit
def dense_hgt_step(count, xs, params, cts):
  def loss(xs, params):
    outs = dense_hgt(count, xs, params)
    return sum(jnp.vdot(o, c) for o, c in zip(outs, cts)), outs

  (_, outs), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(xs, params)
  return outs, grads


# ------------------------------------------------------------------------------------------------
# Edges and the edge softmax


def test_edge_softmax_sums_to_one_and_survives_large_scores():
  rng = np.random.default_rng(0)
  dst = jnp.asarray(rng.integers(0, 6, 40))
  scores = jnp.asarray(rng.standard_normal((40, 3)) * 50 + 1000)  # exp(1000) overflows
  softmax_sums = jax.jit(
    lambda s: jax.ops.segment_sum(attention_ref.edge_softmax(s, dst, 8), dst, num_segments=8)
  )
  sums = softmax_sums(scores)
  want = np.where(np.bincount(np.asarray(dst), minlength=8) > 0, 1.0, 0.0)[:, None]
  np.testing.assert_allclose(sums, np.broadcast_to(want, sums.shape), rtol=1e-12, atol=1e-12)
  bf16 = softmax_sums(scores.astype(jnp.bfloat16))
  assert bf16.dtype == jnp.float32  # the softmax of bfloat16 scores runs in float32
  np.testing.assert_allclose(bf16, np.broadcast_to(want, sums.shape), rtol=1e-6, atol=1e-6)


def test_edges_build_sorts_and_checks():
  edges = attention_ref.Edges.build([0, 1, 2], [1, 2, 0], [2, 0, 1], num_nodes=3, num_relations=3)
  np.testing.assert_array_equal(edges.etype, [0, 1, 2])
  np.testing.assert_array_equal(edges.src, [1, 2, 0])
  with pytest.raises(ValueError, match="num_nodes"):
    attention_ref.Edges.build([0, 3], [1, 2], [0, 0], num_nodes=3, num_relations=1)
  with pytest.raises(ValueError, match="num_relations"):
    attention_ref.Edges.build([0, 1], [1, 2], [0, 1], num_nodes=3, num_relations=1)


# ------------------------------------------------------------------------------------------------
# RGAT


@pytest.mark.parametrize("graph", list(RGAT_GRAPHS))
def test_rgat_dense_reference_matches_loop(graph):
  edges, x, params, ct = rgat_case(graph)
  out, _ = dense_rgat_step(edge_counts(edges, 5, len(x)), x, params, ct)
  np.testing.assert_allclose(
    out, loop_rgat(*numpy_edges(edges), as_numpy(x), as_numpy(params)), **TOL
  )


@pytest.mark.parametrize("graph", list(RGAT_GRAPHS))
@pytest.mark.parametrize("name", list(attention_ref.RGAT))
def test_rgat_matches_references(name, graph):
  """Values against the loop, gradients (x and every weight) against the dense reference."""
  edges, x, params, ct = rgat_case(graph)
  out, grads = rgat_step(name, edges, x, params, ct)
  assert out.shape == (len(x), params.w.shape[-1]) and out.dtype == jnp.float64
  np.testing.assert_allclose(
    out, loop_rgat(*numpy_edges(edges), as_numpy(x), as_numpy(params)), **TOL
  )
  _, want = dense_rgat_step(edge_counts(edges, 5, len(x)), x, params, ct)
  tree_allclose(grads, want, **TOL)


def test_rgat_gradient_matches_finite_differences():
  edges, x, params, ct = rgat_case()
  loss = lambda x, p: float(jnp.vdot(rgat_step("ragged_dot", edges, x, p, ct)[0], ct))  # noqa
  grads = rgat_step("ragged_dot", edges, x, params, ct)[1]
  rng = np.random.default_rng(3)
  direction = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape)), (x, params))
  eps = 1e-6

  def shifted(s):
    return loss(*jax.tree.map(lambda a, v: a + s * eps * v, (x, params), direction))

  numeric = (shifted(1) - shifted(-1)) / (2 * eps)
  analytic = sum(np.vdot(g, v) for g, v in zip(jax.tree.leaves(grads), jax.tree.leaves(direction)))
  np.testing.assert_allclose(analytic, numeric, rtol=1e-6)


@pytest.mark.parametrize("name", list(attention_ref.RGAT))
def test_rgat_bfloat16(name):
  """bfloat16 in and out, float32 inside: within bfloat16's rounding of the float64 result."""
  edges, x64, params64, ct64 = rgat_case()
  want = loop_rgat(*numpy_edges(edges), as_numpy(x64), as_numpy(params64))
  x, params, ct = jax.tree.map(lambda a: a.astype(jnp.bfloat16), (x64, params64, ct64))
  out, grads = rgat_step(name, edges, x, params, ct, precision=HIGHEST)
  assert out.dtype == jnp.bfloat16
  assert all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(grads))
  np.testing.assert_allclose(
    np.asarray(out, np.float64), want, atol=0.05 * np.abs(want).max(), rtol=0.05
  )
  _, want_grads = dense_rgat_step(edge_counts(edges, 5, len(x64)), x64, params64, ct64)
  for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(np.asarray(g, np.float64), w, atol=0.1 * np.abs(w).max())


def test_rgat_float32_step_through_rgnn_peers():
  """The benchmark's path: a Formulation, compiled ahead of time by rgnn_peers, in float32
  (one formulation: the adapter is shared)."""
  edges, x64, params64, ct64 = rgat_case()
  x, params, ct = jax.tree.map(lambda a: a.astype(jnp.float32), (x64, params64, ct64))
  form = peers.rgat_formulation("ragged_dot", edges, precision=HIGHEST)
  compiled = peers.compile_step(form, x, params, ct)
  assert compiled.bytes is None or compiled.bytes > 0
  loss, grads = compiled.run()
  want = loop_rgat(*numpy_edges(edges), as_numpy(x64), as_numpy(params64))
  np.testing.assert_allclose(loss, np.vdot(want, ct64), rtol=1e-5)
  _, want_grads = dense_rgat_step(edge_counts(edges, 5, len(x64)), x64, params64, ct64)
  tree_allclose(grads, want_grads, rtol=1e-4, atol=1e-4)


def test_init_rgat_shapes_and_seed():
  p = attention_ref.init_rgat(0, num_relations=3, in_features=5, head_features=4, heads=2)
  assert p.w.shape == (3, 5, 8) and p.a_src.shape == p.a_dst.shape == (3, 2, 4)
  assert p.w.dtype == jnp.float32 and p.heads == 2
  tree_allclose(
    p,
    attention_ref.init_rgat(0, num_relations=3, in_features=5, head_features=4, heads=2),
    rtol=0,
    atol=0,
  )
  assert not np.allclose(
    p.w, attention_ref.init_rgat(1, num_relations=3, in_features=5, head_features=4, heads=2).w
  )


# ------------------------------------------------------------------------------------------------
# HGT


def test_hgt_case_covers_skip_and_nodes_without_edges():
  edges, xs, params, _ = hgt_case()
  assert [x.shape[1] for x in xs] == [5, 4, 6] and params.a_w[1].shape[1] == 4  # type 1 skips
  dst = np.asarray(edges.dst)
  for first, last in ((0, 6), (6, 10), (10, 13)):
    assert not np.isin(np.arange(first, last), dst).all()


def test_hgt_dense_reference_matches_loop():
  edges, xs, params, cts = hgt_case()
  outs, _ = dense_hgt_step(edge_counts(edges, 4, 13), xs, params, cts)
  tree_allclose(outs, loop_hgt(*numpy_edges(edges), as_numpy(xs), as_numpy(params)), **TOL)


@pytest.mark.parametrize("name", list(attention_ref.HGT))
def test_hgt_matches_references(name):
  edges, xs, params, cts = hgt_case()
  outs, grads = hgt_step(name, edges, xs, params, cts)
  want = loop_hgt(*numpy_edges(edges), as_numpy(xs), as_numpy(params))
  assert [o.shape for o in outs] == [w.shape for w in want]
  tree_allclose(outs, want, **TOL)
  _, want_grads = dense_hgt_step(edge_counts(edges, 4, 13), xs, params, cts)
  tree_allclose(grads, want_grads, **TOL)


@pytest.mark.parametrize("name", list(attention_ref.HGT))
def test_hgt_bfloat16(name):
  """Forward only (the gradients' dtypes are checked for RGAT; compiles are what costs here)."""
  edges, xs64, params64, _ = hgt_case()
  want = loop_hgt(*numpy_edges(edges), as_numpy(xs64), as_numpy(params64))
  xs, params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), (xs64, params64))
  outs = hgt_forward(name, edges, xs, params, precision=HIGHEST)
  for o, w in zip(outs, want):
    assert o.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(o, np.float64), w, atol=0.06 * np.abs(w).max(), rtol=0.06)


def test_hgt_float32_step_through_rgnn_peers():
  """The benchmark's path (one formulation: the adapter is shared; float32 within 1e-4)."""
  edges, xs64, params64, cts64 = hgt_case()
  xs, params, cts = jax.tree.map(lambda a: a.astype(jnp.float32), (xs64, params64, cts64))
  form = peers.hgt_formulation("ragged_dot", edges, precision=HIGHEST)
  loss, grads = peers.compile_step(form, xs, params, jnp.concatenate(cts)).run()
  want = loop_hgt(*numpy_edges(edges), as_numpy(xs64), as_numpy(params64))
  np.testing.assert_allclose(loss, sum(np.vdot(w, c) for w, c in zip(want, cts64)), rtol=1e-5)
  _, want_grads = dense_hgt_step(edge_counts(edges, 4, 13), xs64, params64, cts64)
  tree_allclose(grads, want_grads, rtol=1e-4, atol=1e-4)


def test_check_node_types():
  ds = mag.synthetic_mag(scale=1e-4, num_classes=3)
  attention_ref.check_node_types(ds.graph, ds.features)
  with pytest.raises(ValueError, match="do not match"):
    attention_ref.check_node_types(ds.graph, [ds.features[0][1:], *ds.features[1:]])
  with pytest.raises(ValueError, match="do not match"):
    attention_ref.check_node_types(ds.graph, ds.features[:3])


def test_hgt_rejects_mismatched_types():
  edges, xs, params, _ = hgt_case()
  with pytest.raises(ValueError, match="node types"):
    attention_ref.hgt_ragged_dot(*edges, xs[:2], params)
  with pytest.raises(ValueError, match="dtype"):
    attention_ref.hgt_ragged_dot(*edges, [xs[0].astype(jnp.float32), *xs[1:]], params)


def test_init_hgt_shapes():
  p = attention_ref.init_hgt(
    0, in_features=[5, 7], num_relations=3, head_features=4, heads=2, out_features=6
  )
  assert [w.shape for w in p.k_w] == [(5, 8), (7, 8)] and p.a_w[1].shape == (8, 6)
  assert p.w_att.shape == p.w_msg.shape == (3, 2, 4, 4) and p.mu.shape == (3, 2)
  np.testing.assert_array_equal(p.mu, 1)
  np.testing.assert_array_equal(p.skip, 1)
  assert p.heads == 2 and p.head_features == 4


# ------------------------------------------------------------------------------------------------
# PyTorch Geometric


def pyg_rgat(torch, heads, d_in=5, d=3, num_relations=5, seed=0):
  """A PyG RGATConv as PyG initialises it; heads > 1: q, k zeroed outside the head blocks."""
  from torch_geometric.nn import RGATConv

  torch.manual_seed(seed)
  conv = RGATConv(
    d_in,
    d,
    num_relations=num_relations,
    heads=heads,
    dim=1,
    concat=True,
    bias=False,
    attention_mode="additive-self-attention",
    attention_mechanism="across-relation",
  ).double()
  if heads > 1:
    with pytest.raises(ValueError, match="mixes heads"):
      pyg_ref.rgat_params_from_pyg(conv)
    with torch.no_grad():
      mask = torch.zeros(heads * d, heads, dtype=torch.float64)
      for h in range(heads):
        mask[h * d : (h + 1) * d, h] = 1
      conv.q.mul_(mask), conv.k.mul_(mask)
  return conv


@pytest.mark.parametrize("heads,names", [(1, ["ragged_dot"]), (2, list(attention_ref.RGAT))])
def test_rgat_matches_pyg(torch, heads, names):
  """PyG's q, k become our attention vectors: outputs and gradients in x and W agree."""
  edges, x, _, _ = rgat_case(d=3, heads=heads)
  conv = pyg_rgat(torch, heads)
  params = jax.tree.map(jnp.asarray, pyg_ref.rgat_params_from_pyg(conv))
  ct = np.random.default_rng(1).standard_normal((len(x), 3 * heads))
  xt = torch.tensor(np.asarray(x)).requires_grad_(True)
  cpu = torch.device("cpu")
  want = conv(xt, *pyg_ref.pyg_graph(edges.src, edges.dst, edges.etype, cpu))
  (want * torch.from_numpy(ct)).sum().backward()
  for name in names:
    out, (dx, dparams) = rgat_step(name, edges, x, params, jnp.asarray(ct))
    np.testing.assert_allclose(out, want.detach().numpy(), **TOL, err_msg=name)
    np.testing.assert_allclose(dx, xt.grad.numpy(), **TOL, err_msg=name)
    np.testing.assert_allclose(dparams.w, conv.weight.grad.numpy(), **TOL, err_msg=name)


def test_pyg_rgat_conv_holds_our_weights(torch):
  edges, x, params, ct = rgat_case()
  cpu = torch.device("cpu")
  with pytest.raises(ValueError, match="differ between relations"):
    pyg_ref.pyg_rgat_conv(params, device=cpu, dtype=torch.float64)
  params = params._replace(
    a_src=jnp.broadcast_to(params.a_src[:1], params.a_src.shape),
    a_dst=jnp.broadcast_to(params.a_dst[:1], params.a_dst.shape),
  )
  conv = pyg_ref.pyg_rgat_conv(params, device=cpu, dtype=torch.float64)
  want = conv(
    torch.tensor(np.asarray(x)), *pyg_ref.pyg_graph(edges.src, edges.dst, edges.etype, cpu)
  )
  out, _ = rgat_step("ragged_dot", edges, x, params, ct)
  np.testing.assert_allclose(out, want.detach().numpy(), **TOL)


MAG_HEADS, MAG_HEAD_FEATURES = 3, 16  # 48 features: the fields' width, so they pass the skip


def mag_case(seed=0):
  """Tiny synthetic-mag (about 200 nodes, 4,000 edges), features float64, random cts."""
  ds = mag.synthetic_mag(scale=1e-4, seed=seed, num_classes=5)
  xs = [x.astype(np.float64) for x in ds.features]
  rng = np.random.default_rng(seed)
  cts = [rng.standard_normal((len(x), MAG_HEADS * MAG_HEAD_FEATURES)) for x in xs]
  return ds, xs, cts


def pyg_hgt(torch, types, metadata, in_channels, seed=0):
  """A PyG HGTConv as PyG initialises it, then random priors, skips and biases."""
  from torch_geometric.nn import HGTConv

  torch.manual_seed(seed)
  conv = HGTConv(
    in_channels, MAG_HEADS * MAG_HEAD_FEATURES, (list(types), metadata), heads=MAG_HEADS
  ).double()
  with torch.no_grad():
    for param in [*conv.p_rel.values(), *conv.skip.values()]:
      param.uniform_(-1.5, 1.5)
    for lin in [*conv.kqv_lin.lins.values(), *conv.out_lin.lins.values()]:
      lin.bias.uniform_(-0.5, 0.5)
  return conv


def pyg_hgt_outputs(torch, conv, graph, xs, cts, types, relations, metadata):
  """conv's outputs and input gradients as NumPy lists in our type order."""
  xts = [torch.from_numpy(x).requires_grad_(True) for x in xs]
  x_dict, edge_index_dict = pyg_ref.pyg_hetero_inputs(
    graph.src, graph.dst, graph.etype, xts, types, relations, device=torch.device("cpu")
  )
  # HGTConv's k_rel assumes edge_index_dict iterates in metadata order (is_sorted=True).
  out = conv(x_dict, {rel: edge_index_dict[rel] for rel in metadata})
  sum((out[t] * torch.from_numpy(c)).sum() for t, c in zip(types, cts)).backward()
  return [out[t].detach().numpy() for t in types], [x.grad.numpy() for x in xts]


@pytest.mark.parametrize("shuffle_metadata", [False, True], ids=["our-order", "shuffled"])
def test_hgt_matches_pyg(torch, shuffle_metadata):
  """PyG's weights copied into ours, on tiny synthetic-mag: every formulation's outputs, and the
  input gradients of one (the others' gradients equal its own: test_hgt_matches_references)."""
  ds, xs, cts = mag_case()
  types, relations = ds.graph.node_type_names, list(ds.relation_types)
  metadata = list(relations)
  if shuffle_metadata:  # PyG's relation and type indices then differ from ours
    metadata = [metadata[i] for i in np.random.default_rng(1).permutation(len(metadata))]
  conv = pyg_hgt(torch, types, metadata, {t: x.shape[1] for t, x in zip(types, xs)})
  want, want_dxs = pyg_hgt_outputs(torch, conv, ds.graph, xs, cts, types, relations, metadata)
  params = jax.tree.map(jnp.asarray, pyg_ref.hgt_params_from_pyg(conv, types, relations))
  edges = attention_ref.Edges.from_graph(ds.graph)
  xs, cts = jax.tree.map(jnp.asarray, (xs, cts))
  for name in attention_ref.HGT:
    for t, o, w in zip(types, hgt_forward(name, edges, xs, params), want):
      np.testing.assert_allclose(o, w, **TOL, err_msg=f"{name} {t}")
  _, (dxs, _) = hgt_step("ragged_dot", edges, xs, params, cts)
  for t, dx, want_dx in zip(types, dxs, want_dxs):
    np.testing.assert_allclose(dx, want_dx, **TOL, err_msg=f"d{t}")


def test_pyg_hgt_conv_holds_our_weights(torch):
  ds, xs, cts = mag_case(seed=1)
  types, relations = ds.graph.node_type_names, ds.relation_types
  params = random_hgt_params(
    np.random.default_rng(1),
    [x.shape[1] for x in xs],
    len(relations),
    MAG_HEADS,
    MAG_HEAD_FEATURES,
    MAG_HEADS * MAG_HEAD_FEATURES,
  )
  conv = pyg_ref.pyg_hgt_conv(
    params, types, relations, device=torch.device("cpu"), dtype=torch.float64
  )
  want, _ = pyg_hgt_outputs(torch, conv, ds.graph, xs, cts, types, relations, relations)
  outs = hgt_forward(
    "transform-all-then-gather",
    attention_ref.Edges.from_graph(ds.graph),
    jax.tree.map(jnp.asarray, xs),
    jax.tree.map(jnp.asarray, params),
  )
  tree_allclose(outs, want, **TOL)
  with pytest.raises(ValueError, match="d_out"):
    pyg_ref.pyg_hgt_conv(params._replace(a_w=tuple(w[:, :5] for w in params.a_w)), types, relations)


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
  assert g.relation_names == (
    "writes",
    "cites",
    "has_topic",
    "affiliated_with",
    "rev_writes",
    "rev_cites",
    "rev_has_topic",
    "rev_affiliated_with",
  )
  per_relation = [round(mag.NUM_EDGES[name] * scale) for _, name, _ in mag.RELATIONS]
  np.testing.assert_array_equal(np.diff(g.relation_offsets), per_relation * 2)
  assert ds.relation_types[4] == ("paper", "rev_writes", "author")
  for r, (s_type, name, d_type) in enumerate(ds.relation_types):
    assert g.relation_names[r] == name
    block = slice(*g.relation_offsets[r : r + 2])
    for ends, node_type in ((g.src[block], s_type), (g.dst[block], d_type)):
      first, last = ds.node_range(node_type)
      assert ends.min() >= first and ends.max() < last, (name, node_type)
  for t, x in zip(mag.NODE_TYPES, ds.features):
    assert x.dtype == np.float32 and x.shape == (
      ds.node_range(t)[1] - ds.node_range(t)[0],
      mag.FEATURE_DIMS[t],
    )
  assert ds.labels.dtype == np.int32 and len(ds.labels) == counts[0]
  assert ds.labels.min() >= 0 and ds.labels.max() < 7
  splits = [ds.train_papers, ds.val_papers, ds.test_papers]
  assert sum(map(len, splits)) == counts[0] == len(np.unique(np.concatenate(splits)))
  assert "synthetic-mag" in repr(ds)


def test_mag_reverses_mirror_forward_relations():
  ds = mag.synthetic_mag(scale=1e-3, seed=1, num_classes=5)
  g = ds.graph

  def pairs(r, a, b):
    edges = slice(*g.relation_offsets[r : r + 2])
    return sorted(zip(a[edges].tolist(), b[edges].tolist()))

  for r in range(4):
    assert pairs(r, g.src, g.dst) == pairs(r + 4, g.dst, g.src)
  # HeteroGraph.from_edges(add_inverse=True) of the forward edges gives the same graph.
  forward = slice(0, g.relation_offsets[4])
  rebuilt = HeteroGraph.from_edges(
    g.src[forward],
    g.dst[forward],
    g.etype[forward],
    num_nodes=g.num_nodes,
    relation_names=g.relation_names[:4],
    add_inverse=True,
  )
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
  for bad in (
    dict(scale=0),
    dict(scale=-1.0),
    dict(num_classes=0),
    dict(homophily=1.5),
    dict(split=(0.9, 0.2, 0.0)),
  ):
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
