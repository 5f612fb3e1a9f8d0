"""The GPU-centric mini-batch HGT step's device events, largest first, each with its part of the
step and its HLO op name: what `jaxdata bench hetero --breakdown` sums per part, listed.

On synthetic_mag (default scale 1, as `jaxdata bench hetero`), fanouts 10,10, 1024 seeds.

    python3 probe_hetero_step.py [scale] [top]
"""

import collections
import os
import sys

import jax
import numpy as np

from benchmarks import common, hetero
from jaxdata import timing
from jaxdata.data import synthetic_mag
from jaxdata.train.attention import TrainConfig


def main():
  scale = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
  top = int(sys.argv[2]) if len(sys.argv) > 2 else 40
  ds = synthetic_mag(scale=scale, num_classes=349 if scale >= 0.3 else 8)
  config = TrainConfig(model="hgt")
  rows = hetero._seed_rows(ds, 1024, 8, 0)
  row_bytes = [x.shape[1] * x.dtype.itemsize for x in ds.features]
  state, make = hetero._trainer(ds, config)
  key = jax.random.key(0)
  with hetero.make_loader(ds, "host", (10, 10)) as loader:
    step = make(hetero._whole_loss(loader.type_offsets, row_bytes, loader.caches))
    all_rows, i = jax.device_put(rows), jax.device_put(np.int32(0))
    compiled = step.lower(state, i, loader, all_rows, key).compile(
      compiler_options={"xla_gpu_enable_command_buffer": ""}
    )
    text = compiled.as_text()
    print("compiled step:", {op: text.count(f" {op}(") for op in ("while", "sort", "custom-call")})
    if os.environ.get("OUT"):
      with open(os.path.join(os.environ["OUT"], "step_hlo.txt"), "w") as f:
        f.write(text)
    holder = {"s": state, "i": i}

    def call():
      holder["s"], holder["i"], loss, _ = compiled(holder["s"], holder["i"], loader, all_rows, key)
      return loss

    runs = 5
    by = collections.defaultdict(lambda: [0, 0])
    for start, end, kernel, name in timing.device_events(call, text, runs=runs):
      k = (common.part_of(name), kernel[:60], name[-90:])
      by[k][0] += 1
      by[k][1] += end - start
    total = sum(t for _, t in by.values()) / runs / 1e6
    print(f"device events: {total:.3f} ms per step")
    for (part, kernel, name), (n, t) in sorted(by.items(), key=lambda kv: -kv[1][1])[:top]:
      print(f"{t / runs / 1e6:7.3f} x{n // runs:<3d} {part[:14]:14s} {kernel[:45]:45s} {name}")


if __name__ == "__main__":
  main()
