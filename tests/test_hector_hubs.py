"""jaxdata.hector's edge softmax on graphs whose nodes fall in every tier of the CUDA kernel
(GROUP lanes, a warp, the block) and whose hubs have neighbouring ids, as a real graph's type
nodes do (MUTAG: six hubs among 160 ids), so several hubs meet in one block's scan
(`for_each_hub`, templates/traversal.cuh). RGAT and HGT forward passes, alone (inference) and
under jax.vjp, and RGAT's gradients, against the definitions in plain JAX (float32, precision
"highest")."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_hector_rgat import random_inputs as rgat_inputs
from test_hector_rgat import reference as rgat_reference

from jaxdata import hector
from jaxdata.data import HeteroGraph
from jaxdata.hector import codegen
from jaxdata.reference import attention as attention_ref

HI = jax.lax.Precision.HIGHEST


def tier_graph(seed: int, n: int = 6000, r: int = 3) -> HeteroGraph:
  """In-degrees on both sides of each tier's split, a run of six hubs with consecutive ids (one
  far above the block split), nodes with no in-edges, and light random edges."""
  rng = np.random.default_rng(seed)
  cut, group = codegen.SOFTMAX_BLOCK_DEGREE, codegen.SOFTMAX_GROUP
  degrees = {
    0: 1,
    1: group - 1,
    2: group,
    3: group + 1,
    4: 32,
    5: 33,
    6: cut,
    7: cut + 1,
    n - 1: cut + 5,
  }
  degrees.update({100 + k: (k + 2) * cut + 3 * k for k in range(6)})  # clustered hubs
  degrees[106] = 20 * cut
  dst = np.concatenate(
    [np.full(k, i) for i, k in degrees.items()] + [rng.integers(200, n - 200, 4 * n)]
  )
  src = rng.integers(0, n, len(dst))
  g = HeteroGraph.from_edges(
    src, dst, rng.integers(0, r, len(dst)), num_nodes=n, relation_names=[f"r{i}" for i in range(r)]
  )
  assert (g.in_degree()[list(degrees)] == list(degrees.values())).all()
  assert (g.in_degree() == 0).any()
  return g


def hgt_reference(ga, k, q, v, w_att, w_msg, mu):
  r, heads, d, _ = w_att.shape
  src, dst, et, n = ga.src, ga.dst, ga.etype, ga.num_nodes
  rows = lambda a: a[src].reshape(-1, heads, d)  # noqa: E731
  key = jnp.einsum("ehk,ehkn->ehn", rows(k), w_att[et], precision=HI)
  msg = jnp.einsum("ehk,ehkn->ehn", rows(v), w_msg[et], precision=HI)
  score = (key * q[dst].reshape(-1, heads, d)).sum(-1) * mu[et] / np.sqrt(d)
  alpha = attention_ref.edge_softmax(score, dst, n)
  return jax.ops.segment_sum(alpha[..., None] * msg, dst, n).reshape(n, -1)


def hgt_inputs(rng, g, heads, d):
  r, f = g.num_relations, heads * d
  node = lambda: jnp.asarray(rng.standard_normal((g.num_nodes, f)), jnp.float32)  # noqa: E731
  rel = lambda: jnp.asarray(rng.standard_normal((r, heads, d, d)) / np.sqrt(d), jnp.float32)  # noqa
  return dict(
    k=node(),
    q=node(),
    v=node(),
    w_att=rel(),
    w_msg=rel(),
    mu=jnp.asarray(rng.uniform(0.5, 1.5, (r, heads)), jnp.float32),
  )


@pytest.mark.parametrize("heads,d", [(4, 8), (1, 16), (4, 32)])
def test_rgat_matches_reference_in_every_tier(device, heads, d):
  g = tier_graph(1)
  ga = hector.GraphArrays.from_graph(g)
  inputs = rgat_inputs(np.random.default_rng(1), g, 16, heads, d)
  layer = functools.partial(hector.rgat_message, ga)
  got = jax.jit(layer)(*inputs.values())
  want, want_vjp = jax.vjp(functools.partial(rgat_reference, ga), *inputs.values())
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  trained, got_vjp = jax.vjp(layer, *inputs.values())
  np.testing.assert_allclose(trained, want, rtol=1e-5, atol=1e-5)
  ct = jnp.asarray(np.random.default_rng(5).standard_normal(want.shape), jnp.float32)
  for name, a, b in zip(inputs, got_vjp(ct), want_vjp(ct)):
    # against the largest entry: W's gradient sums each relation's ~13K edges in float32
    error = np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max()
    assert error < 1e-4, f"{name}: max |d - d_ref| / max |d_ref| = {error:.1e}"


@pytest.mark.parametrize("heads,d", [(4, 8), (2, 32)])
def test_hgt_matches_reference_in_every_tier(device, heads, d):
  g = tier_graph(2)
  ga = hector.GraphArrays.from_graph(g)
  inputs = hgt_inputs(np.random.default_rng(2), g, heads, d)
  got = jax.jit(functools.partial(hector.hgt_message, ga))(*inputs.values())
  want = hgt_reference(ga, *inputs.values())
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_nodes_without_edges_get_zeros(device):
  g = tier_graph(3, n=800)
  ga = hector.GraphArrays.from_graph(g)
  inputs = rgat_inputs(np.random.default_rng(3), g, 8, 2, 4)
  got = np.asarray(hector.rgat_message(ga, *inputs.values()))
  empty = g.in_degree() == 0
  assert empty.any() and not np.isnan(got).any()
  np.testing.assert_array_equal(got[empty], 0.0)
