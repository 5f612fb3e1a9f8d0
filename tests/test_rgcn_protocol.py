"""The RGCN paper's entity-classification protocol, piece by piece, against NumPy: basis
decomposition (W_r = sum_b a_rb V_b, the self loop one more combination), the layer's output, the
L2 term on the first layer only, and the paper's settings reaching the model through
`jaxdata train rgcn` (per archive, and from the flags)."""

import dataclasses
import gzip
import io
import tarfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdata import cli, offload
from jaxdata.data import EntityDataset, HeteroGraph
from jaxdata.hector import GraphArrays
from jaxdata.nn import RGCN
from jaxdata.tasks import rgcn as rgcn_task
from jaxdata.train import attention

N, R, B = 9, 3, 2


def _graph() -> HeteroGraph:
  rng = np.random.default_rng(0)
  src, dst = rng.integers(0, N, 30), rng.integers(0, N, 30)
  return HeteroGraph.from_edges(src, dst, rng.integers(0, R, 30), num_nodes=N, add_inverse=True)


def _numpy_layer(g: HeteroGraph, x, w, w0, bias):
  """out[i] = sum_r sum_{j in N_r(i)} x_j W_r / |N_r(i)| + x_i W_0 + b (x None: one-hot ids)."""
  x = np.eye(g.num_nodes) if x is None else np.asarray(x, np.float64)
  out = np.zeros((g.num_nodes, w.shape[-1]))
  src, dst, etype = (np.asarray(a) for a in (g.src, g.dst, g.etype))
  for i in range(g.num_nodes):
    for r in range(g.num_relations):
      js = src[(dst == i) & (etype == r)]
      for j in js:
        out[i] += x[j] @ w[r] / len(js)
  out += x @ w0
  return out + (0 if bias is None else bias)


def _np(p):
  return np.asarray(p[...], np.float64)


def test_basis_decomposition_gives_each_relation_its_combination_of_the_bases():
  layer = RGCN(4, 5, num_relations=R, num_bases=B, rngs=nnx.Rngs(0))
  a, v = _np(layer.coefficients), _np(layer.bases)
  assert a.shape == (R, B) and v.shape == (B, 4, 5)
  want = np.stack([sum(a[r, b] * v[b] for b in range(B)) for r in range(R)])
  np.testing.assert_allclose(layer.relation_weights(), want, rtol=1e-6, atol=1e-7)
  assert layer.root is not None  # the default self loop is a weight of its own
  np.testing.assert_array_equal(layer.self_loop_weight(), layer.root[...])


def test_self_loop_in_the_bases_is_one_more_combination_and_no_weight_of_its_own():
  layer = RGCN(
    4, 5, num_relations=R, num_bases=B, self_loop="basis", use_bias=False, rngs=nnx.Rngs(0)
  )
  a, v = _np(layer.coefficients), _np(layer.bases)
  assert a.shape == (R + 1, B)  # the last row combines W_0
  assert layer.root is None and layer.bias is None and layer.weight is None
  np.testing.assert_allclose(
    layer.self_loop_weight(), sum(a[R, b] * v[b] for b in range(B)), rtol=1e-6, atol=1e-7
  )
  np.testing.assert_allclose(
    layer.relation_weights(), np.einsum("rb,bio->rio", a[:R], v), rtol=1e-6, atol=1e-7
  )


@pytest.mark.parametrize("featureless", [True, False], ids=["one-hot", "features"])
@pytest.mark.parametrize("self_loop,bias", [("basis", False), ("separate", True), (False, False)])
def test_layer_matches_numpy(featureless, self_loop, bias):
  g = _graph()
  x = None if featureless else np.random.default_rng(1).normal(size=(N, 4)).astype(np.float32)
  layer = RGCN(
    None if featureless else 4,
    3,
    num_relations=g.num_relations,
    num_nodes=N,
    num_bases=B,
    self_loop=self_loop,
    use_bias=bias,
    rngs=nnx.Rngs(2),
  )
  if bias:  # a bias that is not zero, so that leaving it out would show
    layer.bias[...] = np.arange(3, dtype=np.float32)
  a, v = _np(layer.coefficients), _np(layer.bases)
  w = np.einsum("rb,bio->rio", a[: g.num_relations], v)
  w0 = {
    "basis": lambda: np.einsum("b,bio->io", a[-1], v),
    "separate": lambda: _np(layer.root),
    False: lambda: np.zeros_like(w[0]),
  }[self_loop]()
  got = layer(GraphArrays.from_graph(g), None if x is None else np.asarray(x))
  want = _numpy_layer(g, x, w, w0, _np(layer.bias) if bias else None)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)


def test_layer_rejects_a_self_loop_in_bases_it_does_not_have():
  with pytest.raises(ValueError, match="needs num_bases"):
    RGCN(4, 5, num_relations=R, self_loop="basis", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="self_loop must be"):
    RGCN(4, 5, num_relations=R, num_bases=B, self_loop="shared", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="needs num_bases"):
    rgcn_task.TrainConfig(self_loop="basis")


def _dataset() -> EntityDataset:
  g = _graph()
  return EntityDataset(
    name="toy",
    graph=g,
    num_classes=2,
    train_idx=np.arange(6),
    train_y=np.array([0, 1, 0, 1, 1, 0], np.int32),
    test_idx=np.arange(6, N),
    test_y=np.array([1, 0, 1], np.int32),
    class_names=("a", "b"),
    features=None,
    node_names=tuple(map(str, range(N))),
  )


@pytest.mark.parametrize("self_loop,bias", [("basis", False), ("separate", True)])
def test_l2_term_is_the_first_layers_sum_of_squares_only(self_loop, bias):
  config = rgcn_task.TrainConfig(num_bases=B, self_loop=self_loop, bias=bias, l2=5e-4)
  model = rgcn_task.build_model(_dataset(), config, nnx.Rngs(0))
  c1 = model.conv1
  if bias:
    c1.bias[...] = np.full(c1.bias.shape, 0.5, np.float32)
  first = [c1.bases, c1.coefficients] + [p for p in (c1.root, c1.bias) if p is not None]
  want = sum(np.sum(_np(p) ** 2) for p in first)
  assert float(rgcn_task.l2_penalty(model)) == pytest.approx(want, rel=1e-6)
  model.conv2.bases[...] = model.conv2.bases[...] * 10  # the second layer is not penalized
  assert float(rgcn_task.l2_penalty(model)) == pytest.approx(want, rel=1e-6)
  c1.coefficients[...] = c1.coefficients[...] * 2
  assert float(rgcn_task.l2_penalty(model)) > want


def test_training_adds_l2_times_the_penalty_to_the_loss():
  ds = _dataset()
  base = rgcn_task.TrainConfig(epochs=1, num_bases=B, self_loop="basis", bias=False)
  plain = attention.train(ds, base)
  with_l2 = attention.train(ds, dataclasses.replace(base, l2=0.25))
  model = rgcn_task.build_model(ds, base, nnx.Rngs(0))  # the initial model, again
  penalty = float(rgcn_task.l2_penalty(model))
  assert with_l2.history[0]["loss"] == pytest.approx(
    plain.history[0]["loss"] + 0.25 * penalty, rel=1e-5
  )


def _mutag_like_archive(path):
  """A tiny archive that `load_entities` names "mutag", so the paper's MUTAG setup applies."""
  nt = (
    "\n".join(
      f"<http://m/d{i % 4}> <http://m/{p}> <http://m/a{i}> ."
      for i in range(12)
      for p in ("hasAtom", "charge")
    ).encode()
    + b"\n"
  )
  train = b"bond\tlabel_mutagenic\n" + b"".join(
    f"http://m/d{i}\t{i % 2}\n".encode() for i in range(3)
  )
  with tarfile.open(path, "w:gz") as tar:
    for name, data in {
      "./mutag_stripped.nt.gz": gzip.compress(nt),
      "./trainingSet.tsv": train,
      "./testSet.tsv": b"bond\tlabel_mutagenic\nhttp://m/d3\t1\n",
    }.items():
      info = tarfile.TarInfo(name)
      info.size = len(data)
      tar.addfile(info, io.BytesIO(data))
  return str(path)


def _train_with(argv, monkeypatch, tmp_path):
  """Runs `jaxdata train rgcn argv` for 2 epochs; returns (configs, results) of its seeds."""
  configs, results, real = [], [], attention.train

  def spy(dataset, config, **kw):
    configs.append(config)
    results.append(real(dataset, config, **kw))
    return results[-1]

  monkeypatch.setattr(attention, "train", spy)
  code = cli.main(["train", "rgcn", "--epochs", "2", "--out", str(tmp_path / "ck")] + argv)
  assert code == 0
  return configs, results


def test_an_archive_named_mutag_trains_with_the_papers_setup(monkeypatch, tmp_path):
  configs, results = _train_with(
    ["--data", _mutag_like_archive(tmp_path / "mutag.tgz")], monkeypatch, tmp_path
  )
  c = configs[0]
  assert (c.num_bases, c.l2, c.self_loop, c.bias, c.val_fraction, c.hidden, c.learning_rate) == (
    30,
    5e-4,
    "basis",
    False,
    0.0,
    16,
    0.01,
  )
  conv1 = results[0].model.conv1
  assert conv1.bases.shape[0] == 30 and conv1.root is None and conv1.bias is None
  assert conv1.coefficients.shape == (conv1.num_relations + 1, 30)


def test_flags_override_the_papers_setup(monkeypatch, tmp_path):
  archive = _mutag_like_archive(tmp_path / "mutag.tgz")
  configs, results = _train_with(
    ["--data", archive, "--bases", "0", "--bias", "--l2", "0"], monkeypatch, tmp_path
  )
  c = configs[0]  # no bases: the self loop falls back to a weight of its own, as in the paper
  assert (c.num_bases, c.self_loop, c.bias, c.l2) == (None, "separate", True, 0.0)
  conv1 = results[0].model.conv1
  assert conv1.weight is not None and conv1.root is not None and conv1.bias is not None


def test_bases_flag_wires_into_the_layer_on_the_synthetic_graph(monkeypatch, tmp_path):
  configs, results = _train_with(
    [
      "--nodes",
      "300",
      "--edges",
      "2000",
      "--relations",
      "4",
      "--bases",
      "30",
      "--self-loop",
      "basis",
      "--no-bias",
    ],
    monkeypatch,
    tmp_path,
  )
  assert configs[0].num_bases == 30 and configs[0].self_loop == "basis"
  for conv in (results[0].model.conv1, results[0].model.conv2):
    assert conv.bases.shape[0] == 30 and conv.root is None and conv.bias is None


def test_an_error_caught_earlier_does_not_fail_training(device, monkeypatch, tmp_path):
  # On a GPU JAX keeps the status of each device's last effectful computation, and
  # jax.effects_barrier() raises it again, even after the caller caught it. The trainer once
  # called it before closing its HostTable and failed with this spill's error (on an H200).
  with offload.TensorStore(ram_bytes=8192) as store:
    spill = jax.jit(lambda xs: offload.spill(xs, store, site=offload.new_site(), tier="ram"))
    with pytest.raises(Exception, match="RAM tier is full"):
      jax.block_until_ready(spill([jnp.zeros(10001, jnp.float32)]))
  _, results = _train_with(
    ["--nodes", "300", "--edges", "2000", "--relations", "4"], monkeypatch, tmp_path
  )
  assert len(results[0].history) == 2
