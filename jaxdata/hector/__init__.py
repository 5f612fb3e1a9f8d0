"""Hector: an IR and code generator for relational GNN layers (Hector, ASPLOS'24, in JAX).

Write a layer over graph domains with typed weights; jaxdata traces it to an IR, infers shapes,
differentiates it, lowers both directions to GEMM and traversal template instances, generates C++
and CUDA for each, compiles them at run time (cached on disk), and runs them through XLA FFI with a
custom VJP:

    from jaxdata import hector

    @hector.layer(x=hector.NODE, W=hector.RELATION_WEIGHT)
    def rgcn(g, x, W):
      return g.aggregate(g.norm * (g.src(x) @ W))

    graph = hector.GraphArrays.from_graph(hetero_graph)
    out = rgcn(graph, x=x, W=W)                # jit, grad and vmap work
    print(rgcn.plan(graph, x=x, W=W))          # the IR after every pass, and the kernels
    print(rgcn.sources(graph, "cuda", x=x, W=W))  # the generated source

`rgat_layer` is relational graph attention (per-head scores, edge softmax), `hgt_layer` HGT's
attention and messages (per-head relation matrices); every optimizing pass (`PASSES`:
linear-operator reordering, compact materialization) can be switched off with ``passes=``.
`partition` splits a graph by destination ranges into equal-shaped parts, one per device, for
full-graph training over several devices (`jaxdata.hector.partition`).
"""

from jaxdata.hector.compiled import SAVED_NAME, Layer, Plan
from jaxdata.hector.compiler import CompileError, CompilerNotFoundError, cache_dir
from jaxdata.hector.frontend import NODE, RELATION_VECTOR, RELATION_WEIGHT, layer
from jaxdata.hector.hgt import hgt_layer, hgt_message
from jaxdata.hector.partition import Partitions, partition
from jaxdata.hector.passes import PASSES
from jaxdata.hector.rgat import rgat_layer, rgat_message
from jaxdata.hector.rgcn import rgcn_featureless_layer, rgcn_layer, rgcn_message
from jaxdata.hector.runtime import GraphArrays

__all__ = [
  "SAVED_NAME",
  "NODE",
  "RELATION_WEIGHT",
  "RELATION_VECTOR",
  "PASSES",
  "layer",
  "Layer",
  "Plan",
  "GraphArrays",
  "Partitions",
  "partition",
  "rgcn_message",
  "rgcn_layer",
  "rgcn_featureless_layer",
  "rgat_message",
  "rgat_layer",
  "hgt_message",
  "hgt_layer",
  "CompileError",
  "CompilerNotFoundError",
  "cache_dir",
]
