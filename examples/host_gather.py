"""Gather embedding rows from a table in host memory inside a jitted training step.

The table lives in pinned host memory; on a GPU, `host_gather` reads only the rows a batch needs,
straight over PCIe. Run: python examples/host_gather.py
"""

import jax
import jax.numpy as jnp
import numpy as np

from jaxdata.host import HostTable, host_gather

rows, dim, batch = 200_000, 128, 4096
rng = np.random.default_rng(0)
features = rng.standard_normal((rows, dim), dtype=np.float32)
labels = (features[:, :8].sum(axis=1) > 0).astype(np.int32)  # a learnable signal

with HostTable(features) as table:  # copied once into pinned memory; released at the end
  print(table)

  @jax.jit
  def step(w, idx, y):
    def loss(w):
      x = host_gather(table, idx)  # (batch, dim), on the device
      logits = x @ w
      return jnp.mean(jax.nn.softplus(logits) - y * logits)

    value, grad = jax.value_and_grad(loss)(w)
    return w - 0.5 * grad, value

  w = jnp.zeros((dim,))
  for i in range(200):
    idx = rng.integers(0, rows, size=batch)
    w, value = step(w, jnp.asarray(idx), jnp.asarray(labels[idx], jnp.float32))
    if i % 50 == 0 or i == 199:
      print(f"step {i:3d}  loss {float(value):.4f}")

  test = rng.integers(0, rows, size=20_000)
  pred = np.asarray(host_gather(table, jnp.asarray(test)) @ w) > 0
  print(f"accuracy on {test.size} rows: {np.mean(pred == labels[test]):.3f}")
