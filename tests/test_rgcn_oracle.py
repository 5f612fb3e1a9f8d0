"""PyTorch Geometric's RGCNConv as the oracle for the RGCN formulations, on the CPU.

Every formulation the benchmark times (the plain-JAX ones and, once built, jaxdata's generated
kernel) must compute what RGCNConv(aggr="mean") computes from the same weights: forward and the
gradients with respect to x and W. Float64 on both sides, so the tolerances are tight.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import rgnn_peers as peers
from jaxdata.reference import rgcn as rgcn_ref

torch = pytest.importorskip("torch")
pytest.importorskip("torch_geometric")
from jaxdata.reference import pyg as pyg_ref  # noqa: E402  (after the skips)


@pytest.fixture(autouse=True)
def on_cpu():
  """CPU tests: on a GPU machine JAX would default to the GPU (and TF32 matmuls)."""
  with jax.default_device(jax.devices("cpu")[0]):
    yield


CPU = torch.device("cpu")
TOL = dict(rtol=1e-9, atol=1e-11)
TOL32 = dict(rtol=2e-5, atol=2e-5)


def random_graph(seed, num_nodes=30, num_edges=160, num_relations=6, empty=(2,)):
  """Random edges; relations in `empty` get none; a third of the nodes get no in-edges."""
  rng = np.random.default_rng(seed)
  used = np.array([r for r in range(num_relations) if r not in empty])
  targets = rng.choice(num_nodes, 2 * num_nodes // 3, replace=False)
  src = rng.integers(0, num_nodes, num_edges)
  dst = rng.choice(targets, num_edges)
  etype = rng.choice(used, num_edges)
  return rng, src, dst, etype


def jaxdata_formulation_or_skip(src, dst, etype, num_nodes, num_relations):
  """jaxdata's kernel through the benchmark's adapter; skips while it is not built."""
  try:
    graph = peers.hetero_graph(src, dst, etype, num_nodes=num_nodes, num_relations=num_relations)
    return peers.jaxdata_formulation(graph)
  except peers.Unavailable as e:
    pytest.skip(str(e))


FORMULATIONS = [*rgcn_ref.PLAIN_JAX, "jaxdata"]


def formulation(name, src, dst, etype, num_nodes, num_relations):
  if name == "jaxdata":
    return jaxdata_formulation_or_skip(src, dst, etype, num_nodes, num_relations)
  edges = rgcn_ref.EdgeArrays.build(
    src, dst, etype, num_nodes=num_nodes, num_relations=num_relations, dtype=np.float64
  )
  return peers.plain_jax(name, edges, num_nodes)


def pyg_reference(src, dst, etype, x, w, ct, **layer):
  """RGCNConv's output and gradients (x, W, and root/bias when given) as NumPy."""
  conv = pyg_ref.pyg_conv(w, device=CPU, dtype=torch.float64, **layer)
  edge_index, edge_type = pyg_ref.pyg_graph(src, dst, etype, CPU)
  xt = None if x is None else torch.from_numpy(x).requires_grad_(True)
  with pyg_ref.pyg_per_relation_mean():
    out = conv(xt, edge_index, edge_type)
  (out * torch.from_numpy(ct)).sum().backward()
  grads = {"w": conv.weight.grad.numpy()}
  if xt is not None:
    grads["x"] = xt.grad.numpy()
  if conv.root is not None:
    grads["w_self"] = conv.root.grad.numpy()
  if conv.bias is not None:
    grads["bias"] = conv.bias.grad.numpy()
  return out.detach().numpy(), grads


@pytest.mark.parametrize("seed,num_relations,empty", [(0, 1, ()), (1, 6, (2,)), (2, 9, (0, 4, 8))])
@pytest.mark.parametrize("name", FORMULATIONS)
def test_relational_message_matches_pyg(name, seed, num_relations, empty):
  rng, src, dst, etype = random_graph(seed, num_relations=num_relations, empty=empty)
  n, d_in, d_out = 30, 7, 5
  form = formulation(name, src, dst, etype, n, num_relations)
  x = rng.standard_normal((n, d_in))
  w = rng.standard_normal((num_relations, d_in, d_out))
  ct = rng.standard_normal((n, d_out))
  want, want_grads = pyg_reference(src, dst, etype, x, w, ct)  # float64

  # jaxdata's kernels are float32 (and bfloat16): compare them in float32 against float64 PyG.
  dtype, tol = (np.float32, TOL32) if name == "jaxdata" else (np.float64, TOL)
  x, w, ct = (jnp.asarray(a, dtype) for a in (x, w, ct))
  got = jax.jit(form.message)(form.graph_args, x, w)
  assert got.dtype == dtype
  np.testing.assert_allclose(got, want, **tol)
  loss, (dx, dw) = peers.loss_and_grads(form)(x, w, form.graph_args, ct)
  np.testing.assert_allclose(loss, np.vdot(want, ct), **tol)
  np.testing.assert_allclose(dx, want_grads["x"], **tol)
  np.testing.assert_allclose(dw, want_grads["w"], **tol)


@pytest.mark.parametrize("name", ["featureless", "jaxdata"])
def test_featureless_matches_pyg(name):
  """x = None: RGCNConv's weight is [R, N, d_out] and node ids index it."""
  rng, src, dst, etype = random_graph(3)
  n, r, d_out = 30, 6, 4
  w = rng.standard_normal((r, n, d_out))
  ct = rng.standard_normal((n, d_out))
  want, want_grads = pyg_reference(src, dst, etype, None, w, ct)
  if name == "jaxdata":
    form, dtype, tol = formulation(name, src, dst, etype, n, r), np.float32, TOL32
  else:
    edges = rgcn_ref.EdgeArrays.build(
      src, dst, etype, num_nodes=n, num_relations=r, dtype=np.float64
    )
    form = peers.Formulation(name, lambda g, x, w: rgcn_ref.featureless(*g, n, x, w), edges)
    dtype, tol = np.float64, TOL
  w, ct = jnp.asarray(w, dtype), jnp.asarray(ct, dtype)
  np.testing.assert_allclose(form.message(form.graph_args, None, w), want, **tol)
  loss, dw = jax.value_and_grad(lambda w: jnp.vdot(form.message(form.graph_args, None, w), ct))(w)
  np.testing.assert_allclose(loss, np.vdot(want, ct), **tol)
  np.testing.assert_allclose(dw, want_grads["w"], **tol)


@pytest.mark.parametrize("featureless", [False, True], ids=["features", "featureless"])
def test_full_layer_matches_pyg(featureless):
  """Self loop and bias (root_weight=True, bias=True) on top of the relational message."""
  rng, src, dst, etype = random_graph(4)
  n, r, d_in, d_out = 30, 6, 7, 5
  edges = rgcn_ref.EdgeArrays.build(src, dst, etype, num_nodes=n, num_relations=r, dtype=np.float64)
  x = None if featureless else rng.standard_normal((n, d_in))
  w = rng.standard_normal((r, n if featureless else d_in, d_out))
  w_self = rng.standard_normal((n if featureless else d_in, d_out))
  bias = rng.standard_normal(d_out)
  ct = rng.standard_normal((n, d_out))
  want, want_grads = pyg_reference(src, dst, etype, x, w, ct, w_self=w_self, bias=bias)

  message = rgcn_ref.featureless if featureless else rgcn_ref.transform_all_then_gather
  xj = None if x is None else jnp.asarray(x)

  def loss(w, w_self, bias, x):
    out = rgcn_ref.full_layer(message, *edges, n, x, w, w_self, bias)
    return jnp.vdot(out, ct), out

  argnums = (0, 1, 2) if featureless else (0, 1, 2, 3)
  (_, out), grads = jax.value_and_grad(loss, argnums=argnums, has_aux=True)(
    jnp.asarray(w), jnp.asarray(w_self), jnp.asarray(bias), xj
  )
  np.testing.assert_allclose(out, want, **TOL)
  np.testing.assert_allclose(grads[0], want_grads["w"], **TOL)
  np.testing.assert_allclose(grads[1], want_grads["w_self"], **TOL)
  np.testing.assert_allclose(grads[2], want_grads["bias"], **TOL)
  if not featureless:
    np.testing.assert_allclose(grads[3], want_grads["x"], **TOL)


def test_per_relation_mean_even_with_segment_matmul_requested():
  """pyg_per_relation_mean keeps PyG's per-relation mean if the backend asks for segment_matmul."""
  import torch_geometric.backend  # pylint: disable=g-import-not-at-top

  rng, src, dst, etype = random_graph(5)
  n, r = 30, 6
  x, w = rng.standard_normal((n, 3)), rng.standard_normal((r, 3, 2))
  edges = rgcn_ref.EdgeArrays.build(src, dst, etype, num_nodes=n, num_relations=r, dtype=np.float64)
  saved = torch_geometric.backend.use_segment_matmul
  torch_geometric.backend.use_segment_matmul = True
  try:
    want, _ = pyg_reference(src, dst, etype, x, w, np.ones((n, 2)))
    assert torch_geometric.backend.use_segment_matmul is True  # restored after the context
  finally:
    torch_geometric.backend.use_segment_matmul = saved
  np.testing.assert_allclose(
    rgcn_ref.ragged_dot(*edges, n, jnp.asarray(x), jnp.asarray(w)), want, **TOL
  )
