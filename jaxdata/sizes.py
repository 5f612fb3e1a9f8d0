"""Byte sizes as people write them: "256MiB", "2GB", "1.5G", "4096".

Binary and decimal units are told apart, as the IEC and SI define them: ``KiB/MiB/GiB/TiB`` are
powers of 1024, ``kB/KB/MB/GB/TB`` powers of 1000. A bare letter (``K/M/G/T``) means the binary
unit, as most memory-sizing flags (and ``ulimit``) read it.

    >>> parse_bytes("2GiB"), parse_bytes("2GB"), parse_bytes("2G")
    (2147483648, 2000000000, 2147483648)
    >>> format_bytes(3 << 30), format_bytes(1536)
    ('3 GiB', '1.5 KiB')
"""

from __future__ import annotations

import math
import os
import re

_BINARY = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_DECIMAL = {"K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMgGtT]?)(i?)([bB]?)\s*")


def parse_bytes(text: str | int) -> int:
  """A size in bytes from text such as "256MiB", "2GB", "1.5G" or "4096".

  Raises:
    ValueError: the text is not a non-negative size with a known unit (the message quotes it).
  """
  if isinstance(text, int) and not isinstance(text, bool):
    if text < 0:
      raise ValueError(f"a size cannot be negative, got {text}")
    return text
  m = _SIZE.fullmatch(str(text))
  if not m or (m.group(3) and not m.group(2)):
    raise ValueError(
      f"{text!r} is not a size: write bytes, or a number with a unit such as "
      f"512MiB, 2GiB (binary) or 2GB (decimal)"
    )
  number, prefix, binary, b = m.groups()
  prefix = prefix.upper()
  if prefix and b and not binary:
    scale = _DECIMAL[prefix]  # kB, MB, GB, TB: powers of 1000
  else:
    scale = _BINARY[prefix]  # KiB, MiB, ... and bare K, M, G, T
  value = float(number) * scale
  if not math.isfinite(value):
    raise ValueError(f"{text!r} is not a size: too large")
  return int(round(value))


def format_bytes(n: int) -> str:
  """A size for people: the largest binary unit it reaches, at most one decimal ("1.5 KiB")."""
  for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
    if abs(n) >= size:
      value = n / size
      return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
  return f"{n} B"


def available_memory() -> int:
  """Bytes of host memory available to a new allocation now: Linux's MemAvailable (free memory
  plus what the page cache would give back), else the free physical pages."""
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
