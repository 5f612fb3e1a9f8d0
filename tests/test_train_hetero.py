"""Mini-batch relational training from host memory (jaxdata.host.sample_blocks, train.attention.minibatch).

Through the real typed sampler: with fanouts that cover every in-edge, the RGAT classifier on
sampled blocks gives the full-graph classifier's logits and gradients at the seeds (HostGraph
and DeviceGraph, CPU and GPU); training on mini-batches learns, both pipelines see the same
samples and losses, and the checkpoint evaluates like a full-graph one.
"""
import functools
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxdata.data import synthetic_mag
from jaxdata.hector import GraphArrays
from jaxdata.host.blocks import gather_typed, node_types, sample_blocks
from jaxdata.train.attention import minibatch as hetero
from jaxdata.train.attention import TrainConfig, build_model


@functools.lru_cache(maxsize=None)
def mag():
  return synthetic_mag(scale=5e-4, seed=1, num_classes=4)


@pytest.mark.parametrize("model", ["rgat", "hgt"])
@pytest.mark.parametrize("pipeline", ["host", "device"])
def test_full_fanout_blocks_give_the_full_graph_logits_and_gradients(device, pipeline, model):
  ds = mag()
  config = TrainConfig(model=model, hidden=16, heads=2)
  model = build_model(ds, config, nnx.Rngs(3))
  width = int(ds.graph.in_degree().max())
  seeds = jnp.asarray(np.r_[np.arange(0, 40, 3), 6, -1].astype(np.int32))  # a repeat, padding
  labels = jnp.asarray(ds.labels)[jnp.maximum(seeds, 0)]
  full = GraphArrays.from_graph(ds.graph)
  xs_full = [jnp.asarray(x) for x in ds.features]
  papers = ds.node_range("paper")[1]

  with hetero.HostData(ds, pipeline) as data:
    def loss_blocks(model):
      logits, valid = hetero.forward(model, data, data.consts, seeds, (width, width),
                                     jax.random.key(0))
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
      return jnp.sum(jnp.where(valid, ce, 0)), (logits, valid)

    def loss_full(model):
      logits = model(full, xs_full, papers)[jnp.maximum(seeds, 0)]
      valid = (seeds >= 0) & (jnp.arange(seeds.shape[0]) != seeds.shape[0] - 2)  # the second "6"
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
      return jnp.sum(jnp.where(valid, ce, 0)), (logits, valid)

    with jax.default_matmul_precision("highest"):
      (lb, (ob, vb)), gb = nnx.jit(nnx.value_and_grad(loss_blocks, has_aux=True))(model)
      (lf, (of, vf)), gf = nnx.jit(nnx.value_and_grad(loss_full, has_aux=True))(model)
    jax.block_until_ready((lb, ob, gb))  # before the tables close
  np.testing.assert_array_equal(vb, vf)  # the repeated seed counts once
  np.testing.assert_allclose(np.asarray(ob)[np.asarray(vb)], np.asarray(of)[np.asarray(vb)],
                             rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(lb, lf, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(gb), jax.tree.leaves(gf)):
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)


def test_blocks_hold_sampled_edges_of_the_graph(device):
  ds = mag()
  with hetero.HostData(ds, "host") as data:
    seeds = jnp.arange(0, 64, dtype=jnp.int32)
    blocks = jax.jit(functools.partial(sample_blocks, fanouts=(3, 2)),
                     static_argnames=())(data.host, seeds, key=jax.random.key(1))
    edges = set(zip(ds.graph.src.tolist(), ds.graph.dst.tolist(), ds.graph.etype.tolist()))
    for h, g in enumerate(blocks.graphs):
      src_nodes, dst_nodes = np.asarray(blocks.nodes[h + 1]), np.asarray(blocks.nodes[h])
      norm = np.asarray(g.norm)
      real = norm > 0
      s, d, r = (np.asarray(a)[real] for a in (g.src, g.dst, g.etype))
      assert all((int(src_nodes[a]), int(dst_nodes[b]), int(c)) in edges for a, b, c in zip(s, d, r))
      # at most `fanout` in-edges per destination, and each destination's norm sums to
      # its number of relations
      counts = np.bincount(d, minlength=len(dst_nodes))
      assert counts.max() <= (3, 2)[h]
    types = np.asarray(node_types(data.type_offsets, blocks.nodes[-1]))
    nodes = np.asarray(blocks.nodes[-1])
    want = np.searchsorted(np.asarray(data.type_offsets[1:-1]), nodes, side="right")
    np.testing.assert_array_equal(types[nodes >= 0], want[nodes >= 0])
    xs = jax.block_until_ready(
        gather_typed(data.tables, data.type_offsets, blocks.nodes[-1], blocks.masks[-1]))
    for t, x in enumerate(xs):
      mine = (types == t) & (nodes >= 0)
      np.testing.assert_array_equal(np.asarray(x)[mine],
                                    ds.features[t][nodes[mine] - data.type_offsets[t]])
      assert not np.asarray(x)[~mine].any()


def test_minibatch_training_learns_and_pipelines_agree():
  ds = mag()
  config = TrainConfig(model="rgat", epochs=3, hidden=16, heads=2, learning_rate=0.01)
  runs = {p: hetero.train(ds, config, hetero.MinibatchConfig(fanouts=(4, 4), batch_size=32,
                                                             pipeline=p), final_evaluation="minibatch")
          for p in ("host", "device")}
  losses = {p: [h["loss"] for h in r.history] for p, r in runs.items()}
  # The same samples and features: the first epoch's losses agree to float rounding; later
  # ones drift apart by the order of GPU atomics (scatter-adds) compounded over Adam steps.
  np.testing.assert_allclose(losses["host"][0], losses["device"][0], rtol=1e-4)
  np.testing.assert_allclose(losses["host"], losses["device"], rtol=3e-3)
  assert losses["host"][-1] < losses["host"][0]
  assert runs["host"].metrics["val_accuracy"] > 1.5 / ds.num_classes


def test_bad_configs_and_inputs():
  with pytest.raises(ValueError, match="two positive ints"):
    hetero.MinibatchConfig(fanouts=(3, 0))
  with pytest.raises(ValueError, match="pipeline must be one of"):
    hetero.MinibatchConfig(pipeline="gpu")
  ds = mag()
  with hetero.HostData(ds, "host") as data:
    with pytest.raises(TypeError, match="seeds must be a 1-D integer array"):
      sample_blocks(data.host, jnp.zeros(3), (2,), jax.random.key(0))
    with pytest.raises(ValueError, match="fanouts must be positive"):
      sample_blocks(data.host, jnp.zeros(3, jnp.int32), (2, 0), jax.random.key(0))
    with pytest.raises(ValueError, match="has 3 rows, the type has"):
      gather_typed([data.tables[0], jnp.zeros((3, 2))] + data.tables[2:], data.type_offsets,
                   jnp.zeros(2, jnp.int32), jnp.ones(2, bool))
  with pytest.raises(ValueError, match="no edge relations"):
    from jaxdata.host import HostGraph
    with HostGraph([0, 1], [0]) as g:
      sample_blocks(g, jnp.zeros(1, jnp.int32), (1,), jax.random.key(0))


def test_cli_minibatch_trains_and_rejects_mistakes(tmp_path):
  out = tmp_path / "ck"
  run = lambda *a: subprocess.run([sys.executable, "-m", "jaxdata.cli", *a], capture_output=True,  # noqa: E731
                                  text=True, timeout=600)
  r = run("train", "hgt", "--minibatch", "--scale", "0.0005", "--epochs", "1", "--hidden", "8",
          "--heads", "2", "--fanouts", "3,3", "--batch-size", "32", "--out", str(out))
  assert r.returncode == 0, r.stderr[-2000:]
  assert "val acc" in r.stdout and (out / "history.json").exists()
  for args, message in ((("--fanouts", "3"), "give two fanouts"),
                        (("--fanouts", "3,0"), "--fanouts"),
                        (("--pipeline", "gpu"), "--pipeline")):
    r = run("train", "rgat", "--minibatch", "--scale", "0.0005", *args)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1
