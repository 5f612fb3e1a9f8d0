"""`jaxdata bench rgnn --mode inference` and the peers at their best, on tiny CPU inputs.

Through the CLI for RGCN, RGAT and HGT into one sectioned document; the inference outputs of
jaxdata and of PyG (RGCNConv, FastRGCNConv, RGATConv, HGTConv) against the plain-JAX
reference on the same weights; that a forward-only executable keeps no residuals; that a
peer's out-of-memory is a row, not a crash; `--precision both`.
"""

import math

import jax
import numpy as np
import pytest
from bench_checks import assert_losses_agree

from benchmarks import rgnn
from benchmarks import rgnn_attention as ra
from benchmarks import rgnn_peers as peers
from jaxdata import cli
from jaxdata.reference import attention as attention_ref
from jaxdata.reference import rgcn as rgcn_ref

torch = pytest.importorskip("torch")
pytest.importorskip("torch_geometric")
from jaxdata.reference import pyg as pyg_ref  # noqa: E402  (after the skips)

HIGHEST = jax.lax.Precision.HIGHEST
TINY_SYNTHETIC = dict(num_nodes=400, num_edges=3_000, num_relations=12)
TINY_MAG = "0.0001"  # about 200 nodes and 4,000 edges


@pytest.fixture(autouse=True)
def on_the_cpu(monkeypatch):
  """CPU tests: PyG on the CPU as JAX, also on a machine with a GPU; tiny synthetic graphs."""
  monkeypatch.setattr(pyg_ref, "torch_device", lambda: torch.device("cpu"))
  monkeypatch.setattr(rgnn, "QUICK_SYNTHETIC", TINY_SYNTHETIC)
  monkeypatch.setattr(ra, "QUICK_SYNTHETIC", TINY_SYNTHETIC)
  with jax.default_device(jax.devices("cpu")[0]):
    yield


@pytest.fixture
def captured(monkeypatch):
  """Keeps what rgnn.run and rgnn_attention.run returned when the CLI calls them."""
  seen = {}
  for module in (rgnn, ra):

    def keep(*args, _run=module.run, **kwargs):
      seen["out"] = _run(*args, **kwargs)
      return seen["out"]

    monkeypatch.setattr(module, "run", keep)
  return seen


def tiny_graph() -> rgnn.Graph:
  graph, why = rgnn.load_graph("synthetic", data_dir=None, quick=True)
  assert graph is not None, why
  return graph


# ------------------------------------------------------------------------------------------------
# Through the CLI


def test_inference_of_all_three_models_lands_in_one_document(captured, tmp_path):
  path = tmp_path / "rgnn_inference.md"
  assert (
    cli.main(
      [
        "bench",
        "rgnn",
        "--mode",
        "inference",
        "--quick",
        "--graphs",
        "synthetic",
        "--dims",
        "16",
        "--write",
        str(path),
      ]
    )
    == 0
  )
  results, notes, _ = captured["out"]
  names = [rgnn.label(r, results) for r in results]
  assert names == [
    *(f"jaxdata ({p})" for p in rgnn.PRECISIONS),
    *(f"{f} ({p})" for f in rgcn_ref.PLAIN_JAX for p in rgnn.PRECISIONS),
    "PyG RGCNConv",
    "PyG FastRGCNConv",
  ]
  assert all(r.ok and r.seconds > 0 for r in results), notes
  assert_losses_agree(results, notes)  # on the CPU "default" is float32 too
  header, rows = rgnn.table_rows(results, mode="inference")
  assert header[3:5] == ["forward ms", "one forward alone ms"]
  assert header[-4:] == [
    "jaxdata vs best plain JAX (highest)",
    "jaxdata vs best plain JAX (default)",
    "jaxdata vs PyG",
    "memory / PyG's",
  ]
  vs_pyg = rows[0][header.index("jaxdata vs PyG")]
  fastest = min((r for r in results if r.formulation in rgnn.PYG), key=lambda r: r.seconds)
  assert vs_pyg.endswith(f"x ({fastest.formulation.removeprefix('PyG ')})")

  for model, extra in (
    ("rgat", ["--graphs", "synthetic", "--dims", "16"]),
    ("hgt", ["--mag-scale", TINY_MAG]),
  ):
    assert (
      cli.main(
        [
          "bench",
          "rgnn",
          "--model",
          model,
          "--mode",
          "inference",
          "--quick",
          "--formulations",
          "jaxdata,transform-all-then-gather,PyG",
          *extra,
          "--write",
          str(path),
        ]
      )
      == 0
    )
    results, notes, _ = captured["out"]
    assert all(r.ok and r.seconds > 0 for r in results), notes
    assert_losses_agree(results, notes)
    assert [r.formulation for r in results][-1] == "PyG"

  text = path.read_text()
  assert text.startswith(rgnn.INFERENCE_TITLE) and text.count(rgnn.INFERENCE_TITLE) == 1
  first = [
    text.index(f"## One {m} layer: inference (forward only)") for m in ("RGCN", "RGAT", "HGT")
  ]
  assert first == sorted(first)  # rgcn's section kept, then rgat, then hgt
  assert "| forward ms |" in text and "fwd+bwd" not in text
  assert "| PyG FastRGCNConv |" in text and "torch.inference_mode()" in text
  assert "PyG with TF32 on" in text  # --precision both: PyG at its fastest


def test_train_mode_is_the_default_and_single_precision_keeps_the_old_columns(captured, tmp_path):
  path = tmp_path / "rgnn.md"
  assert (
    cli.main(
      [
        "bench",
        "rgnn",
        "--quick",
        "--graphs",
        "synthetic",
        "--dims",
        "8",
        "--precision",
        "highest",
        "--write",
        str(path),
      ]
    )
    == 0
  )
  results, notes, _ = captured["out"]
  assert all(r.ok for r in results), notes
  assert {r.precision for r in results if r.formulation in rgcn_ref.PLAIN_JAX} == {"highest"}
  header, rows = rgnn.table_rows(results)
  assert header[3] == "fwd+bwd ms" and "jaxdata vs best plain JAX" in header
  assert [row[2] for row in rows][1:4] == list(rgcn_ref.PLAIN_JAX)  # no precision in brackets
  text = path.read_text()
  assert text.startswith("# One RGCN layer: relational message, forward + backward")
  assert "Matmul precision: `highest` on every side (PyG: TF32 off)" in text


def test_bad_mode_and_precision(capsys):
  with pytest.raises(ValueError, match="mode"):
    rgnn.run(["synthetic"], [8], quick=True, mode="serve")
  with pytest.raises(ValueError, match="precision"):
    ra.run("rgat", ["synthetic"], [8], heads=2, quick=True, precision="tf32")
  with pytest.raises(SystemExit):
    cli.main(["bench", "rgnn", "--mode", "serve"])
  assert "--mode" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# Inference outputs against the plain-JAX reference, on the same weights


def rgcn_reference(graph, x, w):
  edges = rgcn_ref.EdgeArrays.build(
    graph.src,
    graph.dst,
    graph.etype,
    num_nodes=graph.num_nodes,
    num_relations=graph.num_relations,
    norm=graph.norm,
  )
  fn = jax.jit(rgcn_ref.transform_all_then_gather, static_argnums=4, static_argnames="precision")
  return np.asarray(fn(*edges, graph.num_nodes, x, w, precision=HIGHEST))


def test_rgcn_inference_outputs_match_the_reference():
  graph = tiny_graph()
  x, w, ct = rgnn.case_arrays(graph, 16)
  want = rgcn_reference(graph, x, w)
  tol = dict(rtol=1e-4, atol=1e-4 * np.abs(want).max())
  mine = peers.compile_step(peers.jaxdata_formulation(graph.hetero), x, w, ct, mode="inference")
  out = mine.run()
  assert out.shape == want.shape
  np.testing.assert_allclose(np.asarray(out), want, **tol)
  np.testing.assert_allclose(mine.loss(out), np.vdot(want, ct), rtol=1e-4)
  outputs = {}
  for layer in peers.PYG_RGCN:
    timing = peers.time_pyg(
      graph.src,
      graph.dst,
      graph.etype,
      x,
      w,
      ct,
      repeats=1,
      warmup=0,
      mode="inference",
      layer=layer,
      keep_output=True,
    )
    outputs[layer] = timing.output
    np.testing.assert_allclose(timing.output, want, **tol)
    np.testing.assert_allclose(timing.loss, np.vdot(want, ct), rtol=1e-4)
  # FastRGCNConv (per-edge weights, bmm) is RGCNConv (per-relation loop) on the same weights.
  np.testing.assert_allclose(
    outputs["FastRGCNConv"], outputs["RGCNConv"], rtol=1e-5, atol=1e-5 * np.abs(want).max()
  )


def test_fast_rgcn_conv_equals_rgcn_conv_forward_and_backward():
  graph = tiny_graph()
  x, w, ct = rgnn.case_arrays(graph, 8)
  edge_index, edge_type = pyg_ref.pyg_graph(graph.src, graph.dst, graph.etype, torch.device("cpu"))
  got = []
  for fast in (False, True):
    conv = pyg_ref.pyg_conv(w, device=torch.device("cpu"), fast=fast)
    xt = torch.from_numpy(x).requires_grad_(True)
    loss, dx, dw = pyg_ref.pyg_loss_and_grads(conv, xt, edge_index, edge_type, torch.from_numpy(ct))
    got.append((loss.item(), dx.numpy(), dw.numpy()))
  (l0, dx0, dw0), (l1, dx1, dw1) = got
  assert math.isclose(l0, l1, rel_tol=1e-5)
  np.testing.assert_allclose(dx1, dx0, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(dw1, dw0, rtol=1e-4, atol=1e-5)


def attention_case(model: str):
  if model == "rgat":
    case, why = ra.load_case("rgat", "synthetic", data_dir=None, quick=True)
  else:
    case, why = ra.load_case("hgt", "mag", data_dir=None, quick=True, mag_scale=float(TINY_MAG))
  assert case is not None, why
  g = case.graph
  edges = attention_ref.Edges.build(
    g.src, g.dst, g.etype, num_nodes=g.num_nodes, num_relations=g.num_relations
  )
  return case, edges


@pytest.mark.parametrize("model", ["rgat", "hgt"])
def test_attention_inference_outputs_match_the_reference(model):
  case, edges = attention_case(model)
  x, params, ct = ra.case_arrays(model, case, 16, 2)
  ref = ra.plain_formulation(model, "transform-all-then-gather", edges, precision=HIGHEST)
  want = np.asarray(peers.compile_step(ref, x, params, ct, mode="inference").run())
  assert want.shape == ct.shape
  tol = dict(rtol=1e-4, atol=1e-4 * np.abs(want).max())
  arrays = ra.graph_arrays(case)
  if model == "rgat":
    mine = ra.rgat_jaxdata_formulation(arrays, None)
  elif ra.hgt_message_fn() is not None:
    mine = ra.hgt_jaxdata_formulation(arrays, None, precision=HIGHEST)
  else:
    mine = None
  if mine is not None:
    out = peers.compile_step(mine, x, params, ct, mode="inference").run()
    np.testing.assert_allclose(np.asarray(out), want, **tol)
  forward = ra._pyg_step(model, case, x, params, ct, torch.device("cpu"), "inference")
  out = forward()
  parts = [out[t] for t in case.node_types] if model == "hgt" else [out]
  assert all(o.is_inference() and not o.requires_grad for o in parts)  # no autograd graph
  out = torch.cat(parts)
  np.testing.assert_allclose(out.numpy(), want, **tol)
  np.testing.assert_allclose(forward(checksum=True).item(), np.vdot(want, ct), rtol=1e-4)


# ------------------------------------------------------------------------------------------------
# Forward only: nothing kept for a backward pass


def memory(compiled: peers.Compiled) -> dict[str, int]:
  a = compiled.analysis
  return {k: int(getattr(a, f"{k}_size_in_bytes")) for k in ("argument", "output", "temp")}


def jaxdata_models():
  """(name, formulation, inputs, output bytes) for hector's layers on tiny graphs."""
  graph = tiny_graph()
  x, w, ct = rgnn.case_arrays(graph, 16)
  yield "rgcn", peers.jaxdata_formulation(graph.hetero), (x, w, ct)
  case, _ = attention_case("rgat")
  yield (
    "rgat",
    ra.rgat_jaxdata_formulation(ra.graph_arrays(case), None),
    ra.case_arrays("rgat", case, 16, 2),
  )
  if ra.hgt_message_fn() is not None:
    case, _ = attention_case("hgt")
    yield (
      "hgt",
      ra.hgt_jaxdata_formulation(ra.graph_arrays(case), None),
      ra.case_arrays("hgt", case, 16, 2),
    )


def test_inference_executable_keeps_no_residuals():
  """Under jit without grad, hector's custom_vjp runs its primal: the forward-only executable
  returns the output and nothing else (no residual leaves the program), and needs less
  scratch than the training step, which keeps the forward's values for its backward."""
  seen = []
  for name, form, (x, p, ct) in jaxdata_models():
    inference = peers.compile_step(form, x, p, ct, mode="inference")
    train = peers.compile_step(form, x, p, ct, mode="train")
    mi, mt = memory(inference), memory(train)
    out_bytes = np.asarray(ct).nbytes
    assert mi["output"] == out_bytes, (name, mi)
    assert mi["temp"] < mt["temp"], (name, mi, mt)
    assert inference.bytes < train.bytes, name
    # Its HLO has the forward's kernels only: fewer custom calls than the training step.
    hlo_i = peers.forward_only(form).lower(x, p, form.graph_args).as_text()
    hlo_t = peers.loss_and_grads(form).lower(x, p, form.graph_args, ct).as_text()
    assert 0 < hlo_i.count("custom_call") < hlo_t.count("custom_call"), name
    seen.append(name)
  assert seen[:2] == ["rgcn", "rgat"]


# ------------------------------------------------------------------------------------------------
# A peer out of memory is a row


@pytest.mark.parametrize("error", ["cuda", "cpu"])
def test_pyg_out_of_memory_is_a_row_not_a_crash(monkeypatch, error):
  time_pyg = peers.time_pyg

  def failing(*args, layer="RGCNConv", **kwargs):
    if layer == "FastRGCNConv":
      if error == "cuda":
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 131.07 GiB")
      # What torch 2.13 raises on the CPU (torch.empty(2**45) here).
      raise RuntimeError(
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: "
        "can't allocate memory: you tried to allocate 140737488355328 bytes. "
        "Error code 12 (Cannot allocate memory)"
      )
    return time_pyg(*args, layer=layer, **kwargs)

  monkeypatch.setattr(peers, "time_pyg", failing)
  results, notes, graphs = rgnn.run(
    ["synthetic"], [8], quick=True, repeats=1, mode="inference", precision="both"
  )
  by_name = {rgnn.label(r): r for r in results}
  assert by_name["PyG FastRGCNConv"].status == "OOM"
  assert by_name["PyG RGCNConv"].ok and by_name["jaxdata"].ok
  assert any("PyG FastRGCNConv: out of memory" in n for n in notes)
  cells = rgnn.comparisons(results, "synthetic", 8, plain=rgcn_ref.PLAIN_JAX, pyg=rgnn.PYG)
  assert cells[-2].endswith("x (RGCNConv)")  # compared with the one that ran
  text = rgnn.markdown(
    results,
    notes,
    graphs,
    "jaxdata bench rgnn --mode inference",
    precision="both",
    mode="inference",
  )
  assert "| PyG FastRGCNConv | OOM |" in text


def test_every_pyg_row_out_of_memory(monkeypatch):
  def failing(*args, **kwargs):
    raise torch.cuda.OutOfMemoryError("CUDA out of memory")

  monkeypatch.setattr(peers, "time_pyg", failing)
  results, notes, _ = rgnn.run(
    ["synthetic"],
    [8],
    quick=True,
    repeats=1,
    mode="inference",
    formulations=["jaxdata", "PyG RGCNConv", "PyG FastRGCNConv"],
  )
  assert rgnn.comparisons(results, "synthetic", 8, plain=rgcn_ref.PLAIN_JAX, pyg=rgnn.PYG)[-2:] == (
    "PyG OOM",
    "PyG OOM",
  )


def test_fast_rgcn_conv_estimated_out_of_memory_on_the_cpu(monkeypatch):
  """On the CPU (no raising OOM) FastRGCNConv is not started where its [E, d, d] cannot fit."""
  monkeypatch.setattr(rgnn, "available_bytes", lambda device: 1 << 20)  # 1 MiB "free"
  notes = []
  r = rgnn.measure_pyg(
    tiny_graph(),
    32,
    repeats=1,
    precision="highest",
    notes=notes,
    formulation="PyG FastRGCNConv",
    mode="inference",
  )
  assert r.status.startswith("OOM (est.") and "per-edge weights alone" in notes[0]


def test_attention_pyg_out_of_memory_in_inference(monkeypatch):
  def failing(*args, **kwargs):
    raise torch.cuda.OutOfMemoryError("CUDA out of memory")

  monkeypatch.setattr(ra, "_pyg_step", failing)
  results, notes, _ = ra.run(
    "rgat",
    ["synthetic"],
    [8],
    heads=2,
    quick=True,
    repeats=1,
    mode="inference",
    formulations=["jaxdata", "PyG"],
  )
  assert [r.status for r in results] == ["ok", "OOM"]
  assert ra.comparisons(results, "synthetic", 8)[-2:] == ("PyG OOM", "PyG OOM")


# ------------------------------------------------------------------------------------------------
# --precision both


def test_precision_both_runs_jax_rows_at_both_precisions():
  results, notes, _ = rgnn.run(
    ["synthetic"],
    [8],
    quick=True,
    repeats=1,
    precision="both",
    mode="inference",
    formulations=["jaxdata", "ragged_dot", "PyG RGCNConv"],
  )
  assert [(r.formulation, r.precision) for r in results] == [
    ("jaxdata", "highest"),
    ("jaxdata", "default"),
    ("ragged_dot", "highest"),
    ("ragged_dot", "default"),
    ("PyG RGCNConv", None),
  ]
  assert [rgnn.label(r, results) for r in results] == [
    "jaxdata (highest)",
    "jaxdata (default)",
    "ragged_dot (highest)",
    "ragged_dot (default)",
    "PyG RGCNConv",
  ]
  # each jaxdata row is compared with plain JAX at both precisions
  header, rows = rgnn.table_rows(results, mode="inference")
  for row in rows[:2]:
    assert row[header.index("jaxdata vs best plain JAX (highest)")].endswith("x")
    assert row[header.index("jaxdata vs best plain JAX (default)")].endswith("x")
  assert rgnn.plain_precisions("both") == ("highest", "default")
  assert rgnn.jaxdata_precisions("both") == ("highest", "default") and rgnn.pyg_tf32("both")
  assert rgnn.jaxdata_precisions("both", "jaxdata (no passes)") == ("highest",)
  assert not rgnn.pyg_tf32("highest")


def test_losses_differing_beyond_tf32_are_noted():
  r = lambda f, p, loss: rgnn.Result("g", 8, f, 1.0, loss=loss, precision=p)  # noqa: E731
  results = [
    r("transform-all-then-gather", "highest", 100.0),
    r("ragged_dot", "default", 101.0),  # within TF32's 3e-2
    r("jaxdata", "highest", 100.5),
  ]  # beyond float32's 1e-3
  notes = []
  rgnn._check_losses(results, "both", notes)
  assert len(notes) == 1 and "jaxdata's loss" in notes[0]
