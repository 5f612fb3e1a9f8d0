"""One process of tests/test_distributed.py's sparse-optimizer runs (not a test module itself).

    python tests/sparse_worker.py OUT_DIR

Joins the job the environment describes (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
JAX_PROCESS_ID; none: one process), builds a 1-D "data" mesh over every device of every process
(process by process) and applies STEPS data-parallel updates to host tables replicated per
process, every device holding its share of each global batch:

- sparse_sgd(1) with unit gradients on an int-valued float32 table: the table ends as minus the
  number of times each row appeared (np.add.at counts), whatever the process count;
- sparse_adam(0.1) with random gradients: every copy, and a one-process run, end equal.

Writes OUT_DIR/process{I}.npz with the tables and Adam's count.
"""

import argparse
import os
import sys

ROWS, COLS, PER_DEVICE, STEPS = 13, 3, 8, 3


def global_batches(devices: int):
  """The global batches every process draws alike: indices in [-ROWS, ROWS] (negative ones
  count from the end, ROWS is dropped), gradients."""
  import numpy as np

  rng = np.random.default_rng(7)
  n = devices * PER_DEVICE
  out = []
  for _ in range(STEPS):
    ids = rng.integers(-ROWS, ROWS, n).astype(np.int32)
    ids[::5] = ROWS
    out.append((ids, rng.standard_normal((n, COLS)).astype(np.float32)))
  return out


def main(out: str) -> None:
  from jaxdata import distributed

  distributed.initialize(distributed.setup_from(argparse.Namespace()))
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  from jaxdata.host import HostTable, sparse

  try:
    shard_map = jax.shard_map
  except AttributeError:
    from jax.experimental.shard_map import shard_map

  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  mesh = Mesh(np.array(devices), ("data",))
  sgd, adam = sparse.sparse_sgd(1.0), sparse.sparse_adam(0.1)
  counts = HostTable(np.zeros((ROWS, COLS), np.float32))
  weights = HostTable(np.linspace(-1, 1, ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS))
  adam_state = adam.init(weights)

  def update(ids, grads):
    t = sgd.update(counts, (), ids, jnp.ones_like(grads), axis_name="data")
    t = t + adam.update(weights, adam_state, ids, grads, axis_name="data")
    # Every device's writes are done before any device starts the next step.
    return jax.lax.psum(t, "data")

  step = jax.jit(shard_map(update, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P()))
  batch = NamedSharding(mesh, P("data"))
  for ids, grads in global_batches(len(devices)):
    jax.block_until_ready(step(distributed.put(ids, batch), distributed.put(grads, batch)))
  np.savez(
    os.path.join(out, f"process{jax.process_index()}.npz"),
    counts=counts.as_numpy(),
    weights=weights.as_numpy(),
    adam_count=adam_state.count.as_numpy(),
  )
  print(
    f"process {jax.process_index()} of {jax.process_count()}: {len(devices)} devices, done",
    flush=True,
  )


if __name__ == "__main__":
  main(sys.argv[1])
