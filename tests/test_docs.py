"""Every code block in README.md and docs/ runs as written, on a CPU.

A document's ```python blocks run in order in one fresh interpreter (later blocks use what
earlier ones defined, as a reader running them would); its ```bash blocks run line by line in a
shell after them. ```text blocks are output, not code. The README's first block (install, then
run) is what CI itself executes, so it is left out here.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

# Its tests take 5 s to minutes each: the fast tier (-m "not slow") leaves this file out.
pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
RUNNABLE = {"python", "bash", "sh"}


def blocks(path: pathlib.Path) -> list[tuple[str, str]]:
  found = [(m.group(1), m.group(2)) for m in FENCE.finditer(path.read_text())]
  if path.name == "README.md":
    found = found[1:]  # the install + run commands: CI's own job
  return found


def test_every_block_says_what_it_is():
  """A fence without a language is ambiguous (code or output?): each must name one."""
  bare = [
    f"{p.relative_to(ROOT)}: block {i + 1}"
    for p in DOCS
    for i, (lang, _) in enumerate(blocks(p))
    if not lang
  ]
  assert not bare, f"code fences without a language (use python, bash or text): {bare}"


@pytest.mark.parametrize(
  "path",
  [p for p in DOCS if any(lang in RUNNABLE for lang, _ in blocks(p))],
  ids=lambda p: str(p.relative_to(ROOT)),
)
def test_the_documents_code_runs_as_written(path, tmp_path):
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    XLA_FLAGS=os.environ.get("JAXDATA_TEST_XLA_FLAGS", ""),
    JAXDATA_CACHE_DIR=os.environ.get("JAXDATA_CACHE_DIR", str(tmp_path / "cache")),
  )
  python = "\n\n".join(code for lang, code in blocks(path) if lang == "python")
  if python:
    proc = subprocess.run(
      [sys.executable, "-c", python],
      cwd=tmp_path,
      env=env,
      capture_output=True,
      text=True,
      timeout=600,
    )
    assert proc.returncode == 0, f"{path.name}'s python blocks failed:\n{proc.stderr[-3000:]}"
  for lang, code in blocks(path):
    if lang in ("bash", "sh"):
      for line in (l for l in code.splitlines() if l.strip() and not l.startswith("#")):
        proc = subprocess.run(
          line, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, f"{path.name}: `{line}` failed:\n{proc.stderr[-3000:]}"
