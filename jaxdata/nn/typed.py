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

  One GEMM: each type's rows of its features (the others zeroed) side by side, and each row's
  type one-hot, times the kernels and the biases stacked. A Linear per type over all N rows,
  masked to its type and summed, would read and write every row T times, forward and backward;
  a bias gathered by type would make its gradient a scatter-add of N rows into T (serialized
  on a GPU), where here it is part of the GEMM's.
  """
  cols = [jnp.where((types == t)[:, None], f, 0).astype(dtype) for t, f in enumerate(xs)]
  kernels = [lin.kernel[...] for lin in linears]
  biases = [lin.bias for lin in linears]
  if any(b is not None for b in biases):
    cols.append(jax.nn.one_hot(types, len(linears), dtype=dtype))  # a row of zeros for -1
    out = kernels[0].shape[-1]
    kernels.append(jnp.stack([jnp.zeros(out) if b is None else b[...] for b in biases]))
  kernel = jnp.concatenate(kernels).astype(dtype)
  return jnp.dot(jnp.concatenate(cols, 1), kernel, precision=precision)
