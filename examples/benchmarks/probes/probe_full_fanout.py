"""Where the time of a full-fanout block sample goes (session 14: test_train_hetero's full-fanout
GPU tests took 320-340 s each on the H200 against 15-50 s for the same tests on a 2-core CPU).

The test's graph: synthetic_mag(scale=5e-4) (969 nodes, 21,112 edges, in-degree up to 683);
17 seeds, two hops. On a 2-core CPU, sampling the (683, 683) blocks (7.9M second-hop slots)
takes 12 s and the model's forward on them adds under 1 s, so the sample is the cost. This
times each stage of the second hop on its own (each jitted, compiled, then run `--runs`
times): the typed neighbour draw, `expand` (the frontier's dedup: a stable argsort and a
cummax), `block_graph` (lexsorts, argsorts, searchsorted, cumsums), for fanouts (683, F).

    python3 probe_full_fanout.py [--fanouts 20,683] [--runs 1]
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxdata.data import synthetic_mag
from jaxdata.hector import block
from jaxdata.host import DeviceGraph, sample_neighbors
from jaxdata.train.attention import minibatch as hetero


def timed(name, runs, fn, *args):
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  first = time.perf_counter() - t0
  best = float("inf")
  for _ in range(runs):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - t0)
  print(f"  {name:<34} compile+run {first:8.2f} s   run {best:9.4f} s", flush=True)
  return out


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--fanouts", default="20,683")
  p.add_argument("--runs", type=int, default=1)
  a = p.parse_args()
  print(jax.devices(), jax.__version__, flush=True)
  ds = synthetic_mag(scale=5e-4, seed=1, num_classes=4)
  width = int(ds.graph.in_degree().max())
  seeds = jnp.asarray(np.r_[np.arange(0, 40, 3), 6, -1].astype(np.int32))
  key = jax.random.key(0)
  with hetero.make_loader(ds, "device", (width,)) as data:
    graph = data.graph
    assert isinstance(graph, DeviceGraph), type(graph)
    r = data.num_relations
    nodes, mask = block.frontier(seeds)
    drawn = sample_neighbors(graph, jnp.where(mask, nodes, -1), (width,), key)
    shape = (nodes.shape[0], width)
    nodes, mask, _ = block.expand(
      nodes,
      mask,
      drawn.nodes[1].reshape(shape),
      drawn.masks[1].reshape(shape),
      drawn.etypes[1].reshape(shape),
    )
    for fan in (int(f) for f in a.fanouts.split(",")):
      second_hop(graph, nodes, mask, key, r, fan, a.runs)


def second_hop(graph, nodes, mask, key, r, fan, runs):
  """Times the second hop at fanout `fan` and its parts, from the first hop's frontier."""
  print(
    f"second hop: {nodes.shape[0]} frontier slots x fanout {fan} = "
    f"{nodes.shape[0] * fan} edge slots",
    flush=True,
  )
  draw = jax.jit(lambda g, n, m: sample_neighbors(g, jnp.where(m, n, -1), (fan,), key))
  d = timed("sample_neighbors", runs, draw, graph, nodes, mask)
  sh = (nodes.shape[0], fan)
  ex = jax.jit(
    lambda n, m, d: block.expand(
      n, m, d.nodes[1].reshape(sh), d.masks[1].reshape(sh), d.etypes[1].reshape(sh)
    )
  )
  nodes1, _, edges = timed("expand", runs, ex, nodes, mask, d)
  bg = jax.jit(lambda e: block.block_graph(*e, num_nodes=nodes1.shape[0], num_relations=r))
  timed("block_graph", runs, bg, edges)
  rep = jax.jit(lambda c, v: block._representative(c, v))
  cand = jnp.concatenate([nodes, d.nodes[1].reshape(-1)])
  timed("  of expand: _representative", runs, rep, cand, cand >= 0)
  src, dst, et, ok = edges
  timed("  of block_graph: lexsort x3", runs, jax.jit(jnp.lexsort), (src, dst, et))
  timed(
    "  of block_graph: stable argsort",
    runs,
    jax.jit(lambda k: jnp.argsort(k, stable=True)),
    src,
  )
  timed(
    "  of block_graph: searchsorted",
    runs,
    jax.jit(lambda s: jnp.searchsorted(s, jnp.arange(s.shape[0] + 1, dtype=s.dtype))),
    jnp.sort(src),
  )
  timed("  of block_graph: cumsum", runs, jax.jit(jnp.cumsum), ok.astype(jnp.int32))
  timed("  of expand: cummax", runs, jax.jit(jax.lax.cummax), src)


if __name__ == "__main__":
  main()
