"""Synthetic token streams a language model can learn: a random sparse Markov chain.

Each context (the last `order` tokens) may be followed by only `branching` tokens, with
probabilities drawn from a Dirichlet distribution; chain and samples are fixed by seeds. The
best possible next-token loss is the chain's conditional entropy (about 1 nat for 4 successors
and concentration 1), far below the log(vocab) of a model that has learned nothing, so a falling
loss shows that training works, and how close it gets to the floor shows how well.

    from jaxdata.data.tokens import markov_tokens
    chain = markov_tokens(vocab=256, seed=0)
    batches = chain.batches(batch=8, seq=128, seed=1)    # endless (8, 129) int32 arrays
    floor = chain.entropy()                              # nats per token
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np

_MAX_CONTEXTS = 1 << 22


@dataclasses.dataclass(frozen=True, eq=False)
class MarkovTokens:
  """A sparse order-`order` Markov chain over `vocab` tokens.

  successors[c, j] is the j-th token that may follow context c and probs[c, j] its probability;
  context c of tokens (a_1, ..., a_order), oldest first, is sum(a_i * vocab ** (order - i)).
  """

  vocab: int
  order: int
  successors: np.ndarray  # int32 (vocab ** order, branching), distinct per row
  probs: np.ndarray  # float64 (vocab ** order, branching), rows sum to 1

  @property
  def branching(self) -> int:
    return self.successors.shape[1]

  def _context(self, window: np.ndarray) -> np.ndarray:
    """Context ids of windows (..., order) of tokens."""
    c = np.zeros(window.shape[:-1], np.int64)
    for i in range(self.order):
      c = c * self.vocab + window[..., i]
    return c

  def sample(self, batch: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """int32 (batch, length): rows start with `order` uniform tokens, then follow the chain."""
    if length < self.order:
      raise ValueError(f"sample: length ({length}) must be at least the order ({self.order})")
    out = np.empty((batch, length), np.int32)
    out[:, : self.order] = rng.integers(0, self.vocab, (batch, self.order))
    cdf = np.cumsum(self.probs, axis=1)
    for t in range(self.order, length):
      c = self._context(out[:, t - self.order : t])
      pick = (rng.random(batch)[:, None] >= cdf[c]).sum(axis=1)
      out[:, t] = self.successors[c, np.minimum(pick, self.branching - 1)]
    return out

  def batches(self, batch: int, seq: int, seed: int = 0) -> Iterator[np.ndarray]:
    """Endless int32 (batch, seq + 1) arrays: inputs [:, :-1] and next-token targets [:, 1:].

    Every row is a fresh walk from a random start; the same seed gives the same batches.
    """
    rng = np.random.default_rng(seed)
    while True:
      yield self.sample(batch, seq + 1, rng)

  def nll(self, tokens: np.ndarray) -> float:
    """Mean negative log-likelihood (nats) of tokens[:, order:] under the chain itself.

    On samples from the chain this is what a perfect model's loss would be on them.
    """
    tokens = np.asarray(tokens)
    windows = np.lib.stride_tricks.sliding_window_view(tokens, self.order + 1, axis=-1)
    c, nxt = self._context(windows[..., :-1]), windows[..., -1]
    hit = self.successors[c] == nxt[..., None]
    p = np.where(hit, self.probs[c], 0.0).sum(-1)
    with np.errstate(divide="ignore"):
      return float(-np.log(p).mean())

  def entropy(self, samples: int = 64, length: int = 512, seed: int = 0) -> float:
    """The chain's conditional entropy (nats per token) along its walks: the loss floor.

    Exact per context, averaged over the contexts that `samples` walks of `length` tokens visit
    (random starts, as `batches` makes them), so it matches the training data's floor.
    """
    h = -np.sum(self.probs * np.log(np.maximum(self.probs, 1e-300)), axis=1)
    walks = self.sample(samples, length, np.random.default_rng([seed, 0x6E7]))
    windows = np.lib.stride_tricks.sliding_window_view(walks, self.order, axis=-1)[:, :-1]
    return float(h[self._context(windows)].mean())


def markov_tokens(
  vocab: int = 256, *, order: int = 1, branching: int = 4, concentration: float = 1.0, seed: int = 0
) -> MarkovTokens:
  """A random sparse Markov chain, the same for the same arguments.

  Args:
    vocab: number of tokens.
    order: how many previous tokens form the context (vocab ** order contexts).
    branching: how many distinct tokens may follow each context.
    concentration: Dirichlet concentration of each context's probabilities (lower: peakier,
      lower entropy).
    seed: fixes successors and probabilities.
  """
  if vocab < 2 or order < 1 or not 1 <= branching <= vocab or concentration <= 0:
    raise ValueError(
      f"markov_tokens: need vocab >= 2, order >= 1, 1 <= branching <= vocab and "
      f"concentration > 0 (got {vocab}, {order}, {branching}, {concentration})"
    )
  if vocab**order > _MAX_CONTEXTS:
    raise ValueError(
      f"markov_tokens: vocab ** order = {vocab**order} contexts, more than "
      f"{_MAX_CONTEXTS}; lower the order or the vocabulary"
    )
  rng = np.random.default_rng(seed)
  contexts = vocab**order
  # Distinct successors per row: a random start plus strictly increasing offsets in [1, vocab].
  gaps = rng.integers(1, vocab // branching + 1, (contexts, branching))
  start = rng.integers(0, vocab, (contexts, 1))
  successors = ((start + np.cumsum(gaps, axis=1)) % vocab).astype(np.int32)
  probs = rng.dirichlet(np.full(branching, float(concentration)), contexts)
  return MarkovTokens(vocab, order, successors, probs)
