"""The scripts in examples/ run as a user runs them (a fresh process, the CPU here) and learn:
each trains to well above chance, and the RGCN one reaches the RGCN paper's AIFB accuracy.
(examples/gpt_offload.py, a minute of CPU, is left to tests/test_gpt.py's planned training.)"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.rgnn import default_data_dir

ROOT = Path(__file__).resolve().parents[1]

# Whole training runs, 10-60 s each on two cores: the fast tier (-m "not slow") leaves them out.
pytestmark = pytest.mark.slow


def run(script: str, *args: str) -> str:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
    [sys.executable, str(ROOT / "examples" / script), *args],
    capture_output=True,
    text=True,
    timeout=280,
    cwd=ROOT,
    env=env,
  )
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  return proc.stdout


def accuracy_in(out: str) -> float:
  (value,) = re.findall(r"^test accuracy ([0-9.]+)$", out, re.M)
  return float(value)


def test_rgcn_on_aifb_reaches_the_papers_accuracy():
  """The paper reports 95.83% on AIFB's 36 test entities; one or two mistakes are seeds' luck."""
  archive = Path(default_data_dir() or ROOT) / "aifb.tgz"
  if not archive.exists():
    pytest.skip("aifb.tgz is missing ($JAXDATA_DATA_DIR or ../shared/data)")
  out = run("rgcn_aifb.py", str(archive))
  assert "HeteroGraph(num_nodes=8285, num_edges=58086, num_relations=90)" in out
  assert accuracy_in(out) >= 34 / 36, out


def test_hgt_minibatch_reads_the_class_through_the_graph():
  """A paper's class is its venue's topic (4 classes, chance 25%); its own features are noise."""
  out = run("hgt_minibatch.py", "--epochs", "8")
  losses = [float(v) for v in re.findall(r"^epoch +\d+ +loss ([0-9.]+)$", out, re.M)]
  assert len(losses) == 8 and losses[-1] < losses[0] / 3, out
  assert accuracy_in(out) >= 0.8, out


def test_host_gather_trains_from_a_host_table():
  """A logistic regression whose rows come from pinned host memory learns its planted signal."""
  out = run("host_gather.py")
  (value,) = re.findall(r"^accuracy on \d+ rows: ([0-9.]+)$", out, re.M)
  assert float(value) >= 0.95, out
