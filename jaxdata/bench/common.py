"""What every benchmark shares: a description of the machine, tables (rich and Markdown), the
command line it records, random rows.

Timing lives in `jaxdata.timing`, byte sizes in `jaxdata.sizes`."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import sys
from typing import Any

import jax
import numpy as np

from jaxdata import command


def cpu_model() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def hardware() -> dict[str, str]:
  """The machine, as a benchmark table should state it."""
  from jaxdata import _ffi  # pylint: disable=g-import-not-at-top

  dev = jax.devices()[0]
  info = {
    "device": f"{dev.platform}: {getattr(dev, 'device_kind', dev.platform)} x{jax.device_count()}",
    "host": f"{cpu_model()}, {os.cpu_count()} cores, "
    f"{_ffi.ext.physical_memory_bytes() / 2**30:.0f} GiB RAM",
    "software": f"jax {jax.__version__}, jaxlib {jax.lib.__version__}, "
    f"python {sys.version.split()[0]}",
    "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
  }
  if _ffi.built_with_cuda() and dev.platform == "gpu":
    runtime, driver = _ffi.cuda_versions()
    info["software"] += f", CUDA runtime {runtime}, driver API {driver}"
  return info


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return "\n".join(lines)


def random_rows(rng: np.random.Generator, rows: int, n: int) -> np.ndarray:
  dtype = np.int32 if rows < 2**31 else np.int64
  return rng.integers(0, rows, size=n, dtype=dtype)


def command_line() -> str:
  """This command line, as a benchmark table records it."""
  return "jaxdata " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def print_table(console, title: str, header, body, notes=(), left=()) -> None:
  """A rich table (cells printed as written, not as markup), then the notes in yellow."""
  import rich.markup  # pylint: disable=g-import-not-at-top
  import rich.table  # pylint: disable=g-import-not-at-top

  table = rich.table.Table(title=title)
  for h in header:
    table.add_column(h, justify="left" if h in left else "right")
  for r in body:  # cells are text, not markup: "keep[dots]" must print as written
    table.add_row(*(rich.markup.escape(str(c)) for c in r))
  console.print(table)
  for n in notes:
    console.print(f"[yellow]{rich.markup.escape(n)}")


def check_measured(results: list, notes: list[str]) -> None:
  """UsageError, one line giving the notes' reasons, where a benchmark measured nothing (every
  graph or device count it was given was skipped): an empty table is no result."""
  if not results:
    raise command.UsageError("nothing could be measured: " + ("; ".join(notes) or "no rows"))


def write(console, path: str, text: str) -> None:
  """Writes a benchmark's Markdown to `path` (its folder made if missing) and says so."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w") as f:
    f.write(text)
  console.print(f"wrote {path}")


def write_with_plot(console, path: str, markdown, plot) -> None:
  """Writes a benchmark's Markdown to `path` and its plot beside it (PATH.png): `plot(png_path)`
  draws and says whether it could (matplotlib present), `markdown(png_name or None)` gives the
  text, linking the image only when there is one."""
  png = os.path.splitext(path)[0] + ".png"
  drawn = plot(png)
  write(console, path, markdown(os.path.basename(png) if drawn else None))
  console.print(
    f"wrote {png}"
    if drawn
    else "[yellow]no plot: matplotlib is not installed (pip install matplotlib)"
  )


def pick(given, quick: bool, quick_value, full_value):
  """A setting: what the user gave, else the --quick value under --quick, else the full run's."""
  if given is not None:
    return given
  return quick_value if quick else full_value
