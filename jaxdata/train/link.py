"""`jaxdata train rgcn --task link`: trains the link prediction task of `jaxdata.tasks.link` (an
RGCN encoder and a DistMult decoder on a knowledge graph's training triples, ranked by the RGCN
paper's filtered protocol).

    from jaxdata.tasks.link import LinkConfig, synthetic_kg
    from jaxdata.train.link import train
    result = train(synthetic_kg(), LinkConfig(epochs=100))
    result.metrics["test_mrr"]
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxdata import command
from jaxdata.tasks.link import (  # noqa: F401  (the trainer's names for them)
  SPLIT_FILES,
  KGDataset,
  LinkConfig,
  LinkModel,
  evaluate,
  filtered_ranks,
  known_index,
  load_dataset,
  rank_metrics,
  read_triples,
  synthetic_kg,
  training_graph,
)
from jaxdata.train.common import (
  TrainResult,
  fit_epochs,
  mistakes,
  progress,
  resumer,
  save_result,
  say_saved,
)


def train(
  dataset: KGDataset,
  config: LinkConfig = LinkConfig(),  # noqa: B008  (frozen)
  *,
  on_epoch: Callable[[dict], None] | None = None,
  resume: Callable[[nnx.Module, nnx.Optimizer], list[dict]] | None = None,
  save_every: int = 0,
  on_save: Callable[[TrainResult], None] | None = None,
) -> TrainResult:
  """Trains the encoder and decoder; `metrics` holds the test split's filtered "test_mrr" and
  "test_hits@k", and the validation split's "val_mrr". `resume(model, optimizer)` puts a saved
  run's state into the fresh model and optimizer and returns its history (training goes on from
  the step after it); `on_save(result)` gets the run so far every `save_every` steps."""
  graph = training_graph(dataset)
  model = LinkModel(dataset.num_entities, dataset.num_relations, config, nnx.Rngs(config.seed))
  optimizer = nnx.Optimizer(model, optax.adam(config.learning_rate), wrt=nnx.Param)
  positives = jnp.asarray(dataset.train)
  n, entities = len(dataset.train), dataset.num_entities
  batch = min(config.batch_size, n)

  @nnx.jit
  def step(model, optimizer, key):
    pick, corrupt, side, drop = jax.random.split(key, 4)
    pos = (
      positives if batch == n else positives[jax.random.choice(pick, n, (batch,), replace=False)]
    )
    neg = jnp.repeat(pos, config.negatives, axis=0)
    new = jax.random.randint(corrupt, (len(neg),), 0, entities)
    head = jax.random.bernoulli(side, 0.5, (len(neg),))
    neg = (
      neg.at[:, 0]
      .set(jnp.where(head, new, neg[:, 0]))
      .at[:, 2]
      .set(jnp.where(head, neg[:, 2], new))
    )
    labels = jnp.concatenate([jnp.ones(len(pos)), jnp.zeros(len(neg))])

    def loss_fn(model):
      e = model.encode(graph, drop)
      logits = model.score(e, jnp.concatenate([pos, neg]))
      bce = optax.sigmoid_binary_cross_entropy(logits, labels).mean()
      return bce + config.l2 * jnp.mean(model.relation[...] ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  known = known_index(dataset.train, dataset.valid, dataset.test)  # for every evaluation
  key = jax.random.key(config.seed)

  def run_epoch(epoch: int) -> dict:
    t0 = time.perf_counter()
    loss = float(step(model, optimizer, jax.random.fold_in(key, epoch)))
    record = {"loss": loss, "seconds": time.perf_counter() - t0}
    if config.eval_every and epoch % config.eval_every == 0:
      record["val_mrr"] = evaluate(model, graph, dataset, "valid", known)["mrr"]
    return record

  def measure() -> dict:
    val = evaluate(model, graph, dataset, "valid", known)
    test = evaluate(model, graph, dataset, "test", known)
    return {"val_mrr": val["mrr"], **{f"test_{k}": v for k, v in test.items()}}

  return fit_epochs(
    config.epochs,
    run_epoch,
    lambda *run: TrainResult(model, *run, optimizer),
    measure,
    history=[] if resume is None else resume(model, optimizer),
    on_epoch=on_epoch,
    save_every=save_every,
    on_save=on_save,
    measure_saves=False,
  )


# ----------------------------------------------------------------------------- checkpoints, CLI


def data_of(args) -> tuple[KGDataset, dict]:
  """The dataset `jaxdata train rgcn --task link` names, and its description for a checkpoint."""
  if args.data is not None:
    source = "triples" if os.path.isdir(args.data) else "rdf"
    data = {"source": source, "path": os.path.abspath(args.data), "seed": args.seed}
  else:
    data = {
      "source": "synthetic-kg",
      "entities": args.nodes or 500,
      "relations": args.relations or 6,
      "triples": args.edges or 6000,
      "seed": args.seed,
    }
  with mistakes("--data", ValueError, FileNotFoundError):
    return load_dataset(data), data


def save(path: str, result: TrainResult, config: LinkConfig, data: dict) -> str:
  """Saves a trained link predictor as a checkpoint (`jaxdata.tasks.checkpoint`)."""
  return save_result(path, "rgcn-link", result, config, data)


#: `jaxdata train rgcn` options that belong to node classification only.
NODE_ONLY = (
  "l2",
  "self_loop",
  "bias",
  "val_fraction",
  "seeds",
  "scale",
  "classes",
  "embed",
  "target",
  "minibatch",
)


def main(args) -> int:
  """`jaxdata train rgcn --task link`."""
  given = [n for n in NODE_ONLY if getattr(args, n, None) not in (None, False, [], ())]
  if given:
    raise command.UsageError(
      f"argument --{given[0].replace('_', '-')}: for node classification, not --task link"
    )
  console = command.console()
  dataset, data = data_of(args)
  defaults = LinkConfig()
  with mistakes():
    config = LinkConfig(
      hidden=args.hidden or defaults.hidden,
      layers=defaults.layers if args.layers is None else args.layers,
      num_bases=args.bases or defaults.num_bases,
      learning_rate=args.lr or defaults.learning_rate,
      negatives=args.negatives,
      epochs=args.epochs or defaults.epochs,
      eval_every=args.eval_every,
      seed=args.seed,
    )
  console.print(f"[bold]{dataset}[/]")
  console.print(
    f"RGCN encoder ({config.layers} layers, hidden {config.hidden}, {config.num_bases} bases) + "
    f"DistMult, {config.negatives} negative(s) per positive, {config.epochs} steps"
  )
  with progress(console, "link prediction", config.epochs) as update:

    def on_epoch(r):
      update(advance=1, metrics=f"loss {r['loss']:.4f}")
      if "val_mrr" in r:
        console.print(f"step {r['epoch']:4d}  loss {r['loss']:.4f}  val MRR {r['val_mrr']:.4f}")

    result = train(
      dataset,
      config,
      on_epoch=on_epoch,
      resume=resumer(args.resume, kind="rgcn-link", config=config, data=data),
      save_every=args.save_every or 0,
      on_save=(lambda r: save(args.out, r, config, data)) if args.out else None,
    )
  m = result.metrics
  console.print(
    f"[bold]test (filtered): MRR {m['test_mrr']:.4f}, Hits@1 {m['test_hits@1']:.4f}, "
    f"Hits@3 {m['test_hits@3']:.4f}, Hits@10 {m['test_hits@10']:.4f}[/] "
    f"(validation MRR {m['val_mrr']:.4f}; {result.seconds:.1f} s)"
  )
  if args.out:
    save(args.out, result, config, data)
    say_saved(console, args.out)
  return 0
