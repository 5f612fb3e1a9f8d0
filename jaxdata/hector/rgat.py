"""RGAT's relational graph attention, written in the hector front end.

For an edge e = (j -> i) of relation r, with H heads of d features:

    h[e]       = x[j] @ W[r]                                    [H * d], heads concatenated
    score[e,h] = leaky_relu(a_src[r,h] . h[e]_h + a_dst[r,h] . (x[i] @ W[r])_h, slope 0.2)
    alpha[e,h] = softmax of score[., h] over all edges into i (across relations)
    out[i]     = sum over edges e into i of alpha[e,h] * h[e]_h  [N, H * d]

With every pass on, the forward pass lowers to: a GEMM over the unique (source, relation) pairs
for ``h`` (compact materialization: ``h`` depends only on (j, r)), a traversal over the pairs for
the source scores, the weight-vector product ``W[r] a_dst[r]`` folded on XLA and one GEMM of
``H`` columns for the destination scores (linear-operator reordering: no ``[E, H * d]``
intermediate), a softmax traversal grouped by destination that computes the scores on the fly,
and a traversal summing ``alpha * h[pair[e]]`` into destinations. Print
``rgat_layer.plan(graph, x=..., W=..., a_src=..., a_dst=...)`` to see it.
"""

from __future__ import annotations

import jax

from jaxdata.hector.frontend import NODE, RELATION_VECTOR, RELATION_WEIGHT, layer
from jaxdata.hector.runtime import GraphArrays

NEGATIVE_SLOPE = 0.2


@layer(x=NODE, W=RELATION_WEIGHT, a_src=RELATION_VECTOR, a_dst=RELATION_VECTOR)
def rgat_layer(g, x, W, a_src, a_dst):
  h = g.src(x) @ W  # [E, H*d]
  score = (h.dot(a_src) + (g.dst(x) @ W).dot(a_dst)).leaky_relu(NEGATIVE_SLOPE)  # [E, H]
  alpha = g.edge_softmax(score, at="dst")  # [E, H]
  return g.aggregate(alpha * h)  # [N, H*d]


def rgat_message(
  graph: GraphArrays,
  x: jax.Array,
  weight: jax.Array,
  a_src: jax.Array,
  a_dst: jax.Array,
  *,
  passes=None,
  precision=None,
) -> jax.Array:
  """The relational attention of an RGAT layer (no self loop, no bias) with generated kernels.

  Args:
    graph: the graph's device arrays (`GraphArrays.from_graph(hetero_graph)`).
    x: node features ``[N, d_in]`` (float32 or bfloat16).
    weight: ``[R, d_in, H * d_out]``.
    a_src, a_dst: attention vectors ``[R, H, d_out]`` for the source and destination terms.
    passes: the optimizing passes to run (names from `hector.PASSES`; None: all).
    precision: the GEMMs' matmul precision, as `jnp.dot`'s (None:
      ``jax.default_matmul_precision``; `jaxdata.hector.precision`).

  Returns:
    ``[N, H * d_out]`` in the inputs' dtype (sums accumulate in float32); nodes without incoming
    edges get zeros.
  """
  return rgat_layer(graph, passes, precision, x=x, W=weight, a_src=a_src, a_dst=a_dst)
