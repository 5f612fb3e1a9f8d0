"""Mini-batch relational training from host memory (jaxdata.loader.sample_blocks,
train.attention.minibatch).

Through the real typed sampler: with fanouts that cover every in-edge, the RGAT (HGT, RGCN)
classifier on sampled blocks gives the full-graph classifier's logits and gradients at the seeds
(HostGraph and DeviceGraph, CPU and GPU); training on mini-batches learns, both pipelines see the
same samples and losses, and the checkpoint evaluates like a full-graph one.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_cli import _run as run_cli  # `jaxdata ...` in this process

from jaxdata.data import synthetic_mag
from jaxdata.hector import GraphArrays
from jaxdata.loader.blocks import gather_typed, node_types, sample_blocks, type_caches
from jaxdata.nn import classifiers
from jaxdata.train import attention
from jaxdata.train.attention import TrainConfig, build_model
from jaxdata.train.attention import minibatch as hetero

# Its tests take 5 s to minutes each: the fast tier (-m "not slow") leaves this file out.
pytestmark = pytest.mark.slow


@functools.cache
def mag():
  return synthetic_mag(scale=5e-4, seed=1, num_classes=4)


@functools.cache
def small_mag():
  """For full fanouts, whose blocks are padded to the largest in-degree on each hop (seeds x
  in-degree x in-degree slots on the second): 190 here, 683 in `mag()` (a 1.8 GiB process
  instead of 17 GiB on the CPU). Every node and edge type is still there."""
  return synthetic_mag(scale=1e-4, seed=1, num_classes=4)


#: The full-fanout tests hold the most memory of the suite: under pytest-xdist's loadgroup they
#: share one worker, so they do not run at once on one GPU.
FULL_FANOUT = pytest.mark.xdist_group("full_fanout")


@FULL_FANOUT
@pytest.mark.parametrize("model", ["rgat", "hgt", "rgcn"])
@pytest.mark.parametrize("pipeline", ["host", "device"])
def test_full_fanout_blocks_give_the_full_graph_logits_and_gradients(device, pipeline, model):
  ds = small_mag()
  config = TrainConfig(model=model, hidden=16, heads=2)
  model = build_model(ds, config, nnx.Rngs(3))
  width = int(ds.graph.in_degree().max())
  seeds = jnp.asarray(np.r_[np.arange(0, 40, 3), 6, -1].astype(np.int32))  # a repeat, padding
  labels = jnp.asarray(ds.labels)[jnp.maximum(seeds, 0)]
  full = GraphArrays.from_graph(ds.graph)
  xs_full = [jnp.asarray(x) for x in ds.features]
  papers = ds.node_range("paper")[1]

  with hetero.make_loader(ds, pipeline, (width, width)) as loader:

    def loss_blocks(model, loader):
      logits, valid = hetero.forward(model, loader, seeds, jax.random.key(0))
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
      return jnp.sum(jnp.where(valid, ce, 0)), (logits, valid)

    def loss_full(model):
      logits = model(full, xs_full, papers)[jnp.maximum(seeds, 0)]
      valid = (seeds >= 0) & (jnp.arange(seeds.shape[0]) != seeds.shape[0] - 2)  # the second "6"
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
      return jnp.sum(jnp.where(valid, ce, 0)), (logits, valid)

    with jax.default_matmul_precision("highest"):
      (lb, (ob, vb)), gb = nnx.jit(nnx.value_and_grad(loss_blocks, has_aux=True))(model, loader)
      (lf, (of, vf)), gf = nnx.jit(nnx.value_and_grad(loss_full, has_aux=True))(model)
    jax.block_until_ready((lb, ob, gb))  # before the tables close
  np.testing.assert_array_equal(vb, vf)  # the repeated seed counts once
  np.testing.assert_allclose(
    np.asarray(ob)[np.asarray(vb)], np.asarray(of)[np.asarray(vb)], rtol=1e-4, atol=1e-4
  )
  np.testing.assert_allclose(lb, lf, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(gb), jax.tree.leaves(gf)):
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)


def test_blocks_hold_sampled_edges_of_the_graph(device):
  ds = mag()
  with hetero.make_loader(ds, "host", (3, 2)) as data:
    seeds = jnp.arange(0, 64, dtype=jnp.int32)
    blocks = jax.jit(functools.partial(sample_blocks, fanouts=(3, 2)), static_argnames=())(
      data.graph, seeds, key=jax.random.key(1)
    )
    edges = set(zip(ds.graph.src.tolist(), ds.graph.dst.tolist(), ds.graph.etype.tolist()))
    for h, g in enumerate(blocks.graphs):
      src_nodes, dst_nodes = np.asarray(blocks.nodes[h + 1]), np.asarray(blocks.nodes[h])
      norm = np.asarray(g.norm)
      real = norm > 0
      s, d, r = (np.asarray(a)[real] for a in (g.src, g.dst, g.etype))
      assert all(
        (int(src_nodes[a]), int(dst_nodes[b]), int(c)) in edges for a, b, c in zip(s, d, r)
      )
      # at most `fanout` in-edges per destination, and each destination's norm sums to
      # its number of relations
      counts = np.bincount(d, minlength=len(dst_nodes))
      assert counts.max() <= (3, 2)[h]
    types = np.asarray(node_types(data.type_offsets, blocks.nodes[-1]))
    nodes = np.asarray(blocks.nodes[-1])
    want = np.searchsorted(np.asarray(data.type_offsets[1:-1]), nodes, side="right")
    np.testing.assert_array_equal(types[nodes >= 0], want[nodes >= 0])
    xs = jax.block_until_ready(
      gather_typed(data.tables, data.type_offsets, blocks.nodes[-1], blocks.masks[-1])
    )
    for t, x in enumerate(xs):
      mine = (types == t) & (nodes >= 0)
      np.testing.assert_array_equal(
        np.asarray(x)[mine], ds.features[t][nodes[mine] - data.type_offsets[t]]
      )
      assert not np.asarray(x)[~mine].any()
    # with a device cache of each type's most sampled rows: the same rows, fewer read from host
    caches = type_caches(data.graph, data.tables, data.type_offsets, 0.3)
    cached = jax.block_until_ready(
      gather_typed(data.tables, data.type_offsets, blocks.nodes[-1], blocks.masks[-1], caches)
    )
    for a, b in zip(cached, xs):
      np.testing.assert_array_equal(a, b)
    degree = np.bincount(ds.graph.src, minlength=ds.graph.num_nodes)
    for t, cache in enumerate(caches):
      lo, hi = data.type_offsets[t], data.type_offsets[t + 1]
      held = np.flatnonzero(np.asarray(cache.slots) >= 0)
      assert len(held) == max(1, round(0.3 * (hi - lo)))
      # the rows held are those of the type's nodes with the most out-edges
      assert degree[lo:hi][held].min() >= np.delete(degree[lo:hi], held).max(initial=0)
      np.testing.assert_array_equal(np.asarray(cache.rows), ds.features[t][held])


def test_minibatch_training_learns_and_pipelines_agree():
  ds = mag()
  config = TrainConfig(model="rgat", epochs=3, hidden=16, heads=2, learning_rate=0.01)
  runs = {
    p: hetero.train(
      ds,
      config,
      hetero.MinibatchConfig(fanouts=(4, 4), batch_size=32, pipeline=p),
      final_evaluation="minibatch",
    )
    for p in ("host", "device")
  }
  runs["host-cache"] = hetero.train(
    ds,
    config,
    hetero.MinibatchConfig(fanouts=(4, 4), batch_size=32, cache=0.25),
    final_evaluation="minibatch",
  )
  losses = {p: [h["loss"] for h in r.history] for p, r in runs.items()}
  # The same samples and features: the first epoch's losses agree to float rounding; later
  # ones drift apart by the order of GPU atomics (scatter-adds) compounded over Adam steps.
  np.testing.assert_allclose(losses["host"][0], losses["device"][0], rtol=1e-4)
  np.testing.assert_allclose(losses["host"], losses["device"], rtol=3e-3)
  np.testing.assert_allclose(losses["host"], losses["host-cache"], rtol=3e-3)
  assert losses["host"][-1] < losses["host"][0]
  assert runs["host"].metrics["val_accuracy"] > 1.5 / ds.num_classes


def test_bad_configs_and_inputs():
  with pytest.raises(ValueError, match="fanouts must be positive ints"):
    hetero.MinibatchConfig(fanouts=(3, 0))
  with pytest.raises(ValueError, match="pipeline must be one of"):
    hetero.MinibatchConfig(pipeline="gpu")
  with pytest.raises(ValueError, match="cache must be a fraction"):
    hetero.MinibatchConfig(cache=1.5)
  with pytest.raises(ValueError, match="device cache is for the host pipeline"):
    hetero.MinibatchConfig(cache=0.2, pipeline="device")
  ds = mag()
  with hetero.make_loader(ds, "host", (2,)) as data:
    with pytest.raises(TypeError, match="sample_blocks: seeds must be integers"):
      sample_blocks(data.graph, jnp.zeros(3), (2,), jax.random.key(0))
    with pytest.raises(ValueError, match="fanouts must be positive"):
      sample_blocks(data.graph, jnp.zeros(3, jnp.int32), (2, 0), jax.random.key(0))
    with pytest.raises(ValueError, match="has 3 rows, the type has"):
      gather_typed(
        [data.tables[0], jnp.zeros((3, 2)), *data.tables[2:]],
        data.type_offsets,
        jnp.zeros(2, jnp.int32),
        jnp.ones(2, bool),
      )
  # a graph without relations samples as one whose every edge has relation 0
  from jaxdata.host import HostGraph

  indptr, indices = [0, 2, 3, 3], [1, 2, 0]
  with HostGraph(indptr, indices) as plain, HostGraph(indptr, indices, etypes=[0, 0, 0]) as typed:
    a, b = (sample_blocks(g, jnp.arange(3), (2, 2), jax.random.key(0)) for g in (plain, typed))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      np.testing.assert_array_equal(x, y)


def test_cli_minibatch_trains_and_rejects_mistakes(tmp_path, capsys):
  """`jaxdata train hgt --minibatch` (in this process) trains and saves; each mistake is one
  line naming its flag, exit code 2."""
  out = tmp_path / "ck"
  small = ["--minibatch", "--scale", "0.0005"]
  embed = ["--embed", "author,institution", "--embed-dim", "8"]
  code, stdout, stderr = run_cli(
    ["train", "hgt", *small, "--epochs", "1", "--hidden", "8", "--heads", "2", "--fanouts", "3,3",
     "--batch-size", "32", *embed, "--out", str(out)],
    capsys,
  )  # fmt: skip
  assert code == 0, stderr[-2000:]
  assert "val acc" in stdout and (out / "history.json").exists()
  assert "learnable 8-wide embeddings for author, institution" in " ".join(stdout.split())
  for args, message in (
    (("--fanouts", "3"), "give one fanout per layer (--layers 2), got 1"),
    (("--fanouts", "3,0"), "--fanouts"),
    (("--pipeline", "gpu"), "--pipeline"),
    (("--embed", "paper"), "--embed"),
    (("--cache", "0.2", "--pipeline", "device"), "--cache"),
  ):
    code, _, stderr = run_cli(["train", "rgat", *small, *args], capsys)
    assert code == 2 and message in stderr and len(stderr.strip().splitlines()) == 1, stderr
  # --device-bytes auto: a quarter of the host tables (features of the other types, float32
  # embeddings), counted here from the dataset; at this size it cannot hold the dense model,
  # which is a one-line mistake in --device-bytes, not a traceback.
  from jaxdata.sizes import format_bytes

  scale, types, dim = 0.0005, ("author", "institution"), 8
  ds = attention.load_dataset(
    {"scale": scale, "seed": 0, "classes": attention.default_classes(scale)}
  )
  tables = sum(
    len(x) * (dim * 4 if t in types else x.shape[1] * x.itemsize)
    for t, x in zip(ds.graph.node_type_names, ds.features)
  )
  code, stdout, stderr = run_cli(
    ["train", "hgt", *small, "--epochs", "1", "--hidden", "8", "--heads", "2", *embed,
     "--device-bytes", "auto"],
    capsys,
  )  # fmt: skip
  assert f"--device-bytes auto: {format_bytes(tables // 4)}, a quarter" in stdout
  assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr[-2000:]
  assert (
    "argument --device-bytes: the dense model and its optimizer state need" in stderr
    and f"more than device_bytes {format_bytes(tables // 4)}" in stderr
  )
  code, _, stderr = run_cli(["train", "hgt", *small, "--device-bytes", "lots"], capsys)
  assert code == 2 and "argument --device-bytes" in stderr


EMBED = ("author", "field_of_study")


@FULL_FANOUT
@pytest.mark.parametrize("model", ["rgat", "hgt", "rgcn"])
def test_embedded_types_full_fanout_gradients_reach_the_right_table_rows(device, model):
  # Featureless types (TrainConfig.embed) read learnable embeddings: in full-graph training a
  # dense parameter, on blocks the rows of a host table. With full fanouts the gradient of a
  # sampled node's row equals the full-graph gradient of the parameter's row for that node.
  ds = small_mag()
  config = TrainConfig(model=model, hidden=16, heads=2, embed=EMBED, embed_dim=6)
  model = build_model(ds, config, nnx.Rngs(3))
  assert model.embedded == (1, 3) and [t.embedding.shape for t in model.tables] == [
    (len(ds.features[1]), 6),
    (len(ds.features[3]), 6),
  ]
  width = int(ds.graph.in_degree().max())
  seeds = jnp.arange(0, 30, 2, dtype=jnp.int32)
  labels = jnp.asarray(ds.labels)[seeds]
  full = GraphArrays.from_graph(ds.graph)
  xs_full = attention.device_features(ds, model)
  assert xs_full[1] is None and xs_full[3] is None
  papers = ds.node_range("paper")[1]
  dense = nnx.All(nnx.Param, nnx.Not(classifiers.is_table))

  embeddings = {t: np.asarray(x.embedding[...]) for t, x in zip(model.embedded, model.tables)}
  with hetero.make_loader(ds, "host", (width, width), embeddings=embeddings) as data:
    np.testing.assert_array_equal(data.tables[1].as_numpy(), model.tables[0].embedding[...])

    @nnx.jit
    def on_blocks(model, data):
      batch = data.sample(seeds, jax.random.key(0))
      xs = batch.inputs

      def loss(model, learned):
        inputs = list(xs)
        inputs[1], inputs[3] = learned
        logits, _ = hetero.logits_of(model, batch, inputs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).sum()

      grads = nnx.grad(loss, argnums=(nnx.DiffState(0, dense), 1))(model, [xs[1], xs[3]])
      return grads, data.embedding_ids(batch)

    def loss_full(model):
      logits = model(full, xs_full, papers)[seeds]
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).sum()

    with jax.default_matmul_precision("highest"):
      (g_dense, g_rows), ids = jax.block_until_ready(on_blocks(model, data))
      g_full = nnx.jit(nnx.grad(loss_full))(model)
  for a, b in zip(jax.tree.leaves(g_dense), jax.tree.leaves(nnx.state(g_full, dense))):
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)
  for k, t in enumerate((1, 3)):
    rows, n = np.asarray(ids[k]), len(ds.features[t])
    mine = rows < n
    want = np.asarray(g_full.tables[k].embedding[...])
    np.testing.assert_allclose(np.asarray(g_rows[k])[mine], want[rows[mine]], rtol=1e-3, atol=1e-5)
    assert not np.asarray(g_rows[k])[~mine].any()
    assert not np.delete(want, rows[mine], axis=0).any()  # nothing outside the blocks matters


def test_embedded_types_train_in_host_memory_and_the_checkpoint_evaluates(tmp_path):
  ds = mag()
  config = TrainConfig(
    model="rgat", epochs=2, hidden=16, heads=2, learning_rate=0.01, embed=EMBED, embed_dim=8
  )
  before = [np.asarray(t.embedding[...]) for t in build_model(ds, config, nnx.Rngs(0)).tables]
  result = hetero.train(ds, config, hetero.MinibatchConfig(fanouts=(3, 3), batch_size=32))
  assert result.history[-1]["loss"] < result.history[0]["loss"]
  for b, t in zip(before, result.model.tables):
    moved = np.any(np.asarray(t.embedding[...]) != b, axis=1)
    assert moved.any()  # rows the batches reached were trained, in host memory
  attention.save(str(tmp_path / "ck"), result, config, {"scale": 5e-4, "seed": 1, "classes": 4})
  from jaxdata.tasks import checkpoint

  loaded = checkpoint.load_model(str(tmp_path / "ck"))
  np.testing.assert_array_equal(
    loaded.model.tables[1].embedding[...], result.model.tables[1].embedding[...]
  )
  assert loaded.evaluate()["val_accuracy"] == pytest.approx(result.val_accuracy)


def test_embed_errors():
  with pytest.raises(ValueError, match="named twice"):
    build_model(mag(), TrainConfig(embed=("author", "author")), nnx.Rngs(0))
  with pytest.raises(ValueError, match="no node type 'venue'"):
    build_model(mag(), TrainConfig(embed=("venue",)), nnx.Rngs(0))
  with pytest.raises(ValueError, match="papers keep their features"):
    build_model(mag(), TrainConfig(embed=("paper",)), nnx.Rngs(0))
  with pytest.raises(ValueError, match="table_optimizer must be one of"):
    hetero.MinibatchConfig(table_optimizer="lamb")


def test_minibatch_training_keeps_tables_off_the_device_and_within_device_bytes():
  ds = mag()
  config = TrainConfig(model="hgt", epochs=1, hidden=16, heads=2, embed=EMBED, embed_dim=8)
  full = build_model(ds, config, nnx.Rngs(0))
  dense = nnx.All(nnx.Param, nnx.Not(classifiers.is_table))
  dense_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(full, dense)))
  table_bytes = sum(t.embedding[...].nbytes for t in full.tables)
  # tables=False: no tables, the same other parameters
  bare = build_model(ds, config, nnx.Rngs(0), tables=False)
  assert len(bare.tables) == 0
  for a, b in zip(
    jax.tree.leaves(nnx.state(bare, nnx.Param)), jax.tree.leaves(nnx.state(full, dense))
  ):
    np.testing.assert_array_equal(a, b)
  budget = 3 * dense_bytes + 256 + 20_000
  result = hetero.train(
    ds,
    config,
    hetero.MinibatchConfig(fanouts=(3, 3), batch_size=32, max_batches=2, device_bytes=budget),
    final_evaluation="none",
  )
  r = result.history[-1]
  # Adam: parameters, two moments and a step count; no table, nor its moments
  assert table_bytes > 256  # tables on the device would break the upper bound
  assert 3 * dense_bytes <= r["device_state_bytes"] <= 3 * dense_bytes + 256
  assert 0 < r["cache_fraction"] < 1 and 0 < r["cache_bytes"]
  assert r["device_state_bytes"] + r["cache_bytes"] <= budget
  # the returned model holds the trained tables as host arrays
  assert [type(t.embedding.get_value()) for t in result.model.tables] == [np.ndarray] * 2
  with pytest.raises(ValueError, match="dense model and its optimizer state need"):
    hetero.train(
      ds, config, hetero.MinibatchConfig(fanouts=(3, 3), batch_size=32, device_bytes=dense_bytes)
    )
  with pytest.raises(ValueError, match="not both"):
    hetero.MinibatchConfig(cache=0.1, device_bytes=10)
