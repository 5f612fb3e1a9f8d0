"""jaxdata.hector's matmul precision: resolved like jnp.dot's, reaching every GEMM instance, and
each precision's results against float64 references with tolerances that fit it.

On a GPU (the `gpu` variants) precision "default" runs the GEMM and weight-gradient kernels on
tensor cores: float32 operands rounded to TF32 (relative error about 1e-3 in the results),
bfloat16 operands exact with float32 sums (the bfloat16 outputs and gradients: about 1e-2);
"highest" keeps float32 operands float32-exact (about 1e-5). On the CPU every precision is
float32-exact, as jnp.dot is there.
"""

import functools
import hashlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_hector_rgat import corner_case_graph
from test_hector_rgat import reference as rgat_reference

from jaxdata import hector
from jaxdata.data import HeteroGraph
from jaxdata.hector import precision as precision_lib
from jaxdata.nn import HGT, RGAT, RGCN

HI = jax.lax.Precision.HIGHEST
# These tests set the precision themselves: not under conftest's "highest" for everything else.
pytestmark = pytest.mark.default_precision


# ----------------------------------------------------------------------------- resolution
def test_resolve_follows_the_argument_then_the_config_like_jnp_dot():
  assert precision_lib.resolve(None) == "default"
  assert precision_lib.resolve("highest") == "highest"
  assert precision_lib.resolve("high") == "default"
  assert precision_lib.resolve(jax.lax.Precision.HIGHEST) == "highest"
  assert precision_lib.resolve(jax.lax.Precision.DEFAULT) == "default"
  assert precision_lib.resolve((HI, jax.lax.Precision.DEFAULT)) == "highest"
  assert precision_lib.resolve(jax.lax.DotAlgorithmPreset.F32_F32_F32) == "highest"
  assert precision_lib.resolve(jax.lax.DotAlgorithmPreset.TF32_TF32_F32) == "default"
  assert precision_lib.resolve("TF32_TF32_F32_X3") == "highest"
  for name, want in (
    ("highest", "highest"),
    ("float32", "highest"),
    ("tensorfloat32", "default"),
    ("bfloat16", "default"),
    ("default", "default"),
  ):
    with jax.default_matmul_precision(name):
      assert precision_lib.resolve(None) == want, name
      assert precision_lib.resolve("high") == "default"  # an explicit argument wins
  with pytest.raises(ValueError, match="rgcn: precision must be"):
    precision_lib.resolve("fast", "rgcn")
  with pytest.raises(ValueError, match="precision must be"):
    hector.rgcn_message(*_rgcn_case(jnp.float32, 8, 8)[1:4], precision="float16")


def _specs(fn, *args):
  """The KernelSpecs of every hector kernel `fn(*args)` traces (through custom_vjp and jit)."""
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "jaxdata_hector_kernel":
        found.append(eqn.params["spec"])
      for p in eqn.params.values():
        for sub in p if isinstance(p, (tuple, list)) else (p,):
          if isinstance(sub, jax.extend.core.ClosedJaxpr):
            walk(sub.jaxpr)
          elif isinstance(sub, jax.extend.core.Jaxpr):
            walk(sub)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


def _levels(fn, *args):
  return {s.precision for s in _specs(fn, *args)}


def test_every_kernel_of_forward_and_backward_gets_the_resolved_precision():
  g, ga, x, w, _ = _rgcn_case(jnp.float32, 16, 8)

  def loss(x, w, **kw):
    return hector.rgcn_message(ga, x, w, **kw).sum()

  grad = jax.grad(loss, argnums=(0, 1))
  products = [s for s in _specs(grad, x, w) if s.kernel.template in ("gemm", "weight_grad")]
  assert len(products) == 3  # forward GEMM, backward GEMM, weight gradient
  assert _levels(grad, x, w) == {"default"}
  with jax.default_matmul_precision("highest"):
    assert _levels(grad, x, w) == {"highest"}
    assert _levels(functools.partial(grad, precision="default"), x, w) == {"default"}
  assert _levels(functools.partial(grad, precision=HI), x, w) == {"highest"}


def test_layers_pass_their_precision_to_every_kernel():
  g, ga, x, _, _ = _rgcn_case(jnp.float32, 16, 8)
  rgcn = RGCN(16, 8, num_relations=g.num_relations, precision="highest", rngs=nnx.Rngs(0))
  rgat = RGAT(16, 4, num_relations=g.num_relations, heads=2, self_loop=True, rngs=nnx.Rngs(0))
  kqv = HGT((16,), 8, num_relations=g.num_relations, heads=2, precision=HI, rngs=nnx.Rngs(0))
  assert _levels(lambda x: rgcn(ga, x), x) == {"highest"}
  assert _levels(lambda x: rgat(ga, x), x) == {"default"}
  with jax.default_matmul_precision("highest"):
    assert _levels(lambda x: rgat(ga, x), x) == {"highest"}
  assert _levels(lambda x: kqv(ga, [x])[0], x) == {"highest"}
  with pytest.raises(ValueError, match="RGCN: precision must be"):
    RGCN(16, 8, num_relations=g.num_relations, precision="exact", rngs=nnx.Rngs(0))


def test_default_matmul_precision_changes_the_cuda_kernels(monkeypatch):
  """The CUDA source (and so the cached kernel) differs: tensor cores at the default precision,
  CUDA-core FMAs at "highest"; bfloat16 operands take bfloat16 tensor cores at both; the CPU
  source is the same at every precision. With tensor cores switched off
  (JAXDATA_HECTOR_TENSOR_CORES=0) every precision gets the CUDA-core kernels."""
  g, ga, x, w, _ = _rgcn_case(jnp.float32, 64, 64)
  from jaxdata.hector.codegen import cuda as cuda_codegen

  monkeypatch.setenv(cuda_codegen.TENSOR_CORES_ENV, "0")
  off = hector.rgcn_layer.sources(ga, "cuda", x=x, W=w)
  assert "mma.sync" not in off and "micro_fma<" in off
  monkeypatch.delenv(cuda_codegen.TENSOR_CORES_ENV, raising=False)  # on by default
  cuda = functools.partial(hector.rgcn_layer.sources, ga, "cuda", x=x, W=w)
  default = cuda()
  assert "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in default
  assert "gemm_mma<MmaTF32," in default and "micro_fma<" not in default
  with jax.default_matmul_precision("highest"):
    highest = cuda()
  assert "MmaTF32" not in highest and "micro_fma<" in highest
  assert cuda(precision="highest") == highest
  with jax.default_matmul_precision("highest"):
    assert cuda(precision="default") == default
  b16 = functools.partial(
    hector.rgcn_layer.sources, ga, "cuda", x=x.astype(jnp.bfloat16), W=w.astype(jnp.bfloat16)
  )
  for src in (b16(), b16(precision="highest")):
    assert "gemm_mma<MmaBF16," in src  # the forward GEMM: bfloat16 products are exact
  cpu = functools.partial(hector.rgcn_layer.sources, ga, "cpu", x=x, W=w)
  assert cpu() == cpu(precision="highest")


@pytest.mark.parametrize(
  "dtypes",
  [("float32",) * 2, ("bfloat16",) * 2, ("float32", "bfloat16")],
  ids=["f32", "bf16", "mixed"],
)
def test_sources_show_the_kernels_a_step_runs(dtypes):
  """`layer.sources` works out each kernel's operand and output dtypes without running it (a
  bfloat16 layer's stored rows are bfloat16; an XLA-side value takes its operands' dtype): the
  kernels a jitted training step traces are exactly the ones it prints, for float32, bfloat16
  and mixed inputs (x in the first dtype, the weights in the second)."""
  from jaxdata.hector import runtime

  g = _graph()
  ga = hector.GraphArrays.from_graph(g)
  rng = np.random.default_rng(0)
  r, heads, d = g.num_relations, 2, 16
  x = jnp.asarray(rng.standard_normal((g.num_nodes, 32)), dtypes[0])
  ws = [
    jnp.asarray(rng.standard_normal(shape), dtypes[1])
    for shape in ((r, 32, heads * d), (r, heads, d), (r, heads, d))
  ]
  loss = lambda *a: hector.rgat_message(ga, *a).astype(jnp.float32).sum()  # noqa: E731
  traced = _specs(jax.grad(loss, argnums=(0, 1, 2, 3)), x, *ws)
  printed = hector.rgat_layer.sources(ga, "cuda", x=x, W=ws[0], a_src=ws[1], a_dst=ws[2])
  parts = printed.split("// ---- ")[1:]
  assert len(traced) == len(parts)
  assert {runtime.source(s, "cuda").rstrip() for s in traced} == {
    p.split("\n", 1)[1].rstrip() for p in parts
  }
  assert ({s.out_dtype for s in traced} == {"float32", "bfloat16"}) == (
    dtypes[0] == "bfloat16" == dtypes[1]
  )


def test_weight_gradient_tiles_follow_the_kind_of_kernel(monkeypatch):
  """A weight gradient's edges per block (the row tiles the runtime computes and the template's
  tile) are WGRAD_TILE_ROWS on CUDA cores and MMA_WGRAD_TILE_ROWS on tensor cores, read from
  codegen.cuda when the kernel is made (so a probe that sets them moves both together)."""
  from jaxdata.hector import codegen
  from jaxdata.hector.codegen import cuda as cuda_codegen

  g, ga, x, w, _ = _rgcn_case(jnp.bfloat16, 64, 64)
  wgrad = next(
    k.kernel
    for k in hector.rgcn_layer.plan(ga, x=x, W=w).backward_kernels
    if k.kernel.template == "weight_grad"
  )
  assert codegen.tile_rows(wgrad, "fma") == cuda_codegen.WGRAD_TILE_ROWS
  sources = functools.partial(hector.rgcn_layer.sources, ga, "cuda", x=x, W=w)
  for rows in (cuda_codegen.MMA_WGRAD_TILE_ROWS, 128):
    monkeypatch.setattr(cuda_codegen, "MMA_WGRAD_TILE_ROWS", rows)
    assert codegen.tile_rows(wgrad, "bf16") == codegen.tile_rows(wgrad, "tf32") == rows
    assert f"wgrad_mma<MmaTF32, {rows}, 64," in sources()  # scaled by norm: TF32


def test_rows_that_are_not_whole_four_byte_pieces_stay_on_cuda_cores(monkeypatch):
  """cp.async copies 4, 8 or 16 bytes: bfloat16 rows of an odd width (7 features: 14 bytes)
  cannot be staged that way, so the forward GEMM over x keeps the CUDA-core kernel, while the
  same layer with 8 features goes to tensor cores (the backward GEMM over the 8-wide
  cotangent rows is on tensor cores in both)."""
  from jaxdata.hector.codegen import cuda as cuda_codegen

  monkeypatch.delenv(cuda_codegen.TENSOR_CORES_ENV, raising=False)
  for din, on_tensor_cores in ((7, False), (8, True)):
    g, ga, x, w, _ = _rgcn_case(jnp.bfloat16, din, 8)
    src = hector.rgcn_layer.sources(ga, "cuda", x=x, W=w)
    forward = src.split("// ---- ")[1]
    assert forward.startswith("forward:"), forward[:40]
    assert ("gemm_mma<MmaBF16," in forward) == on_tensor_cores, din
    assert ("gemm_simt<" in forward) == (not on_tensor_cores), din


# ----------------------------------------------------------------------------- numerics
#: max |got - want| / max |want| allowed, per (dtype, level); the CPU is exact at every level
TOL = {
  ("float32", "highest"): 2e-5,
  ("float32", "default"): 4e-3,
  ("bfloat16", "highest"): 3e-2,
  ("bfloat16", "default"): 3e-2,
}
GRAD_TOL = {
  ("float32", "highest"): 1e-4,
  ("float32", "default"): 6e-3,
  ("bfloat16", "highest"): 4e-2,
  ("bfloat16", "default"): 4e-2,
}


def _tol(table, dtype, level, device):
  name = jnp.dtype(dtype).name
  if device.platform == "cpu" and name == "float32":
    return table[(name, "highest")]
  return table[(name, level)]


def assert_close(got, want, tol, what):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape, what
  scale = max(np.abs(want).max(), 1e-30)
  err = np.abs(got - want).max() / scale
  assert err <= tol, f"{what}: max error {err:.3g} of max |want| {scale:.3g} (tolerance {tol})"
  return err


def _graph(seed=3):
  """About 2,400 edges over 5 relations (several 64-edge tiles each, hubs among 120
  destinations), an empty relation, nodes without in-edges."""
  return corner_case_graph(seed, n=160, e=2400)


def _rgcn_case(dtype, din, dout, seed=0):
  g = _graph()
  ga = hector.GraphArrays.from_graph(g)
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((g.num_nodes, din)), dtype)
  w = jnp.asarray(rng.standard_normal((g.num_relations, din, dout)) / np.sqrt(din), dtype)
  ct = jnp.asarray(rng.standard_normal((g.num_nodes, dout)), jnp.float64)
  return g, ga, x, w, ct


def rgcn_reference(ga, x, w):
  msg = jnp.einsum("ek,ekn->en", x[ga.src], w[ga.etype], precision=HI)
  return jax.ops.segment_sum(msg * ga.norm.astype(msg.dtype)[:, None], ga.dst, ga.num_nodes)


def hgt_reference(ga, k, q, v, w_att, w_msg, mu):
  """HGT's edge part from its definition (jaxdata.hector.hgt), in plain JAX."""
  r, heads, dk, _ = w_att.shape
  src, dst, et, n = ga.src, ga.dst, ga.etype, ga.num_nodes
  split = lambda a: a.reshape(a.shape[0], heads, dk)  # noqa: E731
  key = jnp.einsum("ehd,ehdf->ehf", split(k[src]), w_att[et], precision=HI)
  score = (key * split(q[dst])).sum(-1) * mu[et] / math.sqrt(dk)
  top = jax.lax.stop_gradient(jax.ops.segment_max(score, dst, n))
  ex = jnp.exp(score - top[dst])
  alpha = ex / jax.ops.segment_sum(ex, dst, n)[dst]
  msg = jnp.einsum("ehd,ehdf->ehf", split(v[src]), w_msg[et], precision=HI)
  return jax.ops.segment_sum(alpha[..., None] * msg, dst, n).reshape(n, heads * dk)


#: float64 references computed in this module, by case and input values: a case's "default" and
#: "highest" variants have the same inputs, so they share one (computed eagerly, op by op, the
#: reference and its gradients are most of such a test's time).
_REFERENCES: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _forget_references():
  yield
  _REFERENCES.clear()


def _reference_and_gradients(reference, wide, ct, key):
  """`reference(*wide)` and the gradients of its dot with `ct`, computed once per `key`."""
  if key not in _REFERENCES:
    loss = lambda *a: jnp.vdot(reference(*a).astype(jnp.float64), ct)  # noqa: E731
    grads = jax.grad(loss, tuple(range(len(wide))))(*wide)
    _REFERENCES[key] = np.asarray(reference(*wide)), [np.asarray(g) for g in grads]
  return _REFERENCES[key]


def check_against_float64(device, fn, reference, inputs, ct, level, what):
  """fn(*inputs) at `level` and its gradients against `reference` in float64 (from the same,
  possibly bfloat16-rounded, values); returns the forward error."""
  dtype = inputs[0].dtype
  wide = [jnp.asarray(a, jnp.float64) for a in inputs]
  values = hashlib.sha256()
  for a in (*wide, ct):
    values.update(np.asarray(a).tobytes())
  key = (what, device.platform, values.hexdigest())
  want_out, want = _reference_and_gradients(reference, wide, ct, key)
  run = functools.partial(fn, precision=level)
  out = jax.jit(run)(*inputs)
  assert out.dtype == dtype
  err = assert_close(out, want_out, _tol(TOL, dtype, level, device), f"{what} forward")
  argnums = tuple(range(len(inputs)))
  loss = lambda f: lambda *a: jnp.vdot(f(*a).astype(jnp.float64), ct)  # noqa: E731
  got = jax.jit(jax.grad(loss(run), argnums))(*inputs)
  for i, (a, b) in enumerate(zip(got, want)):
    assert a.dtype == dtype
    assert_close(a, b, _tol(GRAD_TOL, dtype, level, device), f"{what} gradient {i}")
  return err


DTYPES = [jnp.float32, jnp.bfloat16]
LEVELS = ["default", "highest"]


def _rgcn_products(ga, products: str):
  """RGCN's message with its products per pair (the default on `_graph`, 7 edges per pair) or
  fused into the per-edge GEMM (compaction off)."""
  if products == "per pair":
    assert hector.passes.compacts_fused_products(ga.num_edges, ga.num_pairs)
    return functools.partial(hector.rgcn_message, ga)
  fused = hector.rgcn_layer.with_passes(["reorder"])
  return lambda x, w, **kw: fused(ga, x=x, W=w, **kw)


@pytest.mark.parametrize("products", ["per pair", "fused"])
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("din,dout", [(20, 12), (64, 64), (128, 128), (256, 96)])
def test_rgcn_at_each_precision_against_float64(device, level, dtype, din, dout, products):
  g, ga, x, w, ct = _rgcn_case(dtype, din, dout)
  err = check_against_float64(
    device,
    _rgcn_products(ga, products),
    functools.partial(rgcn_reference, ga),
    (x, w),
    ct,
    level,
    f"rgcn {din}x{dout}",
  )
  from jaxdata.hector.codegen import cuda as cuda_codegen

  if (
    device.platform == "gpu"
    and dtype == jnp.float32
    and level == "default"
    and cuda_codegen.tensor_cores_enabled()
  ):
    assert err > 2e-6, "float32 at the default precision should run on TF32 tensor cores"


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_rgcn_over_hundreds_of_relations_against_float64(device, level, dtype):
  """A GEMM tile finds its relation from the tile offsets (on tensor cores by a 32-ary search,
  `find_relation_warp` in templates/mma.cuh): 300 relations, a third of them empty and lying
  between full ones, from 1 edge to three 64-edge tiles each, so the search takes two rounds
  and every tile must land in its own relation."""
  rng = np.random.default_rng(7)
  r, n = 300, 500
  et = np.repeat(np.arange(r), rng.choice([0, 0, 1, 3, 64, 65, 150], r))
  src, dst = rng.integers(0, n, et.size), rng.integers(0, n, et.size)
  g = HeteroGraph.from_edges(src, dst, et, num_nodes=n, relation_names=[f"r{i}" for i in range(r)])
  ga = hector.GraphArrays.from_graph(g)
  x = jnp.asarray(rng.standard_normal((n, 16)), dtype)
  w = jnp.asarray(rng.standard_normal((r, 16, 16)) / 4, dtype)
  ct = jnp.asarray(rng.standard_normal((n, 16)), jnp.float64)
  check_against_float64(
    device,
    functools.partial(hector.rgcn_message, ga),
    functools.partial(rgcn_reference, ga),
    (x, w),
    ct,
    level,
    "rgcn over 300 relations",
  )


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("k,heads,d", [(16, 1, 16), (64, 4, 16), (128, 2, 64), (24, 3, 10)])
def test_rgat_at_each_precision_against_float64(device, level, dtype, k, heads, d):
  g = _graph()
  ga = hector.GraphArrays.from_graph(g)
  rng = np.random.default_rng(k + heads)
  r = g.num_relations
  inputs = (
    jnp.asarray(rng.standard_normal((g.num_nodes, k)), dtype),
    jnp.asarray(rng.standard_normal((r, k, heads * d)) / np.sqrt(k), dtype),
    jnp.asarray(rng.standard_normal((r, heads, d)) / np.sqrt(d), dtype),
    jnp.asarray(rng.standard_normal((r, heads, d)) / np.sqrt(d), dtype),
  )
  ct = jnp.asarray(rng.standard_normal((g.num_nodes, heads * d)), jnp.float64)
  check_against_float64(
    device,
    functools.partial(hector.rgat_message, ga),
    functools.partial(rgat_reference, ga),
    inputs,
    ct,
    level,
    f"rgat {k}->{heads}x{d}",
  )


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("heads,dk", [(1, 32), (4, 16), (2, 64)])
def test_hgt_at_each_precision_against_float64(device, level, dtype, heads, dk):
  g = _graph()
  ga = hector.GraphArrays.from_graph(g)
  rng = np.random.default_rng(heads * dk)
  r, n, f = g.num_relations, g.num_nodes, heads * dk
  rows = lambda: jnp.asarray(rng.standard_normal((n, f)) / 2, dtype)  # noqa: E731
  mats = lambda: jnp.asarray(rng.standard_normal((r, heads, dk, dk)) / np.sqrt(dk), dtype)  # noqa: E731
  inputs = (
    rows(),
    rows(),
    rows(),
    mats(),
    mats(),
    jnp.asarray(rng.uniform(0.5, 1.5, (r, heads)), dtype),
  )
  ct = jnp.asarray(rng.standard_normal((n, f)), jnp.float64)
  check_against_float64(
    device,
    functools.partial(hector.hgt_message, ga),
    functools.partial(hgt_reference, ga),
    inputs,
    ct,
    level,
    f"hgt {heads}x{dk}",
  )


@pytest.mark.parametrize("level", LEVELS)
def test_rgcn_layer_with_self_loop_at_each_precision(device, level):
  """The Flax layer: its relational kernels and its self-loop product follow `precision`."""
  g, ga, x, _, _ = _rgcn_case(jnp.float32, 32, 16)
  layer = RGCN(32, 16, num_relations=g.num_relations, precision=level, rngs=nnx.Rngs(1))
  w, root, bias = (jnp.asarray(p[...], jnp.float64) for p in (layer.weight, layer.root, layer.bias))
  wide = jnp.asarray(x, jnp.float64)
  want = rgcn_reference(ga, wide, w) + jnp.dot(wide, root, precision=HI) + bias
  assert_close(layer(ga, x), want, _tol(TOL, jnp.float32, level, device), "RGCN layer")
