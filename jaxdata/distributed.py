"""Starting one of N cooperating processes, JAX's way: `jax.distributed.initialize`.

Every `jaxdata train ...` command takes the same flags (`add_arguments`) and calls `initialize`
before anything touches a JAX backend (`jaxdata.cli.main` does it):

    jaxdata train sage --coordinator host0:1234 --num-processes 2 --process-id 0   # on host0
    jaxdata train sage --coordinator host0:1234 --num-processes 2 --process-id 1   # on host1
    jaxdata train sage --distributed auto     # SLURM, Open MPI, Kubernetes: JAX detects them
    jaxdata launch -n 2 -- train sage ...     # N local processes (`jaxdata.launch`)

With none of these, nothing is initialized and the run is the single-process run of before.

Where the flags are not given, the environment supplies them: `JAX_COORDINATOR_ADDRESS` (which
`jax.distributed.initialize` itself reads, as well as `JAX_LOCAL_DEVICE_IDS` and
`JAX_COORDINATOR_BIND_ADDRESS`), and `JAX_NUM_PROCESSES` / `JAX_PROCESS_ID` (which JAX 0.10 does
not read: jaxdata does, so that one environment describes the whole job).

A peer that never comes, or dies, ends the run with an error instead of a hang: `--distributed-
timeout SECONDS` bounds both the wait for every process to join (`initialization_timeout`) and
how long a silent process counts as alive (`heartbeat_timeout_seconds`).

On the CPU backend, collectives across processes need an implementation: `initialize` selects
gloo (`jax_cpu_collectives_implementation`), so multi-process runs can be tested without GPUs
(`XLA_FLAGS=--xla_force_host_platform_device_count=K` gives each process K CPU devices).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import sys
import time
from typing import Any

from jaxdata import command

#: Seconds to wait for all processes to join, and for a silent peer to count as dead.
DEFAULT_TIMEOUT = 60


@dataclasses.dataclass(frozen=True)
class Setup:
  """How this process takes part: `num_processes == 1` and `mode is None` is a plain run."""

  mode: str | None = None  # None: single process; "explicit": coordinator etc.; "auto": detected
  coordinator: str | None = None
  num_processes: int = 1
  process_id: int = 0
  timeout: int = DEFAULT_TIMEOUT

  @property
  def multi_process(self) -> bool:
    return self.mode is not None


def _address(text: str) -> str:
  host, sep, port = text.rpartition(":")
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT (e.g. localhost:1234)")
  return text


def add_arguments(parser) -> None:
  """The flags that make a command one of N processes (see the module's docstring)."""
  group = parser.add_argument_group(
    "multi-process (jax.distributed)", "with none of these, one process; see docs/distributed.md"
  )
  group.add_argument(
    "--coordinator",
    type=_address,
    default=None,
    metavar="HOST:PORT",
    help="address of process 0's coordination service (env JAX_COORDINATOR_ADDRESS)",
  )
  group.add_argument(
    "--num-processes",
    type=command.positive_int,
    default=None,
    metavar="N",
    help="processes in the job (env JAX_NUM_PROCESSES)",
  )
  group.add_argument(
    "--process-id",
    type=command.natural_int,
    default=None,
    metavar="I",
    help="this process's index, 0..N-1 (env JAX_PROCESS_ID)",
  )
  group.add_argument(
    "--distributed",
    choices=("auto",),
    default=None,
    help="auto: let jax.distributed.initialize() detect the cluster (SLURM, Open MPI, Kubernetes)",
  )
  group.add_argument(
    "--distributed-timeout",
    type=command.positive_int,
    default=DEFAULT_TIMEOUT,
    metavar="SECONDS",
    help="wait this long for every process to join, and "
    "declare a silent process dead after this long",
  )


def _env_int(name: str) -> int | None:
  text = os.environ.get(name)
  if text is None or text == "":
    return None
  try:
    return int(text)
  except ValueError:
    raise command.UsageError(f"environment variable {name}={text!r} is not an integer") from None


def setup_from(args: Any) -> Setup:
  """The `Setup` that parsed flags (and the environment) ask for; checks them together."""
  timeout = getattr(args, "distributed_timeout", DEFAULT_TIMEOUT)
  if getattr(args, "distributed", None) == "auto":
    if any(
      getattr(args, a, None) is not None for a in ("coordinator", "num_processes", "process_id")
    ):
      raise command.UsageError(
        "--distributed auto detects the cluster: give it without "
        "--coordinator, --num-processes and --process-id"
      )
    return Setup(mode="auto", timeout=timeout)
  coordinator = getattr(args, "coordinator", None) or os.environ.get("JAX_COORDINATOR_ADDRESS")
  num = getattr(args, "num_processes", None)
  num = _env_int("JAX_NUM_PROCESSES") if num is None else num
  pid = getattr(args, "process_id", None)
  pid = _env_int("JAX_PROCESS_ID") if pid is None else pid
  if coordinator is None and num in (None, 1) and pid in (None, 0):
    return Setup(timeout=timeout)
  if num is None or pid is None or coordinator is None:
    missing = [
      flag
      for flag, v in (
        ("--coordinator", coordinator),
        ("--num-processes", num),
        ("--process-id", pid),
      )
      if v is None
    ]
    raise command.UsageError(
      f"a multi-process run needs --coordinator, --num-processes and "
      f"--process-id (or --distributed auto); missing {', '.join(missing)}"
    )
  if num < 1:
    raise command.UsageError(f"--num-processes must be at least 1, got {num}")
  if not 0 <= pid < num:
    raise command.UsageError(
      f"--process-id must be in 0..{num - 1} for --num-processes {num}, got {pid}"
    )
  try:
    _address(coordinator)
  except argparse.ArgumentTypeError as e:
    raise command.UsageError(f"--coordinator: {e}") from None
  return Setup(
    mode="explicit", coordinator=coordinator, num_processes=num, process_id=pid, timeout=timeout
  )


def _wait_for(address: str, timeout: float) -> None:
  """Returns once something accepts TCP connections at `address`; UsageError after `timeout`."""
  host, _, port = address.rpartition(":")
  deadline = time.monotonic() + timeout
  while True:
    try:
      with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
        return
    except OSError as e:
      if time.monotonic() >= deadline:
        raise command.UsageError(
          f"cannot reach the coordinator {address} within {timeout} s "
          f"({e.strerror or e}); is process 0 running there?"
        ) from None
      time.sleep(0.2)


def initialize(setup: Setup) -> Setup:
  """Joins the job `setup` describes (`jax.distributed.initialize`); nothing for a plain run.

  Must run before anything creates a JAX backend (`jax.devices()`, any computation). Returns the
  setup with the process count and index JAX reports (what auto-detection found). A coordinator
  that cannot be reached, or peers that do not join within `setup.timeout` seconds, raise
  `command.UsageError` naming the address.
  """
  if not setup.multi_process:
    return setup
  import jax  # pylint: disable=g-import-not-at-top
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top

  if getattr(xla_bridge, "_backends", None):
    raise RuntimeError(
      "jaxdata.distributed.initialize: a JAX backend already exists; "
      "initialize must run before any computation or jax.devices()"
    )
  # CPU collectives across processes: gloo (the CPU backend has none across processes without).
  try:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  except (AttributeError, KeyError, ValueError):  # a JAX without the option (or without gloo)
    pass
  kwargs = dict(
    initialization_timeout=setup.timeout,
    heartbeat_timeout_seconds=setup.timeout,
    shutdown_timeout_seconds=setup.timeout,
  )
  if setup.mode == "explicit":
    # JAX aborts the process (a fatal log, no exception) when it cannot reach the coordinator;
    # the peers look for it first, so that an unreachable address is a one-line error.
    if setup.process_id != 0:
      _wait_for(setup.coordinator, setup.timeout)
    print(
      f"jaxdata: process {setup.process_id} of {setup.num_processes} joining the job at "
      f"{setup.coordinator} (timeout {setup.timeout} s)",
      file=sys.stderr,
      flush=True,
    )
    kwargs.update(
      coordinator_address=setup.coordinator,
      num_processes=setup.num_processes,
      process_id=setup.process_id,
    )
  try:
    jax.distributed.initialize(**kwargs)
  except (RuntimeError, ValueError) as e:  # XlaRuntimeError is a RuntimeError
    where = (
      f"coordinator {setup.coordinator} (process {setup.process_id} of {setup.num_processes})"
      if setup.mode == "explicit"
      else "auto-detected cluster"
    )
    raise command.UsageError(
      f"jax.distributed.initialize failed for the {where} within "
      f"{setup.timeout} s: {_first_line(e)}"
    ) from None
  if setup.mode == "explicit":
    _check_same_count(setup)
  return dataclasses.replace(
    setup, num_processes=jax.process_count(), process_id=jax.process_index()
  )


def _check_same_count(setup: Setup) -> None:
  """Raises UsageError in every process when the processes were given different
  --num-processes: JAX takes process 0's count and says nothing (measured with jax 0.10.2: a
  process told 3 trains as one of 2), so each process's count is gathered and compared."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  asked = np.asarray(multihost_utils.process_allgather(np.int32(setup.num_processes))).reshape(-1)
  if (asked != jax.process_count()).any():
    said = ", ".join(f"process {i}: {int(n)}" for i, n in enumerate(asked))
    raise command.UsageError(
      f"--num-processes differs between the processes ({said}); the job "
      f"at {setup.coordinator} has {jax.process_count()} processes: give "
      f"every process the same --num-processes"
    )


def leave() -> bool:
  """Leaves the job this process joined (`jax.distributed.shutdown`); nothing outside one.
  Returns whether this process was in a job.

  JAX would do it at exit, from an `atexit` hook that runs while the interpreter finalizes: a
  run that stopped with an error there once left process 0 hanging past its shutdown timeout
  after it had printed the error (CI, jax 0.10.2). `jaxdata.cli.main` calls this before it
  returns, so every process meets the shutdown barrier with its threads still running.
  """
  jax_distributed = sys.modules.get("jax._src.distributed")  # never imports JAX itself
  if getattr(getattr(jax_distributed, "global_state", None), "client", None) is None:
    return False
  import jax  # pylint: disable=g-import-not-at-top

  try:
    jax.distributed.shutdown()
  except (RuntimeError, ValueError) as e:  # a peer gone already: the barrier times out
    print(f"jaxdata: leaving the job: {_first_line(e)}", file=sys.stderr, flush=True)
  return True


def _first_line(e: Exception) -> str:
  """An exception's first line (XLA's errors run to many), or its type where it has no text."""
  text = str(e).strip()
  return text.splitlines()[0] if text else type(e).__name__


def is_primary() -> bool:
  """Whether this is process 0 (the one that prints progress and writes checkpoints)."""
  import jax  # pylint: disable=g-import-not-at-top

  return jax.process_index() == 0


def local_value(tree: Any) -> Any:
  """NumPy copies of a pytree of fully replicated arrays, read from this process's own copy.

  `jax.device_get` refuses arrays that span other processes' devices; a replicated array has
  the whole value on each of this process's devices, so no collective is needed.
  """
  import jax  # pylint: disable=g-import-not-at-top

  def one(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      if not x.is_fully_replicated:
        raise ValueError(
          "jaxdata.distributed.local_value: the array is not replicated "
          f"(sharding {x.sharding}); gather it first"
        )
      x = x.addressable_data(0)
    return jax.device_get(x)

  return jax.tree.map(one, tree)


def put(tree: Any, sharding) -> Any:
  """`jax.device_put(tree, sharding)` that also works when `sharding` spans other processes.

  With one process it is `jax.device_put`. With several, every process passes the same global
  value and each places only its own devices' shards: host arrays go as they are; arrays already
  on a device (and PRNG keys) are read back first, since JAX puts only host data onto other
  processes' meshes.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  if jax.process_count() == 1:
    return jax.device_put(tree, sharding)

  def one(x):
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      data = one(jax.random.key_data(x))
      return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    if isinstance(x, jax.Array):
      x = np.asarray(jax.device_get(x))
    return jax.device_put(x, sharding)

  return jax.tree.map(one, tree)
