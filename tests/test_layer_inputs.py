"""Graph layers on degenerate graphs (no nodes, no relations, relations without edges) agree with
NumPy, and bad inputs get errors that name the argument and the shape expected.

Tiny graphs and one feature width, so the generated kernels compile once for the file.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdata import hector
from jaxdata.data.graph import HeteroGraph
from jaxdata.nn import HGT, RGAT, RGCN

D_IN, D_OUT = 3, 2


def rgcn_numpy(layer: RGCN, g: HeteroGraph, x) -> np.ndarray:
  """out_i = x_i W_0 + b + sum_r mean_{j -> i of relation r} x_j W_r, in float64."""
  x = np.asarray(x, np.float64)
  w = np.asarray(layer.relation_weights(), np.float64)
  out = np.zeros((g.num_nodes, D_OUT))
  for r in range(g.num_relations):
    for i in range(g.num_nodes):
      into = (g.dst == i) & (g.etype == r)
      if into.any():
        out[i] += (x[g.src[into]] @ w[r]).mean(axis=0)
  w0 = layer.self_loop_weight()
  if w0 is not None:
    out += x @ np.asarray(w0, np.float64)
  if layer.bias is not None:
    out += np.asarray(layer.bias[...], np.float64)
  return out


def rgat_numpy(layer: RGAT, g: HeteroGraph, x) -> np.ndarray:
  """The formula of `jaxdata.nn.rgat`, edge by edge, in float64."""
  x = np.asarray(x, np.float64)
  w, a_src, a_dst = (
    np.asarray(p[...], np.float64) for p in (layer.weight, layer.a_src, layer.a_dst)
  )
  heads, d = a_src.shape[1:]
  out = np.zeros((g.num_nodes, heads, d))
  for i in range(g.num_nodes):
    into = np.flatnonzero(g.dst == i)
    if not into.size:
      continue
    msgs = np.stack([(x[g.src[e]] @ w[g.etype[e]]).reshape(heads, d) for e in into])
    mine = np.stack([(x[i] @ w[g.etype[e]]).reshape(heads, d) for e in into])
    s = (msgs * a_src[g.etype[into]]).sum(-1) + (mine * a_dst[g.etype[into]]).sum(-1)
    s = np.where(s > 0, s, 0.2 * s)
    alpha = np.exp(s - s.max(axis=0))
    alpha /= alpha.sum(axis=0)
    out[i] = (alpha[..., None] * msgs).sum(axis=0)
  out = out.reshape(g.num_nodes, heads * d) if layer.concat else out.mean(axis=1)
  if layer.root is not None:
    out += x @ np.asarray(layer.root[...], np.float64)
  if layer.bias is not None:
    out += np.asarray(layer.bias[...], np.float64)
  return out


def graph(src, dst, etype, num_nodes, num_relations):
  g = HeteroGraph.from_edges(
    np.asarray(src, np.int64),
    np.asarray(dst, np.int64),
    np.asarray(etype, np.int64),
    num_nodes=num_nodes,
    relation_names=[f"r{r}" for r in range(num_relations)],
  )
  return g, hector.GraphArrays.from_graph(g)


def features(n: int, seed: int = 0) -> jax.Array:
  return jnp.asarray(np.random.default_rng(seed).normal(size=(n, D_IN)), jnp.float32)


@pytest.mark.parametrize("bases", [None, 2])
def test_rgcn_without_relations_is_its_self_loop_and_bias(bases):
  g, ga = graph([], [], [], 3, 0)
  self_loop = True if bases is None else "basis"
  layer = RGCN(D_IN, D_OUT, num_relations=0, num_bases=bases, self_loop=self_loop, rngs=nnx.Rngs(0))
  assert layer.relation_weights().shape == (0, D_IN, D_OUT)
  x = features(3)
  np.testing.assert_allclose(layer(ga, x), rgcn_numpy(layer, g, x), rtol=1e-5, atol=1e-6)
  grad = jax.grad(lambda x: layer(ga, x).sum())(x)
  assert grad.shape == x.shape and np.isfinite(grad).all()


@pytest.mark.parametrize("concat", [True, False])
def test_layers_on_a_graph_without_nodes_give_no_rows(concat):
  g, ga = graph([], [], [], 0, 2)
  x = jnp.zeros((0, D_IN))
  rgat = RGAT(
    D_IN, D_OUT, num_relations=2, heads=2, concat=concat, self_loop=True, rngs=nnx.Rngs(0)
  )
  assert rgat(ga, x).shape == (0, 2 * D_OUT if concat else D_OUT)
  assert jax.grad(lambda x: rgat(ga, x).sum())(x).shape == (0, D_IN)
  rgcn = RGCN(D_IN, D_OUT, num_relations=2, rngs=nnx.Rngs(0))
  assert rgcn(ga, x).shape == (0, D_OUT)
  hgt = HGT([D_IN], 2, num_relations=2, heads=2, rngs=nnx.Rngs(0))
  assert [y.shape for y in hgt(ga, [x])] == [(0, 2)]


def test_a_relation_without_edges_matches_numpy():
  # relation 1 has no edges; node 3 none into it
  g, ga = graph([0, 1, 2, 0], [1, 2, 0, 2], [0, 0, 2, 2], 4, 3)
  x = features(4, seed=1)
  rgcn = RGCN(D_IN, D_OUT, num_relations=3, rngs=nnx.Rngs(1))
  np.testing.assert_allclose(rgcn(ga, x), rgcn_numpy(rgcn, g, x), rtol=1e-5, atol=1e-5)
  for concat in (True, False):
    rgat = RGAT(D_IN, D_OUT, num_relations=3, heads=2, concat=concat, rngs=nnx.Rngs(2))
    np.testing.assert_allclose(rgat(ga, x), rgat_numpy(rgat, g, x), rtol=1e-5, atol=1e-5)


def test_a_python_list_is_a_layer_input():
  g, ga = graph([0, 1], [1, 2], [0, 1], 3, 2)
  x = features(3)
  as_list = np.asarray(x).tolist()
  for layer in (
    RGCN(D_IN, D_OUT, num_relations=2, rngs=nnx.Rngs(0)),
    RGAT(D_IN, D_OUT, num_relations=2, rngs=nnx.Rngs(0)),
  ):
    np.testing.assert_array_equal(layer(ga, as_list), layer(ga, x))
  hgt = HGT([D_IN], 2, num_relations=2, rngs=nnx.Rngs(0))
  np.testing.assert_array_equal(hgt(ga, [as_list])[0], hgt(ga, [x])[0])


@pytest.mark.parametrize("make", [RGCN, RGAT], ids=["RGCN", "RGAT"])
def test_layer_errors_name_the_argument_and_the_shape(make):
  g, ga = graph([0, 1], [1, 2], [0, 1], 3, 2)
  name = make.__name__
  layer = make(D_IN, D_OUT, num_relations=2, rngs=nnx.Rngs(0))
  want = rf"{name}: x must have shape \[num_nodes=3, in_features=3\], got"
  for bad in (jnp.ones((3, 4)), jnp.ones((4, 3)), jnp.ones((3,)), [[1.0, 2.0]]):
    with pytest.raises(ValueError, match=want):
      layer(ga, bad)
  with pytest.raises(TypeError, match=f"{name}: x must hold numbers"):
    layer(ga, np.array([["a"] * 3] * 3))
  with pytest.raises(TypeError, match=f"{name}: graph must be a jaxdata.hector.GraphArrays"):
    layer(g, jnp.ones((3, 3)))
  other = make(D_IN, D_OUT, num_relations=3, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=f"{name}: the layer was built for num_relations=3, the"):
    other(ga, jnp.ones((3, 3)))


def test_hgt_errors_name_the_node_type_input():
  _, ga = graph([0, 1], [1, 2], [0, 1], 3, 2)
  hgt = HGT([D_IN], 2, num_relations=2, rngs=nnx.Rngs(0))
  with pytest.raises(
    ValueError, match=r"HGT: xs\[0\] must have shape \[num_nodes, in_features=3\]"
  ):
    hgt(ga, [jnp.ones((3, 4))])
  with pytest.raises(TypeError, match="HGT: xs must be a list of feature arrays"):
    hgt(ga, jnp.ones((3, 3)))


def test_hector_names_the_input_of_a_wrong_width():
  _, ga = graph([0, 1], [1, 2], [0, 1], 3, 2)
  with pytest.raises(ValueError, match=r"input 'x' has rows of shape \(4,\), but weight 'W' of"):
    hector.rgcn_message(ga, jnp.ones((3, 4)), jnp.ones((2, 3, 2)))


@pytest.mark.parametrize("bad", [6.9, 2.0, "2", None, True])
def test_layer_sizes_must_be_ints(bad):
  rngs = nnx.Rngs(0)
  with pytest.raises(TypeError, match="RGCN: num_relations must be an int"):
    RGCN(D_IN, D_OUT, num_relations=bad, rngs=rngs)
  with pytest.raises(TypeError, match="RGAT: num_relations must be an int"):
    RGAT(D_IN, D_OUT, num_relations=bad, rngs=rngs)
  with pytest.raises(TypeError, match="HGT: num_relations must be an int"):
    HGT([D_IN], 2, num_relations=bad, rngs=rngs)
  with pytest.raises(TypeError, match="RGAT: heads must be an int"):
    RGAT(D_IN, D_OUT, num_relations=2, heads=bad, rngs=rngs)
  with pytest.raises(ValueError, match="RGAT: num_relations must be >= 1, got 0"):
    RGAT(D_IN, D_OUT, num_relations=0, rngs=rngs)
  with pytest.raises(ValueError, match="RGCN: num_relations must be >= 0, got -1"):
    RGCN(D_IN, D_OUT, num_relations=-1, rngs=rngs)


def test_hgt_with_a_relation_without_edges_matches_the_reference():
  """HGT on one node type whose relation 1 has no edges (and node 3 no in-edges at all), against
  jaxdata.reference.attention's per-edge formulation in float64, outputs and gradients."""
  from test_attention_layers import hgt_params, randomize  # pylint: disable=g-import-not-at-top

  from jaxdata.reference import attention as ref  # pylint: disable=g-import-not-at-top

  g, ga = graph([0, 1, 2, 0], [1, 2, 0, 2], [0, 0, 2, 2], 4, 3)
  x = features(4, seed=3)
  layer = HGT([D_IN], 4, num_relations=3, heads=2, rngs=nnx.Rngs(3))
  randomize(layer, 4)
  wide = lambda tree: jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), tree)  # noqa: E731
  reference = functools.partial(ref.HGT["per-edge weights"], *ref.Edges.from_graph(g))
  with jax.default_matmul_precision("highest"):
    (got,) = layer(ga, [x])
    (want,) = reference(wide([x]), wide(hgt_params(layer)), precision="highest")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    ct = np.random.default_rng(5).standard_normal(want.shape)
    gx = jax.grad(lambda x: jnp.vdot(layer(ga, [x])[0], ct.astype(np.float32)))(x)
    gw = jax.grad(lambda x: jnp.vdot(reference([x], wide(hgt_params(layer)))[0], ct))(wide(x))
    np.testing.assert_allclose(gx, gw, rtol=1e-4, atol=1e-5)


def test_layers_take_and_return_dicts_by_node_type():
  """On a graph that names its node types, RGCN and RGAT take ``{type: x}`` and give ``{type:
  h}`` (RGCN against NumPy), HGT a dict of per-type widths; mistakes name the type."""
  g = HeteroGraph.from_typed_edges(
    {("a", "r", "b"): ([0, 1, 2], [1, 0, 1]), ("b", "s", "a"): ([0, 1], [2, 2])},
    num_nodes={"a": 3, "b": 2},
  )
  ga = hector.GraphArrays.from_graph(g)
  x = np.random.default_rng(3).standard_normal((5, D_IN)).astype(np.float32)
  xs = {"b": x[3:], "a": x[:3]}  # any order: the graph's decides
  rgcn = RGCN(D_IN, D_OUT, num_relations=g.num_relations, rngs=nnx.Rngs(0))
  out = rgcn(ga, xs)
  assert list(out) == ["a", "b"]
  want = rgcn_numpy(rgcn, g, x)
  np.testing.assert_allclose(out["a"], want[:3], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(out["b"], want[3:], rtol=1e-5, atol=1e-5)
  rgat = RGAT(D_IN, D_OUT, num_relations=g.num_relations, heads=1, rngs=nnx.Rngs(0))
  whole = rgat(ga, x)
  np.testing.assert_allclose(np.concatenate(list(rgat(ga, xs).values())), whole, rtol=1e-6)
  hgt = HGT((D_IN, 4), 4, num_relations=g.num_relations, heads=2, rngs=nnx.Rngs(0))
  y = {"a": x[:3], "b": np.ones((2, 4), np.float32)}
  got = hgt(ga, y)
  for t, h in zip(["a", "b"], hgt(ga, [y["a"], y["b"]])):
    np.testing.assert_array_equal(got[t], h)
  with pytest.raises(ValueError, match=r"RGCN: x\['b'\] must have shape \[num_nodes=2"):
    rgcn(ga, {"a": x[:3], "b": x[3:, :2]})
  with pytest.raises(ValueError, match=r"RGAT: x lacks node types \['b'\]"):
    rgat(ga, {"a": x[:3]})
  with pytest.raises(ValueError, match=r"HGT: xs names node types \['c'\]"):
    hgt(ga, {**y, "c": x})
  untyped = hector.GraphArrays.from_graph(HeteroGraph.from_edges([0], [1], [0], num_nodes=2))
  with pytest.raises(ValueError, match="the graph names no node types"):
    RGCN(D_IN, D_OUT, num_relations=1, rngs=nnx.Rngs(0))(untyped, {"a": x[:2]})
