"""Flax NNX layers built on jaxdata's primitives."""
from jaxdata.nn.rgcn import RGCN

__all__ = ["RGCN"]
