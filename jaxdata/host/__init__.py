"""Host tables: feature and embedding tables in host memory that the GPU reads directly.

A `HostTable` lives in page-locked host memory mapped into the GPU's address space; `host_gather`
is a jit-compatible gather whose CUDA kernel reads the rows it needs straight over PCIe, with no
CPU gather and no staging copy. On a machine without a GPU the same calls run on the CPU.

    >>> import numpy as np, jax.numpy as jnp
    >>> from jaxdata.host import HostTable, host_gather
    >>> with HostTable(np.arange(12, dtype=np.float32).reshape(4, 3)) as table:
    ...   rows = host_gather(table, jnp.array([3, 0, 7]))   # 7 is out of range: NaN row
"""

from jaxdata.host.cache import DeviceCache
from jaxdata.host.gather import host_gather, host_slice
from jaxdata.host.graph import HostGraph
from jaxdata.host.sample import Blocks, DeviceGraph, sample_neighbors
from jaxdata.host.scatter import host_scatter_add
from jaxdata.host.sparse import AdamState, SparseOptimizer, sparse_adagrad, sparse_adam, sparse_sgd
from jaxdata.host.table import SUPPORTED_DTYPES, HostTable

__all__ = [
  "HostTable",
  "host_gather",
  "host_slice",
  "SUPPORTED_DTYPES",
  "HostGraph",
  "sample_neighbors",
  "Blocks",
  "DeviceGraph",
  "DeviceCache",
  "host_scatter_add",
  "SparseOptimizer",
  "sparse_sgd",
  "sparse_adagrad",
  "sparse_adam",
  "AdamState",
]
