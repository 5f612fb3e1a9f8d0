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


def repl_errors(code: str) -> list[str]:
  """What a Python REPL would reject if `code` were pasted into it line by line: the standard
  console compiles its buffer after every line (`code.compile_command`, "single" mode), runs a
  complete statement and starts over, so a blank line inside an indented block ends the block
  there, and a statement right after a block without a blank line is a syntax error."""
  import codeop  # pylint: disable=g-import-not-at-top

  errors, buffer = [], []
  for number, line in enumerate(code.splitlines(), 1):
    buffer.append(line)
    try:
      done = codeop.compile_command("\n".join(buffer), "<stdin>", "single")
    except (SyntaxError, ValueError, OverflowError) as e:
      why = e.msg if isinstance(e, SyntaxError) else str(e)
      errors.append(f"line {number} {line.strip()!r}: {type(e).__name__}: {why}")
      buffer = []
      continue
    if done is not None:
      buffer = []
  return errors


def test_repl_errors_sees_what_a_repl_rejects():
  assert repl_errors("def f():\n  return 1\n\nf()\n") == []
  assert repl_errors("def f():\n  x = 1\n\n  return x\n")  # the blank line ended f
  assert repl_errors("for i in range(2):\n  pass\nprint(i)\n")  # no blank line after the loop


@pytest.mark.parametrize(
  "path",
  [p for p in DOCS if any(b.lang == "python" for b in blocks(p))],
  ids=lambda p: str(p.relative_to(ROOT)),
)
def test_the_python_blocks_paste_into_a_repl(path):
  """Each python block, pasted into a Python REPL line by line, is taken as written."""
  wrong = [
    f"block {i + 1}, {e}"
    for i, b in enumerate(blocks(path))
    if b.lang == "python"
    for e in repl_errors(b.code + "\n")
  ]
  assert not wrong, f"{path.name}: a REPL rejects {wrong}"


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_relative_links_lead_to_files():
  """Every relative link of README.md and docs/ (benchmarks included) names a file or folder
  that exists."""
  broken = []
  for doc in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
    for target in LINK.findall(doc.read_text()):
      if re.match(r"[a-z]+:", target) or target.startswith("#"):
        continue
      if not (doc.parent / target.split("#")[0]).exists():
        broken.append(f"{doc.relative_to(ROOT)}: {target}")
  assert not broken, f"links to nothing: {broken}"


def test_the_guides_carry_no_work_history():
  """README.md and docs/*.md describe the project as it is: no issue or session numbers; nor
  do the headings of the benchmark tables (the *_notes.md files are the development record)."""
  history = re.compile(r"\b(issue|session)s? \d+|\bissue's\b", re.I)
  tables = [
    d for d in sorted((ROOT / "docs" / "benchmarks").glob("*.md")) if "_notes" not in d.name
  ]
  heading = lambda line: line.startswith("#") or line.startswith("| ")  # noqa: E731
  found = [
    f"{doc.relative_to(ROOT)}:{n}: {line.strip()[:80]}"
    for doc in DOCS + tables
    for n, line in enumerate(doc.read_text().splitlines(), 1)
    if history.search(line) and (doc in DOCS or heading(line))
  ]
  assert not found, f"work history in the guides: {found}"


#: A figure: a number with a unit, or a range of two ("1.85-1.93x").
FIGURE = re.compile(
  r"(?<![\w.])(\d[\d,]*(?:\.\d+)?)(?:-(\d[\d,]*(?:\.\d+)?))?(?:x\b|%| ms\b| GB/s)"
)


def unsourced_figures(table: str, root=ROOT) -> list[str]:
  """The figures of a markdown table's rows that the benchmark files each row links to do not
  contain (every end of a range must be there, as written); a row with figures and no linked
  benchmark file is one entry too."""
  missing = []
  for row in (r for r in table.splitlines() if r.startswith("| ") and not r.startswith("| ---")):
    figures = [n for m in FIGURE.finditer(row) for n in m.groups() if n]
    sources = [s for s in LINK.findall(row) if s.startswith("docs/benchmarks/")]
    if figures and not sources:
      missing.append(f"{row[:60]}...: figures {figures} cite no docs/benchmarks/ table")
      continue
    text = " ".join((root / s.split("#")[0]).read_text() for s in sources)
    for n in figures:
      if not re.search(rf"(?<![\d.]){re.escape(n)}(?![\d])", text):
        missing.append(f"{n} (not in {', '.join(sources)})")
  return missing


def readme_table() -> str:
  text = (ROOT / "README.md").read_text()
  start = text.index("| part |")
  return text[start : text.index("\n\n", start)]


def test_the_readme_table_quotes_its_benchmark_tables():
  """Every figure in the README's table is in the benchmark table its row links to, so a
  rerun that changes a table shows up here until the README says the same."""
  table = readme_table()
  assert len(FIGURE.findall(table)) >= 10, "the table's figures were not found"
  assert not unsourced_figures(table)
  # The check itself can fail: a changed figure, an unlinked one.
  first = next(m.group(1) for m in FIGURE.finditer(table))
  assert unsourced_figures(table.replace(first, first + "1", 1))
  assert unsourced_figures("| x | 2.5x faster |")


#: The public packages the API reference covers (each documents the names of its `__all__`).
API = (
  "jaxdata.host",
  "jaxdata.hector",
  "jaxdata.offload",
  "jaxdata.loader",
  "jaxdata.nn",
  "jaxdata.data",
)


def test_the_api_reference_builds_from_the_docstrings(tmp_path):
  """`python -m pdoc` (docs/development.md) builds a page per public package, without warnings,
  and every name a package exports has its entry there (pdoc: the test extra)."""
  import importlib

  pytest.importorskip("pdoc")

  proc = subprocess.run(
    [sys.executable, "-m", "pdoc", *API, "-o", str(tmp_path)],
    env=env(tmp_path),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0 and "Warn" not in proc.stderr, proc.stderr[-3000:]
  for name in API:
    page = (tmp_path / (name.replace(".", "/") + ".html")).read_text()
    missing = [n for n in importlib.import_module(name).__all__ if f'id="{n}"' not in page]
    assert not missing, f"{name}: no entry for {missing}"
