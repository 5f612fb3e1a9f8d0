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
  """Each test using this runs once per platform; the GPU run is skipped without a GPU (and,
  like every test, at matmul precision "highest" unless marked `default_precision`)."""
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


@pytest.fixture(autouse=True)
def _highest_precision_by_default(request):
  """Every test runs under `jax.default_matmul_precision("highest")` unless it is marked
  `default_precision`: tests compare formulations at float32 tolerances, while on a GPU a
  float32 matmul at JAX's default precision runs on TF32 tensor cores (about 1e-3 relative),
  which the H200 gate showed breaks those comparisons (hector's kernels follow the same default
  since issue 19: TF32 / bf16 tensor cores). Precision semantics are tested by the tests that
  opt out (tests/test_hector_precision.py) and by explicit `precision=` arguments.
  """
  if request.node.get_closest_marker("default_precision"):
    yield
  else:
    with jax.default_matmul_precision("highest"):
      yield


@pytest.fixture(autouse=True)
def _no_stale_effect_error():
  """After each test, no error of an effectful computation is left for later tests to raise.

  On a GPU JAX keeps the status of each device's last effectful computation (a side-effecting
  FFI call) and `jax.effects_barrier()` raises it, again and again, until another effectful
  computation runs on that device, even after the test caught it (the offload fault tests
  expect such errors): it once failed an unrelated trainer test, and JAX's exit hook prints it.
  One tiny successful scatter per device replaces it.
  """
  yield
  try:
    jax.effects_barrier()
  except (jax.errors.JaxRuntimeError, RuntimeError):
    import jax.numpy as jnp
    import numpy as np

    from jaxdata.host import HostTable, host_scatter_add

    with HostTable(np.zeros((1, 1), np.float32)) as table:
      for dev in jax.devices():
        with jax.default_device(dev):
          jax.block_until_ready(
            host_scatter_add(table, jnp.zeros(1, jnp.int32), jnp.zeros((1, 1), jnp.float32))
          )
