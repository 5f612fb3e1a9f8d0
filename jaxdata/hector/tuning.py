"""Tilings of the tensor-core kernels, chosen by timing them on a call's own operands.

A tensor-core GEMM or weight-gradient instance (templates/mma.cuh) can be tiled several ways
that read the same operands and compute the same output: `codegen.cuda.tilings` (output
columns per block; a register cap that keeps more blocks resident). Which is fastest depends
on the widths, the heads, the graph and the GPU. When a program is lowered for CUDA, each such
instance with no recorded choice is compiled in every tiling and launched through the tuning
form of ``jaxdata_hector_launch`` (xla_ffi/hector/launch_cuda.cc): its first run times every
tiling on that run's operands (each launched 3 times after a warm-up; the median), keeps the
fastest for the rest of the process, and writes the choice beside the kernel in the disk cache
(`choice_file`: ``<key>.tune`` in `compiler.cache_dir()`, keyed by the default tiling's source,
the GPU's compute capability, the domain's rows and rows per (source, relation) pair, each to a
power of two, and the tilings). A process that lowers the same instance later reads it and
compiles and launches only the chosen tiling.

`read_choice` trusts a file only if it is whole and agrees with the tilings it was made for; any
other file is ignored and the instance is tuned again (which replaces it). With
``JAXDATA_HECTOR_AUTOTUNE=0`` nothing is tuned or read: every instance takes its default tiling
(the first), as before tuning existed.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from jaxdata.hector import compiler

#: tuning runs unless this environment variable is "0"
AUTOTUNE_ENV = "JAXDATA_HECTOR_AUTOTUNE"
#: the first line of a choice file (its format's version)
HEADER = "jaxdata-hector-tune 1"


_lowered_to_tune = 0  # hector calls this process lowered to the tuning target


def note_tuning_lowering() -> None:
  """Counts one call lowered to ``jaxdata_hector_tune`` (`jaxdata.hector.runtime`)."""
  global _lowered_to_tune
  _lowered_to_tune += 1


def tuning_lowerings() -> int:
  """How many hector calls this process has lowered to ``jaxdata_hector_tune``, the target XLA
  keeps out of its CUDA graphs because the call's first run times its tilings. A program whose
  lowering raised this count tunes on its first run; compiled again after that run, it launches
  the chosen tilings inside XLA's graphs."""
  return _lowered_to_tune


def enabled() -> bool:
  """Whether tensor-core instances are tuned (unless `AUTOTUNE_ENV` is "0")."""
  return os.environ.get(AUTOTUNE_ENV, "1") != "0"


def choice_file(
  default_source: str, arch: int, rows: int, tilings: list, pairs: int | None = None
) -> Path:
  """Where the choice among `tilings` for the instance whose default tiling generates
  `default_source` lives, on a GPU of compute capability `arch`, for a domain of `rows` rows
  (bucketed by powers of two: the choice for 2M edges serves 1.5M) over a graph of `pairs`
  unique (source, relation) pairs (None: as many as rows). Rows per pair, also by powers of
  two, is the degree skew a tiling sees: hub sources make a relation's gathered rows repeat,
  and the tiling that serves a uniform graph best need not serve a power-law one."""
  per_pair = max(rows // max(pairs or rows, 1), 1)
  key = compiler.source_key(
    default_source,
    (
      "tune",
      str(arch),
      str(max(rows, 1).bit_length()),
      " | ".join(map(str, tilings)),
      f"skew {per_pair.bit_length()}",
    ),
  )
  return compiler.cache_dir() / f"{key}.tune"


@dataclasses.dataclass(frozen=True)
class Choice:
  """A recorded choice: `index` into the tilings, and each tiling's median time (us;
  infinite where its launch failed)."""

  index: int
  times_us: tuple[float, ...]


def read_choice(path: Path, count: int) -> Choice | None:
  """The choice recorded at `path` among `count` tilings, or None where there is none or the
  file is not a whole one for `count` tilings (torn, foreign, or written for other tilings)."""
  try:
    lines = path.read_text().splitlines()
  except (OSError, UnicodeDecodeError):
    return None
  fields = dict(line.split(" ", 1) for line in lines[1:] if " " in line)
  if not lines or lines[0] != HEADER or "choice" not in fields or "times_us" not in fields:
    return None
  try:
    index = int(fields["choice"])
    times = tuple(float(t) for t in fields["times_us"].split())
  except ValueError:
    return None
  if (
    len(times) != count
    or not 0 <= index < count
    or times[index] != min(times)
    or times[index] == float("inf")
  ):
    return None
  return Choice(index, times)
