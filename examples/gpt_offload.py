"""Train a GPT whose activations do not all fit: a per-layer keep / offload / recompute plan.

The planner measures one block (its residual bytes, its recompute time) and the store's
bandwidths, and gives each layer a policy under the memory budget; the model runs each run of
layers with one policy as one scan under `jaxdata.offload.remat`. The plan changes where the
activations live, not the numbers: loss and gradients equal the plain model's.

Run: python examples/gpt_offload.py [--budget 64M]
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxdata.data.tokens import markov_tokens
from jaxdata.nn import GPT, GPTConfig
from jaxdata.nn.gpt_plan import plan_for_model
from jaxdata.offload import TensorStore, segments
from jaxdata.sizes import parse_bytes

on_gpu = jax.devices()[0].platform == "gpu"
budget = parse_bytes(
  sys.argv[sys.argv.index("--budget") + 1] if "--budget" in sys.argv else "2G" if on_gpu else "8M"
)  # device memory for the layers' residuals
if on_gpu:  # big enough that keeping every activation would not fit the default budget
  cfg, batch, steps = GPTConfig(vocab=256, layers=12, hidden=1024, heads=16, seq=1024), 8, 100
else:  # small enough for a laptop CPU
  cfg, batch, steps = (
    GPTConfig(vocab=256, layers=4, hidden=128, heads=4, seq=128, dtype=jnp.float32),
    8,
    60,
  )
chain = markov_tokens(cfg.vocab, seed=0)
data = chain.batches(batch, cfg.seq, seed=1)
model = GPT(cfg, rngs=nnx.Rngs(0))

with TensorStore(ram_bytes=1 << 30) as store:  # pinned host RAM for what is offloaded
  plan = plan_for_model(model, (batch, cfg.seq), budget_bytes=budget, store=store)
  for start, stop, policy in segments(plan, cfg.layers):
    where = f"layers {start}-{stop - 1}" if stop - start > 1 else f"layer {start}"
    print(f"{where}: {policy}")

  # The contract: a plan changes memory and time, never the loss or the gradients.
  tokens = jnp.asarray(next(data))
  plain = nnx.jit(nnx.value_and_grad(lambda m: m.loss(tokens)))(model)
  planned = nnx.jit(nnx.value_and_grad(lambda m: m.loss(tokens, plan)))(model)
  diff = max(
    float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(planned))
  )
  print(
    f"loss {float(plain[0]):.4f} plain, {float(planned[0]):.4f} planned; "
    f"largest gradient difference {diff:.2e}"
  )

  # One parameter stack per run of layers with one policy, split once outside jit: slicing a
  # single stack inside the step would copy every layer's parameters at each step.
  model.split_layers(plan)
  optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, tokens):
    loss, grads = nnx.value_and_grad(lambda m: m.loss(tokens, plan))(model)
    optimizer.update(model, grads)
    return loss

  for i in range(steps + 1):
    loss = step(model, optimizer, jnp.asarray(next(data)))
    if i % (steps // 5) == 0:
      print(f"step {i:3d}  loss {float(loss):.4f}")
print(
  f"the chain's entropy (the floor): {chain.entropy():.4f}; log(vocab) = {np.log(cfg.vocab):.4f}"
)
