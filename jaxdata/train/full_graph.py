"""What the full-graph trainers share to run over a mesh of devices (and processes).

`jaxdata.train.rgcn.partitioned` and `jaxdata.train.attention.partitioned` split the graph by
destination nodes (`jaxdata.hector.partition`) over a 1-D mesh: `device_mesh` builds it (K
devices of each process, process by process), `node_rows` lays a per-node array over the parts'
padded node space so that it shards by rows, and `shard` jits a per-device function under
`shard_map` with ``check_vma=False`` (hector's kernel primitive carries no varying-axis types;
gradients of replicated parameters are therefore each device's own, and the trainers psum them).
"""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

try:
  _shard_map = jax.shard_map
except AttributeError:  # older JAX
  from jax.experimental.shard_map import shard_map as _shard_map  # type: ignore

#: The mesh axis the parts are spread over.
AXIS = "data"


def device_mesh(devices: int | None, platform: str | None = None) -> Mesh:
  """The 1-D mesh of `devices` devices (None: all) of each process, process by process."""
  per_process: dict[int, list] = {}
  for d in jax.devices(platform):
    per_process.setdefault(d.process_index, []).append(d)
  local = per_process.get(jax.process_index(), [])
  n = len(local) if devices is None else int(devices)
  if n < 1 or n > len(local):
    raise ValueError(f"full-graph training: devices={devices}, but {len(local)} are visible"
                     + (" to this process" if len(per_process) > 1 else ""))
  return Mesh(np.array([d for p in sorted(per_process) for d in per_process[p][:n]]), (AXIS,))


def node_rows(padded_nodes: int, nodes, values=None) -> np.ndarray:
  """A per-node array over ``padded_nodes`` rows: `values` (int32) at `nodes`, zero elsewhere;
  without `values`, a mask (True at `nodes`)."""
  out = np.zeros(padded_nodes, bool if values is None else np.int32)
  out[np.asarray(nodes)] = True if values is None else values
  return out


def shard(fn, mesh: Mesh, in_specs, out_specs):
  """`jax.jit(shard_map(fn))` over `mesh`, with ``check_vma=False`` (see the module)."""
  return jax.jit(_shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                            check_vma=False))


def gather_rows(h: jax.Array) -> jax.Array:
  """Inside `shard`: every device's ``[rows, ...]`` laid end to end, ``[K * rows, ...]``."""
  return jax.lax.all_gather(h, AXIS, tiled=True)


def first_row(rows: int) -> jax.Array:
  """Inside `shard`: the first node id this device's part owns."""
  return jax.lax.axis_index(AXIS) * rows
