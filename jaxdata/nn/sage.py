"""Flax NNX GraphSAGE with the mean aggregator (Hamilton et al., 2017) on sampled `Blocks`.

    h'_v = W_self h_v + W_neigh mean_{u in sampled N(v)} h_u + b

Sampling is tree-shaped (`jaxdata.host.Blocks`): the sampled neighbours of entry i of hop l are
entries i * f .. (i + 1) * f of hop l + 1, so aggregation is a reshape and a masked mean, with
no scatter. A model of L layers consumes L hops: layer k updates hops 0 .. L - k - 1.

    model = GraphSAGE(256, 256, 47, num_layers=2, rngs=nnx.Rngs(0))
    blocks = sample_neighbors(graph, seeds, (15, 10), key)
    logits = model(blocks.gather(graph.features), blocks.masks)   # [len(seeds), 47]
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx


class SAGEConv(nnx.Module):
  """One GraphSAGE layer, mean aggregator, on a hop and the hop sampled below it.

  Args:
    in_features, out_features: feature sizes.
    dtype: computation dtype (float32 or bfloat16); parameters stay float32.
    rngs: parameter initialization.
  """

  def __init__(self, in_features: int, out_features: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
    self.self_linear = nnx.Linear(in_features, out_features, dtype=dtype, rngs=rngs)
    self.neigh_linear = nnx.Linear(
      in_features, out_features, use_bias=False, dtype=dtype, rngs=rngs
    )

  def __call__(self, x: jax.Array, neighbours: jax.Array, mask: jax.Array) -> jax.Array:
    """x: [n, d]; neighbours: [n * f, d]; mask: [n * f] (False: padding, ignored)."""
    n = x.shape[0]
    if n == 0 or neighbours.shape[0] % n:
      raise ValueError(
        f"SAGEConv: {neighbours.shape[0]} neighbour rows do not split evenly over {n} nodes"
      )
    f = neighbours.shape[0] // n
    m = mask.reshape(n, f, 1).astype(neighbours.dtype)
    total = (neighbours.reshape(n, f, -1) * m).sum(axis=1)
    mean = total / jnp.maximum(m.sum(axis=1), 1)
    return self.self_linear(x) + self.neigh_linear(mean)


class GraphSAGE(nnx.Module):
  """A stack of `SAGEConv` layers with ReLU between them; logits for the seed nodes.

  Args:
    in_features: node feature size.
    hidden: hidden size.
    out_features: output size (classes).
    num_layers: layers, equal to the number of sampled hops.
    dtype: computation dtype.
    rngs: parameter initialization.
  """

  def __init__(
    self,
    in_features: int,
    hidden: int,
    out_features: int,
    *,
    num_layers: int = 2,
    dtype=jnp.float32,
    rngs: nnx.Rngs,
  ):
    if num_layers < 1:
      raise ValueError(f"GraphSAGE: num_layers must be >= 1, got {num_layers}")
    sizes = [in_features] + [hidden] * (num_layers - 1) + [out_features]
    layers = [SAGEConv(a, b, dtype=dtype, rngs=rngs) for a, b in zip(sizes[:-1], sizes[1:])]
    self.layers = nnx.List(layers) if hasattr(nnx, "List") else layers  # flax < 0.12: a list
    self.dtype = dtype

  def __call__(self, features: Sequence[jax.Array], masks: Sequence[jax.Array]) -> jax.Array:
    """features[l]: the rows of hop l's nodes; masks[l]: hop l's mask. Returns [len(hop 0), out]."""
    num_layers = len(self.layers)
    if len(features) != num_layers + 1 or len(masks) != num_layers + 1:
      raise ValueError(
        f"GraphSAGE: {num_layers} layers need {num_layers + 1} hops of features "
        f"and masks, got {len(features)} and {len(masks)}"
      )
    h = [x.astype(self.dtype) for x in features]
    for k, layer in enumerate(self.layers):
      h = [layer(h[l], h[l + 1], masks[l + 1]) for l in range(num_layers - k)]
      if k < num_layers - 1:
        h = [jax.nn.relu(x) for x in h]
    return h[0]
