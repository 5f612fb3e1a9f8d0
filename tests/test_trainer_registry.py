"""A model of one's own, registered with a trainer, trains, measures, saves and loads through
the trainer's machinery (`jaxdata.train.attention.register`)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdata
from jaxdata.hector import GraphArrays
from jaxdata.nn import Classifier
from jaxdata.tasks import checkpoint
from jaxdata.train import attention


class MeanByRelation(Classifier):
  """Per-type linear maps to `hidden`; each node adds the mean of its in-neighbours' states,
  each mapped by its edge's relation; ReLU; a linear classifier."""

  def __init__(self, widths, num_relations, num_classes, *, hidden, rngs, rows, embedded,
               embed_dim, tables=True, **_):  # fmt: skip
    self._init_tables(rows, embedded, embed_dim, rngs, tables)
    self.embed = nnx.List([nnx.Linear(w, hidden, rngs=rngs) for w in widths])
    scale = hidden**-0.5
    self.relation = nnx.Param(
      scale * jax.random.normal(rngs.params(), (num_relations, hidden, hidden))
    )
    self.classify = nnx.Linear(hidden, num_classes, rngs=rngs)

  def __call__(self, graph, xs, papers, plan=None):
    h = jnp.concatenate([lin(x) for lin, x in zip(self.embed, self.inputs(xs))])
    by_relation = jnp.einsum("nh,rhk->rnk", h, self.relation[...])
    n = h.shape[0]
    total = jax.ops.segment_sum(by_relation[graph.etype, graph.src], graph.dst, num_segments=n)
    count = jax.ops.segment_sum(jnp.ones_like(graph.dst, h.dtype), graph.dst, num_segments=n)
    return self.classify(jax.nn.relu(h + total / jnp.maximum(count, 1)[:, None])[:papers])


@pytest.fixture
def registered():
  """`MeanByRelation` registered with the heterograph trainer, for one test."""
  attention.register("mean-by-relation", MeanByRelation)
  yield "mean-by-relation"
  for names in (attention.CLASSIFIERS, attention.KINDS, checkpoint.KINDS):
    del names["mean-by-relation"]


def test_a_registered_model_trains_measures_saves_and_loads(registered, tmp_path):
  """The trainer's loop gives the losses of a hand-written Adam loop over the same model, its
  accuracies are those of the model's own logits, and the checkpoint loads back to the same
  predictions."""
  data = {"scale": 0.001, "seed": 0, "classes": 4}
  dataset = attention.load_dataset(data)
  config = attention.TrainConfig(model=registered, epochs=12, hidden=16, learning_rate=0.02)
  result = attention.train(dataset, config)

  # The reference: the same model and optimizer, stepped by hand.
  model = attention.build_model(dataset, config, nnx.Rngs(config.seed))
  graph = GraphArrays.from_graph(dataset.graph)
  xs = attention.device_features(dataset, model)
  papers = dataset.node_range(dataset.target)[1]
  train_idx = np.asarray(dataset.train_papers)
  params = nnx.state(model, nnx.Param)
  graphdef = nnx.graphdef(model)
  tx = optax.adam(config.learning_rate)
  opt = tx.init(params)

  def loss_fn(params):
    logits = nnx.merge(graphdef, params)(graph, xs, papers)[train_idx]
    labels = dataset.labels[train_idx]
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  losses = []
  for _ in range(config.epochs):
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt = tx.update(grads, opt, params)
    params = optax.apply_updates(params, updates)
    losses.append(float(loss))
  np.testing.assert_allclose([r["loss"] for r in result.history], losses, rtol=1e-4)
  assert losses[-1] < 0.5 * losses[0]

  logits = np.asarray(result.model(graph, xs, papers))
  for split in ("val", "test"):
    idx = np.asarray(getattr(dataset, f"{split}_papers"))
    want = np.mean(logits[idx].argmax(-1) == dataset.labels[idx])
    assert result.metrics[f"{split}_accuracy"] == want
  assert result.metrics["test_accuracy"] > 0.5  # 4 classes

  attention.save(str(tmp_path / "run"), result, config, data)
  loaded = jaxdata.load_model(tmp_path / "run")
  assert loaded.kind == registered and loaded.evaluate() == result.metrics
  np.testing.assert_array_equal(np.asarray(loaded.predict()), logits.argmax(-1))
  with pytest.raises(ValueError, match="'hgt' exists already"):
    attention.register("hgt", MeanByRelation)
