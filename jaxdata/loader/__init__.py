"""Mini-batches of a graph in host memory, for your own Flax model and training loop.

`Loader` holds a (typed) graph's structure and every node type's inputs in host memory (or on
the device) and samples batches in fixed shapes: inside your jitted step (`Loader.sample`, the
loader passed as an argument) or as a checkpointable, prefetching iterator over epochs
(`Loader.batches`). The blocks are hector's (`jaxdata.hector.block`): jaxdata's RGCN, RGAT and
HGT layers run on them. docs/loader.md walks through a whole training loop.

    >>> import jax, numpy as np
    >>> from jaxdata.loader import Loader
    >>> edges = {("user", "follows", "user"): ([0, 1, 2], [1, 2, 0])}
    >>> with Loader(edges, num_nodes={"user": 3}, features=np.eye(3, dtype=np.float32),
    ...             labels=np.array([0, 1, 0]), fanouts=(2,)) as loader:
    ...   batch = jax.jit(Loader.sample)(loader, np.array([0, 2]), jax.random.key(0))
    ...   print(batch.labels.tolist(), batch.inputs[0].shape[1])
    [0, 0] 3
"""

from jaxdata.loader.blocks import (
  RelationalBlocks,
  budget_fraction,
  gather_typed,
  node_types,
  sample_blocks,
  type_caches,
)
from jaxdata.loader.loader import (
  Batch,
  BatchIterator,
  Loader,
  ShardedBatch,
  TreeBatch,
  initial_embeddings,
)

__all__ = [
  "Loader",
  "Batch",
  "TreeBatch",
  "BatchIterator",
  "ShardedBatch",
  "RelationalBlocks",
  "sample_blocks",
  "gather_typed",
  "node_types",
  "type_caches",
  "budget_fraction",
  "initial_embeddings",
]
