"""`jaxdata bench rgnn --model rgat|hgt` (examples/benchmarks/rgnn_attention.py), on tiny CPU
inputs.

Through the CLI: every row is there, every formulation computes the same loss, the table and
the ablation are written. Then out-of-memory reported as a result, and the HGT adapter's
refusal of a signature it does not know.
"""

import jax
import numpy as np
import pytest
from bench_checks import assert_losses_agree

from benchmarks import rgnn
from benchmarks import rgnn_attention as ra
from jaxdata import cli

# Its tests take 5 s to minutes each: the fast tier (-m "not slow") leaves this file out.
pytestmark = pytest.mark.slow

pytest.importorskip("torch_geometric")


@pytest.fixture(autouse=True)
def torch_on_the_cpu(monkeypatch):
  """These are CPU tests (tiny inputs, CPU memory rules): PyG runs on the CPU here as JAX does,
  also on a machine with a GPU."""
  import torch

  from jaxdata.reference import pyg

  monkeypatch.setattr(pyg, "torch_device", lambda: torch.device("cpu"))


TINY_SYNTHETIC = dict(num_nodes=400, num_edges=3_000, num_relations=12)
TINY_MAG = "0.0001"  # about 200 nodes and 4,000 edges


@pytest.fixture
def captured(monkeypatch):
  """Runs the CLI on the CPU and keeps what rgnn_attention.run returned."""
  monkeypatch.setattr(ra, "QUICK_SYNTHETIC", TINY_SYNTHETIC)
  seen = {}
  run = ra.run

  def keep(*args, **kwargs):
    seen["out"] = run(*args, **kwargs)
    return seen["out"]

  monkeypatch.setattr(ra, "run", keep)
  with jax.default_device(jax.devices("cpu")[0]):
    yield seen


def test_rgat_quick_through_cli(captured, tmp_path):
  path = tmp_path / "rgnn_attention.md"
  assert (
    cli.main(
      [
        "bench",
        "rgnn",
        "--model",
        "rgat",
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
  results, notes, cases = captured["out"]
  assert [c.graph.num_relations for c in cases] == [12]
  assert list(dict.fromkeys(r.formulation for r in results)) == list(ra.FORMULATIONS)
  # --precision both (the CLI's default): plain JAX and jaxdata's row at both precisions, the
  # pass ablation's variants once.
  assert [r.precision for r in results if r.formulation in ra.PLAIN_JAX + ("jaxdata",)] == [
    "highest",
    "default",
  ] * (len(ra.PLAIN_JAX) + 1)
  assert len(results) == len(ra.FORMULATIONS) + len(ra.PLAIN_JAX) + 1
  assert all(r.ok and r.seconds > 0 and r.loss is not None for r in results), notes
  assert_losses_agree(results, notes)
  header, rows = ra.table_rows(results)
  mine = rows[0]
  assert mine[2] == "jaxdata (highest)" and mine[header.index("jaxdata vs PyG")].endswith("x")
  assert mine[header.index("memory / PyG's")] == "n/a"  # torch on the CPU keeps no peak
  text = path.read_text()
  assert text.startswith(ra.TITLE)
  assert "## One RGAT layer" in text and "### RGAT: what each pass buys" in text
  labelled = {"jaxdata", *ra.PLAIN_JAX}  # rows run at both precisions carry it in their name
  for name in ra.FORMULATIONS:
    assert (f"| {name} |" in text) != (name in labelled)
    assert (f"| {name} (highest) |" in text) == (name in labelled)
  for name in ra.PLAIN_JAX:
    assert f"| {name} (highest) |" in text and f"| {name} (default) |" in text
  _, ablation_rows, summary = ra.ablation(results)
  assert [r[2] for r in ablation_rows] == ["no passes", "compact only", "reorder only", "all"]
  assert [s.split(":")[0] for s in summary] == ["compact only", "reorder only", "all"]


def test_hgt_quick_through_cli(captured, tmp_path):
  path = tmp_path / "rgnn_attention.md"
  path.write_text(
    ra.document(None, "rgat", ra._begin("rgat") + "\nRGAT section\n" + ra._end("rgat"))
  )
  assert (
    cli.main(
      ["bench", "rgnn", "--model", "hgt", "--quick", "--mag-scale", TINY_MAG, "--write", str(path)]
    )
    == 0
  )
  results, notes, cases = captured["out"]
  assert [c.node_types for c in cases] == [("paper", "author", "institution", "field_of_study")]
  names = list(dict.fromkeys(r.formulation for r in results))
  if ra.hgt_message_fn() is None:
    assert names == [*ra.PLAIN_JAX, "PyG"]
    assert any("hgt_message" in n and "not built yet" in n for n in notes)
  else:
    assert names[0] == "jaxdata" and names[-4:] == [*ra.PLAIN_JAX, "PyG"]
  assert all(r.ok and r.seconds > 0 for r in results), notes
  assert_losses_agree(results, notes)
  text = path.read_text()
  assert "## One HGT layer" in text and "RGAT section" in text  # the other model's is kept
  assert text.index("RGAT section") < text.index("## One HGT layer")


def test_hgt_adapter_names_an_unknown_signature(monkeypatch):
  from jaxdata import hector

  monkeypatch.setattr(
    hector, "hgt_message", lambda graph, xs, params, *, passes=None: xs, raising=False
  )
  with pytest.raises(ra.peers.Unavailable, match="no adapter"):
    ra.hgt_jaxdata_formulation(None, None)


def test_oom_is_a_result_not_a_crash(monkeypatch):
  """A tiny memory limit: what XLA's analysis (or the PyG model) says cannot fit is not run;
  a run failing for memory is an OOM row; the tables still render."""
  monkeypatch.setattr(ra, "QUICK_SYNTHETIC", TINY_SYNTHETIC)
  monkeypatch.setattr(rgnn, "available_bytes", lambda device: 1 << 20)  # 1 MiB "free"
  plain = ra.plain_formulation

  def failing(model, name, edges, **kwargs):
    if name == "per-edge weights":
      raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9 GiB")
    return plain(model, name, edges, **kwargs)

  monkeypatch.setattr(ra, "plain_formulation", failing)
  with jax.default_device(jax.devices("cpu")[0]):
    results, notes, cases = ra.run(
      "rgat",
      ["synthetic"],
      [16],
      quick=True,
      repeats=1,
      formulations=["jaxdata", "ragged_dot", "per-edge weights", "PyG"],
    )
  by_name = {r.formulation: r for r in results}
  assert by_name["jaxdata"].ok  # a few hundred KiB
  assert by_name["ragged_dot"].status.startswith("OOM (est.")
  assert by_name["per-edge weights"].status == "OOM"
  assert by_name["PyG"].status.startswith("OOM (est.")  # [E, d_in, H*d] twice > 1 MiB
  assert any("ragged_dot: not run" in n for n in notes)
  assert any("per-edge weights: out of memory" in n for n in notes)
  assert ra.comparisons(results, "synthetic", 16) == ("all OOM", "PyG OOM", "PyG OOM")
  text = ra.markdown("rgat", results, notes, cases, "jaxdata bench rgnn --model rgat --quick")
  assert "| OOM |" in text and "OOM (est." in text


def test_bad_arguments(capsys):
  with pytest.raises(ValueError, match="multiple of heads"):
    ra.run("rgat", ["synthetic"], [30], heads=4, quick=True)
  with pytest.raises(ValueError, match="model"):
    ra.run("gcn", ["synthetic"], [32], quick=True)
  with pytest.raises(ValueError, match="unknown graph"):
    ra.load_case("hgt", "aifb", data_dir=None, quick=True)
  assert cli.main(["bench", "rgnn", "--model", "hgt", "--graphs", "aifb", "--quick"]) == 2
  assert "unknown graph" in capsys.readouterr().err


def test_rgat_inputs_share_attention_vectors_across_relations():
  """So that PyG's RGATConv (q, k shared by all relations) computes the same layer."""
  case = ra.Case(
    rgnn.Graph(
      "g",
      5,
      3,
      np.zeros(1, np.int32),
      np.zeros(1, np.int32),
      np.zeros(1, np.int32),
      np.ones(1, np.float32),
      "test",
    )
  )
  x, p, ct = ra.case_arrays("rgat", case, 8, 2)
  assert x.shape == ct.shape == (5, 8) and p.w.shape == (3, 8, 8) and p.a_src.shape == (3, 2, 4)
  assert (p.a_src == p.a_src[:1]).all() and (p.a_dst == p.a_dst[:1]).all()
  assert all(a.dtype == np.float32 for a in jax.tree.leaves(p))


def test_document_replaces_only_its_models_section():
  rgat = lambda body: ra._begin("rgat") + f"\n{body}\n" + ra._end("rgat")  # noqa: E731
  hgt = ra._begin("hgt") + "\nHGT\n" + ra._end("hgt")
  doc = ra.document(None, "hgt", hgt)
  doc = ra.document(doc, "rgat", rgat("first"))
  doc = ra.document(doc, "rgat", rgat("second"))
  assert doc.startswith(ra.TITLE) and doc.count(ra.TITLE) == 1
  assert "first" not in doc and doc.index("\nsecond\n") < doc.index("\nHGT\n")
