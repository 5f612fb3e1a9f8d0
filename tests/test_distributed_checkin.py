"""A multi-process job that cannot form ends every process with a one-line error, a non-zero
exit and within --distributed-timeout, instead of JAX's abort or a crash.

Every process checks in with process 0 on the coordinator's port before JAX starts
(`jaxdata.distributed`): the check-in runs here in threads of this process, with timeouts of
a second or two; one subprocess test shows the command line's exit code and single line.
"""

import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from jaxdata import command, distributed, launch


def _setup(port: int, pid: int, num: int, timeout: int = 2, host: str = "localhost"):
  return distributed.Setup(
    mode="explicit",
    coordinator=f"{host}:{port}",
    num_processes=num,
    process_id=pid,
    timeout=timeout,
  )


def _check_in_all(setups) -> list:
  """Runs process 0's side and each peer's in threads (process 0 first); returns what each
  raised (None: joined)."""
  errors: list = [None] * len(setups)

  def one(i, s):
    try:
      (distributed._gather_peers if s.process_id == 0 else distributed._check_in)(s)
    except command.UsageError as e:
      errors[i] = e

  threads = [threading.Thread(target=one, args=(i, s)) for i, s in enumerate(setups)]
  for t in threads:
    t.start()
    time.sleep(0.05)
  for t in threads:
    t.join(30)
    assert not t.is_alive()
  return errors


def test_processes_of_one_job_check_in_and_free_the_port():
  port = launch.free_port()
  assert _check_in_all([_setup(port, i, 3) for i in range(3)]) == [None] * 3
  with socket.create_server(("", port)):  # free again, for JAX's service
    pass


def test_process_0_alone_stops_after_the_timeout():
  port = launch.free_port()
  start = time.monotonic()
  (error,) = _check_in_all([_setup(port, 0, 3, timeout=1)])
  assert "processes 1, 2 of 3 did not join the job at localhost" in str(error)
  assert time.monotonic() - start < 5


def test_a_missing_peer_stops_the_ones_that_came():
  port = launch.free_port()
  errors = _check_in_all([_setup(port, 0, 3, timeout=1), _setup(port, 1, 3, timeout=1)])
  assert all("process 2 of 3 did not join" in str(e) for e in errors), errors


def test_different_process_counts_stop_every_process():
  port = launch.free_port()
  errors = _check_in_all([_setup(port, 0, 2), _setup(port, 1, 3)])
  for e in errors:
    assert "--num-processes differs between the processes (process 0: 2, process 1: 3)" in str(e)


def test_a_duplicate_process_id_stops_every_process():
  port = launch.free_port()
  errors = _check_in_all([_setup(port, 0, 3), _setup(port, 1, 3), _setup(port, 1, 3)])
  for e in errors:
    assert "two processes have --process-id 1" in str(e), errors


def test_a_port_in_use_is_a_clear_error_for_every_process():
  with socket.create_server(("", 0)) as other:  # another program, which never answers
    port = other.getsockname()[1]
    start = time.monotonic()
    errors = _check_in_all([_setup(port, 0, 2, timeout=1), _setup(port, 1, 2, timeout=1)])
  assert f"process 0 cannot listen on port {port}" in str(errors[0])
  assert "did not answer as process 0 of a jaxdata job within 1 s" in str(errors[1])
  assert time.monotonic() - start < 8


def test_an_unresolvable_coordinator_host_is_an_immediate_error():
  start = time.monotonic()
  with pytest.raises(command.UsageError, match="cannot resolve the host 'no-such-host.invalid'"):
    distributed._resolve("no-such-host.invalid:1234")
  assert time.monotonic() - start < 5


def test_process_0_alone_ends_the_command_in_one_line():
  port = launch.free_port()
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "jaxdata.cli",
      "train",
      "sage",
      "--coordinator",
      f"localhost:{port}",
      "--num-processes",
      "2",
      "--process-id",
      "0",
      "--distributed-timeout",
      "1",
    ],
    capture_output=True,
    text=True,
    timeout=60,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  assert out.returncode == 2, out.stderr
  lines = out.stderr.strip().splitlines()
  assert lines[-1].endswith(f"process 1 of 2 did not join the job at localhost:{port} within 1 s")
  assert "Traceback" not in out.stderr and "F1" not in out.stderr
