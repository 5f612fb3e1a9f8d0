"""GPT training on a synthetic token chain: `jaxdata train gpt`, optionally with activation offload.

The data is a random sparse Markov chain (`jaxdata.data.tokens`), so the loss has a known floor (the
chain's entropy) far below log(vocab), and a short run shows whether training works. With a plan
(one remat policy per layer, e.g. from `jaxdata.nn.gpt_plan.plan_for_model`), each run of layers
sharing a policy trains under `jaxdata.offload.remat`; the plan changes memory and time, never the
numbers.

Data parallel: `devices` devices per process (and, with `jaxdata.distributed`, every process's
devices) form one 1-D mesh; the global batch of `batch` sequences is split over it, each device
runs the model on its share (under the plan, with its own spills to its process's TensorStore),
and the gradients are averaged by one all-reduce per step. The loss of the global batch is the
mean of the devices' means (equal shares), so any mesh trains like one device on the same
global batch, to float rounding. A plan is made for one device's share (`batch / devices`).

    from jaxdata.train.gpt import GPTTrainConfig, train
    result = train(GPTTrainConfig(steps=200))
    print(result.metrics["start_loss"], result.metrics["final_loss"], result.metrics["entropy"])
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdata import command, distributed
from jaxdata.nn.gpt import GPT
from jaxdata.nn.gpt_plan import offloaded_bytes, plan_for_model, policy_named
from jaxdata.offload.stack import segments
from jaxdata.offload.store import TensorStore
from jaxdata.offload.store import summary as store_summary
from jaxdata.sizes import available_memory, format_bytes
from jaxdata.tasks.gpt import (  # noqa: F401  (the trainer's names for them)
  BASE_LEARNING_RATE,
  BASE_WIDTH,
  GPTTrainConfig,
  data_of,
  held_out,
  make_optimizer,
  token_chain,
)
from jaxdata.train.common import (
  TrainResult,
  add_offload_arguments,
  add_out_argument,
  add_resume_arguments,
  check_offload_arguments,
  describe_plan,
  device_mesh,
  devices_flag,
  fit_epochs,
  mistakes,
  position,
  progress,
  psum_flat,
  refuse_resuming,
  resumer,
  save_due,
  save_result,
  say_saved,
  sharded_jit,
)

LayerPlan = Sequence[Hashable]
#: Makes a plan for a freshly built model and its input shape (batch, seq).
Planner = Callable[[GPT, tuple[int, int]], LayerPlan]
#: `jaxdata train gpt` runs as one of several processes (`jaxdata.distributed`).
MULTI_PROCESS = True


def _mesh(config) -> Mesh:
  return device_mesh(config.devices, what="GPTTrainConfig")


def _steps(graphdef, mesh: Mesh, plan: tuple | None):
  """(step, evaluate): jitted data-parallel functions of the (model, optimizer) state.

  step(state, tokens) -> (state, loss): each device takes its rows of tokens (global batch,
  seq + 1), computes its mean loss and gradients under `plan`, the gradients and losses are
  averaged in one all-reduce, and each device applies the same AdamW update to its replicated
  copy. evaluate(state, batches) -> mean loss over batches (n, global batch, seq + 1).
  shard_map does not check varying axes here: a replicated parameter's gradient stays each
  device's own until `psum_flat(..., mean=True)` averages it (with the check, JAX would sum
  it per leaf).
  """

  def step(state, tokens):
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(lambda m: m.loss(tokens, plan))(model)
    loss, grads = psum_flat((loss, grads), "data", mean=True)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss

  def evaluate(state, batches):
    model, _ = nnx.merge(graphdef, state)
    return jax.lax.pmean(jnp.mean(jax.lax.map(model.loss, batches)), "data")

  return (
    sharded_jit(step, mesh, (P(), P("data")), (P(), P()), donate_argnums=0),
    sharded_jit(evaluate, mesh, (P(), P(None, "data")), P()),
  )


def train(
  config: GPTTrainConfig = GPTTrainConfig(),  # noqa: B008  (frozen)
  *,
  plan: LayerPlan | Planner | None = None,
  on_step: Callable[[int, int], None] | None = None,
  on_log: Callable[[dict], None] | None = None,
  resume: Callable[[nnx.Module, nnx.Optimizer], list[dict]] | None = None,
  save_every: int = 0,
  on_save: Callable[[TrainResult], None] | None = None,
) -> TrainResult:
  """Trains a GPT on next-token prediction over a synthetic Markov chain.

  Args:
    config: the run.
    plan: None (plain), one remat policy per layer, or a function (model, (batch, seq)) -> plan
      called once on the freshly built model (where a planner measures its blocks).
    on_step: on_step(done, total) after each dispatched step (progress bars).
    on_log: called with each logged record (every `log_every` steps and at the last).
    resume: ``resume(model, optimizer) -> history``, a saved run's state put into the fresh
      model and optimizer (`common.resumer`); training goes on from the step after the last
      record's, with the batches a run never stopped would take, to its parameters. Its
      `start_loss` is the held-out loss where the resumed part starts.
    save_every, on_save: `on_save(result)` gets the run so far every `save_every` steps (a
      record is logged there).
  Resuming and saving: one device, no plan.
  """
  chain = token_chain(config)
  data = chain.batches(config.batch, config.seq, seed=config.seed + 1)
  mesh = _mesh(config)
  ndev = mesh.devices.size
  if config.batch % ndev:
    raise ValueError(
      f"train: the batch of {config.batch} sequences does not split evenly over {ndev} devices"
    )
  if (resume is not None or save_every) and (plan is not None or ndev != 1):
    raise ValueError("train: resume and save_every are for one device, without a plan")
  model = GPT(config.model_config(), rngs=nnx.Rngs(config.seed))
  if callable(plan):
    plan = plan(model, (config.batch // ndev, config.seq))  # one device's share
  if plan is not None:
    plan = list(plan)
    if len(segments(plan, config.layers)) > 1:  # (fails early on a plan of the wrong length)
      model.split_layers(plan)  # one parameter stack per segment: no copies inside the step
  optimizer = nnx.Optimizer(model, make_optimizer(config), wrt=nnx.Param)
  history = [] if resume is None else list(resume(model, optimizer))
  first = position(history, "step")[0]
  for _ in range(first - 1):  # the batches the saved run took
    next(data)
  graphdef, state = nnx.split((model, optimizer))
  step, evaluate_on = _steps(graphdef, mesh, None if plan is None else tuple(plan))
  replicated, by_rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  state = distributed.put(state, replicated)
  held_out_batches = distributed.put(
    np.asarray(held_out(config, chain)), NamedSharding(mesh, P(None, "data"))
  )

  def held_out_loss(state) -> float:
    return float(distributed.local_value(evaluate_on(state, held_out_batches)))

  log_every = config.log_every or max(1, config.steps // 10)
  tokens_per_step = config.batch * config.seq
  start_loss = held_out_loss(state)
  window = []  # the losses of the steps since the last record
  start = t0 = time.perf_counter()
  compile_seconds = evaluating = 0.0

  def run_step(i: int) -> dict | None:
    """Step i, and its record where one is due: every `log_every` steps, at the last, at a stop
    and before a save."""
    nonlocal state, t0, compile_seconds, evaluating
    state, loss = step(state, distributed.put(next(data), by_rows))
    window.append(loss)
    if i == first:
      jax.block_until_ready(loss)
      compile_seconds = time.perf_counter() - t0  # the first step includes tracing and compiling
    if on_step:
      on_step(i, config.steps)
    due = on_save is not None and save_due(save_every, i, config.steps)
    if i % log_every and i != config.steps and not command.stop_requested() and not due:
      return None
    losses = np.asarray(distributed.local_value(window), np.float64)  # waits for the window
    seconds = time.perf_counter() - t0
    record = dict(
      loss=float(losses.mean()),
      seconds=seconds,
      tokens_per_second=len(losses) * tokens_per_step / seconds,
    )
    e0 = time.perf_counter()  # the held-out loss, every record (not counted as training time)
    record["val_loss"] = held_out_loss(state)
    evaluating += time.perf_counter() - e0
    window.clear()
    t0 = time.perf_counter()
    return record

  def result(history, metrics, seconds) -> TrainResult:
    local = state  # replicated over the mesh: this process's own copy, on its first device
    if ndev > 1:
      local = jax.device_put(distributed.local_value(state), jax.local_devices()[0])
    nnx.update((model, optimizer), local)
    return TrainResult(model, history, metrics, seconds, optimizer, plan)

  history = fit_epochs(
    config.steps,
    run_step,
    result,
    history=history,
    unit="step",
    on_epoch=on_log,
    save_every=save_every,
    on_save=on_save,
    measure_saves=False,
  ).history
  total = time.perf_counter() - start - evaluating
  ran = history[-1]["step"] - first + 1  # the last step is always logged (also when stopped)
  rest = max(total - compile_seconds, 1e-9)  # the steps after the first, which compiled
  metrics = dict(
    start_loss=start_loss,
    final_loss=history[-1]["val_loss"],
    train_loss=history[-1]["loss"],
    entropy=chain.entropy(),
    uniform_loss=math.log(config.vocab),
    steps=history[-1]["step"],
    seconds=total,
    compile_seconds=compile_seconds,
    # one step is the compiling one: no steady-state speed to report
    step_ms=1e3 * rest / (ran - 1) if ran > 1 else None,
    tokens_per_second=(ran - 1) * tokens_per_step / rest if ran > 1 else None,
  )
  return TrainResult(model, history, metrics, total, optimizer, plan)


def save(path: str, result: TrainResult, config: GPTTrainConfig) -> str:
  """Saves a trained GPT as a checkpoint (`jaxdata.tasks.checkpoint`): layers split for a plan
  are joined first; the optimizer state goes with it where the layers were never split."""
  if split := isinstance(result.model.blocks, nnx.List):
    result.model.split_layers(None)
  step = result.history[-1]["step"] if result.history else 0
  joined = dataclasses.replace(result, optimizer=None) if split else result
  return save_result(path, "gpt", joined, config, data_of(config), step=step)


# ----------------------------------------------------------------------------- the CLI


def add_arguments(parser):
  """`jaxdata train gpt` options."""
  d = GPTTrainConfig()
  parser.add_argument("--layers", type=command.positive_int, default=d.layers, help="layers")
  parser.add_argument("--hidden", type=command.positive_int, default=d.hidden, help="model width")
  parser.add_argument(
    "--heads",
    type=command.positive_int,
    default=d.heads,
    help="attention heads (--hidden must be a multiple)",
  )
  parser.add_argument("--seq", type=command.positive_int, default=d.seq, help="tokens per sequence")
  parser.add_argument(
    "--batch-size",
    type=command.positive_int,
    default=d.batch,
    help="sequences per step, over all devices of all processes (each device takes an equal share)",
  )
  parser.add_argument(
    "--devices",
    type=command.natural_int,
    default=1,
    help="data parallel over this many local devices per process (0: all)",
  )
  parser.add_argument("--vocab", type=command.integer(2), default=d.vocab, help="vocabulary")
  parser.add_argument("--steps", type=command.positive_int, default=d.steps, help="training steps")
  parser.add_argument(
    "--lr",
    type=command.positive_float,
    default=d.learning_rate,
    help=f"peak learning rate (default: {BASE_LEARNING_RATE:g} up to hidden {BASE_WIDTH}, "
    f"times {BASE_WIDTH} / hidden above)",
  )
  parser.add_argument("--seed", type=command.seed, default=d.seed, help="seed of data and model")
  parser.add_argument(
    "--dtype",
    choices=("float32", "bfloat16"),
    default=d.dtype,
    help="compute dtype (parameters stay float32)",
  )
  parser.add_argument(
    "--loss-chunk",
    type=command.natural_int,
    default=d.loss_chunk,
    metavar="N",
    help="cross entropy in chunks of N positions: the float32 logits of one "
    "chunk are live at a time, recomputed in the backward pass (0: all at "
    "once)",
  )
  parser.add_argument(
    "--log-every",
    type=command.positive_int,
    default=None,
    help="steps between printed records (default steps / 10)",
  )
  add_offload_arguments(
    parser,
    planned="jaxdata.nn.gpt_plan.plan_for_model",
    policies="recompute, keep[dots], offload[attn], offload[mlp]+in, offload[in], ...",
    per_device="per device (the plan is made for one device's share of the batch)",
  )
  add_out_argument(parser, "gpt")
  add_resume_arguments(parser, unit="steps")


#: The RAM tier a planning store opens with when --ram is not given; `_sized_store` sizes the
#: training store for the plan.
PLANNING_RAM = 1 << 30
#: The share of the host's available memory a RAM tier sized for a plan may take.
HOST_SHARE = 0.8


def _sized_store(plan, model, batch_shape, args, stores, final: list, console) -> list:
  """`plan` over a store whose RAM tier holds what it offloads in a step (`final[-1]`, the
  store the plan's policies use). --ram is an upper bound: a plan that offloads more than it
  holds needs --ssd-dir for the rest (UsageError otherwise). Without --ram the tier is as large
  as the plan needs, if the host has that much available (`HOST_SHARE` of it; UsageError
  otherwise, or the rest to --ssd-dir): a larger store opens in `stores` and the policies are
  rebuilt over it by name."""

  store = final[-1]
  devices = len(jax.local_devices()) if args.devices in (None, 0) else args.devices
  need = offloaded_bytes(model, batch_shape, plan, store) * devices
  if need <= store.ram_bytes or (args.ssd_dir and args.ram is not None):
    return list(plan)
  ask = f"the plan offloads {format_bytes(need)} per step in this process ({devices} device(s))"
  if args.ram is not None:
    raise command.UsageError(
      f"argument --ram: {ask}, more than --ram {format_bytes(args.ram)} holds: give a larger "
      "--ram, --ssd-dir for the rest, or a larger --budget"
    )
  room = int(HOST_SHARE * available_memory())
  size = need + need // 16 + (64 << 20)  # each spill rounds up to the arena's alignment
  if size > room and not args.ssd_dir:
    raise command.UsageError(
      f"argument --budget: {ask}, more than {format_bytes(room)} ({HOST_SHARE:.0%} of the host "
      "memory available now) can hold: a larger --budget keeps more on the device, or give "
      "--ssd-dir for what RAM cannot hold"
    )
  size = min(size, room)
  console.print(
    f"offload store: {format_bytes(size)} of pinned RAM for {format_bytes(need)} per step"
  )
  bigger = stores.enter_context(
    TensorStore(ram_bytes=size, ssd_dir=args.ssd_dir, device_bytes=store.device_bytes)
  )
  final.append(bigger)
  return [policy_named(str(p), bigger) for p in plan]


def _agreed(plan: LayerPlan | None, store, failed: bool = False) -> list | None:
  """Process 0's plan (and its store's spill cap), in every process: each process holds its
  own TensorStore, so the policies are rebuilt over it from their names. With one process,
  `plan` itself. Other processes pass None (they did not plan). None in every process where
  process 0 says it `failed` (so that all stop, rather than wait for it)."""
  if jax.process_count() == 1:
    return None if failed else list(plan)

  width = 64  # bytes per policy name ("offload[proj]+in" is 16)
  text = "\n".join(str(p) for p in plan).encode() if plan is not None else b""
  n = -1 if failed else len(plan) if plan is not None else 0
  size = multihost_utils.broadcast_one_to_all(np.int32(n))
  if int(size) < 0:
    return None
  buf = np.zeros(int(size) * width, np.uint8)
  buf[: len(text)] = np.frombuffer(text, np.uint8)
  cap = np.int64(store.device_bytes)
  buf, cap = multihost_utils.broadcast_one_to_all((buf, cap))
  names = np.asarray(buf).tobytes().rstrip(b"\0").decode().split("\n")
  if plan is None:
    plan = [policy_named(name, store) for name in names]
    if int(cap):
      store.device_bytes = int(cap)
  return list(plan)


def main(args) -> int:
  check_offload_arguments(args)
  console = command.console()
  console.quiet = not distributed.is_primary()  # one process reports for the job
  with mistakes():  # a setting the flags' own checks cannot see (hidden % heads)
    config = GPTTrainConfig(
      layers=args.layers,
      hidden=args.hidden,
      heads=args.heads,
      seq=args.seq,
      batch=args.batch_size,
      vocab=args.vocab,
      steps=args.steps,
      learning_rate=args.lr,
      seed=args.seed,
      dtype=args.dtype,
      log_every=args.log_every,
      loss_chunk=args.loss_chunk,
      devices=devices_flag(args.devices),
    )
    ndev = _mesh(config).devices.size
    if config.batch % ndev:
      raise ValueError(
        f"argument --batch-size: {config.batch} sequences do not split evenly over {ndev} devices"
      )
  refuse_resuming(
    args, args.offload or ndev * jax.process_count() != 1, "for one device, without --offload"
  )
  data = data_of(config)
  console.print(
    f"[bold]GPT[/] {config.layers} layers, hidden {config.hidden}, {config.heads} "
    f"heads, seq {config.seq}, vocab {config.vocab} | batch {config.batch}, "
    f"{config.steps} steps, {config.dtype} on {jax.devices()[0].platform} x {ndev}"
    + (" | offload" if args.offload else "")
  )

  def run(plan):
    with progress(console, "step", config.steps) as update:

      def on_step(done, total):
        update(completed=done, total=total)

      def on_log(r):
        update(metrics=f"loss {r['loss']:.4f}")
        console.print(
          f"step {r['step']:5d}  loss {r['loss']:.4f}  "
          f"held-out loss {r['val_loss']:.4f}  {r['tokens_per_second']:,.0f} tokens/s"
        )

      return train(
        config,
        plan=plan,
        on_step=on_step,
        on_log=on_log,
        resume=resumer(args.resume, kind="gpt", config=config, data=data, length="steps"),
        save_every=args.save_every or 0,
        on_save=lambda r: save(args.out, r, config),
      )

  if args.offload:
    # Planning probes the store; its RAM tier is sized for the plan afterwards (`_sized_store`).
    ram = PLANNING_RAM if args.ram is None else args.ram
    with contextlib.ExitStack() as stores:
      stores.enter_context(store := TensorStore(ram_bytes=ram, ssd_dir=args.ssd_dir))
      probed, final = {}, [store]
      if args.plan == "auto":

        def planner(model, batch_shape):  # process 0 plans for one device's share
          plan, failure = None, None
          if distributed.is_primary():
            try:
              plan = plan_for_model(model, batch_shape, budget_bytes=args.budget, store=store)
            except ValueError as e:  # no plan fits: every process must stop, not only this one
              failure = e
          plan = _agreed(plan, store, failed=failure is not None)
          if failure is not None or plan is None:
            raise command.UsageError(f"argument --budget: {failure or 'process 0 found no plan'}")
          console.print(
            f"plan under {args.budget:,} bytes per device (batch {batch_shape[0]} "
            f"per device): {describe_plan(plan)}",
            markup=False,
          )
          probed.update(store.stats())  # the planner's bandwidth probe spilled too
          return _sized_store(plan, model, batch_shape, args, stores, final, console)
      else:
        with mistakes("--plan"):
          policy = policy_named(args.plan, store)

        def planner(model, batch_shape):
          plan = [policy] * config.layers
          return _sized_store(plan, model, batch_shape, args, stores, final, console)

      result = run(planner)
      console.print(
        store_summary(final[-1].stats(), probed)
        + (" (process 0's store)" if jax.process_count() > 1 else ""),
        markup=False,
      )
  else:
    result = run(None)
  m = result.metrics
  console.print(
    f"[bold]held-out loss {m['start_loss']:.4f} -> {m['final_loss']:.4f}[/] "
    f"(entropy floor {m['entropy']:.4f}, uniform {m['uniform_loss']:.4f}) | "
    f"{m['seconds']:.1f} s, compile {m['compile_seconds']:.1f} s, "
    + (
      f"{m['step_ms']:.1f} ms/step, {m['tokens_per_second']:,.0f} tokens/s"
      if m["step_ms"] is not None
      else "no speed: the one step was the compiling one"
    )
  )
  save(args.out, result, config)  # every process takes part; Orbax writes once
  say_saved(console, args.out)
  return 0
