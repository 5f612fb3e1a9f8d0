"""Where a mini-batch HGT step's time goes, and how much of the data path the step hides (issue 16).

On synthetic_mag (default scale 1, as `jaxdata bench hetero`), fanouts 10,10, 1024 seeds, the
GPU-centric pipeline: times, each as its own jitted program queued `steps` times back to back,
(1) sampling the blocks (`sample_blocks`), (2) sampling + the feature gathers (`gather_typed`),
(3) the model's forward + backward + Adam update on blocks and features computed beforehand,
(4) the whole step: wall time per call (host dispatch included) and GPU kernel time per call
(from JAX's profiler; on one stream a step's kernels run one after another, so the kernel time
of (4) against (2) + (3) says what, if anything, overlaps). Then the whole step's kernels.

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
from jaxdata.loader.blocks import sample_blocks
from jaxdata.train.attention import TrainConfig, build_model
from jaxdata.train.attention import minibatch as hetero


def timed(fn, args, steps):
  """Wall time per call, ms, of `steps` calls queued back to back (after a warm-up). Includes
  the host's dispatch (nnx.jit walks the model and optimizer on every call)."""
  jax.block_until_ready(fn(*args(0)))
  t0 = time.perf_counter()
  out = [fn(*args(i)) for i in range(1, steps + 1)]
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) / steps * 1e3


def kernels(fn, args, runs=5):
  """(GPU kernel ms per call, {kernel name: [launches, ns]}) from a profile of `runs` calls."""
  jax.block_until_ready(fn(*args(0)))
  trace = tempfile.mkdtemp()
  jax.profiler.start_trace(trace)
  jax.block_until_ready([fn(*args(i)) for i in range(runs)])
  jax.profiler.stop_trace()
  by, total = collections.defaultdict(lambda: [0, 0]), 0
  for path in glob.glob(f"{trace}/**/*.xplane.pb", recursive=True):
    for plane in ProfileData.from_file(path).planes:
      if plane.name.startswith("/device:GPU"):
        for line in plane.lines:
          for e in line.events:
            by[e.name[:80]][0] += 1
            by[e.name[:80]][1] += e.duration_ns
            total += e.duration_ns
  shutil.rmtree(trace, ignore_errors=True)
  return total / runs / 1e6, by


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
  seeds = [
    jnp.asarray(rng.choice(train, batch, replace=len(train) < batch).astype(np.int32))
    for _ in range(steps + 1)
  ]
  keys = [jax.random.key(i) for i in range(steps + 1)]
  embeddings = {t: np.asarray(x.embedding[...]) for t, x in zip(model.embedded, model.tables)}
  with hetero.make_loader(ds, "host", fanouts, embeddings=embeddings) as data:

    @jax.jit
    def sample_only(s, k):
      return sample_blocks(data.graph, s, fanouts, k, num_relations=data.num_relations)

    @jax.jit
    def data_path(s, k):
      return data.sample(s, k)

    def loss_fn(model, batch):
      total, (_, count) = hetero.summed_loss(model, batch)
      return total / jnp.maximum(count, 1)

    @nnx.jit
    def compute(model, optimizer, batch, s):
      del s
      loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
      optimizer.update(model, grads)
      return loss

    @nnx.jit
    def whole(model, optimizer, s, k):
      loss, grads = nnx.value_and_grad(loss_fn)(model, data.sample(s, k))
      optimizer.update(model, grads)
      return loss

    prepared = [data_path(seeds[i], keys[i]) for i in range(steps + 1)]
    jax.block_until_ready(prepared)
    phases = {
      "sample only": (sample_only, lambda i: (seeds[i], keys[i])),
      "sample + gathers (the data path)": (data_path, lambda i: (seeds[i], keys[i])),
      "model fwd+bwd+Adam on prepared inputs": (
        compute,
        lambda i: (model, optimizer, prepared[i], seeds[i]),
      ),
      "whole step": (whole, lambda i: (model, optimizer, seeds[i], keys[i])),
    }
    blocks = prepared[0].blocks
    slots = [int(m.sum()) for m in blocks.masks]
    edges = [int((np.asarray(g.norm) > 0).sum()) for g in blocks.graphs]
    print(
      f"synthetic_mag scale {scale}: fanouts {fanouts}, {batch} seeds; frontier slots used "
      f"{slots} of {[m.shape[0] for m in blocks.masks]}; sampled edges per hop {edges}"
    )
    print(f"{'':40s} {'wall ms/call':>12s} {'GPU kernel ms/call':>19s}")
    profiles = {}
    for name, (fn, args) in phases.items():
      wall = timed(fn, args, steps)
      gpu, by = kernels(fn, args, min(5, steps + 1))
      profiles[name] = by
      print(f"{name:40s} {wall:12.2f} {gpu:19.2f}")
    runs = min(5, steps + 1)
    print("whole step, GPU kernels by time (all streams):")
    for name, (n, t) in sorted(profiles["whole step"].items(), key=lambda kv: -kv[1][1])[:25]:
      print(f"  {t / runs / 1e6:7.3f} ms/step  x{n // runs:<4d} {name}")


if __name__ == "__main__":
  main()
