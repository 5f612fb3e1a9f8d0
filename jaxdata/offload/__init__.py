"""Offload: activations to host RAM and SSD under a remat policy that chooses offload over
recompute per block, under a device memory budget.

    >>> from jaxdata import offload
    >>> with offload.TensorStore(ram_bytes="16GiB", ssd_dir="/local/ssd") as store:
    ...   block = offload.remat(block_fn, offload.offload(store))
    ...   grads = jax.jit(jax.grad(loss))(params, batch)    # loss applies `block`

`TensorStore` holds the tiers; `spill` / `load` are the jit-compatible primitives; `remat` and
its policies (`keep`, `offload`, `recompute`) wrap a block; the planner (`plan`) picks a
policy per block for a memory budget from measured costs (`plan_layers`: for a stack of
identical layers, given the layer function and its candidate inner policies; `plan_blocks`: for
layers that differ in shape, such as one per sampled hop); `run_layers` runs a stack of layers
under a plan (one policy per layer).
"""

from jaxdata.offload.planner import Choice, OffloadPlan, plan, plan_blocks, plan_layers
from jaxdata.offload.remat import Policy, keep, offload, recompute, remat
from jaxdata.offload.spill import load, new_site, spill
from jaxdata.offload.stack import run_layers, segments
from jaxdata.offload.store import TensorStore, measure_disk_write

__all__ = [
  "TensorStore",
  "measure_disk_write",
  "spill",
  "load",
  "new_site",
  "Policy",
  "keep",
  "offload",
  "recompute",
  "remat",
  "Choice",
  "OffloadPlan",
  "plan",
  "plan_blocks",
  "plan_layers",
  "run_layers",
  "segments",
]
