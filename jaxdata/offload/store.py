"""TensorStore: pinned host RAM, then local SSD, for activations that wait for the backward pass."""

from __future__ import annotations

import os
import tempfile
import weakref
from typing import Any

from jaxdata import _ffi
from jaxdata.sizes import parse_bytes

_ext = _ffi.ext


def _bytes(value: Any, what: str) -> int:
  if isinstance(value, str):
    try:
      value = parse_bytes(value)
    except ValueError:
      raise ValueError(
        f"{what} must be a byte count (an int or e.g. '8GiB'), got {value!r}"
      ) from None
  if not isinstance(value, int) or isinstance(value, bool) or value < 0:
    raise ValueError(f"{what} must be a byte count >= 0 (an int or e.g. '8GiB'), got {value!r}")
  return value


def _staging_cap(name: str, doc: str) -> property:
  """A TensorStore property for one of its GPU staging caps: the native store's value, set
  through `offload_store_set_<name>` while the store is open, and a copy to read back."""

  def get(self) -> int:
    return getattr(self, "_" + name)

  def set_(self, value: int | str) -> None:
    value = _bytes(value, name)
    getattr(_ext, f"offload_store_set_{name}")(self.store_id, value)
    setattr(self, "_" + name, value)

  return property(get, set_, doc=doc)


class TensorStore:
  """Tiers for offloaded activations: pinned host RAM under a byte budget, then files on SSD.

  A tensor goes to RAM while it fits under `ram_bytes`, else to a file under `ssd_dir` (direct
  I/O through pinned staging slots, `io_threads` writers). Every chunk is checksummed when it
  reaches the host and verified when it comes back; a tensor's memory or file is released as
  soon as it has been loaded. Files live in a per-process directory under `ssd_dir` that
  `close()` removes (and that the next store made under the same `ssd_dir` removes if its
  process died).

  `jaxdata.offload.spill` / `load` and the `offload` remat policy use a store; it must stay open
  until every computation that spills to or loads from it has finished (wait for results before
  `close()`). A spill or load still running when `close()` is called fails with "the
  TensorStore was closed" (close waits for it to return, then frees everything); loads after
  close fail with an error naming the store; never with wrong data.

      >>> with TensorStore(ram_bytes="8GiB", ssd_dir="/local/ssd") as store:
      ...   step = jax.jit(jax.grad(loss))   # loss uses offload.remat(..., offload(store))
      ...   grads = jax.block_until_ready(step(params, batch))
      ...   print(store.stats()["spilled"])

  Args:
    ram_bytes: capacity of the RAM tier (pinned when a GPU is present).
    ssd_dir: parent directory of the SSD tier; None: no SSD tier (a spill that does not fit in
      RAM fails with a clear error).
    ssd_bytes: capacity of the SSD tier; 0: as much as the disk holds.
    io_threads: threads that checksum and read chunks, and as many more that only write them to
      the disk (each keeps one direct-I/O write in flight, as `measure_disk_write`'s do).
    chunk_bytes: unit of I/O and of checksums (a multiple of 4096).
    staging_bytes: pinned staging between the device or host buffers and the disk.
    device_bytes: the most bytes of spills a GPU may hold in device staging while their copies
      to the host are in flight (0: no limit; counted in the spilled arrays' bytes). JAX's host
      thread runs ahead of the GPU, so without a limit every spill of a step can be staged at
      once; past it, a spill waits for earlier copies to finish (one spill always proceeds).
    load_bytes: a cap on the bytes of loads a GPU holds in device staging (brought back and not
      yet copied out), counted in the arrays' bytes; 0: none beyond two loads held. A prefetch
      that would pass it waits while anything is held, but a load the backward pass waits for
      always proceeds, so up to about the cap plus one load can be held.
  """

  def __init__(
    self,
    ram_bytes: int | str = "1GiB",
    ssd_dir: str | os.PathLike | None = None,
    *,
    ssd_bytes: int | str = 0,
    io_threads: int = 4,
    chunk_bytes: int | str = "8MiB",
    staging_bytes: int | str = "256MiB",
    device_bytes: int | str = 0,
    load_bytes: int | str = 0,
  ):
    ram_bytes = _bytes(ram_bytes, "ram_bytes")
    ssd_bytes = _bytes(ssd_bytes, "ssd_bytes")
    chunk_bytes = _bytes(chunk_bytes, "chunk_bytes")
    staging_bytes = _bytes(staging_bytes, "staging_bytes")
    device_bytes = _bytes(device_bytes, "device_bytes")
    load_bytes = _bytes(load_bytes, "load_bytes")
    if chunk_bytes == 0 or chunk_bytes % 4096:
      raise ValueError(f"chunk_bytes must be a positive multiple of 4096, got {chunk_bytes}")
    if not isinstance(io_threads, int) or io_threads < 1:
      raise ValueError(f"io_threads must be an int >= 1, got {io_threads!r}")
    if ssd_dir is not None and staging_bytes < 2 * chunk_bytes:
      raise ValueError(
        f"staging_bytes ({staging_bytes}) must hold at least two chunks "
        f"of chunk_bytes ({chunk_bytes})"
      )
    _ffi.jax_gpus()  # the CPU client exists before the store's handlers can run
    try:
      self._id = _ext.offload_store_open(
        ram_bytes,
        os.fspath(ssd_dir) if ssd_dir else "",
        ssd_bytes,
        io_threads,
        chunk_bytes,
        staging_bytes,
        device_bytes,
        load_bytes,
      )
    except RuntimeError as e:
      raise OSError(f"TensorStore: {e}") from None
    self.ram_bytes, self.ssd_dir, self.ssd_bytes = ram_bytes, ssd_dir, ssd_bytes
    self._device_bytes, self._load_bytes = device_bytes, load_bytes
    self._finalizer = weakref.finalize(self, _ext.offload_store_close, self._id)

  @property
  def store_id(self) -> int:
    """The id FFI calls carry; ValueError once closed."""
    if not self._finalizer.alive:
      raise ValueError(f"TensorStore #{self._id} is closed")
    return self._id

  device_bytes = _staging_cap(
    "device_bytes",
    "The cap on GPU spill staging (0: none); settable while the store is open, "
    "and read by each spill (the planner sets it with its plan).",
  )
  load_bytes = _staging_cap(
    "load_bytes",
    "The cap on GPU load staging (0: none beyond two loads ahead); settable "
    "while the store is open.",
  )

  @property
  def closed(self) -> bool:
    return not self._finalizer.alive

  @property
  def directory(self) -> str | None:
    """This process's spill directory (None without an SSD tier)."""
    return self.stats()["dir"] or None

  def stats(self) -> dict[str, Any]:
    """Bytes per tier (now and peak), bytes spilled and loaded, SSD bytes written and read, the
    achieved SSD bandwidths (bytes/s while I/O was in flight), the device staging's peak."""
    s = dict(_ext.offload_store_stats(self.store_id))
    s["write_bandwidth"] = s["ssd_written"] / s["write_seconds"] if s["write_seconds"] else 0.0
    s["read_bandwidth"] = s["ssd_read"] / s["read_seconds"] if s["read_seconds"] else 0.0
    return s

  def close(self) -> None:
    """Stops I/O in flight (spills and loads still running fail with "the TensorStore was
    closed"), waits for those calls to return, frees every tier (files and descriptors, pinned
    RAM, staging, GPU staging), removes the spill directory. Idempotent."""
    self._finalizer()

  def __enter__(self) -> TensorStore:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def __repr__(self) -> str:
    state = "closed" if self.closed else "open"
    return (
      f"TensorStore(#{self._id}, {state}, ram_bytes={self.ram_bytes}, ssd_dir={self.ssd_dir!r})"
    )

  # A store is a static argument of jitted functions and policies: hash by identity.
  __hash__ = object.__hash__


def measure_disk_write(
  directory: str | os.PathLike | None = None,
  nbytes: int | str = "2GiB",
  *,
  threads: int = 4,
  chunk_bytes: int | str = "8MiB",
) -> float:
  """The disk's sustained direct-I/O write bandwidth under `directory`, in bytes per second
  (writes `nbytes` to a temporary file with `threads` writers, then removes it)."""
  directory = os.fspath(directory) if directory else tempfile.gettempdir()
  os.makedirs(directory, exist_ok=True)
  return _ext.offload_measure_disk_write(
    directory, _bytes(nbytes, "nbytes"), threads, _bytes(chunk_bytes, "chunk_bytes")
  )


def summary(stats: dict, before: dict | None = None) -> str:
  """One line on where a run's offloaded activations went, from `TensorStore.stats()`: counts
  since `before` (the stats once a planner's own probes were done), peaks over the store's
  life."""
  s = stats
  if before:
    s = dict(s, **{k: s[k] - before[k] for k in ("spills", "spilled", "ssd_written", "ssd_read")})
  if not s["spills"]:
    return "offload: nothing was offloaded (the plan keeps or recomputes every layer)"
  line = (
    f"offload: {s['spills']:,} spills, {s['spilled'] / 2**30:.2f} GiB; RAM tier peak "
    f"{s['ram_peak'] / 2**20:.1f} MiB"
  )
  if s["ssd_written"]:
    line += (
      f"; SSD tier {s['ssd_written'] / 2**30:.2f} GiB written at "
      f"{s['write_bandwidth'] / 1e9:.2f} GB/s, {s['ssd_read'] / 2**30:.2f} GiB read"
    )
  if s["device_peak"]:
    line += f"; device staging peak {s['device_peak'] / 2**20:.1f} MiB"
  return line
