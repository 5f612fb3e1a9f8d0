"""The GPT task: next-token prediction on a synthetic token chain (`jaxdata.data.tokens`), whose
loss has a known floor (the chain's entropy). Its configuration, optimizer, held-out loss and
`restore`; `jaxdata train gpt` (`jaxdata.train.gpt`) trains it."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxdata.data.tokens import markov_tokens
from jaxdata.nn.gpt import GPT, GPTConfig
from jaxdata.tasks import checkpoint

#: The default peak learning rate up to hidden `BASE_WIDTH` (`GPTTrainConfig.peak_learning_rate`).
BASE_LEARNING_RATE, BASE_WIDTH = 3e-3, 128


@dataclasses.dataclass(frozen=True)
class GPTTrainConfig:
  """What `train` does: the model, the data, the optimizer (AdamW, warmup then cosine decay).

  `batch` is the global batch: sequences per step over every device of every process; each
  device of the mesh takes `batch / devices` of them (`batch` must divide evenly).
  """

  layers: int = 4
  hidden: int = 128
  heads: int = 4
  seq: int = 128
  batch: int = 8
  vocab: int = 256
  steps: int = 200
  learning_rate: float | None = None  # peak; None: `BASE_LEARNING_RATE` scaled to the width
  warmup: int = 20
  weight_decay: float = 0.01
  seed: int = 0
  dtype: str = "float32"  # compute dtype; parameters stay float32
  order: int = 1  # the token chain: context length and successors per context
  branching: int = 4  # (at most vocab: a smaller vocab takes vocab)
  eval_batches: int = 4  # held-out batches for the start and final loss
  log_every: int | None = None  # steps between logged records (None: steps // 10)
  loss_chunk: int = 0  # cross entropy in chunks of this many positions (0: at once)
  devices: int | None = 1  # data parallel over this many devices per process (None: all)

  def __post_init__(self):
    if min(self.steps, self.batch, self.eval_batches) < 1:
      raise ValueError("GPTTrainConfig: steps, batch and eval_batches must be >= 1")
    if self.devices is not None and self.devices < 1:
      raise ValueError(f"GPTTrainConfig: devices must be >= 1 (or None: all), got {self.devices}")
    if self.dtype not in ("float32", "bfloat16"):
      raise ValueError(f"GPTTrainConfig: dtype must be float32 or bfloat16, got {self.dtype!r}")
    self.model_config()  # validates the shape

  @property
  def peak_learning_rate(self) -> float:
    """`learning_rate`, or by default `BASE_LEARNING_RATE` at hidden `BASE_WIDTH` and below,
    times BASE_WIDTH / hidden above it: Adam's steps move every weight by about the learning
    rate, so a wider layer's output moves in proportion to its width (3e-3 at hidden 4096 sent
    the loss of a 16-layer GPT from 9.9 to 13.7 in 10 steps)."""
    if self.learning_rate is not None:
      return self.learning_rate
    return BASE_LEARNING_RATE * min(1.0, BASE_WIDTH / self.hidden)

  def model_config(self) -> GPTConfig:
    return GPTConfig(
      vocab=self.vocab,
      layers=self.layers,
      hidden=self.hidden,
      heads=self.heads,
      seq=self.seq,
      dtype=jnp.dtype(self.dtype),
      loss_chunk=self.loss_chunk,
    )


def make_optimizer(config: GPTTrainConfig) -> optax.GradientTransformation:
  peak = config.peak_learning_rate
  schedule = optax.warmup_cosine_decay_schedule(
    0.0,
    peak,
    warmup_steps=min(config.warmup, config.steps // 2),
    decay_steps=config.steps + 1,
    end_value=peak / 10,
  )
  return optax.chain(
    optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=config.weight_decay)
  )


@nnx.jit
def mean_loss(model: GPT, batches: jax.Array) -> jax.Array:
  """Mean loss over batches (n, batch, seq + 1)."""
  return jnp.mean(jax.lax.map(model.loss, batches))


def token_chain(config: GPTTrainConfig):
  return markov_tokens(
    config.vocab,
    order=config.order,
    branching=min(config.branching, config.vocab),
    seed=config.seed,
  )


def held_out(config: GPTTrainConfig, chain=None) -> jax.Array:
  """The held-out batches (eval_batches, batch, seq + 1) the start and final losses are over."""
  chain = token_chain(config) if chain is None else chain
  return jnp.asarray(
    np.stack(
      [
        next(chain.batches(config.batch, config.seq, seed=config.seed + 1000 + i))
        for i in range(config.eval_batches)
      ]
    )
  )


def evaluate(model: GPT, config: GPTTrainConfig) -> dict:
  """{"final_loss": the mean next-token loss over the run's held-out batches}."""
  return {"final_loss": float(mean_loss(model, held_out(config)))}


def data_of(config: GPTTrainConfig) -> dict:
  """A GPT checkpoint's data description: the synthetic chain's seed."""
  return {"source": "markov", "seed": config.seed}


def restore(path: str, meta: dict):
  """Rebuilds a saved GPT (`jaxdata.tasks.checkpoint.load_model`); its data is the run's own
  synthetic chain, rebuilt from the configuration."""
  config = checkpoint.config_from(GPTTrainConfig, meta["config"])
  model = GPT(config.model_config(), rngs=nnx.Rngs(config.seed))
  optimizer = nnx.Optimizer(model, make_optimizer(config), wrt=nnx.Param)
  has_optimizer = checkpoint.restore_nnx(path, meta, model, optimizer)
  return checkpoint.Loaded(
    "gpt",
    model,
    meta,
    evaluate=lambda: evaluate(model, config),
    predict=lambda tokens: model(jnp.asarray(tokens)),
    optimizer_state=optimizer if has_optimizer else None,
  )
