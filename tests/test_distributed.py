"""Multi-process training on jax.distributed (`jaxdata.distributed`, `jaxdata launch`).

The multi-process runs start real processes through the launcher: 2 processes x 2 CPU devices
each (gloo collectives), compared with one process of 4 CPU devices on the same global batch.
"""

import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import doc_blocks
import jax
import pytest

from jaxdata import cli, distributed, launch

# Its tests take 5 s to minutes each: the fast tier (-m "not slow") leaves this file out.
pytestmark = pytest.mark.slow

#: A small `train sage` run: 200 train seeds, batches of 4 x 16, four steps per epoch.
SAGE = [
  "train",
  "sage",
  "--nodes",
  "2000",
  "--edges",
  "20000",
  "--features",
  "8",
  "--classes",
  "4",
  "--fanouts",
  "5,5",
  "--batch-size",
  "16",
  "--hidden",
  "16",
  "--devices",
  "0",
]


def _env(devices: int | None = None) -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  env.pop("JAX_COORDINATOR_ADDRESS", None)
  if devices is not None:
    base = os.environ.get("JAXDATA_TEST_XLA_FLAGS", "")
    env["XLA_FLAGS"] = f"{base} --xla_force_host_platform_device_count={devices}"
  return env


def _jaxdata(args, env, timeout=180):
  return subprocess.run(
    [sys.executable, "-m", "jaxdata.cli", *args],
    env=env,
    timeout=timeout,
    capture_output=True,
    text=True,
  )


def _launched(ran: list) -> tuple[list[str], subprocess.CompletedProcess]:
  """The `jaxdata launch ... -- train ...` line of a document's block run by `run_block`: its
  train command (what a one-process run repeats) and its finished launcher."""
  line, proc = ran[0]
  words = shlex.split(line)
  assert words[:2] == ["jaxdata", "launch"], line
  return words[words.index("--") + 1 :], proc


#: What a successful run must not print: a traceback, or XLA's gRPC logs of the job's end.
NOISE = re.compile(r"Traceback|gRPC|GRPC|UNAVAILABLE|CANCELLED|Source Location")


@pytest.mark.gpu
def test_a_launched_run_on_the_gpu_ends_quietly(tmp_path):
  """`jaxdata launch` on the GPU: the run succeeds and ends without XLA's GPU client logging its
  failed watches of the stopped coordination service (jax 0.11.2 logged one per process)."""
  try:
    jax.devices("gpu")
  except RuntimeError:
    pytest.skip("no GPU visible to JAX")
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  env.pop("JAX_PLATFORMS", None)
  out = _jaxdata(["launch", "-n", "1", "--", *SAGE, "--epochs", "1", "--out", str(tmp_path)], env)
  assert out.returncode == 0, out.stdout + out.stderr
  assert "gpu x 1" in out.stdout
  assert not NOISE.search(out.stdout + out.stderr), out.stderr


@pytest.mark.slow
def test_two_processes_of_two_devices_train_like_one_process_of_four(tmp_path):
  """Same global batch, same per-device keys: the losses and accuracies of every epoch agree.
  The launch is docs/distributed.md's, as written (`--out sage-2x2`)."""
  run, multi = _launched(doc_blocks.run_block("docs/distributed.md", tmp_path))
  assert run[:2] == ["train", "sage"] and run[-2:] == ["--out", "sage-2x2"], run
  out = {"multi": tmp_path / "sage-2x2", "single": tmp_path / "single"}
  single = _jaxdata([*run[:-2], "--out", str(out["single"])], _env(4))
  assert single.returncode == 0, single.stdout + single.stderr
  assert "cpu x 4" in multi.stdout and "cpu x 4" in single.stdout  # one mesh of 4 devices
  # Process 0 reports and writes the checkpoint; process 1 stays quiet.
  assert "[0] test accuracy" in multi.stdout and "[1] test accuracy" not in multi.stdout
  assert not NOISE.search(multi.stdout + multi.stderr), multi.stderr
  hist = {k: json.load(open(out[k] / "history.json")) for k in out}
  assert len(hist["multi"]) == len(hist["single"]) == 2
  for m, s in zip(hist["multi"], hist["single"]):
    assert m["batches"] == s["batches"] == 4
    assert m["loss"] == pytest.approx(s["loss"], rel=1e-5)
    assert m["train_accuracy"] == pytest.approx(s["train_accuracy"], abs=1e-9)
    assert m["val_accuracy"] == pytest.approx(s["val_accuracy"], abs=1e-9)
  assert hist["multi"][1]["loss"] < hist["multi"][0]["loss"]
  from jaxdata.tasks import checkpoint

  metas = {k: checkpoint.read_meta(out[k]) for k in out}
  assert metas["multi"]["step"] == metas["single"]["step"] == 8
  assert metas["multi"]["metrics"]["test_accuracy"] == pytest.approx(
    metas["single"]["metrics"]["test_accuracy"], abs=1e-9
  )


#: A small `train gpt` run: 4 layers whose inputs are 64 KiB per device at 4 sequences per
#: device, 4 steps of a global batch of 16.
GPT = [
  "train",
  "gpt",
  "--layers",
  "4",
  "--hidden",
  "64",
  "--heads",
  "4",
  "--seq",
  "64",
  "--vocab",
  "32",
  "--batch-size",
  "16",
  "--steps",
  "4",
  "--log-every",
  "1",
]


@pytest.mark.slow
def test_gpt_with_offload_on_two_processes_of_two_devices_trains_like_one_device(tmp_path):
  """2 processes x 2 devices, each process with its own TensorStore, under the planner's plan
  for one device's share (4 sequences) and a budget of 200 KiB per device: recomputing every
  layer would keep 4 x 64 KiB of layer inputs, so the plan must offload. The per-step losses
  are those of one plain device on the same global batch; process 0 saves once, and `jaxdata
  eval` in one process of one device measures the saved held-out loss again."""
  multi = _jaxdata(
    [
      "launch",
      "-n",
      "2",
      "--devices-per-process",
      "2",
      "--",
      *GPT,
      "--devices",
      "0",
      "--offload",
      "--budget",
      "200KiB",
      "--ram",
      "64MiB",
      "--out",
      str(tmp_path / "multi"),
    ],
    _env(),
  )
  assert multi.returncode == 0, multi.stdout + multi.stderr
  single = _jaxdata([*GPT, "--out", str(tmp_path / "single")], _env(1))
  assert single.returncode == 0, single.stdout + single.stderr
  assert "cpu x 4" in multi.stdout and "cpu x 1" in single.stdout
  plan = [l for l in multi.stdout.splitlines() if "plan under 204,800 bytes per device" in l]
  assert len(plan) == 1 and plan[0].startswith("[0]") and "batch 4 per device" in plan[0]
  assert "offload[" in plan[0], plan[0]
  spills = re.search(r"\[0\] offload: ([\d,]+) spills", multi.stdout)
  assert spills and int(spills[1].replace(",", "")) >= 4, multi.stdout  # at least 1 per step
  assert "[1] step" not in multi.stdout and "[1] checkpoint saved" not in multi.stdout
  hist = {k: json.load(open(tmp_path / k / "history.json")) for k in ("multi", "single")}
  assert [r["step"] for r in hist["multi"]] == [r["step"] for r in hist["single"]] == [1, 2, 3, 4]
  for m, s in zip(hist["multi"], hist["single"]):
    assert m["loss"] == pytest.approx(s["loss"], rel=1e-5)
    assert m["val_loss"] == pytest.approx(s["val_loss"], rel=1e-5)
  assert hist["multi"][-1]["loss"] < hist["multi"][0]["loss"]
  ev = _jaxdata(["eval", str(tmp_path / "multi")], _env(1))
  assert ev.returncode == 0, ev.stdout + ev.stderr
  measured, saved = map(
    float, re.search(r"final_loss ([\d.]+) \(at save: ([\d.]+)\)", ev.stdout).groups()
  )
  assert measured == pytest.approx(saved, rel=1e-4)  # printed to 4 decimals
  from jaxdata.tasks import checkpoint

  loaded = checkpoint.load_model(tmp_path / "multi")
  assert loaded.evaluate()["final_loss"] == pytest.approx(hist["multi"][-1]["val_loss"], rel=1e-5)


def _launch_endless_sage(tmp_path, env):
  """`jaxdata launch -n 2` of a sage run too long to end by itself, its output piped."""
  command = ["launch", "-n", "2", "--devices-per-process", "2", "--", *SAGE, "--epochs", "100000"]
  return subprocess.Popen(
    [sys.executable, "-m", "jaxdata.cli", *command, "--out", str(tmp_path / "never")],
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )


@pytest.mark.slow
def test_a_process_killed_mid_run_stops_the_launcher(tmp_path):
  """Kill process 1 after its first epoch: the launcher stops process 0 and fails, promptly."""
  proc = _launch_endless_sage(tmp_path, _env())
  try:
    pids, lines = {}, []
    deadline = time.monotonic() + 120
    for line in proc.stdout:
      lines.append(line)
      if m := re.match(r"jaxdata launch: process (\d) is pid (\d+)", line):
        pids[int(m[1])] = int(m[2])
      if line.startswith("[0] epoch   1"):
        break
      assert time.monotonic() < deadline, "".join(lines)
    else:
      pytest.fail("the run ended before its first epoch:\n" + "".join(lines))
    os.kill(pids[1], signal.SIGKILL)
    killed = time.monotonic()
    rest, _ = proc.communicate(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert time.monotonic() - killed < 30
  assert proc.returncode == 128 + signal.SIGKILL
  assert "process 1 exited with code -9; stopping the others" in rest


@pytest.mark.slow
@pytest.mark.parametrize(
  "killed, signum",
  [(1, signal.SIGKILL), (0, signal.SIGKILL), (1, signal.SIGTERM)],
  ids=["a peer", "the coordinator", "a peer, SIGTERM"],
)
def test_without_the_launcher_a_dead_process_ends_the_others_with_one_line(
  tmp_path, killed, signum
):
  """No launcher: kill one process mid-run; the other stops promptly with one line naming it
  and exit code 1: no abort by JAX's coordination client, no wait for its heartbeat timeout
  (--distributed-timeout 30, longer than the test waits). SIGTERM: the process stops with its
  own line, and its peer 3 s later (time to stop by the same signal, as under a launcher)."""
  port = launch.free_port()
  common = [
    sys.executable,
    "-m",
    "jaxdata.cli",
    *SAGE,
    "--epochs",
    "100000",
    "--coordinator",
    f"localhost:{port}",
    "--num-processes",
    "2",
    "--distributed-timeout",
    "30",
  ]
  env = _env(2)
  procs = [
    subprocess.Popen(
      common + ["--process-id", str(i), "--out", str(tmp_path / str(i))],
      env=env,
      stdout=subprocess.PIPE if i == 0 else subprocess.DEVNULL,
      stderr=subprocess.STDOUT if i == 0 else subprocess.PIPE,
      text=True,
    )
    for i in range(2)
  ]
  survivor = procs[1 - killed]
  try:
    lines = []
    assert procs[0].stdout is not None
    for line in procs[0].stdout:
      lines.append(line)
      if line.startswith("epoch   1"):
        break
    else:
      pytest.fail("process 0 ended before its first epoch:\n" + "".join(lines))
    procs[killed].send_signal(signum)
    procs[killed].wait()
    killed_at = time.monotonic()
    out, err = survivor.communicate(timeout=60)
    elapsed = time.monotonic() - killed_at
  finally:
    _kill_left(procs)
  said = (out or "") + (err or "")
  assert survivor.returncode == 1, said[-3000:]
  assert elapsed < 15, elapsed
  if signum == signal.SIGKILL:
    assert f"jaxdata: process {killed} of 2 ended without leaving the job" in said
  else:
    assert procs[killed].returncode == 128 + signal.SIGTERM
    assert f"jaxdata: process {killed} of 2 stopped (SIGTERM); process {1 - killed}" in said
  assert f"process {1 - killed} stops too" in said
  assert "F0000" not in said and "Check failed" not in said and "Fatal" not in said


@pytest.mark.slow
def test_a_save_failing_in_process_0_only_ends_the_job_in_both(tmp_path):
  """Without the launcher: process 0's checkpoint write fails (a full disk, simulated there
  only); process 1, which finished training and waits to leave, stops too with one line and
  exit code 1, promptly (not at JAX's shutdown timeout, 30 s here)."""
  port = launch.free_port()
  flags = [*SAGE, "--epochs", "1", "--coordinator", f"localhost:{port}", "--num-processes", "2"]
  flags += ["--distributed-timeout", "30"]
  full_disk = (
    "import errno, os, sys; import jaxdata.tasks.checkpoint as c; "
    "c.save = lambda *a, **k: (_ for _ in ()).throw(OSError(errno.ENOSPC, 'No space left')); "
    "from jaxdata.cli import main; sys.exit(main(sys.argv[1:]))"
  )
  env = _env(2)
  runs = [
    [sys.executable, "-c", full_disk, *flags, "--process-id", "0", "--out", str(tmp_path / "a")],
    [
      sys.executable,
      "-m",
      "jaxdata.cli",
      *flags,
      "--process-id",
      "1",
      "--out",
      str(tmp_path / "b"),
    ],
  ]
  procs = [
    subprocess.Popen(r, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for r in runs
  ]
  try:
    out0, _ = procs[0].communicate(timeout=180)
    ended = time.monotonic()
    out1, _ = procs[1].communicate(timeout=60)
    after = time.monotonic() - ended
  finally:
    _kill_left(procs)
  assert procs[0].returncode != 0 and "No space left" in out0, out0[-3000:]
  assert procs[1].returncode == 1, out1[-3000:]
  assert "jaxdata: process 0 of 2 ended without leaving the job" in out1
  assert after < 15, after
  assert "F0000" not in out1 and "Check failed" not in out1


def test_a_failing_command_fails_the_launch_with_its_exit_code():
  """Both processes refuse a bad flag value: the launcher returns their exit code 2. The first
  to fail stops the other, which may not have printed its own error yet: one error line, from
  either process."""
  out = _jaxdata(["launch", "-n", "2", "--", "train", "sage", "--fanouts", "0"], _env(), 60)
  assert out.returncode == 2
  assert re.search(r"^\[[01]\] jaxdata train sage: error: argument --fanouts", out.stdout, re.M)
  assert "exited with code 2; stopping the others" in out.stderr


def test_launch_needs_a_train_command_and_sets_the_process_flags_itself(capsys):
  assert cli.main(["launch", "-n", "2", "--", "info"]) == 2
  assert "launch runs train commands" in capsys.readouterr().err
  assert cli.main(["launch", "-n", "2", "--", "train", "sage", "--process-id", "1"]) == 2
  assert "the launcher sets --process-id itself" in capsys.readouterr().err


def test_launch_gives_each_process_its_own_gpus():
  """On a GPU machine each process gets an equal share of CUDA_VISIBLE_DEVICES; CPU runs (and
  --devices-per-process) leave it alone."""
  env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
  assert [e["CUDA_VISIBLE_DEVICES"] for e in launch.process_envs(env, 2, None)] == ["0,1", "2,3"]
  assert [e["CUDA_VISIBLE_DEVICES"] for e in launch.process_envs(env, 3, None)] == ["0", "1", "2"]
  cpu = launch.process_envs(dict(env, JAX_PLATFORMS="cpu"), 2, None)
  assert [e["CUDA_VISIBLE_DEVICES"] for e in cpu] == ["0,1,2,3"] * 2
  flagged = launch.process_envs(env, 2, 3)
  assert all(e["CUDA_VISIBLE_DEVICES"] == "0,1,2,3" for e in flagged)
  assert all("--xla_force_host_platform_device_count=3" in e["XLA_FLAGS"] for e in flagged)
  assert launch.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
  assert launch.visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) == []
  assert launch.visible_gpus({"CUDA_VISIBLE_DEVICES": "1", "JAX_PLATFORMS": "cuda,cpu"}) == ["1"]


def test_more_processes_than_gpus_is_a_usage_error(monkeypatch, capsys):
  """Two processes on one GPU: NCCL refuses them inside the first collective ("Duplicate GPU
  detected", on the H200 machine); the launcher says so before starting anything."""
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  assert cli.main(["launch", "-n", "2", "--", *SAGE]) == 2
  err = capsys.readouterr().err.strip()
  assert "2 processes but 1 GPU(s) here: NCCL runs one process per GPU" in err
  assert len(err.splitlines()) == 1


class _NoProcess:
  """Stands in for `subprocess.Popen` in the launcher: records the command, starts nothing, and
  ends at once with exit code 0."""

  started: list = []

  def __init__(self, cmd, **kwargs):
    self.started.append(cmd)
    self.pid, self.stdout, self.returncode = 0, io.StringIO(""), 0

  def poll(self):
    return 0

  def wait(self, timeout=None):
    return 0


@pytest.mark.parametrize("devices", [["--devices-per-process", "1"], []])
def test_more_cpu_processes_than_cores_is_a_usage_error_unless_forced(monkeypatch, capsys, devices):
  """CPU processes (`--devices-per-process`, or no GPU here) are bounded by the CPU cores: one
  line naming -n and the bound, exit code 2, nothing started; --force starts them anyway."""
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.setattr(launch, "cpu_cores", lambda: 2)
  monkeypatch.setattr(launch.subprocess, "Popen", _NoProcess)
  _NoProcess.started = []
  assert cli.main(["launch", "-n", "3", *devices, "--", *SAGE]) == 2
  err = capsys.readouterr().err.strip()
  assert err == (
    "jaxdata launch: error: argument -n: 3 processes but 2 CPU core(s) here: start at most 2, "
    "or give --force to share the cores among more"
  )
  assert _NoProcess.started == []
  assert cli.main(["launch", "-n", "2", *devices, "--", *SAGE]) == 0
  assert cli.main(["launch", "-n", "3", "--force", *devices, "--", *SAGE]) == 0
  assert [c[c.index("--process-id") + 1] for c in _NoProcess.started] == ["0", "1", "0", "1", "2"]


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_every_process_and_exits_143(tmp_path):
  """SIGTERM to the launcher once training runs: it passes it on to both processes, which stop
  with one line each (or are killed after GRACE seconds), waits for them (none is left running)
  and exits 128 + 15 with one line saying so; nothing is saved."""
  # PYTHONFAULTHANDLER: SIGABRT prints a process's stacks
  proc = _launch_endless_sage(tmp_path, dict(_env(), PYTHONFAULTHANDLER="1"))
  pids, lines = [], []
  try:
    for line in proc.stdout:
      lines.append(line)
      if m := re.match(r"jaxdata launch: process \d is pid (\d+)", line):
        pids.append(int(m[1]))
      if line.startswith("[0] epoch   1"):
        break
    else:
      pytest.fail("the run ended before its first epoch:\n" + "".join(lines))
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    try:
      rest, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # where they hang: faulthandler's stacks
      for pid in _running(pids, 0):
        os.kill(pid, signal.SIGABRT)
      pytest.fail("the processes did not stop within 60 s:\n" + proc.communicate(30)[0])
    took = time.monotonic() - sent
  finally:
    left = _running(pids, 10)
    for pid in left:  # a launcher that did not wait for its processes left them running
      os.kill(pid, signal.SIGKILL)
    if proc.poll() is None:
      proc.kill()
    proc.communicate()
  assert len(pids) == 2
  assert left == [], f"processes {left} outlived the launcher"
  assert took < 30
  assert proc.returncode == 128 + signal.SIGTERM, rest
  own = [l for l in rest.splitlines() if l.startswith("jaxdata launch:")]
  assert own[0] == "jaxdata launch: SIGTERM: passed on to the 2 processes; stopping", rest
  # Each process stops with its one line, unless the signal found it waiting in a collective of
  # a step its peer had stopped before (Python runs handlers between calls, not inside one):
  # then the launcher kills it after GRACE seconds, and says so.
  # Or its peer's stop, passed on its link (`jaxdata.distributed`), ends it 3 s later.
  for i in (0, 1):
    killed = f"jaxdata launch: process {i} did not stop within 5 s of SIGTERM; killing it"
    linked = f"[{i}] jaxdata: process {1 - i} of 2 stopped (SIGTERM); process {i} stops too"
    assert (
      f"[{i}] jaxdata train sage: terminated (SIGTERM)" in rest or killed in own or linked in rest
    ), rest
  assert len(own) <= 3 and all("killing it" in l for l in own[1:]), rest
  assert "Traceback" not in rest
  assert not (tmp_path / "never").exists()


def _kill_left(procs: list[subprocess.Popen]) -> None:
  """Kills and collects those of `procs` still running (a test that failed midway)."""
  for p in procs:
    if p.poll() is None:
      p.kill()
      p.wait()


def _running(pids: list[int], timeout: float) -> list[int]:
  """Those of `pids` still running (not ended, or ended but not collected) after up to
  `timeout` seconds."""
  deadline = time.monotonic() + timeout
  while True:
    left = []
    for pid in pids:
      try:
        with open(f"/proc/{pid}/stat") as f:
          if f.read().rsplit(")", 1)[1].split()[0] != "Z":
            left.append(pid)
      except FileNotFoundError:
        pass
    if not left or time.monotonic() > deadline:
      return left
    time.sleep(0.1)


def test_process_id_must_be_below_the_process_count(capsys):
  code = cli.main(
    SAGE + ["--coordinator", "localhost:1234", "--num-processes", "2", "--process-id", "2"]
  )
  assert code == 2
  assert "--process-id must be in 0..1 for --num-processes 2, got 2" in capsys.readouterr().err


def test_multi_process_flags_come_together(capsys):
  assert cli.main(SAGE + ["--num-processes", "2", "--process-id", "0"]) == 2
  assert "missing --coordinator" in capsys.readouterr().err
  assert cli.main(SAGE + ["--distributed", "auto", "--num-processes", "2"]) == 2
  assert "--distributed auto detects the cluster" in capsys.readouterr().err
  with pytest.raises(SystemExit, match="2"):  # argparse's own check: no port
    cli.main(SAGE + ["--coordinator", "localhost"])
  assert "is not HOST:PORT" in capsys.readouterr().err


def test_a_trainer_without_multi_process_support_refuses_several_processes(monkeypatch, capsys):
  """Every trainer runs as several processes now; one that did not declare MULTI_PROCESS would
  be refused before joining the job (gpt stands in for it here)."""
  from jaxdata.train import gpt

  monkeypatch.setattr(gpt, "MULTI_PROCESS", False)
  code = cli.main(
    ["train", "gpt", "--coordinator", "localhost:1234", "--num-processes", "2", "--process-id", "0"]
  )
  assert code == 2
  err = capsys.readouterr().err
  assert "jaxdata train gpt does not support multi-process runs yet" in err
  assert "sage" in err and "gpt" not in err.split("of the trainers")[1]


def test_no_flags_is_a_single_process_run_that_initializes_nothing(monkeypatch):
  for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    monkeypatch.delenv(name, raising=False)
  args = cli.parser().parse_args(SAGE)
  setup = distributed.setup_from(args)
  assert not setup.multi_process and setup.num_processes == 1
  assert distributed.initialize(setup) is setup  # no jax.distributed.initialize


def test_environment_supplies_the_flags(monkeypatch):
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "host0:999")
  monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
  monkeypatch.setenv("JAX_PROCESS_ID", "3")
  setup = distributed.setup_from(cli.parser().parse_args(SAGE))
  assert (setup.mode, setup.coordinator, setup.num_processes, setup.process_id) == (
    "explicit",
    "host0:999",
    4,
    3,
  )
  monkeypatch.setenv("JAX_PROCESS_ID", "x")
  with pytest.raises(Exception, match="JAX_PROCESS_ID='x' is not an integer"):
    distributed.setup_from(cli.parser().parse_args(SAGE))


def test_an_unreachable_coordinator_is_a_clear_error():
  port = launch.free_port()  # nothing listens there
  start = time.monotonic()
  out = _jaxdata(
    [
      *SAGE,
      "--coordinator",
      f"localhost:{port}",
      "--num-processes",
      "2",
      "--process-id",
      "1",
      "--distributed-timeout",
      "2",
    ],
    _env(2),
    60,
  )
  assert out.returncode == 2, out.stderr
  assert f"cannot reach the coordinator localhost:{port} within 2 s" in out.stderr
  assert time.monotonic() - start < 30


def _sparse_worker(out, processes: int, devices: int, worker: str = "sparse_worker.py") -> list:
  """Runs tests/`worker` (sparse_worker.py) as `processes` processes of `devices` CPU devices
  each; returns each process's saved arrays."""
  out.mkdir()
  script = os.path.join(os.path.dirname(__file__), worker)
  env = _env(devices)
  if processes > 1:
    env.update(
      JAX_COORDINATOR_ADDRESS=f"localhost:{launch.free_port()}", JAX_NUM_PROCESSES=str(processes)
    )
  procs = [
    subprocess.Popen(
      [sys.executable, script, str(out)],
      env=dict(env, JAX_PROCESS_ID=str(i)) if processes > 1 else env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(processes)
  ]
  try:
    logs = [p.communicate(timeout=120)[0] for p in procs]
  finally:
    _kill_left(procs)
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log
  import numpy as np

  return [dict(np.load(out / f"process{i}.npz")) for i in range(processes)]


@pytest.mark.slow
def test_sparse_updates_reach_every_process_copy_exactly(tmp_path):
  """2 processes x 2 devices, rows repeating within and across devices and processes: every
  copy's SGD table is minus np.add.at's counts of the whole global batches (none lost, none
  doubled), and lazy Adam leaves every copy equal to a one-process run over 4 devices."""
  import numpy as np

  sys.path.insert(0, os.path.dirname(__file__))
  import sparse_worker as w

  multi = _sparse_worker(tmp_path / "multi", 2, 2)
  single = _sparse_worker(tmp_path / "single", 1, 4)
  expected = np.zeros((w.ROWS, w.COLS), np.float32)
  for ids, _ in w.global_batches(4):
    kept = ids[ids < w.ROWS]  # ROWS is out of range: dropped; negatives count from the end
    assert len(kept) < len(ids) and (kept < 0).any()  # the batches do exercise both
    np.add.at(expected, kept, -1.0)
  assert len(np.unique(expected)) > 3  # rows repeat unevenly
  for tables in multi + single:
    np.testing.assert_array_equal(tables["counts"], expected)
    assert tables["adam_count"].item() == w.STEPS
  np.testing.assert_array_equal(multi[0]["weights"], multi[1]["weights"])
  np.testing.assert_allclose(multi[0]["weights"], single[0]["weights"], rtol=1e-6, atol=1e-7)
  assert not np.allclose(
    single[0]["weights"], np.linspace(-1, 1, w.ROWS * w.COLS).reshape(w.ROWS, w.COLS)
  )


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adam"])
def test_learned_host_embeddings_train_across_processes_like_one_process(tmp_path, optimizer):
  """`--embed-dim` with a sparse optimizer, 2 processes x 2 devices (launcher) against one
  process of 4: the same losses, and the same trained table (each process checks at the end
  that its copy equals every other's; process 0's is in the checkpoint). The checkpoint of the
  two processes is then measured again by `jaxdata eval` in one process of 4 devices. The
  launch and the eval are docs/distributed.md's, as written (`--out sage-emb-2x2`)."""
  import numpy as np

  import jaxdata

  ran = doc_blocks.run_block("docs/distributed.md", tmp_path)
  run, multi = _launched(ran)
  assert run[run.index("--table-optimizer") + 1] == optimizer and run[-1] == "sage-emb-2x2", run
  out = {"multi": tmp_path / "sage-emb-2x2", "single": tmp_path / "single"}
  single = _jaxdata([*run[:-2], "--out", str(out["single"])], _env(4))
  assert single.returncode == 0, single.stdout + single.stderr
  assert "4-wide node embeddings in host memory" in multi.stdout
  hist = {k: json.load(open(out[k] / "history.json")) for k in out}
  assert len(hist["multi"]) == 2
  for m, s in zip(hist["multi"], hist["single"], strict=True):
    assert m["loss"] == pytest.approx(s["loss"], rel=1e-5)
  tables = {k: jaxdata.load_model(out[k]).tables["embedding"] for k in out}
  from jaxdata.train.sage import SageConfig, initial_embedding

  start = initial_embedding(2000, SageConfig(embed_dim=4))
  moved = np.any(tables["single"] != start, axis=1)
  assert 0 < moved.sum() < len(moved)  # trained the rows the batches touched, only those
  np.testing.assert_allclose(tables["multi"], tables["single"], rtol=1e-5, atol=1e-6)
  line, again = ran[1]
  assert "xla_force_host_platform_device_count=4 jaxdata eval sage-emb-2x2" in line, line
  line = next(l for l in again.stdout.splitlines() if l.startswith("test_accuracy"))
  assert line.split()[1] == line.split("at save: ")[1].rstrip(")")
  too_few = _jaxdata(["eval", str(out["multi"])], _env(2))
  assert too_few.returncode == 2
  assert "trained and measured on a mesh of 4 devices (2 process(es) x 2)" in too_few.stderr


@pytest.mark.slow
def test_processes_given_different_process_counts_all_stop_with_a_clear_error(tmp_path):
  """JAX itself takes process 0's count and lets a process told 3 train as one of 2; jaxdata
  compares the counts once the job has formed and stops every process."""
  port = launch.free_port()
  common = [
    sys.executable,
    "-X",
    "faulthandler",
    "-m",
    "jaxdata.cli",
    *SAGE,
    "--epochs",
    "1",
    "--coordinator",
    f"localhost:{port}",
    "--distributed-timeout",
    "20",
  ]
  procs = [
    subprocess.Popen(
      common + ["--num-processes", n, "--process-id", str(i), "--out", str(tmp_path / str(i))],
      env=_env(2),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i, n in enumerate(["2", "3"])
  ]
  deadline = time.monotonic() + 90
  try:
    outs = [p.communicate(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
  except subprocess.TimeoutExpired:  # where each process hangs: faulthandler's stacks
    for p in procs:
      if p.poll() is None:
        p.send_signal(signal.SIGABRT)
    stacks = [p.communicate(timeout=30)[1] for p in procs]
    pytest.fail(
      "a process did not stop within 90 s:\n"
      + "\n".join(f"--- process {i} ---\n{err}" for i, err in enumerate(stacks))
    )
  finally:
    _kill_left(procs)
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 2, err
    assert (
      "--num-processes differs between the processes (process 0: 2, process 1: 3); the "
      f"job at localhost:{port} has 2 processes"
    ) in err
  assert not (tmp_path / "0").exists()


def test_sparse_update_copies_must_divide_the_axis_and_need_it():
  """`copies` names how many table copies (processes) the axis spans: a count that does not
  divide the axis, or one given without an axis, is refused naming the argument."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh
  from jax.sharding import PartitionSpec as P

  from jaxdata.host import HostTable, sparse
  from jaxdata.train.common import sharded_jit

  sgd = sparse.sparse_sgd(1.0)
  mesh = Mesh(np.array(jax.devices("cpu")[:2]), ("data",))  # CPU devices, on a GPU machine too
  with HostTable(np.zeros((4, 2), np.float32)) as table:

    def update(copies):
      return sharded_jit(
        lambda i, g: sgd.update(table, (), i, g, axis_name="data", copies=copies)[None],
        mesh,
        (P("data"), P("data")),
        P("data"),
      )(jnp.arange(4), jnp.ones((4, 2)))

    with pytest.raises(ValueError, match="has 2 devices, not a multiple of copies=3"):
      update(3)
    with pytest.raises(ValueError, match="copies must be a positive int, got 0"):
      update(0)
    with pytest.raises(ValueError, match="copies=2 needs axis_name"):
      sgd.update(table, (), jnp.arange(2), jnp.ones((2, 2)), copies=2)
    jax.block_until_ready(update(2))  # two copies of one device each: each writes every row
    np.testing.assert_array_equal(table.as_numpy(), -2 * np.ones((4, 2)))


@pytest.mark.slow
def test_the_loaders_iterator_gives_each_process_its_devices_batches(tmp_path):
  """Loader.batches over a mesh of 2 processes x 1 device: process d holds device d's batch of
  a one-process run over 2 devices, for every array of every batch (tests/loader_worker.py;
  tests/test_loader.py holds the one-process batches against each device's own sample)."""
  import numpy as np

  multi = _sparse_worker(tmp_path / "multi", 2, 1, "loader_worker.py")
  (single,) = _sparse_worker(tmp_path / "single", 1, 2, "loader_worker.py")
  assert len(single) > 10 and set(multi[0]) == set(multi[1]) == set(single)
  for key, both in single.items():
    np.testing.assert_array_equal(np.concatenate([multi[0][key], multi[1][key]]), both, key)
  assert (single["batch0_leaf0"] >= 0).any()
