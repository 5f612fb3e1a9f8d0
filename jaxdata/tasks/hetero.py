"""Paper classification on an ogbn-mag-shaped heterograph, the task of `jaxdata train rgat|hgt`
and `train rgcn --scale S` (`jaxdata.train.attention`): the models (`CLASSIFIERS`, `register`),
their configuration, the data (synthetic_mag or a dataset folder, from a data description), how
a model is built and measured, and `restore`. The full-graph, partitioned and mini-batch loops
all read them from here."""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxdata.data import read, synthetic_mag
from jaxdata.data.mag import MagDataset
from jaxdata.hector import GraphArrays
from jaxdata.hector.passes import select as select_passes
from jaxdata.nn.classifiers import Classifier, HGTClassifier, RGATClassifier, RGCNClassifier
from jaxdata.tasks import checkpoint

#: The attention models (`jaxdata train rgat|hgt`).
MODELS = ("rgat", "hgt")
#: The classifier of each model this trainer trains, by `TrainConfig.model`: the attention
#: models, RGCN (`jaxdata train rgcn --scale S`) and those `register` adds.
CLASSIFIERS: dict[str, type[Classifier]] = {
  "rgat": RGATClassifier,
  "hgt": HGTClassifier,
  "rgcn": RGCNClassifier,
}
#: The checkpoint kind of each model (`jaxdata.tasks.checkpoint.KINDS`): "rgcn" is the entity
#: classifier's (`jaxdata.tasks.rgcn`).
KINDS = {"rgat": "rgat", "hgt": "hgt", "rgcn": "rgcn-mag"}
#: `jaxdata train rgat|hgt` runs as one of several processes (`jaxdata.distributed`): full-graph
#: training with the graph partitioned by destinations over every process's devices, and
#: `--minibatch` data parallel over them (`minibatch.sharded_steps`).


def register(name: str, classifier: type[Classifier]) -> None:
  """Makes `classifier` a model of this trainer: `TrainConfig(model=name)` builds it, called as
  `build_model` calls the others (every node type's input width, the number of relations and of
  classes, then the configuration's widths and the tables' settings as keyword arguments), and
  `train`, `evaluate`, `predict` and checkpoints (kind `name`, loaded back by
  `jaxdata.load_model` in a process that registered it) work with it. Full-graph training on one
  device calls `classifier(graph, xs, papers, plan)` for the papers' logits; the partitioned and
  mini-batch paths need the built-in classifiers' `on_partition` and `on_blocks`.

      register("mine", MyClassifier)
      result = jaxdata.train.attention.train(dataset, TrainConfig(model="mine"))
  """
  if name in CLASSIFIERS or name in checkpoint.KINDS:
    raise ValueError(f"register: a model or checkpoint kind {name!r} exists already")
  CLASSIFIERS[name] = classifier
  KINDS[name] = name
  checkpoint.KINDS[name] = "jaxdata.tasks.hetero"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  model: str = "hgt"  # or "rgat", "rgcn"
  epochs: int = 40
  hidden: int = 64
  heads: int = 4
  learning_rate: float = 0.005
  seed: int = 0
  dtype: str = "float32"  # or "bfloat16" (parameters stay float32)
  passes: tuple[str, ...] | None = None  # hector's optimizing passes (None: all)
  embed: tuple[str, ...] = ()  # node types whose input is a learnable embedding, not features
  embed_dim: int = 64  # the width of those embeddings
  devices: int | None = 1  # per process; None: every local device (train.partitioned)
  layers: int = 2  # graph layers (RGAT: all alike; HGT: the first reads every type's width)
  num_bases: int | None = None  # RGCN: shared bases per layer (None: a full weight per relation)

  def __post_init__(self):
    if self.model not in CLASSIFIERS:
      raise ValueError(f"model must be one of {tuple(CLASSIFIERS)}, got {self.model!r}")
    if self.epochs < 1 or self.hidden < 1 or self.heads < 1:
      raise ValueError("epochs, hidden and heads must be >= 1")
    if self.model != "rgcn" and self.hidden % self.heads:
      raise ValueError(f"hidden={self.hidden} must be a multiple of heads={self.heads}")
    if self.dtype not in ("float32", "bfloat16"):
      raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
    select_passes(self.passes)  # validates the names
    if self.embed_dim < 1:
      raise ValueError(f"embed_dim must be >= 1, got {self.embed_dim}")
    if self.devices is not None and self.devices < 1:
      raise ValueError(f"devices must be >= 1 or None (all), got {self.devices}")
    if self.layers < 1:
      raise ValueError(f"layers must be >= 1, got {self.layers}")
    if self.num_bases is not None and (self.model != "rgcn" or self.num_bases < 1):
      raise ValueError(
        f"num_bases is RGCN's and must be >= 1 or None, got {self.num_bases} for {self.model!r}"
      )


def build_model(
  dataset: MagDataset, config: TrainConfig, rngs: nnx.Rngs, *, tables: bool = True
) -> nnx.Module:
  """The classifier `config` names for `dataset`; `tables=False` leaves out the embedding
  tables of `config.embed` (mini-batch training keeps them in host memory) and gives the other
  parameters the values they have with them."""
  target = dataset.target
  if dataset.graph.node_type_names[0] != target or dataset.node_range(target)[0] != 0:
    raise ValueError(
      f"train: the classified type {target!r} must be node type 0 (HeteroData.to_dataset puts "
      "it there)"
    )
  names = dataset.graph.node_type_names
  if len(set(config.embed)) != len(config.embed):
    raise ValueError(f"embed: a node type is named twice in {config.embed}")
  unknown = [t for t in config.embed if t not in names]
  if unknown:
    raise ValueError(
      f"embed: no node type {', '.join(map(repr, unknown))} (the types are {', '.join(names)})"
    )
  embedded = tuple(names.index(t) for t in config.embed)
  if 0 in embedded:
    raise ValueError("embed: papers keep their features (the classifier reads them)")
  widths = tuple(
    config.embed_dim if t in embedded else x.shape[1] for t, x in enumerate(dataset.features)
  )
  return CLASSIFIERS[config.model](
    widths,
    dataset.graph.num_relations,
    dataset.num_classes,
    hidden=config.hidden,
    heads=config.heads,
    layers=config.layers,
    dtype=config.dtype,
    passes=config.passes,
    embed_dim=config.embed_dim,
    num_bases=config.num_bases,
    rngs=rngs,
    rows=tuple(len(x) for x in dataset.features),
    embedded=embedded,
    tables=tables,
  )


def device_features(dataset: MagDataset, model: Classifier) -> list[jax.Array | None]:
  """Every node type's features on the device; None for embedded types (the model has them)."""
  put = jax.device_put  # not jnp.asarray, which stages a second device copy
  return [None if t in model.embedded else put(x) for t, x in enumerate(dataset.features)]


@functools.partial(nnx.jit, static_argnums=3)
def _predict(model, graph, xs, papers):
  return jnp.argmax(model(graph, xs, papers), -1)


def predict(
  model: nnx.Module,
  dataset: MagDataset,
  graph: GraphArrays | None = None,
  xs: Sequence[jax.Array] | None = None,
) -> jax.Array:
  """The predicted class of every paper."""
  graph = GraphArrays.from_graph(dataset.graph) if graph is None else graph
  xs = device_features(dataset, model) if xs is None else xs
  return _predict(model, graph, xs, dataset.node_range(dataset.target)[1])


def evaluate(
  model: nnx.Module,
  dataset: MagDataset,
  graph: GraphArrays | None = None,
  xs: Sequence[jax.Array] | None = None,
) -> dict:
  """{"val_accuracy", "test_accuracy"} of `model` on `dataset`'s papers (NaN for an empty split)."""
  predicted = np.asarray(predict(model, dataset, graph, xs))

  def accuracy(papers) -> float:
    idx = np.asarray(papers)
    return float(np.mean(predicted[idx] == dataset.labels[idx])) if len(idx) else float("nan")

  return {
    "val_accuracy": accuracy(dataset.val_papers),
    "test_accuracy": accuracy(dataset.test_papers),
  }


#: The entries of a data description (`load_dataset`): synthetic_mag's, or a dataset folder's.
DATA_ENTRIES = {"scale": float, "seed": int, "classes": int}


FOLDER_ENTRIES = {"path": str, "target": str}


def load_dataset(data: dict) -> MagDataset:
  """The dataset a data description names: synthetic_mag ({"scale", "seed", "classes"}) or a
  dataset folder (`jaxdata.data.read`) classifying one node type ({"path", "target"})."""
  if "path" in data:
    return folder_dataset(read(data["path"]), data["path"], data["target"])
  return synthetic_mag(scale=data["scale"], seed=data["seed"], num_classes=data["classes"])


def data_entries(data: dict) -> dict:
  """The entries `data` (a checkpoint's data description) must have."""
  return FOLDER_ENTRIES if isinstance(data, dict) and "path" in data else DATA_ENTRIES


class TargetError(ValueError):
  """A dataset folder has labels for several node types (or none), and no target was named."""


def folder_dataset(hetero, path: str, target: str | None) -> MagDataset:
  """The trainers' dataset of a dataset folder's `HeteroData`, classifying `target` (None: the
  one node type with labels; TargetError where there is not exactly one)."""
  if target is None:
    labelled = list(hetero.y_dict)
    if len(labelled) != 1:
      raise TargetError(f"{path} has labels for node types {labelled}; name the one to classify")
    target = labelled[0]
  return hetero.to_dataset(target, name=os.path.basename(os.path.normpath(path)))


def restore(path: str, meta: dict):
  """Rebuilds a saved RGAT / HGT / RGCN classifier and its data (`checkpoint.load_model`)."""
  config = checkpoint.config_from(TrainConfig, meta["config"], newer=("embed",))
  if KINDS.get(config.model) != meta["kind"]:
    raise ValueError(
      f"load_model: {path}: a checkpoint of kind {meta['kind']!r} holding a "
      f"{config.model!r} model (its configuration's model)"
    )
  dataset = load_dataset(
    checkpoint.check_entries(meta["data"], data_entries(meta["data"]), "a heterograph checkpoint")
  )
  model = build_model(dataset, config, nnx.Rngs(config.seed))
  optimizer = nnx.Optimizer(model, optax.adam(config.learning_rate), wrt=nnx.Param)
  has_optimizer = checkpoint.restore_nnx(path, meta, model, optimizer)
  return checkpoint.Loaded(
    meta["kind"],
    model,
    meta,
    evaluate=lambda: evaluate(model, dataset),
    predict=lambda: predict(model, dataset),
    optimizer_state=optimizer if has_optimizer else None,
  )
