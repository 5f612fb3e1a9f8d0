"""jaxdata.hector.operands: the one table of kernel operands, and everything that reads it."""

import dataclasses
import doctest
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdata import hector
from jaxdata.data import HeteroGraph
from jaxdata.hector import codegen, operands
from jaxdata.hector.codegen import common


def _graph():
  rng = np.random.default_rng(0)
  g = HeteroGraph.from_edges(
    rng.integers(0, 9, 40),
    rng.integers(0, 9, 40),
    rng.integers(0, 3, 40),
    num_nodes=9,
    relation_names=["a", "b", "c"],
  )
  return hector.GraphArrays.from_graph(g)


def test_operands_doctest_holds():
  assert doctest.testmod(operands).failed == 0


def test_graph_operands_follow_the_table_over_edges_and_pairs():
  ga = _graph()
  for domain in ("edge", "compact"):
    ops = operands.graph_operands(ga, domain, lambda offsets: offsets + 0)
    assert len(ops) == len(operands.GRAPH)
    for op, a in zip(operands.GRAPH, ops):
      assert np.dtype(a.dtype) == op.dtype, op.name
      field = op.edge if domain == "edge" else op.compact
      if field is not None:
        assert a is getattr(ga, field), (domain, op.name)
    sizes = operands.sizes(ops)
    rows = ga.num_edges if domain == "edge" else ga.num_pairs
    assert sizes == {"E": rows, "N": ga.num_nodes, "R": ga.num_relations, "P": ga.num_pairs}


def test_every_edge_field_of_the_table_is_a_graph_arrays_field():
  fields = {f.name for f in dataclasses.fields(hector.GraphArrays)}
  for op in operands.GRAPH:
    assert op.edge is None or op.edge in fields
    assert op.compact is None or op.compact in fields


def test_check_names_a_wrong_operand_count_or_dtype():
  ga = _graph()
  avals = [
    jax.core.ShapedArray(a.shape, a.dtype) for a in operands.graph_operands(ga, "edge", lambda o: o)
  ]
  x = jax.core.ShapedArray((9, 4), jnp.float32)
  operands.check(avals + [x], 1, "k")
  with pytest.raises(ValueError, match="takes 15 operands"):
    operands.check(avals, 1, "k")
  bad = list(avals)
  bad[operands.index("norm")] = jax.core.ShapedArray((40,), jnp.int32)
  with pytest.raises(ValueError, match="graph operand norm must be a 1-D float32"):
    operands.check(bad + [x], 1, "k")


def test_index_rejects_unknown_operands():
  with pytest.raises(KeyError, match="in2"):
    operands.index("in2", num_inputs=2)


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_generated_source_reads_operands_where_the_table_puts_them(target):
  """Every pointer and scalar a kernel declares comes from its position in the table."""
  ga = _graph()
  x, w = jnp.zeros((ga.num_nodes, 4)), jnp.zeros((ga.num_relations, 4, 3))
  text = hector.rgcn_layer.sources(ga, target, x=x, W=w)
  buf, scal = ("buf", "scal") if target == "cpu" else ("p.buf", "p.scal")
  decl = re.compile(r"(\w+) = \([^)]*\)" + re.escape(buf) + r"\[(\d+)\];")
  found = decl.findall(text)
  assert found
  for name, i in found:
    num_inputs = 2  # every RGCN kernel has two inputs (rows and weights, or the cotangent)
    assert int(i) == operands.index(name, num_inputs), name
  for name, i in re.findall(r"const int64_t (\w) = " + re.escape(scal) + r"\[(\d+)\];", text):
    assert operands.SCALAR_NAMES[int(i)] == name
  if target == "cuda":
    assert (
      f"const void* buf[{operands.num_buffers(2)}]; int64_t scal[{len(operands.SCALARS)}]" in text
    )


@pytest.mark.parametrize(
  "target,fixed", [("cpu", ("cpu.h", "common.h")), ("cuda", ("cuda.cuh", "gemm.cuh", "common.h"))]
)
def test_fixed_parts_come_from_the_template_files(target, fixed):
  """Every instance (RGCN's: GEMMs and a weight gradient, whose CUDA bodies are gemm.cuh's
  templates; 8 and 6 features, so that no GEMM is thin enough to run as a grouped sum) starts
  with the fixed files, as they are."""
  ga = _graph()
  text = hector.rgcn_layer.sources(
    ga, target, x=jnp.zeros((ga.num_nodes, 8)), W=jnp.zeros((ga.num_relations, 8, 6))
  )
  parts = text.split("// ---- ")[1:]
  assert len(parts) == 3
  for part in parts:
    body = part.split("\n", 1)[1].split("\n", 1)[1]  # after the name and the instance's label
    assert body.startswith("".join(common.template(f) for f in fixed))
  assert "row_ok(" in common.template("common.h")
  assert codegen.generate  # the package keeps its entry point


def test_thin_scatter_gemms_run_as_grouped_sums_through_the_target_view():
  """A GEMM that scatters into nodes over at most GEMM_THIN_K input features (RGAT's scores
  times W a) is generated as a grouped sum through the CSC (into dst) or CSR (into src) view,
  on CUDA cores, with no row tiles; wider GEMMs keep their tiles."""
  from jaxdata.hector.codegen import cuda

  ga = _graph()
  thin = hector.rgcn_layer.sources(
    ga, "cuda", x=jnp.zeros((ga.num_nodes, 4)), W=jnp.zeros((ga.num_relations, 4, 3))
  )
  wide = hector.rgcn_layer.sources(
    ga, "cuda", x=jnp.zeros((ga.num_nodes, 8)), W=jnp.zeros((ga.num_relations, 8, 6))
  )
  assert cuda.GEMM_THIN_K >= 4
  assert f"grouped_sum<3, 1, {cuda.GROUP_RUN}>(E, csc_edges, out, ok, target, value)" in thin
  assert f"grouped_sum<4, 1, {cuda.GROUP_RUN}>(E, csr_edges, out, ok, target, value)" in thin
  assert "gemm_simt<" not in thin.split("weight_grad")[0] and "gemm_mma<" not in thin
  assert "grouped_sum<" not in wide and ("gemm_simt<" in wide or "gemm_mma<" in wide)
  from jaxdata.hector.lowering import Gemm, Load

  scores = Gemm(Load("edge", 0, width=4), 1, True, 4, 64, (), "dst")
  rows = Gemm(Load("node", 0, "src", 64), 1, False, 64, 64, (), "dst")
  assert cuda.thin(scores) and not cuda.thin(rows)
  assert codegen.tile_rows(scores) == 0 and codegen.tile_rows(rows) == cuda.GEMM_TILE_ROWS
  assert not cuda.thin(dataclasses.replace(scores, out="edge"))
  assert not cuda.thin(dataclasses.replace(scores, domain="compact"))
  blocks, threads = codegen.launch(scores, 0, 1000)
  lanes = 64 // cuda.features_per_thread(64)
  assert blocks * threads >= -(-1000 // cuda.GROUP_RUN) * lanes and threads == 256


@pytest.mark.parametrize("domain", ["edge", "compact"])
def test_valid_rows_flag_exactly_the_rows_whose_ids_are_in_range(domain):
  """`valid` (what every kernel's ok(e) reads) against NumPy, with ids pushed out of range on
  both sides (negative, and at or past the count), over the edges and over the pairs."""
  ga = _graph()
  ops = dict(
    zip([op.name for op in operands.GRAPH], operands.graph_operands(ga, domain, lambda o: o))
  )
  rng = np.random.default_rng(1)
  n, r, p = ga.num_nodes, ga.num_relations, ga.num_pairs
  bad = {"src": (-1, n, 2**31 - 1), "dst": (-5, n + 3), "etype": (r, -(2**31)), "pair": (p, -1)}
  names = ["src", "dst", "etype"] + (["pair"] if domain == "edge" else [])
  rows = len(ops["src"])
  for name in names:
    a = np.asarray(ops[name]).copy()
    for v in bad[name]:
      a[rng.integers(0, rows)] = v
    ops[name] = jnp.asarray(a)
  want = (
    (np.asarray(ops["src"]) >= 0)
    & (np.asarray(ops["src"]) < n)
    & (np.asarray(ops["dst"]) >= 0)
    & (np.asarray(ops["dst"]) < n)
    & (np.asarray(ops["etype"]) >= 0)
    & (np.asarray(ops["etype"]) < r)
  )
  if domain == "edge":
    want &= (np.asarray(ops["pair"]) >= 0) & (np.asarray(ops["pair"]) < p)
  got = operands.valid_rows(ops, domain)
  assert got.dtype == jnp.uint8 and got.shape == (rows,)
  assert 0 < want.sum() < rows
  np.testing.assert_array_equal(np.asarray(got), want.astype(np.uint8))


def test_kernels_that_check_ids_themselves_get_no_mask_and_agree(monkeypatch):
  """VALID_MASK = 0 (the original kernels of `jaxdata bench tensor-cores`): `valid` is not
  computed (a one-byte placeholder), and RGAT's output and gradients on a graph with an id out of
  range equal those of its traversals that read the mask."""
  ga = _graph()
  rng = np.random.default_rng(2)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
  r = ga.num_relations
  x, w, a_src, a_dst = normal(ga.num_nodes, 4), normal(r, 4, 6), normal(r, 2, 3), normal(r, 2, 3)
  src = jnp.asarray(ga.src).at[5].set(10**8)

  def step(src):
    g = dataclasses.replace(ga, src=src)
    loss = lambda *p: jnp.sum(hector.rgat_message(g, *p) ** 2)  # noqa: E731
    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(x, w, a_src, a_dst)

  def run():
    jax.clear_caches()
    return jax.jit(step).lower(src).as_text(), jax.jit(step)(src)

  masked_text, masked = run()
  monkeypatch.setattr(common, "VALID_MASK", 0)
  checked_text, checked = run()
  jax.clear_caches()
  rows = f"tensor<{ga.num_edges}xui8>"
  assert rows in masked_text and rows not in checked_text and "tensor<1xui8>" in checked_text
  for a, b in zip(jax.tree.leaves(masked), jax.tree.leaves(checked)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_tensor_core_gemms_check_their_own_ids_and_cuda_core_gemms_read_the_mask():
  """The tiled GEMM and weight-gradient kernels on tensor cores (default precision) check each
  row's ids themselves, so RGCN's forward and backward pass no `valid` mask; at "highest" the
  call passes it, for the CUDA-core kernels that read it (`codegen.common.reads_valid`; the
  CPU's GEMMs check inline at both). Either way an edge whose source is out of range contributes
  nothing, as if it were not in the graph (against plain NumPy over the other edges)."""
  ga = _graph()
  assert common.VALID_MASK == 1
  rng = np.random.default_rng(3)
  # wider than GEMM_THIN_K (a GEMM that thin is generated as a traversal, and reads the mask)
  x = rng.standard_normal((ga.num_nodes, 8)).astype(np.float32)
  w = rng.standard_normal((ga.num_relations, 8, 8)).astype(np.float32)
  bad = 5
  src = jnp.asarray(ga.src).at[bad].set(10**8)  # set under jit: not checked on construction
  keep = np.arange(ga.num_edges) != bad
  s, d, et = (np.asarray(a)[keep] for a in (ga.src, ga.dst, ga.etype))
  norm = np.asarray(ga.norm)[keep]
  want = np.zeros((ga.num_nodes, 8), np.float64)
  np.add.at(want, d, norm[:, None] * np.einsum("ei,eio->eo", x[s], w[et]))
  for precision, mask in (("default", False), ("highest", True)):
    layer = lambda src, x, w, p=precision: hector.rgcn_message(  # noqa: E731
      dataclasses.replace(ga, src=src), x, w, precision=p
    )
    step = jax.jit(
      lambda src, x, w, layer=layer: jax.value_and_grad(
        lambda x, w: jnp.sum(layer(src, x, w) ** 2), argnums=(0, 1)
      )(x, w)
    )
    text = step.lower(src, x, w).as_text()
    assert (f"tensor<{ga.num_edges}xui8>" in text) == mask, precision
    assert ("tensor<1xui8>" in text) != mask, precision
    out = np.asarray(jax.jit(layer)(src, x, w))
    # TF32 on a GPU's tensor cores at default precision; float32-exact on the CPU
    loose = precision == "default" and jax.default_backend() == "gpu"
    np.testing.assert_allclose(
      out, want, rtol=2e-2 if loose else 1e-5, atol=2e-2 if loose else 1e-5
    )
