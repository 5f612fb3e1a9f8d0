"""Node classification with mini-batch GraphSAGE on a graph in host memory, the task of
`jaxdata train sage` (`jaxdata.train.sage`): its configuration, data (a synthetic power-law graph
from its description), the model and its loss, the three feeds of sampled batches (the loader's
"host" and "device" pipelines, and the CPU-centric one), the sampled evaluation over a mesh, and
`restore`."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdata import placement
from jaxdata.data.powerlaw import powerlaw_graph
from jaxdata.host import HostGraph, HostTable, sample_neighbors, sparse
from jaxdata.loader import Loader
from jaxdata.nn import GraphSAGE
from jaxdata.placement import device_mesh, sharded_jit
from jaxdata.tasks import checkpoint, prefetched, seed_batches

PIPELINES = ("host", "device", "cpu")


@dataclasses.dataclass(frozen=True)
class SageConfig:
  """What `train` does. `batch_size` is per device; `max_batches` cuts epochs short (benchmarks)."""

  pipeline: str = "host"
  fanouts: tuple[int, ...] = (15, 10)
  batch_size: int = 1024
  hidden: int = 256
  learning_rate: float = 3e-3
  epochs: int = 5
  seed: int = 0
  dtype: str = "float32"
  devices: int | None = 1  # per process; None: every local device of the platform
  platform: str | None = None  # "gpu", "cpu", ...; None: JAX's default backend
  max_batches: int | None = None
  eval_batches: int | None = None  # cap on evaluation batches (None: all)
  cache: float = 0.0  # "host": keep this fraction of the feature rows (most sampled) on device
  evaluate: bool = True  # validation accuracy after every epoch and test accuracy at the end
  embed_dim: int = 0  # learnable node embeddings this wide, concatenated to the features (0: none)
  table_optimizer: str = "adam"  # the sparse optimizer of the embeddings (jaxdata.host.sparse)

  def __post_init__(self):
    if self.pipeline not in PIPELINES:
      raise ValueError(f"SageConfig: pipeline must be one of {PIPELINES}, got {self.pipeline!r}")
    if not self.fanouts or any(int(f) < 1 for f in self.fanouts):
      raise ValueError(f"SageConfig: fanouts must be positive, got {self.fanouts}")
    if self.batch_size < 1 or self.epochs < 0 or self.hidden < 1:
      raise ValueError("SageConfig: batch_size and hidden must be >= 1, epochs >= 0")
    if not 0 <= self.cache <= 1:
      raise ValueError(f"SageConfig: cache must be a fraction in [0, 1], got {self.cache}")
    if self.dtype not in ("float32", "bfloat16"):
      raise ValueError(f"SageConfig: dtype must be float32 or bfloat16, got {self.dtype!r}")
    if self.embed_dim < 0:
      raise ValueError(f"SageConfig: embed_dim must be >= 0, got {self.embed_dim}")
    if self.table_optimizer not in sparse.BY_NAME:
      raise ValueError(
        f"SageConfig: table_optimizer must be one of {tuple(sparse.BY_NAME)}, "
        f"got {self.table_optimizer!r}"
      )
    if self.embed_dim and self.pipeline == "cpu":
      raise ValueError(
        "SageConfig: embed_dim needs pipeline host or device (the cpu pipeline "
        "gathers before the step, so its rows could not learn)"
      )


def loss(model: GraphSAGE, feats, masks, labels, valid, embedded=None) -> tuple:
  """Summed cross-entropy and correct count over the `valid` seeds; `embedded`: per hop, the
  nodes' embedding rows, concatenated to their features."""
  if embedded is not None:
    feats = tuple(jnp.concatenate([f, e.astype(f.dtype)], -1) for f, e in zip(feats, embedded))
  logits = model(feats, masks).astype(jnp.float32)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  correct = (jnp.argmax(logits, -1) == labels) & valid
  return jnp.sum(jnp.where(valid, ce, 0.0)), correct.sum()


def loader_of(graph: HostGraph, labels: np.ndarray, config: SageConfig) -> Loader:
  """The tree-sampling loader of the "host" and "device" pipelines."""
  return Loader(
    graph,
    fanouts=config.fanouts,
    features=graph.features,
    labels=labels,
    pipeline=config.pipeline,
    cache=config.cache,
    tree=True,
  )


def mesh_of(config: SageConfig) -> Mesh:
  """The 1-D "data" mesh: `config.devices` devices (None: all) of the platform in each process,
  process by process, so that with several processes it spans every process's devices."""
  return device_mesh(config.devices, config.platform, what="SageConfig")


def build_model(config: SageConfig, in_features: int, num_classes: int) -> GraphSAGE:
  """The GraphSAGE of `config` over `in_features` feature columns (and its embedding's)."""
  return GraphSAGE(
    in_features + config.embed_dim,
    config.hidden,
    num_classes,
    num_layers=len(config.fanouts),
    dtype=jnp.bfloat16 if config.dtype == "bfloat16" else jnp.float32,
    rngs=nnx.Rngs(config.seed),
  )


def sample_batch(loader: Loader, table, rows, i, key):
  """Inside `sharded_jit`: batch `i` of seed `rows` on this device (its share, sampled with
  ``fold_in(fold_in(key, i), device)``), and its blocks' embedding rows from `table` (None
  without one)."""
  seeds = jax.lax.dynamic_index_in_dim(rows, i, keepdims=False)
  key = jax.random.fold_in(jax.random.fold_in(key, i), jax.lax.axis_index("data"))
  batch = loader.sample(seeds, key)
  with jax.named_scope("gathers"):
    embedded = None if table is None else batch.blocks.gather(table, unique=True)
  return batch, embedded


def evaluation(graphdef, mesh: Mesh, pipeline: str, table=None):
  """The program that counts one batch's correct seeds over `mesh`: for the loader's pipelines
  ``(params, loader, rows, i, key) -> (i + 1, (correct, count))``, for "cpu" ``(params, feats,
  masks, labels) -> (correct, count)`` (a `CpuBatches` batch)."""
  if pipeline != "cpu":

    def device_eval(params, loader, rows, i, key):
      batch, embedded = sample_batch(loader, table, rows, i, key)
      model = nnx.merge(graphdef, params)
      _, correct = loss(model, batch.inputs, batch.blocks.masks, batch.labels, batch.mask, embedded)
      return i + 1, jax.lax.psum((correct, batch.mask.sum()), "data")

    return sharded_jit(device_eval, mesh, (P(), P(), P(None, "data"), P(), P()), (P(), (P(), P())))

  def cpu_eval(params, feats, masks, labels):
    _, correct = loss(nnx.merge(graphdef, params), feats, masks, labels, masks[0])
    return jax.lax.psum((correct, masks[0].sum()), "data")

  data = P("data")
  return sharded_jit(cpu_eval, mesh, (P(), data, data, data), (P(), P()))


def sampled_accuracy(program, params, feed, rows: np.ndarray, key, mesh: Mesh) -> float:
  """The accuracy of `evaluation`'s `program` over the seed `rows` (int32 [batches, global
  batch]; -1 pads), batch i sampled from ``fold_in(key, i)``: `feed` is the loader placed on
  `mesh` (replicated), or a `CpuBatches`."""
  sums = []
  if isinstance(feed, CpuBatches):
    sums = [program(params, *inputs) for inputs in feed.stream(rows, key)]
  else:
    replicated = NamedSharding(mesh, P())
    device_rows = placement.put(rows, NamedSharding(mesh, P(None, "data")))
    i, key = placement.put((np.int32(0), key), replicated)
    for _ in range(len(rows)):
      i, counts = program(params, feed, device_rows, i, key)
      sums.append(counts)
  correct, count = (float(sum(np.asarray(s[k]) for s in sums)) for k in range(2))
  return correct / max(count, 1)


def run_keys(config: SageConfig):
  """A run's (training, validation, test) keys: epoch e's batches sample from ``fold_in(key,
  e)`` (training and validation), the test batches from the test key."""
  return jax.random.split(jax.random.key(config.seed), 3)


#: The entries of a data description (`load_dataset`).
DATA_ENTRIES = {
  "source": str,
  "nodes": int,
  "edges": int,
  "features": int,
  "classes": int,
  "seed": int,
}


def load_dataset(data: dict, features_out: np.ndarray | None = None):
  """The synthetic power-law graph a data description names ({"nodes", "edges", "features",
  "classes", "seed"}); features written into `features_out` where given (a HostTable's memory)."""

  return powerlaw_graph(
    num_nodes=data["nodes"],
    num_edges=data["edges"],
    feature_dim=data["features"],
    num_classes=data["classes"],
    seed=data["seed"],
    features_out=features_out,
  )


#: The checkpoint's key, beside the model's parameters, of a learned embedding table.
EMBEDDING = "host_embedding"


def restore(path: str, meta: dict):
  """Rebuilds a saved GraphSAGE and its graph (`jaxdata.tasks.checkpoint.load_model`).
  `evaluate()` samples the test seeds' neighbourhoods with the run's own keys over a mesh of as
  many devices as training had (whatever the processes were: a run of 2 processes x 2 devices
  is measured again by one process of 4), so it measures the test accuracy training measured;
  ValueError where this process has fewer devices than that."""
  saved = dict(meta["config"])
  saved.pop("unique", None)  # checkpoints from before the loader (feature rows always read once)
  processes, per_process = checkpoint.json_value(
    saved.pop("mesh", None) or [1, saved.get("devices") or 1],
    tuple[int, ...],
    "the configuration's 'mesh'",
  )
  config = checkpoint.config_from(SageConfig, saved)
  dataset = load_dataset(
    checkpoint.check_entries(meta["data"], DATA_ENTRIES, "a GraphSAGE checkpoint")
  )
  model = build_model(config, dataset.features.shape[1], dataset.num_classes)
  params = nnx.state(model, nnx.Param)
  target = {"params": nnx.to_pure_dict(params)}
  if config.embed_dim:
    target["params"][EMBEDDING] = np.zeros((dataset.num_nodes, config.embed_dim), np.float32)
  if meta.get("has_optimizer"):
    target["optimizer"] = optax.adam(config.learning_rate).init(params)
  state = checkpoint.restore_state(path, target, meta.get("digests"))
  embedding = state["params"].pop(EMBEDDING, None)
  nnx.replace_by_pure_dict(params, state["params"])
  nnx.update(model, params)

  def evaluate() -> dict:
    total, visible = processes * per_process, len(jax.local_devices(backend=config.platform))
    if total > visible:
      raise ValueError(
        f"load_model: {path}: this GraphSAGE was trained and measured on a mesh of {total} "
        f"devices ({processes} process(es) x {per_process}); its sampled evaluation splits "
        f"each batch over that many devices, but this process sees {visible} (on the CPU: "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={total})"
      )
    if not config.evaluate or not len(dataset.test_nodes):
      return {"test_accuracy": float("nan")}
    mesh = mesh_of(dataclasses.replace(config, devices=total))
    rows = seed_batches(dataset.test_nodes, config.batch_size * total, None, config.eval_batches)
    labels = np.asarray(dataset.labels).astype(np.int32)
    graphdef, params = nnx.split(model, nnx.Param)
    params = placement.put(params, NamedSharding(mesh, P()))
    with contextlib.ExitStack() as stack:
      graph = stack.enter_context(
        HostGraph(dataset.indptr, dataset.indices, features=dataset.features)
      )
      table = None
      if embedding is not None:
        table = stack.enter_context(HostTable(np.asarray(embedding, np.float32)))
      if config.pipeline == "cpu":
        feed = CpuBatches(graph, labels, config.fanouts, mesh)
      else:
        loader = loader_of(graph, labels, config)
        stack.callback(loader.close)
        feed = placement.put(loader, NamedSharding(mesh, P()))
      program = evaluation(graphdef, mesh, config.pipeline, table)
      test = sampled_accuracy(program, params, feed, rows, run_keys(config)[2], mesh)
    return {"test_accuracy": test}

  def predict(nodes=None, *, key=None, batch_size: int = 1024) -> np.ndarray:
    """Predicted classes of `nodes` (default: every node), each node's neighbourhood sampled
    with the run's fanouts (without replacement: a node of degree <= fanout keeps all of its
    neighbours) from `key` (default: the run's seed), on the CPU, `batch_size` seeds at a time."""
    n = dataset.num_nodes
    nodes = np.arange(n) if nodes is None else np.asarray(nodes)
    if nodes.ndim != 1 or nodes.dtype.kind not in "iu":
      raise TypeError(
        f"predict: nodes must be a 1-D array of integer node ids, got "
        f"{nodes.dtype} of shape {nodes.shape}"
      )
    if nodes.size and (nodes.min() < 0 or nodes.max() >= n):
      raise ValueError(f"predict: node ids must be in [0, {n}), got {nodes.min()}..{nodes.max()}")
    if batch_size < 1:
      raise ValueError(f"predict: batch_size must be >= 1, got {batch_size}")
    features = np.asarray(dataset.features)
    if embedding is not None:
      features = np.concatenate([features, embedding.astype(features.dtype)], axis=1)
    cpu = jax.devices("cpu")[0]
    graphdef, state = nnx.split(model)
    key = jax.random.key(config.seed) if key is None else key
    out = np.empty(len(nodes), np.int32)
    with (
      jax.default_device(cpu),
      HostGraph(dataset.indptr, dataset.indices, features=features) as graph,
    ):

      @jax.jit
      def batch(state, seeds, key):
        blocks = sample_neighbors(graph, seeds, config.fanouts, key)
        logits = nnx.merge(graphdef, state)(blocks.gather(graph.features), blocks.masks)
        return jnp.argmax(logits, -1)

      state = jax.device_put(state, cpu)
      for i, start in enumerate(range(0, len(nodes), batch_size)):
        part = nodes[start : start + batch_size]
        seeds = np.full(batch_size, -1, np.int32)
        seeds[: len(part)] = part
        out[start : start + len(part)] = np.asarray(
          batch(state, seeds, jax.random.fold_in(key, i))
        )[: len(part)]
    return out

  return checkpoint.Loaded(
    "sage",
    model,
    meta,
    evaluate=evaluate,
    predict=predict,
    optimizer_state=state.get("optimizer"),
    tables=None if embedding is None else {"embedding": embedding},
  )


class CpuBatches:
  """The CPU-centric feed: sample and gather on the CPU, device_put, two batches ahead."""

  def __init__(self, graph: HostGraph, labels: np.ndarray, fanouts, mesh: Mesh, depth: int = 2):
    self.cpu = jax.devices("cpu")[0]
    self.graph, self.labels, self.fanouts, self.depth = graph, labels, fanouts, depth
    self.sharding = NamedSharding(mesh, P("data"))

    def prepare(seeds, key):
      blocks = sample_neighbors(graph, seeds, fanouts, key)
      return blocks.gather(graph.features), blocks.masks

    self.prepare = jax.jit(prepare)

  def one(self, seeds: np.ndarray, key) -> tuple:
    ndev = self.sharding.mesh.devices.size
    parts = np.split(seeds, ndev)  # each device's share samples with its own key, like "host"
    feats, masks = [], []
    for d, part in enumerate(parts):
      f, m = self.prepare(
        jax.device_put(part, self.cpu), jax.device_put(jax.random.fold_in(key, d), self.cpu)
      )
      feats.append(f)
      masks.append(m)
    # Per hop, concatenate the devices' shares on the host, then one transfer per array.
    feats = tuple(np.concatenate([np.asarray(f[h]) for f in feats]) for h in range(len(feats[0])))
    masks = tuple(np.concatenate([np.asarray(m[h]) for m in masks]) for h in range(len(masks[0])))
    labels = self.labels[np.maximum(seeds, 0)]
    return jax.device_put((feats, masks, labels), self.sharding)

  def stream(self, rows: np.ndarray, epoch_key, start: int = 0) -> Iterator[tuple]:
    """Batches `rows[start:]`, batch i's key ``fold_in(epoch_key, i)``."""
    cpu_key = jax.device_put(epoch_key, self.cpu)
    batches = enumerate(rows[start:], start)
    return prefetched((self.one(s, jax.random.fold_in(cpu_key, i)) for i, s in batches), self.depth)
