"""Mini-batch RGCN data parallel (jaxdata.train.attention.minibatch.sharded_steps).

With fanouts that cover every in-edge of two hops the samples are whole neighbourhoods,
whatever the keys, so K devices with `batch_size` seeds each must take the step one device
takes on the same global batch (K x `batch_size` seeds): the same loss (the L2 term counting
each row of the global batch once), dense parameters, Adam moments (the first is
(1 - b1) x the gradient: a gradient summed twice shows there) and node rows (sparse SGD: a
row's change is -lr x its gradient). Through the launcher, 2 processes of 1 device train like
one process of 2 devices.
"""

import dataclasses
import json

import doc_blocks
import jax
import numpy as np
import pytest
from flax import nnx
from test_distributed import _env, _jaxdata, _launched  # the CLI in a fresh CPU process
from test_train_hetero_parallel import _assert_close_after_adams_first_step, _two_devices
from test_train_rgcn_minibatch import entities  # 120 nodes, 3 relations and their inverses

from jaxdata.tasks.rgcn import TrainConfig, build_model, split_validation
from jaxdata.train.attention import minibatch as mb

# Its tests take 5 s to minutes each: the fast tier (-m "not slow") leaves this file out.
pytestmark = pytest.mark.slow


def _width(ds) -> int:
  return int(ds.graph.in_degree().max())


def _train(ds, devices: int, batch_size: int, table_optimizer="sgd", l2=5e-3, pipeline="host"):
  config = TrainConfig(epochs=1, hidden=5, num_bases=2, l2=l2, learning_rate=0.01, devices=devices)
  w = _width(ds)
  return mb.train(
    ds,
    config,
    mb.MinibatchConfig(
      fanouts=(w, w),
      batch_size=batch_size,
      max_batches=1,
      table_optimizer=table_optimizer,
      pipeline=pipeline,
    ),
  )


@pytest.mark.parametrize("l2", [0.0, 5e-3], ids=["no-l2", "l2"])
def test_two_devices_take_one_devices_step_on_the_same_global_batch(l2):
  """Featureless: the node rows train in a host table (sparse SGD here), the rest by Adam."""
  _two_devices()
  ds = entities()
  one = _train(ds, 1, 12, l2=l2)
  two = _train(ds, 2, 6, l2=l2)
  assert one.history[0]["seeds"] == two.history[0]["seeds"] == 12
  assert two.history[0]["loss"] == pytest.approx(one.history[0]["loss"], rel=1e-5)
  config = TrainConfig(hidden=5, num_bases=2)
  initial = np.asarray(build_model(ds, config, nnx.Rngs(0)).conv1.node_rows())
  x, y = (np.asarray(r.model.conv1.node_rows()) for r in (one, two))
  assert (x != initial).any(axis=1).sum() > 10  # the step moved rows
  np.testing.assert_array_equal(x != initial, y != initial)  # the same rows
  # the updates (-lr x gradient) agree; atol: rounding of row - update, a few ulps of a row
  ulp = float(np.spacing(np.abs(initial).max().astype(np.float32)))
  np.testing.assert_allclose(y - initial, x - initial, rtol=1e-4, atol=4 * ulp)
  model = build_model(ds, config, nnx.Rngs(0))
  _assert_close_after_adams_first_step(one.model, two.model, mb.dense_filter(model))


@pytest.mark.parametrize("pipeline", ["host", "device"])
def test_with_features_two_devices_give_one_devices_adam_moments(pipeline):
  """With features every parameter is dense: the optimizer state comes back and its moments
  (gradients of the mean loss plus the L2 term's, added once) agree."""
  _two_devices()
  ds = entities(featureless=False)
  one = _train(ds, 1, 12, pipeline=pipeline)
  two = _train(ds, 2, 6, pipeline=pipeline)
  assert two.history[0]["loss"] == pytest.approx(one.history[0]["loss"], rel=1e-5)
  moments = [x for x in jax.tree.leaves(nnx.state(one.optimizer)) if np.ndim(x)]
  assert moments and any(np.abs(np.asarray(m)).max() > 1e-6 for m in moments)
  for x, y in zip(
    jax.tree.leaves(nnx.state(one.optimizer)),
    jax.tree.leaves(nnx.state(two.optimizer)),
    strict=True,
  ):
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-4, atol=1e-8)


def test_data_parallel_trains_and_validates_on_sampled_batches():
  _two_devices()
  ds = entities()
  config = TrainConfig(
    epochs=3, hidden=8, num_bases=2, learning_rate=0.05, val_fraction=0.2, devices=None
  )
  result = mb.train(ds, config, mb.MinibatchConfig(fanouts=(4, 4), batch_size=2))
  losses = [h["loss"] for h in result.history]
  assert losses[-1] < losses[0]
  assert all(0 <= h["val_accuracy"] <= 1 for h in result.history)
  assert result.history[0]["batches"] == -(
    -len(split_validation(len(ds.train_idx), 0.2, 0)[0]) // 4
  )  # 2 seeds x 2 devices per step
  with pytest.raises(ValueError, match="devices=3, but 2 are visible"):
    mb.train(ds, dataclasses.replace(config, devices=3), mb.MinibatchConfig(fanouts=(4, 4)))


def test_two_processes_train_like_one_process_of_two_devices(tmp_path):
  """Same global batches, same per-device keys (sampled fanouts): every epoch's loss and
  validation accuracy, and the trained parameters, agree (the synthetic graph has features).
  The launch is docs/distributed.md's, as written (`--out rgcn-mb-2x1`)."""
  run, multi = _launched(doc_blocks.run_block("docs/distributed.md", tmp_path))
  assert run[:3] == ["train", "rgcn", "--minibatch"] and run[-2:] == ["--out", "rgcn-mb-2x1"]
  out = {"multi": tmp_path / "rgcn-mb-2x1", "single": tmp_path / "single"}
  single = _jaxdata([*run[:-2], "--devices", "2", "--out", str(out["single"])], _env(2), 300)
  assert single.returncode == 0, single.stdout + single.stderr
  assert "cpu x 2" in multi.stdout and "cpu x 2" in single.stdout
  hist = {k: json.load(open(out[k] / "history.json")) for k in out}
  assert len(hist["multi"]) == len(hist["single"]) == 2
  for m, s in zip(hist["multi"], hist["single"]):
    assert m["batches"] == s["batches"] > 1
    assert m["loss"] == pytest.approx(s["loss"], rel=1e-5)
    assert m["val_accuracy"] == pytest.approx(s["val_accuracy"], abs=1e-9)
  from jaxdata.tasks import checkpoint

  params = [
    jax.tree.leaves(nnx.state(checkpoint.load_model(str(out[k])).model, nnx.Param)) for k in out
  ]
  for m, s in zip(*params, strict=True):
    np.testing.assert_allclose(np.asarray(m), np.asarray(s), rtol=1e-4, atol=1e-6)
