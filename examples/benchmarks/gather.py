"""`jaxdata bench gather`: GB/s of three ways to get random table rows onto the device.

Side by side in one run, for each table size and row size, random row indices:
  (a) jaxdata.host_gather: the device reads the rows out of the pinned host table (zero-copy),
      with the default sort policy; its unsorted and sorted variants are reported too;
  (b) the CPU-centric JAX path: NumPy gathers the rows on the host, then `jax.device_put`;
  (c) the ceiling: one contiguous copy of as many bytes out of the same pinned table
      (`host_slice`, a DMA memcpy on the GPU; memcpy on the CPU).
Bandwidth counts the bytes of rows delivered to the device, per second of wall time.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Sequence

import jax
import numpy as np

from benchmarks import common
from jaxdata import command
from jaxdata.host import HostTable, host_gather, host_slice
from jaxdata.host import gather as gather_mod
from jaxdata.sizes import format_bytes, parse_bytes
from jaxdata.timing import median_seconds

ROW_BYTES = (64, 128, 256, 512, 1024, 2048, 4096)
TABLE_BYTES = ("256M", "16G")


@dataclasses.dataclass
class Result:
  table_bytes: int
  row_bytes: int
  sorted_by_default: bool
  gather: float  # GB/s, default policy
  unsorted: float
  sorted: float
  cpu_centric: float
  memcpy: float

  @property
  def of_memcpy(self) -> float:
    return self.gather / self.memcpy

  @property
  def over_cpu(self) -> float:
    return self.gather / self.cpu_centric


def _fill(table: HostTable, rng: np.random.Generator) -> None:
  """Random contents (never zeros), written block by block."""
  block = rng.integers(1, 255, size=min(table.nbytes, 64 << 20), dtype=np.uint8)
  flat = table.view(np.uint8, columns=4096)
  rows_per_block = block.size // 4096
  block = block[: rows_per_block * 4096].reshape(rows_per_block, 4096)
  for start in range(0, flat.shape[0], rows_per_block):
    flat.write(start, block[: flat.shape[0] - start])
  flat.close()


def _measure(
  table: HostTable,
  row_bytes: int,
  batch_bytes: int,
  cpu_batch_bytes: int,
  repeats: int,
  rng: np.random.Generator,
) -> Result:
  t = table.view(np.float32, columns=row_bytes // 4)
  try:
    rows = t.shape[0]
    n = max(1, batch_bytes // row_bytes)
    device = jax.devices()[0]
    index_sets = [jax.device_put(common.random_rows(rng, rows, n), device) for _ in range(3)]

    def gbps(nbytes: int, seconds: float) -> float:
      return nbytes / seconds / 1e9

    def time_gather(sort: bool) -> float:
      fn = jax.jit(lambda i: host_gather(t, i, sort=sort))
      sets = itertools.cycle(index_sets)
      return gbps(n * row_bytes, median_seconds(lambda: fn(next(sets)), repeats=repeats, queued=4))

    unsorted, sorted_ = time_gather(False), time_gather(True)
    by_default = gather_mod.sorts_by_default(t)

    n_copy = min(n, rows)
    copy = jax.jit(lambda: host_slice(t, 0, n_copy))
    memcpy = gbps(n_copy * row_bytes, median_seconds(copy, repeats=repeats, queued=4))

    def time_cpu() -> float:
      # The numpy view is local, so it is gone before `t.close()` unmaps the table.
      view = t.as_numpy()
      n_cpu = max(1, min(n, cpu_batch_bytes // row_bytes))
      cpu_sets = itertools.cycle([common.random_rows(rng, rows, n_cpu) for _ in range(3)])
      seconds = median_seconds(
        lambda: jax.device_put(view[next(cpu_sets)], device), warmup=1, repeats=max(3, repeats // 2)
      )
      return gbps(n_cpu * row_bytes, seconds)

    cpu = time_cpu()
    return Result(
      t.nbytes,
      row_bytes,
      by_default,
      sorted_ if by_default else unsorted,
      unsorted,
      sorted_,
      cpu,
      memcpy,
    )
  finally:
    t.close()


def run(
  table_sizes: Sequence[str] = TABLE_BYTES,
  row_bytes: Sequence[int] = ROW_BYTES,
  *,
  batch_bytes: int = 256 << 20,
  cpu_batch_bytes: int = 64 << 20,
  repeats: int = 7,
  seed: int = 0,
  console=None,
) -> tuple[list[Result], list[str]]:
  """Runs the benchmark; returns the results and notes on what was skipped and why."""
  import rich.progress  # pylint: disable=g-import-not-at-top

  from jaxdata import _ffi  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(seed)
  results, notes = [], []
  ram = _ffi.ext.physical_memory_bytes()
  sizes = [parse_bytes(s) for s in table_sizes]
  for rb in row_bytes:
    if rb % 4 or rb <= 0:
      raise ValueError(f"row sizes must be positive multiples of 4 bytes, got {rb}")
  with rich.progress.Progress(console=console, transient=True) as bar:
    task = bar.add_task("bench gather", total=len(sizes) * len(row_bytes))
    for size in sizes:
      size -= size % 4096
      if 2 * size > ram:
        notes.append(
          f"{format_bytes(size)} table skipped: the host has "
          f"{ram / 2**30:.0f} GiB of RAM (the benchmark wants twice the table)"
        )
        bar.advance(task, len(row_bytes))
        continue
      bar.update(task, description=f"filling a {format_bytes(size)} table")
      with HostTable.empty((size // 4096, 1024), np.float32) as table:
        _fill(table, rng)
        for rb in row_bytes:
          bar.update(task, description=f"{format_bytes(size)} table, {rb} B rows")
          results.append(_measure(table, rb, batch_bytes, cpu_batch_bytes, repeats, rng))
          bar.advance(task)
  return results, notes


def table_rows(results: list[Result]) -> tuple[list[str], list[list[str]]]:
  header = [
    "table",
    "row",
    "host_gather GB/s",
    "% of memcpy",
    "x CPU-centric",
    "unsorted GB/s",
    "sorted GB/s",
    "CPU-centric GB/s",
    "memcpy GB/s",
  ]
  rows = [
    [
      format_bytes(r.table_bytes),
      f"{r.row_bytes} B",
      f"{r.gather:.1f}" + (" (sorted)" if r.sorted_by_default else ""),
      f"{100 * r.of_memcpy:.0f}%",
      f"{r.over_cpu:.1f}x",
      f"{r.unsorted:.1f}",
      f"{r.sorted:.1f}",
      f"{r.cpu_centric:.2f}",
      f"{r.memcpy:.1f}",
    ]
    for r in results
  ]
  return header, rows


def markdown(
  results: list[Result], notes: list[str], command: str, png: str | None = "gather.png"
) -> str:
  hw = common.hardware()
  header, rows = table_rows(results)
  text = [
    "# Gathering random rows from a host table",
    "",
    "Measured by `jaxdata bench gather` (examples/benchmarks/gather.py): GB/s of rows delivered "
    "to the "
    "device, random indices, float32 rows. *host_gather* is jaxdata's zero-copy gather with its "
    "default policy (indices sorted first for tables of "
    f"{format_bytes(gather_mod.SORT_THRESHOLD_BYTES)} or more with rows under "
    f"{gather_mod.SORT_BELOW_ROW_BYTES} B); *CPU-centric* is NumPy "
    "fancy indexing on the host followed by `jax.device_put`; *memcpy* is one contiguous "
    "copy of as many bytes from the same pinned table (`host_slice`, a DMA copy), the ceiling. "
    "Device-side paths are timed as throughput: several calls queued back to back, then one "
    "wait (median over rounds); the CPU-centric path is synchronous by nature and timed per "
    "call.",
    "",
    f"Command: `{command}`",
    "",
    *[f"- {k}: {v}" for k, v in hw.items()],
    "",
    common.markdown_table(header, rows),
    "",
  ]
  if notes:
    text += [*(f"- {n}" for n in notes), ""]
  if png:
    text += [f"![GB/s against row size]({png})", ""]
  text += [
    "What these figures say: [gather_notes.md](gather_notes.md).",
    "",
  ]
  return "\n".join(text)


def plot(results: list[Result], path: str) -> bool:
  """GB/s against row size, one panel per table size. Needs matplotlib; returns whether drawn."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    return False
  sizes = sorted({r.table_bytes for r in results})
  fig, axes = plt.subplots(1, len(sizes), figsize=(5.5 * len(sizes), 4), squeeze=False)
  for ax, size in zip(axes[0], sizes):
    rs = [r for r in results if r.table_bytes == size]
    x = [r.row_bytes for r in rs]
    ax.plot(x, [r.memcpy for r in rs], "k--", label="pinned memcpy (ceiling)")
    ax.plot(x, [r.gather for r in rs], "o-", label="host_gather (zero-copy)")
    ax.plot(
      x, [r.unsorted for r in rs], ":", color="tab:blue", alpha=0.6, label="host_gather, unsorted"
    )
    ax.plot(x, [r.cpu_centric for r in rs], "s-", label="NumPy gather + device_put")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(x, [str(v) for v in x])
    ax.set_xlabel("row size (bytes)")
    ax.set_ylabel("GB/s")
    ax.set_title(f"{format_bytes(size)} table, random rows")
    ax.grid(True, which="both", alpha=0.3)
  axes[0][0].legend(fontsize=8)
  fig.tight_layout()
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


# ----------------------------------------------------------------------------- the CLI
def add_arguments(parser) -> None:
  """`jaxdata bench gather` options."""
  parser.add_argument(
    "--tables",
    type=command.listing(str),
    help="table sizes, comma-separated (default 256M,16G, skipped where RAM is short; --quick 64M)",
  )
  parser.add_argument(
    "--rows",
    type=command.listing(command.positive_int),
    help="row sizes in bytes, comma-separated (default 64 to 4096, powers of "
    "two; --quick 64,512,4096)",
  )
  parser.add_argument(
    "--batch-bytes",
    type=command.size,
    help="bytes gathered per call (default 256MiB; --quick 32MiB)",
  )
  parser.add_argument(
    "--repeats",
    type=command.positive_int,
    help="timed calls per measurement, median (default 7; --quick 3)",
  )
  parser.add_argument(
    "--quick",
    action="store_true",
    help="a small run: 64 MiB table, 3 row sizes (flags given still apply)",
  )
  parser.add_argument(
    "--write",
    metavar="PATH.md",
    type=command.output_path,
    help="write the table (and a .png plot beside it) here",
  )


def main(args) -> int:
  """`jaxdata bench gather`."""
  tables = common.pick(args.tables, args.quick, ["64M"], list(TABLE_BYTES))
  rows = common.pick(args.rows, args.quick, [64, 512, 4096], list(ROW_BYTES))
  for t in tables:
    try:
      size = parse_bytes(t)
    except ValueError as e:
      raise command.UsageError(f"argument --tables: {e}") from None
    if size < (need := max(4096, *rows)):  # a table of 4096-byte rows, read as --rows rows
      raise command.UsageError(
        f"argument --tables: {t} is below {need:,} bytes (a table holds at "
        f"least one 4KiB row, and one row of each --rows size)"
      )
  if bad := [r for r in rows if r % 4]:
    raise command.UsageError(
      f"argument --rows: row sizes must be multiples of 4 bytes (float32 columns), got {bad[0]}"
    )
  repeats = common.pick(args.repeats, args.quick, 3, 7)
  batch = common.pick(args.batch_bytes, args.quick, 32 << 20, 256 << 20)
  console = command.console(width=140)
  results, notes = run(
    tables,
    rows,
    batch_bytes=batch,
    cpu_batch_bytes=min(batch, 64 << 20),
    repeats=repeats,
    console=console,
  )
  common.check_measured(results, notes)
  common.print_table(
    console,
    "random-row gather from a host table (GB/s of rows delivered)",
    *table_rows(results),
    notes,
  )
  if args.write:
    common.write_with_plot(
      console,
      args.write,
      lambda png: markdown(results, notes, common.command_line(), png=png),
      lambda png: plot(results, png),
    )
  return 0
