"""Flax NNX layers built on jaxdata's primitives."""

from jaxdata.nn.gpt import GPT, GPTConfig
from jaxdata.nn.hgt import HGT
from jaxdata.nn.rgat import RGAT
from jaxdata.nn.rgcn import RGCN
from jaxdata.nn.sage import GraphSAGE, SAGEConv

__all__ = ["RGCN", "RGAT", "HGT", "GraphSAGE", "SAGEConv"]
__all__ += ["GPT", "GPTConfig"]
