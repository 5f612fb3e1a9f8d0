"""The GPT model, its per-layer remat plans, the synthetic token chain and `train`."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxdata.data.tokens import markov_tokens
from jaxdata.nn import GPT, GPTConfig
from jaxdata.nn.gpt import BLOCK_NAMES, block_fn, save_names
from jaxdata.offload import stack
from jaxdata.offload.stack import run_layers, segments
from jaxdata.train.gpt import GPTTrainConfig, train

# One shape for every model here (training included): on a small CPU, building a model of a new
# shape and compiling its ops dominates these tests' time.
CFG = GPTConfig(vocab=32, layers=3, hidden=24, heads=3, seq=16, dtype=jnp.float32)
TRAIN = dict(layers=CFG.layers, hidden=CFG.hidden, heads=CFG.heads, seq=CFG.seq, vocab=CFG.vocab)


def _model(cfg=CFG, seed=0):
  return GPT(cfg, rngs=nnx.Rngs(seed))


_logits = nnx.jit(lambda model, tokens: model(tokens))


@pytest.fixture(autouse=True, scope="module")
def _full_float32_matmuls():
  """On a GPU, float32 matmuls may default to TF32; comparisons here want float32 exactly."""
  with jax.default_matmul_precision("highest"):
    yield


def _tokens(shape, vocab=CFG.vocab, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, shape), jnp.int32)


@pytest.fixture
def checkpoint_wrap(monkeypatch):
  """Stands in for jaxdata.offload.remat: jax.checkpoint with the policy; records each call."""
  calls = []

  def remat(fn, policy):
    calls.append(policy)
    return jax.checkpoint(fn, policy=policy)

  monkeypatch.setattr(stack, "remat", remat)
  return calls


# ----------------------------------------------------------------------------- the model


def _reference_logits(params, cfg, tokens):
  """The same math in float64 NumPy, one layer at a time."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)

  def ln(x, q, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * q["scale"] + q["bias"]

  def dense(x, q):
    return x @ q["kernel"] + q["bias"]

  def gelu(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))

  tokens = np.asarray(tokens)
  b, t = tokens.shape
  hd = cfg.hidden // cfg.heads
  x = p["wte"]["embedding"][tokens] + p["wpe"]["embedding"][np.arange(t)]
  for layer in range(cfg.layers):
    blk = jax.tree.map(lambda a, layer=layer: a[layer], p["blocks"])
    q, k, v = np.split(dense(ln(x, blk["ln1"]), blk["qkv"]), 3, axis=-1)
    q, k, v = (a.reshape(b, t, cfg.heads, hd) for a in (q, k, v))
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
    s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
    s = np.exp(s - s.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
    o = np.einsum("bhqk,bkhd->bqhd", s, v).reshape(b, t, cfg.hidden)
    x = x + dense(o, blk["proj"])
    x = x + dense(gelu(dense(ln(x, blk["ln2"]), blk["up"])), blk["down"])
  return ln(x, p["ln_f"]) @ p["wte"]["embedding"].T


def test_logits_match_numpy_reference():
  model = _model()
  tokens = _tokens((2, CFG.seq))
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  want = _reference_logits(params, CFG, tokens)
  got = _logits(model, tokens)
  assert got.dtype == jnp.float32 and got.shape == (2, CFG.seq, CFG.vocab)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)
  # Shorter inputs use the first positions.
  np.testing.assert_allclose(
    np.asarray(_logits(model, tokens[:, :5])), want[:, :5], rtol=1e-4, atol=1e-5
  )


def test_causal():
  model = _model()
  tokens = _tokens((2, CFG.seq))
  changed = tokens.at[:, 7].set((tokens[:, 7] + 1) % CFG.vocab)
  a, b = np.asarray(_logits(model, tokens)), np.asarray(_logits(model, changed))
  np.testing.assert_allclose(a[:, :7], b[:, :7], rtol=0, atol=1e-6)
  assert np.abs(a[:, 7:] - b[:, 7:]).max(axis=-1).min() > 1e-3


def test_loss_is_next_token_cross_entropy():
  model = _model()
  tokens = _tokens((3, CFG.seq + 1))
  logits = np.asarray(_logits(model, tokens[:, :-1]), np.float64)
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  want = -np.take_along_axis(logp, np.asarray(tokens[:, 1:])[..., None], -1).mean()
  loss = nnx.jit(lambda m, t: m.loss(t))(model, tokens)
  assert loss.dtype == jnp.float32 and loss.shape == ()
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)


@pytest.mark.parametrize("chunk,plan", [(5, None), (5, "remat"), (40, None)])
def test_chunked_loss_equals_the_whole_loss(chunk, plan, checkpoint_wrap):
  """`loss_chunk` (5 does not divide 16 positions; 40 is one chunk) changes memory, not the
  loss or the gradients, with or without a plan."""
  tokens = _tokens((3, CFG.seq + 1))
  whole = _model()
  chunked = _model(dataclasses.replace(CFG, loss_chunk=chunk))
  if plan == "remat":
    plan = [jax.checkpoint_policies.nothing_saveable, None, ATTN]
  want = nnx.jit(nnx.value_and_grad(lambda m, t: m.loss(t, plan)))(whole, tokens)
  got = nnx.jit(nnx.value_and_grad(lambda m, t: m.loss(t, plan)))(chunked, tokens)
  np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="loss_chunk"):
    GPTConfig(loss_chunk=-1)


def test_chunked_loss_keeps_one_chunk_of_logits():
  """The compiled step of a chunked loss needs less temporary memory than the whole one: at
  least one float32 logits array less (a vocabulary large enough for the logits to dominate)."""
  cfg = GPTConfig(vocab=4096, layers=1, hidden=16, heads=2, seq=64, dtype=jnp.float32)
  tokens = _tokens((4, cfg.seq + 1), vocab=cfg.vocab)
  temp = {}

  def loss(graphdef, state, tokens):
    return nnx.merge(graphdef, state).loss(tokens)

  for chunk in (0, 8):
    model = _model(dataclasses.replace(cfg, loss_chunk=chunk))
    graphdef, state = nnx.split(model)
    step = jax.jit(jax.grad(functools.partial(loss, graphdef)))
    temp[chunk] = step.lower(state, tokens).compile().memory_analysis().temp_size_in_bytes
  logits = 4 * cfg.seq * cfg.vocab * 4  # the whole step's float32 logits
  assert temp[8] < temp[0] - logits, temp


def test_rejects_long_input_and_bad_plan():
  model = _model()
  with pytest.raises(ValueError, match="seq"):
    model(_tokens((1, CFG.seq + 1)))
  with pytest.raises(ValueError, match="one policy per layer"):
    model(_tokens((1, 4)), plan=[None, None])
  with pytest.raises(ValueError, match="multiple of heads"):
    GPTConfig(hidden=10, heads=3)


def test_bfloat16_compute_float32_params():
  model = _model(dataclasses.replace(CFG, dtype=jnp.bfloat16))
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
  tokens = _tokens((2, 9))
  assert _logits(model, tokens[:, :-1]).dtype == jnp.float32
  f = block_fn(model, (2, 8))
  assert f.x.dtype == jnp.bfloat16 and f.x.shape == (2, 8, CFG.hidden)
  y = jax.eval_shape(f.apply, f.layer(0), f.x)
  assert y.dtype == jnp.bfloat16 and y.shape == f.x.shape


# ----------------------------------------------------------------------------- plans


def test_segments():
  assert segments(None, 4) == [(0, 4, None)]
  assert segments(["a", "a", None, "a"], 4) == [(0, 2, "a"), (2, 3, None), (3, 4, "a")]
  assert segments(["x"] * 3, 3) == [(0, 3, "x")]
  with pytest.raises(ValueError):
    segments(["a"], 2)


NOTHING = jax.checkpoint_policies.nothing_saveable
ATTN = save_names("qkv", "attn_ctx")
BUT_MLP = jax.checkpoint_policies.save_any_names_but_these("mlp_up", "mlp_act")


@pytest.fixture(scope="module")
def loss_fn():
  """(loss of params under a plan, params, jitted value_and_grad of it) for one model and batch."""
  graphdef, params = nnx.split(_model())
  tokens = _tokens((2, CFG.seq + 1))

  def loss(p, plan=None):
    return nnx.merge(graphdef, p).loss(tokens, plan)

  def value_and_grads(plan):
    return jax.jit(jax.value_and_grad(lambda p: loss(p, plan)))(params)

  return loss, params, value_and_grads(None)


@pytest.mark.parametrize(
  "plan",
  [
    [NOTHING] * 3,  # one segment
    [NOTHING, NOTHING, ATTN],  # two segments of different policies
    [ATTN, None, BUT_MLP],  # a plain layer between two remat segments
  ],
  ids=["one", "two", "three"],
)
def test_plan_gradients_equal_plain(plan, loss_fn, checkpoint_wrap):
  loss, params, (plain_loss, grads) = loss_fn
  plan_loss, plan_grads = jax.jit(jax.value_and_grad(lambda p: loss(p, plan)))(params)
  runs = [p for _, _, p in segments(plan, CFG.layers) if p is not None]
  assert checkpoint_wrap == runs  # one remat per segment that has a policy
  np.testing.assert_allclose(float(plan_loss), float(plain_loss), rtol=1e-6)
  flat, flat_plan = jax.tree.leaves(grads), jax.tree.leaves(plan_grads)
  assert len(flat) == len(flat_plan) and any(np.abs(np.asarray(g)).max() > 0 for g in flat)
  for g, h in zip(flat, flat_plan):
    np.testing.assert_allclose(np.asarray(h), np.asarray(g), rtol=1e-5, atol=1e-7)


def test_split_layers_changes_nothing_but_the_stacks(loss_fn):
  """A model split into one parameter stack per segment computes the same loss and gradients."""
  from jaxdata import offload

  _, _, (plain_loss, plain_grads) = loss_fn
  plan = [offload.recompute(), offload.recompute(), offload.keep(ATTN)]
  model = _model()
  model.split_layers(plan)
  tokens = _tokens((2, CFG.seq + 1))
  loss, grads = nnx.jit(nnx.value_and_grad(lambda m: m.loss(tokens, plan)))(model)
  np.testing.assert_allclose(float(loss), float(plain_loss), rtol=1e-6)
  blocks = [nnx.to_pure_dict(grads["blocks"][i]) for i in range(2)]  # two segments
  joined = jax.tree.map(lambda *a: np.concatenate(a), *blocks)
  want = nnx.to_pure_dict(plain_grads["blocks"])
  for a, b in zip(jax.tree.leaves(joined), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, np.asarray(b), rtol=1e-5, atol=1e-7)
  with pytest.raises(ValueError, match="segments"):
    nnx.jit(lambda m: m.loss(tokens, [offload.recompute()] * 3))(model)
  model.split_layers(None)
  np.testing.assert_allclose(
    float(nnx.jit(lambda m: m.loss(tokens))(model)), float(plain_loss), rtol=1e-6
  )


def test_plain_never_asks_for_remat(loss_fn, checkpoint_wrap):
  loss, params, _ = loss_fn
  jax.eval_shape(jax.grad(loss), params)
  jax.eval_shape(jax.grad(lambda p: loss(p, [None] * CFG.layers)), params)
  assert checkpoint_wrap == []


def test_plan_keeps_fewer_residuals(loss_fn, checkpoint_wrap):
  """What the backward pass holds on to (the VJP's residuals) shrinks under a remat plan."""
  del checkpoint_wrap
  loss, params, _ = loss_fn

  def residual_bytes(plan):
    vjp = jax.eval_shape(lambda p: jax.vjp(lambda q: loss(q, plan), p)[1], params)
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(vjp))

  assert residual_bytes([NOTHING] * 3) < residual_bytes([ATTN] * 3) < residual_bytes(None)


def test_block_fn_runs_one_layer_and_tags_its_names():
  model = _model()
  f = block_fn(model, (2, 8))
  assert f.x.shape == (2, 8, CFG.hidden) and f.x.dtype == jnp.float32
  assert jax.tree.leaves(f.states)[0].shape[0] == CFG.layers
  x = jax.random.normal(jax.random.key(0), f.x.shape, f.x.dtype)
  # The layers one at a time equal the model's stack.
  h, apply = x, jax.jit(f.apply)
  for i in range(CFG.layers):
    h = apply(f.layer(i), h)
  np.testing.assert_allclose(
    np.asarray(h),
    np.asarray(jax.jit(run_layers, static_argnums=0)(f.apply, f.states, x)),
    rtol=1e-6,
    atol=1e-6,
  )
  jaxpr = jax.make_jaxpr(f.apply)(f.layer(0), f.x)
  names = [e.params["name"] for e in jaxpr.jaxpr.eqns if e.primitive.name == "name"]
  assert set(names) == set(BLOCK_NAMES)
  assert names.count("qkv") == 3  # q, k and v


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_layer_norm_and_gelu_match_their_formulas(dtype):
  """The hand-written backward passes equal differentiating the formulas (in float32)."""
  from jaxdata.nn.gpt import gelu, layer_norm

  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(3, 5, 16)) * 3 + 1, dtype)
  scale = jnp.asarray(rng.normal(size=16), jnp.float32)
  bias = jnp.asarray(rng.normal(size=16), jnp.float32)
  ct = jnp.asarray(rng.normal(size=(3, 5, 16)), jnp.float32)

  def ln_formula(x, scale, bias):
    x = x.astype(jnp.float32)
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / jnp.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * scale + bias

  def gelu_formula(x):
    x = x.astype(jnp.float32)
    return 0.5 * x * (1 + jnp.tanh(float(np.sqrt(2 / np.pi)) * (x + 0.044715 * x**3)))

  tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
  got, want = layer_norm(x, scale, bias), ln_formula(x, scale, bias)
  assert got.dtype == dtype
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), **tol)
  vjp = jax.vjp(layer_norm, x, scale, bias)[1](ct.astype(dtype))
  vjp_want = jax.vjp(ln_formula, x.astype(jnp.float32), scale, bias)[1](ct)
  for a, b in zip(vjp, vjp_want):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b), **tol)
  np.testing.assert_allclose(np.asarray(gelu(x), np.float32), np.asarray(gelu_formula(x)), **tol)
  (g,) = jax.vjp(gelu, x)[1](ct.astype(dtype))
  (g_want,) = jax.vjp(gelu_formula, x.astype(jnp.float32))[1](ct)
  np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(g_want), **tol)


def test_block_residuals_are_lean():
  """A block's backward pass keeps no float32 copies of activations (bfloat16 compute)."""
  cfg = GPTConfig(
    vocab=32, layers=1, hidden=64, heads=1, seq=8, dtype=jnp.bfloat16, attention="xla"
  )
  f = block_fn(_model(cfg), (2, 8))

  def residuals(state, x):
    _, vjp = jax.vjp(f.apply, state, x)
    return [l for l in jax.tree.leaves(vjp) if l.ndim == 3 and l.shape[-1] >= cfg.hidden]

  big = jax.eval_shape(residuals, f.layer(0), f.x)
  assert big and all(l.dtype == jnp.bfloat16 for l in big), [(l.shape, l.dtype) for l in big]


def test_attention_choice_and_save_names():
  with pytest.raises(ValueError, match="attention"):
    GPTConfig(attention="flash")
  assert GPTConfig(attention="xla").attention_implementation() == "xla"
  assert CFG.attention_implementation() == "xla"  # float32 compute never takes the fused kernel
  with pytest.raises(ValueError, match="attn_scores"):
    save_names("qkv", "attn_scores")


def _attention_forwards(cfg, policy):
  """How many fused attention forwards one compiled gradient of a block runs under `policy`."""
  f = block_fn(_model(cfg), (2, cfg.seq))
  body = jax.checkpoint(f.apply, policy=policy)
  grad = jax.jit(jax.grad(lambda s, x: body(s, x).astype(jnp.float32).sum(), argnums=(0, 1)))
  hlo = grad.lower(f.layer(0), jnp.ones(f.x.shape, f.x.dtype)).compile().as_text()
  return sum(
    1
    for line in hlo.splitlines()
    if 'custom_call_target="__cudnn$fmha' in line and "Backward" not in line
  )


@pytest.mark.gpu
def test_fused_attention_on_gpu():
  """bfloat16 on a GPU takes cuDNN's kernel; it agrees with XLA's attention, and naming attn_ctx
  keeps its statistics so the backward pass does not run the attention forward again."""
  try:
    gpu = jax.devices("gpu")[0]
  except RuntimeError:
    pytest.skip("no GPU visible to JAX")
  cfg = GPTConfig(vocab=64, layers=2, hidden=128, heads=2, seq=64, dtype=jnp.bfloat16)
  with jax.default_device(gpu):
    assert cfg.attention_implementation() == "cudnn"
    tokens = _tokens((2, cfg.seq))
    fused = _logits(_model(cfg), tokens)
    plain = _logits(_model(dataclasses.replace(cfg, attention="xla")), tokens)
    np.testing.assert_allclose(np.asarray(fused), np.asarray(plain), rtol=0.05, atol=0.05)
    assert _attention_forwards(cfg, save_names("qkv", "attn_ctx")) == 1
    # The kernel's per-row softmax statistics (float32 [batch, heads, seq]) are kept only when
    # attn_ctx is named.
    f = block_fn(_model(cfg), (2, cfg.seq))

    def stats(policy):
      body = jax.checkpoint(f.apply, policy=policy)
      vjp = jax.eval_shape(lambda s, x: jax.vjp(body, s, x)[1], f.layer(0), f.x)
      return [
        l.shape
        for l in jax.tree.leaves(vjp)
        if l.dtype == jnp.float32 and l.size == 2 * cfg.heads * cfg.seq
      ]

    assert stats(save_names("qkv", "attn_ctx")) and not stats(save_names("qkv"))


# ----------------------------------------------------------------------------- data and training


def test_markov_tokens_deterministic():
  a, b, c = markov_tokens(64, seed=3), markov_tokens(64, seed=3), markov_tokens(64, seed=4)
  np.testing.assert_array_equal(a.successors, b.successors)
  np.testing.assert_array_equal(a.probs, b.probs)
  assert not np.array_equal(a.successors, c.successors)
  x, y = next(a.batches(4, 32, seed=1)), next(b.batches(4, 32, seed=1))
  assert x.shape == (4, 33) and x.dtype == np.int32
  np.testing.assert_array_equal(x, y)
  assert not np.array_equal(x, next(a.batches(4, 32, seed=2)))
  stream = a.batches(4, 32, seed=1)
  assert not np.array_equal(next(stream), next(stream))  # a stream moves on
  # Successors are distinct; samples follow the chain; its entropy is far below log(vocab).
  assert (np.diff(np.sort(a.successors, axis=1), axis=1) > 0).all()
  walks = a.sample(64, 256, np.random.default_rng(0))
  assert np.isfinite(a.nll(walks))
  assert abs(a.nll(walks) - a.entropy()) < 0.1
  assert a.entropy() < 0.5 * np.log(64)


def test_markov_tokens_order_two():
  chain = markov_tokens(16, order=2, branching=3, seed=0)
  assert chain.successors.shape == (256, 3)
  walks = chain.sample(8, 64, np.random.default_rng(0))
  assert np.isfinite(chain.nll(walks))
  with pytest.raises(ValueError):
    markov_tokens(8, branching=9)


def test_training_under_a_plan_lowers_the_loss(checkpoint_wrap):
  """A short run (with a planner, so the remat path trains too) gets well below log(vocab)."""
  config = GPTTrainConfig(**TRAIN, batch=8, steps=60, learning_rate=1e-2, warmup=5, eval_batches=2)
  plan, seen, logged = [NOTHING, NOTHING, ATTN], [], []

  def planner(model, batch_shape):
    seen.append((type(model), batch_shape))
    return plan

  result = train(config, plan=planner, on_log=logged.append)
  assert seen == [(GPT, (8, CFG.seq))] and result.plan == plan
  assert checkpoint_wrap == [NOTHING, ATTN]  # traced once: the step is compiled once
  m = result.metrics
  assert m["start_loss"] > np.log(CFG.vocab) - 0.3
  assert m["final_loss"] < m["start_loss"] - 1.0, m
  assert m["final_loss"] > m["entropy"] - 0.1
  assert [r["step"] for r in logged] == list(range(6, 61, 6))
  assert [r["step"] for r in result.history] == list(range(6, 61, 6))
  with pytest.raises(ValueError, match="one policy per layer"):
    train(config, plan=[NOTHING])


def test_cli_trains_with_a_named_policy_on_the_ssd_tier(tmp_path, capsys):
  """`jaxdata train gpt --offload --plan offload[attn]+in` with a RAM tier too small for one
  spill trains through the SSD tier: the same losses as the plain model, SSD bytes written, and
  nothing left in the spill directory."""
  import argparse

  from jaxdata.train import gpt as train_gpt

  parser = argparse.ArgumentParser()
  train_gpt.add_arguments(parser)
  # Activations of 128 KiB: above the 64 KiB under which a policy keeps residuals on the device.
  common = [
    "--layers",
    "2",
    "--hidden",
    "64",
    "--heads",
    "4",
    "--seq",
    "64",
    "--vocab",
    "32",
    "--batch-size",
    "8",
    "--steps",
    "3",
    "--log-every",
    "1",
  ]
  assert train_gpt.main(parser.parse_args(common)) == 0
  is_step = lambda l: l.split()[:1] == ["step"] and l.split()[2:3] == ["loss"]  # noqa: E731
  plain = [l for l in capsys.readouterr().out.splitlines() if is_step(l)]
  args = parser.parse_args(
    common
    + ["--offload", "--plan", "offload[attn]+in", "--ram", "4KiB", "--ssd-dir", str(tmp_path)]
  )
  assert train_gpt.main(args) == 0
  out = capsys.readouterr().out
  offloaded = [l for l in out.splitlines() if is_step(l)]
  assert len(offloaded) == len(plain) == 3
  losses = lambda lines: [float(l.split()[3]) for l in lines]  # noqa: E731  (step N loss L ...)
  np.testing.assert_allclose(losses(offloaded), losses(plain), rtol=1e-5)
  assert "SSD tier" in out and "GiB written" in out, out
  assert list(tmp_path.iterdir()) == []
  from jaxdata.command import UsageError

  with pytest.raises(UsageError, match="unknown policy"):
    train_gpt.main(parser.parse_args(common + ["--offload", "--plan", "offload[bogus]"]))
  with pytest.raises(UsageError, match="needs --budget"):
    train_gpt.main(parser.parse_args(common + ["--offload"]))
  # --budget alone plans, as its help says.
  # 512 KiB holds the 2 layers' 128 KiB inputs but not every policy's residuals: the planner
  # measures only the policies that can fit.
  assert train_gpt.main(parser.parse_args(common + ["--budget", "512KiB"])) == 0
  assert "plan under 524,288 bytes per device" in capsys.readouterr().out


# ----------------------------------------------------------------------------- data parallel


def _two_devices(platform: str) -> list:
  try:
    devices = jax.devices(platform)
  except RuntimeError:
    devices = []
  if len(devices) < 2:
    pytest.skip(f"needs two {platform} devices, JAX sees {len(devices)}")
  return devices[:2]


@pytest.mark.parametrize("platform", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("check_vma", [True, False], ids=["checked", "unchecked"])
def test_two_devices_offloading_to_one_store_equal_one_device(platform, check_vma):
  """shard_map over two devices, each offloading its layers' residuals (and inputs) to the
  process's one TensorStore: every device spills and loads its own (same sites, same layers,
  different rows), and the loss and gradients of the global batch are one device's plain ones.
  With shard_map's varying-axes check, JAX sums a replicated parameter's gradient over the
  devices (also through layer_norm's custom VJP); without it, each device's stays its own."""
  from jax.sharding import Mesh
  from jax.sharding import PartitionSpec as P

  from jaxdata.offload import TensorStore, offload

  devices = _two_devices(platform)
  graphdef, params = nnx.split(_model())
  tokens = _tokens((4, CFG.seq + 1), seed=3)
  with jax.default_device(devices[0]):
    want_loss, want = jax.jit(jax.value_and_grad(lambda p: nnx.merge(graphdef, p).loss(tokens)))(
      params
    )
  with TensorStore(ram_bytes="16MiB") as store:
    policy = offload(store, inner=save_names("qkv", "attn_ctx"), min_bytes=0, inputs=(1,))
    plan = [policy] * CFG.layers

    def local(p, t):
      loss, grads = jax.value_and_grad(lambda p: nnx.merge(graphdef, p).loss(t, plan))(p)
      if check_vma:  # the gradients arrive summed over the two devices
        return jax.lax.pmean(loss, "data"), jax.tree.map(lambda g: g / 2, grads)
      return jax.lax.pmean((loss, grads), "data")

    step = jax.jit(
      jax.shard_map(
        local,
        mesh=Mesh(np.array(devices), ("data",)),
        in_specs=(P(), P("data")),
        out_specs=P(),
        check_vma=check_vma,
      )
    )
    before = store.stats()
    loss, grads = jax.block_until_ready(step(params, tokens))
    s = store.stats()
  assert s["spills"] - before["spills"] == 2 * CFG.layers  # one per layer on each device
  assert s["loads"] - before["loads"] == 2 * CFG.layers and s["ram_in_use"] == 0
  np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want)):
    np.testing.assert_allclose(
      np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path)
    )


def test_training_on_two_devices_with_offload_equals_one_device():
  """`train` with devices=2 and an offload plan (each device spills its share) takes the
  steps of a plain one-device run on the same global batch: same losses, same parameters."""
  from jaxdata.offload import TensorStore, offload

  _two_devices(jax.default_backend())  # train's mesh takes the default backend's devices
  config = GPTTrainConfig(**TRAIN, batch=4, steps=3, log_every=1, eval_batches=1, warmup=1)
  one = train(config)
  with TensorStore(ram_bytes="16MiB") as store:
    policy = offload(store, inner=save_names("attn_out", "mlp_up"), min_bytes=0, inputs=(1,))
    shapes = []

    def planner(model, batch_shape):
      shapes.append(batch_shape)
      return [policy] * CFG.layers

    two = train(dataclasses.replace(config, devices=2), plan=planner)
    spills = store.stats()["spills"]
  assert shapes == [(2, CFG.seq)]  # planned for one device's share of the batch
  assert spills == 3 * 2 * CFG.layers  # steps x devices x layers
  for a, b in zip(two.history, one.history):
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-5)
  for a, b in zip(
    jax.tree.leaves(nnx.state(two.model, nnx.Param)),
    jax.tree.leaves(nnx.state(one.model, nnx.Param)),
  ):
    # Adam moves an element whose gradient is summation noise by a noise-sized fraction of a
    # step: agree within 0.1% of one step (the learning rate), and 1e-4 relative elsewhere.
    np.testing.assert_allclose(
      np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-3 * config.peak_learning_rate
    )
  with pytest.raises(ValueError, match="does not split evenly over 2 devices"):
    train(dataclasses.replace(config, batch=3, devices=2))
  with pytest.raises(ValueError, match="devices=3, but 2 are visible"):
    train(dataclasses.replace(config, devices=3))


def test_data_parallel_step_applies_the_mean_gradient_of_the_global_batch():
  """The trainer's step on two devices (offloading) with SGD at learning rate 1 moves every
  parameter by minus one device's plain gradient of the whole batch: neither summed over the
  devices nor one device's share (AdamW, the trainer's optimizer, would hide a scale)."""
  import optax
  from jax.sharding import Mesh

  from jaxdata.offload import TensorStore, offload
  from jaxdata.train import gpt as train_gpt

  devices = _two_devices("cpu")
  model = _model()
  params = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
  tokens = _tokens((4, CFG.seq + 1), seed=5)
  graphdef_m = nnx.graphdef(model)
  want_loss, want = jax.jit(jax.value_and_grad(lambda p: nnx.merge(graphdef_m, p).loss(tokens)))(
    params
  )
  graphdef, state = nnx.split((model, nnx.Optimizer(model, optax.sgd(1.0), wrt=nnx.Param)))
  with TensorStore(ram_bytes="16MiB") as store:
    plan = (offload(store, inner=save_names("qkv", "attn_ctx"), min_bytes=0, inputs=(1,)),) * 3
    step, _ = train_gpt._steps(graphdef, Mesh(np.array(devices), ("data",)), plan)
    state, loss = step(state, tokens)
    after, _ = nnx.merge(graphdef, jax.block_until_ready(state))
  np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
  moved = jax.tree.map(
    lambda a, b: np.asarray(a) - np.asarray(b), nnx.state(after, nnx.Param), params
  )
  for (path, m), w in zip(jax.tree_util.tree_leaves_with_path(moved), jax.tree.leaves(want)):
    np.testing.assert_allclose(
      m, -np.asarray(w), rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path)
    )


@pytest.mark.slow
def test_the_default_learning_rate_is_scaled_to_the_width_and_trains_a_wide_model():
  """At hidden 768 the small models' 3e-3 overshoots (the held-out loss ends above its start);
  the default, scaled by 128 / hidden, brings the loss down in the same steps."""
  # one layer, 8 steps, the held-out loss at the ends only: Adam's updates of 7M float32
  # parameters are this test's time on the CPU
  wide = dict(
    layers=1, hidden=768, heads=6, seq=16, batch=4, vocab=128, steps=8, warmup=2, log_every=8
  )
  assert GPTTrainConfig(**wide).peak_learning_rate == pytest.approx(3e-3 * 128 / 768)
  assert GPTTrainConfig(hidden=64, heads=4).peak_learning_rate == 3e-3
  scaled = train(GPTTrainConfig(**wide)).metrics
  fixed = train(GPTTrainConfig(**wide, learning_rate=3e-3)).metrics
  assert scaled["final_loss"] < scaled["start_loss"] - 0.3
  assert fixed["final_loss"] > fixed["start_loss"] > scaled["final_loss"]


def test_the_ram_tier_is_sized_for_the_plan(monkeypatch, capsys):
  """Without --ram the store's RAM tier grows to what the plan offloads in a step (here from a
  planning store of 4 KiB), and the run equals the plain one; --ram is an upper bound, and a
  plan the host cannot hold is a one-line error; the bytes a plan offloads are the RAM tier's
  peak in a step."""
  import argparse

  from jaxdata.command import UsageError
  from jaxdata.nn.gpt_plan import offloaded_bytes, policy_named
  from jaxdata.offload import TensorStore
  from jaxdata.train import gpt as train_gpt

  parser = argparse.ArgumentParser()
  train_gpt.add_arguments(parser)
  common = "--layers 2 --hidden 64 --heads 4 --seq 64 --vocab 32 --batch-size 8 --steps 3".split()
  common += ["--log-every", "1"]
  assert train_gpt.main(parser.parse_args(common)) == 0
  is_step = lambda l: l.split()[:1] == ["step"] and l.split()[2:3] == ["loss"]  # noqa: E731
  losses = lambda out: [float(l.split()[3]) for l in out.splitlines() if is_step(l)]  # noqa: E731
  plain = losses(capsys.readouterr().out)
  monkeypatch.setattr(train_gpt, "PLANNING_RAM", 4096)
  offload = common + ["--offload", "--plan", "offload[attn]+in"]
  assert train_gpt.main(parser.parse_args(offload)) == 0
  out = capsys.readouterr().out
  assert "offload store:" in out and "RAM tier" in out and "SSD" not in out, out
  np.testing.assert_allclose(losses(out), plain, rtol=1e-5)
  with pytest.raises(UsageError, match=r"argument --ram: the plan offloads .* more than --ram 4"):
    train_gpt.main(parser.parse_args(offload + ["--ram", "4KiB"]))
  monkeypatch.setattr(train_gpt, "available_memory", lambda: 1 << 20)
  with pytest.raises(UsageError, match=r"argument --budget: the plan offloads .* host memory"):
    train_gpt.main(parser.parse_args(offload))
  # The count against the store: one forward of the plan spills exactly that much.
  cfg = GPTConfig(vocab=32, layers=2, hidden=64, heads=4, seq=64, dtype=jnp.float32)
  model = GPT(cfg, rngs=nnx.Rngs(0))
  tokens = jnp.zeros((8, 65), jnp.int32)
  with TensorStore(ram_bytes="64MiB") as store:
    plan = [policy_named("offload[attn]+in", store)] * cfg.layers
    jax.block_until_ready(nnx.jit(nnx.grad(lambda m: m.loss(tokens, plan)))(model))
    need, stats = offloaded_bytes(model, (8, cfg.seq), plan, store), store.stats()
    # each spill rounds up to the arena's 256-byte alignment
    assert 0 < need <= stats["ram_peak"] <= need + 256 * stats["spills"]
