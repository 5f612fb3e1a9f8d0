"""One process of tests/test_distributed.py's loader run (not a test module itself).

    python tests/loader_worker.py OUT_DIR

Joins the job the environment describes (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
JAX_PROCESS_ID; none: one process), iterates `Loader.batches` over a 1-D mesh of every device of
every process (tests/test_loader.py's graph, 3 seeds per device, seed 2, one epoch) and writes
OUT_DIR/process{I}.npz: per batch and per array of it, this process's shards laid end to end
(its devices' batches, in device order).
"""

import argparse
import os
import sys


def main(out: str) -> None:
  from jaxdata import distributed

  distributed.initialize(distributed.setup_from(argparse.Namespace()))
  import jax
  import numpy as np
  from jax.sharding import Mesh
  from test_loader import make_loader

  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  mesh = Mesh(np.array(devices), ("data",))
  saved = {}
  with make_loader() as loader:
    batches = loader.batches({"paper": np.arange(30)}, 3, seed=2, mesh=mesh)
    for i, batch in enumerate(batches):
      for j, leaf in enumerate(batch.leaves):
        shards = sorted(leaf.addressable_shards, key=lambda s: s.index[0].start or 0)
        saved[f"batch{i}_leaf{j}"] = np.concatenate([np.asarray(s.data) for s in shards])
  np.savez(os.path.join(out, f"process{jax.process_index()}.npz"), **saved)
  print(f"process {jax.process_index()} of {jax.process_count()}: {len(saved)} arrays", flush=True)


if __name__ == "__main__":
  main(sys.argv[1])
