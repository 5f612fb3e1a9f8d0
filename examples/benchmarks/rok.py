"""`jaxdata rok`: the recompute-offload-keep curve of a GPT-style stack.

Step time (forward + backward) against device activation memory, measured side by side in one
run, for JAX's built-in remat policies and for the planner's plans at a range of budgets.
Device memory is XLA's temporary allocation for the step (what the activations need) plus the
TensorStore's device staging peak for offloaded plans. Optionally one planner plan runs with
every spill on the SSD tier, next to the disk's own direct-I/O write bandwidth.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks import common
from jaxdata import command, offload
from jaxdata.timing import median_seconds

FULL = dict(layers=16, hidden=4096, heads=32, seq=2048, batch=8, vocab=8192)
QUICK = dict(layers=4, hidden=256, heads=4, seq=256, batch=4, vocab=512)
FRACTIONS = (1.0, 0.5, 0.3, 0.2, 0.1)
NAMES = ("qkv", "attn_ctx", "attn_out", "mlp_up")  # what the planner's "proj" saves


@dataclasses.dataclass
class Row:
  name: str
  kind: str  # "jax" or "planner"
  seconds: float
  device_bytes: int  # XLA temp + store device staging peak
  host_bytes: int = 0
  budget: int | None = None
  plan: str = ""
  ssd_write_bw: float = 0.0


def _builtin() -> dict[str, offload.Policy | None]:
  cp = jax.checkpoint_policies
  return {
    "keep everything": None,
    "recompute everything": offload.keep(cp.nothing_saveable, name="recompute"),
    "save dots only": offload.keep(cp.dots_with_no_batch_dims_saveable, name="dots"),
    "offload names to pinned host (XLA)": offload.keep(
      cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=list(NAMES),
        offload_src="device",
        offload_dst="pinned_host",
      ),
      name="xla-offload",
    ),
  }


def _step(model, tokens, plan):
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from jaxdata.offload.stack import segments  # pylint: disable=g-import-not-at-top

  if plan is not None and len(segments(plan, model.cfg.layers)) > 1:
    model = nnx.clone(model)
    model.split_layers(plan)  # one parameter stack per segment, as training would
  graphdef, params = nnx.split(model)

  def loss(params, tokens):
    return nnx.merge(graphdef, params).loss(tokens, plan)

  step = jax.jit(jax.value_and_grad(loss))
  compiled = step.lower(params, tokens).compile()
  mem = compiled.memory_analysis()
  temp = int(getattr(mem, "temp_size_in_bytes", 0) or 0)
  host = int(getattr(mem, "host_temp_size_in_bytes", 0) or 0)
  return (lambda: compiled(params, tokens)), temp, host


def _time(fn: Callable[[], Any], repeats: int) -> float:
  return median_seconds(fn, warmup=2, repeats=repeats)


def model_and_tokens(
  *, layers, hidden, heads, seq, batch, vocab, loss_chunk=0, param_dtype="float32"
):
  """The GPT (bfloat16 compute) and the fixed token batch (batch, seq + 1) that rok measures."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from jaxdata.nn.gpt import GPT, GPTConfig  # pylint: disable=g-import-not-at-top

  cfg = GPTConfig(
    vocab=vocab,
    layers=layers,
    hidden=hidden,
    heads=heads,
    seq=seq,
    dtype=jnp.bfloat16,
    param_dtype=jnp.dtype(param_dtype),
    loss_chunk=loss_chunk,
  )
  tokens = jax.random.randint(jax.random.PRNGKey(1), (batch, seq + 1), 0, vocab)
  return GPT(cfg, rngs=nnx.Rngs(0)), tokens


def run(
  *,
  layers,
  hidden,
  heads,
  seq,
  batch,
  vocab,
  loss_chunk=0,
  param_dtype="float32",
  fractions=FRACTIONS,
  ram_bytes=64 << 30,
  ssd_dir=None,
  ssd_inner="attn",
  repeats=5,
  say: Callable[[str], None] = print,
) -> tuple[list[Row], dict]:
  from jaxdata.nn.gpt import block_fn  # pylint: disable=g-import-not-at-top
  from jaxdata.nn.gpt_plan import candidates  # pylint: disable=g-import-not-at-top

  model, tokens = model_and_tokens(
    layers=layers,
    hidden=hidden,
    heads=heads,
    seq=seq,
    batch=batch,
    vocab=vocab,
    loss_chunk=loss_chunk,
    param_dtype=param_dtype,
  )
  rows, notes = [], {}

  for name, policy in _builtin().items():
    say(f"JAX policy: {name}")
    plan = None if policy is None else [policy] * layers
    try:
      fn, temp, host = _step(model, tokens, plan)
      rows.append(Row(name, "jax", _time(fn, repeats), temp, host))
      say(
        f"  {rows[-1].seconds * 1e3:.1f} ms, {temp / 2**30:.2f} GiB device temp"
        + (f", {host / 2**30:.2f} GiB host" if host else "")
      )
    except Exception as e:  # pylint: disable=broad-except
      say(f"  failed: {type(e).__name__}: {str(e)[:200]}")
  keep = next((r for r in rows if r.name == "keep everything"), None)
  recompute = next((r for r in rows if r.name == "recompute everything"), None)
  if keep is None or recompute is None:
    raise RuntimeError(
      "rok: keep-everything or recompute-everything did not run (out of device "
      "memory?): the curve needs both; try a smaller model (--batch-size, --vocab)"
    )

  say("planner: measuring one block's choices and the store's bandwidth")
  blk = block_fn(model, (batch, seq))
  with offload.TensorStore(ram_bytes=1 << 30) as probe:
    cands = offload.planner.choices(
      blk.apply,
      (blk.layer(0), blk.x),
      probe,
      candidates(),
      repeats=repeats,
      carry=1,
      progress=lambda n: say(f"  block under {n}"),
    )
    bandwidth = (
      offload.planner.store_bandwidth(probe, repeats=repeats)
      if any(c.offload_bytes for c in cands)
      else 0.0
    )
  notes["bandwidth"] = bandwidth
  notes["choices"] = [(str(c.policy), c.device_bytes, c.offload_bytes, c.seconds) for c in cands]
  notes["candidates"] = cands
  notes["plans"] = {}  # budget fraction -> the planner's OffloadPlan
  # The step's memory beyond the layers' residuals and inputs (the planner's choices count
  # those): what recompute-everything needs, less the layer inputs it keeps.
  in_bytes = blk.x.size * jnp.dtype(blk.x.dtype).itemsize
  baseline = recompute.device_bytes - layers * in_bytes
  notes["baseline"] = baseline
  notes["unfit"] = []
  for frac in fractions:
    budget = int(frac * keep.device_bytes)
    if budget < baseline:
      say(
        f"budget {frac:g} x keep ({budget / 2**30:.1f} GiB): nothing fits; the step needs "
        f"{baseline / 2**30:.2f} GiB beyond the layers' residuals and inputs"
      )
      notes["unfit"].append((frac, budget))
      continue
    try:
      best = offload.plan(layers, cands, max(0, budget - baseline), bandwidth)
    except ValueError:
      say(f"budget {frac:g} x keep: no plan fits")
      continue
    notes["plans"][frac] = best
    say(
      f"budget {frac:g} x keep ({budget / 2**30:.1f} GiB): {best}"
      + (f" (spill staging capped at {best.spill_cap / 2**30:.2f} GiB)" if best.spill_cap else "")
    )
    ram = max(1 << 30, int(best.offload_bytes * 1.2))
    # Spill staging capped where the planner's timeline has it (JAX's host thread would
    # otherwise stage a whole step's spills before the GPU has run them).
    with offload.TensorStore(ram_bytes=min(ram, ram_bytes), device_bytes=best.spill_cap) as store:
      policies = [_with_store(p, store) for p in best.policies]
      fn, temp, host = _step(model, tokens, policies)
      seconds = _time(fn, repeats)
      st = store.stats()
      staged = st["device_peak"]
    rows.append(
      Row(
        f"planner @ {frac:g} x keep",
        "planner",
        seconds,
        temp + staged,
        best.offload_bytes,
        budget,
        str(best),
      )
    )
    say(
      f"  {seconds * 1e3:.1f} ms (predicted {best.seconds * 1e3:.1f} ms of layers), "
      f"{(temp + staged) / 2**30:.2f} GiB device ({staged / 2**30:.2f} GiB staging; at most "
      f"{st.get('spill_peak', 0) / 2**30:.2f} GiB of spills in flight and "
      f"{st.get('load_peak', 0) / 2**30:.2f} GiB of loads held)"
    )

  if ssd_dir:
    say(f"SSD tier: disk write bandwidth under {ssd_dir}")
    disk_before = offload.measure_disk_write(ssd_dir, 4 << 30)
    # Every layer's attention residuals to the SSD: a fixed, heavy write load.
    with offload.TensorStore(ram_bytes=0, ssd_dir=ssd_dir, staging_bytes=1 << 30) as store:
      policy = offload.offload(
        store, "ssd", candidates()[ssd_inner], name=f"offload[{ssd_inner}] to SSD"
      )
      fn, temp, host = _step(model, tokens, [policy] * layers)
      seconds = median_seconds(fn, warmup=1, repeats=2)
      s = store.stats()
    per_layer = next(c.offload_bytes for c in cands if str(c.policy) == f"offload[{ssd_inner}]")
    rows.append(
      Row(
        f"offload[{ssd_inner}] every layer, SSD tier only",
        "planner",
        seconds,
        temp + s["device_peak"],
        per_layer * layers,
        None,
        str(policy),
        s["write_bandwidth"],
      )
    )
    notes["ssd_written"] = s["ssd_written"]
    # The disk's bandwidth varies between runs on a virtual disk: measured before and after the
    # SSD row, the better of the two is the one the tier is held to.
    disk = max(disk_before, offload.measure_disk_write(ssd_dir, 4 << 30))
    notes["disk_write"] = disk
    say(
      f"  {seconds * 1e3:.1f} ms; SSD tier wrote {s['write_bandwidth'] / 1e9:.2f} GB/s, the disk "
      f"{disk / 1e9:.2f} GB/s"
    )
  notes["keep"] = keep
  return rows, notes


def _with_store(policy: offload.Policy, store, tier: str | None = None) -> offload.Policy:
  if policy.mode != "offload":
    return policy
  return dataclasses.replace(policy, store=store, tier=tier or policy.tier)


def table_rows(rows: list[Row], notes: dict) -> tuple[list[str], list[list[Any]]]:
  keep = notes["keep"]
  header = [
    "policy",
    "step ms",
    "vs keep",
    "device GiB",
    "budget GiB",
    "best JAX in budget",
    "vs that",
    "offloaded GiB",
    "plan",
  ]
  body = []
  jax_rows = [r for r in rows if r.kind == "jax"]
  for r in rows:
    fits = [j for j in jax_rows if r.budget is not None and j.device_bytes <= r.budget]
    best = min(fits, key=lambda j: j.seconds) if fits else None
    body.append(
      [
        r.name,
        f"{r.seconds * 1e3:.0f}",
        f"{r.seconds / keep.seconds:.3f}",
        f"{r.device_bytes / 2**30:.2f}",
        "" if r.budget is None else f"{r.budget / 2**30:.2f}",
        "" if r.budget is None else (best.name if best else "none fits"),
        "" if best is None else f"{r.seconds / best.seconds:.3f}",
        f"{r.host_bytes / 2**30:.2f}" if r.host_bytes else "",
        r.plan,
      ]
    )
  return header, body


def markdown(
  rows: list[Row], notes: dict, command: str, size: dict, png: str | None = "rok.png"
) -> str:
  hw = common.hardware()
  header, body = table_rows(rows, notes)
  text = [
    "# Recompute-offload-keep: GPT-style stack",
    "",
    f"`{command}`",
    "",
    f"- model: {size['layers']} layers, hidden {size['hidden']}, {size['heads']} heads, "
    f"sequence {size['seq']}, batch {size['batch']}, vocab {size['vocab']}, bfloat16 "
    f"compute, {size.get('param_dtype', 'float32')} parameters and gradients; "
    "one step = forward + backward (`value_and_grad`)"
    + (
      f"; cross entropy in chunks of {size['loss_chunk']} positions"
      if size.get("loss_chunk")
      else ""
    ),
    *[f"- {k}: {v}" for k, v in hw.items()],
    f"- store round trip (device -> RAM tier -> device): {notes['bandwidth'] / 1e9:.1f} GB/s "
    "each way",
    "",
  ]
  if "disk_write" in notes:
    ssd = next(r for r in rows if "SSD" in r.name)
    text += [
      f"- disk direct-I/O write bandwidth (same run, the better of a probe before and one after "
      f"the SSD row): {notes['disk_write'] / 1e9:.2f} GB/s; "
      f"SSD tier sustained {ssd.ssd_write_bw / 1e9:.2f} GB/s while writing "
      f"({ssd.ssd_write_bw / notes['disk_write']:.0%}); "
      f"{notes['ssd_written'] / 2**30:.1f} GiB written",
      "",
    ]
  text += [
    "Device GiB: XLA's temporary memory for the step plus the TensorStore's device staging "
    "peak (offloaded plans). Budget: a fraction of keep-everything's device memory; "
    "'best JAX in budget' is the fastest built-in policy whose device memory fits it.",
    "",
    common.markdown_table(header, body),
    "",
    *[
      f"Budget {f:g} x keep ({b / 2**30:.2f} GiB): no plan fits; the step needs "
      f"{notes['baseline'] / 2**30:.2f} GiB beyond the layers' residuals and inputs "
      "(the logits and one layer's working set while it is recomputed)."
      for f, b in notes.get("unfit", [])
    ],
    "",
    *([f"![step time against device memory]({png})", ""] if png else []),
    "Per-block choices the planner measured (bytes on the device / offloaded, the block's "
    "input included; forward + backward seconds of one block; '+in': the input is "
    "offloaded too):",
    "",
  ]
  text += [
    common.markdown_table(
      ["choice", "device MiB", "offload MiB", "block ms"],
      [
        [n, f"{d / 2**20:.0f}", f"{o / 2**20:.0f}", f"{s * 1e3:.2f}"]
        for n, d, o, s in notes["choices"]
      ],
    ),
    "",
  ]
  return "\n".join(text)


def plot(rows: list[Row], path: str) -> bool:
  """Step time against device memory; JAX's policies as points, the planner's plans as a line."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    return False
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for r in rows:
    if r.kind == "jax":
      ax.scatter(r.device_bytes / 2**30, r.seconds * 1e3, s=40)
      ax.annotate(
        r.name,
        (r.device_bytes / 2**30, r.seconds * 1e3),
        fontsize=8,
        xytext=(4, 4),
        textcoords="offset points",
      )
  pl = sorted(
    (r for r in rows if r.kind == "planner" and "SSD" not in r.name), key=lambda r: r.device_bytes
  )
  ax.plot(
    [r.device_bytes / 2**30 for r in pl],
    [r.seconds * 1e3 for r in pl],
    "o-",
    color="black",
    label="jaxdata planner",
  )
  ax.set_xlabel("device memory for the step (GiB)")
  ax.set_ylabel("step time (ms)")
  ax.set_title("recompute-offload-keep")
  ax.legend()
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True


# ----------------------------------------------------------------------------- the CLI
_FLAGS = {
  "layers": "--layers",
  "hidden": "--hidden",
  "heads": "--heads",
  "seq": "--seq",
  "batch": "--batch-size",
  "vocab": "--vocab",
}


def add_arguments(parser) -> None:
  """`jaxdata rok` options."""
  for key, flag in _FLAGS.items():
    what = "sequences per step" if key == "batch" else key
    parser.add_argument(
      flag,
      dest=key,
      type=command.positive_int,
      help=f"{what} (default {FULL[key]}; --quick {QUICK[key]})",
    )
  parser.add_argument(
    "--fractions",
    type=command.listing(command.positive_float),
    default=list(FRACTIONS),
    help="budgets as fractions of keep-everything's device memory",
  )
  parser.add_argument("--ssd-dir", metavar="DIR", help="also run a plan on the SSD tier here")
  parser.add_argument(
    "--loss-chunk",
    type=command.natural_int,
    default=0,
    metavar="N",
    help="cross entropy in chunks of N positions, so the float32 logits of one "
    "chunk are live at a time (0: all at once)",
  )
  parser.add_argument(
    "--param-dtype",
    choices=("float32", "bfloat16"),
    default="float32",
    help="parameter (and gradient) dtype; compute is bfloat16 either way "
    "(float32: master weights, cast per layer)",
  )
  parser.add_argument(
    "--repeats", type=command.positive_int, default=5, help="timed steps per measurement"
  )
  parser.add_argument(
    "--quick", action="store_true", help="a small model (flags given still apply)"
  )
  parser.add_argument(
    "--write",
    metavar="PATH.md",
    type=command.output_path,
    help="write the table (and the plot beside it: PATH.png)",
  )


def main(args) -> int:
  """`jaxdata rok`."""
  if args.write and os.path.splitext(args.write)[1].lower() != ".md":
    raise command.UsageError(
      f"argument --write: takes a .md path (the plot goes beside it as .png), got {args.write!r}"
    )
  if args.ssd_dir is not None and not os.path.isdir(args.ssd_dir):
    raise command.UsageError(f"argument --ssd-dir: {args.ssd_dir!r} is not a folder")
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  size = {k: common.pick(getattr(args, k), args.quick, QUICK[k], FULL[k]) for k in FULL}
  if size["hidden"] % size["heads"]:
    raise command.UsageError(
      f"argument --hidden: {size['hidden']} is not a multiple of --heads {size['heads']}"
    )
  size["loss_chunk"] = args.loss_chunk
  size["param_dtype"] = args.param_dtype
  console = command.console(width=200)
  rows, notes = run(
    **size,
    fractions=args.fractions,
    ssd_dir=args.ssd_dir,
    repeats=args.repeats,
    say=lambda text: console.print(text, markup=False),
  )
  common.print_table(
    console,
    "recompute-offload-keep: step time against device memory",
    *table_rows(rows, notes),
    left=("policy", "plan"),
  )
  if args.write:
    common.write_with_plot(  # rok.md, and rok.png beside it
      console,
      args.write,
      lambda png: markdown(rows, notes, common.command_line(), size, png=png),
      lambda png: plot(rows, png),
    )
  return 0
