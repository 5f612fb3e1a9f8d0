"""RGCN entity classification on AIFB, the RGCN paper's setup (Schlichtkrull et al., 2018).

Two RGCN layers on the whole graph: the first featureless (a node's input is its one-hot id, so
it learns a row per node), the second to the four classes; a weight per relation, a self-loop
weight, no bias, hidden 16, Adam at 0.01 for 50 epochs. The relational sums run as hector's
generated kernels. The paper reports 95.83% test accuracy.

AIFB is the RDF archive the RGCN paper used (aifb.tgz: N-Triples plus the train/test splits;
PyG's `Entities` dataset downloads the same file).

Run: python examples/rgcn_aifb.py PATH/aifb.tgz [--seed 0]
"""

import sys

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxdata.data import load_entities
from jaxdata.hector import GraphArrays
from jaxdata.nn import RGCN

path = sys.argv[1] if len(sys.argv) > 1 else "aifb.tgz"
seed = int(sys.argv[sys.argv.index("--seed") + 1]) if "--seed" in sys.argv else 0

ds = load_entities(path)  # HeteroGraph(num_nodes=8285, num_edges=58086, num_relations=90)
graph = GraphArrays.from_graph(ds.graph)  # the arrays hector's kernels read, on the device
print(ds.graph, f"{ds.num_classes} classes, {len(ds.train_idx)} train, {len(ds.test_idx)} test")


class Model(nnx.Module):
  def __init__(self, num_nodes: int, num_relations: int, num_classes: int, rngs: nnx.Rngs):
    self.conv1 = RGCN(
      None, 16, num_relations=num_relations, num_nodes=num_nodes, use_bias=False, rngs=rngs
    )
    self.conv2 = RGCN(16, num_classes, num_relations=num_relations, use_bias=False, rngs=rngs)

  def __call__(self, graph: GraphArrays) -> jax.Array:
    return self.conv2(graph, jax.nn.relu(self.conv1(graph, None)))


model = Model(ds.graph.num_nodes, ds.graph.num_relations, ds.num_classes, nnx.Rngs(seed))
optimizer = nnx.Optimizer(model, optax.adam(0.01), wrt=nnx.Param)
train_idx, train_y = jnp.asarray(ds.train_idx), jnp.asarray(ds.train_y)
test_idx, test_y = jnp.asarray(ds.test_idx), jnp.asarray(ds.test_y)


@nnx.jit
def train_step(model: Model, optimizer: nnx.Optimizer, graph: GraphArrays) -> jax.Array:
  def loss_fn(model):
    logits = model(graph)[train_idx]
    return optax.softmax_cross_entropy_with_integer_labels(logits, train_y).mean()

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


@nnx.jit
def accuracy(model: Model, graph: GraphArrays, idx: jax.Array, y: jax.Array) -> jax.Array:
  return jnp.mean(jnp.argmax(model(graph)[idx], axis=-1) == y)


for epoch in range(1, 51):
  loss = train_step(model, optimizer, graph)
  if epoch % 10 == 0:
    train_accuracy = accuracy(model, graph, train_idx, train_y)
    print(f"epoch {epoch:2d}  loss {float(loss):.4f}  train accuracy {float(train_accuracy):.4f}")
print(f"test accuracy {float(accuracy(model, graph, test_idx, test_y)):.4f}")
