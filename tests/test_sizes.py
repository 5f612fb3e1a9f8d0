"""Byte sizes: binary and decimal units told apart, bad text rejected with the text quoted."""

import pytest

from jaxdata.sizes import format_bytes, parse_bytes


@pytest.mark.parametrize(
  "text,want",
  [
    ("4096", 4096),
    ("0", 0),
    ("2KiB", 2 << 10),
    ("2kB", 2000),
    ("2KB", 2000),
    ("3MiB", 3 << 20),
    ("3MB", 3 * 10**6),
    ("2GiB", 2 << 30),
    ("2GB", 2 * 10**9),
    ("2G", 2 << 30),
    ("1.5G", 3 << 29),
    ("1TiB", 1 << 40),
    ("1TB", 10**12),
    (" 64 MiB ", 64 << 20),
    ("5b", 5),
    (7, 7),
  ],
)
def test_parse_bytes_tells_binary_from_decimal_units(text, want):
  assert parse_bytes(text) == want


@pytest.mark.parametrize(
  "text", ["", "-1", "2X", "MiB", "2iB", "1,5G", "ten", "2 GiBs", -3, "1e400", "1e300TiB"]
)
def test_parse_bytes_rejects_what_is_not_a_size(text):
  with pytest.raises(ValueError, match="size"):
    parse_bytes(text)


@pytest.mark.parametrize(
  "n,want",
  [
    (0, "0 B"),
    (1023, "1023 B"),
    (1024, "1 KiB"),
    (1536, "1.5 KiB"),
    (3 << 30, "3 GiB"),
    (5 << 40, "5 TiB"),
  ],
)
def test_format_bytes_uses_the_largest_binary_unit_reached(n, want):
  assert format_bytes(n) == want
  if n >= 1024:  # what it prints parses back to within the rounding of one decimal
    assert parse_bytes(want.replace(" ", "")) == pytest.approx(n, rel=0.05)
