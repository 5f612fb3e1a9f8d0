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

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdata.hector import GraphArrays, rgcn_message
from jaxdata.hector.precision import resolve as resolve_precision
from jaxdata.nn import _checks as checks


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
    precision: matmul precision of the relational products and the self loop, as `jnp.dot`'s
      (None: ``jax.default_matmul_precision``, TF32 tensor cores for float32 on a GPU;
      "highest": float32-exact; see `jaxdata.hector.precision`).
    rngs: parameter initialization.
  """

  def __init__(
    self,
    in_features: int | None,
    out_features: int,
    *,
    num_relations: int,
    num_nodes: int | None = None,
    num_bases: int | None = None,
    self_loop: bool | str = True,
    use_bias: bool = True,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    precision=None,
    rngs: nnx.Rngs,
  ):
    if in_features is None and num_nodes is None:
      raise ValueError("RGCN: featureless input (in_features=None) needs num_nodes")
    if in_features is not None:
      in_features = checks.size(in_features, "in_features", "RGCN")
    if num_nodes is not None:
      num_nodes = checks.size(num_nodes, "num_nodes", "RGCN")
    out_features = checks.size(out_features, "out_features", "RGCN")
    # 0 relations is a graph without edges: the layer is its self loop and bias
    num_relations = checks.size(num_relations, "num_relations", "RGCN", minimum=0)
    if num_bases is not None:
      num_bases = checks.size(num_bases, "num_bases", "RGCN")
    if self_loop not in (True, False, "separate", "basis"):
      raise ValueError(
        f"RGCN: self_loop must be True, False, 'separate' or 'basis', got {self_loop!r}"
      )
    if self_loop == "basis" and num_bases is None:
      raise ValueError("RGCN: self_loop='basis' combines W_0 from the bases: it needs num_bases")
    rows = num_nodes if in_features is None else in_features
    assert rows is not None  # one of them is given: checked above
    glorot = jax.nn.initializers.glorot_uniform(in_axis=-2, out_axis=-1, batch_axis=(0,))

    def init(key, shape, dtype):
      # Glorot's fans divide by the batch axis: no relations (or bases) have no weights to draw
      return jnp.zeros(shape, dtype) if shape[0] == 0 else glorot(key, shape, dtype)

    self.featureless = in_features is None
    self.in_features = in_features
    self.dtype = dtype
    resolve_precision(precision, "RGCN")  # checked now; resolved per call, as jnp.dot does
    self.precision = precision
    self.num_relations = num_relations
    self.self_loop_in_bases = self_loop == "basis"
    if num_bases is None:
      self.weight = nnx.Param(init(rngs.params(), (num_relations, rows, out_features), param_dtype))
      self.bases = self.coefficients = None
    else:
      self.weight = None
      self.bases = nnx.Param(init(rngs.params(), (num_bases, rows, out_features), param_dtype))
      shape = (num_relations + self.self_loop_in_bases, num_bases)
      self.coefficients = nnx.Param(
        jax.nn.initializers.glorot_uniform()(rngs.params(), shape, param_dtype)
        if shape[0]
        else jnp.zeros(shape, param_dtype)
      )
    separate = self_loop in (True, "separate")
    self.root = (
      nnx.Param(
        jax.nn.initializers.glorot_uniform()(rngs.params(), (rows, out_features), param_dtype)
      )
      if separate
      else None
    )
    self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype)) if use_bias else None

  def relation_weights(self) -> jax.Array:
    """``[R, rows, out]``: the per-relation weights (combined from the bases if decomposed)."""
    if self.weight is not None:
      return self.weight[...]
    assert self.coefficients is not None and self.bases is not None  # no weight: decomposed
    return jnp.einsum("rb,bio->rio", self.coefficients[...][: self.num_relations], self.bases[...])

  def self_loop_weight(self) -> jax.Array | None:
    """``[rows, out]``: ``W_0`` (the root weight, or combined from the bases), or None."""
    if self.self_loop_in_bases:
      assert self.coefficients is not None and self.bases is not None  # W_0 is in the bases
      return jnp.einsum("b,bio->io", self.coefficients[...][self.num_relations], self.bases[...])
    return None if self.root is None else self.root[...]

  # --- featureless input on sampled blocks: the per-node parameters as rows of a table ---------
  # With one-hot input every parameter with a row per node (each basis V_b or relation weight
  # W_r, and a separate W_0) holds node n's part of the layer in its row n. Laid side by side,
  # they make one [num_nodes, row_width] table: a mini-batch reads the rows of its sampled nodes
  # (a HostTable when the table is too large for the device) and trains them sparsely.

  def _row_params(self) -> list[nnx.Param]:
    if not self.featureless:
      raise ValueError("RGCN: node rows exist only for featureless input (in_features=None)")
    table = self.weight if self.bases is None else self.bases
    assert table is not None  # the relation weights, or the bases they are combined from
    return [table] + ([self.root] if self.root is not None else [])

  @property
  def row_width(self) -> int:
    """Columns of `node_rows()`: K * out (+ out with a separate self-loop weight), K the bases
    or the relations."""
    return sum(p.shape[0] * p.shape[-1] if p.ndim == 3 else p.shape[-1] for p in self._row_params())

  def node_rows(self) -> jax.Array:
    """``[num_nodes, row_width]``: row n holds every per-node parameter's row n (each basis or
    relation weight in order, then the separate self-loop weight)."""
    parts = [
      p[...].transpose(1, 0, 2).reshape(p.shape[1], -1) if p.ndim == 3 else p[...]
      for p in self._row_params()
    ]
    return jnp.concatenate(parts, axis=1)

  def set_node_rows(self, rows: jax.Array) -> None:
    """The inverse of `node_rows`: writes a ``[num_nodes, row_width]`` array into the
    parameters (after mini-batch training kept them in a table)."""
    rows = jnp.asarray(rows)
    params, start = self._row_params(), 0
    want = (params[0].shape[1], self.row_width)
    if rows.shape != want:
      raise ValueError(f"RGCN.set_node_rows: rows must have shape {want}, got {rows.shape}")
    for p in params:
      if p.ndim == 3:
        k, n, o = p.shape
        p[...] = rows[:, start : start + k * o].reshape(n, k, o).transpose(1, 0, 2).astype(p.dtype)
        start += k * o
      else:
        p[...] = rows[:, start : start + p.shape[-1]].astype(p.dtype)
        start += p.shape[-1]

  def on_rows(self, graph: GraphArrays, rows: jax.Array) -> jax.Array:
    """The featureless layer on a graph whose node i is global node n_i, given ``rows[i] =
    node_rows()[n_i]``: equal to `__call__` on the whole graph at those nodes, when the graph
    holds their in-edges. A sampled block's slots are such nodes (`jaxdata.loader.sample_blocks`).
    Gradients reach `rows` (to train a table of rows sparsely) and the coefficients.
    """
    checks.graph(graph, "RGCN.on_rows")
    checks.relations(graph, self.num_relations, "RGCN.on_rows")
    s = graph.num_nodes
    rows = checks.rows(rows, "rows", "RGCN.on_rows", s, self.row_width, "row_width")
    first = self._row_params()[0]
    k, o = first.shape[0], first.shape[-1]
    per = rows[:, : k * o].reshape(s, k, o).astype(first.dtype)  # [S, K, out]
    if self.bases is None:
      # Node j's message through relation r is W_r[j]: the rows, transposed, are the one-hot
      # layer's weight over the graph's nodes.
      h = rgcn_message(
        graph, None, per.transpose(1, 0, 2).astype(self.dtype), precision=self.precision
      )
      w0 = rows[:, k * o :] if self.root is not None else None
    else:
      # Through relation r: sum_b a_rb V_b[j], row j times a [B * out, out] weight holding
      # a_rb * I: one hector GEMM per unique (source, relation) pair, where combining the
      # bases per slot would make an [R, S, out] array (R / B times the rows).
      assert self.coefficients is not None  # this branch: decomposed into bases
      a = self.coefficients[...]
      w = jnp.einsum("rb,io->rbio", a[: self.num_relations], jnp.eye(o, dtype=first.dtype))
      h = rgcn_message(
        graph,
        rows[:, : k * o].astype(self.dtype),
        w.reshape(self.num_relations, k * o, o).astype(self.dtype),
        precision=self.precision,
      )
      w0 = (
        jnp.einsum("b,sbo->so", a[self.num_relations], per)
        if self.self_loop_in_bases
        else rows[:, k * o :]
        if self.root is not None
        else None
      )
    if w0 is not None:
      h = h + w0.astype(self.dtype)
    if self.bias is not None:
      h = h + self.bias[...].astype(self.dtype)
    return h

  # --- a destination partition (jaxdata.hector.partition) -------------------------------------

  def on_partition(self, graph: GraphArrays, x: jax.Array | None, start, rows: int) -> jax.Array:
    """Rows ``start:start + rows`` of this layer on the whole graph, computed on a destination
    part (`jaxdata.hector.partition`) that holds every in-edge of those rows.

    Args:
      graph: the part's graph, over the padded node space (``graph.num_nodes >= N + 1``).
      x: every node's input, ``[graph.num_nodes, in_features]`` (the parts' outputs gathered;
        padding rows anything finite), or None for featureless input.
      start: the first owned row (an int, or a traced int inside `shard_map`).
      rows: the number of owned rows (static).

    Returns:
      ``[rows, out_features]``: equal to ``self(whole_graph, x)[start:start + rows]`` for the
      real rows. Only the owned rows get the self loop: the rest of the part's output is zero.
    """
    x = self._inputs(graph, x, "RGCN.on_partition")
    n = graph.num_nodes
    w = self.relation_weights().astype(self.dtype)
    w0 = self.self_loop_weight()
    if x is None:
      real = w.shape[1]
      if real >= n:
        raise ValueError(
          f"RGCN.on_partition: the part's graph has {n} nodes, fewer than the "
          f"layer's {real} plus a padding node"
        )
      # One-hot input: the padding rows' (never-read) parameters are zeros.
      w = jnp.pad(w, ((0, 0), (0, n - real), (0, 0)))
      h = rgcn_message(graph, None, w)
      if w0 is not None:
        w0 = jnp.pad(w0.astype(self.dtype), ((0, n - real), (0, 0)))
        h_self = jax.lax.dynamic_slice_in_dim(w0, start, rows)
    else:
      x = x.astype(self.dtype)
      h = rgcn_message(graph, x, w)
      if w0 is not None:
        h_self = jax.lax.dynamic_slice_in_dim(x, start, rows) @ w0.astype(self.dtype)
    h = jax.lax.dynamic_slice_in_dim(h, start, rows)
    if w0 is not None:
      h = h + h_self
    if self.bias is not None:
      h = h + self.bias[...].astype(self.dtype)
    return h

  def _inputs(self, graph: Any, x: Any, who: str) -> jax.Array | None:
    """The graph and `x` checked against the layer: its relations, x ``[num_nodes, in]``."""
    checks.graph(graph, who)
    checks.relations(graph, self.num_relations, who)
    if self.featureless != (x is None):
      raise ValueError(f"{who}: pass x exactly when the layer was built with in_features")
    if x is None:
      return None
    return checks.rows(x, "x", who, graph.num_nodes, self.in_features)

  def __call__(self, graph: GraphArrays, x: Any = None) -> Any:
    """x: ``[num_nodes, in_features]``, or ``{node type: [N_t, in_features]}`` on a graph that
    names its node types (then the result is a dict too)."""
    if isinstance(x, Mapping):
      checks.graph(graph, "RGCN")
      h = self(graph, checks.concat_by_type(graph, x, "RGCN", self.in_features))
      return checks.split_by_type(graph, h)
    x = self._inputs(graph, x, "RGCN")
    w = self.relation_weights().astype(self.dtype)
    h = rgcn_message(
      graph, None if x is None else x.astype(self.dtype), w, precision=self.precision
    )
    w0 = self.self_loop_weight()
    if w0 is not None:
      root = w0.astype(self.dtype)
      h = h + (root if x is None else jnp.dot(x.astype(self.dtype), root, precision=self.precision))
    if self.bias is not None:
      h = h + self.bias[...].astype(self.dtype)
    return h
