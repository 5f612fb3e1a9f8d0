"""How long building a large relational graph takes: native builders vs the NumPy formulations
(issue 16 item 1).

Draws a random graph (uniform ends and relations; not timed), then times on it
`HeteroGraph.from_edges` (validate + sort by (etype, dst, src)), `csr`, `csc`, `edge_norm`,
`relation_offsets`, `hector.runtime.unique_pairs` and `GraphArrays.from_graph` (its host part:
views, pairs, and the device_put of 17 arrays to the CPU device), then the same steps with the
NumPy formulations of `jaxdata.reference.graph` next to the native ones on a sized-down graph
(an eighth of the edges and nodes; the NumPy versions take about a minute at full size).

    python3 probe_graph_build.py [edges] [relations] [nodes]    # default 64M 500 4M

The bar (issue 16): from_edges + from_graph of the 64M-edge, 500-relation graph in at most 10 s
on the 16-core GPU machine.
"""

import gc
import resource
import sys
import time

import jax
import numpy as np

from jaxdata import _xla_ffi
from jaxdata.data import HeteroGraph, graph_build
from jaxdata.hector import runtime
from jaxdata.reference import graph as ref


def timed(label, f, width=28):
  start = time.perf_counter()
  out = f()
  print(f"  {label:<{width}} {time.perf_counter() - start:8.3f} s", flush=True)
  return out, time.perf_counter() - start


def draw(edges, relations, nodes, seed=0):
  rng = np.random.default_rng(seed)
  return (
    rng.integers(0, nodes, edges, dtype=np.int32),
    rng.integers(0, nodes, edges, dtype=np.int32),
    rng.integers(0, relations, edges, dtype=np.int32),
  )


def native_full(edges, relations, nodes):
  print(
    f"native, {edges:,} edges, {relations} relations, {nodes:,} nodes "
    f"(threads: {len(__import__('os').sched_getaffinity(0))})"
  )
  drawn = list(draw(edges, relations, nodes))
  names = [f"r{i}" for i in range(relations)]
  g, t_edges = timed(
    "from_edges", lambda: HeteroGraph.from_edges(*drawn, num_nodes=nodes, relation_names=names)
  )
  drawn.clear()  # free the input arrays
  ga, t_graph = timed(
    "GraphArrays.from_graph",
    lambda: runtime.GraphArrays.from_graph(g, device=jax.devices("cpu")[0]),
  )
  print(f"  {'from_edges + from_graph':<28} {t_edges + t_graph:8.3f} s   <- the bar: 10 s")
  del ga
  gc.collect()
  # each step alone (the graph caches its views, so they are timed through graph_build)
  timed("csr (group by src)", lambda: graph_build.group_by(g.src, g.num_nodes))
  timed("csc (group by dst)", lambda: graph_build.group_by(g.dst, g.num_nodes))
  timed("edge_norm mean", lambda: graph_build.mean_edge_norm(g.dst, g.etype))
  timed("relation_offsets", lambda: HeteroGraph.relation_offsets.func(g))
  timed("sorted check", lambda: graph_build.edges_sorted(g.src, g.dst, g.etype))
  timed("unique_pairs", lambda: runtime.unique_pairs(g.src, g.etype, g.num_nodes, g.num_relations))


def side_by_side(edges, relations, nodes):
  print(f"native vs NumPy, {edges:,} edges, {relations} relations, {nodes:,} nodes")
  src, dst, etype = draw(edges, relations, nodes, seed=1)
  rows = []

  def both(label, native, numpy):
    a, t_native = timed(label + " native", native, 36)
    b, t_numpy = timed(label + " NumPy", numpy, 36)
    rows.append((label, t_native, t_numpy))
    return a, b

  def numpy_sort():
    order = ref.sort_order(src, dst, etype, nodes, relations)
    return src[order], dst[order], etype[order]

  (s, d, t), _ = both(
    "sort by (etype, dst, src)",
    lambda: graph_build.sort_edges(src, dst, etype, nodes, relations),
    numpy_sort,
  )
  both("csr (group by src)", lambda: graph_build.group_by(s, nodes), lambda: ref.grouped(s, nodes))
  both("csc (group by dst)", lambda: graph_build.group_by(d, nodes), lambda: ref.grouped(d, nodes))
  both("edge_norm mean", lambda: graph_build.mean_edge_norm(d, t), lambda: ref.mean_edge_norm(d, t))
  both(
    "relation_offsets",
    lambda: np.searchsorted(t, np.arange(relations + 1, dtype=np.int32)),
    lambda: ref.relation_offsets(t, relations),
  )
  both("sorted check", lambda: graph_build.edges_sorted(s, d, t), lambda: ref.is_sorted(s, d, t))
  both(
    "unique_pairs",
    lambda: graph_build.unique_pairs(s, t, nodes, relations),
    lambda: ref.unique_pairs(s, t, nodes, relations),
  )
  total_native, total_numpy = sum(r[1] for r in rows), sum(r[2] for r in rows)
  print(
    f"  {'all of the above':<36} native {total_native:.3f} s, NumPy {total_numpy:.3f} s "
    f"({total_numpy / max(total_native, 1e-9):.1f}x)"
  )


def main():
  args = [int(float(a)) for a in sys.argv[1:4]]
  edges, relations, nodes = args + [64_000_000, 500, 4_000_000][len(args) :]
  assert _xla_ffi.graph_sort_edges  # the extension has the builders
  native_full(edges, relations, nodes)
  gc.collect()
  side_by_side(max(edges // 8, 1), relations, max(nodes // 8, 1))
  print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


if __name__ == "__main__":
  main()
