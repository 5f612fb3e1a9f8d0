"""What every benchmark shares: a description of the machine, Markdown tables, random rows.

Timing lives in `jaxdata.timing`, byte sizes in `jaxdata.sizes`."""
from __future__ import annotations

import datetime
import os
import platform
import sys
from typing import Any

import jax
import numpy as np


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
