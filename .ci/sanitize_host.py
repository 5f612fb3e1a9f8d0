"""Runs the sampling and scatter-add kernels on the GPU, for compute-sanitizer (see .ci/gpu).

Covers typed graphs (relations read beside the neighbours), padded and out-of-range seeds, nodes
without neighbours, degree below and above the fanout, with and without replacement, host and device
CSR; scatter-add with repeated, negative and out-of-range indices in every dtype. Exits non-zero if
a GPU result differs from the CPU's.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxdata.host import DeviceGraph, HostGraph, HostTable, host_scatter_add, sample_neighbors

jax.config.update("jax_enable_x64", True)
rng = np.random.default_rng(0)
gpu, cpu = jax.devices("gpu")[0], jax.devices("cpu")[0]
bad = 0
n = 3000
senders = rng.integers(0, n, 40_000)
receivers = rng.zipf(1.5, 40_000) % n  # heavy-tailed: hubs and nodes without neighbours
etypes = rng.integers(0, 5, 40_000)  # the typed sampler reads a relation beside each neighbour
with (
  HostGraph.from_edges(senders, receivers, n) as g,
  HostGraph.from_edges(senders, receivers, n, etypes=etypes) as typed,
):
  seeds = np.concatenate([rng.integers(0, n, 500), [-1, -5]]).astype(np.int32)
  for replace in (False, True):
    for fanouts in ((3,), (25, 4), (1, 1, 1)):
      out = {}
      for name, dev in (("gpu", gpu), ("cpu", cpu)):
        with jax.default_device(dev):
          for kind, graph in (
            ("host", g),
            ("device", DeviceGraph.from_host(g, dev)),
            ("typed host", typed),
            ("typed device", DeviceGraph.from_host(typed, dev)),
          ):
            b = sample_neighbors(
              graph, jnp.asarray(seeds), fanouts, jax.random.key(1), replace=replace
            )
            out[name, kind] = [np.asarray(x) for x in b.nodes + b.masks]
            if b.etypes is not None:
              out[name, kind + " etypes"] = [np.asarray(x) for x in b.etypes]
      ref, ref_t = out["cpu", "host"], out["cpu", "typed host etypes"]
      same = all(
        all(np.array_equal(a, r) for a, r in zip(v, ref_t if "etypes" in k[1] else ref))
        for k, v in out.items()
      )
      bad += not same
      print(f"sample fanouts={fanouts} replace={replace}: {'ok' if same else 'WRONG'}")

for dtype in (np.float32, np.float64, ml_dtypes.bfloat16, np.float16, np.int32, np.int64):
  base = rng.integers(-50, 50, size=(257, 33)).astype(dtype)
  idx = rng.integers(-300, 300, size=4000)
  upd = rng.integers(-3, 4, size=(4000, 33)).astype(dtype)
  want = base.copy()
  ok = (idx >= -257) & (idx < 257)
  np.add.at(want, idx[ok], upd[ok])
  with HostTable(base) as t, jax.default_device(gpu):
    jax.block_until_ready(host_scatter_add(t, jnp.asarray(idx), jnp.asarray(upd)))
    same = np.array_equal(t.as_numpy(), want)
  bad += not same
  print(f"scatter_add {np.dtype(dtype).name}: {'ok' if same else 'WRONG'}")
print("mismatches:", bad)
raise SystemExit(1 if bad else 0)
