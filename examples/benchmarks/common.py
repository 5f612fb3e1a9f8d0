"""What every benchmark shares: a description of the machine, tables (rich and Markdown), the
command line it records, random rows.

Timing lives in `jaxdata.timing`, byte sizes in `jaxdata.sizes`."""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import re
import shlex
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxdata import command, timing
from jaxdata.host import HostTable
from jaxdata.host.gather import host_slice


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


# ------------------------------------------------------------------------ where a step's time goes
#: The parts of the step's device time: (named scope in the op names, part), in order; then the
#: backward pass (op names under ``transpose(``), the forward pass (the rest of the program) and
#: what names no instruction (copies and memsets XLA adds).
SCOPES = (
  ("sampling", "sampling"),
  ("deduplication", "deduplication"),
  ("blocks", "block building"),
  ("gathers", "feature gathers"),
  ("optimizer", "optimizer (Adam)"),
)
PARTS = (*(part for _, part in SCOPES), "forward", "backward", "copies and memsets")


def part_of(op_name: str) -> str:
  """The part of the step an HLO instruction with this ``op_name`` belongs to (`PARTS`)."""
  # a scope inside a transformation is written as it: "jvp(sampling)", "transpose(jvp(blocks))"
  scopes = [re.sub(r"^(\w+\()+|\)+$", "", c) for c in op_name.split("/")]
  for scope, part in SCOPES:
    if scope in scopes:
      return part
  if not op_name:
    return PARTS[-1]
  return "backward" if "transpose(" in op_name else "forward"


def step_parts(lowered: Any, call: Callable[[Any], Any], warmup: int, steps: int) -> StepParts:
  """A training step's device time by part (`PARTS`). `lowered` is the step, ``call(program)``
  runs a compiled program of it on the next batch. The step compiled as users run it is timed
  over `steps` queued back to back after `warmup`; the same program compiled without command
  buffers (a kernel inside a CUDA graph names the graph, not its HLO instruction; the kernels
  are the same) is traced, each kernel, copy and memset attributed to a part through its
  instruction's named scope (`part_of`)."""
  compiled = lowered.compile()
  for _ in range(warmup):
    jax.block_until_ready(call(compiled))
  t0 = time.perf_counter()
  jax.block_until_ready([call(compiled) for _ in range(steps)])
  steady = (time.perf_counter() - t0) / max(1, steps)
  profiled = lowered.compile(compiler_options={"xla_gpu_enable_command_buffer": ""})
  runs = 5
  events = timing.device_events(lambda: call(profiled), profiled.as_text(), runs=runs)
  kernels: dict[tuple[str, str], list[float]] = {}  # (part, kernel): [launches, ms] per step
  for start, end, kernel, op_name in events:
    where = "/".join(op_name.split("/")[-2:])  # its innermost scope and primitive
    k = kernels.setdefault((part_of(op_name), f"{kernel[:40]} [{where[:100]}]"), [0.0, 0.0])
    k[0] += 1 / runs
    k[1] += (end - start) * 1e-6 / runs
  busiest = sorted(kernels.items(), key=lambda kv: -kv[1][1])
  return StepParts(
    [(part, name, n, t) for (part, name), (n, t) in busiest],
    1e3 * timing.busy_seconds(events) / runs,
    1e3 * steady,
  )


@dataclasses.dataclass
class StepParts:
  """`step_parts`: every kernel [(part, kernel [op name's last scopes], launches per step, ms per
  step)], busiest first; device busy ms (the union of the events' intervals: the parts may
  overlap on streams) and steady ms per step (steps queued back to back)."""

  kernels: list[tuple[str, str, float, float]]
  busy_ms: float
  steady_ms: float

  @property
  def parts(self) -> list[tuple[str, float, float]]:
    """[(part, device ms, kernels per step)] for each of `PARTS`."""
    return [
      (
        part,
        sum(t for p, _, _, t in self.kernels if p == part),
        sum(n for p, _, n, _ in self.kernels if p == part),
      )
      for part in PARTS
    ]

  def rows(self) -> list[list[str]]:
    """The parts as table rows (`PARTS_HEADER`): each part's device time, share of the
    device's busy time and kernels per step; the busy time, the steady step and the rest (the
    device idle: host work and waits)."""
    total = sum(t for _, t, _ in self.parts) or 1.0
    rows = [[n, f"{t:.3f}", f"{t / total:.0%}", f"{k:.0f}"] for n, t, k in self.parts]
    return rows + [
      ["device busy (the parts' union on the device's streams)", f"{self.busy_ms:.3f}", "", ""],
      ["steady step (steps queued back to back)", f"{self.steady_ms:.3f}", "", ""],
      [
        "device idle in a step (steady less busy)",
        f"{max(0.0, self.steady_ms - self.busy_ms):.3f}",
        "",
        "",
      ],
    ]

  def kernel_rows(self, n: int = 15) -> list[list[str]]:
    """The `n` busiest kernels as table rows (`KERNELS_HEADER`)."""
    return [[p, f"`{k}`", f"{c:g}", f"{1e3 * t:.1f}"] for p, k, c, t in self.kernels[:n]]


PARTS_HEADER = ["part of the step", "device ms / step", "share", "kernels / step"]
KERNELS_HEADER = ["part", "kernel [op]", "launches / step", "device us / step"]


def memcpy_gbps(nbytes: int, repeats: int = 7) -> float:
  """Pinned host-to-device copy bandwidth, GB/s: `host_slice` (one DMA copy on a GPU) of a
  pinned `HostTable` of `nbytes`, timed with copies queued back to back."""
  cols = 1024
  rows = max(1, nbytes // (cols * 4))
  table = HostTable.empty((rows, cols), np.float32)
  try:
    table.as_numpy().fill(1.0)  # touch every page before timing
    copy = jax.jit(lambda: host_slice(table, 0, rows))
    seconds = timing.median_seconds(copy, repeats=repeats, queued=4)
  finally:
    table.close()
  return rows * cols * 4 / seconds / 1e9
