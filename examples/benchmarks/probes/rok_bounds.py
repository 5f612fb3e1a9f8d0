"""What bounds the ROK curve at small budgets, measured on the GPU (rok_notes.md uses these).

Times the full-size GPT step of `jaxdata rok` (keep everything) whole and forward only (the
window in which offloaded residuals must cross PCIe), and the link itself: one 1 GiB array
device -> pinned host and back through XLA's own transfers (no jaxdata code), and through the
TensorStore's spill + load. Run: python3 rok_bounds.py  (about a minute on an H200).
"""

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks import rok
from jaxdata import offload
from jaxdata.timing import median_seconds


def time_gpt() -> tuple[float, float]:
  """Seconds of the keep-everything step and of its forward alone.

  The model is local, so its parameters are freed before the 1 GiB transfers below.
  """
  model, tokens = rok.model_and_tokens(**rok.FULL, loss_chunk=256)
  graphdef, params = nnx.split(model)

  def loss(params, tokens):
    return nnx.merge(graphdef, params).loss(tokens)

  step = jax.jit(jax.value_and_grad(loss))
  forward = jax.jit(loss)
  t_step = median_seconds(lambda: step(params, tokens), repeats=5)
  t_fwd = median_seconds(lambda: forward(params, tokens), repeats=5)
  return t_step, t_fwd


t_step, t_fwd = time_gpt()
print(
  f"keep-everything step {t_step * 1e3:.1f} ms; forward only {t_fwd * 1e3:.1f} ms "
  f"({t_fwd / t_step:.0%} of the step)"
)

x = jnp.ones((1 << 29,), jnp.bfloat16)  # 1 GiB
dev = x.sharding
host = dev.with_memory_kind("pinned_host")
d2h = median_seconds(lambda: jax.device_put(x, host), repeats=5)
y = jax.device_put(x, host)
h2d = median_seconds(lambda: jax.device_put(y, dev), repeats=5)
print(
  f"XLA transfers of 1 GiB: device -> pinned host {x.nbytes / d2h / 1e9:.1f} GB/s, "
  f"pinned host -> device {x.nbytes / h2d / 1e9:.1f} GB/s"
)
with offload.TensorStore(ram_bytes=2 << 30) as store:
  bw = offload.planner.store_bandwidth(store, 1 << 30)
print(f"TensorStore spill + load round trip of 1 GiB: {bw / 1e9:.1f} GB/s each way")
print(f"at that bandwidth the forward window moves {bw * t_fwd / 2**30:.1f} GiB")
