"""GPU smoke check of jaxdata.offload: round trips per tier, remat gradients against plain JAX."""

import os
import tempfile

# Bit-exact comparisons need one GEMM choice in every program (no TF32, no autotuned Triton).
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_triton_gemm=false --xla_gpu_autotune_level=0"
)

import jax
import jax.numpy as jnp

from jaxdata import offload

jax.config.update("jax_default_matmul_precision", "highest")
print("devices:", jax.devices())
d = tempfile.mkdtemp(dir="/var/tmp")
x = jax.random.normal(jax.random.PRNGKey(0), (1000, 1003), jnp.float32)
y = jnp.arange(7, dtype=jnp.int8)


def round_trip(st, site, tier):
  """A jitted spill of (x, y) to `tier` and load back, ordered after x * 2."""

  @jax.jit
  def rt(x, y):
    t = offload.spill([x, y], st, site=site, tier=tier)
    return offload.load(t, [x, y], st, site=site, after=[x * 2])

  return rt


with offload.TensorStore(
  ram_bytes=64 << 20, ssd_dir=d, chunk_bytes=1 << 20, staging_bytes=8 << 20
) as st:
  for tier in ("ram", "ssd", "auto"):
    a, b = round_trip(st, offload.new_site(), tier)(x, y)
    assert bool((a == x).all()) and bool((b == y).all()), tier
    print(
      tier, "round trip ok", {k: st.stats()[k] for k in ("spilled", "ssd_written", "device_peak")}
    )

  def block(w, h):
    return jnp.tanh(h @ w) @ w.T + h

  W = jax.random.normal(jax.random.PRNGKey(1), (6, 512, 512)) / 20
  h0 = jax.random.normal(jax.random.PRNGKey(2), (256, 512))

  def loss(W, h, policy):
    b = offload.remat(block, policy)
    h, _ = jax.lax.scan(lambda h, w: (b(w, h), None), h, W)
    return (h**2).sum()

  ref = jax.jit(jax.grad(loss), static_argnums=2)(W, h0, None)
  for pol in (
    offload.offload(st, "ram"),
    offload.offload(st, "ssd"),
    offload.offload(st, inner=jax.checkpoint_policies.dots_saveable),
  ):
    errs = []
    for _ in range(3):
      try:
        g = jax.block_until_ready(jax.jit(jax.grad(loss), static_argnums=2)(W, h0, pol))
        errs.append(float(jnp.abs(g - ref).max()))
      except Exception as e:  # pylint: disable=broad-except
        print("  error:", str(e)[:300])
    print("  per call max abs diff:", errs)
    err = max(errs) if errs else float("nan")
    print(pol, "grad max abs diff", err, "outstanding", st.stats()["outstanding"])
    assert err == 0.0 and st.stats()["outstanding"] == 0
print("offload smoke ok")
