"""jaxdata.nn.RGAT and jaxdata.nn.HGT against jaxdata.reference.attention's plain-JAX layers given
the same weights (HGT: PyG's HGTConv semantics), and `jaxdata train rgat|hgt` learning on a tiny
synthetic ogbn-mag.

Precision: the layers' dense terms (HGT's projections, RGAT's self loop) are `jnp.dot`s that
follow `jax.default_matmul_precision` (TF32 by default on NVIDIA GPUs) while the references ask
for "highest", so comparisons run the layers under ``highest()``. The HGT references run in
float64 through the per-edge formulation: `jax.lax.ragged_dot_general` in float64 fails XLA's
GPU verifier ("A dimension number is not unique in Dot", jax 0.11.2)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdata import hector
from jaxdata.data import synthetic_mag
from jaxdata.nn import HGT, RGAT
from jaxdata.reference import attention as attention_ref

try:  # the PyG peers; without torch and torch_geometric the tests that need them skip
  from jaxdata.reference import pyg as pyg_ref
except ImportError:
  pyg_ref = None
from jaxdata.train import attention

HI = jax.lax.Precision.HIGHEST
#: the plain-JAX HGT reference: float64-safe on every platform (no ragged_dot_general)
HGT_REFERENCE = attention_ref.HGT["per-edge weights"]


def highest():
  """Matmuls at full float32 inside: the layers' precision, matched to the references'."""
  return jax.default_matmul_precision("highest")


@nnx.jit
def apply(layer, graph, x):
  """layer(graph, x), jitted once per layer structure and input shapes (shared by the tests)."""
  return layer(graph, x)


@functools.cache
def mag():
  """About 200 nodes of four types, 4,200 edges of eight relations, 4 classes."""
  ds = synthetic_mag(scale=1e-4, seed=0, num_classes=4)
  return ds, hector.GraphArrays.from_graph(ds.graph), attention_ref.Edges.from_graph(ds.graph)


def hgt_params(layer: HGT) -> attention_ref.HGTParams:
  """The layer's weights in jaxdata.reference.attention's layout (as PyG's kqv_lin splits them)."""
  f = layer.heads * layer.head_features
  kernels = [lin.kernel[...] for lin in layer.kqv]
  biases = [lin.bias[...] for lin in layer.kqv]
  part = lambda arrays, i: tuple(a[..., i * f : (i + 1) * f] for a in arrays)  # noqa: E731
  return attention_ref.HGTParams(
    part(kernels, 0),
    part(biases, 0),
    part(kernels, 1),
    part(biases, 1),
    part(kernels, 2),
    part(biases, 2),
    tuple(lin.kernel[...] for lin in layer.out),
    tuple(lin.bias[...] for lin in layer.out),
    layer.w_att[...],
    layer.w_msg[...],
    layer.mu[...],
    layer.skip[...],
  )


def randomize(layer: nnx.Module, seed: int):
  """Every parameter redrawn (biases, priors and skip logits are constants at initialization)."""
  rng = np.random.default_rng(seed)
  state = nnx.state(layer, nnx.Param)
  nnx.update(
    layer, jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape) * 0.4, p.dtype), state)
  )


def test_hgt_layer_matches_reference(device):
  """Every pass on (tests/test_hector_hgt.py covers the pass choices of the edge part)."""
  ds, ga, edges = mag()
  xs = [jnp.asarray(x) for x in ds.features]
  # out 32 = 4 heads of 8: the skip gate mixes types of width 32 (institution) only
  layer = HGT(
    [x.shape[1] for x in xs], 32, num_relations=ga.num_relations, heads=4, rngs=nnx.Rngs(0)
  )
  randomize(layer, 1)
  # the reference in float64 from the same weights
  wide = lambda tree: jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), tree)  # noqa: E731
  xs64, params = wide(xs), wide(hgt_params(layer))
  reference = jax.jit(functools.partial(HGT_REFERENCE, *edges, precision=HI))
  with highest():
    got = apply(layer, ga, xs)
  want = reference(xs64, params)
  for t, (a, b) in enumerate(zip(got, want)):
    assert a.shape == b.shape and a.dtype == jnp.float32
    # 5e-5: on the GPU hector sums with float atomics in any order (the H200 once gave 3.1e-5
    # at a value of 0.37; float32 programs, a float64 reference)
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=5e-5, err_msg=ds.graph.node_type_names[t])

  cts = [np.random.default_rng(t).standard_normal(o.shape) for t, o in enumerate(want)]
  loss = lambda outs: sum(jnp.vdot(o, c.astype(o.dtype)) for o, c in zip(outs, cts))  # noqa
  with highest():
    grads = nnx.jit(nnx.grad(lambda m, xs: loss(m(ga, xs))))(layer, xs)
  want_grads = jax.jit(jax.grad(lambda p: loss(reference(xs64, p))))(params)
  # sums over 4,200 edges of terms up to ~10 in float32
  close = functools.partial(np.testing.assert_allclose, rtol=1e-3, atol=1e-3)
  close(grads["w_att"][...], want_grads.w_att)
  close(grads["w_msg"][...], want_grads.w_msg)
  close(grads["mu"][...], want_grads.mu)
  close(grads["skip"][...], want_grads.skip)
  f = 32
  for t in range(len(xs)):
    kqv = grads["kqv"][t]["kernel"][...]
    for i, w in enumerate((want_grads.k_w, want_grads.q_w, want_grads.v_w)):
      close(kqv[:, i * f : (i + 1) * f], w[t])
    close(grads["out"][t]["kernel"][...], want_grads.a_w[t])


def test_hgt_layer_matches_pyg_hgtconv():
  """The layer and PyG's HGTConv holding its weights (float64 in torch), on the CPU."""
  torch = pytest.importorskip("torch")
  pytest.importorskip("torch_geometric")
  ds, ga, _ = mag()
  types, relations = ds.graph.node_type_names, list(ds.relation_types)
  layer = HGT(
    [x.shape[1] for x in ds.features], 32, num_relations=ga.num_relations, heads=4, rngs=nnx.Rngs(2)
  )
  randomize(layer, 5)
  conv = pyg_ref.pyg_hgt_conv(
    jax.tree.map(np.asarray, hgt_params(layer)),
    types,
    relations,
    device=torch.device("cpu"),
    dtype=torch.float64,
  )
  x_dict, edge_index_dict = pyg_ref.pyg_hetero_inputs(
    ds.graph.src,
    ds.graph.dst,
    ds.graph.etype,
    [torch.from_numpy(x.astype(np.float64)) for x in ds.features],
    types,
    relations,
    device=torch.device("cpu"),
  )
  with torch.no_grad():
    want = conv(x_dict, edge_index_dict)
  with jax.default_device(jax.devices("cpu")[0]):
    got = apply(layer, ga, [jnp.asarray(x) for x in ds.features])
  for t, name in enumerate(types):
    if name in want:  # PyG returns nothing for types no relation points to (all do here)
      np.testing.assert_allclose(got[t], want[name].numpy(), rtol=5e-5, atol=5e-5, err_msg=name)
  assert set(want) == set(types)


def test_hgt_layer_bfloat16_and_checks(device):
  ds, ga, edges = mag()
  xs = [jnp.asarray(x) for x in ds.features]
  layer = HGT(
    [x.shape[1] for x in xs],
    32,
    num_relations=ga.num_relations,
    heads=4,
    passes=["compact"],
    dtype=jnp.bfloat16,
    rngs=nnx.Rngs(0),
  )
  assert layer.passes == ("compact",)
  got = apply(layer, ga, xs)
  want = jax.jit(functools.partial(HGT_REFERENCE, precision=HI))(*edges, xs, hgt_params(layer))
  for a, b in zip(got, want):
    assert a.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(a, np.float32), b, rtol=5e-2, atol=5e-2)
  with pytest.raises(ValueError, match="feature arrays"):
    layer(ga, xs[:3])
  with pytest.raises(ValueError, match=r"HGT: xs\[0\] must have shape \[num_nodes, in_features="):
    layer(ga, [xs[0][:, :5]] + xs[1:])
  with pytest.raises(ValueError, match="multiple of heads"):
    HGT([4], 10, num_relations=2, heads=4, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("passes", [None, ()], ids=["all-passes", "no-passes"])
def test_rgat_layer_matches_reference(device, passes):
  ds, ga, edges = mag()
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.standard_normal((ga.num_nodes, 12)), jnp.float32)
  plain = RGAT(
    12, 8, num_relations=ga.num_relations, heads=3, use_bias=False, passes=passes, rngs=nnx.Rngs(1)
  )
  params = attention_ref.RGATParams(plain.weight[...], plain.a_src[...], plain.a_dst[...])
  want = attention_ref.RGAT["ragged_dot"](*edges, x, params, precision=HI)
  got = apply(plain, ga, x)
  assert got.shape == (ga.num_nodes, 24)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)

  # self loop, bias, heads averaged: the same attention plus dense terms
  full = RGAT(
    12,
    8,
    num_relations=ga.num_relations,
    heads=3,
    concat=False,
    self_loop=True,
    passes=passes,
    rngs=nnx.Rngs(1),
  )
  randomize(full, 3)
  params = attention_ref.RGATParams(full.weight[...], full.a_src[...], full.a_dst[...])
  ref = lambda x, p, root, bias: (  # noqa: E731
    (attention_ref.RGAT["ragged_dot"](*edges, x, p, precision=HI) + jnp.dot(x, root, precision=HI))
    .reshape(-1, 3, 8)
    .mean(1)
    + bias
  )
  with highest():  # the self loop is a jnp.dot at the default precision
    got = apply(full, ga, x)
  np.testing.assert_allclose(
    got, ref(x, params, full.root[...], full.bias[...]), rtol=2e-5, atol=2e-5
  )
  ct = jnp.asarray(rng.standard_normal((ga.num_nodes, 8)), jnp.float32)
  with highest():
    grads = nnx.jit(nnx.grad(lambda m, x: jnp.vdot(m(ga, x), ct)))(full, x)
  want = jax.jit(jax.grad(lambda *a: jnp.vdot(ref(x, *a), ct), argnums=(0, 1, 2)))(
    params, full.root[...], full.bias[...]
  )
  for name, w in (
    ("weight", want[0].w),
    ("a_src", want[0].a_src),
    ("a_dst", want[0].a_dst),
    ("root", want[1]),
    ("bias", want[2]),
  ):
    np.testing.assert_allclose(grads[name][...], w, rtol=1e-4, atol=1e-4, err_msg=name)


def test_rgat_layer_bfloat16(device):
  _, ga, edges = mag()
  x = jnp.asarray(np.random.default_rng(4).standard_normal((ga.num_nodes, 12)), jnp.bfloat16)
  layer = RGAT(
    12,
    8,
    num_relations=ga.num_relations,
    heads=2,
    use_bias=False,
    dtype=jnp.bfloat16,
    rngs=nnx.Rngs(0),
  )
  got = apply(layer, ga, x)
  assert got.dtype == jnp.bfloat16
  params = attention_ref.RGATParams(layer.weight[...], layer.a_src[...], layer.a_dst[...])
  want = jax.jit(functools.partial(attention_ref.RGAT["ragged_dot"], precision=HI))(
    *edges, x.astype(jnp.float32), params
  )
  np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=3e-2, atol=3e-2)


def test_training_learns():
  """RGAT, a few epochs on a tiny synthetic ogbn-mag (4 classes, about 150 papers): well above
  chance. (HGT: test_cli_train.)"""
  ds = synthetic_mag(scale=2e-4, seed=1, num_classes=4)
  config = attention.TrainConfig(model="rgat", epochs=15, hidden=16, heads=2, learning_rate=0.01)
  seen = []
  result = attention.train(ds, config, on_epoch=seen.append)
  assert [r["epoch"] for r in seen] == list(range(1, 16))
  assert seen[-1]["loss"] < seen[0]["loss"] / 2
  assert result.val_accuracy + result.test_accuracy > 2 * 0.6, (
    result.val_accuracy,
    result.test_accuracy,
  )


def test_cli_train(tmp_path, capsys):
  """`jaxdata train hgt` on the same tiny graph learns too."""
  from jaxdata import cli

  out = tmp_path / "hgt-checkpoint"
  assert (
    cli.main(
      [
        "train",
        "hgt",
        "--scale",
        "2e-4",
        "--classes",
        "4",
        "--epochs",
        "15",
        "--hidden",
        "16",
        "--heads",
        "2",
        "--lr",
        "0.01",
        "--seed",
        "1",
        "--out",
        str(out),
      ]
    )
    == 0
  )
  text = " ".join(capsys.readouterr().out.split())
  assert "epoch 15" in text and "chance 0.2500" in text and (out / "history.json").exists()
  val = float(text.split("validation accuracy ")[1].split(",")[0])
  test = float(text.split("test accuracy ")[1].split()[0])
  assert val + test > 2 * 0.6, (val, test)
  with pytest.raises(ValueError, match="unknown passes"):
    attention.TrainConfig(passes=("fuse",))


def test_hgt_on_slots_equals_the_layer_on_nodes_in_any_order(device):
  # A sampled block holds nodes of every type in sampling order: on_slots on a random order of
  # the nodes (the graph relabelled to match) gives each node the row __call__ gives it, and
  # with rows=k only the first k.
  from jaxdata.data import HeteroGraph

  ds, ga, _ = mag()
  g = ds.graph
  xs = [jnp.asarray(x) for x in ds.features]
  layer = HGT(
    [x.shape[1] for x in xs], 32, num_relations=ga.num_relations, heads=4, rngs=nnx.Rngs(0)
  )
  randomize(layer, 2)
  with highest():
    want = np.concatenate([np.asarray(o) for o in apply(layer, ga, xs)])
  perm = np.random.default_rng(5).permutation(g.num_nodes)  # node n sits in slot perm[n]
  shuffled = hector.GraphArrays.from_graph(
    HeteroGraph.from_edges(
      perm[g.src], perm[g.dst], g.etype, num_nodes=g.num_nodes, relation_names=g.relation_names
    )
  )
  types = np.empty(g.num_nodes, np.int32)
  types[perm] = np.searchsorted(
    np.asarray(g.node_type_offsets[1:]), np.arange(g.num_nodes), side="right"
  )
  slot_xs = []
  for t, x in enumerate(ds.features):
    a = np.zeros((g.num_nodes, x.shape[1]), np.float32)
    a[perm[g.node_type_offsets[t] : g.node_type_offsets[t + 1]]] = x
    slot_xs.append(jnp.asarray(a))
  with highest():
    got = nnx.jit(lambda m, xs, ty: m.on_slots(shuffled, xs, ty))(
      layer, slot_xs, jnp.asarray(types)
    )
    first = nnx.jit(lambda m, xs, ty: m.on_slots(shuffled, xs, ty, rows=50))(
      layer, slot_xs, jnp.asarray(types)
    )
  # Two float32 programs, each within 2e-5 of float64 (test_hgt_layer_matches_reference), and
  # on a GPU the kernels' float atomics add in any order: within 5e-5 of each other.
  np.testing.assert_allclose(np.asarray(got)[perm], want, rtol=5e-5, atol=5e-5)
  np.testing.assert_allclose(first, np.asarray(got)[:50], rtol=5e-5, atol=5e-5)
  with pytest.raises(ValueError, match="rows=-1"):
    layer.on_slots(shuffled, slot_xs, jnp.asarray(types), rows=-1)
  with pytest.raises(ValueError, match=r"HGT.on_slots: xs\[0\] must have shape"):
    layer.on_slots(shuffled, slot_xs[::-1], jnp.asarray(types))


@pytest.mark.parametrize("bias", [True, False])
def test_typed_linear_is_each_rows_own_types_linear(bias):
  from jaxdata.nn import typed_linear

  rng = np.random.default_rng(0)
  widths, n = (3, 5, 2), 13
  lins = [nnx.Linear(d, 4, use_bias=bias, rngs=nnx.Rngs(t)) for t, d in enumerate(widths)]
  types = rng.integers(-1, len(widths), n)
  xs = [rng.normal(size=(n, d)).astype(np.float32) for d in widths]
  got = typed_linear(lins, xs, jnp.asarray(types), dtype=jnp.float32, precision="highest")
  want = [
    np.asarray(xs[t][i] @ np.asarray(lins[t].kernel[...]))
    + (np.asarray(lins[t].bias[...]) if bias else 0)
    if t >= 0
    else np.zeros(4)
    for i, t in enumerate(types)
  ]
  np.testing.assert_allclose(np.asarray(got), np.stack(want), rtol=1e-5, atol=1e-6)
