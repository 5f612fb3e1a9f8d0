"""Where the ~2.5 ms per step that two GPUs add to mini-batch GraphSAGE goes (issue 18).

Times the all-in-GPU and GPU-centric steps on one and two devices (a 1M-node graph), then
profiles a few two-device steps with JAX's profiler and prints, per GPU and stream, the kernels
that take the time and the gaps between them, and on the host how long each dispatch takes.

    python3 probe_sage_overhead.py [steps]
"""

import collections
import glob
import os
import shutil
import sys
import tempfile

import jax
import numpy as np
from jax.profiler import ProfileData

from jaxdata.data import powerlaw_graph
from jaxdata.host import HostGraph, HostTable
from jaxdata.train.sage import SageConfig, train


def summarize(path: str, top: int = 12) -> None:
  data = ProfileData.from_file(path)
  for plane in data.planes:
    if plane.name.startswith("/device:GPU"):
      for line in plane.lines:
        events = sorted(line.events, key=lambda e: e.start_ns)
        if not events:
          continue
        busy = sum(e.duration_ns for e in events)
        span = events[-1].end_ns - events[0].start_ns
        print(
          f"{plane.name} | {line.name}: {len(events)} events, busy {busy / 1e6:.2f} ms of "
          f"{span / 1e6:.2f} ms"
        )
        by = collections.defaultdict(lambda: [0, 0.0])
        for e in events:
          by[e.name[:90]][0] += 1
          by[e.name[:90]][1] += e.duration_ns
        for name, (n, t) in sorted(by.items(), key=lambda kv: -kv[1][1])[:top]:
          print(f"    {t / 1e6:8.3f} ms  x{n:<5d} {name}")
        gaps = [
          (b.start_ns - a.end_ns, a.name[:50], b.name[:50]) for a, b in zip(events, events[1:])
        ]
        gaps.sort(reverse=True)
        for g, a, b in gaps[:5]:
          print(f"    gap {g / 1e6:7.3f} ms after {a} before {b}")
    elif plane.name == "/host:CPU":
      for line in plane.lines:
        by = collections.defaultdict(lambda: [0, 0.0])
        for e in line.events:
          by[e.name[:90]][0] += 1
          by[e.name[:90]][1] += e.duration_ns
        rows = sorted(by.items(), key=lambda kv: -kv[1][1])[:6]
        calls = sorted(e.duration_ns for e in line.events if e.name.startswith("PjitFunction"))
        if calls:
          print(
            f"host | {line.name}: {len(calls)} jitted calls, median "
            f"{calls[len(calls) // 2] / 1e6:.3f} ms, max {calls[-1] / 1e6:.3f} ms"
          )
        if rows and rows[0][1][1] > 1e6:
          print(f"host | {line.name}:")
          for name, (n, t) in rows:
            print(f"    {t / 1e6:8.3f} ms  x{n:<5d} {name}")


def main() -> None:
  steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
  table = HostTable.empty((1_000_000, 256), np.float32)
  ds = powerlaw_graph(
    num_nodes=1_000_000, num_edges=20_000_000, feature_dim=256, features_out=table.as_numpy()
  )
  ndevs = (1, 2) if len(jax.devices()) > 1 else (1,)
  with HostGraph(ds.indptr, ds.indices, features=table) as g:
    for pipe in ("device", "host"):
      for ndev in ndevs:
        r = train(
          ds,
          SageConfig(pipeline=pipe, devices=ndev, epochs=2, max_batches=60, evaluate=False),
          graph=g,
        )
        h = r.history[-1]
        print(pipe, ndev, f"{1e3 * h['seconds'] / h['batches']:.2f} ms/batch", flush=True)
    # A steady-state trace: steps 10 to 10 + steps of one epoch, compile excluded.
    trace = tempfile.mkdtemp(prefix="sage-trace-")

    def on_batch(done, total):
      if done == 10:
        jax.profiler.start_trace(trace)
      elif done == 10 + steps:
        jax.block_until_ready(jax.numpy.zeros(()))
        jax.profiler.stop_trace()

    for pipe in ("device", "host"):
      ndev = ndevs[-1]
      train(
        ds,
        SageConfig(pipeline=pipe, devices=ndev, epochs=1, max_batches=steps + 20, evaluate=False),
        graph=g,
        on_batch=on_batch,
      )
      for path in glob.glob(os.path.join(trace, "**", "*.xplane.pb"), recursive=True):
        print(f"=== trace of {pipe} x{ndev}, {steps} steady steps: {path}")
        summarize(path)
        if os.environ.get("OUT"):
          shutil.copy(path, os.path.join(os.environ["OUT"], f"sage-{pipe}-x{ndev}.xplane.pb"))
        os.remove(path)


if __name__ == "__main__":
  main()
