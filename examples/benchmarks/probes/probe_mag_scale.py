"""Times synthetic_mag's construction at a scale, phase by phase: drawing (nodes, samplers,
edges, features), the sorts, HeteroGraph, HostGraph.from_hetero; and the process's peak RSS.

    python3 probe_mag_scale.py 10 [threads]
"""

import resource
import sys
import time

from jaxdata.data import mag
from jaxdata.host import HostGraph

_seconds = {}


def _timed(name, fn):
  def wrapper(*args, **kwargs):
    t0 = time.perf_counter()
    try:
      return fn(*args, **kwargs)
    finally:
      _seconds[name] = _seconds.get(name, 0.0) + time.perf_counter() - t0

  return wrapper


def main():
  scale = float(sys.argv[1]) if len(sys.argv) > 1 else 10.0
  threads = int(sys.argv[2]) if len(sys.argv) > 2 else None
  # per-call sums (calls on several threads overlap: these are CPU-ish seconds, not wall)
  for name in ("_nodes", "_draw_edges", "_draw_features", "_sorted_pairs"):
    setattr(mag, name, _timed(name, getattr(mag, name)))
  t0 = time.perf_counter()
  ds = mag.synthetic_mag(scale=scale, threads=threads)
  t1 = time.perf_counter()
  print(
    f"synthetic_mag(scale={scale:g}, threads={threads or mag._threads(None)}): "
    f"{t1 - t0:.1f} s wall; {ds!r}"
  )
  print("  summed seconds per helper:", {k: round(v, 2) for k, v in _seconds.items()})
  host = HostGraph.from_hetero(ds.graph)
  t2 = time.perf_counter()
  print(f"HostGraph.from_hetero: {t2 - t1:.1f} s; construction total {t2 - t0:.1f} s")
  print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GiB")
  host.close()


if __name__ == "__main__":
  main()
