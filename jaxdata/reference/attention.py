"""Reference formulations of one RGAT layer and one HGT layer (plain JAX, and PyG's from the same
weights): ground truth for tests, peers for benchmarks.

Edges e = (src[e] -> dst[e]) carry a relation etype[e] in [0, R); nodes are numbered globally.
softmax_i below is a softmax over all edges into node i, across relations, per head; a node
without in-edges aggregates nothing (zeros).

RGAT (relational graph attention as in Hector and DGL; one layer, H heads, concatenated):

    x: [N, d_in]   W: [R, d_in, H*d]   a_src, a_dst: [R, H, d]
    h_e      = (x[src[e]] @ W[r]).reshape(H, d)                          r = etype[e], i = dst[e]
    score[e, h] = leaky_relu(a_src[r, h] . h_e[h] + a_dst[r, h] . (x[i] @ W[r]).reshape(H, d)[h],
                             negative_slope=0.2)
    alpha[e, h] = softmax_i(score[:, h])[e]
    out[i]   = concat_h sum_{e: dst[e] = i} alpha[e, h] * h_e[h]          -> [N, H*d]

  Note the destination is transformed by the weight of the edge's relation, not by a node-type
  weight. PyG's `RGATConv` (attention_mode="additive-self-attention",
  attention_mechanism="across-relation", dim=1) computes the same thing except that its
  attention vectors come from matrices q, k: [H*d, H] shared by all relations, which may mix
  heads: score[e, h] = leaky_relu((x[i] @ W[r]) . q[:, h] + h_e . k[:, h]). The two coincide
  when H = 1 or when q and k are head-block-diagonal; then a_dst[r, h] = q[h*d:(h+1)*d, h] and
  a_src[r, h] = k[h*d:(h+1)*d, h] for every r (`jaxdata.reference.pyg.rgat_params_from_pyg`).

HGT (heterogeneous graph transformer, as PyG's `HGTConv` computes it; one layer, H heads):

    node types t = 0..T-1; type t owns the ids [offsets[t], offsets[t+1]), offsets from the
    per-type feature arrays xs[t]: [N_t, d_t] (`check_node_types` compares them with a
    HeteroGraph's node_type_offsets); tau(v) is the type of node v
    K_t, Q_t, V_t: d_t -> H*d_k linear with bias; A_t: H*d_k -> d_out linear with bias
    W_att, W_msg: [R, H, d_k, d_k]   mu: [R, H]   skip: [T]
    k_e[h] = (K_{tau(j)} x_j)[h] @ W_att[r, h]                          j = src[e], r = etype[e]
    score[e, h] = (k_e[h] . (Q_{tau(i)} x_i)[h]) * mu[r, h] / sqrt(d_k)     i = dst[e]
    m_e[h] = (V_{tau(j)} x_j)[h] @ W_msg[r, h]
    agg[i] = concat_h sum_{e: dst[e] = i} softmax_i(score[:, h])[e] * m_e[h]      -> [N, H*d_k]
    y_i    = A_{tau(i)}(gelu(agg[i]))        gelu exact (erf), as torch's default, not tanh
    out_i  = sigmoid(skip[t]) * y_i + (1 - sigmoid(skip[t])) * x_i   if d_out == d_t, else y_i

  (row vectors times matrices throughout; (.)[h] is head h's slice of d_k features). This is
  PyG 2.8's HGTConv: the prior mu multiplies the score, the skip mixes the *output* of A with the
  input, there is no dropout and no gelu after the skip. Differences: PyG needs
  d_out == H*d_k, and it returns no output for node types that are the destination of no
  relation (here they get A_t(gelu(0)), skip-mixed); nodes of a destination type that receive no
  edge get the same in both.

Formulations (each `fn(src, dst, etype, x or xs, params, *, precision=None)`, jit-able and
differentiable in x and params; ragged_dot needs edges sorted by relation, `Edges.build` sorts):

  transform-all-then-gather  every node through every relation's weights ([R, N, ...]), then one
                             gather per edge; O(R N F) memory, no per-edge matmul
  ragged_dot                 per-edge rows grouped by relation, `jax.lax.ragged_dot` (per head);
                             O(E F) memory (XLA's GPU lowering may expand it to [R, E, F])
  per-edge weights           W[etype] gathered per edge ([E, d_in, F]): memory-hungry on purpose

RGAT folds the attention vectors into the weights, (x @ W_r) . a_r = x . (W_r a_r): the scores
cost a [.., d_in] x [d_in, H] product, not a pass over [.., H*d] rows.

Dtypes: float32, bfloat16 or float64 inputs. Matmuls accumulate in at least float32
(`preferred_element_type`); messages are stored in the input dtype; scores, the softmax and the
weighted sums over edges are computed in at least float32; outputs have the input dtype.

    >>> edges = Edges.build(src, dst, etype, num_nodes=n, num_relations=r)
    >>> params = init_rgat(0, num_relations=r, in_features=16, head_features=8, heads=4)
    >>> out = jax.jit(RGAT["ragged_dot"])(*edges, x, params)          # [n, 32]
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxdata.reference.rgcn import checked_edges

#: RGAT's leaky-ReLU slope (GAT's, DGL's and PyG's default).
NEGATIVE_SLOPE = 0.2


# ------------------------------------------------------------------------------------------------
# Edges and the edge softmax


class Edges(NamedTuple):
  """(src, dst, etype) as int32 device arrays, edges sorted by relation (stably); a pytree."""

  src: jax.Array
  dst: jax.Array
  etype: jax.Array

  @classmethod
  def build(cls, src, dst, etype, *, num_nodes: int, num_relations: int, device=None) -> Edges:
    """Checks ranges and lengths (ValueError), sorts by relation."""
    src, dst, etype = checked_edges(src, dst, etype, num_nodes, num_relations)
    order = np.argsort(etype, kind="stable")
    put = functools.partial(jax.device_put, device=device)
    return cls(put(src[order]), put(dst[order]), put(etype[order]))

  @classmethod
  def from_graph(cls, graph, device=None) -> Edges:
    """The edges of a `jaxdata.data.HeteroGraph` (already sorted by relation)."""
    return cls.build(
      graph.src,
      graph.dst,
      graph.etype,
      num_nodes=graph.num_nodes,
      num_relations=graph.num_relations,
      device=device,
    )


def _acc(dtype) -> jnp.dtype:
  """The accumulation dtype: float32, or float64 for float64 inputs."""
  return jnp.promote_types(dtype, jnp.float32)


def edge_softmax(scores: jax.Array, dst: jax.Array, num_nodes: int) -> jax.Array:
  """softmax of scores [E, H] over the edges into each node, per head (max subtracted).

  Computed in at least float32. The per-node maximum is a constant to the gradient (the softmax
  does not depend on it); nodes without in-edges have a maximum of -inf that no edge reads.
  """
  scores = scores.astype(_acc(scores.dtype))
  top = jax.lax.stop_gradient(jax.ops.segment_max(scores, dst, num_segments=num_nodes))
  weights = jnp.exp(scores - top[dst])
  total = jax.ops.segment_sum(weights, dst, num_segments=num_nodes)
  return weights / total[dst]


def _aggregate(
  alpha: jax.Array, messages: jax.Array, dst: jax.Array, num_nodes: int, dtype
) -> jax.Array:
  """sum_{e: dst[e] = i} alpha[e, h] * messages[e, h, :] -> [N, H*d] in `dtype`."""
  weighted = alpha[:, :, None] * messages.astype(alpha.dtype)
  out = jax.ops.segment_sum(weighted, dst, num_segments=num_nodes)
  return out.reshape(num_nodes, messages.shape[1] * messages.shape[2]).astype(dtype)


def _group_sizes(etype: jax.Array, num_relations: int) -> jax.Array:
  return jnp.bincount(etype, length=num_relations).astype(jnp.int32)


# ------------------------------------------------------------------------------------------------
# RGAT


class RGATParams(NamedTuple):
  """One RGAT layer's weights (a pytree).

  w: [R, d_in, H*d] (column h*d + f is head h's feature f); a_src, a_dst: [R, H, d].
  """

  w: jax.Array
  a_src: jax.Array
  a_dst: jax.Array

  @property
  def heads(self) -> int:
    return self.a_src.shape[1]


def _uniform(rng: np.random.Generator, shape, fan_in: int, fan_out: int, dtype):
  """Glorot-uniform: U(-b, b), b = sqrt(6 / (fan_in + fan_out))."""
  bound = math.sqrt(6.0 / (fan_in + fan_out))
  return jnp.asarray(rng.uniform(-bound, bound, shape), dtype)


def init_rgat(
  seed: int,
  *,
  num_relations: int,
  in_features: int,
  head_features: int,
  heads: int = 1,
  dtype=jnp.float32,
) -> RGATParams:
  """Glorot-uniform weights and attention vectors, drawn by NumPy from `seed`."""
  rng = np.random.default_rng(seed)
  r, d, h = num_relations, head_features, heads
  return RGATParams(
    _uniform(rng, (r, in_features, h * d), in_features, h * d, dtype),
    _uniform(rng, (r, h, d), d, 1, dtype),
    _uniform(rng, (r, h, d), d, 1, dtype),
  )


def _folded(params: RGATParams, precision, acc):
  """W_r a_r for the source and destination vectors: [R, d_in, H] each."""
  r, d_in, _ = params.w.shape
  w = params.w.reshape(r, d_in, params.heads, -1)

  def fold(a):
    return jnp.einsum("rihd,rhd->rih", w, a, precision=precision, preferred_element_type=acc)

  return fold(params.a_src), fold(params.a_dst)


def _rgat_finish(scores, messages, dst, num_nodes, heads, dtype):
  alpha = edge_softmax(jax.nn.leaky_relu(scores, NEGATIVE_SLOPE), dst, num_nodes)
  num_edges, features = messages.shape
  return _aggregate(
    alpha, messages.reshape(num_edges, heads, features // heads), dst, num_nodes, dtype
  )


def rgat_transform_all_then_gather(src, dst, etype, x, params: RGATParams, *, precision=None):
  """x @ W_r for every node and relation ([R, N, H*d]) and node scores [R, N, H], then gather."""
  acc, n = _acc(x.dtype), x.shape[0]
  h = jnp.einsum(
    "nd,rdf->rnf", x, params.w, precision=precision, preferred_element_type=acc
  ).astype(x.dtype)
  fold_src, fold_dst = _folded(params, precision, acc)
  s_src = jnp.einsum(
    "nd,rdh->rnh", x, fold_src.astype(x.dtype), precision=precision, preferred_element_type=acc
  )
  s_dst = jnp.einsum(
    "nd,rdh->rnh", x, fold_dst.astype(x.dtype), precision=precision, preferred_element_type=acc
  )
  scores = s_src[etype, src] + s_dst[etype, dst]
  return _rgat_finish(scores, h[etype, src], dst, n, params.heads, x.dtype)


def rgat_ragged_dot(src, dst, etype, x, params: RGATParams, *, precision=None):
  """x[src] and x[dst] grouped by relation through `jax.lax.ragged_dot`; edges sorted by etype."""
  acc, n = _acc(x.dtype), x.shape[0]
  sizes = _group_sizes(etype, params.w.shape[0])
  fold_src, fold_dst = _folded(params, precision, acc)
  x_src, x_dst = x[src], x[dst]
  dot = functools.partial(
    jax.lax.ragged_dot, group_sizes=sizes, precision=precision, preferred_element_type=acc
  )
  messages = dot(x_src, params.w).astype(x.dtype)
  scores = dot(x_src, fold_src.astype(x.dtype)) + dot(x_dst, fold_dst.astype(x.dtype))
  return _rgat_finish(scores, messages, dst, n, params.heads, x.dtype)


def rgat_per_edge_weights(src, dst, etype, x, params: RGATParams, *, precision=None):
  """W[etype] as a per-edge [E, d_in, H*d] tensor times x[src] (and folded scores per edge)."""
  acc, n = _acc(x.dtype), x.shape[0]
  fold_src, fold_dst = _folded(params, precision, acc)
  per_edge = functools.partial(jnp.einsum, precision=precision, preferred_element_type=acc)
  x_src, x_dst = x[src], x[dst]
  messages = per_edge("ed,edf->ef", x_src, params.w[etype]).astype(x.dtype)
  scores = per_edge("ed,edh->eh", x_src, fold_src.astype(x.dtype)[etype]) + per_edge(
    "ed,edh->eh", x_dst, fold_dst.astype(x.dtype)[etype]
  )
  return _rgat_finish(scores, messages, dst, n, params.heads, x.dtype)


#: name -> plain-JAX RGAT formulation, in the benchmark's column order.
RGAT = {
  "transform-all-then-gather": rgat_transform_all_then_gather,
  "ragged_dot": rgat_ragged_dot,
  "per-edge weights": rgat_per_edge_weights,
}


def rgat_scores_float64(src, dst, etype, x, params: RGATParams) -> np.ndarray:
  """Every edge's score before the leaky ReLU, in float64 NumPy on the host: [E, H] with

      z[e, h] = a_src[r, h] . (x[src[e]] @ W[r])[h] + a_dst[r, h] . (x[dst[e]] @ W[r])[h]

  (r = etype[e]; rows in the order of the edges given, which need not be sorted). Folded as the
  formulations above fold it, x . (W_r a_r), and computed one relation at a time: the host
  holds [E_r, d_in] rows of one relation, never an [E, d_in, H] gather (2M edges, d_in 64 and
  4 heads on 2 CPU cores: `jaxdata bench tensor-cores` states the time it took). It tells which
  edges sit at the leaky ReLU's kink (z near 0), where two float32 computations of z may round
  to opposite sides and take different slopes.

      >>> z = rgat_scores_float64(src, dst, etype, x, params)      # [E, H] float64
  """
  src, dst, etype = (np.asarray(a).reshape(-1) for a in (src, dst, etype))
  if not src.size == dst.size == etype.size:
    raise ValueError(
      f"rgat_scores_float64: src, dst and etype differ in length "
      f"({src.size}, {dst.size}, {etype.size})"
    )
  x = np.asarray(x, np.float64)
  w = np.asarray(params.w, np.float64)
  r, d_in, features = w.shape
  heads = params.a_src.shape[1]
  if x.ndim != 2 or x.shape[1] != d_in:
    raise ValueError(
      f"rgat_scores_float64: x must be [N, {d_in}] (W is {list(w.shape)}), got {list(x.shape)}"
    )
  if etype.size and (etype.min() < 0 or etype.max() >= r):
    raise ValueError(
      f"rgat_scores_float64: etype must be in [0, {r}) (W's relations), got "
      f"[{etype.min()}, {etype.max()}]"
    )
  w = w.reshape(r, d_in, heads, features // heads)
  fold_src = np.einsum("rkhd,rhd->rkh", w, np.asarray(params.a_src, np.float64))
  fold_dst = np.einsum("rkhd,rhd->rkh", w, np.asarray(params.a_dst, np.float64))
  z = np.empty((src.size, heads))
  order = np.argsort(etype, kind="stable")
  bounds = np.searchsorted(etype[order], np.arange(r + 1))
  for rel in range(r):
    e = order[bounds[rel] : bounds[rel + 1]]
    if e.size:
      z[e] = x[src[e]] @ fold_src[rel] + x[dst[e]] @ fold_dst[rel]
  return z


# ------------------------------------------------------------------------------------------------
# HGT


class HGTParams(NamedTuple):
  """One HGT layer's weights (a pytree). Per node type t (tuples of T arrays):

  k_w, q_w, v_w: [d_t, H*d_k]; k_b, q_b, v_b: [H*d_k]; a_w: [H*d_k, d_out]; a_b: [d_out].
  Per relation: w_att, w_msg: [R, H, d_k, d_k]; mu: [R, H]. skip: [T] (the gate's logit).
  """

  k_w: tuple
  k_b: tuple
  q_w: tuple
  q_b: tuple
  v_w: tuple
  v_b: tuple
  a_w: tuple
  a_b: tuple
  w_att: jax.Array
  w_msg: jax.Array
  mu: jax.Array
  skip: jax.Array

  @property
  def heads(self) -> int:
    return self.mu.shape[1]

  @property
  def head_features(self) -> int:
    return self.w_att.shape[-1]


def init_hgt(
  seed: int,
  *,
  in_features: Sequence[int],
  num_relations: int,
  head_features: int,
  heads: int = 1,
  out_features: int | None = None,
  dtype=jnp.float32,
) -> HGTParams:
  """Glorot-uniform matrices, zero biases, mu = skip = 1 (PyG's start), drawn by NumPy from `seed`.

  `in_features[t]` is d_t; out_features defaults to H * head_features.
  """
  f = heads * head_features
  d_out = f if out_features is None else out_features
  rng = np.random.default_rng(seed)
  linear = lambda d_in, d_o: _uniform(rng, (d_in, d_o), d_in, d_o, dtype)  # noqa: E731
  zeros = lambda d: jnp.zeros((d,), dtype)  # noqa: E731
  k_w, q_w, v_w = ([linear(d, f) for d in in_features] for _ in range(3))
  shape = (num_relations, heads, head_features, head_features)
  return HGTParams(
    k_w=tuple(k_w),
    k_b=tuple(zeros(f) for _ in in_features),
    q_w=tuple(q_w),
    q_b=tuple(zeros(f) for _ in in_features),
    v_w=tuple(v_w),
    v_b=tuple(zeros(f) for _ in in_features),
    a_w=tuple(linear(f, d_out) for _ in in_features),
    a_b=tuple(zeros(d_out) for _ in in_features),
    w_att=_uniform(rng, shape, head_features, head_features, dtype),
    w_msg=_uniform(rng, shape, head_features, head_features, dtype),
    mu=jnp.ones((num_relations, heads), dtype),
    skip=jnp.ones((len(in_features),), dtype),
  )


def _linear(x, w, b, precision, acc):
  return (jnp.dot(x, w, precision=precision, preferred_element_type=acc) + b).astype(x.dtype)


def _hgt_nodes(xs, params: HGTParams, precision, acc):
  """K, Q, V of every node, types concatenated in id order: [N, H, d_k] each."""
  h, d = params.heads, params.head_features

  def project(ws, bs):
    rows = [_linear(x, w, b, precision, acc) for x, w, b in zip(xs, ws, bs)]
    return jnp.concatenate(rows).reshape(-1, h, d)

  return (
    project(params.k_w, params.k_b),
    project(params.q_w, params.q_b),
    project(params.v_w, params.v_b),
  )


def hgt_projections(xs, params: HGTParams, *, precision=None):
  """(K, Q, V) of every node, [N, H, d_k] each, node types in id order: HGT before its
  relational part (per-type linear maps with bias)."""
  _check_types(xs, params)
  return _hgt_nodes(xs, params, precision, _acc(xs[0].dtype))


def _hgt_finish(k_e, q, m_e, etype, dst, xs, params: HGTParams, precision):
  """Scores, the edge softmax, aggregation, then A_t(gelu(.)) and the skip gate per node type."""
  acc = _acc(xs[0].dtype)
  n = q.shape[0]
  scores = jnp.sum(k_e.astype(acc) * q[dst].astype(acc), axis=-1)
  scores = scores * params.mu[etype].astype(acc) / math.sqrt(params.head_features)
  agg = _aggregate(edge_softmax(scores, dst, n), m_e, dst, n, acc)
  return hgt_output(agg, xs, params, precision=precision)


def hgt_output(agg, xs, params: HGTParams, *, precision=None) -> list:
  """HGT after its relational part: out_t = skip-gated A_t(gelu(agg)) per node type.

  `agg` is the attention-weighted sum of messages, [N, H*d_k], node types in id order (what a
  kernel computing only the relational part returns); one output per node type, in xs' dtype.
  """
  dtype, acc = xs[0].dtype, _acc(xs[0].dtype)
  outs, start = [], 0
  for t, x in enumerate(xs):
    rows = jax.nn.gelu(agg[start : start + x.shape[0]], approximate=False).astype(dtype)
    start += x.shape[0]
    y = _linear(rows, params.a_w[t], params.a_b[t], precision, acc)
    if y.shape[-1] == x.shape[-1]:
      gate = jax.nn.sigmoid(params.skip[t].astype(acc))
      y = (gate * y.astype(acc) + (1 - gate) * x.astype(acc)).astype(dtype)
    outs.append(y)
  return outs


def check_node_types(graph, xs) -> None:
  """ValueError unless xs[t] has the rows of node type t of `graph` (a HeteroGraph).

  The formulations take the type offsets from the row counts of xs, so this is the one check
  that features and graph agree; run it outside jit.
  """
  offsets = graph.node_type_offsets
  if offsets is None:
    offsets = np.array([0, graph.num_nodes])
  rows = [int(np.shape(x)[0]) for x in xs]
  if len(rows) != len(offsets) - 1 or np.any(np.diff(offsets) != rows):
    raise ValueError(
      f"HGT: feature rows {rows} do not match the graph's node types "
      f"{dict(zip(graph.node_type_names, np.diff(offsets).tolist()))}"
    )


def _check_types(xs, params: HGTParams):
  if len(xs) != len(params.k_w):
    raise ValueError(f"HGT: {len(xs)} feature arrays for {len(params.k_w)} node types")
  if len({x.dtype for x in xs}) != 1:
    raise ValueError(f"HGT: node features must share one dtype, got {[x.dtype for x in xs]}")


def hgt_transform_all_then_gather(src, dst, etype, xs, params: HGTParams, *, precision=None):
  """K @ W_att[r] and V @ W_msg[r] for every node and relation ([R, N, H, d_k]), then gather."""
  _check_types(xs, params)
  dtype, acc = xs[0].dtype, _acc(xs[0].dtype)
  k, q, v = _hgt_nodes(xs, params, precision, acc)

  def through(a, w):
    return jnp.einsum(
      "nhd,rhdf->rnhf", a, w.astype(dtype), precision=precision, preferred_element_type=acc
    ).astype(dtype)

  k_e = through(k, params.w_att)[etype, src]
  m_e = through(v, params.w_msg)[etype, src]
  return _hgt_finish(k_e, q, m_e, etype, dst, xs, params, precision)


def hgt_ragged_dot(src, dst, etype, xs, params: HGTParams, *, precision=None):
  """K[src] and V[src] grouped by relation: one `jax.lax.ragged_dot` per head.

  Edges sorted by etype. (Heads as a batch dimension of `ragged_dot_general` would be one call,
  but XLA's verifier rejects that program on jax 0.11.2: "A dimension number is not unique in
  Dot".)
  """
  _check_types(xs, params)
  dtype, acc = xs[0].dtype, _acc(xs[0].dtype)
  k, q, v = _hgt_nodes(xs, params, precision, acc)
  sizes = _group_sizes(etype, params.mu.shape[0])

  def through(a, w):  # a: [N, H, d_k], w: [R, H, d_k, d_k] -> [E, H, d_k]
    rows = a[src]
    heads = [
      jax.lax.ragged_dot(
        rows[:, h], w[:, h].astype(dtype), sizes, precision=precision, preferred_element_type=acc
      )
      for h in range(w.shape[1])
    ]
    return jnp.stack(heads, axis=1).astype(dtype)

  return _hgt_finish(
    through(k, params.w_att), q, through(v, params.w_msg), etype, dst, xs, params, precision
  )


def hgt_per_edge_weights(src, dst, etype, xs, params: HGTParams, *, precision=None):
  """W_att[etype] and W_msg[etype] gathered per edge ([E, H, d_k, d_k]) times K[src], V[src]."""
  _check_types(xs, params)
  dtype, acc = xs[0].dtype, _acc(xs[0].dtype)
  k, q, v = _hgt_nodes(xs, params, precision, acc)
  through = lambda a, w: jnp.einsum(  # noqa: E731
    "ehd,ehdf->ehf", a[src], w.astype(dtype)[etype], precision=precision, preferred_element_type=acc
  ).astype(dtype)
  return _hgt_finish(
    through(k, params.w_att), q, through(v, params.w_msg), etype, dst, xs, params, precision
  )


#: name -> plain-JAX HGT formulation, in the benchmark's column order.
HGT = {
  "transform-all-then-gather": hgt_transform_all_then_gather,
  "ragged_dot": hgt_ragged_dot,
  "per-edge weights": hgt_per_edge_weights,
}
