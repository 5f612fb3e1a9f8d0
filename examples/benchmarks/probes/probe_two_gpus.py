"""Does zero-copy reading from pinned host memory scale across two GPUs? (see .ci/gpu notes)

Times host_gather of 256 MiB of random 1 KiB rows from a 4 GiB pinned table on one GPU, then on
both at once (shard_map, each GPU its own indices), and a plain pinned memcpy the same way; prints
GB/s per GPU and in total. Run on a 2-GPU machine after `nvidia-smi topo -m`.
"""

import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdata.host import HostTable, host_gather, host_slice

ROWS, COLS, N = 4 << 20, 256, 256 << 10  # 4 GiB table of 1 KiB rows; 256 MiB per gather
table = HostTable.empty((ROWS, COLS), np.float32)
table.as_numpy()[:] = 1.0
rng = np.random.default_rng(0)


def timed(fn, *args, repeats=10):
  jax.block_until_ready(fn(*args))
  t0 = time.perf_counter()
  for _ in range(repeats):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) / repeats


for ndev in (1, 2):
  mesh = Mesh(np.array(jax.devices()[:ndev]), ("d",))
  idx = jax.device_put(rng.integers(0, ROWS, ndev * N, dtype=np.int32), NamedSharding(mesh, P("d")))
  gather = jax.jit(
    jax.shard_map(lambda i: host_gather(table, i), mesh=mesh, in_specs=P("d"), out_specs=P("d"))
  )
  copy = jax.jit(
    jax.shard_map(lambda: host_slice(table, 0, N), mesh=mesh, in_specs=(), out_specs=P("d"))
  )
  for name, fn, args in (("host_gather", gather, (idx,)), ("memcpy", copy, ())):
    s = timed(fn, *args)
    per = N * COLS * 4 / s / 1e9
    print(f"{ndev} GPU(s) {name:12s}: {per:6.1f} GB/s per GPU, {ndev * per:6.1f} GB/s total")
