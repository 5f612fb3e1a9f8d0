"""The relational mini-batch trainer data parallel (train.attention.minibatch.sharded_steps,
train.common.ShardedSteps).

With fanouts that cover every in-edge of the seeds the samples are whole neighbourhoods,
whatever the keys, so K devices with `batch_size` seeds each must take the step one device
takes on the same global batch (K x `batch_size` seeds): the same loss, dense parameters,
Adam moments (whose first is (1 - b1) x the gradient: a gradient summed twice shows there,
where Adam's update hides it) and embedding rows. Through the launcher, 2 processes x 2
devices train like one process of 4 devices.
"""

import dataclasses
import functools
import json

import doc_blocks
import jax
import numpy as np
import pytest
from flax import nnx
from test_distributed import _env, _jaxdata, _launched  # the CLI in a fresh CPU process

from jaxdata.data import synthetic_mag
from jaxdata.nn import classifiers
from jaxdata.train.attention import TrainConfig
from jaxdata.train.attention import minibatch as hetero

# Its tests take 5 s to minutes each: the fast tier (-m "not slow") leaves this file out.
pytestmark = pytest.mark.slow

#: The seeds' in-degree bound: training papers above it are left out, so one hop of this
#: fanout holds every in-edge of every seed (a second hop would need the graph's largest
#: in-degree, hundreds of slots per node).
WIDTH = 20


@functools.cache
def mag():
  ds = synthetic_mag(scale=5e-4, seed=1, num_classes=4)
  degree = np.asarray(ds.graph.in_degree())
  papers = np.asarray(ds.train_papers)
  keep = papers[degree[papers + ds.node_range("paper")[0]] <= WIDTH]
  assert len(keep) >= 32
  return dataclasses.replace(ds, train_papers=keep)


def _train(model: str, devices: int, batch_size: int, embed=(), table_optimizer="adam"):
  config = TrainConfig(
    model=model,
    hidden=16,
    heads=2,
    epochs=1,
    layers=1,
    devices=devices,
    embed=embed,
    embed_dim=6,
    learning_rate=0.01,
  )
  return hetero.train(
    mag(),
    config,
    hetero.MinibatchConfig(
      fanouts=(WIDTH,), batch_size=batch_size, max_batches=1, table_optimizer=table_optimizer
    ),
    final_evaluation="none",
    validate=False,
  )


def _two_devices():
  if len(jax.devices()) < 2:
    pytest.skip("needs two devices of the default backend")


@pytest.mark.parametrize("model", ["hgt", "rgcn"])
def test_two_devices_take_one_devices_step_on_the_same_global_batch(model):
  _two_devices()
  one = _train(model, 1, 16)
  two = _train(model, 2, 8)
  assert one.history[0]["seeds"] == two.history[0]["seeds"] == 16
  assert two.history[0]["loss"] == pytest.approx(one.history[0]["loss"], rel=1e-5)
  _assert_close_after_adams_first_step(one.model, two.model)
  moments = [x for x in jax.tree.leaves(nnx.state(one.optimizer)) if np.ndim(x)]
  assert moments and any(np.abs(np.asarray(m)).max() > 1e-6 for m in moments)
  for x, y in zip(
    jax.tree.leaves(nnx.state(one.optimizer)),
    jax.tree.leaves(nnx.state(two.optimizer)),
    strict=True,
  ):
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-4, atol=1e-8)


def _assert_close_after_adams_first_step(one, two, what=nnx.Param):
  """Adam's first update is about lr x sign(gradient): where a gradient is near Adam's eps,
  rounding moves it by up to lr; a gradient of the wrong sign would move it by 2 lr."""
  for x, y in zip(
    jax.tree.leaves(nnx.state(one, what)), jax.tree.leaves(nnx.state(two, what)), strict=True
  ):
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=0, atol=2e-3)


def test_two_devices_update_the_embedding_rows_of_one_devices_step():
  """Sparse SGD on the tables: a row's update is -lr x its gradient, so the rows compare the
  gradients themselves (the launcher test below trains them with lazy Adam)."""
  _two_devices()
  embed = ("author", "field_of_study")
  one = _train("hgt", 1, 16, embed, "sgd")
  two = _train("hgt", 2, 8, embed, "sgd")
  assert two.history[0]["loss"] == pytest.approx(one.history[0]["loss"], rel=1e-5)
  initial = hetero.initial_embeddings([len(mag().features[t]) for t in (1, 3)], 6, 0)
  for k in range(2):
    x, y = (np.asarray(r.model.tables[k].embedding[...]) for r in (one, two))
    assert (x != initial[k]).any(axis=1).sum() > 0  # the step moved some rows
    np.testing.assert_array_equal(x != initial[k], y != initial[k])  # the same rows
    np.testing.assert_allclose(y - initial[k], x - initial[k], rtol=1e-4, atol=1e-9)
  _assert_close_after_adams_first_step(
    one.model, two.model, nnx.All(nnx.Param, nnx.Not(classifiers.is_table))
  )


def test_data_parallel_refuses_plans():
  _two_devices()
  config = TrainConfig(model="hgt", hidden=16, heads=2, epochs=1, layers=1, devices=2)
  with pytest.raises(ValueError, match="offload plan runs on one device"):
    hetero.train(mag(), config, hetero.MinibatchConfig(fanouts=(4,)), plan=())


#: A small `train hgt --minibatch` run: 313 training papers, 4 devices x 16 seeds per step.
HGT = [
  "train",
  "hgt",
  "--scale",
  "5e-4",
  "--classes",
  "4",
  "--minibatch",
  "--fanouts",
  "4,4",
  "--batch-size",
  "16",
  "--hidden",
  "16",
  "--heads",
  "2",
  "--embed",
  "author",
  "--embed-dim",
  "6",
  "--devices",
  "0",
  "--epochs",
  "2",
]


def _tables(path) -> list[np.ndarray]:
  from jaxdata.tasks import checkpoint

  return [np.asarray(t.embedding[...]) for t in checkpoint.load_model(path).model.tables]


@pytest.mark.slow
def test_two_processes_of_two_devices_train_like_one_process_of_four(tmp_path):
  """Same global batches, same per-device keys (sampled fanouts here): every epoch's loss and
  validation accuracy and the trained embedding table agree. The launch is
  docs/distributed.md's, as written (`--out hgt-mb-2x2`)."""
  run, multi = _launched(doc_blocks.run_block("docs/distributed.md", tmp_path))
  assert run == [*HGT, "--out", "hgt-mb-2x2"], run
  single = _jaxdata([*HGT, "--out", str(tmp_path / "single")], _env(4), 300)
  assert single.returncode == 0, single.stdout + single.stderr
  assert "cpu x 4" in multi.stdout and "cpu x 4" in single.stdout
  assert "[0] validation accuracy" in multi.stdout
  assert "[1] validation accuracy" not in multi.stdout
  out = {"multi": tmp_path / "hgt-mb-2x2", "single": tmp_path / "single"}
  hist = {k: json.load(open(out[k] / "history.json")) for k in out}
  assert len(hist["multi"]) == len(hist["single"]) == 2
  for m, s in zip(hist["multi"], hist["single"]):
    assert m["batches"] == s["batches"] == 5
    assert m["loss"] == pytest.approx(s["loss"], rel=1e-5)
    assert m["val_accuracy"] == pytest.approx(s["val_accuracy"], abs=1e-9)
  # The job itself compared its processes' copies by SHA-256 (an error if one missed a row);
  # against one process they agree to rounding (gloo and the in-process all-reduce sum the
  # dense gradients in different orders, so the bits may differ).
  multi_tables, single_tables = _tables(out["multi"]), _tables(out["single"])
  assert len(multi_tables) == 1
  for m, s in zip(multi_tables, single_tables, strict=True):
    np.testing.assert_allclose(m, s, rtol=1e-4, atol=1e-6)
