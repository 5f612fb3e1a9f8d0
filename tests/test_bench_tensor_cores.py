"""`jaxdata bench tensor-cores` (examples/benchmarks/tensor_cores.py), on tiny CPU inputs.

Through the CLI: every row of every case is in the written table, each ratio is the ratio of
the times printed beside it, each bar's met / not met follows its ratio, and jaxdata's float32
gradient equals a NumPy float64 RGCN (on the CPU every precision is float32-exact, so the
error column is 0 or float32 rounding). Then an out-of-memory row, and one-line usage errors.
"""

import re
import sys

import jax
import numpy as np
import pytest

from benchmarks import rgnn
from benchmarks import rgnn_attention as ra
from benchmarks import tensor_cores as tc
from jaxdata import cli
from jaxdata.reference import rgcn as rgcn_ref

TINY_SYNTHETIC = dict(num_nodes=300, num_edges=2_500, num_relations=9)
DIM = 16


@pytest.fixture
def captured(monkeypatch, device):
  """Runs the CLI on `device` (conftest: the CPU, and a GPU where there is one) on a tiny graph;
  keeps what tensor_cores.run returned, dx too."""
  monkeypatch.setattr(rgnn, "QUICK_SYNTHETIC", TINY_SYNTHETIC)
  monkeypatch.setattr(ra, "QUICK_SYNTHETIC", TINY_SYNTHETIC)
  seen = {"device": device}
  run = tc.run

  def keep(*args, **kwargs):
    seen["out"] = run(*args, **kwargs, keep_dx=True)
    return seen["out"]

  monkeypatch.setattr(tc, "run", keep)
  yield seen


def _table(text: str) -> tuple[list[str], list[list[str]]]:
  """The header and rows of the first Markdown table in `text`."""
  lines = [l for l in text.splitlines() if l.startswith("| ")]
  split = lambda l: [c.strip() for c in l.strip().strip("|").split("|")]  # noqa: E731
  return split(lines[0]), [split(l) for l in lines[2:]]  # lines[1]: the "| --- |" rule


def _x(cell: str) -> float:
  return float(re.match(r"([0-9.]+)x", cell).group(1))


def _same_ratio(printed: float, slow_ms: float, fast_ms: float) -> bool:
  """Whether a ratio printed to 2 decimals is slow_ms / fast_ms, times printed to 3 decimals:
  equal up to the rounding of all three."""
  ratio = slow_ms / fast_ms
  return abs(printed - ratio) <= 0.005 + ratio * (5e-4 / slow_ms + 5e-4 / fast_ms) + 1e-9


def _assert_bar(cell: str, what: str, printed: float, need: float) -> None:
  """The bar's verdict in `cell` follows the ratio printed beside it (where rounding to 2
  decimals cannot have moved it across the bar)."""
  verdict = re.search(rf"{what} >= {need:g}x: (met|not met)", cell).group(1)
  if abs(printed - need) > 0.005:
    assert verdict == ("met" if printed >= need else "not met"), (cell, printed)


def _rgcn_numpy(graph, dim):
  """loss = sum(out * ct) and dx of one RGCN relational message, float64 NumPy, from the
  bench's inputs (`rgnn.case_arrays`): out[i] = sum_{dst[e]=i} norm[e] x[src[e]] W[etype[e]]."""
  x, w, ct = (a.astype(np.float64) for a in rgnn.case_arrays(graph, dim))
  norm = np.asarray(graph.norm, np.float64)[:, None]
  msg = np.einsum("ed,edo->eo", x[graph.src], w[graph.etype]) * norm
  out = np.zeros_like(ct)
  np.add.at(out, graph.dst, msg)
  back = np.einsum("eo,edo->ed", ct[graph.dst], w[graph.etype]) * norm
  dx = np.zeros_like(x)
  np.add.at(dx, graph.src, back)
  return float((out * ct).sum()), dx


@pytest.mark.default_precision  # as the command runs: "default" is TF32 on a GPU
def test_quick_run_through_cli_writes_every_row_with_consistent_ratios(
  captured, tmp_path, capsys, monkeypatch
):
  path = tmp_path / "tensor_cores.md"
  argv = ["bench", "tensor-cores", "--quick", "--dims", str(DIM), "--write", str(path)]
  monkeypatch.setattr(sys, "argv", ["jaxdata", *argv])  # the command line the table records
  assert cli.main(argv) == 0
  printed = capsys.readouterr().out
  cases, notes, graphs = captured["out"]
  assert not notes, notes
  assert [(c.model, c.dim) for c in cases] == [("rgcn", DIM), ("rgat", DIM)]
  # a progress line per row, as it ran
  for c in cases:
    for m in c.rows:
      assert f"{c.model} dim {DIM}: {m.row.name}: " in printed

  text = path.read_text()
  assert f"Command: `jaxdata {' '.join(argv)}`" in text
  assert f"jax {jax.__version__}" in text
  here = captured["device"]
  assert f"- device: {here.device_kind} ({here.platform})" in text
  # float32 at "default": exact on the CPU; TF32 on a GPU (hector's where its tensor cores are on)
  loose = 1e-5 if here.platform == "cpu" else 2e-2
  assert "- tensor cores: " in text and "- date: " in text
  assert "Incomplete" not in text
  header, rows = _table(text)
  assert header == tc.HEADER
  col = {h: i for i, h in enumerate(header)}
  names = [r.name for r in tc.ROWS]
  assert len(names) == 4 + 2 * len(tc.PLAIN_JAX)
  assert [(r[0], r[1], r[2]) for r in rows] == [
    (m, str(DIM), n) for m in ("RGCN", "RGAT") for n in names
  ]

  for model in ("RGCN", "RGAT"):
    mine = {r[2]: r for r in rows if r[0] == model}
    ms = {n: float(r[col["fwd+bwd ms"]]) for n, r in mine.items()}  # every row ran on the CPU
    base = ms[tc.BASELINE.name]
    first = ms[tc.ORIGINAL.name]
    plain = {
      n: t
      for n, t in ms.items()
      if n not in (tc.BASELINE.name, tc.ORIGINAL.name, tc.TF32.name, tc.BF16.name)
    }
    fastest = min(plain.values())
    for row in (tc.BASELINE, tc.ORIGINAL, tc.TF32, tc.BF16):
      r = mine[row.name]
      assert _same_ratio(_x(r[col["vs f32 highest"]]), base, ms[row.name]), (model, row, r)
    assert not mine[tc.ORIGINAL.name][-1]  # no bar of its own: the others' are against it
    no_slower = re.search(
      r"no slower than today: (met|not met) \(([0-9.]+)x the original "
      r"traversals\)",
      mine[tc.BASELINE.name][-1],
    )
    assert _same_ratio(float(no_slower.group(2)), first, base)
    assert (no_slower.group(1) == "met") == (base <= first * (1 + tc.NO_SLOWER) + 1e-3)
    for row, need in ((tc.TF32, tc.TF32_VS_HIGHEST), (tc.BF16, tc.BF16_VS_HIGHEST)):
      r = mine[row.name]
      printed = float(re.search(r"vs original f32 highest \(([0-9.]+)x\)", r[-1]).group(1))
      assert _same_ratio(printed, first, ms[row.name]), (model, row, r[-1])
      _assert_bar(r[-1], rf"vs original f32 highest \({printed:.2f}x\)", printed, need)
      vs_plain = r[col["vs best plain JAX (default)"]]
      best = re.search(r"\((.*)\)$", vs_plain).group(1)
      assert plain[best] == fastest, (vs_plain, plain)  # the fastest plain-JAX row, named
      assert _same_ratio(_x(vs_plain), fastest, ms[row.name]), (model, row, vs_plain)
      _assert_bar(r[-1], "vs f32 highest", _x(r[col["vs f32 highest"]]), need)
    bf16 = mine[tc.BF16.name]
    _assert_bar(
      bf16[-1], "vs best plain JAX", _x(bf16[col["vs best plain JAX (default)"]]), tc.BF16_VS_PLAIN
    )
    assert all(not r[col["vs f32 highest"]] and not r[-1] for n, r in mine.items() if n in plain)
    # errors against row 1: on the CPU every float32 row is float32-exact; bfloat16 rounds
    err = {n: float(r[col["dx error vs f32 highest"]]) for n, r in mine.items()}
    assert err[tc.BASELINE.name] == 0
    for n, e in err.items():
      assert (
        (0 < e < 0.1)
        if n.endswith("bfloat16")
        else (e < max(loose, 0.1 * (here.platform != "cpu")))
      ), (model, n, e)
    if here.platform != "cpu":  # TF32: jaxdata's error is of the size of XLA's own TF32 error
      xla_tf32 = max(e for n, e in err.items() if n in plain and n.endswith("float32"))
      assert err[tc.TF32.name] <= max(loose, 3 * xla_tf32), (model, err)
    assert "float32-exact: met" in mine[tc.BASELINE.name][-1]
    # RGAT's check says how many edges sat at the leaky ReLU's kink (their ends left out)
    assert ("at the leaky ReLU's kink" in mine[tc.BASELINE.name][-1]) == (model == "RGAT")

  # the same run's figures, not parsed: jaxdata's float32 dx and loss against NumPy in float64
  graph, _ = rgnn.load_graph("synthetic", data_dir=None, quick=True)
  loss, dx = _rgcn_numpy(graph, DIM)
  rgcn = cases[0]
  base = rgcn.row(tc.BASELINE)
  if here.platform == "cpu":  # on a GPU the loss's own dot (sum(out * ct)) may run on TF32
    assert base.loss == pytest.approx(loss, rel=1e-4, abs=1e-3)
  np.testing.assert_allclose(base.dx, dx, rtol=1e-4, atol=1e-4 * np.abs(dx).max())
  for m in rgcn.rows:  # every formulation computes the same gradient (bfloat16: roughly)
    tol = 0.1 if m.row.dtype == "bfloat16" else max(loose, 1e-4)
    assert np.abs(m.dx - dx).max() <= tol * np.abs(dx).max(), m.row.name


def test_out_of_memory_row_is_reported_not_raised(monkeypatch, tmp_path, capsys):
  monkeypatch.setattr(rgnn, "QUICK_SYNTHETIC", TINY_SYNTHETIC)

  def exhausted(*args, **kwargs):
    raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 123.02GiB")

  monkeypatch.setitem(rgcn_ref.PLAIN_JAX, "ragged_dot", exhausted)
  path = tmp_path / "t.md"
  with jax.default_device(jax.devices("cpu")[0]):
    assert (
      cli.main(
        [
          "bench",
          "tensor-cores",
          "--quick",
          "--models",
          "rgcn",
          "--dims",
          "8",
          "--repeats",
          "1",
          "--write",
          str(path),
        ]
      )
      == 0
    )
  assert "rgcn dim 8: ragged_dot bfloat16: OOM" in capsys.readouterr().out
  _, rows = _table(path.read_text())
  status = {r[2]: r[3] for r in rows}
  assert status["ragged_dot float32"] == status["ragged_dot bfloat16"] == "OOM"
  assert float(status["jaxdata bfloat16"]) > 0
  assert "ragged_dot float32: out of memory" in path.read_text()


def test_a_run_cut_short_leaves_the_cases_it_measured(monkeypatch, tmp_path):
  monkeypatch.setattr(rgnn, "QUICK_SYNTHETIC", TINY_SYNTHETIC)
  monkeypatch.setattr(ra, "QUICK_SYNTHETIC", TINY_SYNTHETIC)
  measure = tc.measure_case

  def cut(model, *args, **kwargs):
    if model == "rgat":
      raise KeyboardInterrupt  # the call's time limit, or a crash, during the second case
    return measure(model, *args, **kwargs)

  monkeypatch.setattr(tc, "measure_case", cut)
  path = tmp_path / "t.md"
  with jax.default_device(jax.devices("cpu")[0]):  # the CLI reports an interrupt as exit 130
    assert (
      cli.main(
        ["bench", "tensor-cores", "--quick", "--dims", "8", "--repeats", "1", "--write", str(path)]
      )
      == 130
    )
  text = path.read_text()
  _, rows = _table(text)
  assert [r[0] for r in rows] == ["RGCN"] * len(tc.ROWS)
  assert "**Incomplete**: 1 of 2 cases measured so far" in text


@pytest.mark.parametrize(
  "argv,flag",
  [
    (["--dims", "30"], "--dims"),  # not a multiple of RGAT's 4 heads
    (["--models", "gcn"], "--models"),
    (["--repeats", "0"], "--repeats"),
    (["--write", "/no/such/folder/t.md"], "--write"),
    (["--graphs", "zipf-src-x"], "--graphs"),
  ],
)
def test_mistakes_are_one_line(argv, flag, capsys):
  try:
    code = cli.main(["bench", "tensor-cores", *argv])
  except SystemExit as e:
    code = e.code
  err = capsys.readouterr().err
  assert code == 2 and flag in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("setting", ["1", "0", None])
def test_reports_whether_tensor_cores_are_on_as_hector_decides(setting, monkeypatch):
  from jaxdata.hector.codegen import cuda

  if setting is None:
    monkeypatch.delenv(cuda.TENSOR_CORES_ENV, raising=False)
  else:
    monkeypatch.setenv(cuda.TENSOR_CORES_ENV, setting)
  text = tc.tensor_cores()
  assert text.startswith("on (" if cuda.tensor_cores_enabled() else "off ("), text
  assert (
    f"{cuda.TENSOR_CORES_ENV}={setting!r}" if setting else f"{cuda.TENSOR_CORES_ENV} unset"
  ) in text


def test_original_kernels_are_generated_with_the_constants_of_then_and_restored():
  """The original row's kernels: one feature of a row per thread, dot products one element
  per load and every id checked in each kernel, inside the context only (the CUDA source shows
  all three); the constants come back."""
  from jaxdata import hector
  from jaxdata.hector.codegen import common as gen_common
  from jaxdata.hector.codegen import cuda

  graph = rgnn.load_graph("synthetic", data_dir=None, quick=True)[0]
  case = ra.Case(graph)
  x, p, _ = ra.case_arrays("rgat", case, 64, 4)
  source = lambda precision="default": hector.rgat_layer.sources(  # noqa: E731
    ra.graph_arrays(case), "cuda", precision=precision, x=x, W=p.w, a_src=p.a_src, a_dst=p.a_dst
  )
  now = source()
  constants = lambda: (cuda.TRAVERSAL_FEATURES, gen_common.DOT_ALIGN, gen_common.VALID_MASK)  # noqa: E731
  before = constants()
  with tc.original_kernels():
    assert constants() == (1, 1, 0)
    then = source()
  assert constants() == before
  assert "edge_map<64, 4>" in now and "edge_map<64, 1>" in then  # the 64-wide stores
  assert "dot_rows<16, 16, 16>" in now and "dot_rows<16, 1, 1>" in then

  def kernels(text):
    return [part.split("jaxdata_hector_kernel(", 1)[1] for part in text.split("// ---- ")[1:]]

  # today: the traversals read the mask; the tiled GEMMs and weight gradients (which read the
  # row tiles) check their rows' ids themselves on tensor cores (default precision), and read
  # the mask on CUDA cores ("highest": `codegen.common.reads_valid`)
  def tiled(k):
    return "__restrict__ tiles =" in k

  assert {tiled(k) for k in kernels(now)} == {True, False}
  assert all(("row_ok(" in k) == tiled(k) and ("valid[e]" in k) != tiled(k) for k in kernels(now))
  assert all("valid[e]" in k and "row_ok(" not in k for k in kernels(source("highest")))
  assert all("row_ok(" in k and "valid[e]" not in k for k in kernels(then))
  assert source() == now


def test_the_hub_heavy_graphs_have_the_skew_they_name():
  """`rgnn.skewed_graph`: Zipf sources put most edges on a few hub sources and leave the
  destinations uniform; "uniform" has neither; an exponent of 1 or less is refused."""
  sizes = dict(synthetic=dict(num_nodes=5_000, num_edges=50_000, num_relations=20))

  def shares(name):
    g, why = rgnn.load_graph(name, data_dir=None, quick=True, **sizes)
    assert why is None and (g.num_nodes, g.num_edges) == (5_000, 50_000)
    assert np.bincount(g.etype, minlength=20).min() >= 1  # every relation has edges
    out = np.sort(np.bincount(g.src, minlength=g.num_nodes))
    inn = np.sort(np.bincount(g.dst, minlength=g.num_nodes))
    top = g.num_nodes // 100  # the top 1% of nodes' share of the edges
    return out[-top:].sum() / g.num_edges, inn[-top:].sum() / g.num_edges

  hubs, dst_share = shares("zipf-src-1.8")
  assert hubs > 0.5 and dst_share < 0.05
  src_share, dst_share = shares("zipf-dst-1.8")
  assert dst_share > 0.5 and src_share < 0.05
  assert max(shares("uniform")) < 0.05
  assert 0.05 < min(shares("zipf-both-3")) and max(shares("zipf-both-3")) < hubs  # lighter hubs
  with pytest.raises(ValueError, match="exponent must be > 1"):
    rgnn.load_graph("zipf-src-1", data_dir=None, quick=True)


def test_rdf_archives_are_graphs_of_their_own():
  """AIFB and MUTAG are bench graphs, read from the archives (both edge directions) for either
  model; other names are still refused."""
  if rgnn.default_data_dir() is None:
    pytest.skip("no RDF archives (../shared/data or $JAXDATA_DATA_DIR)")
  assert tc.unknown_graphs(["aifb", "mutag", "zipf-src-2", "cora"]) == ["cora"]
  graph = tc.load("rgcn", "aifb", quick=True)
  assert (graph.num_nodes, graph.num_edges) == (8_285, 58_086)
  assert "from aifb.tgz" in tc.describe("rgcn", graph)


def test_a_run_over_several_graphs_labels_each_case(captured, tmp_path):
  path = tmp_path / "t.md"
  argv = ["bench", "tensor-cores", "--quick", "--models", "rgcn", "--dims", str(DIM)]
  argv += ["--graphs", "uniform,zipf-src-2", "--plain-dtypes", "float32", "--write", str(path)]
  assert cli.main(argv) == 0
  cases, notes, graphs = captured["out"]
  assert [(c.model, c.graph) for c in cases] == [("rgcn", "uniform"), ("rgcn", "zipf-src-2")]
  assert [g.split(":")[0] for g in graphs] == ["rgcn", "rgcn"] and "Zipf 2 src" in graphs[1]
  _, rows = _table(path.read_text())
  assert {r[0] for r in rows} == {"RGCN on uniform", "RGCN on zipf-src-2"}
