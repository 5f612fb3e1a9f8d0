"""`jaxdata bench one-process` (examples/benchmarks/one_process.py): a plain run against `jaxdata
launch -n 1`, on the CPU at --quick sizes, checked against the runs' own history.json files."""

import json
import os
import statistics
import subprocess
import sys

import doc_blocks
import pytest

from benchmarks import one_process


def _env() -> dict:
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    PYTHONUNBUFFERED="1",
    XLA_FLAGS=os.environ.get("JAXDATA_TEST_XLA_FLAGS", ""),
  )
  env.pop("JAX_COORDINATOR_ADDRESS", None)
  return env


def _bench(*args, timeout=240):
  return subprocess.run(
    [sys.executable, "-m", "jaxdata.cli", "bench", "one-process", *args],
    env=_env(),
    timeout=timeout,
    capture_output=True,
    text=True,
  )


def _rows(md: str) -> dict[str, dict[str, str]]:
  """The results table of the Markdown page: path -> {column: cell}."""
  lines = [l for l in md.splitlines() if l.startswith("| ")]
  header = [c.strip() for c in lines[0].strip("|").split("|")]
  assert header == one_process.HEADER
  out = {}
  for line in lines[1:]:
    cells = [c.strip() for c in line.strip("|").split("|")]
    if len(cells) != len(header):  # the second table (path, what, train command)
      break
    out[cells[0]] = dict(zip(header, cells))
  return out


def test_quick_rgcn_reports_both_variants_from_their_own_histories(tmp_path):
  """docs/distributed.md's command, as written (`--write one_process.md --keep
  one_process-runs`)."""
  [(line, _)] = doc_blocks.run_block("docs/distributed.md", tmp_path)
  assert "--write one_process.md --keep one_process-runs" in line, line
  md_path, keep = tmp_path / "one_process.md", tmp_path / "one_process-runs"
  md = md_path.read_text()
  assert "bench one-process --quick --paths rgcn" in md and "jax 0." in md
  assert "Not yet measured on the H200" in md  # a CPU run says so
  row = _rows(md)["rgcn"]
  # The launched run joined a one-process job; the plain one did not.
  out = {v: (keep / f"rgcn-{v}-0.txt").read_text() for v in one_process.VARIANTS}
  assert "process 0 of 1 joining the job" in out["launched"]
  assert "joining the job" not in out["plain"]
  # Independently from each run's history.json: the steady state (epochs after the first) and
  # the final loss, which both variants must share.
  hist = {
    v: json.loads((keep / f"rgcn-{v}-0" / "history.json").read_text()) for v in one_process.VARIANTS
  }
  assert len(hist["plain"]) == len(hist["launched"]) == 6
  assert hist["plain"][-1]["loss"] == hist["launched"][-1]["loss"]
  assert row["equal"] == "yes"
  for v in one_process.VARIANTS:
    assert float(row[f"final loss {v}"]) == pytest.approx(hist[v][-1]["loss"], rel=1e-7)
    steady_ms = 1e3 * statistics.median(e["seconds"] for e in hist[v][1:])
    assert float(row[f"{v} (ms)"]) == pytest.approx(steady_ms, rel=1e-3)
  # The ratio printed is launched / plain of the times printed (up to their rounding), and one
  # round's spread is that ratio.
  plain, launched = float(row["plain (ms)"]), float(row["launched (ms)"])
  assert float(row["launched / plain"]) == pytest.approx(launched / plain, abs=2e-3)
  lo, hi = (float(x) for x in row["spread (min-max)"].split("-"))
  assert lo == hi == pytest.approx(launched / plain, abs=2e-3)
  assert "`jaxdata train rgcn --nodes 2000" in md


def test_a_history_without_a_steady_state_fails_the_run_and_is_reported(tmp_path):
  md_path = tmp_path / "one.md"
  r = _bench(
    "--quick",
    "--paths",
    "rgcn",
    "--repeats",
    "1",
    "--extra",
    "rgcn=--epochs 1",
    "--write",
    str(md_path),
  )
  assert r.returncode == 1
  assert "at least 2 are needed" in " ".join(r.stdout.split())
  row = _rows(md_path.read_text())["rgcn"]
  assert row["plain (ms)"] == row["launched (ms)"] == "failed"
  assert "Problems:" in md_path.read_text()


@pytest.mark.parametrize(
  "args,flag",
  [
    (["--paths", "rgcn,nope"], "--paths"),
    (["--extra", "nope=--epochs 2"], "--extra"),
    (["--extra", "rgcn"], "--extra"),
    (["--repeats", "0"], "--repeats"),
  ],
)
def test_bad_options_are_one_line_errors(args, flag, capsys):
  """In this process: usage errors come before any run (the command's own process is tested
  above)."""
  from jaxdata import cli

  with pytest.raises(SystemExit) as stopped:  # argparse's exit, as `jaxdata` exits
    cli.main(["bench", "one-process", *args])
  assert stopped.value.code == 2
  err = capsys.readouterr().err
  assert flag in err and len(err.strip().splitlines()) == 1, err


def test_steady_seconds_leaves_out_the_first_record_and_divides_windows_by_their_steps():
  epochs = [
    {"epoch": 1, "seconds": 9.0},
    {"epoch": 2, "seconds": 1.0},
    {"epoch": 3, "seconds": 3.0},
    {"epoch": 4, "seconds": 2.0},
  ]
  assert one_process.steady_seconds(epochs) == (2.0, "epoch")
  windows = [
    {"step": 2, "seconds": 10.0},
    {"step": 4, "seconds": 2.0},
    {"step": 10, "seconds": 9.0},
  ]  # per step: 1.0 and 1.5
  assert one_process.steady_seconds(windows) == (1.25, "step")
  with pytest.raises(ValueError, match="at least 2"):
    one_process.steady_seconds(epochs[:1])
  with pytest.raises(ValueError, match="no 'seconds'"):
    one_process.steady_seconds([{"epoch": 1}, {"epoch": 2}])


def test_summary_ratio_spread_and_a_loss_mismatch():
  R = one_process.Run
  runs = [
    R("gpt", "plain", 0, 2.0, 1.5, 3.0),
    R("gpt", "launched", 0, 3.0, 1.5, 4.0),
    R("gpt", "launched", 1, 2.0, 1.5, 4.0),
    R("gpt", "plain", 1, 2.0, 1.5, 3.0),
    R("gpt", "plain", 2, 4.0, 1.5, 3.0),
    R("gpt", "launched", 2, 4.0, 1.5, 4.0),
  ]
  row = one_process.summarize("gpt", ["train", "gpt"], runs, "step")
  assert (row.plain, row.launched) == (2.0, 3.0)  # medians over rounds
  assert row.ratio == 1.5 and sorted(row.ratios) == [1.0, 1.0, 1.5]
  cells = dict(zip(one_process.HEADER, one_process.table_rows([row])[0]))
  assert cells["spread (min-max)"] == "1.000-1.500" and cells["equal"] == "yes"

  def equal(row):
    return dict(zip(one_process.HEADER, one_process.table_rows([row])[0]))["equal"]

  runs[3] = R("gpt", "plain", 1, 2.0, 1.5000001, 3.0)  # plain's runs differ by 1e-7 (a GPU's)
  row = one_process.summarize("gpt", ["train", "gpt"], runs, "step")
  assert not row.losses_equal and equal(row) == "within spread"
  far = [
    R(r.path, r.variant, r.round, r.seconds, 1.5000003, r.wall) if r.variant == "launched" else r
    for r in runs
  ]  # every launched run 2e-7 past plain's, which spread 1e-7
  row = one_process.summarize("gpt", ["train", "gpt"], far, "step")
  assert equal(row) == "MISMATCH"
  assert "FINAL LOSSES DIFFER" in one_process.markdown(
    [row], {"device": "cpu", "host": "h", "software": "s", "date": "d"}, quick=True, repeats=3
  )
  far[5] = R("gpt", "launched", 2, 4.0, 1.5000002, 4.0)  # now 1e-7 from plain's: as close
  assert equal(one_process.summarize("gpt", ["train", "gpt"], far, "step")) == "within spread"
  assert equal(one_process.summarize("gpt", ["train", "gpt"], runs, "step")) == "within spread"
  one_each = [R("gpt", "plain", 0, 2.0, 1.5, 3.0), R("gpt", "launched", 0, 2.0, 1.6, 3.0)]
  assert equal(one_process.summarize("gpt", ["train", "gpt"], one_each, "step")) == "MISMATCH"
  runs[0] = R("gpt", "plain", 0, error="exit code 1")
  row = one_process.summarize("gpt", ["train", "gpt"], runs, "step")
  assert row.errors == ["plain round 0: exit code 1"] and len(row.ratios) == 2


@pytest.mark.parametrize("quick", [True, False], ids=["quick", "gpu-sized"])
def test_every_preset_is_a_valid_train_command_with_a_steady_state(quick):
  """The presets parse as `jaxdata train ...` (the GPU-sized ones are only run on the H200), with
  at least two epochs or logged windows, so that a steady state is left after the first; the
  size flags land in the path they belong to and win over the preset."""
  from jaxdata import cli

  parser = cli.parser()
  for path in one_process.PATHS:
    args = parser.parse_args(one_process.train_args(path, quick))
    assert args.command == "train" and args.model == path
    if path == "gpt":
      assert args.offload and args.plan != "auto"  # a fixed plan that offloads
      assert args.steps // (args.log_every or max(1, args.steps // 10)) >= 2
    else:
      assert args.epochs >= 2
  sized = {
    p: parser.parse_args(
      one_process.train_args(p, quick, epochs=7, steps=33, scale=0.01, extra="--seed 3")
    )
    for p in one_process.PATHS
  }
  assert sized["sage"].epochs == sized["rgcn"].epochs == sized["rgat"].epochs == 7
  assert sized["gpt"].steps == 33 and sized["rgat"].scale == 0.01
  assert all(a.seed == 3 for a in sized.values())
  assert sized["sage"].embed_dim > 0 and sized["rgat"].minibatch
