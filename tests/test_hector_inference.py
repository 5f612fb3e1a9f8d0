"""jaxdata.hector's forward-only path: a call that nothing differentiates runs the plan's
inference kernels, where an edge softmax feeding one aggregate is fused into it (a
`softmax_sum` traversal: the attention weights are never stored). Checked against the
definitions in plain JAX (float32, precision "highest"), on graphs whose nodes fall in every
tier of the CUDA kernel (GROUP lanes, a warp, the block) and whose hubs have neighbouring ids
(as a real graph's type nodes do), so several hubs share a block's scan."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdata import hector
from jaxdata.data import HeteroGraph
from jaxdata.hector import codegen

HI = jax.lax.Precision.HIGHEST


def tier_graph(seed: int, n: int = 6000, r: int = 3) -> HeteroGraph:
  """In-degrees on both sides of each tier's split, a run of six hubs with consecutive ids (one
  far above the block split), nodes with no in-edges, and light random edges."""
  rng = np.random.default_rng(seed)
  cut, group = codegen.SOFTMAX_BLOCK_DEGREE, codegen.SOFTMAX_GROUP
  degrees = {0: 1, 1: group - 1, 2: group, 3: group + 1, 4: 32, 5: 33, 6: cut, 7: cut + 1,
             n - 1: cut + 5}
  degrees.update({100 + k: (k + 2) * cut + 3 * k for k in range(6)})  # clustered hubs
  degrees[106] = 20 * cut
  dst = np.concatenate([np.full(k, i) for i, k in degrees.items()] +
                       [rng.integers(200, n - 200, 4 * n)])
  src = rng.integers(0, n, len(dst))
  g = HeteroGraph.from_edges(src, dst, rng.integers(0, r, len(dst)), num_nodes=n,
                             relation_names=[f"r{i}" for i in range(r)])
  assert (g.in_degree()[list(degrees)] == list(degrees.values())).all()
  assert (g.in_degree() == 0).any()
  return g


def rgat_reference(ga, x, W, a_src, a_dst):
  _, heads, d = a_src.shape
  src, dst, et, n = ga.src, ga.dst, ga.etype, ga.num_nodes
  hs = jnp.einsum("ek,ekn->en", x[src], W[et], precision=HI).reshape(-1, heads, d)
  hd = jnp.einsum("ek,ekn->en", x[dst], W[et], precision=HI).reshape(-1, heads, d)
  score = jax.nn.leaky_relu((hs * a_src[et]).sum(-1) + (hd * a_dst[et]).sum(-1), 0.2)
  return _attend(score, hs, dst, n)


def hgt_reference(ga, k, q, v, w_att, w_msg, mu):
  r, heads, d, _ = w_att.shape
  src, dst, et, n = ga.src, ga.dst, ga.etype, ga.num_nodes
  rows = lambda a: a[src].reshape(-1, heads, d)  # noqa: E731
  key = jnp.einsum("ehk,ehkn->ehn", rows(k), w_att[et], precision=HI)
  msg = jnp.einsum("ehk,ehkn->ehn", rows(v), w_msg[et], precision=HI)
  score = (key * q[dst].reshape(-1, heads, d)).sum(-1) * mu[et] / np.sqrt(d)
  return _attend(score, msg, dst, n)


def _attend(score, rows, dst, n):
  """sum over each node's in-edges of softmax(score)[e, h] * rows[e, h], as [N, H * d]."""
  top = jax.ops.segment_max(score, dst, n)
  ex = jnp.exp(score - top[dst])
  alpha = ex / jax.ops.segment_sum(ex, dst, n)[dst]
  return jax.ops.segment_sum(alpha[..., None] * rows, dst, n).reshape(n, -1)


def rgat_inputs(rng, g, k, heads, d):
  r = g.num_relations
  return dict(x=jnp.asarray(rng.standard_normal((g.num_nodes, k)), jnp.float32),
              W=jnp.asarray(rng.standard_normal((r, k, heads * d)) / np.sqrt(k), jnp.float32),
              a_src=jnp.asarray(rng.standard_normal((r, heads, d)) / np.sqrt(d), jnp.float32),
              a_dst=jnp.asarray(rng.standard_normal((r, heads, d)) / np.sqrt(d), jnp.float32))


def hgt_inputs(rng, g, heads, d):
  r, f = g.num_relations, heads * d
  node = lambda: jnp.asarray(rng.standard_normal((g.num_nodes, f)), jnp.float32)  # noqa: E731
  rel = lambda: jnp.asarray(rng.standard_normal((r, heads, d, d)) / np.sqrt(d), jnp.float32)  # noqa
  return dict(k=node(), q=node(), v=node(), w_att=rel(), w_msg=rel(),
              mu=jnp.asarray(rng.uniform(0.5, 1.5, (r, heads)), jnp.float32))


def _sinks(kernels):
  return [k.kernel.sink for k in kernels if k.kernel.template == "traversal"]


def test_only_the_forward_only_plan_fuses_the_softmax():
  """The inference kernels hold one softmax_sum and no stored softmax; the forward kernels (whose
  attention weights the backward pass reads) keep the softmax and its aggregate apart."""
  g = tier_graph(0, n=800)
  ga = hector.GraphArrays.from_graph(g)
  rng = np.random.default_rng(0)
  x = rgat_inputs(rng, g, 8, 2, 4)
  h = hgt_inputs(rng, g, 2, 4)
  plans = [hector.rgat_layer.plan(ga, **x),
           hector.hgt_layer.plan(ga, k=h["k"], q=h["q"], v=h["v"], W_att=h["w_att"],
                                 W_msg=h["w_msg"], mu=h["mu"][..., None])]
  for plan in plans:
    assert _sinks(plan.inference_kernels).count("softmax_sum") == 1
    assert "softmax" not in _sinks(plan.inference_kernels)
    assert "softmax_sum" not in _sinks(plan.forward_kernels)
    assert "softmax" in _sinks(plan.forward_kernels)
    assert "inference kernels" in str(plan)


@pytest.mark.parametrize("heads,d", [(4, 8), (1, 16), (4, 32)])
def test_rgat_forward_only_matches_reference_in_every_tier(device, heads, d):
  g = tier_graph(1)
  ga = hector.GraphArrays.from_graph(g)
  inputs = rgat_inputs(np.random.default_rng(1), g, 16, heads, d)
  got = jax.jit(functools.partial(hector.rgat_message, ga))(*inputs.values())
  want = rgat_reference(ga, *inputs.values())
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  # the same layer's training forward (separate softmax and aggregate kernels) agrees too
  trained, _ = jax.vjp(functools.partial(hector.rgat_message, ga), *inputs.values())
  np.testing.assert_allclose(got, trained, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("heads,d", [(4, 8), (2, 32)])
def test_hgt_forward_only_matches_reference_in_every_tier(device, heads, d):
  g = tier_graph(2)
  ga = hector.GraphArrays.from_graph(g)
  inputs = hgt_inputs(np.random.default_rng(2), g, heads, d)
  got = jax.jit(functools.partial(hector.hgt_message, ga))(*inputs.values())
  want = hgt_reference(ga, *inputs.values())
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_forward_only_output_keeps_zeros_for_nodes_without_edges(device):
  """The fused kernel writes every node's row itself (its output is not zeroed first)."""
  g = tier_graph(3, n=800)
  ga = hector.GraphArrays.from_graph(g)
  inputs = rgat_inputs(np.random.default_rng(3), g, 8, 2, 4)
  got = np.asarray(hector.rgat_message(ga, *inputs.values()))
  empty = g.in_degree() == 0
  assert empty.any() and not np.isnan(got).any()
  np.testing.assert_array_equal(got[empty], 0.0)


@pytest.mark.parametrize("width,heads,split", [(32, 4, (8, 4)), (128, 4, (8, 16)),
                                               (16, 0, (8, 2)), (48, 4, (4, 16)),
                                               (12, 4, (1, 16)), (512, 1, None),
                                               (64, 64, None), (30, 4, None)])
def test_softmax_sum_split(width, heads, split):
  """SUB lanes (a power of two, at most a warp) of PL adjacent features of one head each."""
  from jaxdata.hector.lowering import softmax_sum_split  # pylint: disable=g-import-not-at-top
  assert softmax_sum_split(width, heads) == split


def test_a_softmax_too_wide_to_fuse_stays_apart():
  """Where an edge's features need more than a warp's lanes, the forward-only plan keeps the
  forward kernels (softmax stored, then the aggregate)."""
  g = tier_graph(4, n=800)
  ga = hector.GraphArrays.from_graph(g)
  plan = hector.rgat_layer.plan(ga, **rgat_inputs(np.random.default_rng(4), g, 4, 1, 512))
  assert plan.inference_kernels is plan.forward_kernels
  assert "softmax_sum" not in _sinks(plan.inference_kernels)
