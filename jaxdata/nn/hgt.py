"""Flax NNX heterogeneous graph transformer layer (HGT; Hu et al., 2020), as PyG's `HGTConv`.

Node type t owns the global ids [offsets[t], offsets[t+1]) and has its own feature width d_t.
For an edge e = (j -> i) of relation r, H heads of d_k features:

    K_j, Q_j, V_j = x_j @ [K|Q|V]_{tau(j)} + b                 per-type projections (XLA)
    score[e,h]    = (K_j[h] W_att[r,h]) . Q_i[h] * mu[r,h] / sqrt(d_k)
    agg_i         = concat_h sum_e softmax_i(score[., h])[e] * V_j[h] W_msg[r,h]   (hector)
    y_i           = A_{tau(i)}(gelu(agg_i))                       exact GELU (XLA)
    out_i         = sigmoid(s_t) y_i + (1 - sigmoid(s_t)) x_i   when d_out == d_t, else y_i

The edge part runs as generated kernels (`jaxdata.hector.hgt_message`): ``K W_att`` and
``V W_msg`` once per unique (source, relation) pair, per-head GEMMs (no block-diagonal weight),
the prior folded into ``W_att``. The per-type projections, the GELU and the skip gate are
node-level dense work on XLA. This is PyG 2.8's HGTConv: no dropout; node types that receive
no edges get ``A_t(gelu(0))`` skip-mixed (PyG returns nothing for them).

    layer = HGT((128, 64, 32), 64, num_relations=graph.num_relations, heads=4, rngs=nnx.Rngs(0))
    outs = layer(graph_arrays, [x_paper, x_author, x_institution])   # one [N_t, 64] per type

Remat policies can name the layer's intermediates (`NAMES`, and hector's `SAVED_NAME`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxdata.hector import GraphArrays, hgt_message
from jaxdata.hector.passes import select as select_passes
from jaxdata.hector.precision import resolve as resolve_precision
from jaxdata.nn import _checks as checks
from jaxdata.nn.typed import typed_linear

#: The checkpoint names `HGT.__call__` tags its node-level intermediates with (remat policies
#: name what to keep): every node's keys, queries and values ``[N, 3 * H * d_k]``, and its
#: aggregated messages ``[N, H * d_k]``. The edge kernels' own residuals are
#: `jaxdata.hector.SAVED_NAME`.
NAMES = ("hgt_kqv", "hgt_agg")


def _per_type(xs: Sequence[jax.Array] | jax.Array, types: int) -> list[jax.Array]:
  """One feature array per node type: `xs` itself if a list or tuple, else `xs` for each."""
  if isinstance(xs, (list, tuple)):
    return list(xs)
  return [cast(jax.Array, xs)] * types  # not a list or tuple: the one array of every type


class HGT(nnx.Module):
  """One HGT layer over node types with their own feature widths.

  Args:
    in_features: each node type's feature width d_t, in node-type (id) order.
    out_features: output width of every type.
    num_relations: relations in the graph.
    heads: attention heads.
    head_features: d_k (default ``out_features // heads``, which must divide).
    passes: hector's optimizing passes (names from `jaxdata.hector.PASSES`; None: all).
    dtype: computation dtype (float32 or bfloat16); parameters stay in `param_dtype`.
    precision: matmul precision of the relational products and the per-type projections, as
      `jnp.dot`'s (None: ``jax.default_matmul_precision``; see `jaxdata.hector.precision`).
    rngs: parameter initialization.

  Parameters (PyG's layout): ``kqv[t]`` a Linear d_t -> 3 * H * d_k (keys, queries, values),
  ``out[t]`` a Linear H * d_k -> out_features, ``w_att`` and ``w_msg`` ``[R, H, d_k, d_k]``,
  ``mu`` ``[R, H]`` (ones), ``skip`` ``[T]`` (ones).
  """

  def __init__(
    self,
    in_features: Sequence[int],
    out_features: int,
    *,
    num_relations: int,
    heads: int = 1,
    head_features: int | None = None,
    passes=None,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    precision=None,
    rngs: nnx.Rngs,
  ):
    try:
      if isinstance(in_features, (int, np.integer, str, bytes)):
        raise TypeError
      widths = tuple(in_features)
    except TypeError:
      raise TypeError(
        f"HGT: in_features must be a sequence of ints, one per node type, got {in_features!r}"
      ) from None
    in_features = tuple(checks.size(d, f"in_features[{t}]", "HGT") for t, d in enumerate(widths))
    if not in_features:
      raise ValueError("HGT: in_features must name at least one node type")
    out_features = checks.size(out_features, "out_features", "HGT")
    num_relations = checks.size(num_relations, "num_relations", "HGT")
    heads = checks.size(heads, "heads", "HGT")
    if head_features is not None:
      head_features = checks.size(head_features, "head_features", "HGT")
    resolve_precision(precision, "HGT")  # checked now; resolved per call, as jnp.dot does
    if head_features is None:
      if out_features % heads:
        raise ValueError(
          f"HGT: out_features={out_features} is not a multiple of heads={heads}; pass head_features"
        )
      head_features = out_features // heads
    f = heads * head_features

    def linear(a, b):
      return nnx.Linear(a, b, dtype=dtype, param_dtype=param_dtype, precision=precision, rngs=rngs)

    self.kqv = nnx.List([linear(d, 3 * f) for d in in_features])
    self.out = nnx.List([linear(f, out_features) for _ in in_features])
    init = jax.nn.initializers.glorot_uniform(in_axis=-2, out_axis=-1, batch_axis=(0, 1))
    shape = (num_relations, heads, head_features, head_features)
    self.w_att = nnx.Param(init(rngs.params(), shape, param_dtype))
    self.w_msg = nnx.Param(init(rngs.params(), shape, param_dtype))
    self.mu = nnx.Param(jnp.ones((num_relations, heads), param_dtype))
    self.skip = nnx.Param(jnp.ones((len(in_features),), param_dtype))
    self.in_features, self.out_features = in_features, out_features
    self.num_relations = num_relations
    self.heads, self.head_features, self.dtype = heads, head_features, dtype
    self.passes = select_passes(passes)
    self.precision = precision

  def __call__(self, graph: GraphArrays, xs: Any) -> Any:
    """xs[t]: ``[N_t, d_t]``, types in id order (sum of N_t = the graph's nodes; when the graph
    has node types, N_t must be its type t's count: ValueError otherwise). Returns one
    ``[N_t, out_features]`` array per type. On a graph that names its node types, `xs` may be
    ``{node type: array}``, and the result is then a dict."""
    if isinstance(xs, Mapping):
      checks.graph(graph, "HGT")
      names = graph.node_type_names or ()
      return dict(zip(names, self(graph, checks.by_type(graph, xs, "xs", "HGT"))))
    xs = self._inputs(graph, xs, "HGT")
    if len(xs) != len(self.in_features):
      raise ValueError(f"HGT: {len(xs)} feature arrays for {len(self.in_features)} node types")
    widths = tuple(x.shape[-1] for x in xs)
    if widths != self.in_features:
      raise ValueError(f"HGT: feature widths {widths}, expected {self.in_features}")
    rows = [x.shape[0] for x in xs]
    graph.check_node_type_rows(rows, "HGT")  # a wrong split would mix up the types' weights
    if sum(rows) != graph.num_nodes:
      raise ValueError(f"HGT: {sum(rows)} feature rows for a graph of {graph.num_nodes} nodes")
    xs = [x.astype(self.dtype) for x in xs]
    kqv = checkpoint_name(jnp.concatenate([lin(x) for lin, x in zip(self.kqv, xs)]), NAMES[0])
    agg = checkpoint_name(self._message(graph, kqv), NAMES[1])
    outs, start = [], 0
    for t, x in enumerate(xs):
      y = self.out[t](jax.nn.gelu(agg[start : start + rows[t]], approximate=False))
      start += rows[t]
      outs.append(self._skip(t, y, x))
    return outs

  def on_slots(
    self,
    graph: GraphArrays,
    xs: Sequence[jax.Array] | jax.Array,
    types: jax.Array,
    rows: int | None = None,
  ) -> jax.Array:
    """The layer on nodes of mixed types in any order: a sampled block's slots.

    `types[i]` is row i's node type (-1: an unused slot, whose output row is 0 before the
    skip); `xs` is one ``[N, d_t]`` array per type (row i read only in its own type's array,
    as `jaxdata.loader.blocks.gather_typed` returns them) or one ``[N, d]`` array for every type.
    Returns ``[N, out_features]``, row i as `__call__` computes it for that node; with `rows`,
    only the first `rows` of them (a block's destinations come first: the other slots are
    sources only, and their outputs need not be computed).

    The per-type projections are one GEMM over all N rows (`typed_linear`); the output projections
    and the skip run on the first `rows` only.
    """
    feats = self._inputs(graph, _per_type(xs, len(self.in_features)), "HGT.on_slots")
    if len(feats) != len(self.in_features):
      raise ValueError(
        f"HGT.on_slots: {len(feats)} feature arrays for {len(self.in_features)} node types"
      )
    widths = tuple(x.shape[-1] for x in feats)
    if widths != self.in_features:
      raise ValueError(f"HGT.on_slots: feature widths {widths}, expected {self.in_features}")
    if any(x.shape[0] != graph.num_nodes for x in feats) or types.shape != (graph.num_nodes,):
      raise ValueError(
        f"HGT.on_slots: xs and types need {graph.num_nodes} rows (the graph's "
        f"slots), got {[x.shape[0] for x in feats]} and {types.shape}"
      )
    rows = graph.num_nodes if rows is None else int(rows)
    if not 0 <= rows <= graph.num_nodes:
      raise ValueError(f"HGT.on_slots: rows={rows} is not in [0, {graph.num_nodes}]")
    feats = [x.astype(self.dtype) for x in feats]
    mine = [(types == t)[:, None] for t in range(len(feats))]

    def pick(ys, n) -> jax.Array:
      """Each of the first n slots' row from its own node type's array."""
      total = sum(jnp.where(m[:n], y, 0) for m, y in zip(mine, ys))
      assert isinstance(total, jax.Array)  # a term per node type, and there is at least one
      return total

    agg = self._message(
      graph, typed_linear(self.kqv, feats, types, dtype=self.dtype, precision=self.precision)
    )
    h = jax.nn.gelu(agg[:rows], approximate=False)
    return pick([self._skip(t, self.out[t](h), x[:rows]) for t, x in enumerate(feats)], rows)

  def on_partition(
    self, graph: GraphArrays, xs: Sequence[jax.Array] | jax.Array, types: jax.Array, start, gather
  ) -> jax.Array:
    """This layer's rows ``start:start + rows`` on the whole graph, computed on a destination
    part (`jaxdata.hector.partition`) that holds every in-edge of those rows.

    `xs` are the owned rows' inputs only, as `on_slots` takes them (one ``[rows, d_t]`` array
    per type, or one for every type), `types` their node types (``[rows]``, -1 for padding
    rows). The keys, queries and values of the owned rows are projected here and `gather` turns
    them into every node's (``jax.lax.all_gather(kqv, axis, tiled=True)`` inside `shard_map`):
    the gathered width is ``3 * heads * head_features``. Returns ``[rows, out_features]``.
    """
    feats = self._inputs(graph, _per_type(xs, len(self.in_features)), "HGT.on_partition")
    if len(feats) != len(self.in_features):
      raise ValueError(
        f"HGT.on_partition: {len(feats)} feature arrays for {len(self.in_features)} node types"
      )
    rows = types.shape[0]
    if any(x.shape[0] != rows for x in feats):
      raise ValueError(
        f"HGT.on_partition: xs need {rows} rows (as types), got {[x.shape[0] for x in feats]}"
      )
    feats = [x.astype(self.dtype) for x in feats]
    mine = [(types == t)[:, None] for t in range(len(feats))]

    def pick(ys) -> jax.Array:
      """Each slot's row from its own node type's array."""
      total = sum(jnp.where(m, y, 0) for m, y in zip(mine, ys))
      assert isinstance(total, jax.Array)  # a term per node type, and there is at least one
      return total

    kqv = gather(typed_linear(self.kqv, feats, types, dtype=self.dtype, precision=self.precision))
    if kqv.shape[0] != graph.num_nodes:
      raise ValueError(
        f"HGT.on_partition: gather must give the part's {graph.num_nodes} rows, got {kqv.shape[0]}"
      )
    agg = jax.lax.dynamic_slice_in_dim(self._message(graph, kqv), start, rows)
    h = jax.nn.gelu(agg, approximate=False)
    return pick([self._skip(t, self.out[t](h), x) for t, x in enumerate(feats)])

  def _inputs(self, graph: Any, xs: Any, who: str) -> list[jax.Array]:
    """The graph checked against the layer, and each node type's features as a 2-D array."""
    checks.graph(graph, who)
    checks.relations(graph, self.num_relations, who)
    if not isinstance(xs, (list, tuple)):
      raise TypeError(
        f"{who}: xs must be a list of feature arrays, one per node type, got {type(xs).__name__}"
      )
    widths = self.in_features if len(xs) == len(self.in_features) else (None,) * len(xs)
    return [checks.rows(x, f"xs[{t}]", who, None, widths[t]) for t, x in enumerate(xs)]

  def _message(self, graph: GraphArrays, kqv: jax.Array) -> jax.Array:
    """The edge part (hector): every node's aggregated messages from its keys/queries/values."""
    k, q, v = jnp.split(kqv, 3, axis=-1)
    cast = lambda p: p[...].astype(self.dtype)  # noqa: E731
    return hgt_message(
      graph,
      k,
      q,
      v,
      cast(self.w_att),
      cast(self.w_msg),
      cast(self.mu),
      passes=self.passes,
      precision=self.precision,
    )

  def _skip(self, t: int, y: jax.Array, x: jax.Array) -> jax.Array:
    """Type t's gated skip connection, where its input width equals the output width."""
    if y.shape[-1] != x.shape[-1]:
      return y
    gate = jax.nn.sigmoid(self.skip[t].astype(jnp.float32))
    return (gate * y.astype(jnp.float32) + (1 - gate) * x.astype(jnp.float32)).astype(y.dtype)
