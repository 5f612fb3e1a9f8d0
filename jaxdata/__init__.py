"""jaxdata: data-efficient GPU training for JAX.

Parts:
  jaxdata.host     host tables the GPU reads directly (zero-copy gathers from pinned memory)
"""
from jaxdata import host
from jaxdata.host import HostTable, host_gather, host_slice

__version__ = "0.1.0"
__all__ = ["host", "HostTable", "host_gather", "host_slice", "__version__"]
