"""The tasks jaxdata's trainers train, below the trainers: each task's configuration, data (from
its description, as a checkpoint records it), model, measurement and `restore` (what
`jaxdata.load_model` calls), and the checkpoints themselves (`jaxdata.tasks.checkpoint`). The
command line's training loops (`jaxdata.train`) build on them; nothing here imports them."""

import jax
import jax.numpy as jnp


def accuracy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """The fraction of rows whose largest logit is at their label."""
  return jnp.mean(jnp.argmax(logits, -1) == labels)
