"""`jaxdata launch -n N -- train sage ...`: one jax.distributed job of N processes on this machine.

Starts N copies of `python -m jaxdata.cli train ... --coordinator localhost:PORT --num-processes
N --process-id I` (a free port is picked), prefixes each output line with `[I]`, and waits. When
one process fails, the others are stopped and the launcher returns that first non-zero exit
code; when all succeed, 0. SIGINT (Ctrl-C) and SIGTERM to the launcher are passed on to every
process, which stops where it is (`jaxdata.cli`), and the launcher waits for them all (SIGKILL
after `GRACE` seconds) and returns 128 + the signal's number. `--devices-per-process K` gives
every process K CPU devices (`XLA_FLAGS=--xla_force_host_platform_device_count=K`), which is how
CI tests multi-process training without GPUs:

    jaxdata launch -n 2 --devices-per-process 2 -- train sage --devices 0 --epochs 1

On a machine with GPUs, each process gets its own share of them (`CUDA_VISIBLE_DEVICES`): NCCL,
which carries JAX's collectives between GPUs, refuses two processes on one GPU ("Duplicate GPU
detected", measured on the H200 machine), so more processes than GPUs is a usage error here
rather than a crash inside the first collective. CPU processes are bounded by the CPU cores
(`-n` above them is a usage error unless `--force`).

On several hosts, start one process per host with the same flags (or `--distributed auto` under
SLURM, Open MPI or Kubernetes): see docs/distributed.md.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from jaxdata import command

#: Seconds a stopped process gets between SIGTERM and SIGKILL.
GRACE = 5.0


def add_arguments(parser) -> None:
  parser.add_argument(
    "-n",
    "--num-processes",
    type=command.positive_int,
    required=True,
    metavar="N",
    help="processes to start",
  )
  parser.add_argument(
    "--devices-per-process",
    type=command.positive_int,
    default=None,
    metavar="K",
    help="give each process K CPU devices (XLA_FLAGS=--xla_force_"
    "host_platform_device_count=K; CPU testing)",
  )
  parser.add_argument(
    "--force",
    action="store_true",
    help="start more CPU processes than this machine has CPU cores (they share the cores)",
  )
  parser.add_argument(
    "--port",
    type=command.integer(0, 65535),
    default=0,
    help="the coordinator's port on localhost (0: a free one)",
  )
  parser.add_argument(
    "argv",
    nargs=argparse.REMAINDER,
    metavar="-- train MODEL ...",
    help="the jaxdata command each process runs",
  )


def free_port() -> int:
  """A TCP port on localhost that nothing listens on now."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _xla_flags(existing: str, k: int) -> str:
  kept = [f for f in existing.split() if not f.startswith("--xla_force_host_platform_device_count")]
  return " ".join(kept + [f"--xla_force_host_platform_device_count={k}"])


def visible_gpus(env: dict) -> list[str]:
  """The GPUs the launched processes would see: `CUDA_VISIBLE_DEVICES`'s entries when it is set,
  else the indices `nvidia-smi` lists; none when `JAX_PLATFORMS` leaves CUDA out or no GPU (or no
  nvidia-smi) is found."""
  platforms = env.get("JAX_PLATFORMS", "")
  if platforms and not {"cuda", "gpu"} & {p.strip() for p in platforms.split(",")}:
    return []
  if "CUDA_VISIBLE_DEVICES" in env:
    return [
      d
      for d in (x.strip() for x in env["CUDA_VISIBLE_DEVICES"].split(","))
      if d and not d.startswith("-")
    ]
  try:
    out = subprocess.run(
      ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
      capture_output=True,
      text=True,
      timeout=30,
    )
  except (OSError, subprocess.TimeoutExpired):
    return []
  return out.stdout.split() if out.returncode == 0 else []


def cpu_cores() -> int:
  """The CPU cores this process may run on (its affinity mask, where the system has one)."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # not Linux
    return os.cpu_count() or 1


def _check_cpu_processes(num_processes: int, force: bool) -> None:
  """UsageError naming -n where more CPU processes are asked for than there are cores, unless
  `force`: each runs XLA's CPU thread pools, and a job of more processes than cores crawls."""
  cores = cpu_cores()
  if num_processes > cores and not force:
    raise command.UsageError(
      f"argument -n: {num_processes} processes but {cores} CPU core(s) here: start at most "
      f"{cores}, or give --force to share the cores among more"
    )


def process_envs(
  env: dict, num_processes: int, devices_per_process: int | None, force: bool = False
) -> list[dict]:
  """Each process's environment: K CPU devices each under `devices_per_process`; otherwise, on a
  machine with GPUs, an equal share of them each (`CUDA_VISIBLE_DEVICES`; GPUs left over when
  the count does not divide stay unused). UsageError where `num_processes` exceeds the GPUs, or
  for CPU processes the CPU cores (unless `force`)."""
  env = dict(env, PYTHONUNBUFFERED="1", JAXDATA_LAUNCHED="1")  # JAXDATA_LAUNCHED: distributed.py
  if devices_per_process:
    _check_cpu_processes(num_processes, force)
    env["XLA_FLAGS"] = _xla_flags(env.get("XLA_FLAGS", ""), devices_per_process)
    return [env] * num_processes
  gpus = visible_gpus(env)
  if not gpus:
    _check_cpu_processes(num_processes, force)
    return [env] * num_processes
  if num_processes > len(gpus):  # --force cannot help: NCCL would refuse them
    raise command.UsageError(
      f"argument -n: {num_processes} processes but {len(gpus)} GPU(s) here: NCCL runs one "
      f"process per GPU (it refuses two on one GPU); start at most {len(gpus)}, or run CPU "
      f"processes with --devices-per-process"
    )
  k = len(gpus) // num_processes
  return [
    dict(env, CUDA_VISIBLE_DEVICES=",".join(gpus[i * k : (i + 1) * k]))
    for i in range(num_processes)
  ]


def _pump(i: int, stream, lock: threading.Lock) -> None:
  for line in stream:
    with lock:
      sys.stdout.write(f"[{i}] {line if line.endswith(chr(10)) else line + chr(10)}")
      sys.stdout.flush()
  stream.close()


def _stop(procs: list[subprocess.Popen], signum: int, lock: threading.Lock) -> None:
  """Sends `signum` to the processes still running and waits for them, GRACE seconds, then
  SIGKILL; a signal to the launcher while it waits kills them at once: none is left running."""
  for p in procs:
    if p.poll() is None:
      p.send_signal(signum)
  deadline = time.monotonic() + GRACE
  try:
    for i, p in enumerate(procs):
      try:
        p.wait(max(0.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        with lock:
          print(
            f"jaxdata launch: process {i} did not stop within {GRACE:g} s of "
            f"{signal.Signals(signum).name}; killing it",
            file=sys.stderr,
            flush=True,
          )
        p.kill()
        p.wait()
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()


def run(
  argv: list[str],
  num_processes: int,
  devices_per_process: int | None = None,
  port: int = 0,
  force: bool = False,
) -> int:
  """Runs `jaxdata <argv>` as `num_processes` processes of one job; returns the exit code.
  `force`: start more CPU processes than there are CPU cores."""
  if argv and argv[0] == "--":
    argv = argv[1:]
  if not argv:
    raise command.UsageError(
      "give the command to run after --, e.g. `jaxdata launch -n 2 -- train sage`"
    )
  if argv[0] != "train":
    raise command.UsageError(
      f"launch runs train commands (e.g. `jaxdata launch -n 2 -- train sage`), not `{argv[0]}`"
    )
  taken = {"--coordinator", "--num-processes", "--process-id", "--distributed"}
  if clash := sorted(a.split("=")[0] for a in argv if a.split("=")[0] in taken):
    raise command.UsageError(f"the launcher sets {', '.join(clash)} itself: leave it out")
  envs = process_envs(dict(os.environ), num_processes, devices_per_process, force)
  address = f"localhost:{port or free_port()}"
  lock = threading.Lock()
  procs, pumps = [], []
  stop_with = signal.SIGTERM  # what stops the others once one fails
  try:
    for i in range(num_processes):
      cmd = [
        sys.executable,
        "-m",
        "jaxdata.cli",
        *argv,
        "--coordinator",
        address,
        "--num-processes",
        str(num_processes),
        "--process-id",
        str(i),
      ]
      p = subprocess.Popen(
        cmd,
        env=envs[i],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
      )
      procs.append(p)
      with lock:
        print(f"jaxdata launch: process {i} is pid {p.pid}", file=sys.stderr, flush=True)
      pumps.append(threading.Thread(target=_pump, args=(i, p.stdout, lock), daemon=True))
      pumps[-1].start()
    code = 0
    while code == 0:
      codes = [p.poll() for p in procs]  # every process, every time (not any(): it stops early)
      failed = [(i, c) for i, c in enumerate(codes) if c]
      if not failed and all(c == 0 for c in codes):
        break
      if failed:
        i, code = failed[0]
        with lock:
          print(
            f"jaxdata launch: process {i} exited with code {code}; stopping the others",
            file=sys.stderr,
            flush=True,
          )
      else:
        time.sleep(0.05)
  except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (command.Terminated): passed on
    stop_with = getattr(e, "signum", signal.SIGINT)
    code = 128 + stop_with
    with lock:
      print(
        f"jaxdata launch: {signal.Signals(stop_with).name}: passed on to the "
        f"{len(procs)} processes; stopping",
        file=sys.stderr,
        flush=True,
      )
  finally:
    _stop(procs, stop_with, lock)
    for t in pumps:
      t.join(1.0)
  return code if code >= 0 else 128 - code  # killed by signal S: 128 + S, as a shell reports


def main(args) -> int:
  return run(args.argv, args.num_processes, args.devices_per_process, args.port, args.force)
