"""The code blocks of README.md and docs/, and how tests run them (tests/test_docs.py).

A bash block that another test runs as written and checks more closely (a launch test that
compares the job with one process) says so on the line above its fence, in an HTML comment a
reader does not see:

  <!-- run by tests/test_distributed.py::test_two_processes_of_two_devices_train_like_... -->

tests/test_docs.py then checks that the test exists and leaves the block to it, so one
multi-process job does not run twice in a suite; the test runs the block with `run_block`,
line by line, in the same environment test_docs gives every document.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
from typing import NamedTuple

ROOT = pathlib.Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^(?:<!-- run by (\S+) -->\n)?```(\w*)\n(.*?)^```", re.M | re.S)


class Block(NamedTuple):
  lang: str  # "python", "bash", "text", ...
  code: str
  run_by: str  # the test that runs it ("tests/test_x.py::test_name"), or "" for test_docs


def blocks(path: pathlib.Path) -> list[Block]:
  found = [
    Block(m.group(2), m.group(3), m.group(1) or "") for m in FENCE.finditer(path.read_text())
  ]
  if path.name == "README.md":
    found = found[1:]  # the install + run commands: CI's own job
  return found


def env(tmp_path: pathlib.Path) -> dict[str, str]:
  """The environment a document's code runs in: the CPU, the suite's XLA flags and caches."""
  return dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    XLA_FLAGS=os.environ.get("JAXDATA_TEST_XLA_FLAGS", ""),
    JAXDATA_CACHE_DIR=os.environ.get("JAXDATA_CACHE_DIR", str(tmp_path / "cache")),
  )


def lines(code: str) -> list[str]:
  """A bash block's commands: its non-empty lines that are not comments."""
  return [l for l in code.splitlines() if l.strip() and not l.startswith("#")]


def run_line(line: str, where: pathlib.Path, doc: str) -> subprocess.CompletedProcess:
  """One command of `doc`'s bash block, in a shell in `where`; it must succeed."""
  proc = subprocess.run(
    line, shell=True, cwd=where, env=env(where), capture_output=True, text=True, timeout=600
  )
  assert proc.returncode == 0, f"{doc}: `{line}` failed:\n{proc.stderr[-3000:]}"
  return proc


def run_block(doc: str, where: pathlib.Path) -> list[tuple[str, subprocess.CompletedProcess]]:
  """Runs the block of `doc` (a path from the repository's root) marked as run by the calling
  test, each line as test_docs would, in `where`; returns (line, its finished process) pairs."""
  current = os.environ["PYTEST_CURRENT_TEST"].rsplit(" ", 1)[0].split("[")[0]
  mine = [b for b in blocks(ROOT / doc) if b.run_by == current]
  assert len(mine) == 1, f"{doc}: {len(mine)} blocks marked `<!-- run by {current} -->`"
  return [(line, run_line(line, where, doc)) for line in lines(mine[0].code)]
