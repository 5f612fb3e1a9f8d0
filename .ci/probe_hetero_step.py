"""Where a mini-batch HGT step's time goes, and how much of the data path the step hides (issue 16).

On synthetic_mag (default scale 1, as `jaxdata bench hetero`), fanouts 10,10, 1024 seeds, the
GPU-centric pipeline: times, each as its own jitted program queued `steps` times back to back,
(1) sampling the blocks (`sample_blocks`), (2) sampling + the feature gathers (`gather_typed`),
(3) the model's forward + backward + Adam update on blocks and features computed beforehand,
(4) the whole step. The data path is (2); if the whole step took (2) + (3), nothing of it is
hidden; (2) + (3) - (4) is what XLA overlaps inside one program. Then a profile of a few whole
steps lists the GPU kernels that take the time.

    python3 .ci/probe_hetero_step.py [scale] [steps]
"""
import collections
import glob
import shutil
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.profiler import ProfileData

from jaxdata.data import synthetic_mag
from jaxdata.host.blocks import sample_blocks
from jaxdata.train.attention import TrainConfig, build_model
from jaxdata.train.attention import minibatch as hetero


def timed(fn, args, steps):
  """Wall time per call, ms, of `steps` calls queued back to back (after a warm-up)."""
  jax.block_until_ready(fn(*args(0)))
  t0 = time.perf_counter()
  out = [fn(*args(i)) for i in range(1, steps + 1)]
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) / steps * 1e3


def main():
  scale = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
  steps = int(sys.argv[2]) if len(sys.argv) > 2 else 30
  ds = synthetic_mag(scale=scale, num_classes=349 if scale >= 0.3 else 8)
  config = TrainConfig(model="hgt")
  model = build_model(ds, config, nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  fanouts, batch = (10, 10), 1024
  rng = np.random.default_rng(0)
  train = np.asarray(ds.train_papers)
  seeds = [jnp.asarray(rng.choice(train, batch, replace=len(train) < batch).astype(np.int32))
           for _ in range(steps + 1)]
  keys = [jax.random.key(i) for i in range(steps + 1)]
  labels = jnp.asarray(ds.labels)
  with hetero.HostData(ds, "host", model) as data:
    @jax.jit
    def sample_only(s, k):
      return sample_blocks(data.host, s, fanouts, k, num_relations=data.num_relations)

    @jax.jit
    def data_path(s, k):
      return hetero.sample(data, data.consts, s, fanouts, k)

    def loss_fn(model, blocks, xs, s):
      logits, valid = hetero.logits_of(model, data, blocks, xs, s)
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels[jnp.maximum(s, 0)])
      return jnp.sum(jnp.where(valid, ce, 0)) / jnp.maximum(valid.sum(), 1)

    @nnx.jit
    def compute(model, optimizer, blocks, xs, s):
      loss, grads = nnx.value_and_grad(loss_fn)(model, blocks, xs, s)
      optimizer.update(model, grads)
      return loss

    @nnx.jit
    def whole(model, optimizer, s, k):
      blocks, xs = hetero.sample(data, data.consts, s, fanouts, k)
      loss, grads = nnx.value_and_grad(loss_fn)(model, blocks, xs, s)
      optimizer.update(model, grads)
      return loss

    prepared = [data_path(seeds[i], keys[i]) for i in range(steps + 1)]
    jax.block_until_ready(prepared)
    t_sample = timed(sample_only, lambda i: (seeds[i], keys[i]), steps)
    t_data = timed(data_path, lambda i: (seeds[i], keys[i]), steps)
    t_compute = timed(compute, lambda i: (model, optimizer, *prepared[i], seeds[i]), steps)
    t_whole = timed(whole, lambda i: (model, optimizer, seeds[i], keys[i]), steps)
    blocks = prepared[0][0]
    slots = [int(m.sum()) for m in blocks.masks]
    edges = [int((np.asarray(g.norm) > 0).sum()) for g in blocks.graphs]
    print(f"synthetic_mag scale {scale}: fanouts {fanouts}, {batch} seeds; frontier slots used "
          f"{slots} of {[m.shape[0] for m in blocks.masks]}; sampled edges per hop {edges}")
    print(f"sample only        {t_sample:7.2f} ms")
    print(f"sample + gathers   {t_data:7.2f} ms   (the data path)")
    print(f"model fwd+bwd+Adam {t_compute:7.2f} ms   (on prepared blocks and features)")
    print(f"whole step         {t_whole:7.2f} ms")
    hidden = t_data + t_compute - t_whole
    print(f"data path + model - whole = {hidden:.2f} ms hidden "
          f"({100 * hidden / t_data:.0f}% of the data path)")

    trace = tempfile.mkdtemp()
    jax.profiler.start_trace(trace)
    runs = min(5, steps + 1)
    jax.block_until_ready([whole(model, optimizer, seeds[i], keys[i]) for i in range(runs)])
    jax.profiler.stop_trace()
    for path in glob.glob(f"{trace}/**/*.xplane.pb", recursive=True):
      for plane in ProfileData.from_file(path).planes:
        if not plane.name.startswith("/device:GPU"):
          continue
        by = collections.defaultdict(lambda: [0, 0.0])
        total = 0
        for line in plane.lines:
          for e in line.events:
            by[e.name[:80]][0] += 1
            by[e.name[:80]][1] += e.duration_ns
            total += e.duration_ns
        print(f"{plane.name}: {total / runs / 1e6:.2f} ms of kernels per step (all streams)")
        for name, (n, t) in sorted(by.items(), key=lambda kv: -kv[1][1])[:25]:
          print(f"  {t / runs / 1e6:7.3f} ms/step  x{n // runs:<4d} {name}")
    shutil.rmtree(trace, ignore_errors=True)


if __name__ == "__main__":
  main()
