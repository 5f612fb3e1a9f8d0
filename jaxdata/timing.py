"""Wall-clock timing of JAX calls (dispatch is asynchronous: a call is timed to when its result
is ready), and the folder where jaxdata keeps what it compiled or measured once (`cache_dir`).
Used by the benchmarks, the offload planner's measurements and hector's kernel cache.

    >>> import jax.numpy as jnp
    >>> x = jnp.ones((256, 256))
    >>> median_seconds(lambda: x @ x, repeats=3) > 0
    True
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
from jax.profiler import ProfileData


class CacheDirError(OSError):
  """A cache's folder cannot be made (`cache_dir`): the message names it and says which
  variable sets it."""


def cache_dir(name: str, what: str | None = None) -> Path:
  """$JAXDATA_CACHE_DIR/`name` (default ~/.cache/jaxdata/`name`, or under $XDG_CACHE_HOME), made
  if missing; CacheDirError where it cannot be (a file in its place, no permission), its message
  naming the cache as `what`."""
  root = os.environ.get("JAXDATA_CACHE_DIR") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jaxdata"
  )
  path = Path(root) / name
  try:
    path.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise CacheDirError(
      e.errno,
      f"{what or 'the cache'} {path} cannot be made ({e.strerror or e}): set "
      "JAXDATA_CACHE_DIR to a folder this user can write",
    ) from None
  return path


def median_seconds(
  fn: Callable[[], Any],
  *,
  warmup: int = 2,
  repeats: int = 7,
  queued: int = 1,
  wait: Callable[[Any], Any] = jax.block_until_ready,
) -> float:
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


def step_seconds(
  fn: Callable[[], Any],
  *,
  warmup: int = 1,
  repeats: int = 7,
  wait: Callable[[Any], Any] = jax.block_until_ready,
) -> tuple[float, float]:
  """(per step with steps queued back to back, one step waited for on its own): the median of
  rounds of `queue_depth` calls waited for once, and of single calls each waited for (the same
  figure where the depth is 1)."""
  queued = queue_depth(fn, wait=wait)
  seconds = median_seconds(fn, warmup=warmup, repeats=repeats, queued=queued, wait=wait)
  alone = median_seconds(fn, warmup=0, repeats=repeats, wait=wait) if queued > 1 else seconds
  return seconds, alone


def queue_depth(
  fn: Callable[[], Any],
  *,
  wait: Callable[[Any], Any] = jax.block_until_ready,
  round_seconds: float = 0.02,
  most: int = 20,
) -> int:
  """How many calls of `fn` to queue per timed round (`median_seconds(queued=...)`) so that a
  round lasts about `round_seconds`: 1 for calls that long or longer, at most `most`. Runs `fn`
  once (after a call to warm it up) to see how long a call takes."""
  wait(fn())
  t0 = time.perf_counter()
  wait(fn())
  one = time.perf_counter() - t0
  return max(1, min(most, int(round_seconds / max(one, 1e-6))))


def device_events(
  fn: Callable[[], Any], hlo_text: str, *, runs: int = 5
) -> list[tuple[int, int, str, str]]:
  """The device's events in a `jax.profiler` trace of `runs` calls of `fn` (after one warm-up
  call): (start ns, end ns, event name, ``op_name``) for each kernel, memcpy and memset, the
  ``op_name`` (named scopes, ``transpose(`` for a backward pass, ...) that `hlo_text` (the
  compiled program's ``as_text()``) records for the event's HLO instruction, or "" for events
  that name none (copies and memsets XLA adds). A kernel inside a command buffer (a CUDA
  graph) names the buffer, not its instruction: compile with
  ``compiler_options={"xla_gpu_enable_command_buffer": ""}`` to attribute every kernel. On a
  machine without a GPU, the CPU's XLA operations stand in for the device's events."""
  op_names = dict(
    re.findall(r"^\s*(?:ROOT )?%?(\S+) = [^\n]*?op_name=\"([^\"]*)\"", hlo_text, re.M)
  )
  jax.block_until_ready(fn())
  trace = tempfile.mkdtemp()
  events = []
  try:
    jax.profiler.start_trace(trace)
    jax.block_until_ready([fn() for _ in range(runs)])
    jax.profiler.stop_trace()
    for path in glob.glob(f"{trace}/**/*.xplane.pb", recursive=True):
      for plane in ProfileData.from_file(path).planes:
        gpu = plane.name.startswith("/device:GPU")
        if not gpu and plane.name != "/host:CPU":
          continue
        for line in plane.lines:
          for e in line.events:
            op = dict(e.stats).get("hlo_op")
            if not gpu and op is None:
              continue  # host threads: only XLA's operations are the CPU device's work
            name = op_names.get(op or "", "")
            events.append((e.start_ns, e.start_ns + e.duration_ns, e.name, name))
  finally:
    shutil.rmtree(trace, ignore_errors=True)
  return events


def busy_seconds(events) -> float:
  """Seconds covered by the union of the `device_events` intervals (events on several streams
  may overlap)."""
  busy, reach = 0, None
  for start, end, *_ in sorted(events):
    if reach is None or start > reach:
      busy, reach = busy + end - start, end
    elif end > reach:
      busy, reach = busy + end - reach, end
  return busy * 1e-9
