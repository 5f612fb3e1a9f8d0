"""Adversarial offload: faults injected into a TensorStore between spill and load.

Every case must end in the right data (compared bit for bit with what was spilled) or in a
clear error naming what happened (truncated, corrupted, closed, full, too large), never in a
crash, a hang or wrong values; and the store must be left with nothing outstanding and no file
behind. Cases that could crash or hang run in a subprocess (`run_isolated`), many hypothesis
examples per subprocess; the platform comes from the `device` fixture, so the GPU run covers
the CUDA handlers.
"""

import os
import resource
import signal
import threading
import time

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from isolation import descriptors_into, own_threads, run_isolated

from jaxdata import offload

CHUNK = 4096
RuntimeErrors = (jax.errors.JaxRuntimeError, RuntimeError)
_SHAPES = [(1,), (1023,), (1024,), (1025,), (3001,), (4096 * 3 + 5,)]  # in float32 words
_SETTINGS = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck))


def _store(ssd_dir, **kw):
  opts = dict(ram_bytes=0, chunk_bytes=CHUNK, staging_bytes=8 * CHUNK, io_threads=2)
  opts.update(kw)
  return offload.TensorStore(ssd_dir=ssd_dir, **opts)


def _wait_written(store, at_least, timeout=20.0):
  deadline = time.monotonic() + timeout
  while store.stats()["ssd_written"] < at_least:
    assert time.monotonic() < deadline, f"only {store.stats()['ssd_written']} bytes written"
    time.sleep(0.001)


def _padded(n):
  return -(-n // CHUNK) * CHUNK


def _assert_clean(store):
  """Nothing outstanding, no file in the store's directory."""
  s = store.stats()
  assert s["outstanding"] == 0 and s["ram_in_use"] == 0 and s["ssd_in_use"] == 0, s
  if store.directory:
    assert os.listdir(store.directory) == [], os.listdir(store.directory)


class _Programs:
  """Jitted spill / load per (shape, tier), compiled once per subprocess."""

  def __init__(self, store):
    self.store, self.site, self._cache = store, offload.new_site(), {}

  def spill(self, x, tier):
    key = ("spill", x.shape, tier)
    if key not in self._cache:
      self._cache[key] = jax.jit(
        lambda x: offload.spill([x], self.store, site=self.site, tier=tier)
      )
    return jax.block_until_ready(self._cache[key](x))

  def load(self, ticket, like):
    key = ("load", like.shape)
    if key not in self._cache:
      self._cache[key] = jax.jit(lambda t: offload.load(t, [like], self.store, site=self.site))
    return np.asarray(jax.block_until_ready(self._cache[key](ticket))[0])


# --------------------------------------------------------------------------------------------
# the spill file is truncated, corrupted, deleted or replaced between spill and load


def _file_fault_cases(ssd_dir, examples):
  """Hypothesis examples of one fault each; returns how often each outcome happened."""
  os.makedirs(ssd_dir, exist_ok=True)
  outcomes = {}
  store = _store(ssd_dir)
  programs = _Programs(store)

  @settings(max_examples=examples, **_SETTINGS)
  @given(
    shape=st.sampled_from(_SHAPES),
    seed=st.integers(0, 2**31 - 1),
    fault=st.sampled_from(["none", "truncate", "corrupt", "delete", "replace", "grow"]),
    where=st.floats(0, 1, exclude_max=True),
    bit=st.integers(0, 7),
  )
  def case(shape, seed, fault, where, bit):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    written = store.stats()["ssd_written"]
    ticket = programs.spill(x, "ssd")
    _wait_written(store, written + _padded(x.nbytes))  # the writes are asynchronous
    (name,) = os.listdir(store.directory)
    path = os.path.join(store.directory, name)
    size = os.path.getsize(path)
    expect = None  # None: the right data; else a regex of the error
    if fault == "truncate":
      keep = int(where * x.nbytes)
      os.truncate(path, keep)
      expect = "truncated"
    elif fault == "corrupt":  # one bit of the data (not the padding): the checksum must see it
      at = int(where * x.nbytes)
      with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ (1 << bit)]))
      expect = "corrupted"
    elif fault == "delete":  # the store's descriptor still reads the file: the right data
      os.unlink(path)
    elif fault == "replace":  # a new file under the name: the descriptor reads the old one
      os.rename(path, path + ".old")
      with open(path, "wb") as f:
        f.write(b"\0" * size)
      os.unlink(path + ".old")
    elif fault == "grow":  # bytes after the entry's end are never read
      with open(path, "ab") as f:
        f.write(b"junk" * 1000)
    try:
      got = programs.load(ticket, jax.ShapeDtypeStruct(shape, np.float32))
    except RuntimeErrors as e:
      assert expect is not None and expect in str(e), f"{fault}: unexpected error {e}"
      outcome = "error"
    else:
      assert expect is None, f"{fault}: no error, data equal: {np.array_equal(got, x)}"
      np.testing.assert_array_equal(got.view(np.uint32), x.view(np.uint32))
      outcome = "ok"
    outcomes[(fault, outcome)] = outcomes.get((fault, outcome), 0) + 1
    for leftover in os.listdir(store.directory):  # a "replace" leaves its stand-in
      os.unlink(os.path.join(store.directory, leftover))
    s = store.stats()
    assert s["outstanding"] == 0 and s["ssd_in_use"] == 0, s

  case()
  directory = store.directory
  store.close()
  assert not os.path.exists(directory) and descriptors_into(directory) == []
  return outcomes


def test_spill_file_faults_end_in_the_right_data_or_a_clear_error(device, tmp_path):
  outcomes = run_isolated(
    _file_fault_cases,
    str(tmp_path / "ssd"),
    40,
    timeout=240,
    env={"JAX_PLATFORMS": "cpu" if device.platform == "cpu" else "cuda"},
  )
  assert sum(outcomes.values()) >= 20, outcomes
  assert os.listdir(tmp_path / "ssd") == []


def test_truncation_inside_the_data_is_always_an_error(device, tmp_path):
  """A file cut anywhere before its last data byte must fail as truncated (in-process: the
  fault cases above showed it does not crash)."""
  ssd = str(tmp_path / "ssd")
  with _store(ssd) as store:
    programs = _Programs(store)
    x = np.arange(3001, dtype=np.float32)
    for keep in (0, 1, 4095, 4096, 8191, 12003):
      written = store.stats()["ssd_written"]
      ticket = programs.spill(x, "ssd")
      _wait_written(store, written + _padded(x.nbytes))
      (name,) = os.listdir(store.directory)
      os.truncate(os.path.join(store.directory, name), keep)
      with pytest.raises(RuntimeErrors, match="truncated"):
        programs.load(ticket, jax.ShapeDtypeStruct(x.shape, x.dtype))
      _assert_clean(store)


# --------------------------------------------------------------------------------------------
# close() while spills and loads are in flight on other threads


def _close_mid_flight_cases(ssd_dir, rounds):
  """Each round: three threads spill and load (RAM, SSD and auto tiers, each its own site)
  while the main thread closes the store after a random delay. Every thread ends with the
  right data or a 'closed' error; afterwards no descriptor, file or thread of the store is
  left."""
  os.makedirs(ssd_dir, exist_ok=True)
  rng = np.random.default_rng(0)
  x = np.arange(1 << 20, dtype=np.float32)  # 4 MiB: 1024 chunks
  like = jax.ShapeDtypeStruct(x.shape, x.dtype)
  with _store(ssd_dir, ram_bytes=16 << 20, io_threads=1) as warm:  # JAX starts its threads
    programs = _Programs(warm)
    for tier in ("ssd", "ram"):
      programs.load(programs.spill(x, tier), like)
  counts = {"ok": 0, "closed": 0}
  errors, lock = [], threading.Lock()

  def worker(programs, tier, seed):
    local = np.random.default_rng(seed)
    try:
      deadline = time.monotonic() + 60
      while time.monotonic() < deadline:  # round trips until close() stops them
        y = x + np.float32(local.integers(100))
        got = programs.load(programs.spill(y, tier), like)
        np.testing.assert_array_equal(got, y)
        with lock:
          counts["ok"] += 1
    except (*RuntimeErrors, ValueError) as e:
      with lock:
        if "closed" in str(e) and "truncated" not in str(e) and "corrupt" not in str(e):
          counts["closed"] += 1
        else:
          errors.append(f"{tier}: {type(e).__name__}: {e}")
    except BaseException as e:  # noqa: BLE001 - reported below
      errors.append(f"{tier}: {type(e).__name__}: {e}")

  for r in range(rounds):
    store = _store(ssd_dir, ram_bytes=16 << 20, io_threads=1)
    directory = store.directory
    workers = []
    for i, tier in enumerate(["ssd", "ram", "auto"]):
      programs = _Programs(store)  # its own site: a site's loads pair with its own spills
      programs.load(programs.spill(x, tier), like)  # compiled before the clock starts
      workers.append(threading.Thread(target=worker, args=(programs, tier, 10 * r + i)))
    read = store.stats()["ssd_read"]
    for w in workers:
      w.start()
    if r % 2:  # as soon as a load is reading from the SSD tier
      while store.stats()["ssd_read"] == read:
        time.sleep(0.0001)
    else:
      time.sleep(float(rng.uniform(0.005, 0.05)))
    store.close()
    for w in workers:
      w.join(timeout=120)
      assert not w.is_alive(), "a spill or load did not return after close()"
    assert not errors, errors
    assert descriptors_into(directory) == [], descriptors_into(directory)
    assert not os.path.exists(directory)
  deadline = time.monotonic() + 10  # every store is closed: none of its threads may remain
  while own_threads() and time.monotonic() < deadline:
    time.sleep(0.01)
  assert own_threads() == 0, "a closed store's threads outlive it"
  assert os.listdir(ssd_dir) == []
  return counts


def test_close_mid_flight_ends_in_the_right_data_or_closed(device, tmp_path):
  counts = run_isolated(
    _close_mid_flight_cases,
    str(tmp_path / "ssd"),
    6,
    timeout=240,
    env={"JAX_PLATFORMS": "cpu" if device.platform == "cpu" else "cuda"},
  )
  assert counts["closed"] == 3 * 6, counts  # every worker was stopped by its close()
  assert os.listdir(tmp_path / "ssd") == []


# --------------------------------------------------------------------------------------------
# the disk fills: a size cap on the SSD tier, or a file-size limit (EFBIG)


@settings(max_examples=25, **_SETTINGS)
@given(
  cap_chunks=st.integers(1, 8), sizes=st.lists(st.sampled_from(_SHAPES), min_size=1, max_size=4)
)
def test_ssd_cap_gives_full_errors_and_keeps_what_fits(device, cap_chunks, sizes):
  import tempfile

  with (
    tempfile.TemporaryDirectory() as parent,
    _store(parent, ssd_bytes=cap_chunks * CHUNK) as store,
  ):
    programs = _Programs(store)
    held = []
    for i, shape in enumerate(sizes):
      x = np.full(shape, i, np.float32)
      fits = store.stats()["ssd_in_use"] + _padded(x.nbytes) <= cap_chunks * CHUNK
      try:
        held.append((programs.spill(x, "ssd"), x))
      except RuntimeErrors as e:
        assert not fits, f"a spill that fits failed: {e}"
        assert "SSD tier is full" in str(e) and "ssd_bytes" in str(e), str(e)
        assert "0.00 GiB" not in str(e), str(e)
      else:
        assert fits
    for ticket, x in reversed(held):
      np.testing.assert_array_equal(
        programs.load(ticket, jax.ShapeDtypeStruct(x.shape, x.dtype)), x
      )
    _assert_clean(store)


def _file_size_limit_cases(ssd_dir, examples):
  """A file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored: writes past it fail with EFBIG)."""
  os.makedirs(ssd_dir, exist_ok=True)
  store = _store(ssd_dir)
  programs = _Programs(store)
  shapes = [(1024,), (3001,), (4096 * 3 + 5,), (64 * 1024,)]
  for s in shapes:  # compiled before the limit (the compiler writes no files, but be sure)
    x = np.zeros(s, np.float32)
    programs.load(programs.spill(x, "ssd"), jax.ShapeDtypeStruct(s, np.float32))
  signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
  outcomes = {"ok": 0, "too large": 0}

  @settings(max_examples=examples, **_SETTINGS)
  @given(
    limit_chunks=st.integers(1, 20), shape=st.sampled_from(shapes), seed=st.integers(0, 2**31 - 1)
  )
  def case(limit_chunks, shape, seed):
    limit = limit_chunks * CHUNK
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    try:
      x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
      try:
        got = programs.load(programs.spill(x, "ssd"), jax.ShapeDtypeStruct(shape, x.dtype))
      except RuntimeErrors as e:
        assert _padded(x.nbytes) > limit, f"failed under the limit: {e}"
        assert "writing" in str(e) and "File too large" in str(e), str(e)
        outcomes["too large"] += 1
      else:
        assert _padded(x.nbytes) <= limit
        np.testing.assert_array_equal(got, x)
        outcomes["ok"] += 1
      _assert_clean(store)
    finally:
      resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))

  case()
  directory = store.directory
  store.close()
  assert not os.path.exists(directory) and descriptors_into(directory) == []
  return outcomes


def test_file_size_limit_fails_spills_cleanly(device, tmp_path):
  outcomes = run_isolated(
    _file_size_limit_cases,
    str(tmp_path / "ssd"),
    25,
    timeout=240,
    env={"JAX_PLATFORMS": "cpu" if device.platform == "cpu" else "cuda"},
  )
  assert outcomes["ok"] > 0 and outcomes["too large"] > 0, outcomes
  assert os.listdir(tmp_path / "ssd") == []


# --------------------------------------------------------------------------------------------
# the RAM tier under pressure, with and without an SSD tier


@settings(max_examples=30, **_SETTINGS)
@given(
  ram_chunks=st.integers(0, 12),
  ssd=st.booleans(),
  plan=st.lists(
    st.tuples(st.sampled_from(_SHAPES), st.sampled_from(["auto", "ram", "ssd"])),
    min_size=1,
    max_size=5,
  ),
)
def test_ram_pressure_spills_to_the_right_tier_or_says_what_is_full(device, ram_chunks, ssd, plan):
  import tempfile

  with (
    tempfile.TemporaryDirectory() as parent,
    _store(parent if ssd else None, ram_bytes=ram_chunks * CHUNK) as store,
  ):
    programs = _Programs(store)
    held = []
    for i, (shape, tier) in enumerate(plan):
      x = np.full(shape, i + 0.5, np.float32)
      try:
        held.append((programs.spill(x, tier), x))
      except ValueError as e:  # before anything runs
        assert tier == "ssd" and not ssd and "no SSD tier" in str(e), str(e)
      except RuntimeErrors as e:
        msg = str(e)
        assert tier != "ssd", msg
        assert "RAM tier is full" in msg and "ram_bytes" in msg and "0.00 GiB" not in msg, msg
        if not ssd:
          assert "no SSD tier" in msg and "ssd_dir=" in msg, msg
    for ticket, x in reversed(held):
      np.testing.assert_array_equal(
        programs.load(ticket, jax.ShapeDtypeStruct(x.shape, x.dtype)), x
      )
    _assert_clean(store)
