"""What every benchmark shares: timing, a description of the machine, size parsing, output."""
from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable

import jax
import numpy as np


def median_seconds(fn: Callable[[], Any], *, warmup: int = 2, repeats: int = 7,
                   queued: int = 1, wait: Callable[[Any], Any] = jax.block_until_ready) -> float:
  """Median wall time of one `fn()` call, results waited for (JAX dispatch is asynchronous).

  With `queued` > 1, each timed round queues that many calls back to back and waits once, so the
  figure is the device's throughput rather than one call's round-trip latency. `wait(result)`
  blocks until a call's work is done (for PyTorch: a function that synchronizes the device).
  """
  for _ in range(warmup):
    wait(fn())
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    for _ in range(queued - 1):
      fn()
    wait(fn())
    times.append((time.perf_counter() - t0) / queued)
  return statistics.median(times)


def step_seconds(fn: Callable[[], Any], *, warmup: int = 1, repeats: int = 7,
                 wait: Callable[[Any], Any] = jax.block_until_ready) -> tuple[float, float]:
  """(per step with steps queued back to back, one step waited for on its own): the median of
  rounds of `queue_depth` calls waited for once, and of single calls each waited for (the same
  figure where the depth is 1)."""
  queued = queue_depth(fn, wait=wait)
  seconds = median_seconds(fn, warmup=warmup, repeats=repeats, queued=queued, wait=wait)
  alone = (median_seconds(fn, warmup=0, repeats=repeats, wait=wait) if queued > 1 else seconds)
  return seconds, alone


def queue_depth(fn: Callable[[], Any], *, wait: Callable[[Any], Any] = jax.block_until_ready,
                round_seconds: float = 0.02, most: int = 20) -> int:
  """How many calls of `fn` to queue per timed round (`median_seconds(queued=...)`) so that a
  round lasts about `round_seconds`: 1 for calls that long or longer, at most `most`. Runs `fn`
  once (after a call to warm it up) to see how long a call takes."""
  wait(fn())
  t0 = time.perf_counter()
  wait(fn())
  one = time.perf_counter() - t0
  return max(1, min(most, int(round_seconds / max(one, 1e-6))))


def parse_bytes(text: str) -> int:
  """'256M' -> 268435456 (binary units: K, M, G, T)."""
  text = text.strip().upper().removesuffix("B").removesuffix("I")
  units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
  if text and text[-1] in units:
    return int(float(text[:-1]) * units[text[-1]])
  return int(text)


def format_bytes(n: int) -> str:
  for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
    if n >= size and n % size == 0:
      return f"{n // size} {unit}"
  return f"{n} B"


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
