"""Shared test setup: tests run on the CPU and, where JAX sees one, on a GPU (marked `gpu`)."""
import os

# Two CPU devices, for the shard_map test; must be set before JAX starts.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", True)  # 64-bit tables and indices are part of the contract


def _gpus():
  try:
    return jax.devices("gpu")
  except RuntimeError:
    return []


@pytest.fixture(params=["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def device(request):
  """Each test using this runs once per platform; the GPU run is skipped without a GPU."""
  if request.param == "gpu":
    gpus = _gpus()
    if not gpus:
      pytest.skip("no GPU visible to JAX")
    from jaxdata import _ffi
    if not _ffi.built_with_cuda():
      pytest.fail("JAX sees a GPU but jaxdata was built without CUDA")
    dev = gpus[0]
  else:
    dev = jax.devices("cpu")[0]
  with jax.default_device(dev):
    yield dev
