"""The entity classification task of `jaxdata train rgcn` (`jaxdata.train.attention`): its
configuration (and the RGCN paper's per dataset), its data (an RDF archive or a synthetic graph,
from a data description), how the model is built, its L2 term, how it is measured, and `restore`.
The full-graph, partitioned and mini-batch loops all read them from here."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxdata.data import EntityDataset, HeteroGraph, load_entities, synthetic_entities
from jaxdata.hector import GraphArrays
from jaxdata.host import HostTable, host_gather
from jaxdata.nn import EntityClassifier
from jaxdata.tasks import accuracy, checkpoint


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  epochs: int = 50
  hidden: int = 16
  num_bases: int | None = None
  l2: float = 0.0  # times the first layer's sum of squared parameters, as in the paper
  self_loop: str = "separate"  # W_0 a weight of its own, or "basis": combined from the bases
  bias: bool = True
  learning_rate: float = 0.01
  seed: int = 0
  dtype: str = "float32"  # or "bfloat16" (parameters stay float32)
  val_fraction: float = 0.0  # training nodes held out (seeded) to report validation accuracy
  devices: int | None = 1  # per process; None: every local device (train.partitioned; minibatch)

  def __post_init__(self):
    if self.epochs < 1 or self.hidden < 1:
      raise ValueError("epochs and hidden must be >= 1")
    if not 0 <= self.val_fraction < 1:
      raise ValueError(f"val_fraction must be in [0, 1), got {self.val_fraction}")
    if self.dtype not in ("float32", "bfloat16"):
      raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
    if self.devices is not None and self.devices < 1:
      raise ValueError(f"devices must be >= 1 or None (all), got {self.devices}")
    if self.self_loop not in ("separate", "basis"):
      raise ValueError(f"self_loop must be 'separate' or 'basis', got {self.self_loop!r}")
    if self.self_loop == "basis" and self.num_bases is None:
      raise ValueError(
        "self_loop='basis' combines the self-loop weight from the bases: it needs num_bases"
      )


#: The RGCN paper's hyperparameters per RDF dataset (hidden 16, 50 epochs, lr 0.01 everywhere;
#: bases and L2 per dataset); it trains on the whole training set (no validation split) once they
#: are chosen. From the authors' code (tkipf/relational-gcn, whose README gives these commands): no
#: bias in either layer, and the self loop is one more relation, decomposed over the bases where
#: there are bases (`main` falls back to a weight of its own where there are none, as on AIFB).
PAPER_SETUP = {
  "aifb": dict(num_bases=None, l2=0.0, val_fraction=0.0, self_loop="basis", bias=False),
  "mutag": dict(num_bases=30, l2=5e-4, val_fraction=0.0, self_loop="basis", bias=False),
}
#: The built-in synthetic graph: 100 relations (with inverses) and 2,000 training nodes overfit a
#: full weight per relation (55% test accuracy); 8 shared bases generalize (89%). A fifth of the
#: training nodes is held out to report validation accuracy every epoch.
SYNTHETIC_SETUP = dict(num_bases=8, l2=5e-4, val_fraction=0.2)


def build_model(dataset: EntityDataset, config: TrainConfig, rngs: nnx.Rngs) -> EntityClassifier:
  """`jaxdata.nn.EntityClassifier` for `dataset` (its relations, classes, and its features'
  width, or one learnable row per node when featureless) with `config`'s hyperparameters."""
  g = dataset.graph
  return EntityClassifier(
    None if dataset.features is None else dataset.features.shape[1],
    g.num_relations,
    dataset.num_classes,
    num_nodes=g.num_nodes,
    hidden=config.hidden,
    num_bases=config.num_bases,
    self_loop=config.self_loop,
    use_bias=config.bias,
    dtype=config.dtype,
    rngs=rngs,
  )


def l2_penalty(model: EntityClassifier) -> jax.Array:
  """The sum of squares of every parameter of the first layer (bases and coefficients, or
  relation weights; the self-loop weight and bias where it has them): the paper's L2 term, which
  the loss adds times `TrainConfig.l2` (the second layer is not penalized)."""
  return sum(
    jnp.sum(p[...].astype(jnp.float32) ** 2)
    for _, p in nnx.iter_graph(model.conv1)
    if isinstance(p, nnx.Param)
  )


def split_validation(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
  """Positions of the training nodes to fit on and to validate on: `fraction` of n (at least one
  where fraction > 0 and n > 1) drawn with `seed`; (all, none) for fraction 0."""
  k = min(n - 1, max(1, round(fraction * n))) if fraction > 0 and n > 1 else 0
  order = np.random.default_rng(seed).permutation(n)
  return np.sort(order[k:]), np.sort(order[:k])


@nnx.jit
def _logits(model, graph, x):
  return model(graph, x)


def predict(
  model: EntityClassifier, dataset: EntityDataset, graph: GraphArrays | None = None
) -> jax.Array:
  """Class logits for every node of `dataset`'s graph (features gathered from host memory)."""
  graph = GraphArrays.from_graph(dataset.graph) if graph is None else graph
  if dataset.features is None:
    return _logits(model, graph, None)
  with HostTable(dataset.features) as table:
    logits = _logits(
      model, graph, host_gather(table, jnp.arange(dataset.graph.num_nodes, dtype=jnp.int32))
    )
    return jax.block_until_ready(logits)


def evaluate(
  model: EntityClassifier, dataset: EntityDataset, graph: GraphArrays | None = None
) -> dict:
  """{"test_accuracy": ...} of `model` on `dataset`'s test nodes."""
  logits = predict(model, dataset, graph)
  test_idx, test_y = jnp.asarray(dataset.test_idx), jnp.asarray(dataset.test_y)
  return {"test_accuracy": float(accuracy(logits[test_idx], test_y))}


#: The entries of a data description (`load_dataset`), by source.
DATA_ENTRIES = {
  "rdf": {"source": str, "path": str},
  "synthetic": {"source": str, "nodes": int, "edges": int, "relations": int, "seed": int},
}


def load_dataset(data: dict) -> tuple[EntityDataset, dict]:
  """The dataset a data description names, and its paper setup (bases, L2): an RDF archive
  ({"source": "rdf", "path": ...}) or the synthetic graph ({"source": "synthetic", "nodes",
  "edges", "relations", "seed"}), with inverse relations as the RDF graphs have them."""

  if data["source"] == "rdf":
    dataset = load_entities(data["path"])
    return dataset, PAPER_SETUP.get(dataset.name.lower(), {})
  if data["source"] != "synthetic":
    raise ValueError(f"rgcn: unknown data source {data['source']!r}")
  ds = synthetic_entities(
    num_nodes=data["nodes"],
    num_edges=data["edges"],
    num_relations=data["relations"],
    seed=data["seed"],
  )
  g = ds.graph  # messages flow both ways, as on the RDF graphs: add inverse relations
  dataset = dataclasses.replace(
    ds,
    graph=HeteroGraph.from_edges(
      g.src,
      g.dst,
      g.etype,
      num_nodes=g.num_nodes,
      relation_names=g.relation_names,
      add_inverse=True,
    ),
  )
  return dataset, SYNTHETIC_SETUP


def restore(path: str, meta: dict):
  """Rebuilds a saved RGCN and its data (`jaxdata.tasks.checkpoint.load_model`)."""
  config = checkpoint.config_from(TrainConfig, meta["config"])
  dataset, _ = load_dataset(
    checkpoint.check_entries(
      meta["data"],
      DATA_ENTRIES.get(meta["data"].get("source"), DATA_ENTRIES["synthetic"]),
      "an RGCN checkpoint",
    )
  )
  model = build_model(dataset, config, nnx.Rngs(config.seed))
  optimizer = nnx.Optimizer(model, optax.adam(config.learning_rate), wrt=nnx.Param)
  has_optimizer = checkpoint.restore_nnx(path, meta, model, optimizer)
  return checkpoint.Loaded(
    "rgcn",
    model,
    meta,
    evaluate=lambda: evaluate(model, dataset),
    predict=lambda: predict(model, dataset),
    optimizer_state=optimizer if has_optimizer else None,
  )
