"""Full-graph relational GNNs over several devices: destination partitions
(jaxdata.hector.partition).

A graph split by destination ranges into padded parts of equal shapes must hold exactly the
whole graph's edges (with their norms) once each; layers run part by part on the devices of a
mesh, each layer's input all-gathered, must give the whole-graph layers' outputs and parameter
gradients; and `jaxdata train rgcn` over 2 processes x 2 CPU devices (through the launcher) must
give the per-epoch losses of one process with one device.
"""

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from test_distributed import _env, _jaxdata  # one way to run the CLI in a fresh CPU process

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
DATA = Path(
  os.environ.get("JAXDATA_DATA_DIR", Path(__file__).resolve().parents[2] / "shared" / "data")
)


#: The trainers' meshes take the default backend's devices: on a machine with one GPU (the H200
#: gate) there are not two, and these run in CPU CI (two forced host devices) instead.
two_default_devices = pytest.mark.skipif(
  len(jax.devices()) < 2, reason="needs two devices of the default backend"
)


def random_graph(seed: int = 0) -> HeteroGraph:
  rng = np.random.default_rng(seed)
  src, dst, etype = rng.integers(0, N, E), rng.integers(0, N, E), rng.integers(0, R, E)
  dst[:30] = 3  # one part gets many more edges than the others: padding edges
  src[:6], etype[:6] = 5, 2  # parallel edges
  return HeteroGraph.from_edges(
    src, dst, etype, num_nodes=N, relation_names=[f"r{i}" for i in range(R)]
  )


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


def _mesh(device) -> Mesh:
  """Two devices of `device`'s platform (the `device` fixture's): tests/conftest.py gives the
  CPU two; on a GPU machine, up to two GPUs (one GPU: one part, still through shard_map)."""
  return Mesh(np.array(jax.devices(device.platform)[:2]), ("data",))


def two_layers(featureless: bool, bases: bool):
  rngs = nnx.Rngs(0)
  first = RGCN(
    None if featureless else 6,
    5,
    num_relations=R,
    num_nodes=N,
    num_bases=2 if bases else None,
    self_loop="basis" if bases else True,
    rngs=rngs,
  )
  second = RGCN(5, 4, num_relations=R, num_bases=2 if bases else None, rngs=rngs)
  return first, second


@pytest.mark.parametrize("bases", [False, True], ids=["full-weights", "bases"])
@pytest.mark.parametrize("featureless", [False, True], ids=["features", "featureless"])
def test_two_rgcn_layers_on_parts_over_a_mesh_equal_the_whole_graph(device, featureless, bases):
  """Two devices, one part each, inputs all-gathered per layer: the output rows and the
  gradients of every parameter and of the input equal the whole graph's."""
  mesh = _mesh(device)
  g = random_graph(1)
  parts = partition(g, mesh.devices.size)
  full = hector.GraphArrays.from_graph(g)
  rng = np.random.default_rng(2)
  x = None if featureless else rng.normal(size=(N, 6)).astype(np.float32)
  cot = rng.normal(size=(N, 4)).astype(np.float32)
  graphdef, params = nnx.split(two_layers(featureless, bases))

  def whole(params, x):
    first, second = nnx.merge(graphdef, params)
    return jnp.vdot(second(full, jax.nn.relu(first(full, x))), cot)

  want, (w_params, w_x) = jax.value_and_grad(whole, argnums=(0, 1))(
    params, None if featureless else jnp.asarray(x)
  )

  def per_device(params, arrays, x_own, cot_own):
    graph = parts.local(arrays)
    start = jax.lax.axis_index("data") * parts.rows

    def loss(params, x_own):
      first, second = nnx.merge(graphdef, params)
      x_all = None if x_own is None else jax.lax.all_gather(x_own, "data", tiled=True)
      h = jax.nn.relu(first.on_partition(graph, x_all, start, parts.rows))
      out = second.on_partition(graph, jax.lax.all_gather(h, "data", tiled=True), start, parts.rows)
      return jnp.vdot(out, cot_own)  # padding rows have a zero cotangent

    value, (g_params, g_x) = jax.value_and_grad(loss, argnums=(0, 1))(params, x_own)
    # check_vma=False: each device's gradient of the replicated parameters is its own part's.
    return jax.lax.psum(value, "data"), jax.lax.psum(g_params, "data"), g_x

  rows = NamedSharding(mesh, P("data"))
  arrays = jax.device_put(parts.arrays, rows)
  x_rows = None if featureless else jax.device_put(parts.pad_rows(x), rows)
  cot_rows = jax.device_put(parts.pad_rows(cot), rows)
  step = jax.jit(
    _shard_map(
      per_device,
      mesh=mesh,
      in_specs=(P(), P("data"), P("data"), P("data")),
      out_specs=(P(), P(), P("data")),
      check_vma=False,
    )
  )
  got, g_params, g_x = step(params, arrays, x_rows, cot_rows)
  np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g_params), jax.tree.leaves(w_params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  if not featureless:
    np.testing.assert_allclose(np.asarray(g_x)[:N], np.asarray(w_x), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- the trainer
SYNTHETIC = {"source": "synthetic", "nodes": 300, "edges": 3000, "relations": 4, "seed": 0}


@two_default_devices
def test_featureless_rgcn_on_two_local_devices_trains_like_one_device():
  """Per-node parameters (replicated), bases, the L2 term, a validation split: per-epoch losses
  and accuracies agree (features: the launcher test below)."""
  import dataclasses

  from jaxdata.tasks import rgcn
  from jaxdata.train import attention

  dataset, setup = rgcn.load_dataset(SYNTHETIC)
  dataset = dataclasses.replace(dataset, features=None)
  config = rgcn.TrainConfig(epochs=3, hidden=8, **setup)
  one = attention.train(dataset, config)
  two = attention.train(dataset, dataclasses.replace(config, devices=2))
  assert len(one.history) == len(two.history) == 3
  for a, b in zip(one.history, two.history):
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    assert b["train_accuracy"] == pytest.approx(a["train_accuracy"], abs=1e-6)
    assert b["val_accuracy"] == pytest.approx(a["val_accuracy"], abs=1e-6)
  assert two.history[-1]["loss"] < two.history[0]["loss"]
  assert two.test_accuracy == pytest.approx(one.test_accuracy, abs=1e-6)
  # The trained parameters come back as one model, equal to the single device's.
  for a, b in zip(
    jax.tree.leaves(nnx.state(one.model, nnx.Param)),
    jax.tree.leaves(nnx.state(two.model, nnx.Param)),
  ):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-4, atol=2e-6)


def test_rgcn_devices_are_checked():
  from jaxdata import cli
  from jaxdata.tasks import rgcn
  from jaxdata.train import attention

  with pytest.raises(ValueError, match="devices must be >= 1 or None"):
    rgcn.TrainConfig(devices=0)
  dataset, setup = rgcn.load_dataset(SYNTHETIC)
  with pytest.raises(ValueError, match=f"devices=3, but {len(jax.devices())} are visible"):
    attention.train(dataset, rgcn.TrainConfig(epochs=1, devices=3, **setup))
  # --minibatch is data parallel too (tests/test_train_rgcn_minibatch_parallel.py): more
  # devices than visible is the same one-line usage error.
  assert (
    cli.main(
      ["train", "rgcn", "--minibatch", "--devices", str(len(jax.devices()) + 1), "--epochs", "1"]
    )
    == 2
  )


@pytest.mark.slow
def test_rgcn_on_two_processes_of_two_devices_trains_like_one_device(tmp_path):
  """Through the launcher: the graph split over 4 devices of 2 processes (gloo collectives);
  every epoch's loss and accuracies, and the test accuracy, equal one process with one device."""
  rgcn = [
    "train",
    "rgcn",
    "--nodes",
    str(SYNTHETIC["nodes"]),
    "--edges",
    str(SYNTHETIC["edges"]),
    "--relations",
    str(SYNTHETIC["relations"]),
    "--hidden",
    "8",
    "--epochs",
    "3",
  ]
  multi = _jaxdata(
    [
      "launch",
      "-n",
      "2",
      "--devices-per-process",
      "2",
      "--",
      *rgcn,
      "--devices",
      "2",
      "--out",
      str(tmp_path / "multi"),
    ],
    _env(),
    240,
  )
  assert multi.returncode == 0, multi.stdout + multi.stderr
  single = _jaxdata([*rgcn, "--out", str(tmp_path / "single")], _env(1), 240)
  assert single.returncode == 0, single.stdout + single.stderr
  assert "cpu x 4" in multi.stdout and "cpu x 1" in single.stdout
  assert "[0] seed 0: test accuracy" in multi.stdout
  assert "[1] seed 0: test accuracy" not in multi.stdout  # process 0 reports
  hist = {k: json.load(open(tmp_path / k / "history.json")) for k in ("multi", "single")}
  assert len(hist["multi"]) == len(hist["single"]) == 3
  for m, s in zip(hist["multi"], hist["single"]):
    assert m["loss"] == pytest.approx(s["loss"], rel=1e-5)
    assert m["train_accuracy"] == pytest.approx(s["train_accuracy"], abs=1e-6)
    assert m["val_accuracy"] == pytest.approx(s["val_accuracy"], abs=1e-6)
  from jaxdata.tasks import checkpoint

  metas = {k: checkpoint.read_meta(tmp_path / k) for k in ("multi", "single")}
  assert metas["multi"]["metrics"]["test_accuracy"] == pytest.approx(
    metas["single"]["metrics"]["test_accuracy"], abs=1e-6
  )


# ----------------------------------------------------------------------------- attention layers
TYPES = (0, 15, N)  # two node types for HGT


def _on_mesh(mesh, per_device, *args):
  """Runs `per_device(*blocks)` on `mesh`, every arg sharded by rows, check_vma off; returns
  its (replicated) results."""
  rows = NamedSharding(mesh, P("data"))
  args = jax.device_put(args, rows)
  return jax.jit(
    _shard_map(
      per_device, mesh=mesh, in_specs=(P("data"),) * len(args), out_specs=P(), check_vma=False
    )
  )(*args)


def test_two_rgat_layers_on_parts_over_a_mesh_equal_the_whole_graph(device):
  from jaxdata.nn import RGAT

  mesh = _mesh(device)
  g = random_graph(3)
  parts, full = partition(g, mesh.devices.size), hector.GraphArrays.from_graph(g)
  rngs = nnx.Rngs(0)
  layers = (
    RGAT(6, 3, num_relations=R, heads=2, self_loop=True, rngs=rngs),
    RGAT(6, 4, num_relations=R, heads=2, concat=False, rngs=rngs),
  )
  graphdef, params = nnx.split(layers)
  rng = np.random.default_rng(4)
  x, cot = rng.normal(size=(N, 6)).astype(np.float32), rng.normal(size=(N, 4)).astype(np.float32)

  def whole(params):
    first, second = nnx.merge(graphdef, params)
    return jnp.vdot(second(full, jax.nn.relu(first(full, jnp.asarray(x)))), cot)

  want, w_grads = jax.value_and_grad(whole)(params)

  def per_device(arrays, x_own, cot_own):
    graph, start = parts.local(arrays), jax.lax.axis_index("data") * parts.rows
    gather = lambda h: jax.lax.all_gather(h, "data", tiled=True)  # noqa: E731

    def loss(params):
      first, second = nnx.merge(graphdef, params)
      h = jax.nn.relu(first.on_partition(graph, gather(x_own), start, parts.rows))
      return jnp.vdot(second.on_partition(graph, gather(h), start, parts.rows), cot_own)

    return jax.lax.psum(jax.value_and_grad(loss)(params), "data")

  got, grads = _on_mesh(mesh, per_device, parts.arrays, parts.pad_rows(x), parts.pad_rows(cot))
  np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(w_grads)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_two_hgt_layers_on_parts_over_a_mesh_equal_the_whole_graph(device):
  """Node types (widths 6 and 4) whose ranges cross the parts' boundary; keys, queries and
  values all-gathered."""
  from jaxdata.nn import HGT

  rng = np.random.default_rng(5)
  src, dst, etype = rng.integers(0, N, E), rng.integers(0, N, E), rng.integers(0, R, E)
  g = HeteroGraph.from_edges(
    src,
    dst,
    etype,
    num_nodes=N,
    relation_names=[f"r{i}" for i in range(R)],
    node_type_names=("a", "b"),
    node_type_offsets=TYPES,
  )
  mesh = _mesh(device)
  parts, full = partition(g, mesh.devices.size), hector.GraphArrays.from_graph(g)
  assert parts.node_type_offsets == (0, 15, parts.padded_nodes)
  assert TYPES[1] < parts.rows  # both types have rows in part 0
  rngs = nnx.Rngs(0)
  layers = (
    HGT((6, 4), 8, num_relations=R, heads=2, rngs=rngs),
    HGT((8, 8), 8, num_relations=R, heads=2, rngs=rngs),
  )
  graphdef, params = nnx.split(layers)
  xs = [
    rng.normal(size=(TYPES[t + 1] - TYPES[t], w)).astype(np.float32) for t, w in enumerate((6, 4))
  ]
  cot = rng.normal(size=(N, 8)).astype(np.float32)

  def whole(params):
    first, second = nnx.merge(graphdef, params)
    return jnp.vdot(jnp.concatenate(second(full, first(full, [jnp.asarray(x) for x in xs]))), cot)

  want, w_grads = jax.value_and_grad(whole)(params)
  types = np.full(parts.padded_nodes, -1, np.int32)
  for t in range(2):
    types[TYPES[t] : TYPES[t + 1]] = t
  typed = []  # type t's features on its rows of the padded node space, zeros elsewhere
  for t, x in enumerate(xs):
    rows = np.zeros((parts.padded_nodes, x.shape[1]), np.float32)
    rows[TYPES[t] : TYPES[t + 1]] = x
    typed.append(rows)

  def per_device(arrays, x0, x1, types_own, cot_own):
    graph, start = parts.local(arrays), jax.lax.axis_index("data") * parts.rows
    gather = lambda h: jax.lax.all_gather(h, "data", tiled=True)  # noqa: E731

    def loss(params):
      first, second = nnx.merge(graphdef, params)
      h = first.on_partition(graph, [x0, x1], types_own, start, gather)
      return jnp.vdot(second.on_partition(graph, h, types_own, start, gather), cot_own)

    return jax.lax.psum(jax.value_and_grad(loss)(params), "data")

  got, grads = _on_mesh(mesh, per_device, parts.arrays, *typed, types, parts.pad_rows(cot))
  np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(w_grads)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("model", ["rgat", "hgt", "rgcn"])
@two_default_devices
def test_attention_on_two_local_devices_trains_like_one_device(model):
  """Four node types over two parts: per-epoch losses and accuracies, and the final validation
  and test accuracy, agree with one device's."""
  import dataclasses

  from jaxdata.data import synthetic_mag
  from jaxdata.train import attention

  dataset = synthetic_mag(scale=0.0005, num_classes=4)
  config = attention.TrainConfig(model=model, epochs=2, hidden=8, heads=2)
  one = attention.train(dataset, config)
  two = attention.train(dataset, dataclasses.replace(config, devices=2))
  for a, b in zip(one.history, two.history, strict=True):
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    assert b["train_accuracy"] == pytest.approx(a["train_accuracy"], abs=1e-6)
    assert b["val_accuracy"] == pytest.approx(a["val_accuracy"], abs=1e-6)
  assert two.metrics == pytest.approx(one.metrics, abs=1e-6)
  with pytest.raises(ValueError, match="embeddings .embed. train on one device only"):
    attention.train(dataset, dataclasses.replace(config, devices=2, embed=("author",)))
