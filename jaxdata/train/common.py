"""What every trainer shares: its result, accuracy, and the progress display of a run.

    result = train(...)                  # any of jaxdata.train.{rgcn,attention,sage,gpt}
    result.model, result.history         # the trained model; one record per epoch or logged step
    result.metrics                       # what training measured at its end (test accuracy, ...)
    result.test_accuracy                 # = result.metrics["test_accuracy"], where measured
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jaxdata import command


@dataclasses.dataclass
class TrainResult:
  """A finished run: the model, its history, what it measured at the end, and the optimizer
  state (an `nnx.Optimizer`, or an optax state) that a checkpoint saves to resume from."""
  model: Any
  history: list[dict]               # per epoch (or logged step): loss, accuracies, seconds, ...
  metrics: dict[str, Any]           # measured at the end: test/val accuracy, held-out loss, ...
  seconds: float = 0.0              # the run's wall time
  optimizer: Any = None             # nnx.Optimizer or optax state
  plan: Any = None                  # gpt: the per-layer remat plan it trained under

  @property
  def test_accuracy(self) -> float:
    return float(self.metrics["test_accuracy"])

  @property
  def val_accuracy(self) -> float:
    return float(self.metrics["val_accuracy"])


def accuracy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """The fraction of rows whose largest logit is at their label."""
  return jnp.mean(jnp.argmax(logits, -1) == labels)


def seed_batches(ids: np.ndarray, size: int, rng: np.random.Generator | None = None,
                 limit: int | None = None) -> np.ndarray:
  """int32[num_batches, size]: `ids` (shuffled if `rng`) in batches, the last padded with -1;
  at most `limit` batches."""
  order = rng.permutation(ids) if rng is not None else np.asarray(ids)
  n = -(-len(order) // size)
  if limit is not None:
    n = min(n, limit)
  rows = np.full(n * size, -1, np.int32)
  take = min(len(order), n * size)
  rows[:take] = order[:take]
  return rows.reshape(n, size)


@contextlib.contextmanager
def progress(console, label: str, total: int | None, **fields: Any
             ) -> Iterator[Callable[..., None]]:
  """A progress bar for a run (`label`, `total` epochs or steps; None: unknown), yielding
  `update(advance=1, **fields)`; `fields` are shown after the bar ("metrics": a short text)."""
  from rich.progress import (  # pylint: disable=g-import-not-at-top
      BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn)
  fields.setdefault("metrics", "")
  columns = (TextColumn(label), BarColumn(), MofNCompleteColumn(),
             TextColumn("{task.fields[metrics]}"), TimeElapsedColumn())
  with Progress(*columns, console=console, transient=fields.pop("transient", False)) as bar:
    task = bar.add_task("run", total=total, **fields)
    yield lambda **kw: bar.update(task, **kw)


def add_out_argument(parser, kind: str, model: str = "the trained model") -> None:
  """Every trainer's `--out DIR`: where its checkpoint goes (checked before training starts)."""
  parser.add_argument("--out", default=f"{kind}-checkpoint", type=command.checkpoint_dir,
                      metavar="DIR", help=f"checkpoint folder for {model} (`jaxdata eval DIR` "
                                          "measures it again)")


def say_saved(console, path: str) -> None:
  """The line every trainer ends with: where the checkpoint and its history went."""
  console.print(f"checkpoint saved to {path} (history in {path}/history.json; "
                f"`jaxdata eval {path}` measures it again)")
