"""Node classifiers on typed graphs: per-type inputs, a stack of RGAT, RGCN or HGT layers, a
linear classifier on the first node type (ogbn-mag's papers).

Each runs on a whole graph (`__call__`), on a destination part of it (`on_partition`, data
parallel full-graph training) and on the blocks of a sampled mini-batch (`on_blocks`, a
`jaxdata.loader.Batch`'s blocks, inputs and types), with the same parameters; an offload plan
(one `jaxdata.offload.Policy` per planned layer) changes memory and time, not the numbers.
Featureless node types read learnable embeddings (`embedded`), kept in the model or, for
mini-batch training, in host tables (`tables=False`, `set_tables`).

    model = HGTClassifier([128, 64], num_relations=4, num_classes=8, hidden=64,
                          rngs=nnx.Rngs(0))
    logits = model.on_blocks(batch.blocks, batch.inputs, batch.types)[: len(batch.seeds)]
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxdata.hector import GraphArrays
from jaxdata.nn import layer_stack
from jaxdata.nn.hgt import HGT
from jaxdata.nn.hgt import NAMES as HGT_NAMES
from jaxdata.nn.rgat import NAMES as RGAT_NAMES
from jaxdata.nn.rgat import RGAT
from jaxdata.nn.rgcn import RGCN
from jaxdata.nn.typed import typed_linear


class Classifier(nnx.Module):
  """What the classifiers share: learnable embeddings in place of some types' features. A
  classifier of one's own (`jaxdata.train.attention.register`) subclasses it, calls
  `_init_tables` in its constructor and reads its inputs through `inputs(xs)`.

  ogbn-mag gives features to papers only; its authors, institutions and fields of study are
  featureless, and models learn an embedding per node (`embedded` types). Type t's embedding
  is ``tables[embedded.index(t)].embedding``, ``[N_t, embed_dim]``: a dense parameter in
  full-graph training; mini-batch training keeps it in a host table and trains it sparsely
  (the model is then built without tables, `build_model(..., tables=False)`, and gets them back
  as host arrays at the end, `set_tables`).
  """

  # the graph layers, set by `_init_convs` as conv1, conv2, ... (`convs`): declared for the
  # code that names the first two
  conv1: Any
  conv2: Any

  def _init_tables(
    self,
    rows: Sequence[int],
    embedded: Sequence[int],
    dim: int,
    rngs: nnx.Rngs,
    tables: bool = True,
  ):
    self.embedded = tuple(embedded)
    if tables:
      self.tables = nnx.List([nnx.Embed(rows[t], dim, rngs=rngs) for t in self.embedded])
    else:  # draw the tables' keys all the same: the other parameters are those of a full model
      for _ in self.embedded:
        rngs.params()
      self.tables = nnx.List([])

  def set_tables(self, arrays: Sequence[Any]):
    """Gives the model its embedding tables, one [N_t, embed_dim] array per embedded type (in
    `embedded` order), kept as they are: NumPy arrays stay in host memory until a full-graph
    call moves them."""
    if len(arrays) != len(self.embedded):
      raise ValueError(f"set_tables: {len(arrays)} arrays for {len(self.embedded)} embedded types")
    self.tables = nnx.List(
      [nnx.Embed(*np.shape(x), embedding_init=lambda *_, x=x: x, rngs=nnx.Rngs(0)) for x in arrays]
    )

  def inputs(self, xs: Sequence[jax.Array | None]) -> list[jax.Array]:
    """`xs` with each embedded type's features (None or anything) replaced by its embedding."""
    out = list(xs)
    for table, t in zip(self.tables, self.embedded):
      out[t] = table.embedding[...]
    return out  # type: ignore[return-value]  # every None was an embedded type's

  def _init_convs(self, convs: Sequence[nnx.Module]):
    """The graph layers as ``conv1``, ``conv2``, ... (a two-layer model's names of old)."""
    self.layers = len(convs)
    for i, conv in enumerate(convs, 1):
      setattr(self, f"conv{i}", conv)

  @property
  def convs(self) -> list[nnx.Module]:
    """The graph layers, input to output."""
    return [getattr(self, f"conv{i}") for i in range(1, self.layers + 1)]

  def stack(
    self, graph: GraphArrays, rows: Sequence[int]
  ) -> tuple[list[nnx.Module], layer_stack.LayerFn, jax.ShapeDtypeStruct]:
    """The layers an offload plan covers (`stack_layers` of them, alike), the function of one
    (graph closed over) and its input's shape, on a graph whose node types have `rows` nodes:
    what `layer_stack.plan` measures."""
    raise NotImplementedError

  @property
  def stack_layers(self) -> int:
    """How many layers a plan (`__call__`'s `plan`) has one policy for."""
    raise NotImplementedError

  def block_stack(
    self, blocks, types: jax.Array
  ) -> tuple[list[nnx.Module], list[layer_stack.LayerFn], list[jax.ShapeDtypeStruct]]:
    """On sampled blocks (`on_blocks`, `types` each outermost slot's node type): the layers a
    plan covers (`stack_layers` of them), each one's function (its hop's block closed over;
    it returns the block's destination rows) and each one's input shape, in the order they
    run: what `layer_stack.plan_each` measures and `layer_stack.run_each` runs."""
    raise NotImplementedError

  def _check_blocks(self, blocks):
    if len(blocks.graphs) != self.layers:
      raise ValueError(
        f"{type(self).__name__}.on_blocks: {len(blocks.graphs)} sampled hops for "
        f"{self.layers} layers (give one fanout per layer)"
      )


def is_table(path, value) -> bool:
  """An `nnx` filter: the embedding tables (`Classifier.tables`)."""
  del value
  return bool(path) and path[0] == "tables"


class RGATClassifier(Classifier):
  """Per-type linear maps to `hidden`, RGAT -> ReLU -> RGAT -> ReLU, a linear classifier."""

  def __init__(
    self,
    in_features: Sequence[int],
    num_relations: int,
    num_classes: int,
    *,
    hidden: int = 64,
    heads: int = 4,
    layers: int = 2,
    dtype: str = "float32",
    passes: Sequence[str] | None = None,
    embed_dim: int = 64,
    num_bases: int | None = None,
    rngs: nnx.Rngs,
    rows: Sequence[int] = (),
    embedded: Sequence[int] = (),
    tables: bool = True,
  ):
    self._init_tables(rows, embedded, embed_dim, rngs, tables)
    dt = jnp.dtype(dtype)
    h = hidden
    self.embed = nnx.List([nnx.Linear(d, h, dtype=dt, rngs=rngs) for d in in_features])
    conv = dict(heads=heads, passes=passes, num_bases=num_bases, dtype=dt, rngs=rngs)
    self._init_convs([self._conv(h, num_relations, **conv) for _ in range(layers)])
    self.classify = nnx.Linear(h, num_classes, dtype=dt, rngs=rngs)
    self.hidden, self.dtype = h, dt

  @staticmethod
  def _conv(h: int, num_relations: int, *, heads, passes, num_bases, dtype, rngs) -> nnx.Module:
    """One graph layer, ``[N, h]`` to ``[N, h]`` (RGCNClassifier's are RGCN layers)."""
    del num_bases  # RGCN's
    return RGAT(
      h,
      h // heads,
      num_relations=num_relations,
      heads=heads,
      self_loop=True,
      passes=passes,
      dtype=dtype,
      rngs=rngs,
    )

  def __call__(
    self, graph: GraphArrays, xs: Sequence[jax.Array], papers: int, plan: Sequence | None = None
  ) -> jax.Array:
    """Paper logits. `plan`: None (plain layers) or one `jaxdata.offload.Policy` per layer
    (`stack_layers`): the same logits and gradients, each layer's residuals kept, offloaded
    or recomputed as its policy says."""
    xs = self.inputs(xs)
    graph.check_node_type_rows([x.shape[0] for x in xs], "RGATClassifier")
    x = jnp.concatenate([lin(x) for lin, x in zip(self.embed, xs)])
    layers, layer_fn, _ = self.stack(graph, [x_t.shape[0] for x_t in xs])
    x = layer_stack.run(layers, layer_fn, x, plan)
    return self.classify(x[:papers]).astype(jnp.float32)

  def on_partition(
    self,
    graph: GraphArrays,
    xs: Sequence[jax.Array],
    types: jax.Array,
    start,
    rows: int,
    gather: Callable,
  ) -> jax.Array:
    """The same model on one destination part (`jaxdata.hector.partition`): logits for the
    owned rows ``start:start + rows`` (every owned node, not only papers). `xs[t]` holds type
    t's features on the owned rows (zeros elsewhere), `types` their node types (-1: padding);
    `gather` all-gathers each device's rows (``jax.lax.all_gather(h, axis, tiled=True)``)."""
    x = sum(
      jnp.where((types == t)[:, None], lin(x_t), 0)
      for t, (lin, x_t) in enumerate(zip(self.embed, xs))
    )
    x = jax.nn.relu(self.conv1.on_partition(graph, gather(x), start, rows))
    x = jax.nn.relu(self.conv2.on_partition(graph, gather(x), start, rows))
    return self.classify(x).astype(jnp.float32)

  def stack(self, graph, rows):
    layer_fn = lambda conv, h: jax.nn.relu(conv(graph, h))  # noqa: E731
    return self.convs, layer_fn, jax.ShapeDtypeStruct((sum(rows), self.hidden), self.dtype)

  @property
  def stack_layers(self) -> int:
    return self.layers

  @staticmethod
  def names() -> tuple[str, ...]:
    """The checkpoint names a layer tags (`layer_stack.candidates`)."""
    return RGAT_NAMES

  def on_blocks(
    self, blocks, xs: Sequence[jax.Array], types: jax.Array, plan: Sequence | None = None
  ) -> jax.Array:
    """The same model on sampled blocks (`jaxdata.loader.sample_blocks`): `xs[t]` holds node
    type t's features for the slots of the outermost frontier (zeros elsewhere), `types` each
    slot's node type. Returns logits for the slots of the seeds' frontier. `plan`: None or one
    `jaxdata.offload.Policy` per layer (`stack_layers`), as `__call__` takes it: each layer
    call under its own policy (`layer_stack.run_each`), the same logits and gradients."""
    self._check_blocks(blocks)
    x = typed_linear(self.embed, xs, types, dtype=self.dtype)
    layers, layer_fns, _ = self.block_stack(blocks, types)
    x = layer_stack.run_each(layers, layer_fns, x, plan)
    return self.classify(x).astype(jnp.float32)

  def block_stack(self, blocks, types):
    # layer i runs on hop L - 1 - i (the seeds' hop last) and keeps its destinations' rows
    fns, inputs = [], []
    for i in range(self.layers):
      hop = self.layers - 1 - i
      graph, rows = blocks.graphs[hop], blocks.nodes[hop].shape[0]
      fns.append(lambda conv, h, graph=graph, rows=rows: jax.nn.relu(conv(graph, h))[:rows])
      inputs.append(jax.ShapeDtypeStruct((blocks.nodes[hop + 1].shape[0], self.hidden), self.dtype))
    return self.convs, fns, inputs


class RGCNClassifier(RGATClassifier):
  """`RGATClassifier`'s model with RGCN layers in place of RGAT's: per-type linear maps to
  `hidden`, RGCN -> ReLU -> RGCN -> ReLU, a linear classifier on papers. Its forward passes
  (full graph, sampled blocks, destination partitions, the stack an offload plan covers) are
  RGAT's: both layers map ``[N, hidden]`` to ``[N, hidden]`` on a graph (`jaxdata.nn.RGCN`
  has `on_partition` too).

  Each `jaxdata.nn.RGCN` layer (hector's generated relational kernels) has a full weight per
  relation, or `num_bases` shared bases, a self-loop weight of its own and a bias;
  messages are averaged per relation (the RGCN paper's 1 / |N_r(i)|). ogbn-mag's eight relations
  (with reverses) at hidden 64 make 33K weights per layer: no need for bases by default. A
  featureless type reads a learnable embedding (`embedded`), as with RGAT and HGT.
  """

  @staticmethod
  def _conv(h: int, num_relations: int, *, heads, passes, num_bases, dtype, rngs) -> nnx.Module:
    del heads, passes  # RGAT's
    return RGCN(
      h,
      h,
      num_relations=num_relations,
      num_bases=num_bases,
      self_loop=True,
      use_bias=True,
      dtype=dtype,
      rngs=rngs,
    )

  @staticmethod
  def names() -> tuple[str, ...]:
    """The checkpoint names a layer tags (`layer_stack.candidates`): none (an RGCN layer's
    residuals are hector's own, `SAVED_NAME`)."""
    return ()


class HGTClassifier(Classifier):
  """HGT (every type's own width in) -> HGT (x `layers - 1`) -> a linear classifier on papers.

  The layers after the first are alike (hidden in, hidden out): an offload plan covers them.
  Between them every type's rows travel as one ``[N, hidden]`` array, types in id order."""

  def __init__(
    self,
    in_features: Sequence[int],
    num_relations: int,
    num_classes: int,
    *,
    hidden: int = 64,
    heads: int = 4,
    layers: int = 2,
    dtype: str = "float32",
    passes: Sequence[str] | None = None,
    embed_dim: int = 64,
    num_bases: int | None = None,
    rngs: nnx.Rngs,
    rows: Sequence[int] = (),
    embedded: Sequence[int] = (),
    tables: bool = True,
  ):
    self._init_tables(rows, embedded, embed_dim, rngs, tables)
    dt = jnp.dtype(dtype)

    def conv(widths):
      return HGT(
        widths, hidden, num_relations=num_relations, heads=heads, passes=passes, dtype=dt, rngs=rngs
      )

    self._init_convs(
      [conv(in_features)] + [conv((hidden,) * len(in_features)) for _ in range(layers - 1)]
    )
    self.classify = nnx.Linear(hidden, num_classes, dtype=dt, rngs=rngs)
    self.hidden, self.dtype = hidden, dt

  def __call__(
    self, graph: GraphArrays, xs: Sequence[jax.Array], papers: int, plan: Sequence | None = None
  ) -> jax.Array:
    """Paper logits. `plan`: None (plain layers) or one `jaxdata.offload.Policy` per layer
    after the first (`stack_layers`): the same logits and gradients, each layer's residuals
    kept, offloaded or recomputed as its policy says."""
    del papers  # type 0 is the paper type: its rows are the first output
    hs = self.conv1(graph, self.inputs(xs))
    if self.layers == 1:
      return self.classify(hs[0]).astype(jnp.float32)
    rows = [h.shape[0] for h in hs]
    layers, layer_fn, _ = self.stack(graph, rows)
    h = layer_stack.run(layers, layer_fn, jnp.concatenate(hs), plan)
    return self.classify(h[: rows[0]]).astype(jnp.float32)

  def stack(self, graph, rows):
    bounds = np.cumsum([0, *rows]).tolist()

    def layer_fn(conv, h):
      return jnp.concatenate(conv(graph, [h[a:b] for a, b in zip(bounds[:-1], bounds[1:])]))

    return self.convs[1:], layer_fn, jax.ShapeDtypeStruct((sum(rows), self.hidden), self.dtype)

  @property
  def stack_layers(self) -> int:
    return self.layers - 1

  @staticmethod
  def names() -> tuple[str, ...]:
    """The checkpoint names a layer tags (`layer_stack.candidates`)."""
    return HGT_NAMES

  def on_partition(
    self,
    graph: GraphArrays,
    xs: Sequence[jax.Array],
    types: jax.Array,
    start,
    rows: int,
    gather: Callable,
  ) -> jax.Array:
    """The same model on one destination part, as `RGATClassifier.on_partition`."""
    del rows  # the owned rows are types' rows
    h = self.conv1.on_partition(graph, xs, types, start, gather)
    h = self.conv2.on_partition(graph, h, types, start, gather)
    return self.classify(h).astype(jnp.float32)

  def on_blocks(
    self, blocks, xs: Sequence[jax.Array], types: jax.Array, plan: Sequence | None = None
  ) -> jax.Array:
    """The same model on sampled blocks, as `RGATClassifier.on_blocks` (the seeds are papers;
    `plan`: one policy per layer after the first)."""
    self._check_blocks(blocks)
    top = self.layers - 1  # layer i runs on hop L - 1 - i (the seeds' hop last)
    h = self.conv1.on_slots(blocks.graphs[top], xs, types, rows=blocks.nodes[top].shape[0])
    layers, layer_fns, _ = self.block_stack(blocks, types)
    h = layer_stack.run_each(layers, layer_fns, h, plan)
    return self.classify(h).astype(jnp.float32)

  def block_stack(self, blocks, types):
    fns, inputs = [], []
    for hop in range(self.layers - 2, -1, -1):  # the layers after the first, outermost hop first
      graph, rows = blocks.graphs[hop], blocks.nodes[hop].shape[0]
      slots = blocks.nodes[hop + 1].shape[0]
      fns.append(
        lambda conv, h, graph=graph, rows=rows, slots=slots: conv.on_slots(
          graph, h, types[:slots], rows=rows
        )
      )
      inputs.append(jax.ShapeDtypeStruct((slots, self.hidden), self.dtype))
    return self.convs[1:], fns, inputs


class EntityClassifier(nnx.Module):
  """RGCN -> ReLU -> RGCN on a graph of one node type: class logits for every node, the RGCN
  paper's entity classification model (Schlichtkrull et al., 2018, sec. 4), on the whole graph,
  on sampled blocks (`on_blocks`) or on destination partitions (`on_partition`).

  Args:
    in_features: the nodes' feature width, or None for featureless nodes (the first layer then
      learns a row per node: `num_nodes` is needed).
    num_relations, num_classes: the graph's relations and the logits' width.
    num_nodes: the graph's nodes (featureless input).
    hidden: the first layer's width (the paper's 16).
    num_bases: basis decomposition of the relation weights (None: a full weight per relation).
    self_loop: the layers' self-loop weight (`jaxdata.nn.RGCN`: "separate", "basis", or a bool).
    use_bias: whether the layers have biases.
    dtype: computation dtype (parameters stay float32).

      >>> from flax import nnx
      >>> from jaxdata.nn import EntityClassifier
      >>> model = EntityClassifier(None, 3, 4, num_nodes=10, rngs=nnx.Rngs(0))
      >>> model.conv1.featureless  # a learnable row per node
      True
  """

  def __init__(
    self,
    in_features: int | None,
    num_relations: int,
    num_classes: int,
    *,
    num_nodes: int | None = None,
    hidden: int = 16,
    num_bases: int | None = None,
    self_loop: bool | str = True,
    use_bias: bool = True,
    dtype: str = "float32",
    rngs: nnx.Rngs,
  ):
    layer = functools.partial(
      RGCN,
      num_relations=num_relations,
      num_bases=num_bases,
      dtype=jnp.dtype(dtype),
      self_loop=self_loop,
      use_bias=use_bias,
      rngs=rngs,
    )
    self.conv1 = layer(in_features, hidden, num_nodes=num_nodes)
    self.conv2 = layer(hidden, num_classes)

  def __call__(self, graph: GraphArrays, x: jax.Array | None = None) -> jax.Array:
    h = jax.nn.relu(self.conv1(graph, x))
    return self.conv2(graph, h).astype(jnp.float32)

  def on_partition(
    self, graph: GraphArrays, start, rows: int, gather: Callable, x: jax.Array | None = None
  ) -> jax.Array:
    """The same model on one destination part (`jaxdata.hector.partition`): logits for the
    owned rows ``start:start + rows``. `x` holds every node's features (padded rows, or None
    when featureless); `gather` turns each device's ``[rows, hidden]`` into every node's
    (``jax.lax.all_gather(h, axis, tiled=True)`` inside `shard_map`)."""
    h = jax.nn.relu(self.conv1.on_partition(graph, x, start, rows))
    return self.conv2.on_partition(graph, gather(h), start, rows).astype(jnp.float32)

  def on_blocks(
    self, blocks, xs: Sequence[jax.Array], types: Any = None, plan: Any = None
  ) -> jax.Array:
    """The same model on sampled blocks (`jaxdata.loader.sample_blocks`), called as the
    heterograph classifiers' `on_blocks` are: `xs[0]` holds, for the slots of the outermost
    frontier, their features, or without features their rows of ``conv1.node_rows()``
    (`types` and `plan` are theirs: one node type, no offload plan). Returns logits for the
    slots of the seeds' frontier."""
    del types, plan
    g1, g0 = blocks.graphs[1], blocks.graphs[0]
    x = xs[0]
    h = self.conv1.on_rows(g1, x) if self.conv1.featureless else self.conv1(g1, x)
    h = jax.nn.relu(h)[: blocks.nodes[1].shape[0]]
    return self.conv2(g0, h)[: blocks.nodes[0].shape[0]].astype(jnp.float32)
