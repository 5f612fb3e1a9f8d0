"""Flax NNX relational graph convolution (Schlichtkrull et al., 2018) on hector's kernels.

    h'_i = W_0 h_i + b + sum_r sum_{j in N_r(i)} (1 / |N_r(i)|) W_r h_j

The relational sum runs as generated kernels (`jaxdata.hector.rgcn_message`); the self loop and
bias are dense XLA ops. Without input features (``in_features=None``, the paper's setup on RDF
graphs) a node's input is its one-hot id, so ``W_r`` has a row per node and ``W_0 h_i`` is row i
of the self-loop weight. Basis decomposition, ``W_r = sum_b a_rb V_b``, shares parameters across
relations (``num_bases``); with ``self_loop="basis"`` the self loop is one more such combination,
``W_0 = sum_b a_0b V_b``, as in the RGCN authors' code (tkipf/relational-gcn appends the identity
matrix to the relations' adjacency matrices, so the self loop shares the bases and has no weight of
its own).

    layer = RGCN(16, 4, num_relations=graph.num_relations, rngs=nnx.Rngs(0))
    out = layer(graph_arrays, x)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdata.hector import GraphArrays, rgcn_message


class RGCN(nnx.Module):
  """One RGCN layer.

  Args:
    in_features: input feature size, or None for featureless input (one-hot node ids; then
      `num_nodes` is required).
    out_features: output feature size.
    num_relations: relations in the graph (inverse relations count separately).
    num_nodes: nodes in the graph (featureless input only).
    num_bases: basis decomposition with this many bases; None for a full weight per relation.
    self_loop: add ``W_0 h_i``: True (or "separate") with a full weight ``W_0`` of its own,
      "basis" with ``W_0`` combined from the bases like a relation's (needs `num_bases`; the
      coefficients then have a last row for the self loop), False for none.
    use_bias: add a bias.
    dtype: computation dtype (float32 or bfloat16); parameters stay in `param_dtype`.
    rngs: parameter initialization.
  """

  def __init__(self, in_features: int | None, out_features: int, *, num_relations: int,
               num_nodes: int | None = None, num_bases: int | None = None,
               self_loop: bool | str = True, use_bias: bool = True, dtype=jnp.float32,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    if in_features is None and num_nodes is None:
      raise ValueError("RGCN: featureless input (in_features=None) needs num_nodes")
    if num_bases is not None and num_bases < 1:
      raise ValueError(f"RGCN: num_bases must be >= 1 or None, got {num_bases}")
    if self_loop not in (True, False, "separate", "basis"):
      raise ValueError(f"RGCN: self_loop must be True, False, 'separate' or 'basis', got "
                       f"{self_loop!r}")
    if self_loop == "basis" and num_bases is None:
      raise ValueError("RGCN: self_loop='basis' combines W_0 from the bases: it needs num_bases")
    rows = num_nodes if in_features is None else in_features
    init = jax.nn.initializers.glorot_uniform(in_axis=-2, out_axis=-1, batch_axis=(0,))
    self.featureless = in_features is None
    self.dtype = dtype
    self.num_relations = num_relations
    self.self_loop_in_bases = self_loop == "basis"
    if num_bases is None:
      self.weight = nnx.Param(init(rngs.params(), (num_relations, rows, out_features),
                                   param_dtype))
      self.bases = self.coefficients = None
    else:
      self.weight = None
      self.bases = nnx.Param(init(rngs.params(), (num_bases, rows, out_features), param_dtype))
      self.coefficients = nnx.Param(
          jax.nn.initializers.glorot_uniform()(
              rngs.params(), (num_relations + self.self_loop_in_bases, num_bases), param_dtype))
    separate = self_loop in (True, "separate")
    self.root = nnx.Param(jax.nn.initializers.glorot_uniform()(
        rngs.params(), (rows, out_features), param_dtype)) if separate else None
    self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype)) if use_bias else None

  def relation_weights(self) -> jax.Array:
    """``[R, rows, out]``: the per-relation weights (combined from the bases if decomposed)."""
    if self.weight is not None:
      return self.weight[...]
    return jnp.einsum("rb,bio->rio", self.coefficients[...][:self.num_relations], self.bases[...])

  def self_loop_weight(self) -> jax.Array | None:
    """``[rows, out]``: ``W_0`` (the root weight, or combined from the bases), or None."""
    if self.self_loop_in_bases:
      return jnp.einsum("b,bio->io", self.coefficients[...][self.num_relations], self.bases[...])
    return None if self.root is None else self.root[...]

  def __call__(self, graph: GraphArrays, x: jax.Array | None = None) -> jax.Array:
    if self.featureless != (x is None):
      raise ValueError("RGCN: pass x exactly when the layer was built with in_features")
    w = self.relation_weights().astype(self.dtype)
    h = rgcn_message(graph, None if x is None else x.astype(self.dtype), w)
    w0 = self.self_loop_weight()
    if w0 is not None:
      root = w0.astype(self.dtype)
      h = h + (root if x is None else x.astype(self.dtype) @ root)
    if self.bias is not None:
      h = h + self.bias[...].astype(self.dtype)
    return h
