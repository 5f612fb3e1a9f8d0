"""The software-pipelined mini-batch step (`MinibatchConfig.prefetch`, `Steps.pipelined`):
step i trains on batch i while batch i + 1 is sampled and its feature rows gathered, in one
program. It must compute exactly what the plain step computes: the same
losses, parameters and embedding tables, every batch once."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxdata.data import synthetic_mag
from jaxdata.host import sparse
from jaxdata.nn.classifiers import is_table
from jaxdata.train import common
from jaxdata.train.attention import TrainConfig, build_model
from jaxdata.train.attention import minibatch as hetero

# Its tests take 5 s to minutes each: the fast tier (-m "not slow") leaves this file out.
pytestmark = pytest.mark.slow

EMBED = ("author", "field_of_study")


@functools.cache
def mag():
  return synthetic_mag(scale=5e-4, seed=1, num_classes=4)


def _params(model):
  return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def test_pipelined_epoch_trains_every_row_once_in_order_with_run_epochs_keys():
  rows = np.arange(5 * 3, dtype=np.int32).reshape(5, 3)
  rows[-1, 1:] = -1  # a padded last batch
  key = jax.random.key(7)
  plain = []

  def step(seeds, k):
    plain.append((np.asarray(seeds), np.asarray(jax.random.key_data(k))))
    n = (seeds >= 0).sum()
    return seeds.sum() * 1.0, n, n, jnp.int32(0)

  want = common.run_epoch(step, rows, key)

  prepared, trained = [], []

  def prepare(seeds, k):
    prepared.append((np.asarray(seeds), np.asarray(jax.random.key_data(k))))
    return seeds, k

  def piped(batch, seeds_next, k_next):
    seeds, k = batch
    trained.append((np.asarray(seeds), np.asarray(jax.random.key_data(k))))
    n = (seeds >= 0).sum()
    return (seeds.sum() * 1.0, n, n, jnp.int32(0), prepare(seeds_next, k_next))

  got = common.run_pipelined_epoch(prepare, piped, rows, key)

  assert len(trained) == len(plain) == 5
  for (a, ka), (b, kb) in zip(trained, plain):
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(ka, kb)
  # one batch prepared ahead of each step; the last one is all padding, dropped
  assert len(prepared) == 6 and (prepared[-1][0] == -1).all()
  assert got["seeds"] == want["seeds"] == 13 and got["batches"] == want["batches"] == 5
  assert got["loss"] == want["loss"]
  empty = common.run_pipelined_epoch(prepare, piped, rows[:0], key)
  assert empty["batches"] == 0 and empty["seeds"] == 0


def _setup(ds, config, pipeline="host"):
  model = build_model(ds, config, nnx.Rngs(config.seed), tables=False)
  embeddings = dict(
    zip(
      model.embedded,
      hetero.initial_embeddings(
        [len(ds.features[t]) for t in model.embedded], config.embed_dim, config.seed
      ),
    )
  )
  dense = nnx.All(nnx.Param, nnx.Not(is_table))
  optimizer = nnx.Optimizer(model, optax.adam(config.learning_rate), wrt=dense)
  data = hetero.make_loader(ds, pipeline, (3, 3), embeddings=embeddings)
  table_opt = sparse.BY_NAME["adam"](config.learning_rate)
  states = data.init_embeddings(table_opt)
  return model, optimizer, data, dense, table_opt, states


@pytest.mark.parametrize("embed", [(), EMBED], ids=["features", "embeddings"])
def test_pipelined_steps_give_the_plain_steps_losses_parameters_and_tables(device, embed):
  ds = mag()
  config = TrainConfig(
    model="hgt", hidden=16, heads=2, learning_rate=0.01, embed=embed, embed_dim=8
  )
  rows = common.seed_batches(
    np.asarray(ds.train_papers) + ds.node_range("paper")[0], 48, np.random.default_rng(0), 4
  )
  key = jax.random.key(3)
  results = {}
  with jax.default_device(device):
    for piped in (False, True):
      model, optimizer, data, dense, table_opt, states = _setup(ds, config)
      with data:
        steps = hetero.make_steps(dense, table_opt)
        outs = []
        if piped:
          batch = steps.prepare(data, jnp.asarray(rows[0]), jax.random.fold_in(key, 0))
          for i in range(len(rows)):
            nxt = rows[i + 1] if i + 1 < len(rows) else np.full_like(rows[0], -1)
            *out, batch = steps.pipelined(
              model,
              optimizer,
              states,
              data,
              batch,
              jnp.asarray(nxt),
              jax.random.fold_in(key, i + 1),
            )
            outs.append(out)
        else:
          for i, row in enumerate(rows):
            outs.append(
              steps.step(
                model, optimizer, states, data, jnp.asarray(row), jax.random.fold_in(key, i)
              )
            )
        jax.block_until_ready(outs)
        tables = [data.tables[t].as_numpy().copy() for t in data.embedded]
        for s in states:
          sparse.close(s)
      results[piped] = ([[float(o[k]) for k in range(3)] for o in outs], _params(model), tables)
  (plain_out, plain_p, plain_t), (pipe_out, pipe_p, pipe_t) = results[False], results[True]
  assert [o[2] for o in pipe_out] == [o[2] for o in plain_out]  # seeds per step
  assert sum(o[2] for o in pipe_out) == (rows >= 0).sum()
  assert len(pipe_t) == len(plain_t) == len(embed)
  if device.platform == "gpu":
    # The GPU's scatter-adds (atomics) add in any order, even between two runs of one
    # program; Adam turns a gradient element that is rounding noise into a full step, so
    # parameters are compared on the CPU only.
    np.testing.assert_allclose(pipe_out, plain_out, rtol=2e-4)
    return
  np.testing.assert_allclose(pipe_out, plain_out, rtol=1e-6)
  for a, b in zip(pipe_p + pipe_t, plain_p + plain_t):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("embed", [(), EMBED], ids=["features", "embeddings"])
def test_prefetch_training_equals_plain_training_over_epochs(embed):
  ds = mag()
  config = TrainConfig(
    model="rgat", epochs=2, hidden=16, heads=2, learning_rate=0.01, embed=embed, embed_dim=8
  )
  runs = {
    p: hetero.train(
      ds,
      config,
      hetero.MinibatchConfig(fanouts=(3, 3), batch_size=40, prefetch=p, cache=0.25),
      final_evaluation="none",
      validate=False,
    )
    for p in (False, True)
  }
  gpu = jax.default_backend() == "gpu"  # atomics: see the test above
  for a, b in zip(runs[True].history, runs[False].history):
    # 313 training papers in batches of 40: the last batch is padded; none lost or repeated
    assert a["seeds"] == b["seeds"] == len(ds.train_papers)
    assert a["batches"] == b["batches"] == -(-len(ds.train_papers) // 40)
    np.testing.assert_allclose(a["loss"], b["loss"], rtol=3e-3 if gpu else 1e-6)
  if gpu:
    return
  for a, b in zip(runs[True].history, runs[False].history):
    assert a["train_accuracy"] == b["train_accuracy"]
  # every Param, the trained embedding tables (back in the model as NumPy arrays) included
  assert len(runs[True].model.tables) == len(embed)
  for a, b in zip(_params(runs[True].model), _params(runs[False].model)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_cli_prefetch_flag_reaches_the_config():
  import argparse

  from jaxdata.train import attention

  parser = argparse.ArgumentParser()
  attention.add_arguments(parser, "hgt")
  assert parser.parse_args(["--prefetch"]).prefetch is True
  assert parser.parse_args(["--no-prefetch"]).prefetch is False
  assert parser.parse_args([]).prefetch is False
