"""HGT's heterogeneous mutual attention and message passing, written in the hector front end.

The edge part of an HGT layer (Hu et al., 2020, as PyG's `HGTConv` computes it). For an edge
e = (j -> i) of relation r, with H heads of d_k features, K, Q, V the nodes' key, query and value
rows (each node's type's projection, computed outside: node-level dense work):

    key[e]_h   = K[j]_h @ W_att[r, h]                              [d_k] per head
    score[e,h] = key[e]_h . Q[i]_h * mu[r, h] / sqrt(d_k)
    alpha[e,h] = softmax of score[., h] over all edges into i (across relations)
    out[i]     = concat_h sum over edges e into i of alpha[e,h] * (V[j]_h @ W_msg[r, h])

`W_att` and `W_msg` are per-head relation weights ``[R, H, d_k, d_k]``: the GEMM template runs
them head by head (``H * d_k * d_k`` multiply-adds per row, not the ``(H * d_k)^2`` of a
block-diagonal ``[R, H*d_k, H*d_k]`` weight). The prior ``mu`` enters as a relation vector
``[R, H, 1]`` already divided by ``sqrt(d_k)`` (`hgt_message` does that on XLA).

With every pass on, the forward pass lowers to: ``W_att[r, h] * mu[r, h]`` folded on XLA
(linear-operator reordering: no multiply per edge and head), two per-head GEMMs over the unique
(source, relation) pairs for ``K W_att`` and ``V W_msg`` (compact materialization: both depend
only on (j, r)), a softmax traversal grouped by destination that computes the scores on the fly
from the pair rows and ``Q[dst]``, and a traversal summing ``alpha * (V W_msg)[pair[e]]`` into
destinations. Print ``hgt_layer.plan(graph, k=..., q=..., v=..., W_att=..., W_msg=..., mu=...)``
to see it.

Where ``W_att`` goes: ``(K[j] W_att) . Q[i]`` and ``K[j] . (Q[i] W_att^T)`` cost the same
``H * d_k * d_k`` per edge, but only the first depends on (source, relation) alone, so only it
is shared by compaction (a GEMM over P unique pairs instead of E edges). The reordering pass
therefore keeps the product on the source side, and moves it there when a layer is written the
other way round.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxdata.hector.frontend import NODE, RELATION_VECTOR, RELATION_WEIGHT, layer
from jaxdata.hector.runtime import GraphArrays


@layer(k=NODE, q=NODE, v=NODE, W_att=RELATION_WEIGHT, W_msg=RELATION_WEIGHT, mu=RELATION_VECTOR)
def hgt_layer(g, k, q, v, W_att, W_msg, mu):
  key = g.src(k) @ W_att  # [E, H*d_k], head by head
  score = key.dot(g.dst(q), heads=W_att) * g.vector_row(mu)  # [E, H]
  alpha = g.edge_softmax(score, at="dst")  # [E, H]
  return g.aggregate(alpha * (g.src(v) @ W_msg))  # [N, H*d_k]


def hgt_message(
  graph: GraphArrays,
  k: jax.Array,
  q: jax.Array,
  v: jax.Array,
  w_att: jax.Array,
  w_msg: jax.Array,
  mu: jax.Array,
  *,
  passes=None,
  precision=None,
) -> jax.Array:
  """The edge part of an HGT layer (attention and messages, summed) with generated kernels.

  Args:
    graph: the graph's device arrays (`GraphArrays.from_graph(hetero_graph)`); node ids are
      global (every type's nodes, types concatenated in id order).
    k, q, v: every node's key, query and value rows ``[N, H * d_k]`` (its type's projections).
    w_att, w_msg: per-relation, per-head attention and message matrices ``[R, H, d_k, d_k]``.
    mu: the prior ``[R, H]`` (PyG's ``p_rel``).
    passes: the optimizing passes to run (names from `hector.PASSES`; None: all).
    precision: the GEMMs' matmul precision, as `jnp.dot`'s (None:
      ``jax.default_matmul_precision``; `jaxdata.hector.precision`).

  Returns:
    ``[N, H * d_k]`` in the inputs' dtype (sums accumulate in float32); nodes without incoming
    edges get zeros. Before PyG's output projection: `jaxdata.nn.HGT` adds the per-type
    projections, the GELU and the skip gate.
  """
  r, heads, d_k, d_k2 = jnp.shape(w_att)
  n = jnp.shape(k)[0]
  if d_k != d_k2 or jnp.shape(w_msg) != (r, heads, d_k, d_k):
    raise ValueError(
      f"hgt_message: w_att and w_msg must both be [R, H, d_k, d_k], got "
      f"{jnp.shape(w_att)} and {jnp.shape(w_msg)}"
    )
  for name, x in (("k", k), ("q", q), ("v", v)):
    if jnp.shape(x) != (n, heads * d_k):
      raise ValueError(
        f"hgt_message: {name} must be [N, H * d_k] = [{n}, {heads * d_k}], got {jnp.shape(x)}"
      )
  if jnp.shape(mu) != (r, heads):
    raise ValueError(f"hgt_message: mu must be [R, H] = [{r}, {heads}], got {jnp.shape(mu)}")
  scaled = (mu.astype(jnp.float32) / math.sqrt(d_k)).astype(jnp.result_type(k))[..., None]
  return hgt_layer(graph, passes, precision, k=k, q=q, v=v, W_att=w_att, W_msg=w_msg, mu=scaled)
