"""Link prediction on a knowledge graph: an RGCN encoder and a DistMult decoder, the RGCN paper's
second task (Schlichtkrull et al., 2018, sec. 5), trained by `jaxdata train rgcn --task link`
(`jaxdata.train.link`): the data, the model, the filtered ranking and `restore`.

The data are triples (head, relation, tail) split into train, valid and test (`read_triples`
reads FB15k-237's layout: train.txt, valid.txt, test.txt, one triple of names per line;
`from_graph` splits any knowledge graph's triples, an RDF archive's for one). Every
entity has a learnt embedding; RGCN layers (basis decomposition) run on the graph of the
training triples, their inverses added; DistMult scores a triple as
``sum_k e_h[k] * w_r[k] * e_t[k]``. Each step draws `negatives` corrupted triples per training
triple on the device (head or tail replaced by a uniformly drawn entity) and minimises the
binary cross-entropy of the positives against them, with the paper's L2 penalty on the
decoder's relations.

Evaluation is the paper's protocol: every test triple ranks its true tail against all entities
as tails of (head, relation), and its true head against all entities as heads, with the other
triples known true (in train, valid or test) removed from the candidates ("filtered"); MRR is
the mean reciprocal rank over both directions, Hits@k the share of ranks <= k. The paper's
FB15k-237 figures (R-GCN, filtered): MRR 0.248, Hits@1 0.153, Hits@3 0.258, Hits@10 0.414.

    from jaxdata.tasks.link import LinkConfig, synthetic_kg
    from jaxdata.train.link import train
    result = train(synthetic_kg(), LinkConfig(epochs=100))
    result.metrics["test_mrr"]
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxdata.data import load_entities
from jaxdata.data.graph import HeteroGraph
from jaxdata.hector import GraphArrays
from jaxdata.nn import RGCN
from jaxdata.tasks import checkpoint

#: The files of a split, FB15k-237's names.
SPLIT_FILES = {"train": "train.txt", "valid": "valid.txt", "test": "test.txt"}


#: The RGCN paper's FB15k-237 results (R-GCN, filtered), for the docs' comparison.
PAPER_FB15K237 = {"mrr": 0.248, "hits@1": 0.153, "hits@3": 0.258, "hits@10": 0.414}


HITS = (1, 3, 10)


@dataclasses.dataclass(frozen=True, eq=False)
class KGDataset:
  """Triples of entity and relation ids, split three ways; the names behind the ids."""

  entities: tuple[str, ...]
  relations: tuple[str, ...]
  train: np.ndarray  # int64 [n, 3]: head, relation, tail
  valid: np.ndarray
  test: np.ndarray
  name: str = "kg"

  @property
  def num_entities(self) -> int:
    return len(self.entities)

  @property
  def num_relations(self) -> int:
    return len(self.relations)

  def __repr__(self) -> str:
    return (
      f"KGDataset({self.name!r}, {self.num_entities} entities, {self.num_relations} relations, "
      f"{len(self.train)}/{len(self.valid)}/{len(self.test)} train/valid/test triples)"
    )


def read_triples(path: str | os.PathLike) -> KGDataset:
  """A folder of train.txt, valid.txt and test.txt: one "head relation tail" per line
  (tab- or space-separated names). Ids in order of first appearance, train first."""
  root = Path(path)
  missing = [f for f in SPLIT_FILES.values() if not (root / f).is_file()]
  if missing:
    raise FileNotFoundError(f"read_triples: {root} lacks {', '.join(missing)}")
  entities: dict[str, int] = {}
  relations: dict[str, int] = {}
  splits = {}
  for split, name in SPLIT_FILES.items():
    rows = []
    with open(root / name, encoding="utf-8") as f:
      for number, line in enumerate(f, 1):
        parts = line.split("\t") if "\t" in line else line.split()
        parts = [p.strip() for p in parts]
        if not any(parts):
          continue
        if len(parts) != 3 or not all(parts):
          raise ValueError(f"read_triples: {root / name}:{number}: expected 'head relation tail'")
        h, r, t = parts
        rows.append(
          (
            entities.setdefault(h, len(entities)),
            relations.setdefault(r, len(relations)),
            entities.setdefault(t, len(entities)),
          )
        )
    splits[split] = np.array(rows, np.int64).reshape(-1, 3)
  return KGDataset(tuple(entities), tuple(relations), name=root.name, **splits)


def from_graph(
  graph: HeteroGraph, *, name: str = "kg", seed: int = 0, held_out: float = 0.1
) -> KGDataset:
  """The triples of a knowledge graph (a `HeteroGraph`, its generated inverses left out), split
  at random: `held_out` of them half valid, half test, keeping only held-out triples whose
  entities and relation occur in train (as FB15k-237's split does)."""
  r = graph.num_relations
  names = graph.relation_names
  half = r // 2
  inverse = r % 2 == 0 and all(n == f"rev_{m}" for m, n in zip(names[:half], names[half:]))
  keep = graph.etype < half if inverse else np.ones(graph.num_edges, bool)
  triples = np.stack([graph.src[keep], graph.etype[keep], graph.dst[keep]], 1).astype(np.int64)
  triples = np.unique(triples, axis=0)
  triples = triples[np.random.default_rng(seed).permutation(len(triples))]
  cut = len(triples) - int(round(held_out * len(triples)))
  train, rest = triples[:cut], triples[cut:]
  seen = np.zeros(graph.num_nodes, bool)
  seen[train[:, 0]] = seen[train[:, 2]] = True
  known_relation = np.zeros(r, bool)
  known_relation[train[:, 1]] = True
  rest = rest[seen[rest[:, 0]] & seen[rest[:, 2]] & known_relation[rest[:, 1]]]
  used = half if inverse else r
  return KGDataset(
    tuple(str(i) for i in range(graph.num_nodes)),
    tuple(names[:used]),
    train,
    rest[: len(rest) // 2],
    rest[len(rest) // 2 :],
    name=name,
  )


def synthetic_kg(
  num_entities: int = 500,
  num_relations: int = 6,
  num_triples: int = 6000,
  clusters: int = 25,
  seed: int = 0,
) -> KGDataset:
  """A knowledge graph with planted relations: entities fall into `clusters` clusters, and
  relation r joins an entity of cluster c to entities of cluster ``sigma_r(c)`` (sigma_r a
  random pairing of the clusters, so the relation is symmetric, as DistMult models). A model
  that learns the clusters ranks a test triple's tail among its cluster's entities; chance
  ranks it among all. Split 80/10/10, the valid and test triples' entities all seen in train."""
  rng = np.random.default_rng(seed)
  cluster = rng.integers(0, clusters, num_entities)
  members = [np.flatnonzero(cluster == c) for c in range(clusters)]
  pairing = []
  for _ in range(num_relations):
    order = rng.permutation(clusters)
    sigma = np.arange(clusters)  # an odd cluster out is paired with itself
    pairs = clusters // 2
    sigma[order[:pairs]], sigma[order[pairs : 2 * pairs]] = order[pairs : 2 * pairs], order[:pairs]
    pairing.append(sigma)
  heads = rng.integers(0, num_entities, num_triples)
  rels = rng.integers(0, num_relations, num_triples)
  tails = np.array(
    [
      rng.choice(members[pairing[r][cluster[h]]] if len(members[pairing[r][cluster[h]]]) else [h])
      for h, r in zip(heads, rels)
    ]
  )
  triples = np.unique(np.stack([heads, rels, tails], 1), axis=0)
  triples = triples[rng.permutation(len(triples))]
  n = len(triples)
  train, rest = triples[: int(0.8 * n)], triples[int(0.8 * n) :]
  seen = np.zeros(num_entities, bool)
  seen[train[:, 0]] = seen[train[:, 2]] = True
  rest = rest[seen[rest[:, 0]] & seen[rest[:, 2]]]
  half = len(rest) // 2
  return KGDataset(
    tuple(f"e{i}" for i in range(num_entities)),
    tuple(f"r{i}" for i in range(num_relations)),
    train,
    rest[:half],
    rest[half:],
    name="synthetic-kg",
  )


@dataclasses.dataclass(frozen=True)
class LinkConfig:
  """What `train` does (defaults: the paper's FB15k-237 setup where it fits: 2 layers, Adam
  0.01, L2 0.01 on the decoder, one negative per positive; bases instead of its block-diagonal
  decomposition)."""

  hidden: int = 200
  layers: int = 2  # RGCN layers (0: DistMult on the embeddings alone, the paper's baseline)
  num_bases: int = 4
  learning_rate: float = 0.01
  l2: float = 0.01
  negatives: int = 1
  batch_size: int = 30_000  # training triples per step (all when fewer)
  epochs: int = 200  # steps
  eval_every: int = 0  # validation MRR every this many steps (0: at the end only)
  dropout: float = 0.2
  seed: int = 0

  def __post_init__(self):
    if self.layers < 0:
      raise ValueError(f"LinkConfig: layers must be >= 0 (0: DistMult alone), got {self.layers}")
    for name in ("hidden", "num_bases", "negatives", "batch_size"):
      if getattr(self, name) < 1:
        raise ValueError(f"LinkConfig: {name} must be >= 1, got {getattr(self, name)}")
    if self.epochs < 0 or self.eval_every < 0 or not 0 <= self.dropout < 1:
      raise ValueError("LinkConfig: epochs, eval_every >= 0 and dropout in [0, 1)")


class LinkModel(nnx.Module):
  """Entity embeddings, RGCN layers on the training graph, and DistMult relation vectors."""

  def __init__(self, num_entities: int, num_relations: int, config: LinkConfig, rngs: nnx.Rngs):
    d = config.hidden
    self.embed = nnx.Embed(num_entities, d, rngs=rngs)
    self.convs = nnx.List(
      [
        RGCN(d, d, num_relations=2 * num_relations, num_bases=config.num_bases, rngs=rngs)
        for _ in range(config.layers)
      ]
    )
    self.relation = nnx.Param(jax.random.normal(rngs.params(), (num_relations, d)) / np.sqrt(d))
    self.dropout = nnx.Dropout(config.dropout, rngs=rngs)

  def encode(self, graph: GraphArrays, key: jax.Array | None = None) -> jax.Array:
    """Entity representations; `key` draws the dropout masks (a training step's, so that a
    resumed run draws the same ones; None: the module's own stream)."""
    h = self.embed.embedding[...]
    for i, conv in enumerate(self.convs):
      h = conv(graph, self.dropout(h, rngs=None if key is None else jax.random.fold_in(key, i)))
      if i < len(self.convs) - 1:
        h = jax.nn.relu(h)
    return h

  def score(self, e: jax.Array, triples: jax.Array) -> jax.Array:
    """DistMult scores of int [n, 3] triples under entity representations `e`."""
    w = self.relation[...]
    return jnp.sum(e[triples[:, 0]] * w[triples[:, 1]] * e[triples[:, 2]], axis=-1)


def training_graph(dataset: KGDataset) -> GraphArrays:
  """The graph the encoder runs on: the training triples, each relation's inverse added."""
  t = dataset.train
  g = HeteroGraph.from_edges(
    t[:, 0],
    t[:, 2],
    t[:, 1],
    num_nodes=dataset.num_entities,
    relation_names=dataset.relations,
    add_inverse=True,
  )
  return GraphArrays.from_graph(g)


def known_index(*splits: np.ndarray) -> dict[tuple[int, int, int], np.ndarray]:
  """For filtering: ``(0, head, relation)``: every known tail; ``(1, tail, relation)``: every
  known head, over the given triples."""
  triples = np.concatenate(splits)
  out: dict[tuple[int, int, int], list[int]] = {}
  for h, r, t in triples.tolist():
    out.setdefault((0, h, r), []).append(t)
    out.setdefault((1, t, r), []).append(h)
  return {k: np.unique(v) for k, v in out.items()}


def filtered_ranks(
  scores_of: Callable[[jax.Array, int], jax.Array],
  triples: np.ndarray,
  known: dict[tuple[int, int, int], np.ndarray],
  batch: int = 256,
) -> np.ndarray:
  """Filtered ranks of every triple's tail (direction 0) then head (direction 1): ``scores_of(
  triples, direction)`` gives [n, num_entities] scores of each candidate tail (or head); a
  candidate known true (other than the triple's own) is removed; rank = 1 + the candidates
  scoring strictly higher."""
  ranks = []
  for direction in (0, 1):
    true_col, query_col = (2, 0) if direction == 0 else (0, 2)
    for start in range(0, len(triples), batch):
      part = triples[start : start + batch]
      lists = [known.get((direction, int(q), int(r)), ()) for q, r in part[:, [query_col, 1]]]
      # padded to fixed shapes (rows to `batch`, filters to a power of two): few compilations
      width = 1 << (max([len(x) for x in lists] + [1]) - 1).bit_length()
      filt = np.full((batch, width), -1, np.int64)
      for i, x in enumerate(lists):
        filt[i, : len(x)] = x
      padded = np.zeros((batch, 3), np.int64)
      padded[: len(part)] = part
      got = _ranks(scores_of(jnp.asarray(padded), direction), padded[:, true_col], filt)
      ranks.append(np.asarray(got)[: len(part)])
  return np.concatenate(ranks) if ranks else np.zeros(0, np.int64)


@jax.jit
def _ranks(scores: jax.Array, true: Any, filt: Any) -> jax.Array:
  true, drop = jnp.asarray(true), jnp.asarray(filt)
  rows = jnp.arange(scores.shape[0])
  target = scores[rows, true]
  drop = jnp.where(drop == true[:, None], -1, drop)  # the triple itself stays a candidate
  hits = jnp.zeros(scores.shape, jnp.int32).at[rows[:, None], jnp.maximum(drop, 0)].add(drop >= 0)
  return 1 + jnp.sum(jnp.where(hits > 0, False, scores > target[:, None]), axis=1)


@functools.partial(jax.jit, static_argnums=3)
def _scores(e: jax.Array, w: jax.Array, part: jax.Array, direction: int) -> jax.Array:
  """DistMult scores of every entity as the tail (direction 0) or head (1) of each triple."""
  query = part[:, 0] if direction == 0 else part[:, 2]
  return (e[query] * w[part[:, 1]]) @ e.T


def rank_metrics(ranks: np.ndarray) -> dict[str, float]:
  """MRR and Hits@1/3/10 of filtered ranks."""
  ranks = np.asarray(ranks, np.float64)
  if not ranks.size:
    return {"mrr": float("nan"), **{f"hits@{k}": float("nan") for k in HITS}}
  return {
    "mrr": float(np.mean(1 / ranks)),
    **{f"hits@{k}": float(np.mean(ranks <= k)) for k in HITS},
  }


#: The encoder over the whole graph, one compiled program for every evaluation and prediction.
_encode = nnx.jit(lambda model, graph: model.encode(graph))


def evaluate(
  model: LinkModel, graph: GraphArrays, dataset: KGDataset, split: str = "test", known=None
) -> dict:
  """Filtered MRR and Hits@k of `split`'s triples (against every entity, both directions);
  `known`: `known_index` of all the dataset's triples, if already built."""
  model.eval()
  e = _encode(model, graph)
  w = model.relation[...]
  if known is None:
    known = known_index(dataset.train, dataset.valid, dataset.test)
  triples = getattr(dataset, split)
  out = rank_metrics(filtered_ranks(lambda p, d: _scores(e, w, p, d), triples, known))
  model.train()
  return out


def load_dataset(data: dict) -> KGDataset:
  """The triples a data description names: a folder of triple files, an RDF archive's graph
  split by `from_graph`, or `synthetic_kg`."""
  if data["source"] == "triples":
    return read_triples(data["path"])
  if data["source"] == "rdf":
    name = os.path.basename(data["path"]).split(".")[0]
    return from_graph(load_entities(data["path"]).graph, name=name, seed=data["seed"])
  return synthetic_kg(data["entities"], data["relations"], data["triples"], seed=data["seed"])


def restore(path: str, meta: dict):
  """Rebuilds a saved link-prediction model and its triples (`checkpoint.load_model`);
  `evaluate()` measures the test split's filtered MRR and Hits@k again, `predict(triples)`
  scores (head, relation, tail) triples."""
  config = checkpoint.config_from(LinkConfig, meta["config"])
  dataset = load_dataset(meta["data"])
  model = LinkModel(dataset.num_entities, dataset.num_relations, config, nnx.Rngs(config.seed))
  optimizer = nnx.Optimizer(model, optax.adam(config.learning_rate), wrt=nnx.Param)
  has_optimizer = checkpoint.restore_nnx(path, meta, model, optimizer)
  graph = training_graph(dataset)

  def again() -> dict:
    return {f"test_{k}": v for k, v in evaluate(model, graph, dataset, "test").items()}

  def predict(triples: Any) -> np.ndarray:
    """DistMult scores of int [n, 3] (head, relation, tail) triples."""
    model.eval()
    e = _encode(model, graph)
    return np.asarray(model.score(e, jnp.asarray(np.asarray(triples, np.int32).reshape(-1, 3))))

  return checkpoint.Loaded(
    "rgcn-link",
    model,
    meta,
    evaluate=again,
    predict=predict,
    optimizer_state=optimizer if has_optimizer else None,
  )
