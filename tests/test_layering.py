"""Dependencies point one way (DESIGN.md): benchmarks (examples/benchmarks/, outside the
package) -> apps (cli, command, distributed, launch, train) -> tasks (what the trainers train, and
checkpoints: `jaxdata.load_model` imports no app) -> models (nn) -> libraries (host, hector,
offload, loader) -> ground (data, reference, _ffi, _version, placement, sizes, timing).
Every import in a module, at top level or inside a function, is checked against its layer; the
checks are run on planted violations too, so they can fail."""

import ast
import importlib.util
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jaxdata"
APPS = (
  "jaxdata.cli",
  "jaxdata.command",
  "jaxdata.distributed",
  "jaxdata.launch",
  "jaxdata.train",
  "benchmarks",
)
TASKS = ("jaxdata.tasks",)
MODELS = ("jaxdata.nn",)
LIBRARIES = ("jaxdata.host", "jaxdata.hector", "jaxdata.offload", "jaxdata.loader")
GROUND = (
  "jaxdata.data",
  "jaxdata.reference",
  "jaxdata._ffi",
  "jaxdata._version",
  "jaxdata.placement",
  "jaxdata.sizes",
  "jaxdata.timing",
)
#: What each layer may not import.
FORBIDDEN = {
  TASKS: APPS,
  MODELS: APPS + TASKS,
  LIBRARIES: APPS + TASKS + MODELS,
  GROUND: APPS + TASKS + MODELS + LIBRARIES,
}


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path, name: str | None = None) -> list[tuple[int, str]]:
  """(line, module) for every import in the file (module `name`, by default its own);
  relative imports resolved."""
  name = _module_name(path) if name is None else name
  package = name.rsplit(".", 0 if path.name == "__init__.py" else 1)[0]
  found = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      found += [(node.lineno, a.name) for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(
          package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
        )
      found += [(node.lineno, f"{base}.{a.name}") for a in node.names] + [(node.lineno, base)]
  return found


def _within(name: str, layer: tuple[str, ...]) -> bool:
  return any(name == p or name.startswith(p + ".") for p in layer)


def _layer_modules():
  for path in sorted(PACKAGE.rglob("*.py")):
    name = _module_name(path)
    for layer, forbidden in FORBIDDEN.items():
      if _within(name, layer):
        yield pytest.param(path, forbidden, id=name)


def upward(path: pathlib.Path, forbidden: tuple[str, ...], name: str | None = None) -> list[str]:
  """The imports of the file at `path` (module `name`) from the layers `forbidden`."""
  found = _imports(path, name)
  return sorted({f"line {line}: {mod}" for line, mod in found if _within(mod, forbidden)})


def strays(names) -> list[str]:
  """The module names outside every layer (the package itself, "jaxdata", has none)."""
  every = APPS + TASKS + MODELS + LIBRARIES + GROUND
  return [n for n in names if n != "jaxdata" and not _within(n, every)]


@pytest.mark.parametrize("path,forbidden", list(_layer_modules()))
def test_module_imports_only_from_its_layer_and_below(path, forbidden):
  wrong = upward(path, forbidden)
  assert not wrong, f"{path.relative_to(PACKAGE.parent)} imports upward: {wrong}"


def test_every_module_has_a_layer():
  stray = strays(_module_name(p) for p in PACKAGE.rglob("*.py"))
  assert not stray, f"modules outside every layer (add them to one): {stray}"


def test_the_checks_fail_on_planted_violations(tmp_path):
  """A library importing a trainer inside a function, a model importing the CLI through a
  relative import, and modules outside every layer are each found."""
  lib = tmp_path / "lib.py"
  lib.write_text("def f():\n  from jaxdata.train import sage\n  return sage\n")
  wrong = upward(lib, FORBIDDEN[LIBRARIES], "jaxdata.host.planted")
  assert wrong == ["line 2: jaxdata.train", "line 2: jaxdata.train.sage"]
  model = tmp_path / "model.py"
  model.write_text("import numpy\nfrom .. import cli\n")
  assert upward(model, FORBIDDEN[MODELS], "jaxdata.nn.planted") == ["line 2: jaxdata.cli"]
  names = ["jaxdata", "jaxdata.nn.gpt", "jaxdata.experimental", "jaxdata.loaders"]
  assert strays(names) == ["jaxdata.experimental", "jaxdata.loaders"]


def test_the_package_imports_no_benchmark(tmp_path):
  """The wheel ships without examples/benchmarks/: only the CLI reaches them, by name
  (importlib, when `jaxdata bench` runs from a clone), never through an import statement; a
  planted one is found."""
  wrong = {
    str(p.relative_to(PACKAGE.parent)): upward(p, ("benchmarks",)) for p in PACKAGE.rglob("*.py")
  }
  assert not {k: v for k, v in wrong.items() if v}, "the package imports the benchmarks"
  planted = tmp_path / "planted.py"
  planted.write_text("def f():\n  from benchmarks import rok\n  return rok\n")
  assert upward(planted, ("benchmarks",), "jaxdata.train.planted") == [
    "line 2: benchmarks",
    "line 2: benchmarks.rok",
  ]


def test_trainers_import_no_benchmark_or_command_line_and_no_other_trainer():
  """Within the apps: cli -> bench -> train. A trainer shares with other trainers only through
  jaxdata.train.common, the full-graph loop over destination parts (jaxdata.train.partitioned)
  and the tasks below them."""
  shared = ("jaxdata.train.common", "jaxdata.train.partitioned")
  for path in sorted((PACKAGE / "train").rglob("*.py")):
    name = _module_name(path)
    if name in shared or name == "jaxdata.train":
      continue
    # a trainer is a module or a package (jaxdata.train.attention and its minibatch module)
    trainer = ".".join(name.split(".")[:3])
    wrong = sorted(
      {
        f"line {line}: {mod}"
        for line, mod in _imports(path)
        if _within(mod, ("benchmarks", "jaxdata.cli"))
        or (
          _within(mod, ("jaxdata.train",))
          and not _within(mod, shared)
          and mod != "jaxdata.train"
          and not _within(mod, (trainer,))
        )
      }
    )
    assert not wrong, f"{path.relative_to(PACKAGE.parent)} imports sideways: {wrong}"


def inner_imports(path: pathlib.Path) -> list[tuple[int, str]]:
  """(line, text) of every import statement inside a function of the file."""
  lines = path.read_text().splitlines()
  found = set()
  for node in ast.walk(ast.parse("\n".join(lines), str(path))):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      for inner in ast.walk(node):
        if isinstance(inner, (ast.Import, ast.ImportFrom)):
          found.add((inner.lineno, lines[inner.lineno - 1].strip()))
  return sorted(found)


def test_imports_inside_functions_are_few_and_each_says_why(tmp_path):
  """Imports sit at the top of a module; at most 15 in the package wait inside a function (an
  optional dependency, an app reached only when asked for), each with a comment saying why."""
  found = {
    f"{path.relative_to(PACKAGE.parent)}:{line}": text
    for path in sorted(PACKAGE.rglob("*.py"))
    for line, text in inner_imports(path)
  }
  assert len(found) <= 15, f"{len(found)} imports inside functions: {sorted(found)}"
  silent = [k for k, text in found.items() if "#" not in text]
  assert not silent, f"imports inside functions without their reason: {silent}"
  planted = tmp_path / "planted.py"
  planted.write_text("import os\n\n\ndef f():\n  import json\n  return json, os\n")
  assert inner_imports(planted) == [(5, "import json")]


def import_cycles(modules: dict[str, pathlib.Path]) -> list[list[str]]:
  """The groups of modules (of `modules`: name -> file) that import each other in a circle,
  counting imports inside functions (Tarjan's strongly connected components). `from pkg import
  name` depends on module pkg.name where that is a module (a compiled one is a leaf), else on
  pkg."""

  def is_module(name: str) -> bool:
    try:
      return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
      return False

  graph = {}
  for name, path in modules.items():
    found = _imports(path, name)
    deps = set()
    for line, mod in found:
      if any(line == n and other.startswith(mod + ".") for n, other in found):
        continue  # the `pkg` of `from pkg import name`: the entry for `name` decides
      if mod in modules:
        deps.add(mod)
      elif not is_module(mod) and mod.rpartition(".")[0] in modules:
        deps.add(mod.rpartition(".")[0])  # a name the package defines, not one of its modules
    deps.discard(name)
    graph[name] = deps
  index, low, stack, cycles = {}, {}, [], []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      group = stack[stack.index(v) :]
      del stack[stack.index(v) :]
      if len(group) > 1:
        cycles.append(sorted(group))

  for v in graph:
    if v not in index:
      visit(v)
  return cycles


def test_no_import_cycles(tmp_path):
  modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
  assert not import_cycles(modules), "modules that import each other in a circle"
  (tmp_path / "a.py").write_text("from jaxdata import b\n")
  (tmp_path / "b.py").write_text("def f():\n  from jaxdata.a import x\n  return x\n")
  (tmp_path / "c.py").write_text("import jaxdata.a\n")
  planted = {f"jaxdata.{n}": tmp_path / f"{n}.py" for n in "abc"}
  assert import_cycles(planted) == [["jaxdata.a", "jaxdata.b"]]
