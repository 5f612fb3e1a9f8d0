"""Per-node-type linear maps over the slots of a sampled block, whose node types are mixed."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx


def typed_linear(
  linears: Sequence[nnx.Linear], xs: Sequence[jax.Array], types: jax.Array, *, dtype, precision=None
) -> jax.Array:
  """Row i through its own type's Linear: ``linears[types[i]](xs[types[i]][i])``, 0 where
  ``types[i]`` is -1 (an unused slot). `xs[t]` is ``[N, d_t]``; only type t's rows of it are
  read. Returns ``[N, out]``.

  One GEMM: each type's rows of its features (the others zeroed) side by side, times the
  kernels stacked, plus each row's bias. A Linear per type over all N rows, masked to its type
  and summed, would read and write every row T times, forward and backward.
  """
  x = jnp.concatenate([jnp.where((types == t)[:, None], f, 0) for t, f in enumerate(xs)], 1)
  kernel = jnp.concatenate([lin.kernel[...] for lin in linears]).astype(dtype)
  y = jnp.dot(x.astype(dtype), kernel, precision=precision)
  if linears[0].bias is None:
    return y
  bias = jnp.stack([lin.bias[...] for lin in linears] + [jnp.zeros_like(linears[0].bias[...])])
  return y + bias.astype(dtype)[jnp.where(types >= 0, types, len(linears))]
