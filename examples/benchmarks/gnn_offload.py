"""`jaxdata bench gnn-offload`: a deep HGT (or RGAT) full-graph step without and with an offload
plan under a device budget: device memory and step time.

The model is `jaxdata train hgt --layers L --hidden H`'s on `synthetic_mag(scale)`. First the
plain step (every residual kept) is compiled: XLA's temporary bytes are its activation memory.
The budget is `--fraction` of that; the planner (`jaxdata.nn.layer_stack.plan`) gets what is
left of it once the rest of the step (the first layer, the classifier, the gradients: the plain
step's temporaries less the planned layers' residuals and inputs, as traced) is taken out. The
planned step runs with its store; its device memory is XLA's temporaries plus the store's
staging peak (`TensorStore.stats()["device_peak"]`). On a GPU the process's measured peak
(`memory_stats()["peak_bytes_in_use"]`) is reported too: the planned step runs first, so the
plain row's peak is its own wherever it is the larger.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from benchmarks.common import command_line, hardware, markdown_table, print_table, write
from jaxdata import command
from jaxdata.timing import median_seconds


def _step(model, graph, xs, papers, idx, y, plan):
  """(run, XLA temp bytes): one jitted loss + gradients of the training papers."""
  graphdef, params = nnx.split(model)

  def loss(params, xs):
    logits = nnx.merge(graphdef, params)(graph, xs, papers, plan)[idx]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  compiled = jax.jit(jax.value_and_grad(loss)).lower(params, xs).compile()
  mem = compiled.memory_analysis()
  temp = int(getattr(mem, "temp_size_in_bytes", 0) or 0)
  return (lambda: compiled(params, xs)), temp


def _peak() -> int | None:
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


def run(
  *,
  model: str = "hgt",
  scale: float = 1.0,
  layers: int = 4,
  hidden: int = 256,
  heads: int = 4,
  fraction: float = 0.5,
  repeats: int = 5,
  ram_bytes: int | None = None,
  say=print,
) -> tuple[list[list], list[str]]:
  """Measures the plain and the planned step; returns (table rows, notes)."""
  # pylint: disable=g-import-not-at-top
  from jaxdata.data import synthetic_mag
  from jaxdata.hector import GraphArrays
  from jaxdata.nn import layer_stack
  from jaxdata.offload import TensorStore
  from jaxdata.offload.planner import residual_bytes
  from jaxdata.train import attention

  t0 = time.perf_counter()
  ds = synthetic_mag(scale=scale, num_classes=attention.default_classes(scale))
  config = attention.TrainConfig(model=model, layers=layers, hidden=hidden, heads=heads)
  net = attention.build_model(ds, config, nnx.Rngs(0))
  graph = GraphArrays.from_graph(ds.graph)
  xs = attention.device_features(ds, net)
  papers = ds.node_range("paper")[1]
  idx = jnp.asarray(ds.train_papers)
  y = jnp.asarray(ds.labels)[idx]
  say(
    f"{ds.graph.num_nodes:,} nodes, {ds.graph.num_edges:,} edges (drawn in "
    f"{time.perf_counter() - t0:.1f} s); {model.upper()} {layers} layers, hidden {hidden}"
  )
  plain, plain_temp = _step(net, graph, xs, papers, idx, y, None)
  rows_t = [x.shape[0] for x in net.inputs(xs)]
  stack, layer_fn, x = net.stack(graph, rows_t)
  apply, states = layer_stack.stacked(stack, layer_fn)
  first = jax.tree.map(lambda a: a[0], states)
  per_layer = residual_bytes(apply, (first, x)) + x.size * x.dtype.itemsize
  budget = int(fraction * plain_temp)
  rest = max(0, plain_temp - len(stack) * per_layer)
  say(
    f"plain step: {plain_temp / 2**30:.2f} GiB of XLA temporaries; planned layers "
    f"{len(stack)} x {per_layer / 2**30:.2f} GiB (residuals + input); budget {fraction:g} x "
    f"plain = {budget / 2**30:.2f} GiB, {(budget - rest) / 2**30:.2f} GiB of it for the layers"
  )
  if ram_bytes is None:  # a quarter of the host's memory, at most 64 GiB
    from jaxdata import _ffi

    ram_bytes = min(64 << 30, _ffi.ext.physical_memory_bytes() // 4)
  header_notes = []
  rows = []
  with TensorStore(ram_bytes=ram_bytes) as store:
    if budget <= rest:
      header_notes.append(
        f"budget {fraction:g} x plain: nothing fits (the rest of the step "
        f"needs {rest / 2**30:.2f} GiB)"
      )
    else:
      try:
        best, bw = layer_stack.plan(
          stack,
          layer_fn,
          x,
          budget - rest,
          store,
          attention.candidates(net),
          repeats=3,
          progress=lambda n: say(f"  measuring a layer under {n} ..."),
        )
      except ValueError as e:  # not even the smallest plan fits
        raise command.UsageError(f"argument --fraction: {e}") from None
      say(
        f"plan: {best} (predicted {best.device_bytes / 2**30:.2f} GiB of layers, "
        f"{best.offload_bytes / 2**30:.2f} GiB offloaded at {bw / 1e9:.1f} GB/s)"
      )
      planned, temp = _step(net, graph, xs, papers, idx, y, tuple(best.policies))
      seconds = median_seconds(planned, warmup=2, repeats=repeats)
      st = store.stats()
      rows.append(
        [
          f"planner @ {fraction:g} x plain",
          str(best),
          _gib(temp),
          _gib(st["device_peak"]),
          _gib(temp + st["device_peak"]),
          _gib(_peak()),
          f"{seconds * 1e3:.1f}",
          _gib(best.offload_bytes),
        ]
      )
  seconds = median_seconds(plain, warmup=2, repeats=repeats)
  rows.insert(
    0,
    [
      "no remat",
      "keep everything",
      _gib(plain_temp),
      _gib(0),
      _gib(plain_temp),
      _gib(_peak()),
      f"{seconds * 1e3:.1f}",
      _gib(0),
    ],
  )
  for r in rows:
    say("  " + " | ".join(r))
  return rows, header_notes


HEADER = [
  "run",
  "plan",
  "XLA temp (GiB)",
  "staging peak (GiB)",
  "device (GiB)",
  "process peak (GiB)",
  "step (ms)",
  "offloaded per step (GiB)",
]


def _gib(b: int | None) -> str:
  return "n/a" if b is None else f"{b / 2**30:.3f}"


def add_arguments(parser) -> None:
  parser.add_argument("--model", choices=("hgt", "rgat"), default="hgt", help="the model")
  parser.add_argument(
    "--scale",
    type=command.positive_float,
    default=1.0,
    help="synthetic_mag's share of ogbn-mag (default 1: full size)",
  )
  parser.add_argument("--layers", type=command.positive_int, default=4, help="graph layers")
  parser.add_argument("--hidden", type=command.positive_int, default=256, help="hidden features")
  parser.add_argument("--heads", type=command.positive_int, default=4, help="attention heads")
  parser.add_argument(
    "--fraction",
    type=command.fraction,
    default=0.5,
    help="the budget, as a fraction of the plain step's activation memory",
  )
  parser.add_argument("--repeats", type=command.positive_int, default=5, help="timed steps")
  parser.add_argument(
    "--ram",
    type=command.size,
    default=None,
    help="the store's pinned RAM tier (default: a quarter of the host's memory, at most 64GiB)",
  )
  parser.add_argument(
    "--write",
    default=None,
    metavar="PATH",
    type=command.output_path,
    help="write the table as Markdown (e.g. docs/benchmarks/gnn_offload.md)",
  )


def main(args) -> int:
  if args.model == "hgt" and args.layers < 2:
    raise command.UsageError(
      "argument --layers: HGT's plan covers the layers after the first, so "
      f"it needs at least 2, got {args.layers}"
    )
  if args.hidden % args.heads:
    raise command.UsageError(
      f"argument --hidden: {args.hidden} is not a multiple of --heads {args.heads}"
    )
  console = command.console()
  say = lambda text: console.print(text, markup=False)  # noqa: E731
  rows, notes = run(
    model=args.model,
    scale=args.scale,
    layers=args.layers,
    hidden=args.hidden,
    heads=args.heads,
    fraction=args.fraction,
    repeats=args.repeats,
    ram_bytes=args.ram,
    say=say,
  )
  print_table(console, "deep GNN under an offload plan", HEADER, rows, notes, left=("run", "plan"))
  if args.write:
    hw = hardware()
    text = (
      f"# A deep {args.model.upper()} under a device-memory budget\n\n"
      f"`{command_line()}` on {hw['device']} ({hw['host']}; {hw['software']}; "
      f"{hw['date']}).\n\n{args.layers} layers, hidden {args.hidden}, {args.heads} heads, "
      f"full-graph loss and gradients on synthetic_mag scale {args.scale:g}. Device: XLA's "
      "temporaries plus the store's staging peak; process peak: "
      "`memory_stats()['peak_bytes_in_use']` so far (the planned step runs first). The "
      "plan covers the layers after the first (HGT) or every layer (RGAT).\n\n"
      + markdown_table(HEADER, rows)
      + "\n"
      + "".join(f"\n{n}\n" for n in notes)
    )
    write(console, args.write, text)
  return 0
