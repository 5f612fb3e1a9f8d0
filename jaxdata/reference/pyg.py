"""PyTorch Geometric's versions of the layers in `jaxdata.reference`, holding the same weights:
RGCNConv and FastRGCNConv (RGCN), RGATConv and HGTConv, with the conversions between their
parameters and ours. The peers of the tests (tests/test_rgcn_oracle.py,
tests/test_reference_attention.py) and of the benchmarks; importing this module needs torch and
torch_geometric (`pip install -e ".[oracle]"`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np
import torch
import torch_geometric.backend
from torch_geometric.nn import FastRGCNConv, HGTConv, RGATConv, RGCNConv

from jaxdata.reference.attention import NEGATIVE_SLOPE, HGTParams, RGATParams


@contextlib.contextmanager
def pyg_per_relation_mean():
  """Keeps RGCNConv on its per-relation loop.

  With pyg_lib installed, RGCNConv may switch (by a size heuristic) to `segment_matmul`, whose
  aggr="mean" averages over all in-edges of a node instead of per relation (a TODO in its
  `message`): another layer. Switching it off keeps PyG computing the RGCN of the paper.
  """

  saved = torch_geometric.backend.use_segment_matmul
  torch_geometric.backend.use_segment_matmul = False
  try:
    yield
  finally:
    torch_geometric.backend.use_segment_matmul = saved


def torch_device():
  """CUDA when torch sees a GPU, else the CPU."""

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

  device = device or torch_device()
  edge_index = torch.from_numpy(np.stack([np.asarray(src), np.asarray(dst)]).astype(np.int64))
  edge_type = torch.from_numpy(np.asarray(etype).astype(np.int64))
  return edge_index.to(device), edge_type.to(device)


def pyg_forward(conv, x, edge_index, edge_type):
  """conv(x) for inference: under `torch.inference_mode()` (no autograd graph, nothing saved for a
  backward pass), RGCNConv kept on its per-relation loop. Put `conv` in eval mode first."""

  with torch.inference_mode(), pyg_per_relation_mean():
    return conv(x, edge_index, edge_type)


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


def _block_diagonal(matrix: np.ndarray, heads: int, what: str) -> np.ndarray:
  """[H*d, H] with column h nonzero only in rows h*d:(h+1)*d -> its blocks as [H, d]."""
  d = matrix.shape[0] // heads
  blocks = matrix.reshape(heads, d, heads)
  vectors = np.stack([blocks[h, :, h] for h in range(heads)])
  off = blocks.copy()
  for h in range(heads):
    off[h, :, h] = 0
  if np.any(off != 0):
    raise ValueError(
      f"RGATConv's {what} mixes heads (nonzero outside its head-diagonal "
      f"blocks); per-head attention vectors cannot express it"
    )
  return vectors


def rgat_params_from_pyg(conv) -> RGATParams:
  """Our weights computing what `conv`, a PyG RGATConv, computes (float64 NumPy arrays).

  Needs dim=1, no bases/blocks, and q, k head-block-diagonal (always so when heads=1); the
  shared attention vectors are repeated for every relation. The bias, if any, is not ours.
  """
  if conv.dim != 1 or conv.num_bases is not None or conv.num_blocks is not None:
    raise ValueError("rgat_params_from_pyg needs RGATConv(dim=1) without bases or blocks")
  get = lambda p: p.detach().cpu().double().numpy()  # noqa: E731
  w, heads, r = get(conv.weight), conv.heads, conv.num_relations
  a_dst = _block_diagonal(get(conv.q), heads, "q")
  a_src = _block_diagonal(get(conv.k), heads, "k")
  return RGATParams(
    w,
    np.broadcast_to(a_src, (r, *a_src.shape)).copy(),
    np.broadcast_to(a_dst, (r, *a_dst.shape)).copy(),
  )


def pyg_rgat_conv(params: RGATParams, *, device=None, dtype=None):
  """A PyG RGATConv (additive, across-relation, concat, no bias) computing our layer.

  Needs a_src and a_dst equal across relations (PyG's are shared); q, k get the per-head
  vectors on their block diagonal.
  """

  w, a_src, a_dst = (np.asarray(a, np.float64) for a in params)
  r, d_in, f = w.shape
  heads, d = a_src.shape[1:]
  if not (np.all(a_src == a_src[:1]) and np.all(a_dst == a_dst[:1])):
    raise ValueError(
      "pyg_rgat_conv: PyG shares attention vectors across relations; these differ between relations"
    )
  conv = RGATConv(
    d_in,
    d,
    num_relations=r,
    heads=heads,
    dim=1,
    concat=True,
    bias=False,
    attention_mode="additive-self-attention",
    attention_mechanism="across-relation",
    negative_slope=NEGATIVE_SLOPE,
  )
  q, k = np.zeros((f, heads)), np.zeros((f, heads))
  for h in range(heads):
    q[h * d : (h + 1) * d, h] = a_dst[0, h]
    k[h * d : (h + 1) * d, h] = a_src[0, h]
  conv = conv.to(device=device or torch_device(), dtype=dtype or torch.float32)
  with torch.no_grad():
    for param, value in ((conv.weight, w), (conv.q, q), (conv.k, k)):
      param.copy_(torch.tensor(value))
  return conv


def _pyg_name(relation) -> str:
  return "__".join(relation)


def hgt_params_from_pyg(
  conv, node_types: Sequence[str], relation_types: Sequence[tuple[str, str, str]]
) -> HGTParams:
  """Our weights computing what `conv`, a PyG HGTConv, computes (float64 NumPy arrays).

  `node_types[t]` names our type t and `relation_types[r]` = (src type, name, dst type) our
  relation r; they must be conv's metadata (any order).
  """
  get = lambda p: p.detach().cpu().double().numpy()  # noqa: E731
  f, heads = conv.out_channels, conv.heads
  d = f // heads
  k_w, k_b, q_w, q_b, v_w, v_b, a_w, a_b = ([] for _ in range(8))
  for t in node_types:
    lin = conv.kqv_lin.lins[t]
    w, b = get(lin.weight).T, get(lin.bias)  # torch's Linear: x @ weight.T + bias
    for ws, bs, part in ((k_w, k_b, 0), (q_w, q_b, 1), (v_w, v_b, 2)):
      ws.append(w[:, part * f : (part + 1) * f])
      bs.append(b[part * f : (part + 1) * f])
    out = conv.out_lin.lins[t]
    a_w.append(get(out.weight).T)
    a_b.append(get(out.bias))
  # k_rel / v_rel hold one [d, d] matrix per (head h, relation index i) at h * R_pyg + i.
  index = [conv.edge_types_map[tuple(rel)] for rel in relation_types]
  num = len(conv.edge_types)
  per = lambda lin: get(lin.weight).reshape(heads, num, d, d)[:, index].swapaxes(0, 1)  # noqa
  mu = np.stack([get(conv.p_rel[_pyg_name(rel)])[0] for rel in relation_types])
  skip = np.concatenate([get(conv.skip[t]) for t in node_types])
  return HGTParams(
    tuple(k_w),
    tuple(k_b),
    tuple(q_w),
    tuple(q_b),
    tuple(v_w),
    tuple(v_b),
    tuple(a_w),
    tuple(a_b),
    per(conv.k_rel),
    per(conv.v_rel),
    mu,
    skip,
  )


def pyg_hgt_conv(
  params: HGTParams,
  node_types: Sequence[str],
  relation_types: Sequence[tuple[str, str, str]],
  *,
  device=None,
  dtype=None,
):
  """A PyG HGTConv holding our weights (needs d_out == H * d_k), metadata in our order."""

  heads, d = params.heads, params.head_features
  f = heads * d
  if any(np.shape(w)[1] != f for w in params.a_w):
    raise ValueError(f"pyg_hgt_conv: PyG's HGTConv needs d_out == H * d_k = {f}")
  relation_types = [tuple(rel) for rel in relation_types]
  in_channels = {t: int(np.shape(w)[0]) for t, w in zip(node_types, params.k_w)}
  conv = HGTConv(in_channels, f, (list(node_types), relation_types), heads=heads)
  conv = conv.to(device=device or torch_device(), dtype=dtype or torch.float32)
  arr = lambda a: torch.tensor(np.asarray(a, np.float64))  # noqa: E731  (copies)
  num = len(relation_types)
  with torch.no_grad():
    for t, name in enumerate(node_types):
      lin = conv.kqv_lin.lins[name]
      lin.weight.copy_(arr(np.concatenate([params.k_w[t], params.q_w[t], params.v_w[t]], axis=1).T))
      lin.bias.copy_(arr(np.concatenate([params.k_b[t], params.q_b[t], params.v_b[t]])))
      conv.out_lin.lins[name].weight.copy_(arr(np.asarray(params.a_w[t]).T))
      conv.out_lin.lins[name].bias.copy_(arr(params.a_b[t]))
      conv.skip[name].copy_(arr(np.asarray(params.skip)[t : t + 1]))
    for lin, w in ((conv.k_rel, params.w_att), (conv.v_rel, params.w_msg)):
      lin.weight.copy_(arr(np.asarray(w).swapaxes(0, 1).reshape(heads * num, d, d)))
    for r, rel in enumerate(relation_types):
      conv.p_rel[_pyg_name(rel)].copy_(arr(np.asarray(params.mu)[r : r + 1]))
  return conv


def pyg_hetero_inputs(
  src,
  dst,
  etype,
  xs,
  node_types: Sequence[str],
  relation_types: Sequence[tuple[str, str, str]],
  *,
  device=None,
):
  """(x_dict, edge_index_dict) for HGTConv from global ids; edge types in our relation order.

  Node type t owns ids [offsets[t], offsets[t+1]) with offsets from the row counts of xs; each
  relation's edges become local ids of its source and destination types. HGTConv's relation
  weights (`k_rel`, `is_sorted=True`) assume the dict iterates in the conv's metadata order:
  build the conv with `relation_types` as its metadata (`pyg_hgt_conv` does) or reorder.
  """

  device = device or torch_device()
  offsets = dict(zip(node_types, np.cumsum([0] + [len(x) for x in xs])))
  src, dst, etype = (np.asarray(a, np.int64) for a in (src, dst, etype))
  x_dict = {t: x for t, x in zip(node_types, xs)}
  edge_index_dict = {}
  for r, rel in enumerate(relation_types):
    mine = etype == r
    pair = np.stack([src[mine] - offsets[rel[0]], dst[mine] - offsets[rel[2]]])
    edge_index_dict[tuple(rel)] = torch.from_numpy(pair).to(device)
  return x_dict, edge_index_dict
