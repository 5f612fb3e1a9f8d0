"""The timing harness of `jaxdata bench rgnn`: every formulation (the references in
`jaxdata.reference`, jaxdata's generated kernels, PyG) as a `Formulation`, compiled ahead of time
and timed side by side, with the device memory each needs.

    >>> edges = rgcn.EdgeArrays.build(src, dst, etype, num_nodes=n, num_relations=r)
    >>> step = compile_step(plain_jax("ragged_dot", edges, n), x, w, ct)
    >>> timing = time_jax(step)

Two modes (`MODES`): "train", one forward + backward step (loss = sum(out * ct), gradients for
the inputs and weights), and "inference", one forward pass alone: the message under `jax.jit`
without `jax.grad` (JAX then lowers a `jax.custom_vjp` function, as hector's kernels are, through
its primal function, never its forward rule, so nothing is kept for a backward pass), PyG's layer
in eval mode under `torch.inference_mode()`.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdata.reference import attention, rgcn

#: "train": forward + backward per step; "inference": forward only.
MODES = ("train", "inference")


class Unavailable(Exception):
  """A formulation that cannot run here; the message says why (it goes into the table's notes)."""


# ------------------------------------------------------------------------------------------------
# One interface for everything timed from JAX


@dataclasses.dataclass(frozen=True)
class Formulation:
  """A relational message as `message(graph_args, x, w) -> out`, jit-able, graph_args a pytree."""

  name: str
  message: Callable[[Any, jax.Array, jax.Array], jax.Array]
  graph_args: Any


def plain_jax(name: str, edges: rgcn.EdgeArrays, num_nodes: int, *, precision=None) -> Formulation:
  fn = rgcn.PLAIN_JAX[name]
  return Formulation(name, lambda g, x, w: fn(*g, num_nodes, x, w, precision=precision), edges)


def hetero_graph(src, dst, etype, *, num_nodes: int, num_relations: int):
  """These edges as a `jaxdata.data.HeteroGraph` (what `jaxdata_formulation` compiles for).

  Raises `Unavailable` where jaxdata.data is not importable.
  """
  try:
    from jaxdata.data import HeteroGraph  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise Unavailable(f"jaxdata.data.HeteroGraph not importable ({e})") from e
  return HeteroGraph.from_edges(
    np.asarray(src),
    np.asarray(dst),
    np.asarray(etype),
    num_nodes=int(num_nodes),
    relation_names=[f"r{i}" for i in range(num_relations)],
  )


def jaxdata_formulation(graph, *, precision=None) -> Formulation:
  """jaxdata's generated kernel, `jaxdata.hector.rgcn_message`, as a `Formulation`.

  The adapter between the benchmark (and tests) and `jaxdata.hector`: the only code that knows its
  API. `graph` is a `jaxdata.data.HeteroGraph`, or its `hector.GraphArrays` already built (one
  graph's arrays for several formulations). Raises `Unavailable` while `jaxdata.hector` has no
  `rgcn_message` / `GraphArrays`.
  """
  try:
    from jaxdata import hector  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise Unavailable(f"jaxdata.hector.rgcn_message not built yet ({e})") from e
  if not (hasattr(hector, "rgcn_message") and hasattr(hector, "GraphArrays")):
    raise Unavailable("jaxdata.hector.rgcn_message not built yet")
  if graph is None:
    raise Unavailable("no jaxdata.data.HeteroGraph of this graph to compile for")
  arrays = graph if isinstance(graph, hector.GraphArrays) else hector.GraphArrays.from_graph(graph)
  kwargs = {}
  if precision is not None and "precision" in inspect.signature(hector.rgcn_message).parameters:
    kwargs["precision"] = precision
  return Formulation("jaxdata", lambda g, x, w: hector.rgcn_message(g, x, w, **kwargs), arrays)


def loss_and_grads(formulation: Formulation) -> Callable:
  """jit(graph_args, x, w, ct -> (sum(out * ct), (d/dx, d/dw))): one forward + backward step."""

  def loss(x, w, g, ct):
    return jnp.vdot(formulation.message(g, x, w), ct)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def forward_only(formulation: Formulation) -> Callable:
  """jit(x, w, graph_args -> out): one forward pass, as inference runs it.

  No `jax.grad` around it, so a `jax.custom_vjp` inside (hector's `_apply`) is lowered through
  its primal function: its forward rule, which returns residuals for the backward pass, is never
  traced, and what the kernels compute on the way is a temporary of the executable, freed once
  used, not an output kept alive.
  """
  return jax.jit(lambda x, w, g: formulation.message(g, x, w))


@jax.jit
def _checksum(out, ct):
  """sum(out * ct) elementwise in float32 (no dot, so no TF32 on any backend)."""
  return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32))


@dataclasses.dataclass
class Compiled:
  """A compiled step (forward+backward, or forward only) and what XLA says it needs."""

  run: Callable[[], Any]  # one step on the bound arguments, results not waited for
  bytes: int | None  # arguments + outputs + temporaries - aliased, from memory_analysis()
  analysis: Any
  #: sum(out * ct) from what `run` returned: the loss of a train step, a checksum of inference.
  loss: Callable[[Any], float] = lambda result: float(result[0])
  #: hector kernels in it time their tilings on its first run (jaxdata.hector.tuning): those
  #: calls stay outside XLA's CUDA graphs, so a step compiled after that run is the one to time
  tunes: bool = False


def compile_step(formulation: Formulation, x, w, ct, *, mode: str = "train") -> Compiled:
  """Lowers and compiles the step ahead of time, so its memory is known before it runs.

  mode "train": `loss_and_grads`; "inference": `forward_only` (ct is then used only for the
  checksum that `Compiled.loss` computes outside the timed program).
  """
  g = formulation.graph_args
  tuned_before = _tuning_lowerings()
  if mode == "train":
    lowered = loss_and_grads(formulation).lower(x, w, g, ct)
    compiled = lowered.compile()
    run, loss = (lambda: compiled(x, w, g, ct)), (lambda result: float(result[0]))
  elif mode == "inference":
    lowered = forward_only(formulation).lower(x, w, g)
    compiled = lowered.compile()
    run, loss = (lambda: compiled(x, w, g)), (lambda out: float(_checksum(out, ct)))
  else:
    raise ValueError(f"compile_step: mode must be one of {MODES}, got {mode!r}")
  analysis = compiled.memory_analysis()
  return Compiled(
    run, compiled_bytes(analysis), analysis, loss, tunes=_tuning_lowerings() > tuned_before
  )


def _tuning_lowerings() -> int:
  """`jaxdata.hector.tuning.tuning_lowerings()`, or 0 where hector is not importable."""
  try:
    from jaxdata.hector import tuning  # pylint: disable=g-import-not-at-top
  except ImportError:
    return 0
  return tuning.tuning_lowerings()


def compiled_bytes(analysis) -> int | None:
  """Device bytes an executable needs: arguments + outputs + temporaries - aliased.

  jax 0.10/0.11 return a `CompiledMemoryStats` (`argument_size_in_bytes`, `output_size_in_bytes`,
  `temp_size_in_bytes`, `alias_size_in_bytes`, and `peak_memory_in_bytes`, which XLA fills on some
  backends only and which is not in its repr); older ones a list of them or None.
  """
  if isinstance(analysis, (list, tuple)):
    analysis = analysis[0] if analysis else None
  if analysis is None:
    return None
  total = 0
  for field in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes"):
    total += int(getattr(analysis, field, 0) or 0)
  total -= int(getattr(analysis, "alias_size_in_bytes", 0) or 0)
  return max(total, int(getattr(analysis, "peak_memory_in_bytes", 0) or 0)) or None


def device_memory_stats(device=None) -> dict[str, int]:
  """`device.memory_stats()`, or {} where the backend keeps none (the CPU)."""
  device = device or jax.devices()[0]
  try:
    return dict(device.memory_stats() or {})
  except Exception:  # pylint: disable=broad-except
    return {}


@dataclasses.dataclass
class Timing:
  seconds: float  # median wall time of one step (forward+backward, or forward only)
  bytes: int | None  # model of the step's device memory (compiled analysis; torch's peak for PyG)
  measured_bytes: int | None = None  # rise of the device's peak_bytes_in_use, where it rose
  loss: float | None = None  # sum(out * ct) of the first step, to check formulations agree
  output: Any = None  # inference: the first forward's output (for tests), else None
  alone_seconds: float | None = None  # median of one step waited for on its own (latency)


def time_jax(
  compiled: Compiled, *, repeats: int = 7, warmup: int = 2, baseline: dict[str, int] | None = None
) -> Timing:
  """Median fwd+bwd time of a compiled step per step, with steps queued back to back as a training
  loop dispatches them (`jaxdata.timing.queue_depth`: enough to fill ~20 ms, at most 20), so a
  sub-millisecond step is not dominated by the host's round trip of waiting for each one.

  The first call's loss is kept (it is also the first warm-up). On a GPU, also how far the step
  raised the allocator's high-water mark: peak_bytes_in_use after, minus bytes_in_use at
  `baseline` (`device_memory_stats()` taken before compiling; default: now), plus the step's
  arguments (already resident). None where the peak did not rise past an earlier case's (JAX
  cannot reset it). XLA's GPU autotuner allocates operand-sized buffers while compiling, and
  they count too when the baseline is taken before compiling: without them, the peak of a run
  almost never rises past the compile's.
  """
  from jaxdata.timing import step_seconds  # pylint: disable=g-import-not-at-top

  before = device_memory_stats() if baseline is None else baseline
  loss = compiled.loss(compiled.run())
  seconds, alone = step_seconds(compiled.run, warmup=max(warmup - 1, 0), repeats=repeats)
  after = device_memory_stats()
  measured = None
  if "peak_bytes_in_use" in after and after["peak_bytes_in_use"] > before.get(
    "peak_bytes_in_use", 0
  ):
    args = int(getattr(compiled.analysis, "argument_size_in_bytes", 0) or 0)
    measured = after["peak_bytes_in_use"] - before.get("bytes_in_use", 0) + args
  return Timing(seconds, compiled.bytes, measured, loss=loss, alone_seconds=alone)


def pyg_wait(device) -> Callable[[Any], None]:
  """`jaxdata.timing.median_seconds`'s `wait` for PyTorch on `device`: synchronizes it if CUDA."""
  import torch  # pylint: disable=g-import-not-at-top

  if device.type == "cuda":
    return lambda _: torch.cuda.synchronize(device)
  return lambda _: None


#: PyG's RGCN layers: name -> `jaxdata.reference.pyg.pyg_conv`'s `fast`.
PYG_RGCN = {"RGCNConv": False, "FastRGCNConv": True}


def time_pyg(
  src,
  dst,
  etype,
  x: np.ndarray,
  w: np.ndarray,
  ct: np.ndarray,
  *,
  repeats: int = 7,
  warmup: int = 2,
  device=None,
  mode: str = "train",
  layer: str = "RGCNConv",
  keep_output: bool = False,
) -> Timing:
  """Median step time of PyG's RGCNConv (or FastRGCNConv: `layer`) on `device`, and on CUDA its
  peak allocated bytes.

  mode "train": forward + backward of sum(conv(x) * ct); "inference": the forward alone, the
  layer in eval mode under `torch.inference_mode()` (`pyg_ref.pyg_forward`). The peak counts what
  this case allocated, inputs and weights included (memory allocated before it is subtracted),
  as the compiled figure of a JAX step counts its arguments. `keep_output`: inference's first
  output, as NumPy, in `Timing.output`.
  """
  import torch  # pylint: disable=g-import-not-at-top

  from jaxdata.reference import pyg as pyg_ref  # pylint: disable=g-import-not-at-top

  if mode not in MODES:
    raise ValueError(f"time_pyg: mode must be one of {MODES}, got {mode!r}")
  if layer not in PYG_RGCN:
    raise ValueError(f"time_pyg: layer must be one of {tuple(PYG_RGCN)}, got {layer!r}")
  device = device or pyg_ref.torch_device()
  cuda = device.type == "cuda"
  if cuda:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
  conv = pyg_ref.pyg_conv(w, device=device, fast=PYG_RGCN[layer])
  edge_index, edge_type = pyg_ref.pyg_graph(src, dst, etype, device)
  xt = torch.from_numpy(np.asarray(x)).to(device).requires_grad_(mode == "train")
  ctt = torch.from_numpy(np.asarray(ct)).to(device)
  output = None
  if mode == "train":

    def step():
      return pyg_ref.pyg_loss_and_grads(conv, xt, edge_index, edge_type, ctt)

    loss = step()[0].detach().item()
  else:
    conv.eval()

    def step():
      return pyg_ref.pyg_forward(conv, xt, edge_index, edge_type)

    first = step()
    loss = float((first * ctt).sum().item())
    if keep_output:
      output = first.cpu().numpy()
    del first

  from jaxdata.timing import step_seconds  # pylint: disable=g-import-not-at-top

  wait = pyg_wait(device)
  seconds, alone = step_seconds(step, warmup=max(warmup - 1, 0), repeats=repeats, wait=wait)
  peak = torch.cuda.max_memory_allocated(device) - base if cuda else None
  conv = edge_index = edge_type = xt = ctt = step = None  # free the case's tensors (and cells)
  return Timing(seconds, peak, loss=loss, alone_seconds=alone, output=output)


# ------------------------------------------------------------------------------------------------
# As `Formulation`s, for its compile_step / time_jax


def rgat_formulation(name: str, edges: attention.Edges, *, precision=None) -> Formulation:
  """`message(edges, x, params) -> [N, H*d]`."""
  fn = attention.RGAT[name]
  return Formulation(name, lambda g, x, p: fn(*g, x, p, precision=precision), edges)


def hgt_formulation(name: str, edges: attention.Edges, *, precision=None) -> Formulation:
  """`message(edges, xs, params) -> [N, d_out]`: the per-type outputs concatenated in id order."""
  fn = attention.HGT[name]
  return Formulation(
    name, lambda g, xs, p: jnp.concatenate(fn(*g, xs, p, precision=precision)), edges
  )
