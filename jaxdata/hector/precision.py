"""Matmul precision of generated GEMMs, resolved as `jnp.dot` resolves it.

A hector layer's products (its GEMM and weight-gradient kernels) follow the `precision=`
argument of the call and, when that is None, ``jax.config.jax_default_matmul_precision`` (set
globally or by the ``jax.default_matmul_precision(...)`` context manager), exactly where
`jnp.dot` would look: at trace time. The result is one of two levels a kernel instance is
compiled for (part of its cache key):

* ``"default"``: tensor cores on a GPU. float32 operands are rounded to TF32 (10-bit mantissa,
  relative error about 5e-4 per product), bfloat16 operands multiply exactly; sums are float32.
  This is what `jnp.dot` does on NVIDIA GPUs at its default precision.
* ``"highest"``: float32-exact products (CUDA cores for float32 operands; bfloat16 operands
  still use tensor cores, whose bfloat16 products are exact).

On the CPU both levels compute float32-exact products, as `jnp.dot` does there.

    >>> import jax
    >>> from jaxdata.hector.precision import resolve
    >>> resolve(None)
    'default'
    >>> with jax.default_matmul_precision("highest"):
    ...   resolve(None)
    'highest'
    >>> resolve(jax.lax.Precision.HIGH)
    'default'

Names map as JAX's do: "default", "high", "bfloat16", "tensorfloat32" and the algorithm
presets of less than float32 accuracy (``TF32_TF32_F32``, ``BF16_BF16_F32``,
``BF16_BF16_F32_X3``, the F16 and F8 presets) give "default"; "highest", "float32" and the
presets of float32 accuracy or better (``F32_F32_F32``, ``F64_F64_F64``, ``TF32_TF32_F32_X3``,
``BF16_BF16_F32_X6``, ``BF16_BF16_F32_X9``) give "highest".
"""

from __future__ import annotations

import jax

#: the levels a kernel instance is compiled for
LEVELS = ("default", "highest")

_HIGHEST_NAMES = frozenset(
  {
    "highest",
    "float32",
    "f32_f32_f32",
    "f64_f64_f64",
    "tf32_tf32_f32_x3",
    "bf16_bf16_f32_x6",
    "bf16_bf16_f32_x9",
  }
)
_DEFAULT_NAMES = frozenset(
  {
    "default",
    "high",
    "bfloat16",
    "tensorfloat32",
    "fastest",
    "tf32_tf32_f32",
    "bf16_bf16_f32",
    "bf16_bf16_bf16",
    "bf16_bf16_f32_x3",
    "f16_f16_f16",
    "f16_f16_f32",
    "any_f8_any_f8_f32",
    "any_f8_any_f8_f32_fast_accum",
    "any_f8_any_f8_any",
    "any_f8_any_f8_any_fast_accum",
  }
)


def _level(p, what: str) -> str:
  if isinstance(p, (tuple, list)):  # jnp.dot's (lhs, rhs) pair: the more precise of the two
    if len(p) != 2:
      raise ValueError(f"{what}: a precision pair must have two entries, got {p!r}")
    levels = [_level(x, what) for x in p]
    return "highest" if "highest" in levels else "default"
  if isinstance(p, jax.lax.Precision):
    return "highest" if p == jax.lax.Precision.HIGHEST else "default"
  name = getattr(p, "name", p)  # a jax.lax.DotAlgorithmPreset
  if isinstance(name, str):
    key = name.lower()
    if key in _HIGHEST_NAMES:
      return "highest"
    if key in _DEFAULT_NAMES:
      return "default"
  raise ValueError(
    f"{what}: precision must be None, 'default', 'high', 'highest', a "
    f"jax.lax.Precision or a dot algorithm preset name, got {p!r}"
  )


def resolve(precision=None, what: str = "hector") -> str:
  """The level ("default" or "highest") that `precision` asks for; None defers to
  ``jax_default_matmul_precision`` (None there too: "default"). ValueError (naming `what`)
  for anything else."""
  if precision is None:
    # jax sets its flags on Config at runtime: no stub declares them
    precision = jax.config.jax_default_matmul_precision  # pyright: ignore[reportAttributeAccessIssue]
    if precision is None:
      return "default"
    what = f"{what} (jax_default_matmul_precision)"
  return _level(precision, what)
