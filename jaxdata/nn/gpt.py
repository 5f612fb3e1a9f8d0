"""A GPT-style decoder in Flax NNX whose layer stack runs under per-layer remat policies.

Pre-LayerNorm blocks (causal multi-head self-attention, then a GELU MLP), learned token and
position embeddings, a final LayerNorm and an output head tied to the token embedding (logits
are `h @ wte.T`, computed in float32). Attention is `jax.nn.dot_product_attention`, causal: on a
GPU with a half-precision compute dtype it is cuDNN's fused (flash) kernel, which keeps only its
output and per-row softmax statistics for the backward pass, elsewhere XLA's einsum-and-softmax
(`GPTConfig.attention` overrides the choice). Each block tags its intermediates with
`jax.ad_checkpoint.checkpoint_name` (see `BLOCK_NAMES`), so remat policies can name what to
keep, offload or recompute; `save_names` builds such a policy that also covers the fused
kernel's statistics, which carry no name.

The L blocks are one `Block` whose parameters carry a leading layer axis (made under
`nnx.vmap`); the stack runs as `jax.lax.scan`. A *plan* gives each layer a policy: consecutive
layers with equal policies form one segment, one scan over that slice of the stacked
parameters, whose body is `jaxdata.offload.remat(block_apply, policy)`.

    from jaxdata.nn import GPT, GPTConfig
    model = GPT(GPTConfig(vocab=256, layers=4, hidden=128, heads=4, seq=128), rngs=nnx.Rngs(0))
    logits = model(tokens)                       # int (batch, t <= seq) -> (batch, t, vocab)
    loss = model.loss(batch)                     # batch: (batch, t + 1); next-token cross entropy
    loss = model.loss(batch, plan=[None, None, p, p])   # layers 2-3 under policy p
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxdata.offload.stack import run_layers, segments

#: The names a block tags its intermediates with, in the order the forward pass makes them.
BLOCK_NAMES = ("block_in", "qkv", "attn_ctx", "attn_out", "mlp_up", "mlp_act", "mlp_down")
ATTENTION = ("auto", "xla", "cudnn")


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """The model's shape. `dtype` is the compute dtype; parameters are kept in `param_dtype`."""

  vocab: int = 256
  layers: int = 4
  hidden: int = 128
  heads: int = 4
  seq: int = 128  # the longest input (the position table's length)
  mlp_ratio: int = 4
  dtype: Any = jnp.bfloat16
  param_dtype: Any = jnp.float32
  attention: str = "auto"  # "cudnn" (fused), "xla", or "auto": cudnn on a GPU in 16-bit compute
  # `loss` in chunks of this many positions (0: all at once): only one chunk's float32 logits
  # are live at a time, recomputed in the backward pass (batch x seq x vocab x 4 bytes otherwise)
  loss_chunk: int = 0

  def __post_init__(self):
    for name in ("vocab", "layers", "hidden", "heads", "seq", "mlp_ratio"):
      if int(getattr(self, name)) < 1:
        raise ValueError(f"GPTConfig: {name} must be >= 1, got {getattr(self, name)}")
    if int(self.loss_chunk) < 0:
      raise ValueError(f"GPTConfig: loss_chunk must be >= 0, got {self.loss_chunk}")
    if self.hidden % self.heads:
      raise ValueError(
        f"GPTConfig: hidden ({self.hidden}) must be a multiple of heads ({self.heads})"
      )
    if self.attention not in ATTENTION:
      raise ValueError(f"GPTConfig: attention must be one of {ATTENTION}, got {self.attention!r}")

  def attention_implementation(self) -> str:
    """The implementation `attention="auto"` stands for on the default backend."""
    if self.attention != "auto":
      return self.attention
    half = jnp.dtype(self.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    fits = self.hidden // self.heads <= 128 and (self.hidden // self.heads) % 8 == 0
    return "cudnn" if jax.default_backend() == "gpu" and half and fits else "xla"


def save_names(*names: str) -> Callable[..., bool]:
  """A checkpoint policy saving the block values tagged with `names` (see `BLOCK_NAMES`).

  A fused attention kernel's residuals (its output and softmax statistics) are outputs of one
  primitive that no name reaches; naming "attn_ctx" saves them too, so the backward pass needs
  no second run of the attention forward.
  """
  unknown = set(names) - set(BLOCK_NAMES)
  if unknown:
    raise ValueError(f"save_names: unknown names {sorted(unknown)}; a block has {BLOCK_NAMES}")
  by_name = jax.checkpoint_policies.save_only_these_names(*names)
  fused = "attn_ctx" in names

  def policy(prim, *args, **params):
    if fused and prim.name.startswith("dot_product_attention_fwd"):  # (its "_wrapper" too)
      return True
    return by_name(prim, *args, **params)

  return policy


@jax.custom_vjp
def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array) -> jax.Array:
  """LayerNorm over the last axis (epsilon 1e-5), statistics in float32, result in x's dtype.

  Its backward pass keeps x and one mean and inverse deviation per row, where differentiating
  the formula would keep several float32 copies of x (6 activations' worth in bfloat16 terms).
  Reverse mode only (a custom VJP): `jax.jvp` through it raises. Under `shard_map` with
  per-device rows and replicated `scale`/`bias`, their gradients are summed over the devices
  (what JAX's own differentiation does for a replicated input; see `_like_primal`).
  """
  return _layer_norm_fwd(x, scale, bias)[0]


def _layer_norm_fwd(x, scale, bias):
  xf = x.astype(jnp.float32)
  mean = xf.mean(-1, keepdims=True)
  rstd = jax.lax.rsqrt(jnp.square(xf - mean).mean(-1, keepdims=True) + 1e-5)
  y = (xf - mean) * rstd * scale.astype(jnp.float32) + bias.astype(jnp.float32)
  return y.astype(x.dtype), (x, mean, rstd, scale, bias)


def _like_primal(ct: jax.Array, primal: jax.Array) -> jax.Array:
  """`ct` summed over the manual mesh axes along which it varies and `primal` does not.

  Inside `shard_map` (checking varying axes, its default) a replicated input used with
  per-device data gets a per-device cotangent; JAX's own transpose of the implicit broadcast
  sums it over those axes, and a custom VJP must return what that would (same type as the
  primal). Outside `shard_map` nothing varies and this is `ct`.
  """
  extra = tuple(sorted(_varying(ct) - _varying(primal)))
  return jax.lax.psum(ct, extra) if extra else ct


def _varying(x: jax.Array) -> set:
  """The manual mesh axes along which x varies: `vma` of its type in JAX <= 0.9, `varying` of
  its `manual_axis_type` since 0.10; empty outside `shard_map`."""
  aval = jax.typeof(x)
  if hasattr(aval, "vma"):
    return set(aval.vma)
  return set(getattr(getattr(aval, "manual_axis_type", None), "varying", ()))


def _layer_norm_bwd(res, g):
  x, mean, rstd, scale, bias = res
  xhat = (x.astype(jnp.float32) - mean) * rstd
  g = g.astype(jnp.float32)
  axes = tuple(range(g.ndim - 1))
  d_scale = (g * xhat).sum(axes).astype(scale.dtype)
  d_bias = g.sum(axes).astype(scale.dtype)
  gx = g * scale.astype(jnp.float32)
  dx = rstd * (gx - gx.mean(-1, keepdims=True) - xhat * (gx * xhat).mean(-1, keepdims=True))
  return dx.astype(x.dtype), _like_primal(d_scale, scale), _like_primal(d_bias, bias)


layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


@jax.custom_vjp
def gelu(x: jax.Array) -> jax.Array:
  """GELU, tanh approximation (GPT-2's); its backward pass keeps only x (differentiating the
  formula keeps five arrays of x's size)."""
  return jax.nn.gelu(x, approximate=True)


def _gelu_fwd(x):
  return jax.nn.gelu(x, approximate=True), x


def _gelu_bwd(x, g):
  xf = x.astype(jnp.float32)
  c = math.sqrt(2 / math.pi)
  inner = c * (xf + 0.044715 * xf**3)
  t = jnp.tanh(inner)
  d = 0.5 * (1 + t) + 0.5 * xf * (1 - t * t) * c * (1 + 3 * 0.044715 * xf * xf)
  return ((g.astype(jnp.float32) * d).astype(g.dtype),)


gelu.defvjp(_gelu_fwd, _gelu_bwd)


def _dense(cfg: GPTConfig, n_in: int, n_out: int, std: float, rngs: nnx.Rngs) -> nnx.Linear:
  return nnx.Linear(
    n_in,
    n_out,
    dtype=cfg.dtype,
    param_dtype=cfg.param_dtype,
    kernel_init=nnx.initializers.normal(std),
    rngs=rngs,
  )


def _layer_norm(cfg: GPTConfig, rngs: nnx.Rngs) -> nnx.LayerNorm:
  """The parameters (scale, bias) of a LayerNorm that `_norm` applies with `layer_norm`."""
  return nnx.LayerNorm(
    cfg.hidden, epsilon=1e-5, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs
  )


def _norm(ln: nnx.LayerNorm, x: jax.Array) -> jax.Array:
  assert ln.scale is not None and ln.bias is not None  # `_layer_norm` keeps both
  return layer_norm(x, ln.scale[...], ln.bias[...])


class Block(nnx.Module):
  """x + attn(ln1(x)), then x + mlp(ln2(x)); shapes (batch, seq, hidden) in and out."""

  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
    self.heads = cfg.heads
    self.attention = cfg.attention_implementation()
    # GPT-2's initialization: N(0, 0.02), residual projections scaled down by sqrt(2 L).
    std, out_std = 0.02, 0.02 / math.sqrt(2 * cfg.layers)
    self.ln1 = _layer_norm(cfg, rngs)
    self.qkv = _dense(cfg, cfg.hidden, 3 * cfg.hidden, std, rngs)
    self.proj = _dense(cfg, cfg.hidden, cfg.hidden, out_std, rngs)
    self.ln2 = _layer_norm(cfg, rngs)
    self.up = _dense(cfg, cfg.hidden, cfg.mlp_ratio * cfg.hidden, std, rngs)
    self.down = _dense(cfg, cfg.mlp_ratio * cfg.hidden, cfg.hidden, out_std, rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = checkpoint_name(x, "block_in")
    b, t, d = x.shape
    hd = d // self.heads
    q, k, v = jnp.split(self.qkv(_norm(self.ln1, x)), 3, axis=-1)
    q, k, v = (checkpoint_name(a.reshape(b, t, self.heads, hd), "qkv") for a in (q, k, v))
    ctx = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=self.attention)
    ctx = checkpoint_name(ctx.reshape(b, t, d), "attn_ctx")
    x = x + checkpoint_name(self.proj(ctx), "attn_out")
    up = checkpoint_name(self.up(_norm(self.ln2, x)), "mlp_up")
    act = checkpoint_name(gelu(up), "mlp_act")
    return x + checkpoint_name(self.down(act), "mlp_down")


def _join(stacks: list) -> Any:
  """One stack of layer states from several (no copy when there is only one)."""
  if len(stacks) == 1:
    return stacks[0]
  return jax.tree.map(lambda *a: jnp.concatenate(a), *stacks)


class BlockFn(NamedTuple):
  """One layer in isolation, for a planner: `apply(layer(i), x)` runs layer i on input like x."""

  apply: Callable[[Any, jax.Array], jax.Array]  # pure: (one layer's state, x) -> x
  states: Any  # every layer's state, stacked on axis 0
  x: jax.ShapeDtypeStruct  # a block's input: (batch, seq, hidden), dtype

  def layer(self, i: int) -> Any:
    """Layer i's state (the stacked states indexed at i)."""
    return jax.tree.map(lambda a: a[i], self.states)


class GPT(nnx.Module):
  """Token + position embeddings, `cfg.layers` stacked `Block`s, final LayerNorm, tied head."""

  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    init = nnx.initializers.normal(0.02)
    self.wte = nnx.Embed(
      cfg.vocab,
      cfg.hidden,
      dtype=cfg.dtype,
      param_dtype=cfg.param_dtype,
      embedding_init=init,
      rngs=rngs,
    )
    self.wpe = nnx.Embed(
      cfg.seq,
      cfg.hidden,
      dtype=cfg.dtype,
      param_dtype=cfg.param_dtype,
      embedding_init=init,
      rngs=rngs,
    )

    @nnx.split_rngs(splits=cfg.layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def stack(rngs: nnx.Rngs) -> Block:
      return Block(cfg, rngs=rngs)

    self.blocks = stack(rngs)
    self.ln_f = _layer_norm(cfg, rngs)

  def _block_fn(self) -> tuple[Callable, Any]:
    if isinstance(self.blocks, nnx.List):  # split by `split_layers`: one stack per segment
      graphdef = nnx.split(self.blocks[0])[0]
      states = [nnx.split(b)[1] for b in self.blocks]
    else:
      graphdef, states = nnx.split(self.blocks)

    def block_apply(state, x):
      return nnx.merge(graphdef, state)(x)

    return block_apply, states

  def split_layers(self, plan: Sequence[Hashable]) -> None:
    """Splits the stacked layers into one stack per segment of `plan` (see `segments`), in place.

    Training under a plan of several segments should split first (outside `jit`): a single
    stack's slices cost a copy of every layer's parameters and a stack-sized gradient buffer per
    segment inside the step (12 GiB each at 16 layers of hidden 4096). After the split, calls
    take plans with the same segment lengths (or none: plain layers). `split_layers(None)` joins
    the stacks again.
    """
    stacks = list(self.blocks) if isinstance(self.blocks, nnx.List) else [self.blocks]
    graphdef = nnx.split(stacks[0])[0]
    state = _join([nnx.split(b)[1] for b in stacks])
    if plan is None:
      self.blocks = nnx.merge(graphdef, state)
      return
    runs = segments(plan, self.cfg.layers)
    self.blocks = nnx.List(
      [nnx.merge(graphdef, jax.tree.map(lambda a, i=i, j=j: a[i:j], state)) for i, j, _ in runs]
    )

  def __call__(self, tokens: jax.Array, plan: Sequence[Hashable] | None = None) -> jax.Array:
    """Float32 logits (batch, t, vocab) for int tokens (batch, t), t <= cfg.seq.

    `plan`: None (one plain scan, every residual kept) or one policy per layer.
    """
    x, table = self._features(tokens, plan)
    return _logits(x, table)

  def _features(self, tokens: jax.Array, plan) -> tuple[jax.Array, jax.Array]:
    """The final normalized hidden states (batch, t, hidden) and the output embedding table."""
    t = tokens.shape[-1]
    if t > self.cfg.seq:
      raise ValueError(f"GPT: tokens have length {t}, longer than cfg.seq={self.cfg.seq}")
    x = (self.wte(tokens) + self.wpe(jnp.arange(t))).astype(self.cfg.dtype)
    block_apply, states = self._block_fn()
    x = _norm(self.ln_f, run_layers(block_apply, states, x, plan))
    return x, self.wte.embedding[...].astype(x.dtype)

  def loss(self, tokens: jax.Array, plan: Sequence[Hashable] | None = None) -> jax.Array:
    """Mean next-token cross entropy (float32) of tokens (batch, t + 1): predicts tokens[:, 1:].

    With `cfg.loss_chunk` > 0 the positions go through the output layer and the cross entropy
    in chunks of that many, one after another, each rematerialized in the backward pass: the
    same loss, without (batch, t, vocab) float32 logits in memory.
    """
    x, table = self._features(tokens[:, :-1], plan)
    labels = tokens[:, 1:]
    chunk = int(self.cfg.loss_chunk)
    b, t = labels.shape
    if chunk == 0 or chunk >= t:
      return optax.softmax_cross_entropy_with_integer_labels(_logits(x, table), labels).mean()
    n = -(-t // chunk)
    pad = n * chunk - t

    def split(a):
      """(b, t, ...) -> (n, b, chunk, ...), padding t up to n * chunk."""
      padded = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
      return jnp.moveaxis(padded.reshape(b, n, chunk, *a.shape[2:]), 1, 0)

    valid = (jnp.arange(n * chunk) < t).reshape(n, 1, chunk)

    @jax.checkpoint
    def chunk_loss(table, xs, ls, ok):
      ce = optax.softmax_cross_entropy_with_integer_labels(_logits(xs, table), ls)
      return jnp.where(ok, ce, 0.0).sum()

    def body(total, c):
      return total + chunk_loss(table, *c), None

    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (split(x), split(labels), valid))
    return total / (b * t)


def _logits(x: jax.Array, table: jax.Array) -> jax.Array:
  """Float32 logits of hidden states x (..., hidden) against the embedding table (vocab, hidden)."""
  return jnp.einsum("...d,vd->...v", x, table, preferred_element_type=jnp.float32)


def block_fn(model: GPT, batch_shape: tuple[int, int] | None = None) -> BlockFn:
  """The model's block as a pure function of (one layer's state, x), for planners.

  `batch_shape` is (batch, seq) of the model's input (default (1, cfg.seq)); the returned `x`
  describes a block's input for it.

      f = block_fn(model, (8, 128))
      y = f.apply(f.layer(0), jnp.zeros(f.x.shape, f.x.dtype))
  """
  b, t = batch_shape if batch_shape is not None else (1, model.cfg.seq)
  apply, states = model._block_fn()  # pylint: disable=protected-access
  if isinstance(states, list):  # split by `GPT.split_layers`
    states = _join(states)
  return BlockFn(apply, states, jax.ShapeDtypeStruct((b, t, model.cfg.hidden), model.cfg.dtype))
