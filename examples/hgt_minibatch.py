"""HGT on mini-batches of a heterograph you build: papers, authors, venues, from NumPy arrays.

`HeteroData` holds your graph (edges per (source type, relation, destination type), ids local to
each type; features and labels per type). `Loader.from_data` keeps it in host memory
(pinned: on a GPU the kernels read the rows a batch needs, with no CPU gather), samples two hops
of in-edges around each batch of papers and gathers every sampled node's features. The model is
two `jaxdata.nn.HGT` layers and a classifier, trained by your own `nnx.jit` step.

A paper's class here is its venue's topic, which the venue's features show: it must be read
through the graph, since a paper's own features are noise.

Run: python examples/hgt_minibatch.py [--epochs 10]
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxdata.data import HeteroData
from jaxdata.loader import Loader
from jaxdata.nn import HGT

epochs = int(sys.argv[sys.argv.index("--epochs") + 1]) if "--epochs" in sys.argv else 10
rng = np.random.default_rng(0)
n = {"paper": 4000, "author": 2000, "venue": 40}
topic = rng.integers(0, 4, n["venue"])  # what the classifier has to find
venue_of = rng.integers(0, n["venue"], n["paper"])
writes = (rng.integers(0, n["author"], 12000), rng.integers(0, n["paper"], 12000))
cites = (rng.integers(0, n["paper"], 16000), rng.integers(0, n["paper"], 16000))
split = rng.permutation(n["paper"])
x = {t: rng.standard_normal((c, 16)).astype(np.float32) for t, c in n.items()}  # noise, but
x["venue"][:, :4] += 2 * np.eye(4, dtype=np.float32)[topic]  # a venue shows its topic
data = HeteroData(
  {
    ("author", "writes", "paper"): writes,
    ("paper", "cites", "paper"): cites,
    ("paper", "published_in", "venue"): (np.arange(n["paper"]), venue_of),
  },
  num_nodes=n,
  x=x,
  y={"paper": topic[venue_of]},
)
train, test = {"paper": split[:3000]}, {"paper": split[3000:]}
widths = [16] * len(n)


class Model(nnx.Module):
  def __init__(self, num_relations: int, rngs: nnx.Rngs):
    self.conv1 = HGT(widths, 32, num_relations=num_relations, heads=4, rngs=rngs)
    self.conv2 = HGT([32] * len(n), 32, num_relations=num_relations, heads=4, rngs=rngs)
    self.out = nnx.Linear(32, 4, rngs=rngs)

  def __call__(self, batch) -> jax.Array:
    # Hop 0 is next to the seeds; a hop's destinations are the first rows of its sources.
    graphs, inner = batch.blocks.graphs, [n.shape[0] for n in batch.blocks.nodes]
    h = self.conv1.on_slots(graphs[1], batch.inputs, batch.types, rows=inner[1])
    h = self.conv2.on_slots(graphs[0], h, batch.types[: inner[1]], rows=inner[0])
    return self.out(jax.nn.gelu(h[: batch.seeds.shape[0]]))


def loss_fn(model: Model, batch) -> jax.Array:
  ce = optax.softmax_cross_entropy_with_integer_labels(model(batch), batch.labels)
  return jnp.sum(jnp.where(batch.mask, ce, 0)) / jnp.maximum(batch.mask.sum(), 1)


@nnx.jit
def train_step(model: Model, optimizer: nnx.Optimizer, batch) -> jax.Array:
  loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
  optimizer.update(model, grads)
  return loss


@nnx.jit
def correct(model: Model, batch) -> tuple[jax.Array, jax.Array]:
  hit = (jnp.argmax(model(batch), -1) == batch.labels) & batch.mask
  return hit.sum(), batch.mask.sum()


with Loader.from_data(data, fanouts=(10, 5)) as loader:
  print(loader)
  model = Model(loader.num_relations, nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  for epoch in range(1, epochs + 1):
    losses = [train_step(model, optimizer, b) for b in loader.batches(train, 256, seed=epoch)]
    print(f"epoch {epoch:2d}  loss {float(jnp.mean(jnp.stack(losses))):.4f}")
  hits, total = np.sum([jax.device_get(correct(model, b)) for b in loader.batches(test, 256)], 0)
  print(f"test accuracy {hits / total:.4f}")
