"""jaxdata.hector: generated kernels against plain NumPy / JAX references, on every platform."""

import functools
import os
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdata import hector
from jaxdata.data import HeteroGraph
from jaxdata.hector import compiled, compiler


def random_graph(rng, n=60, e=500, r=7, empty_relations=(3,)):
  """A random multigraph with some relations left empty and some nodes with no in-edges."""
  src = rng.integers(0, n, e)
  dst = rng.integers(0, n - 5, e)  # the last 5 nodes receive nothing
  et = rng.choice([t for t in range(r) if t not in empty_relations], e)
  return HeteroGraph.from_edges(
    src, dst, et, num_nodes=n, relation_names=[f"r{i}" for i in range(r)]
  )


def reference_message(g: HeteroGraph, x, w):
  """out[i] = sum_{e: dst=i} norm[e] * x[src[e]] @ W[etype[e]], in float64 NumPy, edge by edge."""
  norm = g.edge_norm("mean").astype(np.float64)
  x = None if x is None else np.asarray(x, np.float64)
  w = np.asarray(w, np.float64)
  out = np.zeros((g.num_nodes, w.shape[2]))
  for e in range(g.num_edges):
    row = w[g.etype[e], g.src[e]] if x is None else x[g.src[e]] @ w[g.etype[e]]
    out[g.dst[e]] += norm[e] * row
  return out


def reference_jax(ga: hector.GraphArrays, x, w):
  msg = jnp.einsum("ei,eio->eo", x[ga.src], w[ga.etype], precision="highest")
  return jax.ops.segment_sum(msg * ga.norm[:, None], ga.dst, ga.num_nodes)


@pytest.mark.parametrize("din,dout", [(5, 7), (16, 16), (64, 32), (130, 70)])
def test_rgcn_forward_and_grads_match_reference(device, din, dout):
  rng = np.random.default_rng(din * 1000 + dout)
  g = random_graph(rng)
  ga = hector.GraphArrays.from_graph(g)
  x = rng.standard_normal((g.num_nodes, din)).astype(np.float32)
  w = (rng.standard_normal((g.num_relations, din, dout)) / np.sqrt(din)).astype(np.float32)
  ct = rng.standard_normal((g.num_nodes, dout)).astype(np.float32)

  out = jax.jit(hector.rgcn_message)(ga, jnp.asarray(x), jnp.asarray(w))
  np.testing.assert_allclose(out, reference_message(g, x, w), rtol=1e-5, atol=1e-5)

  loss = lambda f: lambda x, w: jnp.vdot(f(ga, x, w), ct)  # noqa: E731
  got = jax.jit(jax.grad(loss(hector.rgcn_message), argnums=(0, 1)))(x, w)
  want = jax.grad(loss(reference_jax), argnums=(0, 1))(
    jnp.asarray(x, jnp.float64), jnp.asarray(w, jnp.float64)
  )
  for a, b in zip(got, want):
    assert a.dtype == jnp.float32
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_rgcn_featureless_forward_and_grad(device):
  rng = np.random.default_rng(1)
  g = random_graph(rng)
  ga = hector.GraphArrays.from_graph(g)
  w = rng.standard_normal((g.num_relations, g.num_nodes, 9)).astype(np.float32)
  ct = rng.standard_normal((g.num_nodes, 9)).astype(np.float32)
  out = hector.rgcn_message(ga, None, jnp.asarray(w))
  np.testing.assert_allclose(out, reference_message(g, None, w), rtol=1e-5, atol=1e-5)

  def ref(w):
    return jax.ops.segment_sum(w[ga.etype, ga.src] * ga.norm[:, None], ga.dst, ga.num_nodes)

  got = jax.grad(lambda w: jnp.vdot(hector.rgcn_message(ga, None, w), ct))(w)
  want = jax.grad(lambda w: jnp.vdot(ref(w), ct))(jnp.asarray(w))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_rgcn_bfloat16(device):
  rng = np.random.default_rng(2)
  g = random_graph(rng)
  ga = hector.GraphArrays.from_graph(g)
  x = jnp.asarray(rng.standard_normal((g.num_nodes, 32)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((g.num_relations, 32, 16)) / 6, jnp.bfloat16)
  out = hector.rgcn_message(ga, x, w)
  assert out.dtype == jnp.bfloat16
  want = reference_message(g, np.asarray(x, np.float32), np.asarray(w, np.float32))
  np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=2e-2, atol=2e-2)
  gx, gw = jax.grad(
    lambda x, w: hector.rgcn_message(ga, x, w).astype(jnp.float32).sum(), argnums=(0, 1)
  )(x, w)
  assert gx.dtype == gw.dtype == jnp.bfloat16
  rx, rw = jax.grad(lambda x, w: reference_jax(ga, x, w).sum(), argnums=(0, 1))(
    x.astype(jnp.float32), w.astype(jnp.float32)
  )
  np.testing.assert_allclose(np.asarray(gx, np.float32), rx, rtol=3e-2, atol=3e-2)
  np.testing.assert_allclose(np.asarray(gw, np.float32), rw, rtol=3e-2, atol=5e-2)


def hub_graph(rng, n=300, e=4000, r=9, hubs=3):
  """Most edges leave a few hub sources (a power law's shape), so unique (source, relation)
  pairs are far fewer than edges; the rest are spread uniformly."""
  src = np.where(rng.random(e) < 0.8, rng.integers(0, hubs, e), rng.integers(0, n, e))
  return HeteroGraph.from_edges(
    src,
    rng.integers(0, n, e),
    rng.integers(0, r, e),
    num_nodes=n,
    relation_names=[f"r{i}" for i in range(r)],
  )


@pytest.mark.parametrize("precision", ["highest", "default"])  # CUDA or tensor cores on a GPU
@pytest.mark.parametrize("din,dout", [(8, 8), (64, 32)])
def test_rgcn_on_hub_sources_runs_its_products_per_pair_and_matches_reference(
  device, din, dout, precision
):
  rng = np.random.default_rng(din + dout)
  g = hub_graph(rng)
  ga = hector.GraphArrays.from_graph(g)
  assert ga.num_edges >= 4 * ga.num_pairs
  x = jnp.asarray(rng.standard_normal((g.num_nodes, din)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((g.num_relations, din, dout)) / np.sqrt(din), jnp.float32)
  ct = jnp.asarray(rng.standard_normal((g.num_nodes, dout)), jnp.float32)
  plan = hector.rgcn_layer.plan(ga, x=x, W=w)
  kernels = [i.kernel for i in plan.forward_kernels + plan.backward_kernels]
  gemms = [k for k in kernels if k.template in ("gemm", "weight_grad")]
  assert len(gemms) == 3 and all(k.domain == "compact" for k in gemms)

  message = functools.partial(hector.rgcn_message, precision=precision)
  tol = 1e-5 if precision == "highest" else 2e-3  # of the largest value; TF32 keeps 10 bits

  def close(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.abs(a - b).max() <= tol * np.abs(b).max()

  close(jax.jit(message)(ga, x, w), reference_message(g, x, w))
  loss = lambda f: lambda x, w: jnp.vdot(f(ga, x, w), ct)  # noqa: E731
  got = jax.jit(jax.grad(loss(message), argnums=(0, 1)))(x, w)
  want = jax.grad(loss(reference_jax), argnums=(0, 1))(
    jnp.asarray(x, jnp.float64), jnp.asarray(w, jnp.float64)
  )
  for a, b in zip(got, want):
    close(a, b)


def test_rgcn_on_uniform_sources_fuses_its_products_into_the_sum():
  g = random_graph(np.random.default_rng(5), n=400, e=1000)
  ga = hector.GraphArrays.from_graph(g)
  assert ga.num_edges < 2 * ga.num_pairs
  x, w = jnp.zeros((g.num_nodes, 8)), jnp.zeros((g.num_relations, 8, 4))
  (forward,) = [i.kernel for i in hector.rgcn_layer.plan(ga, x=x, W=w).forward_kernels]
  assert forward.template == "gemm" and forward.domain == "edge" and forward.out == "dst"


def test_vmap_over_features(device):
  rng = np.random.default_rng(3)
  g = random_graph(rng)
  ga = hector.GraphArrays.from_graph(g)
  xs = jnp.asarray(rng.standard_normal((3, g.num_nodes, 8)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((g.num_relations, 8, 4)), jnp.float32)
  got = jax.vmap(hector.rgcn_message, in_axes=(None, 0, None))(ga, xs, w)
  want = jnp.stack([reference_jax(ga, x, w) for x in xs])
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@hector.layer(x=hector.NODE, W=hector.RELATION_WEIGHT, V=hector.RELATION_WEIGHT)
def gated_two_way(g, x, W, V):
  """A user-written layer: a nonlinearity between the relation product and the sum (so the
  product is stored and a traversal sums it), plus messages the other way summed at sources."""
  forward = g.aggregate(g.norm * (g.src(x) @ W).tanh())
  backward = g.aggregate(g.dst(x) @ V, at="src")
  return forward + backward


def test_user_layer_uses_every_template_and_differentiates(device):
  rng = np.random.default_rng(4)
  g = random_graph(rng)
  ga = hector.GraphArrays.from_graph(g)
  x = jnp.asarray(rng.standard_normal((g.num_nodes, 6)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((g.num_relations, 6, 5)) / 3, jnp.float32)
  v = jnp.asarray(rng.standard_normal((g.num_relations, 6, 5)) / 3, jnp.float32)

  def ref(x, w, v):
    hi = jax.lax.Precision.HIGHEST
    f = jnp.tanh(jnp.einsum("ei,eio->eo", x[ga.src], w[ga.etype], precision=hi))
    b = jnp.einsum("ei,eio->eo", x[ga.dst], v[ga.etype], precision=hi)
    return jax.ops.segment_sum(f * ga.norm[:, None], ga.dst, ga.num_nodes) + jax.ops.segment_sum(
      b, ga.src, ga.num_nodes
    )

  plan = gated_two_way.plan(ga, x=x, W=w, V=v)
  templates = {k.kernel.template for k in plan.forward_kernels + plan.backward_kernels}
  assert templates == {"gemm", "weight_grad", "traversal", "dense"}
  np.testing.assert_allclose(gated_two_way(ga, x=x, W=w, V=v), ref(x, w, v), rtol=1e-5, atol=1e-5)
  ct = jnp.asarray(rng.standard_normal((g.num_nodes, 5)), jnp.float32)
  got = jax.grad(
    lambda *a: jnp.vdot(gated_two_way(ga, x=a[0], W=a[1], V=a[2]), ct), argnums=(0, 1, 2)
  )(x, w, v)
  want = jax.grad(lambda *a: jnp.vdot(ref(*a), ct), argnums=(0, 1, 2))(x, w, v)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_plan_prints_every_pass_and_sources_are_readable():
  rng = np.random.default_rng(5)
  g = random_graph(rng)
  ga = hector.GraphArrays.from_graph(g)
  x, w = jnp.zeros((g.num_nodes, 4)), jnp.zeros((g.num_relations, 4, 3))
  text = str(hector.rgcn_layer.plan(ga, x=x, W=w))
  for section in (
    "traced",
    "after shape inference",
    "after differentiation",
    "forward kernels",
    "backward kernels",
  ):
    assert f"== {section}" in text
  assert "weight_grad" in text and "linear(%" in text
  for target in ("cpu", "cuda"):
    src = hector.rgcn_layer.sources(ga, target, x=x, W=w)
    assert src.count("jaxdata_hector_kernel(") == 3  # forward GEMM, backward GEMM, weight grad
    assert "atomicAdd" in src if target == "cuda" else "parallel_for" in src


def test_bad_inputs_raise_clear_errors():
  rng = np.random.default_rng(6)
  g = random_graph(rng)
  ga = hector.GraphArrays.from_graph(g)
  x = jnp.zeros((g.num_nodes, 4))
  with pytest.raises(ValueError, match="weight 'W' must be"):
    hector.rgcn_message(ga, x, jnp.zeros((g.num_relations + 1, 4, 3)))
  with pytest.raises(ValueError, match="rows of shape"):
    hector.rgcn_message(ga, x, jnp.zeros((g.num_relations, 5, 3)))
  with pytest.raises(ValueError, match="input 'x' must be"):
    hector.rgcn_message(ga, jnp.zeros((g.num_nodes + 1, 4)), jnp.zeros((g.num_relations, 4, 3)))
  with pytest.raises(TypeError, match="floating point"):
    hector.rgcn_message(
      ga, jnp.zeros((g.num_nodes, 4), jnp.int32), jnp.zeros((g.num_relations, 4, 3))
    )
  with pytest.raises(TypeError, match="GraphArrays"):
    hector.rgcn_message(g, x, jnp.zeros((g.num_relations, 4, 3)))
  with pytest.raises(TypeError, match="gather nodes onto edges"):
    hector.layer(x=hector.NODE)(lambda g, x: g.aggregate(g.src(x) + x))


# ----------------------------------------------------------------------------- compile cache
def test_corrupt_cache_entry_is_rebuilt(tmp_path, monkeypatch):
  monkeypatch.setenv("JAXDATA_CACHE_DIR", str(tmp_path))
  source = 'extern "C" int answer() { return 42; }\n'
  first = compiler.compile_cpu(source)
  good = first.read_bytes()
  first.write_bytes(good[: len(good) // 2])  # a torn write
  with pytest.warns(UserWarning, match="corrupt"):
    second = compiler.compile_cpu(source)
  assert second == first and second.read_bytes() == good
  import ctypes

  assert ctypes.CDLL(str(second)).answer() == 42


def test_missing_compiler_says_what_to_install(tmp_path, monkeypatch):
  monkeypatch.setenv("JAXDATA_CACHE_DIR", str(tmp_path))
  monkeypatch.delenv("CXX", raising=False)  # no compiler named, none on PATH
  monkeypatch.setattr(shutil, "which", lambda name: None)
  with pytest.raises(compiler.CompilerNotFoundError, match="install"):
    compiler.compile_cpu('extern "C" int f() { return 0; }\n')
  monkeypatch.setattr(compiler, "nvrtc", lambda: None)
  with pytest.raises(compiler.CompilerNotFoundError, match="nvidia-cuda-nvrtc"):
    compiler.compile_cuda("__global__ void k() {}\n", 90)


def test_cache_survives_restart(tmp_path):
  """A second process finds every kernel on disk: it runs with no compiler at all."""
  script = textwrap.dedent("""
      import jax, jax.numpy as jnp, numpy as np
      jax.config.update("jax_platforms", "cpu")
      from jaxdata import hector
      from jaxdata.data import HeteroGraph
      g = HeteroGraph.from_edges(np.array([0, 1, 2]), np.array([1, 2, 0]), np.array([0, 1, 0]),
                                 num_nodes=3)
      ga = hector.GraphArrays.from_graph(g)
      x, w = jnp.ones((3, 4)), jnp.ones((2, 4, 2))
      dw = jax.grad(lambda x, w: hector.rgcn_message(ga, x, w).sum(), (0, 1))(x, w)[1]
      print(float(dw.sum()))
  """)
  env = dict(os.environ, JAXDATA_CACHE_DIR=str(tmp_path))
  first = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
  assert first.returncode == 0, first.stderr
  env.update(CXX="/nonexistent/c++", PATH=os.path.dirname(sys.executable))
  second = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
  assert second.returncode == 0, second.stderr
  assert (
    first.stdout == second.stdout and float(first.stdout) == 3 * 4 * 2
  )  # 3 edges, norm 1, x and ct all ones


@pytest.mark.skipif(
  shutil.which("nvcc") is None and compiler.nvrtc() is None, reason="neither nvcc nor NVRTC here"
)
def test_generated_cuda_compiles(tmp_path, monkeypatch):
  """Every CUDA template instance the tests use compiles (checked without a GPU, in CI)."""
  monkeypatch.setenv("JAXDATA_CACHE_DIR", str(tmp_path))
  rng = np.random.default_rng(7)
  g = random_graph(rng)
  ga = hector.GraphArrays.from_graph(g)
  cases = [
    (
      hector.rgcn_layer,
      dict(x=jnp.zeros((g.num_nodes, 130)), W=jnp.zeros((g.num_relations, 130, 70))),
    ),
    (
      hector.rgcn_layer,
      dict(
        x=jnp.zeros((g.num_nodes, 16), jnp.bfloat16),
        W=jnp.zeros((g.num_relations, 16, 16), jnp.bfloat16),
      ),
    ),
    (hector.rgcn_featureless_layer, dict(W=jnp.zeros((g.num_relations, g.num_nodes, 8)))),
    (
      gated_two_way,
      dict(
        x=jnp.zeros((g.num_nodes, 6)),
        W=jnp.zeros((g.num_relations, 6, 5)),
        V=jnp.zeros((g.num_relations, 6, 5)),
      ),
    ),
  ]
  count = 0
  for layer, inputs in cases:
    for part in layer.sources(ga, "cuda", **inputs).split("// ---- ")[1:]:
      source = part.split("\n", 1)[1]
      assert compiler.compile_cuda(source, 90).stat().st_size > 0
      count += 1
  assert count >= 10


@hector.layer(x=hector.NODE, W=hector.RELATION_WEIGHT, V=hector.RELATION_WEIGHT)
def stored_rows(g, x, W, V):
  """Two stored edge intermediates of 32 features: the GEMM's rows x[src] @ W (stored, then a
  traversal sums relu of them) and the traversal's rows x[src] * x[dst] (stored, then a GEMM
  reads them)."""
  return g.aggregate((g.src(x) @ W).relu()) + g.aggregate((g.src(x) * g.dst(x)) @ V)


def test_bfloat16_layers_store_wide_intermediates_rounded_to_nearest_even(device):
  """A bfloat16 layer's stored rows are bfloat16, rounded as XLA's convert rounds (to nearest,
  ties to even), by the GEMM epilogue and by the traversal alike. Integer inputs make every
  float32 sum exact in any order, and with one in-edge per node the output is the stored rows
  themselves: the result must equal jnp's rounding bit for bit."""
  n, r, d = 96, 3, 32
  rng = np.random.default_rng(11)
  src, dst = rng.permutation(n), np.arange(n)  # every node has exactly one in-edge
  g = HeteroGraph.from_edges(
    src, dst, rng.integers(0, r, n), num_nodes=n, relation_names=["a", "b", "c"]
  )
  ga = hector.GraphArrays.from_graph(g)
  x = jnp.asarray(rng.integers(-40, 41, (n, d)), jnp.bfloat16)  # products up to 1600: ties
  w = jnp.asarray(rng.integers(-8, 9, (r, d, d)), jnp.bfloat16)  # sums up to 2560, exact in f32
  eye = jnp.broadcast_to(jnp.eye(d, dtype=jnp.bfloat16), (r, d, d))
  plan = stored_rows.plan(ga, x=x, W=w, V=eye)
  specs = [
    compiled._spec(
      k, ["bfloat16"] * len(k.inputs), ga, "default", compiled.out_dtype(k, "bfloat16")
    )
    for k in plan.forward_kernels
    if k.kernel.template != "dense"
  ]
  # stored: the GEMM's rows, relu of them, the traversal's rows; summed: the two aggregates
  assert sorted(s.out_dtype for s in specs) == ["bfloat16"] * 3 + ["float32"] * 2

  got = stored_rows(ga, x=x, W=w, V=eye)
  assert got.dtype == jnp.bfloat16
  f32, hi = lambda a: np.asarray(a, np.float32), jax.lax.Precision.HIGHEST  # noqa: E731
  s, t, et = np.asarray(ga.src), np.asarray(ga.dst), np.asarray(ga.etype)
  gemm = jnp.einsum("ed,edo->eo", f32(x)[s], f32(w)[et], precision=hi)
  rows = jax.nn.relu(gemm.astype(jnp.bfloat16)).astype(jnp.float32)
  rows = rows + (f32(x)[s] * f32(x)[t]).astype(jnp.bfloat16).astype(jnp.float32)
  want = np.zeros((n, d), np.float32)
  want[t] = rows
  assert np.array_equal(f32(got), want.astype(jnp.bfloat16).astype(np.float32))
  # float32 inputs keep every intermediate float32
  plan32 = stored_rows.plan(ga, x=f32(x), W=f32(w), V=f32(eye))
  assert {compiled.out_dtype(k, "float32") for k in plan32.forward_kernels} == {"float32"}
