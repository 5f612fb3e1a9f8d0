"""Loads jaxdata's native extension and registers its XLA FFI targets, once, at import.

Every target has the same name and semantics on "cpu" and "CUDA"; the CUDA handlers exist only
when the extension was built with a CUDA toolkit (see `jaxdata info`).
"""

from __future__ import annotations

import functools

import jax

from jaxdata import _xla_ffi as ext


def _register() -> dict[str, tuple[str, ...]]:
  registered = {}
  for name, platforms in ext.registrations().items():
    for platform, capsule in platforms.items():
      jax.ffi.register_ffi_target(name, capsule, platform=platform)
    registered[name] = tuple(platforms)
  return registered


#: {target name: platforms it was registered for}
TARGETS: dict[str, tuple[str, ...]] = _register()


def built_with_cuda() -> bool:
  """Whether the extension holds the CUDA kernels."""
  return ext.built_with_cuda()


@functools.cache
def cuda_device_count() -> int:
  """GPUs the extension's CUDA runtime sees (0 when not built with CUDA or no driver)."""
  return ext.cuda_device_count() if ext.built_with_cuda() else 0


def cuda_versions() -> tuple[str, str]:
  """(CUDA runtime built in, driver) as 'major.minor'; 'none' for what is missing."""
  fmt = lambda v: f"{v // 1000}.{v % 1000 // 10}" if v else "none"  # noqa: E731
  if not ext.built_with_cuda():
    return "none", "none"
  return fmt(ext.cuda_runtime_version()), fmt(ext.cuda_driver_version())


def jax_gpus() -> list[jax.Device]:
  """The GPUs JAX itself uses (empty on a CPU-only JAX)."""
  try:
    return jax.devices("gpu")
  except RuntimeError:
    return []
