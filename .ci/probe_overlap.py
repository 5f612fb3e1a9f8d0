"""How much of a mini-batch HGT step's data path the pipelined step hides (issue 16, item 4).

On synthetic_mag (default scale 1), fanouts 10,10, 1024 seed papers, HGT hidden 64, the
GPU-centric pipeline, `train.attention.minibatch.make_steps`' programs, each queued `steps`
times back to back (wall ms per call, nnx.jit's dispatch included, as the trainer runs them):

- unpipelined: `Steps.step` (sample, gather, model; one program, one stream);
- pipelined: `Steps.pipelined`, batch i + 1 prepared under compute_on("gpu_stream:1");
- pipelined, no annotation: the same program with the prefetch on XLA's one stream (what the
  restructuring alone costs or saves);
- data path alone: `Steps.prepare` (sampling + feature gathers);
- model alone: `Steps.compute` on a prepared batch (forward, backward, Adam).

hidden = (unpipelined - pipelined) / data path: 1 means the data path is free, 0 nothing gained.
First the compiled HLO of the pipelined step: the stream annotation and the async start / done
pair XLA makes of it (found or not); last the pipelined step's GPU kernel time per stream
(JAX's profiler): kernels on two streams, and a GPU busy span shorter than their sum, are the
overlap itself. Every part runs under its own try/except: one failure does not lose the rest.

    python3 .ci/probe_overlap.py [scale] [steps]
"""

import collections
import glob
import re
import shutil
import sys
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxdata.data import synthetic_mag
from jaxdata.host import sparse
from jaxdata.train.attention import TrainConfig, build_model, is_table
from jaxdata.train.attention import minibatch as hetero


def timed(call, steps):
  """Wall ms per call of `steps` calls queued back to back, after one warm-up call;
  `call(i)` runs call i and returns what to wait for."""
  jax.block_until_ready(call(0))
  t0 = time.perf_counter()
  out = [call(i) for i in range(1, steps + 1)]
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) / steps * 1e3


def attempt(what, fn, *args):
  """fn(*args), or None after printing the error (the probe goes on)."""
  try:
    return fn(*args)
  except Exception:  # noqa: BLE001  a probe reports every failure and carries on
    print(f"[{what}] FAILED:")
    traceback.print_exc(limit=6)
    sys.stdout.flush()
    return None


def hlo_report(text):
  """What the compiled pipelined step says about the second stream."""
  marks = {
    "stream annotation (_xla_stream_annotation)": "_xla_stream_annotation",
    "async start": r"\b(async-start|call-start)\b|-start\(",
    "async done": r"\b(async-done|call-done)\b|-done\(",
    "operation_queue_id (XLA's stream id)": "operation_queue_id",
  }
  for name, pattern in marks.items():
    hits = [line.strip() for line in text.splitlines() if re.search(pattern, line)]
    hits.sort(key=lambda line: not re.search(r" call\(|start|done", line))  # calls first
    print(f"  {name}: {'found' if hits else 'NOT found'} ({len(hits)} lines)")
    for line in hits[:3]:
      print(f"    {line[:220]}")


def stream_profile(call, runs=5):
  """Per GPU stream (profiler line), kernel ms per call; and the GPU's busy span per call."""
  from jax.profiler import ProfileData  # pylint: disable=g-import-not-at-top

  jax.block_until_ready(call(0))
  trace = tempfile.mkdtemp()
  jax.profiler.start_trace(trace)
  try:
    jax.block_until_ready([call(i) for i in range(1, runs + 1)])
  finally:
    jax.profiler.stop_trace()
  per_line, intervals = collections.defaultdict(float), []
  for path in glob.glob(f"{trace}/**/*.xplane.pb", recursive=True):
    for plane in ProfileData.from_file(path).planes:
      if not plane.name.startswith("/device:GPU"):
        continue
      for line in plane.lines:
        for e in line.events:
          per_line[line.name] += e.duration_ns
          start = getattr(e, "start_ns", None)
          if start is not None:
            intervals.append((start, start + e.duration_ns))
  shutil.rmtree(trace, ignore_errors=True)
  for name, ns in sorted(per_line.items(), key=lambda kv: -kv[1]):
    print(f"  {ns / runs / 1e6:8.3f} ms/step  {name}")
  if intervals:  # union of the kernels' intervals: time some kernel was running
    intervals.sort()
    busy, (lo, hi) = 0, intervals[0]
    for a, b in intervals[1:]:
      if a > hi:
        busy, (lo, hi) = busy + hi - lo, (a, b)
      else:
        hi = max(hi, b)
    busy += hi - lo
    total = sum(b - a for a, b in intervals)
    print(
      f"  kernel time {total / runs / 1e6:.3f} ms/step, GPU busy {busy / runs / 1e6:.3f} "
      f"ms/step: {(total - busy) / runs / 1e6:.3f} ms/step of kernels ran concurrently"
    )


def main():
  scale = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
  steps = int(sys.argv[2]) if len(sys.argv) > 2 else 30
  print("jax", jax.__version__, jax.devices(), "prefetch stream:", hetero.prefetch_stream())
  t0 = time.perf_counter()
  ds = synthetic_mag(scale=scale, num_classes=349 if scale >= 0.3 else 8)
  print(f"synthetic_mag scale {scale} in {time.perf_counter() - t0:.1f} s")
  config = TrainConfig(model="hgt", hidden=64)
  model = build_model(ds, config, nnx.Rngs(0), tables=False)
  dense = nnx.All(nnx.Param, nnx.Not(is_table))
  optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=dense)
  table_opt = sparse.BY_NAME["adam"](1e-3)
  fanouts, batch = (10, 10), 1024
  rng = np.random.default_rng(0)
  train = np.asarray(ds.train_papers) + ds.node_range("paper")[0]
  n = steps + 2  # batches, used in turn (call i reads batches i and i + 1, modulo n)
  seeds = [
    jnp.asarray(rng.choice(train, batch, replace=len(train) < batch).astype(np.int32))
    for _ in range(n)
  ]
  keys = [jax.random.key(i) for i in range(n)]
  labels = jnp.asarray(ds.labels)
  with hetero.HostData(ds, "host") as data:
    states = []  # no embedding tables: every type has features
    consts = data.consts
    steps_on = hetero.make_steps(
      data, labels, fanouts, dense, table_opt, stream=hetero.PREFETCH_STREAM
    )
    steps_off = hetero.make_steps(data, labels, fanouts, dense, table_opt, stream=None)
    ms = {}

    def plain(i):
      return steps_on.step(model, optimizer, states, consts, seeds[i % n], keys[i % n])

    def pipelined_with(steps_):
      held = {}

      def call(i):
        if i == 0 or "batch" not in held:
          held["batch"] = steps_.prepare(consts, seeds[i % n], keys[i % n])
        j = (i + 1) % n
        *out, held["batch"] = steps_.pipelined(
          model, optimizer, states, consts, held["batch"], seeds[j], keys[j]
        )
        return out

      return call

    def data_path(i):
      return steps_on.prepare(consts, seeds[i % n], keys[i % n])

    prepared = attempt("prepare", lambda: jax.block_until_ready(data_path(0)))

    def model_only(i):
      return steps_on.compute(model, optimizer, states, consts, prepared)

    def hlo():  # the annotation named explicitly: on the CPU too, to see what XLA does there
      steps_ = (
        steps_on
        if hetero.prefetch_stream()
        else hetero.make_steps(
          data, labels, fanouts, dense, table_opt, stream=hetero.PREFETCH_STREAM
        )
      )
      batch = steps_.prepare(consts, seeds[0], keys[0])
      lowered = steps_.pipelined.lower(model, optimizer, states, consts, batch, seeds[1], keys[1])
      print(
        "lowered (StableHLO): stream annotation "
        + ("found" if "_xla_stream_annotation" in lowered.as_text() else "NOT found")
      )
      text = lowered.compile().as_text()
      print("compiled HLO of the pipelined step:")
      hlo_report(text)

    attempt("HLO", hlo)

    pieces = {
      "unpipelined step": plain,
      "pipelined step (next batch on gpu_stream:1)": pipelined_with(steps_on),
      "pipelined step, no stream annotation": pipelined_with(steps_off),
      "data path alone (sample + gathers)": data_path,
      "model alone (fwd + bwd + Adam)": model_only,
    }
    for name, call in pieces.items():
      if name.startswith("model") and prepared is None:
        continue
      t = time.perf_counter()
      got = attempt(name, timed, call, steps)
      if got is not None:
        ms[name] = got
        print(f"{name:48s} {got:8.2f} ms/step   ({time.perf_counter() - t:.0f} s with compile)")
      sys.stdout.flush()

    un = ms.get("unpipelined step")
    pipe = ms.get("pipelined step (next batch on gpu_stream:1)")
    dp = ms.get("data path alone (sample + gathers)")
    mo = ms.get("model alone (fwd + bwd + Adam)")
    if None not in (un, pipe, dp):
      print(
        f"hidden: (unpipelined - pipelined) / data path = ({un:.2f} - {pipe:.2f}) / "
        f"{dp:.2f} = {(un - pipe) / dp:.1%} of the data path"
      )
    if None not in (un, dp, mo):
      print(
        f"unpipelined {un:.2f} against data path + model {dp + mo:.2f} ms; the floor a "
        f"perfect overlap reaches: max(data path, model) = {max(dp, mo):.2f} ms"
      )

    print("pipelined step, GPU kernel time per stream (profiler lines):")
    attempt("profile", stream_profile, pipelined_with(steps_on))
    print("unpipelined step, GPU kernel time per stream:")
    attempt("profile", stream_profile, plain)


if __name__ == "__main__":
  main()
