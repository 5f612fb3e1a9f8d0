"""Deep relational GNNs (RGAT / HGT / RGCN classifiers with `layers > 2`) under offload plans: the
stacked layers run through `jaxdata.offload.run_layers` with keep / offload / recompute per layer,
with the plain model's loss and gradients; the planner fits their residuals to a budget."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxdata import offload
from jaxdata.data import synthetic_mag
from jaxdata.hector import GraphArrays
from jaxdata.nn import layer_stack
from jaxdata.train import attention

# Its tests take 5 s to minutes each: the fast tier (-m "not slow") leaves this file out.
pytestmark = pytest.mark.slow

LAYERS, HIDDEN, HEADS = 4, 256, 4
_TRACER = getattr(jax.core, "Tracer", None) or jax._src.core.Tracer  # pylint: disable=protected-access


def _setup(model: str, layers: int = LAYERS):
  ds = synthetic_mag(scale=1e-4, seed=3, num_classes=4)
  config = attention.TrainConfig(model=model, layers=layers, hidden=HIDDEN, heads=HEADS)
  net = attention.build_model(ds, config, nnx.Rngs(0))
  graph = GraphArrays.from_graph(ds.graph)
  xs = attention.device_features(ds, net)
  return ds, net, graph, xs


def _loss_and_grads(net, ds, graph, xs, plan):
  papers = ds.node_range("paper")[1]
  idx = jnp.asarray(ds.train_papers)
  y = jnp.asarray(ds.labels)[idx]

  @nnx.jit
  def run(net):
    def loss(net):
      logits = net(graph, xs, papers, plan)[idx]
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return nnx.value_and_grad(loss)(net)

  loss, grads = run(net)
  return float(loss), jax.tree.leaves(nnx.to_pure_dict(grads))


#: The plain model's (loss, gradients) by (model, platform): `_setup` builds the same model
#: each time, so the tests comparing a plan with it share one compile and run.
_PLAIN: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _forget_plain():
  yield
  _PLAIN.clear()


def _plain_loss_and_grads(model, device, net, ds, graph, xs):
  key = (model, device.platform)
  if key not in _PLAIN:
    _PLAIN[key] = _loss_and_grads(net, ds, graph, xs, None)
  return _PLAIN[key]


def _own_residuals(fn, state, x_like, inner) -> tuple[int, bool]:
  """(bytes the VJP of `fn(state, x)` (under `jax.checkpoint(policy=inner)`) holds besides its
  inputs and the constants it closes over, whether it holds the input x itself): counted here,
  apart from the planner."""
  f = jax.checkpoint(fn, policy=inner) if inner is not None else fn
  total, holds_x = 0, False

  def trace(state, x):
    nonlocal total, holds_x
    _, vjp = jax.vjp(f, state, x)
    mine = {id(a) for a in jax.tree.leaves((state, x))}
    leaves = [l for l in jax.tree.leaves(vjp) if isinstance(l, _TRACER)]
    held = {id(l): l for l in leaves if id(l) not in mine}
    total = sum(l.size * l.dtype.itemsize for l in held.values())
    holds_x = any(l is x for l in leaves)
    return 0

  jax.eval_shape(trace, state, jax.ShapeDtypeStruct(x_like.shape, x_like.dtype))
  return total, holds_x


def _own_residual_bytes(fn, state, x_like, inner) -> int:
  return _own_residuals(fn, state, x_like, inner)[0]


@pytest.mark.parametrize("model", ["hgt", "rgat", "rgcn"])
def test_deep_model_under_an_offload_plan_has_the_plain_loss_and_gradients(model, device):
  ds, net, graph, xs = _setup(model)
  assert net.layers == LAYERS and len(net.convs) == LAYERS
  want_loss, want = _plain_loss_and_grads(model, device, net, ds, graph, xs)
  with offload.TensorStore(ram_bytes=256 << 20) as store:
    inners = attention.candidates(net)
    named = lambda n: layer_stack.policy_named(n, store, inners)  # noqa: E731
    # Every kind of choice, in segments of one and two layers.
    names = ["offload[edges]+in", "recompute", "keep[nodes]", "offload[in]", "offload[dots]"]
    plan = tuple(named(n) for n in names[: net.stack_layers - 1]) + (named("keep[all]"),)
    got_loss, got = _loss_and_grads(net, ds, graph, xs, plan)
    assert store.stats()["spills"] > 0
  assert got_loss == pytest.approx(want_loss, rel=1e-5)
  assert len(got) == len(want)
  for g, w in zip(got, want):
    np.testing.assert_allclose(
      np.asarray(g),
      np.asarray(w),
      rtol=2e-4,
      # 1e-4 of the largest: on a GPU hector's float atomics sum
      # in any order (the H200 gave 9e-8 where the largest is ~5e-3)
      atol=1e-4 * float(np.abs(w).max() + 1e-30),
    )


def test_the_plan_under_a_tight_budget_offloads_or_recomputes(device):
  ds, net, graph, xs = _setup("hgt")
  rows = [x.shape[0] for x in net.inputs(xs)]
  layers, layer_fn, x = net.stack(graph, rows)
  assert len(layers) == net.stack_layers == LAYERS - 1 and x.shape == (sum(rows), HIDDEN)
  apply, states = layer_stack.stacked(layers, layer_fn)
  first = jax.tree.map(lambda a: a[0], states)
  inners = attention.candidates(net)
  keep_all = _own_residual_bytes(apply, first, x, None)
  nodes = _own_residual_bytes(apply, first, x, inners["nodes"])
  n = sum(rows)
  # The layer's own tags: keys/queries/values and the messages, float32.
  assert nodes == n * 3 * HIDDEN * 4 + n * HIDDEN * 4
  assert keep_all > nodes
  carried = n * HIDDEN * 4
  everything = len(layers) * (keep_all + carried)
  budget = everything // 2
  with offload.TensorStore(ram_bytes=256 << 20) as store:
    best, bandwidth = layer_stack.plan(layers, layer_fn, x, budget, store, inners, repeats=1)
    assert bandwidth > 0
    modes = [p.mode for p in best.policies]
    assert len(modes) == len(layers)
    assert best.device_bytes <= budget < everything
    assert any(m in ("offload", "recompute") for m in modes) or all(
      str(p) != "keep[all]" for p in best.policies
    ), best
    # What the plan keeps on the device, counted from the residual sizes measured here.
    kept = 0
    for p in best.policies:
      name = str(p)
      if name.startswith("keep["):  # the layer's input only where its VJP holds it
        own, holds_x = _own_residuals(apply, first, x, inners[name[5:-1]])
        kept += own + (carried if holds_x else 0)
      elif name == "recompute" or (p.mode == "offload" and not p.inputs):
        kept += carried
    assert kept <= best.device_bytes <= budget, (kept, best)
    if best.offload_bytes:
      assert any(m == "offload" for m in modes)
      assert store.device_bytes == best.spill_cap
    # And it trains: one step under the plan has the plain model's loss.
    want, _ = _plain_loss_and_grads("hgt", device, net, ds, graph, xs)
    got, _ = _loss_and_grads(net, ds, graph, xs, tuple(best.policies))
    assert got == pytest.approx(want, rel=1e-5)


def test_a_budget_below_the_smallest_plan_is_a_clear_error():
  ds, net, graph, xs = _setup("rgat")
  with offload.TensorStore(ram_bytes=64 << 20) as store:
    planner = attention.budget_planner(1000, store, repeats=1)
    with pytest.raises(
      ValueError,
      match=r"no plan fits a budget of 1,000 bytes .* 4 blocks: the "
      r"smallest plan needs at least [\d,]+ bytes",
    ):
      planner(net, graph, xs)
    with pytest.raises(ValueError, match="plan has 2 policies for the model's 4 stacked"):
      attention.train(
        ds,
        attention.TrainConfig(model="rgat", layers=4, hidden=16, heads=2, epochs=1),
        plan=[None, None],
      )


def test_depth_is_configurable_and_two_layers_keep_the_old_parameter_names():
  ds, net, _, _ = _setup("hgt", layers=2)
  names = {k for k in nnx.to_pure_dict(nnx.state(net))}
  assert {"conv1", "conv2"} <= names and "conv3" not in names
  _, net3, _, _ = _setup("rgat", layers=3)
  assert {"conv1", "conv2", "conv3"} <= set(nnx.to_pure_dict(nnx.state(net3)))
  with pytest.raises(ValueError, match="layers must be >= 1"):
    attention.TrainConfig(layers=0)


def test_cli_trains_a_deep_hgt_under_a_budget(tmp_path, capsys):
  from jaxdata import cli

  out = tmp_path / "hgt-checkpoint"
  assert (
    cli.main(
      [
        "train",
        "hgt",
        "--scale",
        "1e-4",
        "--classes",
        "4",
        "--epochs",
        "1",
        "--layers",
        "4",
        "--hidden",
        "256",
        "--budget",
        "2MiB",
        "--out",
        str(out),
      ]
    )
    == 0
  )
  text = " ".join(capsys.readouterr().out.split())
  assert "plan under 2,097,152 bytes" in text and "epoch 1" in text, text
  assert "4 layers" in text and (out / "history.json").exists()
  from jaxdata import load_model

  loaded = load_model(str(out))
  assert loaded.model.layers == 4


@pytest.mark.parametrize(
  "argv, message",
  [
    (["--budget", "1KiB"], "argument --budget: no plan fits a budget of 1,024 bytes"),
    (["--offload"], "argument --offload: needs --budget"),
    (
      ["--minibatch", "--fanouts", "5,5"],
      "argument --fanouts: give one fanout per layer (--layers 4), got 2",
    ),
    (["--plan", "keep[bogus]", "--offload"], "argument --plan: unknown policy"),
  ],
)
def test_cli_rejects_bad_offload_options(tmp_path, capsys, argv, message):
  from jaxdata import cli

  code = cli.main(
    [
      "train",
      "hgt",
      "--scale",
      "1e-4",
      "--classes",
      "4",
      "--epochs",
      "1",
      "--layers",
      "4",
      "--hidden",
      "32",
      "--out",
      str(tmp_path / "c"),
      *argv,
    ]
  )
  assert code != 0
  captured = capsys.readouterr()
  text = " ".join((captured.out + captured.err).split())
  assert message in text, text
