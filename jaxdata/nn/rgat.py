"""Flax NNX relational graph attention (RGAT; Busbridge et al., 2019) on hector's kernels.

For an edge e = (j -> i) of relation r, H heads of d features:

    h_e        = x_j W_r                                              [H * d]
    score[e,h] = leaky_relu(a_src[r,h] . h_e[h] + a_dst[r,h] . (x_i W_r)[h], 0.2)
    alpha      = softmax of score over the edges into i (all relations), per head
    out_i      = concat_h sum_e alpha[e,h] h_e[h]  (+ x_i W_0) (+ b)

The attention runs as generated kernels (`jaxdata.hector.rgat_message`: compact
materialization of ``x_j W_r`` per unique (source, relation), the destination term reordered to
``x_i (W_r a_dst[r])``); the self loop and bias are dense XLA ops. With ``concat=False`` the
heads are averaged instead (an output layer's usual choice).

    layer = RGAT(64, 16, num_relations=graph.num_relations, heads=4, rngs=nnx.Rngs(0))
    out = layer(graph_arrays, x)          # [N, 64]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxdata.hector import GraphArrays, rgat_message
from jaxdata.hector.passes import select as select_passes
from jaxdata.hector.precision import resolve as resolve_precision
from jaxdata.nn import _checks as checks

#: The checkpoint names `RGAT.__call__` tags its intermediates with (remat policies name what to
#: keep): the attention's aggregated messages ``[N, heads * out_features]``. The edge kernels'
#: own residuals are `jaxdata.hector.SAVED_NAME`.
NAMES = ("rgat_msg",)


class RGAT(nnx.Module):
  """One RGAT layer: per-relation weights and attention vectors, several heads.

  Args:
    in_features: input feature size.
    out_features: features per head.
    num_relations: relations in the graph (inverse relations count separately).
    heads: attention heads.
    concat: concatenate the heads (``[N, heads * out_features]``) or average them
      (``[N, out_features]``).
    self_loop: add ``x_i W_0`` (a node's own row; attention sees only its in-edges).
    use_bias: add a bias.
    passes: hector's optimizing passes (names from `jaxdata.hector.PASSES`; None: all).
    dtype: computation dtype (float32 or bfloat16); parameters stay in `param_dtype`.
    precision: matmul precision of the relational products and the self loop, as `jnp.dot`'s
      (None: ``jax.default_matmul_precision``; see `jaxdata.hector.precision`).
    rngs: parameter initialization.
  """

  def __init__(
    self,
    in_features: int,
    out_features: int,
    *,
    num_relations: int,
    heads: int = 1,
    concat: bool = True,
    self_loop: bool = False,
    use_bias: bool = True,
    passes=None,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    precision=None,
    rngs: nnx.Rngs,
  ):
    in_features = checks.size(in_features, "in_features", "RGAT")
    out_features = checks.size(out_features, "out_features", "RGAT")
    num_relations = checks.size(num_relations, "num_relations", "RGAT")
    heads = checks.size(heads, "heads", "RGAT")
    f = heads * out_features
    glorot = jax.nn.initializers.glorot_uniform(in_axis=-2, out_axis=-1, batch_axis=(0,))
    vector = jax.nn.initializers.glorot_uniform(in_axis=-1, out_axis=-2, batch_axis=(0,))
    self.weight = nnx.Param(glorot(rngs.params(), (num_relations, in_features, f), param_dtype))
    self.a_src = nnx.Param(vector(rngs.params(), (num_relations, heads, out_features), param_dtype))
    self.a_dst = nnx.Param(vector(rngs.params(), (num_relations, heads, out_features), param_dtype))
    self.root = (
      nnx.Param(jax.nn.initializers.glorot_uniform()(rngs.params(), (in_features, f), param_dtype))
      if self_loop
      else None
    )
    width = f if concat else out_features
    self.bias = nnx.Param(jnp.zeros((width,), param_dtype)) if use_bias else None
    self.heads, self.concat, self.dtype = heads, concat, dtype
    self.in_features, self.out_features, self.num_relations = (
      in_features,
      out_features,
      num_relations,
    )
    self.passes = select_passes(passes)
    resolve_precision(precision, "RGAT")  # checked now; resolved per call, as jnp.dot does
    self.precision = precision

  def on_partition(self, graph: GraphArrays, x: jax.Array, start, rows: int) -> jax.Array:
    """Rows ``start:start + rows`` of this layer on the whole graph, computed on a destination
    part (`jaxdata.hector.partition`) that holds every in-edge of those rows. `x` is every
    node's input, ``[graph.num_nodes, in_features]`` (the parts' rows gathered; padding rows
    anything finite); `start` may be traced, `rows` is static. Attention needs only the edges
    into a node, so the part's softmax equals the whole graph's."""
    x = self._inputs(graph, x, "RGAT.on_partition").astype(self.dtype)
    cast = lambda p: p[...].astype(self.dtype)  # noqa: E731
    h = rgat_message(
      graph,
      x,
      cast(self.weight),
      cast(self.a_src),
      cast(self.a_dst),
      passes=self.passes,
      precision=self.precision,
    )
    h = jax.lax.dynamic_slice_in_dim(h, start, rows)
    if self.root is not None:
      h = h + jnp.dot(
        jax.lax.dynamic_slice_in_dim(x, start, rows), cast(self.root), precision=self.precision
      )
    if not self.concat:
      h = h.reshape(h.shape[0], self.heads, self.out_features).mean(axis=1)
    if self.bias is not None:
      h = h + cast(self.bias)
    return h

  def _inputs(self, graph: Any, x: Any, who: str) -> jax.Array:
    """The graph and `x` checked against the layer: its relations, x ``[num_nodes, in]``."""
    checks.graph(graph, who)
    checks.relations(graph, self.num_relations, who)
    return checks.rows(x, "x", who, graph.num_nodes, self.in_features)

  def __call__(self, graph: GraphArrays, x: Any) -> Any:
    """x: ``[num_nodes, in_features]``, or ``{node type: [N_t, in_features]}`` on a graph that
    names its node types (then the result is a dict too)."""
    if isinstance(x, Mapping):
      checks.graph(graph, "RGAT")
      return checks.split_by_type(
        graph, self(graph, checks.concat_by_type(graph, x, "RGAT", self.in_features))
      )
    x = self._inputs(graph, x, "RGAT").astype(self.dtype)
    cast = lambda p: p[...].astype(self.dtype)  # noqa: E731
    h = checkpoint_name(
      rgat_message(
        graph,
        x,
        cast(self.weight),
        cast(self.a_src),
        cast(self.a_dst),
        passes=self.passes,
        precision=self.precision,
      ),
      NAMES[0],
    )
    if self.root is not None:
      h = h + jnp.dot(x, cast(self.root), precision=self.precision)
    if not self.concat:
      h = h.reshape(h.shape[0], self.heads, self.out_features).mean(axis=1)
    if self.bias is not None:
      h = h + cast(self.bias)
    return h
