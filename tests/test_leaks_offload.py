"""Leaks: loops of TensorStore create / spill / load / close, and of jitted steps under the
offload remat policy, must not grow RSS (budget 50 MB), nor leave a descriptor, a thread or a
file behind, nor hold bytes in the store between steps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from isolation import Resources

from jaxdata import offload

CHUNK = 4096
SITE = offload.new_site()  # one site for every cycle: a new site is a new compiled call


def _cycle(ssd_dir, tier, x, *, load=True):
  with offload.TensorStore(
    ram_bytes=1 << 20, ssd_dir=ssd_dir, chunk_bytes=CHUNK, staging_bytes=8 * CHUNK, io_threads=2
  ) as store:
    ticket = offload.spill([x], store, site=SITE, tier=tier)
    if load:
      y = offload.load(ticket, [x], store, site=SITE)[0]
      np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
      s = store.stats()
      assert s["outstanding"] == 0 and s["ram_in_use"] == 0 and s["ssd_in_use"] == 0, s
    else:
      jax.block_until_ready(ticket)


@pytest.mark.parametrize("tier, cycles", [("ram", 1000), ("ssd", 200)])
def test_store_cycles_leave_no_memory_descriptor_thread_or_file(device, tmp_path, tier, cycles):
  ssd_dir = str(tmp_path / "ssd") if tier == "ssd" else None
  x = jnp.arange(3001, dtype=jnp.float32)  # 3 chunks
  for _ in range(20):  # compiled, and JAX's own pools started
    _cycle(ssd_dir, tier, x)
  before = Resources.now(tmp_path)
  for _ in range(cycles):
    _cycle(ssd_dir, tier, x)
  Resources.now(tmp_path).assert_within(
    before, rss_bytes=50 << 20, what=f"{cycles} {tier} store cycles"
  )


def test_closing_stores_with_entries_never_loaded_frees_them(device, tmp_path):
  ssd_dir = str(tmp_path / "ssd")
  x = jnp.arange(3001, dtype=jnp.float32)
  for tier in ("ram", "ssd"):
    _cycle(ssd_dir, tier, x, load=False)
  before = Resources.now(tmp_path)
  for i in range(200):
    _cycle(ssd_dir, ("ram", "ssd")[i % 2], x, load=False)
  Resources.now(tmp_path).assert_within(
    before, rss_bytes=50 << 20, what="stores closed with entries outstanding"
  )


@pytest.mark.parametrize("tier", ["ram", "ssd"])
def test_jitted_remat_steps_hold_no_store_bytes_between_steps(device, tmp_path, tier):
  d = 32
  w = jax.random.normal(jax.random.key(0), (4, d, d), jnp.float32) / d**0.5
  x = jax.random.normal(jax.random.key(1), (16, d), jnp.float32)
  with offload.TensorStore(
    ram_bytes=1 << 20, ssd_dir=str(tmp_path / "ssd"), chunk_bytes=CHUNK, staging_bytes=8 * CHUNK
  ) as store:
    blk = offload.remat(lambda w, h: jnp.tanh(h @ w) + h, offload.offload(store, tier, min_bytes=0))

    @jax.jit
    def step(w, x):
      def loss(w):
        h, _ = jax.lax.scan(lambda h, wi: (blk(wi, h), None), x, w)
        return jnp.sum(h**2)

      g = jax.grad(loss)(w)
      return w - 1e-3 * g

    w = jax.block_until_ready(step(w, x))
    first = store.stats()
    before = Resources.now(tmp_path)
    for _ in range(300):
      w = step(w, x)
    jax.block_until_ready(w)
    s = store.stats()
    assert s["spills"] == 301 * 4 and s["loads"] == s["spills"], s
    assert s["outstanding"] == 0 and s["ram_in_use"] == 0 and s["ssd_in_use"] == 0, s
    assert s["ram_peak"] == first["ram_peak"] and s["ssd_peak"] == first["ssd_peak"], (first, s)
    Resources.now(tmp_path).assert_within(before, rss_bytes=50 << 20, what="300 remat steps")
