"""Wall-clock timing of JAX calls (dispatch is asynchronous: a call is timed to when its result
is ready). Used by the benchmarks and by the offload planner's measurements.

    >>> import jax.numpy as jnp
    >>> x = jnp.ones((256, 256))
    >>> median_seconds(lambda: x @ x, repeats=3) > 0
    True
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax


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
