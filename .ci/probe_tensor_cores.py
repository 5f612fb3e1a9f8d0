"""Issue 19's tensor-core bar, measured: RGCN and RGAT forward + backward (hector's generated
kernels) on the 2M-edge, 500-relation synthetic graph at dims 64 and 128, float32 at "highest"
(the SIMT kernels, today's baseline), float32 at "default" (TF32 tensor cores) and bfloat16
(bf16 tensor cores), the median of 10 steps each, and each result's error against float64.

  python3 .ci/probe_tensor_cores.py [dims...]
"""
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxdata import hector
from jaxdata.bench import rgnn
from jaxdata.data import synthetic_entities


def timed(fn, *args, repeats=10):
  jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append(time.perf_counter() - t)
  return statistics.median(ts) * 1e3


def main(dims):
  ds = synthetic_entities(**rgnn.SYNTHETIC, num_classes=4, feature_dim=0, seed=0)
  graph = jax.device_put(hector.GraphArrays.from_graph(ds.graph))
  n, r = ds.graph.num_nodes, ds.graph.num_relations
  print(f"graph: {n:,} nodes, {ds.graph.num_edges:,} edges, {r} relations; {jax.devices()[0]}")
  heads = 4
  for model in ("rgcn", "rgat"):
    for dim in dims:
      rng = np.random.default_rng(dim)
      x = rng.standard_normal((n, dim), dtype=np.float32)
      w = (rng.standard_normal((r, dim, dim)) / np.sqrt(dim)).astype(np.float32)
      a = (rng.standard_normal((2, r, heads, dim // heads)) / np.sqrt(dim)).astype(np.float32)
      ct = rng.standard_normal((n, dim), dtype=np.float32)
      # on the device before timing, and the graph an argument: numpy inputs (or a captured
      # graph) would add host-to-device copies to every step (session 12's table did: 14.3 ms
      # for RGCN dim 64 where `jaxdata bench rgnn` measures 3.1 ms)
      x, w, a, ct = jax.device_put((x, w, a, ct))
      rows = {}
      for name, dtype, precision in (("f32 highest", jnp.float32, "highest"),
                                     ("f32 default (TF32)", jnp.float32, "default"),
                                     ("bf16 default", jnp.bfloat16, "default")):
        def loss(x, w, a, graph, ct, dtype=dtype, precision=precision):
          x, w, a = x.astype(dtype), w.astype(dtype), a.astype(dtype)
          if model == "rgcn":
            out = hector.rgcn_message(graph, x, w, precision=precision)
          else:
            out = hector.rgat_message(graph, x, w, a[0], a[1], precision=precision)
          return jnp.sum(out.astype(jnp.float32) * ct)
        step = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))
        ms = timed(step, x, w, a, graph, ct)
        value, grads = step(x, w, a, graph, ct)
        rows[name] = (ms, np.asarray(grads[0], np.float64))
        print(f"{model} dim {dim:4d} {name:20s} {ms:8.2f} ms", flush=True)
      base, ref = rows["f32 highest"]
      for name, (ms, g) in rows.items():
        err = np.abs(g - ref).max() / max(np.abs(ref).max(), 1e-30)
        print(f"{model} dim {dim:4d} {name:20s} speedup vs f32 highest {base / ms:5.2f}x;"
              f"  max |dx - dx_highest| / max |dx_highest| = {err:.2e}")


if __name__ == "__main__":
  main([int(d) for d in sys.argv[1:]] or [64, 128])
