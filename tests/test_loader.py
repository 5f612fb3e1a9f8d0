"""jaxdata.loader: a user's heterograph (NumPy dicts), a model written here, the user's own loop.

With fanouts that cover every in-edge, the loss and gradients on the loader's batches equal the
full graph's at the seeds (dense parameters and the embedding rows); a few epochs of the test's
own `nnx.jit` loop learn; the iterator's saved state resumes the same batch sequence; features
given as a HostTable, a device array or a .npy file, and the device pipeline, give the same
batches.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxdata.data import HeteroGraph
from jaxdata.hector import GraphArrays
from jaxdata.host import HostGraph, HostTable, sample_neighbors, sparse_adam, sparse_sgd
from jaxdata.loader import Batch, Loader, TreeBatch
from jaxdata.nn import RGCN

NUM_NODES = {"paper": 30, "author": 20, "field": 6}
EMBED = 8


@functools.cache
def user_data():
  """What a user brings: typed edges with local ids, paper and field features, paper labels."""
  rng = np.random.default_rng(0)

  def edges(s, d, n):
    return rng.integers(0, NUM_NODES[s], n), rng.integers(0, NUM_NODES[d], n)

  graph = {
    ("author", "writes", "paper"): edges("author", "paper", 60),
    ("paper", "cites", "paper"): edges("paper", "paper", 50),
    ("paper", "has_topic", "field"): edges("paper", "field", 30),
  }
  features = {
    "paper": rng.standard_normal((30, 5)).astype(np.float32),
    "field": rng.standard_normal((6, 3)).astype(np.float32),
  }
  labels = {"paper": rng.integers(0, 3, 30), "field": rng.integers(0, 3, 6)}
  return graph, features, labels


class Net(nnx.Module):
  """The user's model: a projection per node type, two RGCN layers, a classifier."""

  def __init__(self, widths, num_relations, rngs):
    self.proj = nnx.List([nnx.Linear(w, 16, rngs=rngs) for w in widths])
    self.convs = nnx.List([RGCN(16, 16, num_relations=num_relations, rngs=rngs) for _ in range(2)])
    self.out = nnx.Linear(16, 3, rngs=rngs)

  def project(self, xs, types):
    return sum(
      jnp.where((types == t)[:, None], p(x), 0) for t, (p, x) in enumerate(zip(self.proj, xs))
    )

  def on_batch(self, batch: Batch, xs):
    h = self.project(xs, batch.types)
    for i, conv in enumerate(self.convs):  # layer i runs on hop L - 1 - i
      hop = len(self.convs) - 1 - i
      h = jax.nn.relu(conv(batch.blocks.graphs[hop], h))[: batch.blocks.nodes[hop].shape[0]]
    return self.out(h[: batch.seeds.shape[0]])

  def full(self, graph, xs, types):
    h = self.project(xs, types)
    for conv in self.convs:
      h = jax.nn.relu(conv(graph, h))
    return self.out(h)


def batch_loss(model, batch, learned, embedded):
  xs = list(batch.inputs)
  for t, x in zip(embedded, learned):
    xs[t] = x
  ce = optax.softmax_cross_entropy_with_integer_labels(model.on_batch(batch, xs), batch.labels)
  return jnp.sum(jnp.where(batch.mask, ce, 0)) / jnp.maximum(batch.mask.sum(), 1)


def make_loader(**kw):
  graph, features, labels = user_data()
  kw = dict(
    dict(features=features, embeddings={"author": EMBED}, labels=labels, fanouts=(2, 2)), **kw
  )
  return Loader(graph, num_nodes=NUM_NODES, **kw)


def test_full_fanout_batches_give_the_full_graph_loss_and_gradients():
  graph, features, labels = user_data()
  full = HeteroGraph.from_typed_edges(graph, NUM_NODES)
  fanout = int(full.in_degree().max())
  with make_loader(fanouts=(fanout, fanout)) as loader:
    widths = [5, EMBED, 3]  # paper, author, field: the loader's node_types order
    assert loader.node_types == ("paper", "author", "field") and loader.embedded == (1,)
    model = Net(widths, loader.num_relations, nnx.Rngs(0))
    # seeds of two node types, a repeat and padding
    seeds = np.r_[loader.global_ids({"paper": [0, 4, 9, 4], "field": [1, 5]}), -1].astype(np.int32)
    batch = jax.jit(Loader.sample)(loader, seeds, jax.random.key(3))
    embedded = loader.embedded

    def loss_batch(model, learned):
      return batch_loss(model, batch, learned, embedded)

    (lb, (gb, rows)) = nnx.value_and_grad(loss_batch, argnums=(0, 1))(
      model, [batch.inputs[t] for t in embedded]
    )
    table = jnp.asarray(loader.tables[1].as_numpy())

    def loss_full(model, table):
      o = loader.type_offsets
      types = jnp.asarray(np.repeat(np.arange(3), np.diff(o)))
      xs = [
        jnp.zeros((o[-1], w)).at[o[t] : o[t + 1]].set(x)
        for t, (w, x) in enumerate(zip(widths, (features["paper"], table, features["field"])))
      ]
      logits = model.full(GraphArrays.from_graph(full), xs, types)[np.maximum(seeds, 0)]
      y = np.concatenate([labels["paper"], np.full(20, -1), labels["field"]])[np.maximum(seeds, 0)]
      valid = np.r_[True, True, True, False, True, True, False]  # the repeated 4, the padding
      np.testing.assert_array_equal(batch.mask, valid)
      np.testing.assert_array_equal(batch.labels[valid], y[valid])
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, np.maximum(y, 0))
      return jnp.sum(jnp.where(valid, ce, 0)) / valid.sum()

    lf, (gf, gtable) = nnx.value_and_grad(loss_full, argnums=(0, 1))(model, table)
    np.testing.assert_allclose(lb, lf, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(gb), jax.tree.leaves(gf)):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    # the embedding rows' gradients, scattered to their table rows, are the table's gradient
    (ids,) = loader.embedding_ids(batch)
    scattered = jnp.zeros((21, EMBED)).at[ids].add(rows[0])[:20]
    np.testing.assert_allclose(scattered, gtable, rtol=1e-4, atol=1e-6)
    assert np.abs(gtable).sum() > 0


def test_the_users_own_loop_learns_and_trains_the_embeddings():
  with make_loader(fanouts=(4, 4)) as loader:
    model = Net([5, EMBED, 3], loader.num_relations, nnx.Rngs(1))
    optimizer = nnx.Optimizer(model, optax.adam(0.02), wrt=nnx.Param)
    table_opt = sparse_adam(0.02)
    states = loader.init_embeddings(table_opt)
    before = loader.tables[1].as_numpy().copy()

    @nnx.jit
    def step(model, optimizer, states, loader, batch):
      batch = loader.complete(batch)
      learned = [batch.inputs[t] for t in loader.embedded]
      grad_fn = nnx.value_and_grad(batch_loss, argnums=(0, 2))
      loss, (grads, rows) = grad_fn(model, batch, learned, loader.embedded)
      optimizer.update(model, grads)
      return loss, loader.update_embeddings(table_opt, states, batch, rows)

    losses = []
    for batch in loader.batches({"paper": np.arange(30)}, 10, num_epochs=15):
      loss, token = step(model, optimizer, states, loader, batch)
      losses.append(float(loss))
    jax.block_until_ready(token)
    assert np.mean(losses[-3:]) < 0.6 * np.mean(losses[:3]), losses
    after = loader.tables[1].as_numpy()
    assert not np.allclose(before, after)  # authors' rows learned in host memory


def test_the_iterators_state_resumes_the_same_batches():
  with make_loader() as loader:
    seeds = {"paper": np.arange(30), "field": np.arange(6)}
    it = loader.batches(seeds, 8, seed=5, num_epochs=2)
    assert len(it) == 5  # 36 seeds: the last batch padded
    first = [next(it) for _ in range(7)]  # into the second epoch
    state = it.get_state()
    assert state == {"epoch": 1, "index": 2, "seed": 5}
    rest = list(it)
    assert len(rest) == 3
    again = loader.batches(seeds, 8, seed=5, num_epochs=2)
    again.set_state(state)
    for a, b in zip(rest, again, strict=True):
      for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)
    # an epoch holds every seed once, in another order each epoch; padding only at its end
    epochs = [
      np.concatenate([np.asarray(b.seeds) for b in (first + rest)[e * 5 : e * 5 + 5]])
      for e in (0, 1)
    ]
    for e in epochs:
      np.testing.assert_array_equal(np.sort(e[e >= 0]), loader.global_ids(seeds))
      assert (e[-4:] == -1).all() and (e[:-4] >= 0).all()
    assert not np.array_equal(epochs[0], epochs[1])
    dropped = loader.batches(seeds, 8, drop_last=True, shuffle=False)
    want = loader.global_ids(seeds)[:32].reshape(4, 8)
    assert [np.asarray(b.seeds).tolist() for b in dropped] == want.tolist()
    with pytest.raises(ValueError, match="seed 5, not 6"):
      loader.batches(seeds, 8, seed=6).set_state(state)


def test_features_from_a_table_a_device_array_a_npy_file_and_the_device_pipeline_agree(tmp_path):
  graph, features, labels = user_data()
  np.save(tmp_path / "field.npy", features["field"])
  seeds, key = np.arange(0, 30, 3, dtype=np.int32), jax.random.key(7)
  sample = jax.jit(Loader.sample)
  with make_loader() as reference, HostTable(features["paper"]) as paper:
    want = sample(reference, seeds, key)
    kinds = [
      dict(features={"paper": paper, "field": jnp.asarray(features["field"])}),
      dict(features={"paper": features["paper"], "field": str(tmp_path / "field.npy")}),
      dict(pipeline="device"),
      dict(cache=0.5),
    ]
    for kind in kinds:
      with make_loader(**kind) as loader:
        got = sample(loader, seeds, key)
        for x, y in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
          np.testing.assert_array_equal(x, y)
    assert not paper.closed  # given, not owned


def test_a_homogeneous_host_graph_and_mistakes():
  rng = np.random.default_rng(1)
  x = rng.standard_normal((12, 4)).astype(np.float32)
  indptr = np.r_[0, np.cumsum(rng.integers(0, 4, 12))]
  with (
    HostGraph(indptr, rng.integers(0, 12, indptr[-1])) as g,
    Loader(g, features=x, labels=np.arange(12) % 2, fanouts=(3,)) as loader,
  ):
    batch = jax.jit(Loader.sample)(loader, np.arange(4), jax.random.key(0))
    nodes, mask = np.asarray(batch.blocks.nodes[-1]), np.asarray(batch.blocks.masks[-1])
    np.testing.assert_array_equal(np.asarray(batch.inputs[0])[mask], x[nodes[mask]])
    assert batch.labels.tolist() == [0, 1, 0, 1] and loader.num_relations == 1
  graph, features, labels = user_data()
  with pytest.raises(ValueError, match="needs num_nodes"):
    Loader(graph, fanouts=(2,))
  with pytest.raises(ValueError, match=r"names node types \['paperz'\]"):
    make_loader(features={"paperz": features["paper"]})
  with pytest.raises(ValueError, match="both features and embeddings"):
    make_loader(embeddings={"paper": 4})
  with pytest.raises(ValueError, match="the type has 30 nodes"):
    make_loader(features={"paper": features["paper"][:5]})
  with pytest.raises(ValueError, match="labels of node type 'paper'"):
    make_loader(labels={"paper": np.zeros(30, np.float32)})
  with make_loader() as loader, pytest.raises(ValueError, match="batch_size must be a positive"):
    loader.batches({"paper": [1]}, 0)


def _homogeneous(rng, nodes=12, most=4):
  x = rng.standard_normal((nodes, 4)).astype(np.float32)
  indptr = np.r_[0, np.cumsum(rng.integers(0, most, nodes))]
  return x, indptr, rng.integers(0, nodes, indptr[-1])


def test_tree_batches_are_sample_neighbors_with_every_hops_rows():
  """A tree loader's batch holds `sample_neighbors`' tree for the same key and every hop's
  feature rows (zeros in padding), from a host table, a device cache and the device pipeline."""
  x, indptr, indices = _homogeneous(np.random.default_rng(2))
  seeds, key = np.array([3, 0, -1, 7], np.int32), jax.random.key(4)
  sample = jax.jit(Loader.sample)
  with HostGraph(indptr, indices) as g:
    want = jax.jit(sample_neighbors, static_argnums=2)(g, seeds, (3, 2), key)
    for kind in (dict(), dict(cache=0.5), dict(pipeline="device")):
      with Loader(g, features=x, labels=np.arange(12) % 3, fanouts=(3, 2), tree=True, **kind) as ld:
        batch = sample(ld, seeds, key)
        assert isinstance(batch, TreeBatch) and ld.tree
        for n, m, got_n, got_m, rows in zip(
          want.nodes, want.masks, batch.blocks.nodes, batch.blocks.masks, batch.inputs
        ):
          np.testing.assert_array_equal(got_n, n)
          np.testing.assert_array_equal(got_m, m)
          m = np.asarray(m)
          np.testing.assert_array_equal(np.asarray(rows)[m], x[np.asarray(n)[m]])
          assert not np.asarray(rows)[~m].any()
        assert batch.labels.tolist() == [0, 0, 0, 1] and batch.mask.tolist() == [1, 1, 0, 1]


def test_tree_batches_with_full_fanouts_give_the_full_graph_sage_logits():
  """A GraphSAGE-mean model written here, run on tree batches whose fanouts cover every
  in-edge, gives at the seeds the logits the same model computes on the whole graph."""
  rng = np.random.default_rng(5)
  x, indptr, indices = _homogeneous(rng, nodes=15, most=4)
  w_self, w_neigh = (rng.standard_normal((2, 4, 4)) / 2).astype(np.float32)

  def layer(h, neighbours, mask):  # the tree: node i's neighbours are rows i*f .. (i+1)*f
    f = neighbours.shape[0] // h.shape[0]
    m = mask.reshape(h.shape[0], f, 1)
    mean = (neighbours.reshape(h.shape[0], f, -1) * m).sum(1) / jnp.maximum(m.sum(1), 1)
    return jnp.tanh(h @ w_self + mean @ w_neigh)

  def on_tree(batch):
    h, masks = list(batch.inputs), batch.blocks.masks
    for _ in range(2):
      h = [layer(h[i], h[i + 1], masks[i + 1]) for i in range(len(h) - 1)]
    return h[0]

  adjacency = np.zeros((15, 15), np.float32)  # row v: the mean over v's in-edges (with repeats)
  for v in range(15):
    for u in indices[indptr[v] : indptr[v + 1]]:
      adjacency[v, u] += 1 / (indptr[v + 1] - indptr[v])
  full = x
  for _ in range(2):
    full = np.tanh(full @ w_self + (adjacency @ full) @ w_neigh)
  seeds = np.arange(15, dtype=np.int32)
  with HostGraph(indptr, indices) as g, Loader(g, features=x, fanouts=(4, 4), tree=True) as ld:
    got = np.asarray(
      jax.jit(lambda ld, s, k: on_tree(ld.sample(s, k)))(ld, seeds, jax.random.key(0))
    )
  np.testing.assert_allclose(got, full, rtol=1e-5, atol=1e-5)


def test_tree_embeddings_learn_every_hops_rows():
  """An embedded node type in a tree loader: `prepare` leaves the inputs to `complete`, and
  `update_embeddings` with each hop's gradient subtracts, per row, lr times the sum over its
  slots of every hop (NumPy)."""
  _, indptr, indices = _homogeneous(np.random.default_rng(6))
  table0 = np.random.default_rng(7).standard_normal((12, 3)).astype(np.float32)
  seeds, key, opt = np.array([1, 5, 9], np.int32), jax.random.key(1), sparse_sgd(0.5)
  with (
    HostGraph(indptr, indices) as g,
    Loader(g, embeddings=table0, fanouts=(2, 2), tree=True) as ld,
  ):
    assert jax.jit(Loader.prepare)(ld, seeds, key).inputs is None
    states = ld.init_embeddings(opt)

    @jax.jit
    def step(ld, states):
      batch = ld.sample(seeds, key)
      grads = tuple(  # hop h, slot i: 1 + i where the slot holds a node
        jnp.where(m[:, None], 1.0 + jnp.arange(len(m), dtype=jnp.float32)[:, None], 0.0)
        * jnp.ones(3)
        for m in batch.blocks.masks
      )
      return batch, ld.update_embeddings(opt, states, batch, [grads])

    batch, token = step(ld, states)
    jax.block_until_ready(token)
    want = table0.copy()
    for n, m in zip(batch.blocks.nodes, batch.blocks.masks):
      for slot in np.flatnonzero(np.asarray(m)):
        want[int(n[slot])] -= 0.5 * (1.0 + slot)
    np.testing.assert_allclose(ld.tables[0].as_numpy(), want, rtol=1e-6)
    for rows, n, m in zip(batch.inputs, batch.blocks.nodes, batch.blocks.masks):
      np.testing.assert_array_equal(
        np.asarray(rows)[np.asarray(m)], table0[np.asarray(n)[np.asarray(m)]]
      )
  graph, features, labels = user_data()
  with pytest.raises(ValueError, match="tree=True samples a graph of one node type"):
    make_loader(tree=True)


def test_a_mesh_gives_each_device_its_share_sampled_with_its_own_key():
  cpus = jax.devices("cpu")[:2]
  if len(cpus) < 2:
    pytest.skip("needs two CPU devices (--xla_force_host_platform_device_count)")
  mesh = jax.sharding.Mesh(np.array(cpus), ("data",))
  with make_loader() as loader:
    seeds = {"paper": np.arange(30)}
    one = loader.batches(seeds, 6, seed=2, num_epochs=1)
    two = loader.batches(seeds, 3, seed=2, num_epochs=1, mesh=mesh)
    assert len(two) == len(one) == 5  # 3 seeds per device, 6 per step
    prepare = jax.jit(Loader.prepare)
    for i, (a, b) in enumerate(zip(one, two, strict=True)):
      leaves = b.leaves
      assert leaves[0].sharding.spec == jax.sharding.PartitionSpec("data")
      key = jax.random.fold_in(jax.random.fold_in(jax.random.key(2), 0), i)
      for d in range(2):  # device d's part: its share, sampled with fold_in(key, d)
        want = prepare(loader, np.asarray(a.seeds)[3 * d : 3 * d + 3], jax.random.fold_in(key, d))
        for x, y in zip(jax.tree.leaves(want), leaves, strict=True):
          n = x.shape[0]
          np.testing.assert_array_equal(x, np.asarray(y)[d * n : (d + 1) * n])
      # inside shard_map each device reads its own Batch
      count = jax.shard_map(
        lambda sb: sb.batch.mask.sum()[None], mesh=mesh, in_specs=P("data"), out_specs=P("data")
      )(b)
      np.testing.assert_array_equal(count, np.asarray(a.mask).reshape(2, 3).sum(1))


def test_the_docstring_examples_run():
  import doctest

  import jaxdata.loader
  import jaxdata.loader.loader

  for module in (jaxdata.loader, jaxdata.loader.loader):
    result = doctest.testmod(module)
    assert result.attempted and not result.failed, module.__name__
