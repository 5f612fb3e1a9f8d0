"""jaxdata: data-efficient GPU training for JAX.

Parts:
  jaxdata.host     host tables the GPU reads directly (zero-copy gathers from pinned memory)
  jaxdata.hector   relational GNN layers compiled to fused kernels
  jaxdata.offload  activations offloaded to host RAM and SSD under remat policies
  jaxdata.loader   mini-batches of a graph in host memory for your own model and loop
  jaxdata.nn       Flax NNX models built from them
  jaxdata.tasks    what `jaxdata train` trains: each task's data, model, measurement, checkpoints

`jaxdata.load_model(path)` rebuilds a model that `jaxdata train ... --out DIR` saved.
"""

from jaxdata import host
from jaxdata._version import __version__
from jaxdata.host import HostTable, host_gather, host_slice

__all__ = ["host", "HostTable", "host_gather", "host_slice", "load_model", "__version__"]


def load_model(path, /, **data_overrides):
  """Rebuilds a saved model to evaluate or predict with (`jaxdata.tasks.checkpoint.load_model`)."""
  from jaxdata.tasks.checkpoint import load_model as load  # Orbax and the models: when asked for

  return load(path, **data_overrides)
