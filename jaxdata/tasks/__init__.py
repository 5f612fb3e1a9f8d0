"""The tasks jaxdata's trainers train, below the trainers: each task's configuration, data (from
its description, as a checkpoint records it), model, measurement and `restore` (what
`jaxdata.load_model` calls), and the checkpoints themselves (`jaxdata.tasks.checkpoint`). The
command line's training loops (`jaxdata.train`) build on them; nothing here imports them."""

import queue
import threading
from collections.abc import Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np


def accuracy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """The fraction of rows whose largest logit is at their label."""
  return jnp.mean(jnp.argmax(logits, -1) == labels)


def seed_batches(
  ids: np.ndarray, size: int, rng: np.random.Generator | None = None, limit: int | None = None
) -> np.ndarray:
  """int32[num_batches, size]: `ids` (shuffled if `rng`) in batches, the last padded with -1;
  at most `limit` batches. A shuffled `limit` draws only the seeds it keeps: permuting every id
  would cost a benchmark's short epoch more than its steps (0.4 s for ogbn-papers100M's 11M
  training nodes)."""
  ids = np.asarray(ids)
  n = -(-len(ids) // size)
  if limit is not None:
    n = min(n, limit)
  if rng is None:
    order = ids
  elif n * size < len(ids):
    order = ids[rng.choice(len(ids), n * size, replace=False)]
  else:
    order = rng.permutation(ids)
  rows = np.full(n * size, -1, np.int32)
  take = min(len(order), n * size)
  rows[:take] = order[:take]
  return rows.reshape(n, size)


def prefetched(items: Iterable, depth: int = 2) -> Iterator:
  """`items`, produced on a background thread `depth` ahead (exceptions re-raised here).

  Closing the iterator early stops the producer (a producer blocked on a full queue is
  unblocked), so nothing keeps running behind an abandoned epoch.
  """
  q: queue.Queue = queue.Queue(depth)
  stop = threading.Event()
  done = object()

  def produce():
    try:
      for item in items:
        if stop.is_set():
          return
        q.put(item)
      q.put(done)
    except BaseException as e:  # noqa: BLE001  surfaced in the consumer
      q.put(e)

  worker = threading.Thread(target=produce, daemon=True)
  worker.start()
  try:
    while (item := q.get()) is not done:
      if isinstance(item, BaseException):
        raise item
      yield item
  finally:
    stop.set()
    while worker.is_alive():  # unblock a producer waiting on a full queue
      try:
        q.get_nowait()
      except queue.Empty:
        pass
      worker.join(0.01)
