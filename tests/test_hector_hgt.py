"""jaxdata.hector HGT: generated kernels against the plain-JAX HGT of jaxdata.reference.attention,
with every pass on or off.

jaxdata.reference.attention's HGT matches PyG's HGTConv (tests/test_reference_attention.py checks it
against the real HGTConv). Here the same layer is built around `hector.hgt_message`: the per-type
K/Q/V projections, the GELU, the output projection and the skip gate in plain JAX, the edge part
(per-head relation matrices, prior, edge softmax, messages) in generated kernels, and outputs and
gradients in every input and parameter are compared with the reference in float64. So hector's HGT
matches PyG's, transitively. The graph has self loops, repeated edges, an empty relation, nodes
without in-edges, fewer unique (source, relation) pairs than edges, and three node types of
different widths.
"""

import concurrent.futures
import functools
import math
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_hector_rgat import PASS_CHOICES, corner_case_graph

from jaxdata import hector
from jaxdata.hector import compiler
from jaxdata.hector.compiled import execute
from jaxdata.reference import attention as attention_ref

HI = jax.lax.Precision.HIGHEST
#: node types: (rows, feature width) in id order; 40 nodes in all (corner_case_graph's)
TYPES = ((10, 6), (15, 7), (15, 3))
HEADS, DK = 2, 3  # d_out = H * d_k = 6: type 0 goes through the skip gate


def random_params(rng, num_relations, dtype=jnp.float32) -> attention_ref.HGTParams:
  """Random weights, biases, priors and skip logits (init_hgt's biases are zero, mu = skip = 1)."""
  f = HEADS * DK
  p = attention_ref.init_hgt(
    int(rng.integers(1 << 30)),
    in_features=[d for _, d in TYPES],
    num_relations=num_relations,
    head_features=DK,
    heads=HEADS,
    dtype=dtype,
  )
  noise = lambda shape: jnp.asarray(rng.standard_normal(shape) * 0.5, dtype)  # noqa: E731
  return p._replace(
    k_b=tuple(noise(f) for _ in TYPES),
    q_b=tuple(noise(f) for _ in TYPES),
    v_b=tuple(noise(f) for _ in TYPES),
    a_b=tuple(noise(f) for _ in TYPES),
    w_att=noise(p.w_att.shape) * 2,
    w_msg=noise(p.w_msg.shape) * 2,
    mu=jnp.asarray(rng.uniform(0.3, 2.0, p.mu.shape), dtype),
    skip=noise(len(TYPES)),
  )


def random_features(rng, dtype=jnp.float32):
  return [jnp.asarray(rng.standard_normal((n, d)), dtype) for n, d in TYPES]


def hector_hgt(ga, xs, params: attention_ref.HGTParams, passes):
  """The HGT layer with its edge part in hector's kernels, node-level work in plain JAX."""
  dtype = xs[0].dtype
  proj = lambda ws, bs: jnp.concatenate(  # noqa: E731
    [(jnp.dot(x, w, precision=HI) + b).astype(dtype) for x, w, b in zip(xs, ws, bs)]
  )
  k, q, v = (
    proj(params.k_w, params.k_b),
    proj(params.q_w, params.q_b),
    proj(params.v_w, params.v_b),
  )
  agg = hector.hgt_message(ga, k, q, v, params.w_att, params.w_msg, params.mu, passes=passes)
  outs, start = [], 0
  for t, x in enumerate(xs):
    rows = jax.nn.gelu(agg[start : start + len(x)].astype(jnp.float32), approximate=False)
    start += len(x)
    y = jnp.dot(rows.astype(dtype), params.a_w[t], precision=HI) + params.a_b[t]
    if y.shape[-1] == x.shape[-1]:
      gate = jax.nn.sigmoid(params.skip[t].astype(jnp.float32))
      y = gate * y + (1 - gate) * x
    outs.append(y.astype(dtype))
  return outs


def reference(edges, xs, params):
  return attention_ref.HGT["transform-all-then-gather"](*edges, xs, params, precision=HI)


def value_and_grads(fn, xs, params, cts):
  def loss(xs, params):
    outs = fn(xs, params)
    return sum(jnp.vdot(o.astype(c.dtype), c) for o, c in zip(outs, cts)), outs

  (_, outs), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(xs, params)
  return outs, grads


def assert_tree_close(got, want, what, **tol):
  flat_got, _ = jax.tree_util.tree_flatten_with_path(got)
  flat_want = jax.tree.leaves(want)
  assert len(flat_got) == len(flat_want)
  for (path, g), w in zip(flat_got, flat_want):
    np.testing.assert_allclose(
      np.asarray(g, np.float64),
      np.asarray(w, np.float64),
      err_msg=f"{what}{jax.tree_util.keystr(path)}",
      **tol,
    )


@functools.cache
def setup(seed=5):
  g = corner_case_graph(seed)
  assert g.num_nodes == sum(n for n, _ in TYPES)
  return g, hector.GraphArrays.from_graph(g), attention_ref.Edges.from_graph(g)


@functools.cache
def case(dtype, seed):
  """(xs, params, cotangents, the reference's outputs and gradients in float64)."""
  g, _, edges = setup()
  rng = np.random.default_rng(seed)
  xs, params = random_features(rng, dtype), random_params(rng, g.num_relations, dtype)
  cts = [jnp.asarray(rng.standard_normal((n, HEADS * DK)), jnp.float64) for n, _ in TYPES]
  wide = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), (xs, params))
  with jax.default_device(jax.devices("cpu")[0]):
    want = jax.jit(functools.partial(value_and_grads, functools.partial(reference, edges)))(
      *wide, cts
    )
  return xs, params, cts, want


def run_both(passes, dtype, seed):
  _, ga, _ = setup()
  xs, params, cts, want = case(dtype, seed)
  got = jax.jit(functools.partial(value_and_grads, lambda xs, p: hector_hgt(ga, xs, p, passes)))(
    xs, params, cts
  )
  return got, want, (xs, params)


@pytest.mark.parametrize("passes", PASS_CHOICES, ids=lambda p: "+".join(p) or "none")
def test_hgt_float32_matches_pyg_reference(device, passes):
  (outs, grads), (want_outs, want_grads), (xs, params) = run_both(passes, jnp.float32, 1)
  for o in outs:
    assert o.dtype == jnp.float32
  assert_tree_close(outs, want_outs, "out", rtol=1e-5, atol=1e-5)
  assert jax.tree.map(lambda a: a.dtype, grads) == jax.tree.map(lambda a: a.dtype, (xs, params))
  assert_tree_close(grads, want_grads, "grad", rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("passes", PASS_CHOICES, ids=lambda p: "+".join(p) or "none")
def test_hgt_bfloat16(device, passes):
  (outs, grads), (want_outs, want_grads), _ = run_both(passes, jnp.bfloat16, 2)
  assert all(o.dtype == jnp.bfloat16 for o in outs)
  assert_tree_close(outs, want_outs, "out", rtol=3e-2, atol=3e-2)
  assert_tree_close(grads, want_grads, "grad", rtol=5e-2, atol=1e-1)


def message_inputs(rng, num_nodes, num_relations, dtype=jnp.float32):
  f = HEADS * DK
  node = lambda: jnp.asarray(rng.standard_normal((num_nodes, f)), dtype)  # noqa: E731
  rel = lambda: jnp.asarray(rng.standard_normal((num_relations, HEADS, DK, DK)) / 2, dtype)  # noqa
  return dict(
    k=node(),
    q=node(),
    v=node(),
    W_att=rel(),
    W_msg=rel(),
    mu=jnp.asarray(rng.uniform(0.5, 1.5, (num_relations, HEADS, 1)), dtype),
  )


def test_compaction_materializes_one_row_per_unique_pair():
  g, ga, _ = setup()
  unique = len(set(zip(g.src.tolist(), g.etype.tolist())))
  assert ga.num_pairs == unique < g.num_edges
  inputs = message_inputs(np.random.default_rng(0), g.num_nodes, g.num_relations)
  for passes, rows in ((("compact",), unique), (("reorder", "compact"), unique), ((), g.num_edges)):
    plan = hector.hgt_layer.plan(ga, passes, **inputs)
    env = {plan.forward.inputs[k].id: v for k, v in inputs.items()}
    execute(plan.forward_kernels, ga, env)
    # K[src] @ W_att[r] and V[src] @ W_msg[r]: per-head GEMMs storing one row per pair (or edge)
    gemms = [k for k in plan.forward_kernels if k.kernel.template == "gemm"]
    assert len(gemms) == 2
    for k in gemms:
      assert k.kernel.heads == HEADS and (k.kernel.k, k.kernel.n) == (DK, DK)
      assert env[k.output.id].shape == (rows, HEADS * DK)
      assert (k.output.domain == "compact") == ("compact" in passes)
    if "compact" in passes:  # the backward's GEMMs and weight gradients run over pairs too
      assert all(
        k.kernel.domain == "compact"
        for k in plan.backward_kernels
        if k.kernel.template in ("gemm", "weight_grad")
      )


def test_reordering_folds_the_prior_into_w_att():
  g, ga, _ = setup()
  inputs = message_inputs(np.random.default_rng(0), g.num_nodes, g.num_relations)
  on = hector.hgt_layer.plan(ga, ("reorder",), **inputs)
  off = hector.hgt_layer.plan(ga, (), **inputs)
  reads_mu = lambda k: any(v.name == "mu" for v in k.inputs)  # noqa: E731
  # on: mu is read once, by the [R, H, d_k, d_k] fold on XLA; its gradient is a weight-level
  # reduction. off: every edge's score multiplies mu[etype], and mu's gradient sums over edges.
  (fold,) = [k for k in on.forward_kernels if reads_mu(k)]
  assert fold.kernel.template == "dense" and fold.kernel.op == "head_scale"
  assert not any(
    k.kernel.template == "traversal" and k.kernel.sink == "relation" for k in on.backward_kernels
  )
  assert any(
    k.kernel.template == "traversal" and k.kernel.sink == "softmax" and reads_mu(k)
    for k in off.forward_kernels
  )
  assert any(
    k.kernel.template == "traversal" and k.kernel.sink == "relation" for k in off.backward_kernels
  )
  # the attention product stays on the source side either way (compactable): no GEMM reads dst
  for plan in (on, off):
    assert all(
      k.kernel.rows.end == "src" for k in plan.forward_kernels if k.kernel.template == "gemm"
    )


@hector.layer(
  k=hector.NODE,
  q=hector.NODE,
  v=hector.NODE,
  W_att=hector.RELATION_WEIGHT,
  W_msg=hector.RELATION_WEIGHT,
  mu=hector.RELATION_VECTOR,
)
def hgt_destination_side(g, k, q, v, W_att, W_msg, mu):
  """HGT written with the attention matrix on the destination side: K[j] . (Q[i] W_att^T)
  (W_att here is the transpose of hgt_layer's)."""
  score = (g.dst(q) @ W_att).dot(g.src(k), heads=W_att) * g.vector_row(mu)
  return g.aggregate(g.edge_softmax(score) * (g.src(v) @ W_msg))


def test_reordering_moves_the_attention_product_to_the_source_side(device):
  g, ga, _ = setup()
  rng = np.random.default_rng(3)
  inputs = message_inputs(rng, g.num_nodes, g.num_relations)
  swapped = dict(inputs, W_att=jnp.swapaxes(inputs["W_att"], -1, -2))
  want = jax.jit(hector.hgt_layer.with_passes(()))(ga, **inputs)
  for passes in PASS_CHOICES:
    plan = hgt_destination_side.plan(ga, passes, **swapped)
    ends = sorted(k.kernel.rows.end for k in plan.forward_kernels if k.kernel.template == "gemm")
    assert ends == (["src", "src"] if "reorder" in passes else ["dst", "src"]), passes
    if passes == ("reorder", "compact"):  # both products now run over the unique pairs
      assert all(
        k.kernel.domain == "compact" for k in plan.forward_kernels if k.kernel.template == "gemm"
      )
    np.testing.assert_allclose(
      jax.jit(hgt_destination_side.with_passes(passes))(ga, **swapped), want, rtol=1e-5, atol=1e-5
    )
  ct = jnp.asarray(rng.standard_normal(want.shape), jnp.float32)

  def grad(layer, w):
    return jax.jit(jax.grad(lambda a: jnp.vdot(layer(ga, **a), ct)))(w)

  got = grad(hgt_destination_side, swapped)
  ref = grad(hector.hgt_layer.with_passes(()), inputs)
  ref["W_att"] = jnp.swapaxes(ref["W_att"], -1, -2)
  for name in inputs:
    np.testing.assert_allclose(got[name], ref[name], rtol=1e-4, atol=1e-4, err_msg=name)


def test_plan_shows_every_pass():
  g, ga, _ = setup()
  inputs = message_inputs(np.random.default_rng(0), g.num_nodes, g.num_relations)
  text = str(hector.hgt_layer.plan(ga, **inputs))
  for piece in (
    "dot(%",
    "heads=W_att",
    "vector_row(mu)",
    "head_scale(W_att, mu)",
    f"compact[{HEADS * DK}] = linear",
    f"({HEADS} heads x {DK}x{DK})",
    "over (src, relation) pairs",
    "softmax over dst[e] of dot2(",
    "head_scale_grad",
    "kept from the forward pass: %",
  ):
    assert piece in text, piece
  off = str(hector.hgt_layer.plan(ga, (), **inputs))
  assert off.count("(switched off)") == 2 and "compact" not in off.split("== forward")[1]


def test_hgt_message_checks_its_inputs():
  g, ga, _ = setup()
  inputs = message_inputs(np.random.default_rng(0), g.num_nodes, g.num_relations)
  k, q, v, wa, wm, mu = inputs.values()
  mu = mu[..., 0]
  with pytest.raises(ValueError, match="w_att and w_msg"):
    hector.hgt_message(ga, k, q, v, wa, wm[:, :, :2], mu)
  with pytest.raises(ValueError, match="q must be"):
    hector.hgt_message(ga, k, q[:, :4], v, wa, wm, mu)
  with pytest.raises(ValueError, match="mu must be"):
    hector.hgt_message(ga, k, q, v, wa, wm, mu[:, :1])
  # rows of the wrong width for W[r, h]: the input and the weight are named
  with pytest.raises(ValueError, match=r"input 'k' has rows of shape \(4,\), but weight 'W_att'"):
    hector.hgt_layer(ga, k=k[:, :4], q=q[:, :4], v=v[:, :4], W_att=wa, W_msg=wm, mu=inputs["mu"])
  with pytest.raises(ValueError, match="heads=W needs a per-head weight"):
    hector.layer(x=hector.NODE, W=hector.RELATION_WEIGHT)(
      lambda g, x, W: g.aggregate((g.src(x) @ W).dot(g.dst(x), heads=W) * g.src(x))
    )(ga, x=k, W=jnp.zeros((g.num_relations, HEADS * DK, HEADS * DK)))
  with pytest.raises(TypeError, match="vector_row"):
    hector.layer(x=hector.NODE, W=hector.RELATION_WEIGHT)(
      lambda g, x, W: g.aggregate(g.src(x) * g.vector_row(W))
    )


@pytest.mark.skipif(
  shutil.which("nvcc") is None and compiler.nvrtc() is None, reason="neither nvcc nor NVRTC here"
)
def test_generated_hgt_cuda_compiles(tmp_path, monkeypatch):
  """Every CUDA kernel of HGT, every pass on (float32, d_k 16: one column tile per head) and
  every pass off (bfloat16, d_k 3), compiles (without a GPU)."""
  monkeypatch.setenv("JAXDATA_CACHE_DIR", str(tmp_path))
  g, ga, _ = setup()
  sources = set()
  for passes, dtype, heads, d_k in ((None, jnp.float32, 4, 16), ((), jnp.bfloat16, 2, 3)):
    z = jnp.zeros((g.num_nodes, heads * d_k), dtype)
    w = jnp.zeros((g.num_relations, heads, d_k, d_k), dtype)
    text = hector.hgt_layer.sources(
      ga,
      "cuda",
      passes,
      k=z,
      q=z,
      v=z,
      W_att=w,
      W_msg=w,
      mu=jnp.zeros((g.num_relations, heads, 1), dtype),
    )
    sources.update(part.split("\n", 1)[1] for part in text.split("// ---- ")[1:])
  assert len(sources) >= 25
  assert sum("heads x" in s.split("\n", 1)[0] for s in sources) >= 10  # per-head GEMMs
  with concurrent.futures.ThreadPoolExecutor(os.cpu_count()) as pool:
    for path in pool.map(lambda s: compiler.compile_cuda(s, 90), sorted(sources)):
      assert path.stat().st_size > 0


def test_scaled_prior_matches_the_definition():
  """hgt_message divides mu by sqrt(d_k) itself: the layer's `mu` input is the scaled prior."""
  g, ga, _ = setup()
  inputs = message_inputs(np.random.default_rng(4), g.num_nodes, g.num_relations)
  raw = inputs["mu"][..., 0] * math.sqrt(DK)
  np.testing.assert_allclose(
    hector.hgt_message(
      ga, inputs["k"], inputs["q"], inputs["v"], inputs["W_att"], inputs["W_msg"], raw
    ),
    hector.hgt_layer(ga, **inputs),
    rtol=1e-6,
    atol=1e-6,
  )
