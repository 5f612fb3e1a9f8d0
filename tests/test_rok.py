"""`jaxdata rok` end to end on a tiny model: JAX's built-in policies, the planner's rows, the
table."""

import itertools

import jax.numpy as jnp
import pytest

from benchmarks import rok
from jaxdata.offload import planner

# Its tests take 5 s to minutes each: the fast tier (-m "not slow") leaves this file out.
pytestmark = pytest.mark.slow

TINY = dict(layers=2, hidden=32, heads=2, seq=32, batch=2, vocab=64)


@pytest.fixture(scope="module")
def measured():
  lines = []
  rows, notes = rok.run(
    **TINY, param_dtype="bfloat16", fractions=(1.0, 0.6), repeats=1, say=lines.append
  )
  return rows, notes, lines


def test_rok_measures_every_builtin_and_a_plan_per_budget(measured):
  rows, notes, _ = measured
  names = [r.name for r in rows if r.kind == "jax"]
  assert names == list(rok._builtin())
  keep = notes["keep"]
  assert keep.name == "keep everything" and keep.device_bytes > 0
  by_name = {r.name: r for r in rows}
  # Recomputing everything keeps less than keeping everything (XLA's own accounting).
  assert by_name["recompute everything"].device_bytes < keep.device_bytes
  planned = [r for r in rows if r.kind == "planner"]
  assert [r.budget for r in planned] == [
    int(f * keep.device_bytes)
    for f in (1.0, 0.6)
    if int(f * keep.device_bytes) >= notes["baseline"]
  ]
  for r in planned:
    assert r.seconds > 0 and r.plan


def test_rok_plans_are_the_brute_force_optimum_of_the_measured_choices(measured):
  """The planner's pick for each budget, against every assignment of the tiny model's measured
  choices to its layers, in every order and under every spill cap a plan may ask for."""
  _, notes, _ = measured
  cands, bandwidth, layers = notes["candidates"], notes["bandwidth"], TINY["layers"]
  assert len(cands) >= 4 and notes["plans"]
  for frac, best in notes["plans"].items():
    budget = int(frac * notes["keep"].device_bytes) - notes["baseline"]
    fitting = {}
    for picks in itertools.product(cands, repeat=layers):
      largest = max(c.offload_bytes for c in picks)
      for cap in [n * largest for n in planner._CAPS] if largest else [None]:
        p = planner.predict(list(picks), bandwidth, spill_cap=cap)
        if p.device_bytes <= budget:
          fitting[tuple(str(c.policy) for c in picks), cap] = p.seconds
    assert best.device_bytes <= budget
    fastest = min(fitting.values())
    assert best.seconds == pytest.approx(fastest, rel=1e-9), (
      frac,
      str(best),
      min(fitting, key=fitting.get),
    )
    assert fitting[tuple(str(p) for p in best.policies), best.spill_cap or None] == best.seconds


def test_rok_table_names_the_parameter_dtype_and_the_plot(measured):
  rows, notes, _ = measured
  text = rok.markdown(
    rows, notes, "jaxdata rok --quick", dict(TINY, param_dtype="bfloat16"), png="rok_bf16.png"
  )
  assert "bfloat16 parameters and gradients" in text
  assert "](rok_bf16.png)" in text
  header, body = rok.table_rows(rows, notes)
  assert len(body) == len(rows) and all(len(b) == len(header) for b in body)
  keep_row = body[[r.name for r in rows].index("keep everything")]
  assert keep_row[2] == "1.000"


def test_rok_param_dtype_reaches_the_model(monkeypatch):
  seen = []

  def spy(model, tokens, plan):
    seen.append(model.blocks.qkv.kernel[...].dtype)
    raise RuntimeError("stop after the first compile")

  monkeypatch.setattr(rok, "_step", spy)
  with pytest.raises(RuntimeError, match="keep-everything"):
    rok.run(**TINY, param_dtype="bfloat16", fractions=(1.0,), repeats=1, say=lambda _: None)
  assert seen and all(d == jnp.bfloat16 for d in seen)


def test_cli_rok_passes_the_dtype_and_names_the_plot_after_the_table(
  measured, monkeypatch, tmp_path, capsys
):
  from jaxdata import cli

  rows, notes, _ = measured
  seen = {}

  def fake_run(**kw):
    seen.update(kw)
    return rows, notes

  monkeypatch.setattr(rok, "run", fake_run)
  out = tmp_path / "curve.md"
  assert (
    cli.main(["rok", "--quick", "--param-dtype", "bfloat16", "--repeats", "1", "--write", str(out)])
    == 0
  )
  assert seen["param_dtype"] == "bfloat16" and seen["repeats"] == 1
  text = out.read_text()
  assert "bfloat16 parameters" in text
  try:  # the plot, and its link, only where matplotlib can draw it
    import matplotlib  # noqa: F401

    assert "](curve.png)" in text and (tmp_path / "curve.png").exists()
  except ImportError:
    assert "](curve.png)" not in text and "matplotlib is not installed" in capsys.readouterr().out
  capsys.readouterr()
  assert cli.main(["rok", "--quick", "--write", str(tmp_path / "curve.png")]) == 2
  assert ".md" in capsys.readouterr().err
