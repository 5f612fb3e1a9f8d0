"""The `jaxdata` command line: help, version, defaults in --help, and every documented mistake
answered by one line naming the flag, exit code 2, no traceback, before any work starts."""

import gzip
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time

import jax
import pytest

from benchmarks import gather
from jaxdata import cli, command


def _run(argv, capsys):
  """(exit code, stdout, stderr) of `jaxdata argv` run in this process."""
  try:
    code = cli.main(argv)
  except SystemExit as e:  # argparse's own exits (help, version, errors)
    code = e.code
  out = capsys.readouterr()
  return code, out.out, out.err


def test_jaxdata_alone_prints_help(capsys):
  code, out, _ = _run([], capsys)
  assert code == 0
  for name in ("train", "bench", "rok", "info"):
    assert name in out


def test_version(capsys):
  import jaxdata

  code, out, _ = _run(["--version"], capsys)
  assert code == 0 and out.strip() == f"jaxdata {jaxdata.__version__}"


@pytest.mark.parametrize(
  "argv,shown",
  [
    (
      ["train", "rgcn", "--help"],
      [
        "(default: 50;",
        "(default: rgcn-checkpoint)",
        "(default: the paper's setting for the archive, 30 on MUTAG",
        "(default: the paper's setting, none on AIFB and MUTAG",
      ],
    ),
    (["train", "sage", "--help"], ["(default: 15,10)", "(default: 1024)"]),
    (["train", "gpt", "--help"], ["(default: 200)"]),
    (["bench", "minibatch", "--help"], ["(default: 1,2)"]),
    (["rok", "--help"], ["(default: 1.0,0.5,0.3,0.2,0.1)"]),
  ],
)
def test_every_help_shows_defaults(argv, shown, capsys):
  code, out, _ = _run(argv, capsys)
  assert code == 0
  flat = " ".join(out.split()).replace("- ", "-")  # argparse wraps lines at hyphens too
  for s in shown:
    assert s in flat


def _archive(path, members: dict[str, bytes]) -> str:
  with tarfile.open(path, "w:gz") as tar:
    for name, data in members.items():
      info = tarfile.TarInfo(name)
      info.size = len(data)
      tar.addfile(info, io.BytesIO(data))
  return str(path)


MISTAKES = [
  (["train", "rgcn", "--seeds", "0"], "--seeds"),
  (["train", "rgcn", "--epochs", "-3"], "--epochs"),
  (["train", "rgcn", "--lr", "fast"], "--lr"),
  (["train", "rgcn", "--data", "{tmp}/missing.tgz"], "--data"),
  (["train", "rgcn", "--data", "{garbage}"], "--data"),
  (["train", "rgcn", "--data", "{wrong_archive}"], "--data"),
  (["train", "rgcn", "--out", "{tmp}/no/such/folder/params.msgpack"], "--out"),
  (["train", "rgcn", "--bases", "-1"], "--bases"),
  (["train", "rgcn", "--self-loop", "shared"], "--self-loop"),
  (["train", "rgcn", "--self-loop", "basis", "--bases", "0"], "--self-loop"),
  (["train", "rgcn", "--scale", "0.001", "--data", "{garbage}"], "--data"),
  (["train", "rgcn", "--scale", "0.001", "--nodes", "300"], "--nodes"),
  (["train", "rgcn", "--scale", "0.001", "--seeds", "3"], "--seeds"),
  (["train", "rgcn", "--scale", "0"], "--scale"),
  (["train", "rgcn", "--classes", "4"], "--classes"),
  (["train", "rgcn", "--embed", "author"], "--embed"),
  (["train", "sage", "--fanouts", "15,,10"], "--fanouts"),
  (["train", "sage", "--fanouts", "0,5"], "--fanouts"),
  (["train", "sage", "--cache", "1.5"], "--cache"),
  (["train", "gpt", "--offload"], "--offload"),
  (["train", "gpt", "--offload", "--budget", "2XB"], "--budget"),
  (["train", "gpt", "--offload", "--plan", "offload[nope]"], "--plan"),
  (["train", "gpt", "--ssd-dir", "{tmp}/no-such-dir"], "--ssd-dir"),
  (["train", "rgat", "--offload"], "--offload"),
  (["train", "hgt", "--budget", "1MiB", "--ssd-dir", "{tmp}/no-such-dir"], "--ssd-dir"),
  (["train", "hgt", "--passes", "reorder,bogus"], "--passes"),
  (["train", "rgat", "--hidden", "10", "--heads", "4"], "--hidden"),
  (["bench", "gather", "--tables", "1Q"], "--tables"),
  (["bench", "rgnn", "--graphs", "nope"], "--graphs"),
  (["bench", "rgnn", "--data-dir", "{tmp}/nowhere"], "--data-dir"),
  (["bench", "rgnn", "--formulations", "jaxdata"], "--formulations"),
  (["rok", "--write", "{tmp}/curve.png"], "--write"),
  (["train", "nosuchmodel"], "nosuchmodel"),
  # more devices than this process sees, in every trainer
  (["train", "rgcn", "--devices", "{many}"], "--devices"),
  (["train", "rgcn", "--minibatch", "--devices", "{many}"], "--devices"),
  (["train", "rgat", "--devices", "{many}"], "--devices"),
  (["train", "hgt", "--scale", "0.001", "--minibatch", "--devices", "{many}"], "--devices"),
  (["train", "sage", "--devices", "{many}"], "--devices"),
  (["train", "gpt", "--devices", "{many}"], "--devices"),
  # found by an adversarial review of the CLI
  (["train", "sage", "--nodes", "5"], "--nodes"),
  (["train", "sage", "--seed", "99999999999999999999"], "--seed"),
  (["train", "sage", "--fanouts", "9999999999"], "--fanouts"),
  (["train", "gpt", "--vocab", "1"], "--vocab"),
  (["train", "gpt", "--plan", "bogus"], "--plan"),
  (["train", "gpt", "--ram", "1GiB"], "--ram"),
  (["train", "rgcn", "--nodes", "2"], "argument --nodes"),
  (["rok", "--heads", "3", "--hidden", "16"], "--hidden"),
  (["bench", "gather", "--rows", "3"], "--rows"),
  (["bench", "gather", "--tables", "0"], "--tables"),
  (["bench", "gnn-offload", "--layers", "1"], "--layers"),
  (["bench", "minibatch", "--device-counts", "{many}"], "--device-counts"),
  (["bench", "rgnn", "--graphs", "aifb", "--data-dir", "{bad_data}"], "aifb.tgz"),
  (["launch", "-n", "1", "--", "info"], "launch runs train commands"),
  # tracebacks, NaN results or lost files until the session-25 CLI review
  (["train", "gpt", "--budget", "1e400"], "--budget"),
  (["bench", "hetero", "--quick", "--device-bytes", "1e400"], "--device-bytes"),
  (["launch", "--port", "99999", "-n", "1", "--", "train", "gpt"], "--port"),
  (["train", "rgat", "--scale", "1e-6"], "--scale"),
  (["rok", "--write", "{tmp}/figure_folder.md"], "figure_folder.png"),
  (["train", "gpt", "--out", "{tmp}/own"], "--out"),
  # options a training run would otherwise ignore without a word
  (["train", "rgcn", "--fanouts", "5,5"], "--fanouts"),
  (["train", "rgcn", "--pipeline", "device"], "--pipeline"),
  (["train", "rgcn", "--table-optimizer", "sgd"], "--table-optimizer"),
  (["train", "rgcn", "--scale", "0.001", "--batch-size", "64"], "--batch-size"),
  (["train", "rgat", "--scale", "0.001", "--cache", "0.5"], "--cache"),
  (["train", "hgt", "--scale", "0.001", "--device-bytes", "1GB"], "--device-bytes"),
  (["train", "sage", "--pipeline", "cpu", "--cache", "0.5"], "--cache"),
  (["eval", ""], "DIR"),
  (["bench", "one-process", "--keep", "{garbage}"], "--keep"),
]


@pytest.mark.parametrize("argv,flag", MISTAKES, ids=[" ".join(a) for a, _ in MISTAKES])
def test_a_mistake_is_one_line_naming_the_flag_with_exit_code_2(argv, flag, tmp_path, capsys):
  garbage = tmp_path / "garbage.tgz"
  garbage.write_bytes(gzip.compress(b"not a tar archive"))
  wrong = _archive(tmp_path / "wrong.tgz", {"readme.txt": b"hello"})
  (tmp_path / "bad_data").mkdir()
  (tmp_path / "bad_data" / "aifb.tgz").write_bytes(garbage.read_bytes())
  (tmp_path / "figure_folder.png").mkdir()
  for item in ("meta", "state"):  # someone's own folder that looks like a checkpoint
    (tmp_path / "own" / item).mkdir(parents=True)
    (tmp_path / "own" / item / "notes.txt").write_text("mine")
  argv = [
    a.format(
      tmp=tmp_path,
      garbage=garbage,
      wrong_archive=wrong,
      bad_data=tmp_path / "bad_data",
      many=len(jax.local_devices()) + 1,
    )
    for a in argv
  ]
  code, _, err = _run(argv, capsys)
  assert code == 2
  lines = err.strip().splitlines()
  assert len(lines) == 1, err
  assert lines[0].startswith("jaxdata") and "error:" in lines[0] and flag in lines[0]
  assert "Traceback" not in err
  assert all(
    (tmp_path / "own" / item / "notes.txt").read_text() == "mine" for item in ("meta", "state")
  )


def test_a_mistake_in_a_fresh_process_prints_no_traceback():
  proc = subprocess.run(
    [sys.executable, "-m", "jaxdata.cli", "train", "rgcn", "--seeds", "0"],
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines() == [
    "jaxdata train rgcn: error: argument --seeds: must be an integer of at least 1, got 0 "
    "(see jaxdata train rgcn --help)"
  ]


def test_without_the_benchmarks_bench_is_one_line_saying_where_they_are(tmp_path):
  """An install without a clone's examples/benchmarks/ (a wheel) still lists `bench` and `rok`;
  running one is a usage error that says how to get them, whatever its flags."""
  script = (
    "import pathlib, sys; from jaxdata import cli; cli.EXAMPLES = pathlib.Path(sys.argv[1]); "
    "sys.exit(cli.main(sys.argv[2:]))"
  )
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  for argv in (["bench", "hetero", "--scale", "1"], ["rok", "--quick"]):
    proc = subprocess.run(
      [sys.executable, "-c", script, str(tmp_path), *argv],
      capture_output=True,
      text=True,
      timeout=120,
      cwd=tmp_path,
      env=env,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert f"jaxdata {' '.join(argv[: 2 if argv[0] == 'bench' else 1])}" in line
    assert "pip install -e '.[bench]'" in line


def test_quick_never_overrides_flags_the_user_gave(monkeypatch, tmp_path, capsys):
  seen = {}

  def fake_run(tables, rows, *, batch_bytes, cpu_batch_bytes, repeats, console):
    seen.update(tables=tables, rows=rows, batch=batch_bytes, repeats=repeats)
    return [gather.Result(64 << 20, 128, False, 1.0, 1.0, 1.0, 1.0, 1.0)], []

  monkeypatch.setattr(gather, "run", fake_run)
  assert _run(["bench", "gather", "--quick", "--rows", "128", "--repeats", "9"], capsys)[0] == 0
  assert seen == dict(tables=["64M"], rows=[128], batch=32 << 20, repeats=9)
  assert _run(["bench", "gather", "--quick", "--batch-bytes", "1MiB"], capsys)[0] == 0
  assert seen["batch"] == 1 << 20 and seen["repeats"] == 3


@pytest.mark.parametrize("text,want", [("2GiB", 2 << 30), ("2GB", 2 * 10**9), ("512M", 512 << 20)])
def test_size_flags_tell_decimal_from_binary_units(text, want):
  assert command.size(text) == want


TINY = {
  "gpt": [
    "train",
    "gpt",
    "--layers",
    "1",
    "--hidden",
    "16",
    "--heads",
    "2",
    "--seq",
    "8",
    "--batch-size",
    "2",
    "--vocab",
    "16",
    "--steps",
    "4",
    "--log-every",
    "1",
  ],
  "sage": [
    "train",
    "sage",
    "--nodes",
    "200",
    "--edges",
    "1000",
    "--features",
    "4",
    "--classes",
    "2",
    "--fanouts",
    "3,3",
    "--batch-size",
    "16",
    "--hidden",
    "8",
    "--epochs",
    "1",
  ],
  "rgcn": [
    "train",
    "rgcn",
    "--nodes",
    "60",
    "--edges",
    "300",
    "--relations",
    "3",
    "--hidden",
    "4",
    "--epochs",
    "2",
  ],
}


@pytest.mark.parametrize("model", list(TINY))
def test_a_diverged_run_stops_with_one_line_and_saves_nothing(model, tmp_path, capsys):
  out = tmp_path / "ckpt"
  code, _, err = _run(TINY[model] + ["--lr", "1e30", "--out", str(out)], capsys)
  assert code == 1
  assert err.strip().splitlines() == [err.strip()] and "Traceback" not in err
  assert "loss became nan" in err or "loss became inf" in err, err
  assert not out.exists()


def test_a_one_epoch_run_shows_its_own_epoch_and_a_folder_out_path_once(tmp_path, capsys):
  code, out, _ = _run(TINY["sage"] + ["--out", f"{tmp_path}/sub/"], capsys)
  assert code == 0
  assert "epoch 2" not in out and "epoch 1" in out
  assert f"{tmp_path}/sub/history.json" in " ".join(out.split())


def test_ctrl_c_is_one_line_and_exit_code_130(monkeypatch, capsys):
  def interrupted(*args, **kwargs):
    raise KeyboardInterrupt

  monkeypatch.setattr(gather, "run", interrupted)
  code, _, err = _run(["bench", "gather", "--quick"], capsys)
  assert code == 130
  assert err.strip() == "jaxdata bench gather: interrupted"


def test_signals_stop_raises_once_and_gives_the_handlers_back():
  """Inside `signals_stop` SIGTERM raises `Terminated` (a KeyboardInterrupt) and SIGINT
  KeyboardInterrupt, the first signal only (a repeat while stopping is ignored); outside, the
  handlers are those from before."""
  before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
  for signum, raised in ((signal.SIGTERM, command.Terminated), (signal.SIGINT, KeyboardInterrupt)):
    with pytest.raises(raised) as e, command.signals_stop():
      try:
        os.kill(os.getpid(), signum)
        time.sleep(5)  # the handler runs in this thread, before the sleep ends
      finally:
        os.kill(os.getpid(), signal.SIGTERM)  # while stopping: ignored
        os.kill(os.getpid(), signal.SIGINT)
    assert getattr(e.value, "signum", signal.SIGINT) == signum
    assert {s: signal.getsignal(s) for s in before} == before


@pytest.mark.parametrize(
  "signum, said",
  [(signal.SIGTERM, "terminated (SIGTERM)"), (signal.SIGINT, "interrupted (Ctrl-C)")],
)
def test_a_signal_ends_a_training_run_after_its_step_and_saves_it(tmp_path, signum, said):
  """SIGTERM or Ctrl-C to a one-process `jaxdata train` while it trains: it finishes the step it
  is in, saves what it trained to --out, says so in one line (no traceback) and exits 128 + the
  signal."""
  out = tmp_path / "stopped"
  proc = subprocess.Popen(
    [sys.executable, "-m", "jaxdata.cli", *TINY["sage"], "--epochs", "100000", "--out", str(out)],
    env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1"),
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  try:
    lines = []
    for line in proc.stdout:
      lines.append(line)
      if line.startswith("epoch   1"):
        break
    else:
      pytest.fail("the run ended before its first epoch:\n" + "".join(lines))
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.communicate()
  assert proc.returncode == 128 + signum, err
  last = f"jaxdata train sage: {said} after its last completed step"
  assert err.strip().splitlines()[-1] == last, err
  assert "stopping after this step" in err and "Traceback" not in err
  from jaxdata.tasks import checkpoint

  history = json.load(open(out / "history.json"))
  assert 1 <= len(history) < 1000
  assert checkpoint.load_model(str(out)).model is not None


def test_bench_one_process_writes_markdown_only_where_asked(monkeypatch, tmp_path, capsys):
  from benchmarks import one_process

  monkeypatch.setattr(one_process, "run", lambda *args, **kwargs: [])
  monkeypatch.chdir(tmp_path)
  assert _run(["bench", "one-process", "--quick"], capsys)[0] == 0
  assert list(tmp_path.iterdir()) == []
  assert _run(["bench", "one-process", "--quick", "--write", "table.md"], capsys)[0] == 0
  assert (tmp_path / "table.md").read_text().startswith("#")


def test_a_hetero_bench_that_measured_nothing_exits_2_and_writes_nothing(tmp_path, capsys):
  """Every pipeline asked for is skipped (the all-in-GPU one, past a 1000-byte device budget):
  exit 2 with the reason, and no empty table written."""
  out = tmp_path / "hetero.md"
  code, _, err = _run(
    [
      "bench",
      "hetero",
      "--quick",
      "--scale",
      "0.002",
      "--pipelines",
      "device",
      "--device-bytes",
      "1000",
      "--out",
      str(out),
    ],
    capsys,
  )
  assert code == 2
  assert "nothing could be measured" in err and "past the device budget" in err
  assert len(err.strip().splitlines()) == 1 and not out.exists()


def test_a_tensor_cores_bench_that_measured_nothing_exits_2(monkeypatch, tmp_path, capsys):
  """Every row of every case failed (here: the run's rows, each marked "error"): exit 2
  naming the notes' reason, where an empty table used to exit 0."""
  from benchmarks import tensor_cores

  case = tensor_cores.Case(
    "rgcn",
    64,
    [tensor_cores.Measured("rgcn", 64, row, status="error") for row in tensor_cores.rows()],
  )
  monkeypatch.setattr(
    tensor_cores,
    "run",
    lambda *args, **kwargs: ([case], ["rgcn dim 64: every row failed (no GPU)"], []),
  )
  code, _, err = _run(
    ["bench", "tensor-cores", "--quick", "--models", "rgcn", "--write", str(tmp_path / "t.md")],
    capsys,
  )
  assert code == 2
  assert "nothing could be measured: rgcn dim 64: every row failed" in err


def test_a_one_step_gpt_run_reports_no_speed(tmp_path, capsys):
  """Its one step is the compiling one: no ms/step or tokens/s made up from loop overhead."""
  assert (
    cli.main(
      [
        "train",
        "gpt",
        "--layers",
        "1",
        "--hidden",
        "32",
        "--heads",
        "2",
        "--seq",
        "16",
        "--vocab",
        "32",
        "--batch-size",
        "2",
        "--steps",
        "1",
        "--out",
        str(tmp_path / "ck"),
      ]
    )
    == 0
  )
  out = " ".join(capsys.readouterr().out.split())
  assert "no speed: the one step was the compiling one" in out and "ms/step" not in out
  assert f"checkpoint saved to {tmp_path / 'ck'}" in out


def test_out_of_host_memory_is_one_line_with_exit_code_1(monkeypatch, capsys):
  def too_big(*args, **kwargs):
    raise MemoryError("Unable to allocate 728. TiB for an array with shape (99999999999999,)")

  monkeypatch.setattr(gather, "run", too_big)
  code, _, err = _run(["bench", "gather", "--quick"], capsys)
  assert code == 1
  assert err.strip().splitlines() == [
    "jaxdata bench gather: error: out of host memory (Unable to allocate 728. TiB for an array "
    "with shape (99999999999999,)): ask for a smaller run"
  ]


def test_an_offload_that_outgrows_ram_is_one_line_naming_ram(tmp_path):
  """The store's spill fails inside the jitted step (XLA raises it, and JAX's exit hooks raised
  it twice more): one line naming --ram, exit 2, nothing saved."""
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "jaxdata.cli",
      "train",
      "rgat",
      "--scale",
      "0.002",
      "--epochs",
      "1",
      "--hidden",
      "8",
      "--heads",
      "2",
      "--ram",
      "0",
      "--plan",
      "offload[edges]",
      "--out",
      str(tmp_path / "ck"),
    ],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 2, proc.stderr[-3000:]
  [line] = proc.stderr.strip().splitlines()
  assert line.startswith("jaxdata train rgat: error: argument --ram: the RAM tier is full: ")
  assert line.endswith(
    "0 bytes limit in use (a spill this size never fits in it): raise --ram, "
    "or give --ssd-dir for what does not fit"
  ), line
  assert not (tmp_path / "ck").exists()


def test_a_kernel_cache_that_cannot_be_made_is_one_line(tmp_path):
  """JAXDATA_CACHE_DIR naming a file: `info` shows why in its table, `train` stops with one line
  (not a traceback)."""
  blocker = tmp_path / "a-file"
  blocker.write_text("not a folder")
  env = dict(os.environ, JAXDATA_CACHE_DIR=str(blocker))
  info = subprocess.run(
    [sys.executable, "-m", "jaxdata.cli", "info"],
    capture_output=True,
    text=True,
    timeout=300,
    env=env,
  )
  assert info.returncode == 0 and "Traceback" not in info.stderr, info.stderr[-2000:]
  assert "cannot be made (Not a directory)" in " ".join(info.stdout.replace("│", " ").split())
  train = subprocess.run(
    [
      sys.executable,
      "-m",
      "jaxdata.cli",
      "train",
      "rgcn",
      "--nodes",
      "600",
      "--edges",
      "4000",
      "--epochs",
      "1",
    ],
    capture_output=True,
    text=True,
    timeout=300,
    env=env,
  )
  assert train.returncode == 1 and "Traceback" not in train.stderr, train.stderr[-2000:]
  assert train.stderr.strip().splitlines()[-1] == (
    f"jaxdata train rgcn: error: hector's kernel cache {blocker}/hector cannot be made (Not a "
    f"directory): set JAXDATA_CACHE_DIR to a folder this user can write"
  )
