"""Shared test setup: tests run on the CPU and, where JAX sees one, on a GPU (marked `gpu`).

Also the suite's guards (docs/development.md): a test file that leaves its process large has
its compiled programs dropped when it ends, each worker's peak RSS and the files it grew most on
are reported, `slow` tests get a longer timeout, and `-n auto` starts no more workers than memory
holds.
"""

import atexit
import ctypes
import gc
import importlib.metadata
import os
import resource
import shutil
import tempfile
import time

# XLA_FLAGS must be set before JAX starts. Two CPU devices, for the shard_map tests. And the
# cheapest compiles, because the suite compiles thousands of small programs and runs few large
# ones: XLA's backends at -O0 (LLVM's cheapest pipeline; on a GPU, ptxas still optimizes); each
# program's code generated on one thread (the suite already runs a worker per core); and, up to
# jaxlib 0.10 (0.11 knows no such flag, and an unknown flag aborts XLA), XLA:CPU's classic loop
# emitters instead of its MLIR fusion emitters, which take seconds over the gathers and scatters
# this project is made of. Together they take about two thirds off a compile-bound test's CPU
# time; results differ from the defaults only in the order of float reductions. Subprocesses
# inherit them; a test that sets XLA_FLAGS for its child starts from JAXDATA_TEST_XLA_FLAGS,
# which a run may set itself (JAXDATA_TEST_XLA_FLAGS= compiles as users do).
_cheap = "--xla_backend_optimization_level=0 --xla_cpu_parallel_codegen_split_count=1"
if tuple(map(int, importlib.metadata.version("jaxlib").split(".")[:2])) < (0, 11):
  _cheap += " --xla_cpu_use_fusion_emitters=false"
os.environ.setdefault("JAXDATA_TEST_XLA_FLAGS", _cheap)
_flags = os.environ.get("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
if os.environ["JAXDATA_TEST_XLA_FLAGS"] not in _flags:  # (xdist workers inherit the controller's)
  _flags = f"{os.environ['JAXDATA_TEST_XLA_FLAGS']} {_flags}"
os.environ["XLA_FLAGS"] = _flags.strip()


def _folder_per_run(variable: str, prefix: str) -> None:
  """$variable names a fresh folder for this run, shared by the xdist workers and every test
  subprocess (they inherit it), removed at the end by the process that made it; a run that sets
  it itself keeps its own."""
  if variable not in os.environ:
    os.environ[variable] = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, os.environ[variable], ignore_errors=True)


# One persistent compilation cache per run: a program compiled once (a trainer's step, and again
# in the `jaxdata eval` process that measures its checkpoint; the small eager-op programs every
# process compiles) is read back, not compiled again.
_folder_per_run("JAX_COMPILATION_CACHE_DIR", "jaxdata-tests-xla-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# Likewise one kernel cache for hector (each distinct kernel is compiled once, by g++ on the CPU,
# about 0.25 CPU-seconds, then read back by every worker, subprocess and document run): a run
# starts as cold as on a fresh machine and leaves the user's ~/.cache alone.
_folder_per_run("JAXDATA_CACHE_DIR", "jaxdata-tests-kernels-")

import jax  # noqa: E402
import pytest  # noqa: E402

from jaxdata.hector import runtime as _hector_runtime  # noqa: E402

jax.config.update("jax_enable_x64", True)  # 64-bit tables and indices are part of the contract


def _gpus():
  try:
    return jax.devices("gpu")
  except RuntimeError:
    return []


@pytest.fixture(params=["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def device(request):
  """Each test using this runs once per platform; the GPU run is skipped without a GPU (and,
  like every test, at matmul precision "highest" unless marked `default_precision`)."""
  if request.param == "gpu":
    gpus = _gpus()
    if not gpus:
      pytest.skip("no GPU visible to JAX")
    from jaxdata import _ffi

    if not _ffi.built_with_cuda():
      pytest.fail("JAX sees a GPU but jaxdata was built without CUDA")
    dev = gpus[0]
  else:
    dev = jax.devices("cpu")[0]
  with jax.default_device(dev):
    yield dev


@pytest.fixture(autouse=True)
def _highest_precision_by_default(request):
  """Every test runs under `jax.default_matmul_precision("highest")` unless it is marked
  `default_precision`: tests compare formulations at float32 tolerances, while on a GPU a
  float32 matmul at JAX's default precision runs on TF32 tensor cores (about 1e-3 relative),
  which the H200 gate showed breaks those comparisons (hector's kernels follow the same default
  on TF32 / bf16 tensor cores). Precision semantics are tested by the tests that opt out
  (tests/test_hector_precision.py) and by explicit `precision=` arguments.
  """
  if request.node.get_closest_marker("default_precision"):
    yield
  else:
    with jax.default_matmul_precision("highest"):
      yield


@pytest.fixture(autouse=True)
def _no_stale_effect_error():
  """After each test, no error of an effectful computation is left for later tests to raise.

  On a GPU JAX keeps the status of each device's last effectful computation (a side-effecting
  FFI call) and `jax.effects_barrier()` raises it, again and again, until another effectful
  computation runs on that device, even after the test caught it (the offload fault tests
  expect such errors): it once failed an unrelated trainer test, and JAX's exit hook prints it.
  One tiny successful scatter per device replaces it.
  """
  yield
  try:
    jax.effects_barrier()
  except (jax.errors.JaxRuntimeError, RuntimeError):
    import jax.numpy as jnp
    import numpy as np

    from jaxdata.host import HostTable, host_scatter_add

    with HostTable(np.zeros((1, 1), np.float32)) as table:
      for dev in jax.devices():
        with jax.default_device(dev):
          jax.block_until_ready(
            host_scatter_add(table, jnp.zeros(1, jnp.int32), jnp.zeros((1, 1), jnp.float32))
          )


# -- the suite's guards --------------------------------------------------------------------------

GIB = 1 << 30
WORKER_BYTES = 6 * GIB  # the most one test process may hold (.ci/run enforces it)
RELEASE_ABOVE = 3 * GIB // 2  # a test file that leaves this much more held than at the start
_rss_at_start = 0  # of this process's first test file
TIMEOUT_SLOW = 900  # seconds; every other test has pyproject's `timeout`


def _rss() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
  """The largest RSS this process or any test subprocess it waited for has reached."""
  return 1024 * max(
    resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
  )


def _release_memory() -> None:
  """Drops what outlives a test file: JAX's compiled executables and traces, hector's eager-call
  programs (each holds its kernel's executable), and the heap glibc keeps after frees."""
  jax.clear_caches()
  _hector_runtime._jitted.cache_clear()
  gc.collect()
  try:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
  except (OSError, AttributeError):  # not glibc
    pass


@pytest.fixture(autouse=True, scope="module")
def _release_memory_after_each_file():
  """Releases memory after a test file that leaves its process RELEASE_ABOVE bytes larger than
  it was at its first test (below that, keeping JAX's caches saves the next files compiling the
  same small programs again; a GPU process starts large, with its CUDA context)."""
  global _rss_at_start
  _rss_at_start = _rss_at_start or _rss()
  yield
  if _rss() - _rss_at_start > RELEASE_ABOVE:
    _release_memory()


def _busy_cores(seconds: float = 0.5) -> int:
  """How many cores other processes keep busy now (from /proc/stat over `seconds`; 0 where
  there is no /proc/stat)."""

  def times():
    with open("/proc/stat") as f:
      ticks = [int(x) for x in f.readline().split()[1:]]
    return sum(ticks), ticks[3] + ticks[4]  # all, idle + iowait

  try:
    total0, idle0 = times()
    time.sleep(seconds)
    total1, idle1 = times()
  except (OSError, ValueError, IndexError):
    return 0
  busy = 1 - (idle1 - idle0) / max(total1 - total0, 1)
  return round(busy * (os.cpu_count() or 1))


def pytest_xdist_auto_num_workers(config):
  """`-n auto`: one worker more than idle cores (tests that wait on their subprocesses leave a
  core idle), but no more than memory holds at WORKER_BYTES each. Cores that other processes
  keep busy do not count: beside one CPU-bound process on 2 cores, 2 workers spend about a
  tenth less CPU on the same tests than 3 (they share one core's time either way)."""
  del config
  with open("/proc/meminfo") as f:
    info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
  idle = max(1, (os.cpu_count() or 1) - _busy_cores())
  return max(1, min(idle + 1, info.get("MemAvailable", GIB) // WORKER_BYTES))


def pytest_addoption(parser):
  parser.addoption(
    "--no-cpu-variants",
    action="store_true",
    help="deselect the CPU instances of tests parametrized by the `device` fixture "
    "(the GPU gate: CI runs them)",
  )


def pytest_collection_modifyitems(config, items):
  if config.getoption("--no-cpu-variants"):

    def on_cpu(item):
      return getattr(item, "callspec", None) and item.callspec.params.get("device") == "cpu"

    config.hook.pytest_deselected(items=[i for i in items if on_cpu(i)])
    items[:] = [i for i in items if not on_cpu(i)]
  for item in items:
    if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
      item.add_marker(pytest.mark.timeout(TIMEOUT_SLOW))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  """Each test's teardown report carries the RSS its process ends the test with."""
  outcome = yield
  if call.when == "teardown":
    outcome.get_result().user_properties.append(("rss", (_rss(), _peak_rss())))


_rss_seen: dict[str, list] = {}  # worker -> [(file, RSS after a test, peak RSS so far), ...]


def pytest_runtest_logreport(report):
  if report.when != "teardown":
    return
  value = dict(report.user_properties).get("rss")
  if value is None:
    return
  worker = getattr(report, "node", None)
  worker = getattr(worker, "gateway", None) and worker.gateway.id or "main"
  _rss_seen.setdefault(worker, []).append((report.nodeid.split("::")[0], *value))


def pytest_terminal_summary(terminalreporter):
  """Per worker: peak RSS (its own or a test subprocess's) and the test files it grew most on."""
  if not _rss_seen:
    return
  tr = terminalreporter
  tr.section("memory per test process")
  for worker, seen in sorted(_rss_seen.items()):
    growth: dict[str, int] = {}
    before = seen[0][1]
    for path, rss, _ in seen:
      growth[path] = growth.get(path, 0) + rss - before
      before = rss
    top = sorted(growth.items(), key=lambda kv: -kv[1])[:3]
    tr.write_line(
      f"{worker}: peak {max(p for *_, p in seen) / GIB:.2f} GiB, ends at "
      f"{seen[-1][1] / GIB:.2f} GiB; grew most on "
      + ", ".join(f"{os.path.basename(p)} (+{g / GIB:.2f})" for p, g in top)
    )
