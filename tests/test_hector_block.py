"""Hector layers on sampled blocks (jaxdata.hector.block) against the same layers run full-graph.

A block built on the device from a padded, shuffled edge list must give the layers exactly
what `GraphArrays.from_graph` gives them for the same edges (outputs and gradients, every model,
every pass choice, float32 and bfloat16); `expand` must keep the frontier as a prefix and
deduplicate; and a two-layer model on blocks whose fanouts cover every in-edge must give the
full-graph model's outputs and parameter gradients at the seeds.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdata import hector
from jaxdata.data import HeteroGraph
from jaxdata.hector.block import block_graph, capacities, expand, frontier
from jaxdata.nn import HGT, RGAT, RGCN

N, R, E = 40, 3, 160  # node 39 is the padding node of the blocks
TYPES = (0, 12, 40)  # two node types for HGT; the padding node is of the last type


def random_edges(seed: int, padding: float = 0.3):
  rng = np.random.default_rng(seed)
  src, dst = rng.integers(0, N - 1, E), rng.integers(0, N - 1, E)
  etype = rng.integers(0, R, E)
  etype[:6] = 2  # some parallel edges of one relation, and a node with many of them
  src[:6], dst[:6] = 5, 7
  valid = rng.random(E) >= padding
  return src, dst, etype, valid


def full_graph(src, dst, etype, valid, types=None):
  g = HeteroGraph.from_edges(
    src[valid],
    dst[valid],
    etype[valid],
    num_nodes=N,
    relation_names=[f"r{i}" for i in range(R)],
    node_type_names=("a", "b") if types else ("node",),
    node_type_offsets=types,
  )
  return hector.GraphArrays.from_graph(g)


def make_layer(model: str, passes, dtype):
  rngs = nnx.Rngs(0)
  if model == "rgcn":
    return RGCN(8, 6, num_relations=R, dtype=dtype, rngs=rngs)
  if model == "rgcn-bases":
    return RGCN(8, 6, num_relations=R, num_bases=2, dtype=dtype, rngs=rngs)
  if model == "rgat":
    return RGAT(
      8, 3, num_relations=R, heads=2, self_loop=True, passes=passes, dtype=dtype, rngs=rngs
    )
  return HGT((8, 8), 8, num_relations=R, heads=2, passes=passes, dtype=dtype, rngs=rngs)


def call(layer, graph, x):
  if isinstance(layer, HGT):
    return jnp.concatenate(layer(graph, [x[: TYPES[1]], x[TYPES[1] :]]))
  return layer(graph, x)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("passes", [None, ()], ids=["all-passes", "no-passes"])
@pytest.mark.parametrize("model", ["rgcn", "rgcn-bases", "rgat", "hgt"])
def test_layer_on_block_equals_layer_on_the_same_graph(device, model, passes, dtype):
  if model.startswith("rgcn") and passes == ():
    pytest.skip("RGCN has no pass choice")
  src, dst, etype, valid = random_edges(1)
  types = TYPES if model == "hgt" else None
  want_graph = full_graph(src, dst, etype, valid, types)
  layer = make_layer(model, passes, dtype)
  x = jnp.asarray(np.random.default_rng(2).normal(size=(N, 8)), jnp.float32).at[N - 1].set(0)
  cot = jnp.asarray(np.random.default_rng(3).normal(size=call(layer, want_graph, x).shape))
  cot = cot.at[N - 1].set(0)  # the padding node's row is never read

  def loss(layer, graph, x):
    return jnp.vdot(call(layer, graph, x).astype(jnp.float32), cot)

  @nnx.jit
  def on_block(layer, x):
    g = block_graph(src, dst, etype, valid, num_nodes=N, num_relations=R, node_type_offsets=types)
    return call(layer, g, x), nnx.grad(loss, argnums=(0, 2))(layer, g, x)

  @nnx.jit
  def on_graph(layer, x):
    return call(layer, want_graph, x), nnx.grad(loss, argnums=(0, 2))(layer, want_graph, x)

  (got, (g_params, g_x)), (want, (w_params, w_x)) = on_block(layer, x), on_graph(layer, x)
  tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
  np.testing.assert_allclose(
    np.asarray(got[: N - 1], np.float32), np.asarray(want[: N - 1], np.float32), **tol
  )
  np.testing.assert_allclose(
    np.asarray(g_x[: N - 1], np.float32), np.asarray(w_x[: N - 1], np.float32), **tol
  )
  for a, b in zip(jax.tree.leaves(g_params), jax.tree.leaves(w_params)):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **tol)


def _stored_pair_gemm(graph, *args):
  """The KernelSpec of HGT's `K W_att`: a GEMM over the pairs that stores a row per pair."""
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      spec = eqn.params.get("spec")
      if eqn.primitive.name == "jaxdata_hector_kernel" and spec.kernel.template == "gemm":
        if spec.kernel.domain == "compact" and spec.kernel.out == "edge":
          found.append(spec)
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub)

  walk(jax.make_jaxpr(lambda *a: hector.hgt_message(graph, *a))(*args).jaxpr)
  return found[0]


@pytest.mark.parametrize("precision", ["highest", "default"])
def test_a_gemm_over_pairs_writes_zeros_for_the_unused_pairs(device, precision):
  """No GEMM tile covers a block's unused pairs (no relation): a GEMM that stores a row per pair
  writes theirs as 0 all the same, so no row of its output is left as the memory held."""
  src, dst, etype, valid = random_edges(4)
  g = block_graph(src, dst, etype, valid, num_nodes=N, num_relations=R)
  used = int(g.pair_rel_offsets[R])
  assert 0 < used < g.num_pairs
  rng = np.random.default_rng(5)
  k, q, v = (jnp.asarray(rng.normal(size=(N, 8)), jnp.float32) for _ in range(3))
  w_att, w_msg = (jnp.asarray(rng.normal(size=(R, 2, 4, 4)), jnp.float32) for _ in range(2))
  mu = jnp.ones((R, 2), jnp.float32)
  with jax.default_matmul_precision(precision):
    spec = _stored_pair_gemm(g, k, q, v, w_att, w_msg, mu)
    # freed NaNs of the output's size first: the allocator tends to hand that memory back
    junk = jnp.full(spec.out_shape, jnp.nan, jnp.float32).block_until_ready()
    del junk
    out = np.asarray(
      jax.jit(lambda g, x, w: hector.runtime.run_kernel(spec, g, [x, w]))(g, k, w_att)
    )
  assert (out[used:] == 0).all()
  ps, pe = np.asarray(g.pair_src)[:used], np.asarray(g.pair_etype)[:used]
  want = np.einsum("phk,phkn->phn", np.asarray(k)[ps].reshape(used, 2, 4), np.asarray(w_att)[pe])
  np.testing.assert_allclose(out[:used], want.reshape(used, 8), rtol=2e-3, atol=2e-3)


def test_block_graph_holds_the_valid_edges_with_their_norms():
  src, dst, etype, valid = random_edges(4)
  g = block_graph(src, dst, etype, valid, num_nodes=N, num_relations=R)
  want = full_graph(src, dst, etype, valid)
  for f in ("src", "dst", "etype", "norm"):
    a, b = np.asarray(getattr(g, f)), np.asarray(getattr(want, f))
    keep = np.asarray(g.norm) > 0
    np.testing.assert_array_equal(np.sort(a[keep]), np.sort(b), err_msg=f)
  # Padding edges are unused edges: from and to the padding node, no relation (R), norm 0,
  # after the used edges in relation order and after every group of the CSR and CSC views.
  pad = np.asarray(g.norm) == 0
  used = int(valid.sum())
  assert (~pad).sum() == used and int(g.rel_offsets[R]) == used
  et = np.asarray(g.etype)
  assert (np.flatnonzero(pad) == np.arange(used, E)).all() and (et[pad] == R).all()
  assert (np.asarray(g.src)[pad] == N - 1).all() and (np.asarray(g.dst)[pad] == N - 1).all()
  for offsets, listed in ((g.csr_offsets, g.csr_edges), (g.csc_offsets, g.csc_edges)):
    assert (
      int(offsets[N]) == used and (np.sort(np.asarray(listed)[used:]) == np.arange(used, E)).all()
    )
  assert g.num_pairs == E and g.num_edges == E
  # Pairs: one per distinct (source, relation) of the used edges, each naming its edges'
  # source and relation; after them the unused ones, (N - 1, R), the padding edges' first: no
  # relation, past pair_rel_offsets[R], so the kernels over pairs never visit them.
  src_, pair = np.asarray(g.src), np.asarray(g.pair)
  ps, pe = np.asarray(g.pair_src), np.asarray(g.pair_etype)
  distinct = sorted(set(zip(src_[:used].tolist(), et[:used].tolist())), key=lambda p: (p[1], p[0]))
  assert list(zip(ps[: len(distinct)].tolist(), pe[: len(distinct)].tolist())) == distinct
  np.testing.assert_array_equal(ps[pair], src_)
  np.testing.assert_array_equal(pe[pair], et)
  assert (ps[len(distinct) :] == N - 1).all() and (pe[len(distinct) :] == R).all()
  assert int(g.pair_rel_offsets[R]) == len(distinct) < g.num_pairs
  assert (pair[used:] == len(distinct)).all()  # the padding edges' pair: the first unused one


def test_unused_edges_and_pairs_are_checked_like_the_rest():
  """GraphArrays accepts a block's unused edges and pairs only as the last rows, with no
  relation, listed after the views' groups: each way of breaking that is a ValueError."""
  src, dst, etype, valid = random_edges(4)
  g = block_graph(src, dst, etype, valid, num_nodes=N, num_relations=R)
  used = int(valid.sum())
  fields = {f: np.asarray(getattr(g, f)).copy() for f in ("etype", "csc_offsets", "pair_etype")}

  def broken(field, change):
    arrays = dict(fields)
    arrays[field] = change(fields[field].copy())
    return lambda: dataclasses.replace(g, **{field: jnp.asarray(arrays[field])})

  for field, change, match in (
    ("etype", lambda a: a.__setitem__(0, R) or a, "etype"),  # no relation among the used
    ("etype", lambda a: a.__setitem__(E - 1, 0) or a, "etype"),  # a relation among the unused
    ("csc_offsets", lambda a: a.__setitem__(N, used - 1) or a, "csc"),  # a used edge past it
    ("pair_etype", lambda a: a.__setitem__(E - 1, 0) or a, "pair_etype"),
  ):
    with pytest.raises(ValueError, match=match):
      broken(field, change)()


def test_block_graph_with_no_valid_edges_and_bad_arguments():
  z = np.zeros(5, np.int32)
  g = block_graph(z, z, z, np.zeros(5, bool), num_nodes=3, num_relations=2)
  out = hector.rgcn_message(g, jnp.ones((3, 2)), jnp.ones((2, 2, 4)))
  np.testing.assert_array_equal(out, np.zeros((3, 4)))
  with pytest.raises(ValueError, match="norm must be one of"):
    block_graph(z, z, z, z > 0, num_nodes=3, num_relations=2, norm="sum")
  with pytest.raises(ValueError, match="dst must have the shape of src"):
    block_graph(z, z[:4], z, z > 0, num_nodes=3, num_relations=2)
  with pytest.raises(ValueError, match="num_nodes and num_relations must be >= 1"):
    block_graph(z, z, z, z > 0, num_nodes=0, num_relations=2)


def in_neighbours(graph: HeteroGraph, nodes: np.ndarray, mask: np.ndarray, width: int):
  """Every in-edge of each valid node, padded to `width`: ([C, width] src, mask, etype)."""
  offsets, edge_ids = graph.csc()
  c = len(nodes)
  nbrs, nmask, net = (
    np.zeros((c, width), np.int32),
    np.zeros((c, width), bool),
    np.zeros((c, width), np.int32),
  )
  for i, (v, m) in enumerate(zip(nodes, mask)):
    if m:
      ids = edge_ids[offsets[v] : offsets[v + 1]]
      assert len(ids) <= width
      nbrs[i, : len(ids)] = graph.src[ids]
      net[i, : len(ids)] = graph.etype[ids]
      nmask[i, : len(ids)] = True
  return nbrs, nmask, net


def test_expand_keeps_the_frontier_as_prefix_and_deduplicates():
  rng = np.random.default_rng(5)
  seeds = np.array([3, 9, 3, -1, 17], np.int32)  # a repeat and a padded seed
  nodes, mask = frontier(seeds)
  np.testing.assert_array_equal(np.asarray(nodes), [3, 9, -1, -1, 17, -1])
  c, f = nodes.shape[0], 4
  nbrs = rng.integers(0, 12, (c, f)).astype(np.int32)
  nmask = rng.random((c, f)) < 0.8
  net = rng.integers(0, R, (c, f)).astype(np.int32)
  nodes1, mask1, (src, dst, etype, valid) = jax.jit(expand)(nodes, mask, nbrs, nmask, net)
  nodes1, mask1 = np.asarray(nodes1), np.asarray(mask1)
  assert nodes1.shape == (c * (1 + f) + 1,) and capacities(5, (f,)) == (c, len(nodes1))
  np.testing.assert_array_equal(nodes1[:c], np.asarray(nodes))
  real = nodes1[mask1]
  assert len(set(real.tolist())) == len(real), "a node twice in one frontier"
  want = set(np.asarray(nodes)[np.asarray(mask)]) | set(nbrs[nmask & np.asarray(mask)[:, None]])
  assert set(real.tolist()) == want
  assert not mask1[-1]
  src, dst, etype, valid = map(np.asarray, (src, dst, etype, valid))
  # every valid edge maps back to its global ends and relation
  np.testing.assert_array_equal(valid, (nmask & np.asarray(mask)[:, None]).reshape(-1))
  np.testing.assert_array_equal(nodes1[src[valid]], nbrs.reshape(-1)[valid])
  np.testing.assert_array_equal(
    np.asarray(nodes)[dst[valid]], np.repeat(np.asarray(nodes), f)[valid]
  )
  np.testing.assert_array_equal(etype[valid], net.reshape(-1)[valid])


class TwoLayers(nnx.Module):
  def __init__(self, model: str):
    rngs = nnx.Rngs(7)
    if model == "rgcn":
      self.l1 = RGCN(8, 8, num_relations=R, rngs=rngs)
      self.l2 = RGCN(8, 3, num_relations=R, rngs=rngs)
    else:
      self.l1 = RGAT(8, 4, num_relations=R, heads=2, self_loop=True, rngs=rngs)
      self.l2 = RGAT(8, 3, num_relations=R, heads=1, self_loop=True, rngs=rngs)

  def __call__(self, graphs, x, rows):
    """graphs: the input-side graph first; rows: the rows each layer's output keeps."""
    h = x
    for layer, graph, keep in zip((self.l1, self.l2), graphs, rows):
      h = layer(graph, h)[:keep]
      h = jax.nn.relu(h) if layer is self.l1 else h
    return h


@pytest.mark.parametrize("model", ["rgcn", "rgat"])
def test_minibatch_with_full_fanout_equals_full_graph(device, model):
  src, dst, etype, valid = random_edges(6, padding=0.0)
  graph = HeteroGraph.from_edges(
    src, dst, etype, num_nodes=N, relation_names=[f"r{i}" for i in range(R)]
  )
  full = hector.GraphArrays.from_graph(graph)
  width = int(graph.in_degree().max())
  x_all = np.random.default_rng(8).normal(size=(N, 8)).astype(np.float32)
  seeds = np.array([7, 0, 21, 7, 33, -1], np.int32)
  labels = np.random.default_rng(9).normal(size=(len(seeds) + 1, 3)).astype(np.float32)

  # blocks, hop by hop, with every in-edge drawn (the host side here; a sampler in training)
  nodes0, mask0 = frontier(seeds)
  nbrs, nm, net = in_neighbours(graph, np.asarray(nodes0), np.asarray(mask0), width)
  nodes1, mask1, e0 = expand(nodes0, mask0, nbrs, nm, net)
  nbrs, nm, net = in_neighbours(graph, np.asarray(nodes1), np.asarray(mask1), width)
  nodes2, mask2, e1 = expand(nodes1, mask1, nbrs, nm, net)
  g0 = block_graph(*e0, num_nodes=len(nodes1), num_relations=R)
  g1 = block_graph(*e1, num_nodes=len(nodes2), num_relations=R)
  x = np.where(np.asarray(mask2)[:, None], x_all[np.maximum(np.asarray(nodes2), 0)], 0)
  keep = np.asarray(mask0)

  model_ = TwoLayers(model)

  def loss_blocks(m):
    out = m((g1, g0), jnp.asarray(x), (len(nodes1), len(nodes0)))
    return jnp.sum(jnp.where(keep[:, None], out * labels, 0)), out

  def loss_full(m):
    out = m((full, full), jnp.asarray(x_all), (N, N))
    rows = out[np.maximum(np.asarray(nodes0), 0)]
    return jnp.sum(jnp.where(keep[:, None], rows * labels, 0)), rows

  with jax.default_matmul_precision("highest"):
    (lb, ob), gb = nnx.jit(nnx.value_and_grad(loss_blocks, has_aux=True))(model_)
    (lf, of), gf = nnx.jit(nnx.value_and_grad(loss_full, has_aux=True))(model_)
  np.testing.assert_allclose(np.asarray(ob)[keep], np.asarray(of)[keep], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(lb, lf, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(gb), jax.tree.leaves(gf)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
