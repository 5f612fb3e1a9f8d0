"""RGCN on synthetic_mag (`jaxdata.train.attention`, model "rgcn"; `jaxdata train rgcn --scale`).

The classifier's full-graph logits and gradients equal a plain-JAX model written from
`jaxdata.reference.rgcn` (CPU and GPU); training learns, full graph and on mini-batches; the
command line trains, saves a "rgcn-mag" checkpoint that `jaxdata eval` measures again, and keeps
the entity datasets' options apart. (Sampled blocks against the full graph, and two devices
against one: tests/test_train_hetero.py and tests/test_distributed_hector.py, parametrized over
rgcn.)
"""

import functools
import re
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
from jaxdata.nn import classifiers
from jaxdata.reference import rgcn as ref
from jaxdata.train import attention
from jaxdata.train.attention import TrainConfig, build_model
from jaxdata.train.attention import minibatch as hetero

# Its tests take 5 s to minutes each: the fast tier (-m "not slow") leaves this file out.
pytestmark = pytest.mark.slow


@functools.cache
def mag():
  return synthetic_mag(scale=5e-4, seed=1, num_classes=4)


def reference_logits(p: dict, ds, edges, embedded: tuple[int, ...], num_relations: int):
  """The RGCN classifier in plain JAX from its parameters (`nnx.to_pure_dict`): per-type
  linear maps (embedding tables for `embedded` types), RGCN layers (transform every node through
  every relation's weight, gather per edge, per-relation mean) with self loop, bias and ReLU, a
  linear classifier on papers."""
  xs = [
    p["tables"][embedded.index(t)]["embedding"] if t in embedded else jnp.asarray(x)
    for t, x in enumerate(ds.features)
  ]
  h = jnp.concatenate(
    [x @ p["embed"][t]["kernel"] + p["embed"][t]["bias"] for t, x in enumerate(xs)]
  )
  n = h.shape[0]
  layers = sorted((k for k in p if k.startswith("conv")), key=lambda k: int(k[4:]))
  for name in layers:
    conv = p[name]
    w = (
      conv["weight"]
      if "weight" in conv
      else jnp.einsum("rb,bio->rio", conv["coefficients"][:num_relations], conv["bases"])
    )
    h = jax.nn.relu(
      ref.full_layer(ref.transform_all_then_gather, *edges, n, h, w, conv["root"], conv["bias"])
    )
  papers = len(ds.features[0])
  return h[:papers] @ p["classify"]["kernel"] + p["classify"]["bias"]


@pytest.mark.parametrize("bases,layers,embed", [(None, 2, ()), (3, 3, ("author",))])
def test_full_graph_logits_and_gradients_equal_a_plain_jax_reference(device, bases, layers, embed):
  ds = mag()
  g = ds.graph
  config = TrainConfig(
    model="rgcn", hidden=8, num_bases=bases, layers=layers, embed=embed, embed_dim=6
  )
  model = build_model(ds, config, nnx.Rngs(5))
  assert isinstance(model, classifiers.RGCNClassifier) and model.layers == layers
  edges = ref.EdgeArrays.build(
    g.src, g.dst, g.etype, num_nodes=g.num_nodes, num_relations=g.num_relations
  )
  graph = GraphArrays.from_graph(g)
  xs = attention.device_features(ds, model)
  papers = ds.node_range("paper")[1]
  train_idx = jnp.asarray(ds.train_papers)
  y = jnp.asarray(ds.labels)[train_idx]

  def loss_model(model):
    logits = model(graph, xs, papers)
    return optax.softmax_cross_entropy_with_integer_labels(logits[train_idx], y).mean(), logits

  def loss_ref(p):
    logits = reference_logits(p, ds, edges, model.embedded, g.num_relations)
    return optax.softmax_cross_entropy_with_integer_labels(logits[train_idx], y).mean(), logits

  (loss, logits), grads = nnx.jit(nnx.value_and_grad(loss_model, has_aux=True))(model)
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  (want_loss, want), want_grads = jax.jit(jax.value_and_grad(loss_ref, has_aux=True))(params)
  assert logits.shape == (papers, ds.num_classes)
  np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  got = nnx.to_pure_dict(nnx.state(grads, nnx.Param))
  assert jax.tree.structure(got) == jax.tree.structure(want_grads)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want_grads)):
    assert np.abs(np.asarray(b)).max() > 0, path  # every parameter matters
    # atol: a GPU's float atomics sum in any order
    np.testing.assert_allclose(
      a, b, rtol=1e-3, atol=1e-5 + 1e-5 * float(np.abs(b).max()), err_msg=jax.tree_util.keystr(path)
    )


def test_rgcn_learns_full_graph_and_on_minibatches():
  ds = mag()
  chance = 1 / ds.num_classes
  config = TrainConfig(model="rgcn", epochs=15, hidden=16, learning_rate=0.01)
  full = attention.train(ds, config)
  assert full.history[-1]["loss"] < 0.5 * full.history[0]["loss"]
  assert full.val_accuracy > 2 * chance and full.test_accuracy > 2 * chance
  mb = hetero.train(
    ds,
    TrainConfig(
      model="rgcn", epochs=3, hidden=16, learning_rate=0.01, embed=("institution",), embed_dim=8
    ),
    hetero.MinibatchConfig(fanouts=(4, 4), batch_size=32),
  )
  losses = [h["loss"] for h in mb.history]
  assert losses[-1] < losses[0]
  assert mb.val_accuracy > 2 * chance  # measured full-graph, with the trained embeddings
  # the returned model holds the embedding table trained in host memory
  assert mb.model.tables[0].embedding.shape == (len(ds.features[2]), 8)


def test_config_errors():
  with pytest.raises(ValueError, match="num_bases is RGCN's"):
    TrainConfig(model="hgt", num_bases=2)
  with pytest.raises(ValueError, match="num_bases is RGCN's and must be >= 1"):
    TrainConfig(model="rgcn", num_bases=0)
  with pytest.raises(ValueError, match="model must be one of"):
    TrainConfig(model="gcn")
  TrainConfig(model="rgcn", hidden=10, heads=4)  # heads are the attention models'


def _jaxdata(*args):
  return subprocess.run(
    [sys.executable, "-m", "jaxdata.cli", *args], capture_output=True, text=True, timeout=600
  )


def test_cli_minibatch_trains_saves_and_eval_measures_the_same(tmp_path):
  out = tmp_path / "ck"
  r = _jaxdata(
    "train",
    "rgcn",
    "--scale",
    "5e-4",
    "--classes",
    "4",
    "--minibatch",
    "--epochs",
    "2",
    "--hidden",
    "8",
    "--bases",
    "2",
    "--fanouts",
    "3,3",
    "--batch-size",
    "32",
    "--embed",
    "author",
    "--embed-dim",
    "8",
    "--out",
    str(out),
  )
  assert r.returncode == 0, r.stderr[-2000:]
  text = " ".join(r.stdout.split())
  assert "RGCN: 2 layers, hidden 8, 2 bases" in text and "1024 papers" not in text
  assert "learnable 8-wide embeddings for author" in text
  trained = re.search(r"validation accuracy ([0-9.]+), test accuracy ([0-9.]+)", text)
  e = _jaxdata("eval", str(out))
  assert e.returncode == 0, e.stderr[-2000:]
  assert e.stdout.startswith("rgcn-mag checkpoint")
  measured = {
    line.split()[0]: line.split()[1]
    for line in e.stdout.splitlines()
    if line.startswith(("val_accuracy", "test_accuracy"))
  }
  # a fresh process measures what training printed (full graph, with the trained embeddings)
  assert (measured["val_accuracy"], measured["test_accuracy"]) == trained.groups()
  from jaxdata.tasks import checkpoint

  loaded = checkpoint.load_model(out)
  assert loaded.kind == "rgcn-mag" and loaded.model.convs[0].bases.shape == (2, 8, 8)
  assert loaded.meta["config"]["model"] == "rgcn" and loaded.meta["data"]["scale"] == 5e-4
