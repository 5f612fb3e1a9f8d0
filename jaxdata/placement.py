"""Placing values on the devices of one or several processes: `put` and `local_value`.

Below every other layer (the loader and the trainers use them); `jaxdata.distributed` re-exports
them. JAX is imported inside each function: `jaxdata.distributed` imports this module, and the
command line imports that before it sets JAX up.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def local_value(tree: Any) -> Any:
  """NumPy copies of a pytree of fully replicated arrays, read from this process's own copy.

  `jax.device_get` refuses arrays that span other processes' devices; a replicated array has
  the whole value on each of this process's devices, so no collective is needed.
  """

  def one(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      if not x.is_fully_replicated:
        raise ValueError(
          "jaxdata.distributed.local_value: the array is not replicated "
          f"(sharding {x.sharding}); gather it first"
        )
      x = x.addressable_data(0)
    return jax.device_get(x)

  return jax.tree.map(one, tree)


def put(tree: Any, sharding) -> Any:
  """`jax.device_put(tree, sharding)` that also works when `sharding` spans other processes.

  With one process it is `jax.device_put`. With several, every process passes the same global
  value and each places only its own devices' shards: host arrays go as they are; arrays already
  on a device (and PRNG keys) are read back first, since JAX puts only host data onto other
  processes' meshes.
  """
  if jax.process_count() == 1:
    return jax.device_put(tree, sharding)

  def one(x):
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      data = one(jax.random.key_data(x))
      return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    if isinstance(x, jax.Array):
      x = np.asarray(jax.device_get(x))
    return jax.device_put(x, sharding)

  return jax.tree.map(one, tree)
