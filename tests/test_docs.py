"""Every code block in README.md and docs/ runs as written, on a CPU.

A document's ```python blocks run in order in one fresh interpreter (later blocks use what
earlier ones defined, as a reader running them would); its ```bash blocks run line by line in a
shell after them. ```text blocks are output, not code. The README's first block (install, then
run) is what CI itself executes, so it is left out here. A bash block marked as run by another
test (tests/doc_blocks.py) is run there, as written, and checked more closely.
"""

import re
import subprocess
import sys

import pytest
from doc_blocks import ROOT, blocks, env, lines, run_line

# Its tests take 5 s to minutes each: the fast tier (-m "not slow") leaves this file out.
pytestmark = pytest.mark.slow

DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
RUNNABLE = {"python", "bash", "sh"}


def test_every_block_says_what_it_is():
  """A fence without a language is ambiguous (code or output?): each must name one."""
  bare = [
    f"{p.relative_to(ROOT)}: block {i + 1}"
    for p in DOCS
    for i, b in enumerate(blocks(p))
    if not b.lang
  ]
  assert not bare, f"code fences without a language (use python, bash or text): {bare}"


def test_a_block_run_by_another_test_names_one_that_exists():
  """`<!-- run by tests/test_x.py::test_name -->` above a block hands it to that test (see
  tests/doc_blocks.py): the test must exist, and the block must be a bash block."""
  wrong = []
  for p in DOCS:
    for b in blocks(p):
      if not b.run_by:
        continue
      file, _, name = b.run_by.partition("::")
      test = ROOT / file
      if (
        b.lang != "bash"
        or not test.is_file()
        or not re.search(rf"^def {name}\(", test.read_text(), re.M)
      ):
        wrong.append(f"{p.relative_to(ROOT)}: {b.run_by} ({b.lang} block)")
  assert not wrong, f"blocks handed to tests that do not exist, or not bash: {wrong}"


@pytest.mark.parametrize(
  "path",
  [p for p in DOCS if any(b.lang in RUNNABLE for b in blocks(p))],
  ids=lambda p: str(p.relative_to(ROOT)),
)
def test_the_documents_code_runs_as_written(path, tmp_path):
  """Blocks handed to another test (`<!-- run by ... -->`) are left to it."""
  python = "\n\n".join(b.code for b in blocks(path) if b.lang == "python")
  if python:
    proc = subprocess.run(
      [sys.executable, "-c", python],
      cwd=tmp_path,
      env=env(tmp_path),
      capture_output=True,
      text=True,
      timeout=600,
    )
    assert proc.returncode == 0, f"{path.name}'s python blocks failed:\n{proc.stderr[-3000:]}"
  for b in blocks(path):
    if b.lang in ("bash", "sh") and not b.run_by:
      for line in lines(b.code):
        run_line(line, tmp_path, path.name)
