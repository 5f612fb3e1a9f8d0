"""GraphSAGE on sampled blocks, and mini-batch training through the three pipelines."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdata.data.powerlaw import powerlaw_graph
from jaxdata.host import DeviceCache, HostGraph, sample_neighbors
from jaxdata.nn import GraphSAGE, SAGEConv
from jaxdata.train.sage import SageConfig, train


def _linear(layer, x):
  y = x @ np.asarray(layer.kernel[...])
  return y + np.asarray(layer.bias[...]) if layer.bias is not None else y


def test_sage_conv_matches_numpy_masked_mean():
  rng = np.random.default_rng(0)
  n, f, d = 7, 4, 5
  x = rng.normal(size=(n, d)).astype(np.float32)
  nb = rng.normal(size=(n * f, d)).astype(np.float32)
  mask = rng.random(n * f) < 0.6
  mask[:f] = False  # a node with no sampled neighbour: its mean is zero
  conv = SAGEConv(d, 3, rngs=nnx.Rngs(0))
  got = np.asarray(conv(jnp.asarray(x), jnp.asarray(nb), jnp.asarray(mask)))
  want = np.zeros((n, 3), np.float32)
  for i in range(n):
    rows = [nb[i * f + j] for j in range(f) if mask[i * f + j]]
    mean = np.mean(rows, axis=0) if rows else np.zeros(d, np.float32)
    want[i] = _linear(conv.self_linear, x[i]) + _linear(conv.neigh_linear, mean)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_graphsage_matches_jraph_aggregation():
  """Two layers on blocks equal the same layers applied through jraph's segment ops."""
  jraph = pytest.importorskip("jraph")
  rng = np.random.default_rng(1)
  x = rng.normal(size=(50, 6)).astype(np.float32)
  with HostGraph.from_edges(
    rng.integers(0, 50, 300), rng.integers(0, 50, 300), 50, features=x
  ) as g:
    blocks = sample_neighbors(g, jnp.array([3, 9, -1, 20]), (3, 2), jax.random.key(0))
    feats = blocks.gather(g.features)
    model = GraphSAGE(6, 8, 4, num_layers=2, rngs=nnx.Rngs(0))
    got = model(feats, blocks.masks)

    def conv(layer, hop, h_dst, h_src):
      gt = blocks.to_jraph(hop)
      n_dst = h_dst.shape[0]
      msg = h_src * blocks.masks[hop + 1][:, None]
      total = jraph.segment_sum(msg, gt.receivers, n_dst)
      count = jraph.segment_sum(blocks.masks[hop + 1].astype(jnp.float32), gt.receivers, n_dst)
      return layer.self_linear(h_dst) + layer.neigh_linear(total / jnp.maximum(count, 1)[:, None])

    l0, l1 = model.layers[0], model.layers[1]
    h1 = [
      jax.nn.relu(conv(l0, 0, feats[0], feats[1])),
      jax.nn.relu(conv(l0, 1, feats[1], feats[2])),
    ]
    want = conv(l1, 0, h1[0], h1[1])
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def small_dataset():
  return powerlaw_graph(num_nodes=4000, num_edges=60_000, feature_dim=16, num_classes=4, seed=3)


def _config(device, **kw):
  base = dict(
    fanouts=(5, 5),
    batch_size=128,
    hidden=32,
    epochs=3,
    learning_rate=1e-2,
    platform=device.platform,
  )
  base.update(kw)
  return SageConfig(**base)


def test_pipelines_train_identically(device, small_dataset):
  """Same seeds, same samples: the GPU-centric, all-in-device and CPU-centric runs agree."""
  results = {
    p: train(small_dataset, _config(device, pipeline=p)) for p in ("host", "device", "cpu")
  }
  results["cached"] = train(small_dataset, _config(device, pipeline="host", cache=0.3))
  losses = {p: [h["loss"] for h in r.history] for p, r in results.items()}
  np.testing.assert_allclose(losses["host"], losses["device"], rtol=1e-3)
  np.testing.assert_allclose(losses["host"], losses["cpu"], rtol=1e-3)
  np.testing.assert_allclose(losses["host"], losses["cached"], rtol=1e-3)
  accs = [r.test_accuracy for r in results.values()]
  chance = 1 / small_dataset.num_classes
  assert min(accs) > chance + 0.25, accs  # it learns
  assert max(accs) - min(accs) < 0.03, accs  # and the GPU-centric path is as accurate
  assert losses["host"][-1] < losses["host"][0]


def test_data_parallel_over_two_devices(device, small_dataset):
  if len(jax.devices(device.platform)) < 2:
    pytest.skip("needs two devices of the platform")
  one = train(small_dataset, _config(device, pipeline="host", devices=1))
  two = train(small_dataset, _config(device, pipeline="host", devices=2, batch_size=64))
  # Same global batch (2 x 64 = 128): comparable learning; every device sampled its share.
  assert two.history[0]["batches"] == one.history[0]["batches"]
  assert two.test_accuracy > one.test_accuracy - 0.05
  assert two.test_accuracy > 1 / small_dataset.num_classes + 0.25


def test_two_devices_average_the_gradient_over_the_global_batch_once(device):
  """With fanouts above every in-degree the samples are whole neighbourhoods, whatever the key,
  so one device and two devices with the same global batch must take the same first step:
  Adam's first moment after one step is (1 - b1) * gradient, the gradient's scale included
  (Adam's update itself hides a constant scale: gradients summed K times over would pass every
  loss test)."""
  if len(jax.devices(device.platform)) < 2:
    pytest.skip("needs two devices of the platform")
  ds = powerlaw_graph(num_nodes=300, num_edges=1200, feature_dim=8, num_classes=3, seed=5)
  top = int(np.diff(np.asarray(ds.indptr)).max())
  cfg = dict(fanouts=(top, top), epochs=1, max_batches=1, evaluate=False, hidden=8)
  one = train(ds, _config(device, devices=1, batch_size=64, **cfg))
  two = train(ds, _config(device, devices=2, batch_size=32, **cfg))
  for a, b in zip(jax.tree.leaves(one.optimizer), jax.tree.leaves(two.optimizer)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-7)


def test_dedup_and_cached_gathers_equal_plain(device, small_dataset):
  x = small_dataset.features
  with HostGraph(small_dataset.indptr, small_dataset.indices, features=x) as g:
    seeds = jnp.array(np.r_[np.arange(0, 4000, 37), [-1, -1]], jnp.int32)
    blocks = jax.jit(sample_neighbors, static_argnums=2)(g, seeds, (10, 5), jax.random.key(2))
    cache = DeviceCache.build(g, g.features, fraction=0.1)
    # The cache holds the rows of the nodes with the highest out-degree.
    out_degree = np.bincount(small_dataset.indices, minlength=4000)
    cached = np.flatnonzero(np.asarray(cache.slots) >= 0)
    assert len(cached) == 400 and out_degree[cached].min() >= np.sort(out_degree)[-400]
    np.testing.assert_array_equal(np.asarray(cache.rows), x[cached])
    gather = jax.jit(lambda b, **kw: b.gather(g.features, **kw), static_argnames="unique")
    plain = jax.device_get(gather(blocks))
    variants = [
      jax.device_get(gather(blocks, unique=True)),
      jax.device_get(gather(blocks, cache=cache)),
      jax.device_get(gather(blocks, unique=True, cache=cache)),
    ]
  for v in variants:
    for a, b in zip(plain, v):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for a, n, m in zip(plain, blocks.nodes, blocks.masks):
    want = np.where(np.asarray(m)[:, None], x[np.maximum(np.asarray(n), 0)], 0)
    np.testing.assert_array_equal(np.asarray(a), want)


def test_bad_config():
  with pytest.raises(ValueError, match="pipeline"):
    SageConfig(pipeline="gpu")
  with pytest.raises(ValueError, match="fanouts"):
    SageConfig(fanouts=(5, 0))
  with pytest.raises(ValueError, match="num_layers"):
    GraphSAGE(4, 4, 2, num_layers=0, rngs=nnx.Rngs(0))
