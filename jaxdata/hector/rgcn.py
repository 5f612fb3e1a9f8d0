"""RGCN's relational message passing, written in the hector front end.

    out[i] = sum over edges e into i of  norm[e] * (x[src[e]] @ W[etype[e]])

and, without input features (the RGCN paper's first layer on RDF graphs, one-hot node ids):

    out[i] = sum over edges e into i of  norm[e] * W[etype[e], src[e]]

The forward pass lowers to one GEMM instance (gathered rows in, per-relation weight, normalizer
in the epilogue, rows scattered to destinations) or one traversal instance (featureless); the
backward pass, derived from the IR, to a transposed GEMM scattering to sources plus a
weight-gradient GEMM (or a traversal summing into weight rows). On a graph with many edges per
(source, relation) pair (`hector.passes.compacts_fused_products`: hub sources) the GEMMs run once
per pair instead, and edge loops sum the pairs' rows into destinations (forward) and the
cotangents into pairs (backward).
"""

from __future__ import annotations

import jax

from jaxdata.hector.frontend import NODE, RELATION_WEIGHT, layer
from jaxdata.hector.runtime import GraphArrays


@layer(x=NODE, W=RELATION_WEIGHT)
def rgcn_layer(g, x, W):
  return g.aggregate(g.norm * (g.src(x) @ W))


@layer(W=RELATION_WEIGHT)
def rgcn_featureless_layer(g, W):
  return g.aggregate(g.norm * g.weight_row(W))


def rgcn_message(
  graph: GraphArrays, x: jax.Array | None, weight: jax.Array, *, precision=None
) -> jax.Array:
  """The relational part of an RGCN layer (no self loop, no bias) with generated kernels.

  Args:
    graph: the graph's device arrays (`GraphArrays.from_graph(hetero_graph)`).
    x: node features ``[N, d_in]`` (float32 or bfloat16), or None for one-hot node ids.
    weight: ``[R, d_in, d_out]``, or ``[R, N, d_out]`` when `x` is None.
    precision: the products' matmul precision, as `jnp.dot`'s (None:
      ``jax.default_matmul_precision``; `jaxdata.hector.precision`): by default TF32 tensor
      cores for float32 on a GPU, "highest" float32-exact.

  Returns:
    ``[N, d_out]`` in the inputs' dtype (sums accumulate in float32).
  """
  if x is None:
    return rgcn_featureless_layer(graph, precision=precision, W=weight)
  return rgcn_layer(graph, precision=precision, x=x, W=weight)
