"""What a bad table handle inside a compiled program gives, on each platform.

On the CPU the call itself fails. On a GPU, `host_gather` and `sample_neighbors` check handles in
their kernels without waiting for the GPU: the call returns having read nothing from any table
(fill values, padding), and the next jaxdata host call on that device fails with the error.
(`host_scatter_add` and `host_slice` wait for the GPU and fail the call itself on both.)
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np


def on_gpu(result: Any) -> bool:
  return any(
    d.platform == "gpu"
    for leaf in jax.tree.leaves(result)
    if isinstance(leaf, jax.Array)
    for d in leaf.devices()
  )


def assert_handle_error(
  call: Callable[[], Any],
  match: str,
  *,
  then: Callable[[], Any],
  untouched: Callable[[Any], bool] | None = None,
) -> None:
  """`call()` fails with an error matching `match`; or, on a GPU only, it returns a result for
  which `untouched` holds (nothing was read) and `then()`, the next jaxdata host call on the
  device, fails with that error, after which `then()` works again."""
  try:
    result = jax.block_until_ready(call())
  except Exception as e:  # noqa: BLE001 - any error type: what matters is the message
    assert re.search(match, str(e)), str(e)
    return
  assert on_gpu(result), "a bad handle must fail the call itself on the CPU"
  if untouched is not None:
    assert untouched(result), "a bad handle on a GPU must read nothing"
  try:
    jax.block_until_ready(then())
  except Exception as e:  # noqa: BLE001
    assert re.search(match, str(e)), str(e)
    assert "earlier" in str(e), str(e)
  else:
    raise AssertionError(f"the next host call on the GPU did not report {match!r}")
  jax.block_until_ready(then())  # reported once, then cleared


def all_nan(result: Any) -> bool:
  return bool(np.isnan(np.asarray(result)).all())
