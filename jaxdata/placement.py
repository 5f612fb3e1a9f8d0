"""Placing values and programs on the devices of one or several processes: `put` and
`local_value`; the 1-D mesh of a data-parallel run (`device_mesh`), programs over it
(`sharded_jit`) and their one-collective sums (`psum_flat`).

Below every other layer (the loader, the tasks and the trainers use them); `jaxdata.distributed`
re-exports `put` and `local_value`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh


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


#: The mesh axis the parts are spread over.
MESH_AXIS = "data"


def device_mesh(
  devices: int | None, platform: str | None = None, *, what: str = "full-graph training"
):
  """The 1-D mesh of `devices` devices (None: all) of `platform` in each process, process by
  process (so mesh device d takes the d-th share of a batch in any process layout); `what`
  names the caller in the error for a count this process cannot give."""
  per_process: dict[int, list] = {}
  for d in jax.devices(platform):
    per_process.setdefault(d.process_index, []).append(d)
  local = per_process.get(jax.process_index(), [])
  n = len(local) if devices is None else int(devices)
  if n < 1 or n > len(local):
    raise ValueError(
      f"{what}: devices={devices}, but {len(local)} are visible"
      + (" to this process" if len(per_process) > 1 else "")
    )

  devices = [d for p in sorted(per_process) for d in per_process[p][:n]]
  return Mesh(np.array(devices), (MESH_AXIS,))


def psum_flat(tree, axis_name: str, *, mean: bool = False):
  """`jax.lax.psum(tree, axis_name)` (`mean`: divided by the axis size) as one all-reduce of
  one float32 vector: one collective per step, not one per leaf and dtype (on two H200s each
  collective costs the step a host-side rendezvous). Integer leaves go through
  float32 and back, exact below 2**24 (the counts of a batch)."""
  flat, unravel = ravel_pytree(tree)
  total = jax.lax.psum(flat.astype(jnp.float32), axis_name)
  if mean:
    total = total / jax.lax.psum(1, axis_name)
  return unravel(total.astype(flat.dtype))


def sharded_jit(fn, mesh, in_specs, out_specs, **jit_kwargs):
  """`jax.jit(shard_map(fn), **jit_kwargs)` over `mesh`, with ``check_vma=False``: hector's
  kernel primitive carries no varying-axis types, and gradients of replicated parameters stay
  each device's own, so the caller sums them once (`psum_flat`). With check_vma on, JAX's
  transpose of the implicit pvary already sums them over the axis, and a psum of its result
  would count them K times."""
  try:
    shard_map = jax.shard_map
  except AttributeError:  # older JAX
    from jax.experimental.shard_map import shard_map  # type: ignore  (older JAX)
  return jax.jit(
    shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False), **jit_kwargs
  )
