"""Mini-batch RGCN from host memory (jaxdata.train.attention.minibatch, RGCN.on_rows).

The featureless first layer's per-node parameters live as rows of a host table; on a block the
layer reads the rows of its slots' nodes. Against the full-graph layer (`RGCN.__call__` with
one-hot input): the same outputs from the same rows; with fanouts covering every in-edge, a
mini-batch step's loss and gradients (dense parameters and node rows) are the full-graph ones at
its seeds, and rows of nodes outside the sampled neighbourhood get no gradient there either.
"""

import dataclasses
import functools
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxdata.data import HeteroGraph, synthetic_entities
from jaxdata.hector import GraphArrays
from jaxdata.nn import RGCN
from jaxdata.tasks.rgcn import TrainConfig, build_model, split_validation
from jaxdata.train import attention
from jaxdata.train.attention import minibatch as mb

# Its tests take 5 s to minutes each: the fast tier (-m "not slow") leaves this file out.
pytestmark = pytest.mark.slow

LAYERS = {
  "full": dict(),
  "bases": dict(num_bases=2),
  "bases-selfloop": dict(num_bases=2, self_loop="basis", use_bias=False),
  "no-selfloop": dict(self_loop=False),
}


@functools.cache
def entities(featureless: bool = True):
  ds = synthetic_entities(
    num_nodes=120, num_edges=500, num_relations=3, num_classes=3, seed=2, feature_dim=6
  )
  g = ds.graph
  g = HeteroGraph.from_edges(g.src, g.dst, g.etype, num_nodes=g.num_nodes, add_inverse=True)
  return dataclasses.replace(ds, graph=g, features=None if featureless else ds.features)


@pytest.mark.parametrize("layer", list(LAYERS))
def test_on_rows_equals_the_one_hot_layer_and_rows_round_trip(layer):
  g = entities().graph
  graph = GraphArrays.from_graph(g)
  a = RGCN(
    None, 4, num_relations=g.num_relations, num_nodes=g.num_nodes, rngs=nnx.Rngs(0), **LAYERS[layer]
  )
  rows = a.node_rows()
  assert rows.shape == (g.num_nodes, a.row_width)
  np.testing.assert_allclose(a.on_rows(graph, rows), a(graph), rtol=1e-5, atol=1e-6)
  b = RGCN(
    None, 4, num_relations=g.num_relations, num_nodes=g.num_nodes, rngs=nnx.Rngs(1), **LAYERS[layer]
  )
  assert not np.allclose(b(graph), a(graph))
  b.set_node_rows(rows)
  for p, q in zip(
    jax.tree.leaves(nnx.state(a, nnx.Param)), jax.tree.leaves(nnx.state(b, nnx.Param))
  ):
    if p.ndim >= 2 and p.shape[-2 if p.ndim == 3 else 0] == g.num_nodes:
      np.testing.assert_array_equal(p, q)  # every per-node parameter came back
  with pytest.raises(ValueError, match="rows must have shape"):
    b.set_node_rows(rows[:, 1:])
  with pytest.raises(ValueError, match="on_rows: rows must have shape"):
    a.on_rows(graph, rows[1:])
  with pytest.raises(ValueError, match="only for featureless"):
    RGCN(3, 4, num_relations=2, rngs=nnx.Rngs(0)).node_rows()


def _full_graph_loss(model, graph, rows, seeds, labels):
  """The mini-batch loss's full-graph counterpart (no L2): mean cross entropy at the seeds."""
  x = model.conv1.on_rows(graph, rows) if rows is not None else model.conv1(graph, None)
  h = jax.nn.relu(x)
  logits = model.conv2(graph, h).astype(jnp.float32)[seeds]
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels[seeds]).mean()


@pytest.mark.parametrize("pipeline", ["host", "device"])
@pytest.mark.parametrize(
  "setup",
  [dict(num_bases=2, self_loop="basis", bias=False), dict(num_bases=None)],
  ids=["bases", "full"],
)
def test_full_fanout_step_gives_the_full_graph_loss_and_gradients(device, pipeline, setup):
  ds = entities()
  config = TrainConfig(hidden=5, **setup)
  model = build_model(ds, config, nnx.Rngs(4))
  g = ds.graph
  width = int(g.in_degree().max())
  seeds_np = np.asarray(ds.train_idx[:9], np.int32)
  seeds = jnp.asarray(np.r_[seeds_np, -1].astype(np.int32))  # one padding slot
  labels = np.zeros(g.num_nodes, np.int32)
  labels[ds.train_idx] = ds.train_y
  labels = jnp.asarray(labels)
  full = GraphArrays.from_graph(g)
  dense = mb.dense_filter(model)

  with mb.entity_loader(ds, model, pipeline, (width, width)) as loader:

    @nnx.jit
    def on_blocks(model, loader):
      batch = loader.sample(seeds, jax.random.key(0))

      def loss_fn(model, learned):  # the mean cross entropy of the valid seeds
        total, (_, count) = mb.summed_loss(model, batch, learned, loader.embedded)
        return total / jnp.maximum(count, 1)

      grad = nnx.value_and_grad(loss_fn, argnums=(nnx.DiffState(0, dense), 1))
      loss, (g_dense, [g_rows]) = grad(model, [batch.inputs[0]])
      return loss, g_dense, g_rows, loader.embedding_ids(batch)[0]

    with jax.default_matmul_precision("highest"):
      loss_b, dense_b, rows_b, ids = jax.block_until_ready(on_blocks(model, loader))
      rows = model.conv1.node_rows()
      grad = nnx.value_and_grad(_full_graph_loss, argnums=(nnx.DiffState(0, dense), 2))
      loss_f, (dense_f, rows_f) = nnx.jit(grad)(model, full, rows, jnp.asarray(seeds_np), labels)
  np.testing.assert_allclose(loss_b, loss_f, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(dense_b), jax.tree.leaves(dense_f)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  ids = np.asarray(ids)
  sampled = ids[ids < g.num_nodes]
  rows_f = np.asarray(rows_f)
  np.testing.assert_allclose(
    np.asarray(rows_b)[ids < g.num_nodes], rows_f[sampled], rtol=1e-4, atol=1e-6
  )
  outside = np.setdiff1d(np.arange(g.num_nodes), sampled)
  assert not rows_f[outside].any()  # every row that matters was sampled


def _reach(graph, seeds, hops=2):
  """The nodes whose rows a 2-layer model's outputs at `seeds` can depend on: the seeds and
  their in-neighbours up to `hops` hops away."""
  reach = set(np.asarray(seeds).tolist())
  frontier = set(reach)
  src, dst = np.asarray(graph.src), np.asarray(graph.dst)
  for _ in range(hops):
    frontier = set(src[np.isin(dst, list(frontier))].tolist())
    reach |= frontier
  return np.asarray(sorted(reach))


def test_training_learns_and_moves_only_rows_batches_reach():
  ds = entities()
  config = TrainConfig(epochs=4, hidden=8, num_bases=2, learning_rate=0.05, val_fraction=0.2)
  before = np.asarray(build_model(ds, config, nnx.Rngs(config.seed)).conv1.node_rows())
  result = mb.train(ds, config, mb.MinibatchConfig(fanouts=(4, 4), batch_size=8))
  losses = [h["loss"] for h in result.history]
  assert losses[-1] < losses[0] and "val_accuracy" in result.history[0]
  # the trained rows went back into the model; lazy Adam moves only rows that batches read,
  # and batches only read the training nodes' 2-hop in-neighbourhoods
  after = np.asarray(result.model.conv1.node_rows())
  changed = np.flatnonzero(np.any(after != before, axis=1))
  fit, _ = split_validation(len(ds.train_idx), config.val_fraction, config.seed)
  reach = _reach(ds.graph, ds.train_idx[fit])
  assert len(changed) > 0 and len(reach) < ds.graph.num_nodes
  assert np.isin(changed, reach).all()


def test_with_features_every_parameter_trains_and_other_table_optimizers():
  ds = entities(featureless=False)
  config = TrainConfig(epochs=2, hidden=8, num_bases=2)
  model0 = build_model(ds, config, nnx.Rngs(config.seed))
  result = mb.train(
    ds, config, mb.MinibatchConfig(fanouts=(3, 3), batch_size=16, pipeline="device")
  )
  assert np.isfinite(result.history[-1]["loss"])
  # with features conv1's bases and self-loop weight are dense parameters: they train
  for name in ("bases", "root", "coefficients"):
    assert not np.array_equal(
      getattr(result.model.conv1, name)[...], getattr(model0.conv1, name)[...]
    ), name
  result = mb.train(
    entities(),
    dataclasses.replace(config, epochs=3),
    mb.MinibatchConfig(fanouts=(3, 3), batch_size=16, table_optimizer="adagrad"),
  )
  assert result.history[-1]["loss"] < result.history[0]["loss"]


def test_bad_configs():
  with pytest.raises(ValueError, match="1 fanouts for 2 layers"):
    mb.train(entities(), TrainConfig(epochs=1), mb.MinibatchConfig(fanouts=(3,)))
  with pytest.raises(ValueError, match="table_optimizer must be one of"):
    mb.MinibatchConfig(table_optimizer="lamb")
  with pytest.raises(ValueError, match="pipeline must be one of"):
    mb.MinibatchConfig(pipeline="cpu")


def test_cli_minibatch(tmp_path):
  out = tmp_path / "ck"

  def run(*a):
    return subprocess.run(
      [sys.executable, "-m", "jaxdata.cli", *a], capture_output=True, text=True, timeout=600
    )

  r = run(
    "train",
    "rgcn",
    "--minibatch",
    "--nodes",
    "300",
    "--edges",
    "2000",
    "--relations",
    "4",
    "--epochs",
    "2",
    "--fanouts",
    "3,3",
    "--batch-size",
    "16",
    "--out",
    str(out),
  )
  assert r.returncode == 0, r.stderr[-2000:]
  assert "mini-batches" in r.stdout and (out / "history.json").exists()
  r = run("eval", str(out))
  assert r.returncode == 0, r.stderr[-2000:]
  r = run("train", "rgcn", "--minibatch", "--fanouts", "3")
  assert r.returncode == 2 and "--fanouts" in r.stderr


def test_a_run_that_fails_closes_its_optimizer_tables_and_refusals(monkeypatch):
  """The node rows' sparse optimizer states are closed however the run ends; settings an entity
  run cannot honour are refused, not ignored."""
  ds = entities()
  config = TrainConfig(epochs=2, hidden=8, val_fraction=0.2)
  closed = []
  monkeypatch.setattr(mb.sparse, "close", lambda state: closed.append(state))

  def stop(record):
    raise RuntimeError("stopped by the test")

  with pytest.raises(RuntimeError, match="stopped by the test"):
    mb.train(ds, config, mb.MinibatchConfig(fanouts=(3, 3), batch_size=16), on_epoch=stop)
  assert len(closed) == 1  # the featureless first layer's rows: one table, one state
  small = mb.MinibatchConfig(fanouts=(3, 3), batch_size=16)
  with pytest.raises(ValueError, match="embedded node rows"):
    mb.train(ds, config, small, save_every=1, on_save=lambda result: None)
  with pytest.raises(ValueError, match="entity dataset"):
    mb.train(ds, config, dataclasses.replace(small, cache=0.2))
  with pytest.raises(ValueError, match="entity dataset"):
    mb.train(ds, config, small, final_evaluation="none")
  with pytest.raises(ValueError, match="no layers to plan"):
    attention.train(ds, config, plan=[None, None])
