"""Test helpers for adversarial and leak tests: run code where a crash cannot take pytest down,
and measure what a loop of create/use/close leaves behind.

`run_isolated(fn, *args)` runs a module-level function in a fresh Python process and returns its
result, re-raises its exception (same type, same message), or fails the test with the signal
that killed it: a segfault is a test failure, not a dead test session.

`Resources.now()` snapshots RSS, open descriptors, threads and the files under some directories;
`assert_within` checks the growth against a budget. Threads are judged by jaxdata's own, which
native code names "jaxdata-..." (`own_threads()`): JAX's and the CUDA runtime's thread pools grow
on demand (more dispatching threads, more work in flight) and never shrink, so a count of all
threads measures them, not a leak of ours.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import pathlib
import pickle
import threading
import traceback
from collections.abc import Callable
from typing import Any

import jax
import pytest


class _Raised(Exception):
  """An exception from the child that could not be pickled as itself."""


def _child(conn, fn, args, kwargs):
  try:
    result = ("ok", fn(*args, **kwargs))
  except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
    try:
      pickle.dumps(e)
      result = ("raised", e)
    except Exception:  # noqa: BLE001
      result = ("raised", _Raised(f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
  conn.send(result)
  conn.close()


def run_isolated(
  fn: Callable[..., Any],
  *args: Any,
  timeout: float = 300.0,
  env: dict[str, str] | None = None,
  **kwargs: Any,
) -> Any:
  """Runs ``fn(*args, **kwargs)`` in a new process (spawned, so JAX starts fresh there).

  `fn` must be importable (a module-level function of a test module). The child inherits
  XLA_FLAGS and the other environment variables, plus `env`, from its start: it has them before
  it imports anything (JAX reads JAX_PLATFORMS when it is imported), and the caller's matmul
  precision (conftest runs tests at "highest": a child at JAX's default would run hector's
  float32 GEMMs on TF32 tensor cores). Returns fn's result;
  re-raises its exception; fails the test if the child dies (signal or exit without a result) or
  runs past `timeout` seconds.
  """
  ctx = mp.get_context("spawn")
  parent, child = ctx.Pipe(duplex=False)
  proc = ctx.Process(target=_child, args=(child, fn, args, kwargs))
  precision = jax.config.jax_default_matmul_precision
  if precision is not None:
    env = {"JAX_DEFAULT_MATMUL_PRECISION": str(precision), **(env or {})}
  saved = {k: os.environ.get(k) for k in (env or {})}
  os.environ.update(env or {})  # a spawned child takes the environment as it is at start()
  try:
    proc.start()
  finally:
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v
  child.close()
  try:
    if not parent.poll(timeout):
      proc.kill()
      proc.join()
      pytest.fail(f"{fn.__name__} did not finish within {timeout} s in its subprocess")
    try:
      kind, value = parent.recv()
    except EOFError:
      proc.join()
      code = proc.exitcode
      how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
      pytest.fail(f"{fn.__name__} crashed its subprocess ({how})")
  finally:
    parent.close()
    proc.join(timeout=30)
    if proc.is_alive():
      proc.kill()
  if kind == "raised":
    raise value
  return value


def _rss_bytes() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def own_threads() -> int:
  """Threads of this process that jaxdata's native code started (named "jaxdata-...")."""
  count = 0
  for task in os.listdir("/proc/self/task"):
    try:
      with open(f"/proc/self/task/{task}/comm") as f:
        count += f.read().startswith("jaxdata")
    except OSError:  # the thread ended meanwhile
      pass
  return count


def descriptors_into(directory: str | None) -> list[str]:
  """Open descriptors of this process pointing into `directory` (deleted files included)."""
  found = []
  for fd in os.listdir("/proc/self/fd"):
    try:
      target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
      continue
    if directory and target.startswith(directory):
      found.append(target)
  return found


def _files_under(dirs: tuple[str, ...]) -> frozenset[str]:
  found = set()
  for d in dirs:
    p = pathlib.Path(d)
    if p.exists():
      found.update(str(x) for x in p.rglob("*") if x.is_file())
  return frozenset(found)


@dataclasses.dataclass(frozen=True)
class Resources:
  """What this process holds at one moment (Linux: /proc)."""

  rss: int
  fds: int
  threads: int  # every thread (for reports)
  own: int  # jaxdata's own threads (what leak checks compare)
  files: frozenset[str]

  @classmethod
  def now(cls, *dirs: str | os.PathLike) -> Resources:
    """RSS, open descriptors, OS threads and the files under `dirs`."""
    return cls(
      rss=_rss_bytes(),
      fds=len(os.listdir("/proc/self/fd")),
      threads=len(os.listdir("/proc/self/task")),
      own=own_threads(),
      files=_files_under(tuple(str(d) for d in dirs)),
    )

  def assert_within(self, before: Resources, *, rss_bytes: int = 50 << 20, what: str = "") -> None:
    """Fails unless, since `before`, RSS grew by less than `rss_bytes` and no descriptor, thread
    of jaxdata's or file was left behind."""
    tag = f"{what}: " if what else ""
    grew = self.rss - before.rss
    assert grew < rss_bytes, (
      f"{tag}RSS grew by {grew / 2**20:.1f} MiB (budget {rss_bytes / 2**20:.0f})"
    )
    assert self.fds <= before.fds, f"{tag}{self.fds - before.fds} descriptor(s) left open"
    assert self.own <= before.own, (
      f"{tag}{self.own - before.own} of jaxdata's threads left running "
      f"(python threads: {[t.name for t in threading.enumerate()]})"
    )
    left = sorted(self.files - before.files)
    assert not left, f"{tag}files left behind: {left[:5]}"
