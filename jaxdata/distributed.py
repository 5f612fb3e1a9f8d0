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
import atexit
import dataclasses
import os
import selectors
import socket
import sys
import threading
import time
from typing import Any

import jax
import numpy as np
from jax._src import xla_bridge
from jax.experimental import multihost_utils

from jaxdata import command
from jaxdata.placement import local_value, put  # noqa: F401  (the trainers' names for them)

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


# -- the check-in before jax.distributed.initialize ------------------------------------------------
# JAX's coordination client aborts the process (a fatal log, exit 134) or crashes when the job
# cannot form: process 0 alone past the timeout, a port another program holds, two processes with
# one --process-id. So every process first checks in with process 0 over a plain TCP connection
# on the coordinator's port, before JAX binds it: process 0 collects one line from each peer,
# "jaxdata-join PROCESS_ID NUM_PROCESSES", and answers every peer "ok" once all have come, or
# "error MESSAGE" naming what is wrong; only then does it close the port and start JAX's service.

_HELLO = "jaxdata-join"
_LINE_LIMIT = 1024  # bytes of one message line


def _host_port(address: str) -> tuple[str, int]:
  host, _, port = address.rpartition(":")
  return host.strip("[]"), int(port)


def _resolve(address: str) -> None:
  """UsageError at once when the coordinator's host name does not resolve (retrying would not
  help, and JAX would abort on it)."""
  host, port = _host_port(address)
  try:
    socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
  except socket.gaierror as e:
    raise command.UsageError(
      f"--coordinator {address}: cannot resolve the host {host!r} ({e.strerror or e})"
    ) from None


def _read_line(conn: socket.socket, deadline: float) -> str | None:
  """One line from `conn` (without its newline) by `deadline`; None on EOF, timeout or a line
  too long to be ours."""
  data = b""
  while b"\n" not in data:
    left = deadline - time.monotonic()
    if left <= 0 or len(data) > _LINE_LIMIT:
      return None
    conn.settimeout(left)
    try:
      chunk = conn.recv(_LINE_LIMIT)
    except OSError:
      return None
    if not chunk:
      return None
    data += chunk
  return data.split(b"\n", 1)[0].decode("utf-8", "replace")


def _listen(setup: Setup) -> socket.socket:
  """Process 0's check-in socket, on the address JAX's service will bind (all interfaces unless
  JAX_COORDINATOR_BIND_ADDRESS says otherwise); UsageError when something holds the port."""
  assert setup.coordinator is not None  # explicit mode
  bind = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS")
  host, port = _host_port(bind) if bind else ("", _host_port(setup.coordinator)[1])
  try:
    if not host and socket.has_dualstack_ipv6():
      return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
    return socket.create_server((host, port))
  except OSError as e:
    raise command.UsageError(
      f"--coordinator {setup.coordinator}: process 0 cannot listen on port {port} "
      f"({os.strerror(e.errno) if e.errno else e}); another job or program, or a second "
      f"process 0, holds it: pick a free port"
    ) from None


def _gather_peers(setup: Setup) -> None:
  """Process 0: waits until every other process has checked in with a consistent count and a
  distinct id, answers them all, and frees the port; else answers "error" and raises UsageError
  (after `setup.timeout` seconds at most)."""
  listener = _listen(setup)
  deadline = time.monotonic() + setup.timeout
  peers: dict[int, socket.socket] = {}
  problem = None
  try:
    while problem is None and len(peers) < setup.num_processes - 1:
      left = deadline - time.monotonic()
      if left <= 0:
        missing = [i for i in range(1, setup.num_processes) if i not in peers]
        problem = (
          f"process{'es' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of "
          f"{setup.num_processes} did not join the job at {setup.coordinator} within "
          f"{setup.timeout} s"
        )
        break
      listener.settimeout(min(left, 0.5))
      try:
        conn, _ = listener.accept()
      except TimeoutError:
        continue
      except OSError:
        continue
      words = (_read_line(conn, min(deadline, time.monotonic() + 5.0)) or "").split()
      if len(words) != 3 or words[0] != _HELLO or not all(w.isdigit() for w in words[1:]):
        conn.close()  # not a jaxdata process: ignored
        continue
      pid, num = int(words[1]), int(words[2])
      if num != setup.num_processes:
        problem = (
          f"--num-processes differs between the processes (process 0: "
          f"{setup.num_processes}, process {pid}: {num}); the job at {setup.coordinator} has "
          f"{setup.num_processes} processes: give every process the same --num-processes"
        )
      elif pid == 0 or pid in peers:
        problem = (
          f"two processes have --process-id {pid} in the job at {setup.coordinator}: give "
          f"each process its own id in 0..{setup.num_processes - 1}"
        )
      elif pid >= setup.num_processes:
        problem = f"--process-id {pid} is not in 0..{setup.num_processes - 1}"
      if problem is not None and pid in peers:
        peers[-1 - len(peers)] = conn  # the duplicate also hears why
      else:
        peers[pid] = conn
    listener.close()  # before the answers: JAX's service takes the port next
    links = _link_listener() if problem is None else None
    answer = f"ok {links.getsockname()[1]}\n" if links is not None else f"error {problem}\n"
    answer = answer.encode()
    for conn in peers.values():
      try:
        conn.sendall(answer)
      except OSError:
        pass
    for conn in peers.values():  # the peer closes first: no TIME_WAIT left on this side's port
      _read_line(conn, time.monotonic() + 2.0)
    if links is not None:
      _accept_links(links, setup, deadline=time.monotonic() + setup.timeout)
  finally:
    listener.close()
    if links is not None:
      links.close()
    for conn in peers.values():
      conn.close()
  if problem is not None:
    raise command.UsageError(problem)


def _check_in(setup: Setup) -> None:
  """A peer: checks in with process 0 (waiting for it up to `setup.timeout` seconds) and returns
  once it answers "ok"; UsageError with process 0's reason, or when nobody answers."""
  assert setup.coordinator is not None  # explicit mode
  with _connect(setup.coordinator, setup.timeout) as conn:
    try:
      conn.sendall(f"{_HELLO} {setup.process_id} {setup.num_processes}\n".encode())
    except OSError:
      pass
    # process 0 started before this connection and answers within its own timeout
    line = _read_line(conn, time.monotonic() + setup.timeout + 2.0)
  words = (line or "").split()
  if len(words) == 2 and words[0] == "ok" and words[1].isdigit():
    host = _host_port(setup.coordinator)[0]
    link = _connect(f"{host}:{words[1]}", setup.timeout)
    try:
      link.sendall(f"{_LINK} {setup.process_id}\n".encode())
    except OSError as e:
      raise command.UsageError(
        f"process 0 of the job at {setup.coordinator} is gone: {e}"
      ) from None
    _watch({0: link}, setup)
    return
  if line is not None and line.startswith("error "):
    raise command.UsageError(line[len("error ") :])
  raise command.UsageError(
    f"the coordinator {setup.coordinator} did not answer as process 0 of a jaxdata job within "
    f"{setup.timeout} s; is another program listening on that port?"
  )


# -- the links: a peer that dies ends the job ------------------------------------------------------
# JAX's coordination client aborts a process whose peer stopped answering (a fatal log, after
# the heartbeat timeout), and a collective waits on a dead peer until then. So process 0 keeps a
# TCP connection to every peer for the whole job (on a port of its own, not the coordinator's),
# and a thread in every process watches its connections: a process that leaves the job in good
# order says "bye" first (`leave`); a connection that ends without it (the process was killed,
# crashed or stopped with an error) ends this process too, at once, with one line on stderr. A
# peer's end reaches the other peers through process 0, which ends in turn.

_LINK = "jaxdata-link"
_links: dict[int, socket.socket] = {}
_left: bool | None = None  # None: in the job; else whether this process left it in good order


def _link_listener() -> socket.socket:
  """Process 0's listener for the peers' links: any free port, every interface."""
  if socket.has_dualstack_ipv6():
    return socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True)
  return socket.create_server(("", 0))


def _accept_links(listener: socket.socket, setup: Setup, deadline: float) -> None:
  """Process 0: a link from every peer (each says "jaxdata-link ID"), then the watch starts."""
  links: dict[int, socket.socket] = {}
  while len(links) < setup.num_processes - 1:
    left = deadline - time.monotonic()
    if left <= 0:
      for conn in links.values():
        conn.close()
      missing = [i for i in range(1, setup.num_processes) if i not in links]
      raise command.UsageError(
        f"process{'es' if len(missing) > 1 else ''} {', '.join(map(str, missing))} joined the "
        f"job at {setup.coordinator} but did not link back within {setup.timeout} s"
      )
    listener.settimeout(min(left, 0.5))
    try:
      conn, _ = listener.accept()
    except OSError:  # a timeout too
      continue
    words = (_read_line(conn, min(deadline, time.monotonic() + 5.0)) or "").split()
    if len(words) == 2 and words[0] == _LINK and words[1].isdigit() and int(words[1]) not in links:
      links[int(words[1])] = conn
    else:
      conn.close()
  _watch(links, setup)


def _watch(links: dict[int, socket.socket], setup: Setup) -> None:
  """Starts the thread that ends this process when a linked process ends without "bye"."""
  _links.update(links)
  ended, stopping = threading.Event(), threading.Event()
  hook = sys.excepthook

  def failed(*exc):  # an exception nobody caught: the others stop now, not at JAX's exit hook
    # A collective that failed because a peer died (gloo: "Connection closed by peer") races
    # the watch below to report it: the watch's one line wins if its process ended.
    if ended.wait(1.0) or (stopping.is_set() and ended.wait(5.0)):
      time.sleep(60)  # the watch is ending this process with its own line
    _say_goodbye(ok=False)
    hook(*exc)

  sys.excepthook = failed
  atexit.register(_say_goodbye, True)  # an exit without an uncaught exception leaves in order
  selector = selectors.DefaultSelector()
  for pid, conn in links.items():
    conn.settimeout(None)
    selector.register(conn, selectors.EVENT_READ, pid)

  def end(why: str):
    if _left is False:  # this process stops with its own error: nothing to add
      return
    ended.set()
    print(f"jaxdata: {why}; process {setup.process_id} stops too", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)

  def watch():
    said: dict[int, bytes] = {pid: b"" for pid in links}
    while said:
      for key, _ in selector.select():
        pid = key.data
        try:
          data = key.fileobj.recv(64)  # type: ignore[union-attr]
        except OSError:
          data = b""
        said[pid] += data
        if data and not said[pid].startswith(b"bye"):
          continue  # more to come: a stop's reason, then the end
        selector.unregister(key.fileobj)
        last = said.pop(pid)
        if last.startswith(b"bye"):
          continue
        if last.startswith(b"stop "):
          # a peer stopped by a signal: this process most likely got it too and stops with its
          # own line first
          reason = last[5:].decode(errors="replace").strip()[:40]
          why, grace = f"process {pid} of {setup.num_processes} stopped ({reason})", 3.0
        else:
          why = (
            f"process {pid} of {setup.num_processes} ended without leaving the job (killed, "
            f"or stopped by an error: see its own output)"
          )
          # `jaxdata launch` stops the others itself and reports the first process to end: give
          # it the time to (it looks every 50 ms)
          grace = 2.0 if os.environ.get("JAXDATA_LAUNCHED") else 0.0
        if grace:
          stopping.set()
          threading.Timer(grace, end, (why,)).start()
        else:
          end(why)

  threading.Thread(target=watch, name="jaxdata-links", daemon=True).start()


def _say_goodbye(ok: bool, why: str | None = None) -> None:
  """Ends what this process says on its links: "bye" where it leaves in good order, so the
  other processes carry on; else the end of its side (they stop). This process keeps watching
  them: a process that fails after this one said bye (process 0's save, while this one waits
  in JAX's shutdown barrier) still ends it with an error."""
  global _left
  if _left is not None:
    return
  _left = ok
  for conn in _links.values():
    try:
      if ok:
        conn.sendall(b"bye\n")
      else:
        if why:
          conn.sendall(f"stop {why}\n".encode())
        conn.shutdown(socket.SHUT_WR)
    except OSError:
      pass


def _connect(address: str, timeout: float) -> socket.socket:
  """A TCP connection to `address`, tried again until `timeout` seconds; UsageError after."""
  host, port = _host_port(address)
  deadline = time.monotonic() + timeout
  while True:
    try:
      return socket.create_connection((host, port), timeout=1.0)
    except OSError as e:
      if time.monotonic() >= deadline:
        raise command.UsageError(
          f"cannot reach the coordinator {address} within {timeout} s "
          f"({e.strerror or e}); is process 0 running there?"
        ) from None
      time.sleep(0.2)


def _wait_for(address: str, timeout: float) -> None:
  """Returns once something accepts TCP connections at `address`; UsageError after `timeout`."""
  _connect(address, timeout).close()


def initialize(setup: Setup) -> Setup:
  """Joins the job `setup` describes (`jax.distributed.initialize`); nothing for a plain run.

  Must run before anything creates a JAX backend (`jax.devices()`, any computation). Returns the
  setup with the process count and index JAX reports (what auto-detection found). A coordinator
  that cannot be reached, or peers that do not join within `setup.timeout` seconds, raise
  `command.UsageError` naming the address.
  """
  if not setup.multi_process:
    return setup

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
    assert setup.coordinator is not None  # explicit mode
    # JAX aborts the process (a fatal log, no exception) when the job cannot form: every
    # process checks in with process 0 first, so that each failure is a one-line error.
    _resolve(setup.coordinator)
    if setup.process_id == 0:
      _gather_peers(setup)
    else:
      _check_in(setup)
      _wait_for(setup.coordinator, setup.timeout)  # process 0 starts JAX's service now
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
  asked = np.asarray(multihost_utils.process_allgather(np.int32(setup.num_processes))).reshape(-1)
  if (asked != jax.process_count()).any():
    said = ", ".join(f"process {i}: {int(n)}" for i, n in enumerate(asked))
    raise command.UsageError(
      f"--num-processes differs between the processes ({said}); the job "
      f"at {setup.coordinator} has {jax.process_count()} processes: give "
      f"every process the same --num-processes"
    )


def leave(ok: bool = True, why: str | None = None) -> bool:
  """Leaves the job this process joined (`jax.distributed.shutdown`); nothing outside one.
  Returns whether this process was in a job. With `ok` false (the run stopped with an error),
  the other processes of an explicit job stop at once (their links end without "bye"); `why`
  (a signal's name) gives them 3 s to stop by the same signal first. Then, in a job with links,
  JAX's shutdown is skipped: the caller ends the process with `os._exit`, as `jaxdata.cli`
  does.

  JAX would do it at exit, from an `atexit` hook that runs while the interpreter finalizes: a
  run that stopped with an error there once left process 0 hanging past its shutdown timeout
  after it had printed the error (CI, jax 0.10.2). `jaxdata.cli.main` calls this before it
  returns, so every process meets the shutdown barrier with its threads still running.
  """
  _say_goodbye(ok, why)
  jax_distributed = sys.modules.get("jax._src.distributed")  # never imports JAX itself
  if getattr(getattr(jax_distributed, "global_state", None), "client", None) is None:
    return False
  if not ok and _links:
    # The links end the others now; JAX's shutdown barrier would wait on them, and its client
    # aborts the process when they are gone: the caller ends this process (os._exit) instead.
    return True

  stderr = sys.stderr
  if ok:
    # Everything the run had to say has been said. XLA's GPU client goes on watching the job's
    # tasks through the coordination service until the process ends, and logs each failed watch
    # once the service has stopped (gRPC "UNAVAILABLE" or "CANCELLED", with a source trace,
    # jax 0.11.2): the C++ logs of a successful run's last moments go to /dev/null.
    sys.stdout.flush()
    stderr.flush()
    stderr = os.fdopen(os.dup(2), "w")
    with open(os.devnull, "wb") as null:
      os.dup2(null.fileno(), 2)
  try:
    jax.distributed.shutdown()
  except (RuntimeError, ValueError) as e:  # a peer gone already: the barrier times out
    print(f"jaxdata: leaving the job: {_first_line(e)}", file=stderr, flush=True)
  return True


def _first_line(e: Exception) -> str:
  """An exception's first line (XLA's errors run to many), or its type where it has no text."""
  text = str(e).strip()
  return text.splitlines()[0] if text else type(e).__name__


def is_primary() -> bool:
  """Whether this is process 0 (the one that prints progress and writes checkpoints)."""
  return jax.process_index() == 0
