"""Flax NNX layers built on jaxdata's primitives, and the models built from them."""

from jaxdata.nn.classifiers import (
  Classifier,
  EntityClassifier,
  HGTClassifier,
  RGATClassifier,
  RGCNClassifier,
)
from jaxdata.nn.gpt import GPT, GPTConfig
from jaxdata.nn.hgt import HGT
from jaxdata.nn.rgat import RGAT
from jaxdata.nn.rgcn import RGCN
from jaxdata.nn.sage import GraphSAGE, SAGEConv
from jaxdata.nn.typed import typed_linear

__all__ = ["RGCN", "RGAT", "HGT", "GraphSAGE", "SAGEConv"]
__all__ += [
  "GPT",
  "GPTConfig",
  "Classifier",
  "RGATClassifier",
  "RGCNClassifier",
  "HGTClassifier",
  "EntityClassifier",
  "typed_linear",
]
