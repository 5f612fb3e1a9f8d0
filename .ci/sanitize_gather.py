"""Runs every gather kernel plan once on the GPU, for compute-sanitizer (see .ci/gpu).

Row sizes cover 1- to 16-byte vectors, one and several segments, and rows that are not
multiples of 128 bytes; indices include every kind of out-of-range value, sorted and unsorted.
Exits non-zero if a result differs from jnp.take.
"""

import jax
import jax.numpy as jnp
import numpy as np

from jaxdata.host import HostTable, host_gather, host_slice

jax.config.update("jax_enable_x64", True)
rng = np.random.default_rng(0)
bad = 0
for dtype, cols in [
  (np.uint8, 1),
  (np.uint8, 3),
  (np.float32, 3),
  (np.float32, 16),
  (np.float32, 24),
  (np.float64, 65),
  (np.float32, 130),
  (np.int8, 1001),
]:
  data = rng.integers(0, 100, size=(777, cols)).astype(dtype)
  idx = jnp.asarray(rng.integers(-2000, 2000, size=5000))
  with HostTable(data) as table:
    for sort in (False, True):
      for mode in ("fill", "clip"):
        got = host_gather(table, idx, mode=mode, sort=sort)
        want = jnp.take(jnp.asarray(data), idx, axis=0, mode=mode)
        same = np.array_equal(np.asarray(got), np.asarray(want), equal_nan=True)
        bad += not same
        verdict = "ok" if same else "WRONG"
        print(f"{np.dtype(dtype).name:>8} x {cols:<5} sort={sort!s:<5} {mode}: {verdict}")
    np.testing.assert_array_equal(np.asarray(host_slice(table, 700, 77)), data[700:])
print("mismatches:", bad)
raise SystemExit(1 if bad else 0)
