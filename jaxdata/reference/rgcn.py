"""Reference formulations of one RGCN layer: ground truth for tests, peers for benchmarks.


One RGCN layer's relational part, over edges e = (src[e] -> dst[e]) of relation etype[e]:

    out[i] = sum_{e : dst[e] == i} norm[e] * (x[src[e]] @ W[etype[e]])
    x: [N, d_in], W: [R, d_in, d_out]

and, featureless (x is None; the RGCN paper's first layer on RDF data, where a node's input is its
one-hot id):  out[i] = sum_e norm[e] * W[etype[e], src[e]]   with W: [R, N, d_out].
`norm[e]` is 1 / |{e' : dst[e'] == dst[e], etype[e'] == etype[e]}|, the per-relation mean.

The plain-JAX formulations are pure functions `(src, dst, etype, norm, num_nodes, x, W) -> out`,
jit-able with `num_nodes` static; edges must be sorted by relation (`ragged_dot` relies on it):

  transform_all_then_gather  every node through every relation's weight ([R, N, d_out]), then one
                             gather per edge; cheap with few relations, O(R N d_out) memory
  ragged_dot                 x[src] as one ragged matrix grouped by relation, `jax.lax.ragged_dot`
  per_edge_weights           W[etype] materialised per edge ([E, d_in, d_out]), like PyG's
                             FastRGCNConv: memory-hungry on purpose
  featureless                the x-is-None layer

The PyTorch Geometric formulations are `torch_geometric.nn.RGCNConv(aggr="mean")` and its
per-edge-weight twin `FastRGCNConv` given the same weights (`jaxdata.reference.pyg.pyg_conv`).

    >>> edges = EdgeArrays.build(src, dst, etype, num_nodes=n, num_relations=r)
    >>> out = jax.jit(ragged_dot, static_argnums=4)(*edges, n, x, w)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# ------------------------------------------------------------------------------------------------
# Graph arrays


def mean_norm(dst: np.ndarray, etype: np.ndarray, num_nodes: int, num_relations: int) -> np.ndarray:
  """1 / (number of edges with the same destination and relation), per edge (float64)."""
  dst, etype = np.asarray(dst, np.int64), np.asarray(etype, np.int64)
  if dst.size == 0:
    return np.zeros(0, np.float64)
  key = dst * num_relations + etype
  _, inverse, counts = np.unique(key, return_inverse=True, return_counts=True)
  del num_nodes  # the key range is implied; kept in the signature for symmetry with the callers
  return 1.0 / counts[inverse.reshape(-1)]


def checked_edges(src, dst, etype, num_nodes: int, num_relations: int):
  """(src, dst, etype) as int32 NumPy arrays; ValueError on ragged shapes or ids out of range."""
  src, dst, etype = (np.asarray(a).astype(np.int32) for a in (src, dst, etype))
  if not src.shape == dst.shape == etype.shape or src.ndim != 1:
    raise ValueError(
      f"src, dst, etype must be 1-D and of one length, got {src.shape}, {dst.shape}, {etype.shape}"
    )
  if src.size and (min(src.min(), dst.min()) < 0 or max(src.max(), dst.max()) >= num_nodes):
    raise ValueError(f"src/dst must lie in [0, num_nodes={num_nodes})")
  if etype.size and (etype.min() < 0 or etype.max() >= num_relations):
    raise ValueError(f"etype must lie in [0, num_relations={num_relations})")
  return src, dst, etype


class EdgeArrays(NamedTuple):
  """(src, dst, etype, norm) as device arrays, edges sorted by relation; a pytree."""

  src: jax.Array
  dst: jax.Array
  etype: jax.Array
  norm: jax.Array

  @classmethod
  def build(
    cls,
    src,
    dst,
    etype,
    *,
    num_nodes: int,
    num_relations: int,
    norm=None,
    dtype=np.float32,
    device=None,
  ) -> EdgeArrays:
    """Sorts by relation (stable), computes the per-relation mean norm unless given."""
    src, dst, etype = checked_edges(src, dst, etype, num_nodes, num_relations)
    if norm is None:
      norm = mean_norm(dst, etype, num_nodes, num_relations)
    norm = np.asarray(norm)
    order = np.argsort(etype, kind="stable")
    put = functools.partial(jax.device_put, device=device)
    return cls(put(src[order]), put(dst[order]), put(etype[order]), put(norm[order].astype(dtype)))


# ------------------------------------------------------------------------------------------------
# Plain-JAX formulations


def _scatter(messages: jax.Array, norm: jax.Array, dst: jax.Array, num_nodes: int) -> jax.Array:
  return jax.ops.segment_sum(
    messages * norm[:, None].astype(messages.dtype), dst, num_segments=num_nodes
  )


def _needs_features(name: str, x) -> None:
  if x is None:
    raise ValueError(f"{name} needs node features x; use `featureless` for the x-is-None layer")


def transform_all_then_gather(src, dst, etype, norm, num_nodes: int, x, w, *, precision=None):
  """h = x @ W_r for every node and relation ([R, N, d_out]), then scatter norm * h[etype, src].

  With x None, h is W itself (the featureless layer).
  """
  h = w if x is None else jnp.einsum("nd,rde->rne", x, w, precision=precision)
  return _scatter(h[etype, src], norm, dst, num_nodes)


def ragged_dot(src, dst, etype, norm, num_nodes: int, x, w, *, precision=None):
  """x[src] grouped by relation times W_r with `jax.lax.ragged_dot`; edges sorted by etype."""
  _needs_features("ragged_dot", x)
  group_sizes = jnp.bincount(etype, length=w.shape[0]).astype(jnp.int32)
  y = jax.lax.ragged_dot(x[src], w, group_sizes, precision=precision)
  return _scatter(y, norm, dst, num_nodes)


def per_edge_weights(src, dst, etype, norm, num_nodes: int, x, w, *, precision=None):
  """W[etype] as a per-edge [E, d_in, d_out] tensor times x[src] (PyG FastRGCNConv's way)."""
  _needs_features("per_edge_weights", x)
  y = jnp.einsum("ed,edo->eo", x[src], w[etype], precision=precision)
  return _scatter(y, norm, dst, num_nodes)


def featureless(src, dst, etype, norm, num_nodes: int, x, w, *, precision=None):
  """The x-is-None layer: out = segment_sum(norm W[etype, src]), W: [R, N, d_out]."""
  del precision
  if x is not None:
    raise ValueError("featureless takes x=None (its weight W is [R, num_nodes, d_out])")
  return _scatter(w[etype, src], norm, dst, num_nodes)


def full_layer(
  message: Callable[..., jax.Array],
  src,
  dst,
  etype,
  norm,
  num_nodes: int,
  x,
  w,
  w_self,
  bias,
  *,
  precision=None,
):
  """The whole RGCN layer: relational message + self loop (x @ W_self; W_self if no x) + bias."""
  out = message(src, dst, etype, norm, num_nodes, x, w, precision=precision)
  loop = w_self if x is None else jnp.dot(x, w_self, precision=precision)
  return out + loop + bias


#: name -> plain-JAX formulation with node features, in the benchmark's column order.
PLAIN_JAX = {
  "transform-all-then-gather": transform_all_then_gather,
  "ragged_dot": ragged_dot,
  "per-edge weights": per_edge_weights,
}


def per_edge_weight_bytes(num_edges: int, d_in: int, d_out: int, itemsize: int = 4) -> int:
  """Bytes of per_edge_weights' [E, d_in, d_out] tensor, where XLA materialises it.

  XLA on the CPU does (and its backward holds one more); XLA on the GPU fuses the gather W[etype]
  into the contraction and never builds it, so ask the compiled executable first.
  """
  return num_edges * d_in * d_out * itemsize


def pyg_fast_bytes(num_edges: int, d_in: int, d_out: int, *, train: bool, itemsize: int = 4) -> int:
  """A lower bound on FastRGCNConv's memory: its per-edge W[etype], [E, d_in, d_out]; training
  also builds that tensor's gradient (and autograd keeps the gather's index), counted twice more.
  Used only on the CPU, where torch keeps no peak and the kernel's OOM killer does not raise."""
  return per_edge_weight_bytes(num_edges, d_in, d_out, itemsize) * (3 if train else 1)
