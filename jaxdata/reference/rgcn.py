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
per-edge-weight twin `FastRGCNConv` given the same weights (`pyg_conv`; torch is imported only
by the functions that need it).

    >>> edges = EdgeArrays.build(src, dst, etype, num_nodes=n, num_relations=r)
    >>> out = jax.jit(ragged_dot, static_argnums=4)(*edges, n, x, w)
"""

from __future__ import annotations

import contextlib
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


# ------------------------------------------------------------------------------------------------
# PyTorch Geometric


@contextlib.contextmanager
def pyg_per_relation_mean():
  """Keeps RGCNConv on its per-relation loop.

  With pyg_lib installed, RGCNConv may switch (by a size heuristic) to `segment_matmul`, whose
  aggr="mean" averages over all in-edges of a node instead of per relation (a TODO in its
  `message`): another layer. Switching it off keeps PyG computing the RGCN of the paper.
  """
  import torch_geometric.backend  # pylint: disable=g-import-not-at-top

  saved = torch_geometric.backend.use_segment_matmul
  torch_geometric.backend.use_segment_matmul = False
  try:
    yield
  finally:
    torch_geometric.backend.use_segment_matmul = saved


def torch_device():
  """CUDA when torch sees a GPU, else the CPU."""
  import torch  # pylint: disable=g-import-not-at-top

  return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pyg_conv(
  w: np.ndarray,
  *,
  w_self: np.ndarray | None = None,
  bias: np.ndarray | None = None,
  device=None,
  dtype=None,
  fast: bool = False,
):
  """RGCNConv(aggr="mean") holding the given weights; root/bias only when given.

  `w` is [R, d_in, d_out], or [R, N, d_out] for the featureless layer (then in_channels = N).
  `fast`: PyG's FastRGCNConv instead, the same layer (same parameters, same per-relation mean)
  computed with the per-edge weight W[etype] as one [E, d_in, d_out] tensor and a batched matmul.
  """
  import torch  # pylint: disable=g-import-not-at-top
  from torch_geometric.nn import FastRGCNConv, RGCNConv  # pylint: disable=g-import-not-at-top

  w = np.asarray(w)
  num_relations, d_in, d_out = w.shape
  dtype = dtype or getattr(torch, np.dtype(w.dtype).name)
  conv = (FastRGCNConv if fast else RGCNConv)(
    d_in,
    d_out,
    num_relations=num_relations,
    aggr="mean",
    root_weight=w_self is not None,
    bias=bias is not None,
    is_sorted=False,
  )
  conv = conv.to(device=device or torch_device(), dtype=dtype)
  with torch.no_grad():
    conv.weight.copy_(torch.from_numpy(w))
    if w_self is not None:
      conv.root.copy_(torch.from_numpy(np.asarray(w_self)))
    if bias is not None:
      conv.bias.copy_(torch.from_numpy(np.asarray(bias)))
  return conv


def pyg_graph(src, dst, etype, device=None):
  """(edge_index = [src; dst], edge_type) as int64 torch tensors."""
  import torch  # pylint: disable=g-import-not-at-top

  device = device or torch_device()
  edge_index = torch.from_numpy(np.stack([np.asarray(src), np.asarray(dst)]).astype(np.int64))
  edge_type = torch.from_numpy(np.asarray(etype).astype(np.int64))
  return edge_index.to(device), edge_type.to(device)


def pyg_forward(conv, x, edge_index, edge_type):
  """conv(x) for inference: under `torch.inference_mode()` (no autograd graph, nothing saved for a
  backward pass), RGCNConv kept on its per-relation loop. Put `conv` in eval mode first."""
  import torch  # pylint: disable=g-import-not-at-top

  with torch.inference_mode(), pyg_per_relation_mean():
    return conv(x, edge_index, edge_type)


def pyg_fast_bytes(num_edges: int, d_in: int, d_out: int, *, train: bool, itemsize: int = 4) -> int:
  """A lower bound on FastRGCNConv's memory: its per-edge W[etype], [E, d_in, d_out]; training
  also builds that tensor's gradient (and autograd keeps the gather's index), counted twice more.
  Used only on the CPU, where torch keeps no peak and the kernel's OOM killer does not raise."""
  return per_edge_weight_bytes(num_edges, d_in, d_out, itemsize) * (3 if train else 1)


def pyg_loss_and_grads(conv, x, edge_index, edge_type, ct):
  """One forward + backward of sum(conv(x) * ct); returns (loss, dx or None, dW).

  `x` is a leaf tensor with requires_grad (or None: featureless); gradients are cleared first.
  """
  conv.zero_grad(set_to_none=True)
  if x is not None:
    x.grad = None
  with pyg_per_relation_mean():
    out = conv(x, edge_index, edge_type)
  loss = (out * ct).sum()
  loss.backward()
  return loss, (None if x is None else x.grad), conv.weight.grad
