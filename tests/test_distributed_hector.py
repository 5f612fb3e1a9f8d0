"""Full-graph relational GNNs over several devices: destination partitions (jaxdata.hector.partition).

A graph split by destination ranges into padded parts of equal shapes must hold exactly the
whole graph's edges (with their norms) once each; layers run part by part on the devices of a
mesh, each layer's input all-gathered, must give the whole-graph layers' outputs and parameter
gradients; and `jaxdata train rgcn` over 2 processes x 2 CPU devices (through the launcher) must
give the per-epoch losses of one process with one device.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxdata import hector
from jaxdata.data import HeteroGraph
from jaxdata.hector.block import edges_numpy
from jaxdata.hector.partition import partition
from jaxdata.nn import RGCN

try:
  _shard_map = jax.shard_map
except AttributeError:  # older JAX
  from jax.experimental.shard_map import shard_map as _shard_map  # type: ignore

N, R, E = 41, 3, 200
DATA = Path(os.environ.get("JAXDATA_DATA_DIR",
                           Path(__file__).resolve().parents[2] / "shared" / "data"))


def random_graph(seed: int = 0) -> HeteroGraph:
  rng = np.random.default_rng(seed)
  src, dst, etype = rng.integers(0, N, E), rng.integers(0, N, E), rng.integers(0, R, E)
  dst[:30] = 3  # one part gets many more edges than the others: padding edges
  src[:6], etype[:6] = 5, 2  # parallel edges
  return HeteroGraph.from_edges(src, dst, etype, num_nodes=N,
                                relation_names=[f"r{i}" for i in range(R)])


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_parts_hold_each_edge_once_with_the_whole_graphs_norm(k):
  g = random_graph()
  parts = partition(g, k)
  assert parts.padded_nodes >= N + 1 and parts.padding_node >= N
  assert all(a.shape[0] == k for a in parts.arrays.values())
  norm = g.edge_norm("mean")
  got = []
  for part in range(k):
    src, dst, etype, nm = edges_numpy(parts.graph(part))
    start, stop = parts.owned(part)
    assert np.all((dst >= start) & (dst < stop))
    got += list(zip(src, dst, etype, nm))
    # Padding edges touch only the padding node.
    pad = np.asarray(parts.graph(part).norm) == 0
    assert np.all(np.asarray(parts.graph(part).src)[pad] == parts.padding_node)
  want = list(zip(g.src, g.dst, g.etype, norm))
  assert sorted(got) == sorted(want)


def test_partition_rejects_bad_arguments():
  g = random_graph()
  with pytest.raises(ValueError, match="num_parts must be an int >= 1"):
    partition(g, 0)
  with pytest.raises(ValueError, match="norm must have one value per edge"):
    partition(g, 2, norm=np.ones(3, np.float32))
  with pytest.raises(ValueError, match="x must have 41 rows"):
    partition(g, 2).pad_rows(np.zeros((3, 2)))


def two_layers(featureless: bool, bases: bool):
  rngs = nnx.Rngs(0)
  first = RGCN(None if featureless else 6, 5, num_relations=R, num_nodes=N,
               num_bases=2 if bases else None, self_loop="basis" if bases else True, rngs=rngs)
  second = RGCN(5, 4, num_relations=R, num_bases=2 if bases else None, rngs=rngs)
  return first, second


@pytest.mark.parametrize("bases", [False, True], ids=["full-weights", "bases"])
@pytest.mark.parametrize("featureless", [False, True], ids=["features", "featureless"])
def test_two_rgcn_layers_on_parts_over_a_mesh_equal_the_whole_graph(featureless, bases):
  """Two CPU devices (tests/conftest.py), one part each, inputs all-gathered per layer: the
  output rows and the gradients of every parameter and of the input equal the whole graph's."""
  devices = jax.devices("cpu")[:2]
  assert len(devices) == 2
  mesh = Mesh(np.array(devices), ("data",))
  g = random_graph(1)
  parts = partition(g, 2)
  full = hector.GraphArrays.from_graph(g)
  rng = np.random.default_rng(2)
  x = None if featureless else rng.normal(size=(N, 6)).astype(np.float32)
  cot = rng.normal(size=(N, 4)).astype(np.float32)
  graphdef, params = nnx.split(two_layers(featureless, bases))

  def whole(params, x):
    first, second = nnx.merge(graphdef, params)
    return jnp.vdot(second(full, jax.nn.relu(first(full, x))), cot)

  want, (w_params, w_x) = jax.value_and_grad(whole, argnums=(0, 1))(
      params, None if featureless else jnp.asarray(x))

  def per_device(params, arrays, x_own, cot_own):
    graph = parts.local(arrays)
    start = jax.lax.axis_index("data") * parts.rows

    def loss(params, x_own):
      first, second = nnx.merge(graphdef, params)
      x_all = None if x_own is None else jax.lax.all_gather(x_own, "data", tiled=True)
      h = jax.nn.relu(first.on_partition(graph, x_all, start, parts.rows))
      out = second.on_partition(graph, jax.lax.all_gather(h, "data", tiled=True), start,
                                parts.rows)
      return jnp.vdot(out, cot_own)  # padding rows have a zero cotangent

    value, (g_params, g_x) = jax.value_and_grad(loss, argnums=(0, 1))(params, x_own)
    # check_vma=False: each device's gradient of the replicated parameters is its own part's.
    return jax.lax.psum(value, "data"), jax.lax.psum(g_params, "data"), g_x

  rows = NamedSharding(mesh, P("data"))
  arrays = jax.device_put(parts.arrays, rows)
  x_rows = None if featureless else jax.device_put(parts.pad_rows(x), rows)
  cot_rows = jax.device_put(parts.pad_rows(cot), rows)
  step = jax.jit(_shard_map(per_device, mesh=mesh, in_specs=(P(), P("data"), P("data"),
                                                             P("data")),
                            out_specs=(P(), P(), P("data")), check_vma=False))
  got, g_params, g_x = step(params, arrays, x_rows, cot_rows)
  np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g_params), jax.tree.leaves(w_params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  if not featureless:
    np.testing.assert_allclose(np.asarray(g_x)[:N], np.asarray(w_x), rtol=1e-5, atol=1e-6)
