"""Train -> save -> a fresh process rebuilds the model (`jaxdata.load_model`) and measures the
same test accuracy / held-out loss; the optimizer state and the history come back too; bad
checkpoints give errors naming the problem."""

import errno
import fcntl
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from isolation import run_isolated

from jaxdata import cli

#: Tiny runs of every trainer (a few seconds each on a CPU).
RUNS = {
  "rgcn": [
    "train",
    "rgcn",
    "--nodes",
    "600",
    "--edges",
    "4000",
    "--relations",
    "6",
    "--epochs",
    "5",
  ],
  "rgat": [
    "train",
    "rgat",
    "--scale",
    "2e-4",
    "--classes",
    "4",
    "--epochs",
    "3",
    "--hidden",
    "8",
    "--heads",
    "2",
  ],
  "hgt": [
    "train",
    "hgt",
    "--scale",
    "2e-4",
    "--classes",
    "4",
    "--epochs",
    "3",
    "--hidden",
    "8",
    "--heads",
    "2",
  ],
  "rgcn-mag": [
    "train",
    "rgcn",
    "--scale",
    "2e-4",
    "--classes",
    "4",
    "--epochs",
    "3",
    "--hidden",
    "8",
  ],
  "sage": [
    "train",
    "sage",
    "--nodes",
    "2000",
    "--edges",
    "16000",
    "--features",
    "8",
    "--epochs",
    "10",
    "--batch-size",
    "128",
    "--hidden",
    "16",
    "--lr",
    "0.01",
  ],
  "gpt": [
    "train",
    "gpt",
    "--layers",
    "2",
    "--hidden",
    "32",
    "--heads",
    "2",
    "--seq",
    "16",
    "--vocab",
    "32",
    "--batch-size",
    "4",
    "--steps",
    "6",
  ],
}


#: The app layer's modules (tests/test_layering.py): a model loads and measures without them.
APPS = ("jaxdata.train", "jaxdata.cli", "jaxdata.command", "jaxdata.distributed", "jaxdata.launch")


def _load_and_evaluate(path):
  """In a fresh process: what the rebuilt model measures, what was saved, its state, and the app
  modules that loading and measuring it imported."""
  import sys

  import jax

  import jaxdata

  before = set(sys.modules)
  loaded = jaxdata.load_model(path)
  leaves = jax.tree.leaves(loaded.optimizer_state) if loaded.optimizer_state is not None else []
  measured = loaded.evaluate()
  return dict(
    kind=loaded.kind,
    apps=sorted(m for m in set(sys.modules) - before if m.startswith(APPS)),
    measured=measured,
    saved=loaded.metrics,
    step=loaded.meta["step"],
    optimizer_leaves=len(leaves),
    history=loaded.meta["history"],
  )


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """Every kind trained once through the CLI, saved with --out."""
  root = tmp_path_factory.mktemp("checkpoints")
  for kind, argv in RUNS.items():
    assert cli.main(argv + ["--out", str(root / kind)]) == 0, kind
  return root


def _load_and_evaluate_each(root, kinds):
  """`_load_and_evaluate` of every kind's checkpoint under `root`, in one fresh process."""
  return {kind: _load_and_evaluate(f"{root}/{kind}") for kind in kinds}


@pytest.fixture(scope="module")
def reloaded(trained):
  """What one fresh process (not the one that trained) measures of every kind's checkpoint:
  one process for all kinds, so the suite starts JAX once for them, not once per kind."""
  return run_isolated(_load_and_evaluate_each, str(trained), list(RUNS))


@pytest.mark.parametrize("kind", list(RUNS))
def test_a_fresh_process_measures_what_training_measured(trained, reloaded, kind):
  got = reloaded[kind]
  assert got["kind"] == kind
  assert got["apps"] == [], f"loading and measuring a {kind} model imported apps"
  assert got["measured"] and set(got["measured"]) <= set(got["saved"])
  for name, value in got["measured"].items():
    # float32, and on a GPU the fresh process's XLA may pick other kernels (GPT's loss: 1.2e-6
    # apart on the H200)
    np.testing.assert_allclose(value, got["saved"][name], rtol=1e-5, err_msg=name)
  assert got["optimizer_leaves"] > 0  # resumable: the optimizer state came back
  with open(trained / kind / "history.json") as f:
    assert json.load(f) == got["history"] and len(got["history"]) > 0


def test_jaxdata_eval_in_a_fresh_process(trained):
  proc = subprocess.run(
    [sys.executable, "-m", "jaxdata.cli", "eval", str(trained / "rgcn")],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr
  line = next(l for l in proc.stdout.splitlines() if l.startswith("test_accuracy"))
  measured, saved = line.split()[1], line.split("at save: ")[1].rstrip(")")
  assert measured == saved


def test_eval_finds_a_moved_archive_given_data(tmp_path):
  """`jaxdata eval DIR --data PATH` where the RDF archive has moved since training: the data
  description's `path` is replaced (it once collided with load_model's own `path`)."""
  from benchmarks.rgnn import default_data_dir

  data = default_data_dir()
  if data is None or not (aifb := Path(data) / "aifb.tgz").exists():
    pytest.skip("aifb.tgz is missing ($JAXDATA_DATA_DIR or ../shared/data)")
  archive = tmp_path / "aifb.tgz"
  shutil.copy(aifb, archive)
  assert (
    cli.main(
      ["train", "rgcn", "--data", str(archive), "--epochs", "3", "--out", str(tmp_path / "ck")]
    )
    == 0
  )
  moved = archive.rename(tmp_path / "moved.tgz")
  run = lambda *extra: subprocess.run(  # noqa: E731
    [sys.executable, "-m", "jaxdata.cli", "eval", str(tmp_path / "ck"), *extra],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert run().returncode != 0  # the archive is no longer where training read it
  proc = run("--data", str(moved))
  assert proc.returncode == 0, proc.stderr
  line = next(l for l in proc.stdout.splitlines() if l.startswith("test_accuracy"))
  assert line.split()[1] == line.split("at save: ")[1].rstrip(")")


def test_predict_gives_the_classes_evaluate_counts(trained):
  import jaxdata

  loaded = jaxdata.load_model(trained / "hgt")
  predicted = np.asarray(loaded.predict())
  assert predicted.ndim == 1 and predicted.dtype.kind == "i"


def test_sage_predict_classifies_the_test_nodes_as_evaluate_measured(trained):
  """sage's predict samples each node's neighbourhood like training did: on the test nodes its
  accuracy (against the labels, computed here) is the saved test accuracy up to sampling noise,
  far above chance; the same key gives the same classes; bad ids are refused."""
  import jaxdata

  loaded = jaxdata.load_model(trained / "sage")
  from jaxdata.train.sage import load_dataset

  ds = load_dataset(loaded.meta["data"])
  test = np.asarray(ds.test_nodes)
  predicted = loaded.predict(test, batch_size=100)  # several batches, the last one padded
  assert predicted.shape == test.shape and predicted.dtype.kind == "i"
  accuracy = float(np.mean(predicted == np.asarray(ds.labels)[test]))
  saved = loaded.metrics["test_accuracy"]
  assert saved > 2.0 / ds.num_classes  # the run learned, so the comparison means something
  assert abs(accuracy - saved) < 0.08, (accuracy, saved)
  np.testing.assert_array_equal(loaded.predict(test[:50]), predicted[:50])  # the default key
  with pytest.raises(ValueError, match="node ids must be in"):
    loaded.predict(np.array([ds.num_nodes]))
  with pytest.raises(TypeError, match="integer node ids"):
    loaded.predict(np.array([0.5]))


def test_bad_checkpoints_are_named(trained, tmp_path, capsys):
  import jaxdata

  with pytest.raises(FileNotFoundError, match="no checkpoint folder"):
    jaxdata.load_model(tmp_path / "missing")
  (tmp_path / "empty").mkdir()
  with pytest.raises(ValueError, match="not a jaxdata checkpoint"):
    jaxdata.load_model(tmp_path / "empty")
  broken = tmp_path / "broken"
  shutil.copytree(trained / "rgcn", broken)
  meta_files = [p for p in (broken / "meta").iterdir() if p.is_file()]
  for p in meta_files:
    p.write_text("{not json")
  with pytest.raises(ValueError, match="metadata cannot be read"):
    jaxdata.load_model(broken)
  other = tmp_path / "other"  # arrays of one configuration, the metadata of another
  shutil.copytree(trained / "rgcn", other)
  shutil.rmtree(other / "state")
  shutil.copytree(trained / "hgt" / "state", other / "state")
  with pytest.raises(ValueError, match="do not fit"):
    jaxdata.load_model(other)
  assert cli.main(["eval", str(tmp_path / "empty")]) == 2
  assert "not a jaxdata checkpoint" in capsys.readouterr().err


def test_training_never_replaces_a_folder_that_is_not_a_checkpoint(tmp_path, capsys):
  keep = tmp_path / "mine"
  keep.mkdir()
  (keep / "notes.txt").write_text("precious")
  with pytest.raises(SystemExit) as e:
    cli.main(["train", "rgcn", "--epochs", "1", "--out", str(keep)])
  assert e.value.code == 2 and "not a checkpoint folder" in capsys.readouterr().err
  assert (keep / "notes.txt").read_text() == "precious"


def _save_tiny(path, accuracy):
  from jaxdata.tasks import checkpoint

  return checkpoint.save(
    path,
    kind="rgcn",
    params={"w": np.full(3, accuracy, np.float32)},
    config={},
    data={},
    step=1,
    metrics={"test_accuracy": accuracy},
  )


@pytest.mark.parametrize("command", [["gpt"], ["sage"], ["hgt"], ["rgcn", "--scale", "0.001"]])
def test_out_never_replaces_a_checkpoint_of_another_kind(tmp_path, capsys, command):
  """An RGCN entity model at --out: a GPT, GraphSAGE or HGT run refuses it before training (one
  line, exit 2) and so does `save`; `train rgcn --scale` (kind rgcn-mag) may replace it, as
  may an rgcn save."""
  from jaxdata.tasks import checkpoint

  ck = _save_tiny(tmp_path / "ck", 0.25)
  if command[0] == "rgcn":
    assert checkpoint.out_dir(ck, ("rgcn", "rgcn-mag")) == ck
    return
  with pytest.raises(SystemExit) as e:
    cli.main(["train", *command, "--out", str(ck)])
  err = capsys.readouterr().err
  assert e.value.code == 2 and len(err.splitlines()) == 1, err
  assert f"holds a rgcn checkpoint, and this run saves a {command[0]} model" in err
  with pytest.raises(ValueError, match="holds a rgcn checkpoint"):
    checkpoint.save(ck, kind=command[0], params={"w": np.zeros(3)}, config={}, data={}, step=1)
  assert _save_tiny(ck, 0.5) == ck  # the same kind replaces it


def _full(*args, **kwargs):
  raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("writer", ["orbax", "history"])
def test_a_save_that_runs_out_of_space_leaves_the_previous_checkpoint_and_no_temporaries(
  tmp_path, monkeypatch, writer
):
  """The disk fills while Orbax writes (its JSON item fails while the arrays are still being
  written), or after it, at history.json: the error is the disk's, the previous checkpoint
  stays, and nothing else is left beside it, not even by the writes still under way."""
  import orbax.checkpoint as ocp

  from jaxdata.tasks import checkpoint

  _save_tiny(tmp_path / "ck", 0.25)
  if writer == "orbax":

    async def full(*args, **kwargs):
      _full()

    monkeypatch.setattr(ocp.JsonCheckpointHandler, "_save_fn", full)
  else:

    class Full:
      load = staticmethod(json.load)  # check_out reads the old checkpoint's meta
      dump = staticmethod(_full)

    monkeypatch.setattr(checkpoint, "json", Full)
  with pytest.raises(OSError) as e:
    _save_tiny(tmp_path / "ck", 0.75)
  assert e.value.errno == errno.ENOSPC
  monkeypatch.undo()
  assert checkpoint.read_meta(tmp_path / "ck")["metrics"] == {"test_accuracy": 0.25}
  assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
  time.sleep(0.5)  # a write the failed save abandoned would make its folder again by now
  assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def _saved(path) -> tuple[float, np.ndarray]:
  """A `_save_tiny` checkpoint's test accuracy (its meta) and array (its state), as loaded."""
  from jaxdata.tasks import checkpoint

  meta = checkpoint.read_meta(path)
  target = {"params": {"w": np.zeros(3, np.float32)}}
  state = checkpoint.restore_state(path, target, meta["digests"])
  return meta["metrics"]["test_accuracy"], np.asarray(state["params"]["w"])


def test_threads_saving_to_one_folder_at_once_leave_one_of_their_checkpoints_whole(tmp_path):
  """Two threads save different states to one folder at the same moment, three times over: both
  saves succeed, one after the other, and the folder holds one of the two states whole (meta and
  arrays of the same save), with nothing left beside it."""

  def writer(accuracy, start, errors):
    start.wait()
    try:
      _save_tiny(tmp_path / "ck", accuracy)
    except BaseException as e:  # noqa: BLE001 - reported by the test
      errors.append(e)

  _save_tiny(tmp_path / "ck", 0.0)
  for _ in range(3):
    start, errors = threading.Barrier(2), []
    threads = [threading.Thread(target=writer, args=(a, start, errors)) for a in (0.25, 0.75)]
    for t in threads:
      t.start()
    for t in threads:
      t.join(120)
    assert not errors and not any(t.is_alive() for t in threads), errors
    accuracy, w = _saved(tmp_path / "ck")
    assert accuracy in (0.25, 0.75)
    np.testing.assert_array_equal(w, np.full(3, accuracy, np.float32))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def _save_when_all_started(path, accuracy, start, results) -> None:
  """In a process of its own: once every process is ready (Orbax imported, JAX started), saves
  `accuracy` to `path` three times; puts each outcome, "saved" or the error's text, in
  `results`."""
  import jax
  import orbax.checkpoint  # noqa: F401 - imported before the start, so the saves overlap

  jax.device_get(np.zeros(1))
  start.wait(120)
  for _ in range(3):
    try:
      _save_tiny(path, accuracy)
      results.put((accuracy, "saved"))
    except Exception as e:  # noqa: BLE001 - the test judges the message
      results.put((accuracy, f"{type(e).__name__}: {e}"))


@pytest.mark.slow
def test_processes_saving_to_one_folder_at_once_each_save_whole_or_fail_in_one_line(tmp_path):
  """Two processes save different states to one checkpoint folder at the same moment, three
  times each: every save succeeds, or fails with one line naming the folder; the folder holds
  one of the two states whole, with nothing left beside it."""
  _save_tiny(tmp_path / "ck", 0.0)
  ctx = mp.get_context("spawn")
  start, results = ctx.Barrier(2), ctx.Queue()
  procs = [
    ctx.Process(target=_save_when_all_started, args=(str(tmp_path / "ck"), a, start, results))
    for a in (0.25, 0.75)
  ]
  for p in procs:
    p.start()
  try:
    said = [results.get(timeout=240) for _ in range(3 * len(procs))]
  finally:
    for p in procs:
      p.join(60)
      if p.is_alive():
        p.kill()
  assert [p.exitcode for p in procs] == [0, 0]
  for _, outcome in said:
    assert outcome == "saved" or (
      outcome.startswith("CheckpointLocked: checkpoint.save: ")
      and str(tmp_path / "ck") in outcome
      and "\n" not in outcome
    ), outcome
  accuracy, w = _saved(tmp_path / "ck")
  assert (accuracy, "saved") in said
  np.testing.assert_array_equal(w, np.full(3, accuracy, np.float32))
  assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_a_save_waits_for_another_saves_lock_then_fails_in_one_line(tmp_path, monkeypatch, capsys):
  """Another process holds the folder's lock (`.NAME.jaxdata-lock`) throughout: a save waits
  `LOCK_TIMEOUT` seconds, then fails without writing; `jaxdata train` says so in one line, exit
  code 1; the checkpoint there is untouched."""
  from jaxdata.tasks import checkpoint

  _save_tiny(tmp_path / "ck", 0.25)
  monkeypatch.setattr(checkpoint, "LOCK_TIMEOUT", 0.5)
  lock = os.open(tmp_path / ".ck.jaxdata-lock", os.O_RDWR | os.O_CREAT)
  try:
    fcntl.flock(lock, fcntl.LOCK_EX)
    began = time.monotonic()
    with pytest.raises(checkpoint.CheckpointLocked, match="another save of .*ck.* 0.5 s"):
      _save_tiny(tmp_path / "ck", 0.75)
    assert 0.5 <= time.monotonic() - began < 10
    code = cli.main(["train", "rgcn", "--epochs", "1", "--out", str(tmp_path / "ck")])
  finally:
    os.close(lock)
  err = capsys.readouterr().err.strip()
  assert code == 1
  assert err.startswith("jaxdata train rgcn: error: checkpoint.save: another save of ")
  assert len(err.splitlines()) == 1, err
  assert checkpoint.read_meta(tmp_path / "ck")["metrics"] == {"test_accuracy": 0.25}


def test_replacing_a_checkpoint_leaves_no_temporaries_and_clears_a_killed_runs(tmp_path):
  from jaxdata.tasks import checkpoint

  _save_tiny(tmp_path / "ck", 0.25)
  for leftover in (".ck.jaxdata-tmp", ".ck.jaxdata-tmp.orbax-checkpoint-tmp-17"):
    (tmp_path / leftover / "state").mkdir(parents=True)
  _save_tiny(tmp_path / "ck", 0.75)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
  assert checkpoint.read_meta(tmp_path / "ck")["metrics"] == {"test_accuracy": 0.75}


def test_a_checkpoint_holding_other_files_is_never_replaced(tmp_path, capsys):
  from jaxdata.tasks import checkpoint

  _save_tiny(tmp_path / "ck", 0.25)
  (tmp_path / "ck" / "NOTES.txt").write_text("precious")
  (tmp_path / "ck" / "plots").mkdir()
  with pytest.raises(ValueError, match="also holds NOTES.txt, plots"):
    _save_tiny(tmp_path / "ck", 0.75)
  with pytest.raises(SystemExit) as e:
    cli.main(["train", "rgcn", "--epochs", "1", "--out", str(tmp_path / "ck")])
  assert e.value.code == 2 and "also holds NOTES.txt, plots" in capsys.readouterr().err
  assert (tmp_path / "ck" / "NOTES.txt").read_text() == "precious"
  assert checkpoint.read_meta(tmp_path / "ck")["metrics"] == {"test_accuracy": 0.25}


@pytest.mark.parametrize("out, message", [("", "name is empty"), ("link", "symbolic link")])
def test_an_empty_or_linked_out_is_refused_before_training(
  tmp_path, monkeypatch, capsys, out, message
):
  _save_tiny(tmp_path / "ck", 0.25)
  (tmp_path / "link").symlink_to(tmp_path / "ck")
  monkeypatch.chdir(tmp_path)
  with pytest.raises(SystemExit) as e:
    cli.main(["train", "rgcn", "--epochs", "1", "--out", out])
  err = capsys.readouterr().err
  assert e.value.code == 2 and message in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("edit", ["kind=hgt", "kind=list", "no config", "no data", "no step"])
def test_eval_of_a_hand_edited_meta_is_one_line(trained, tmp_path, capsys, edit):
  ck = tmp_path / "ck"
  shutil.copytree(trained / "rgcn", ck)
  meta_file = ck / "meta" / "metadata"
  meta = json.loads(meta_file.read_text())
  if edit.startswith("kind="):
    meta["kind"] = ["rgcn"] if edit == "kind=list" else "hgt"
  else:
    del meta[edit.split()[1]]
  meta_file.write_text(json.dumps(meta))
  assert cli.main(["eval", str(ck)]) == 2
  err = capsys.readouterr().err
  assert len(err.splitlines()) == 1 and str(meta_file) in err, err


@pytest.mark.parametrize(
  "damage", ["missing data file", "truncated data file", "missing _METADATA"]
)
def test_eval_of_damaged_arrays_is_one_line(trained, tmp_path, damage):
  ck = tmp_path / "ck"
  shutil.copytree(trained / "rgcn", ck)
  if damage == "missing _METADATA":
    (ck / "state" / "_METADATA").unlink()
  else:
    for f in (ck / "state" / "d").iterdir():
      f.unlink() if damage.startswith("missing") else f.write_bytes(f.read_bytes()[:10])
  proc = subprocess.run(
    [sys.executable, "-m", "jaxdata.cli", "eval", str(ck)],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 2
  assert len(proc.stderr.splitlines()) == 1, proc.stderr[:3000]
  assert "missing or damaged" in proc.stderr and "do not fit" not in proc.stderr


def test_a_flipped_byte_in_an_array_is_named_not_restored(tmp_path):
  """Orbax and TensorStore do not check the bytes they read: `save` records a checksum per
  array and `restore_state` compares the restored arrays with it."""
  from jaxdata.tasks import checkpoint

  _save_tiny(tmp_path / "ck", 0.25)
  meta = checkpoint.read_meta(tmp_path / "ck")
  target = {"params": {"w": np.zeros(3, np.float32)}}
  got = checkpoint.restore_state(tmp_path / "ck", target, meta["digests"])
  np.testing.assert_array_equal(got["params"]["w"], np.full(3, 0.25, np.float32))
  wrong = dict(meta["digests"], **{"params/w": "float32:0123456789abcdef"})
  with pytest.raises(ValueError, match="the saved array params/w is damaged"):
    checkpoint.restore_state(tmp_path / "ck", target, wrong)
  # another dtype than saved is not compared (nothing to compare its bytes with)
  other = {"params": {"w": np.zeros(3, np.float64)}}
  assert checkpoint.restore_state(tmp_path / "ck", other, wrong)["params"]["w"].dtype == np.float64


def test_eval_of_an_array_file_with_flipped_bits_is_one_line(trained, tmp_path):
  """8 bytes flipped in the middle of the largest array data file (the arrays' chunks, which
  TensorStore reads without a checksum; its b-tree nodes carry one): without `save`'s checksums
  this restored a wrong optimizer moment and measured the model as if nothing happened."""
  ck = tmp_path / "ck"
  shutil.copytree(trained / "rgcn", ck)
  f = max(
    (f for f in (ck / "state").rglob("*") if f.is_file() and f.parent.name == "d"),
    key=lambda f: f.stat().st_size,
  )
  data = bytearray(f.read_bytes())
  i = len(data) // 3
  data[i : i + 8] = bytes(b ^ 0x5A for b in data[i : i + 8])
  f.write_bytes(bytes(data))
  proc = subprocess.run(
    [sys.executable, "-m", "jaxdata.cli", "eval", str(ck)],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 2, proc.stdout + proc.stderr[:3000]
  assert len(proc.stderr.splitlines()) == 1, proc.stderr[:3000]
  # flipped chunk bytes read as other numbers (the checksums catch them) or break the chunk's
  # compression (TensorStore's read fails): the training run's bytes decide which
  assert (
    "is damaged (its bytes differ from those saved" in proc.stderr
    or "the saved arrays cannot be read, a file is missing or damaged" in proc.stderr
  ), proc.stderr


@pytest.mark.parametrize(
  "kind, edit", [("rgcn", "seed=null"), ("sage", "seed=null"), ("rgat", "kind=hgt")]
)
def test_eval_of_a_hand_edited_configuration_is_one_line(trained, tmp_path, capsys, kind, edit):
  """A null seed (the model cannot be built) or an RGAT checkpoint relabelled HGT (it would be
  measured, and printed, as an HGT): one line naming the checkpoint, exit 2."""
  ck = tmp_path / "ck"
  shutil.copytree(trained / kind, ck)
  meta_file = ck / "meta" / "metadata"
  meta = json.loads(meta_file.read_text())
  if edit == "seed=null":
    meta["config"]["seed"] = None
  else:
    meta["kind"] = "hgt"
  meta_file.write_text(json.dumps(meta))
  assert cli.main(["eval", str(ck)]) == 2
  err = capsys.readouterr().err
  assert len(err.strip().splitlines()) == 1 and str(ck) in err, err


#: Hand edits that could rebuild another model than the one saved, without a word: (kind,
#: where, entry, new value or DROP, what the error must say).
DROP = object()
SILENT_EDITS = [
  ("rgat", "config", "dtype", DROP, "lacks ['dtype']"),
  ("rgcn", "config", "hidden", "16", "'hidden' must be int"),
  ("gpt", "config", "evaluate_every", 5, "entries GPTTrainConfig does not"),
  ("sage", "config", "evaluate", None, "'evaluate' must be bool"),
  ("rgcn", "data", "seed", None, "data description's 'seed' must be int"),
  ("hgt", "data", "scale", DROP, "must have the entries"),
  ("sage", "config", "fanouts", [15, "10"], "'fanouts' must be"),
]


@pytest.mark.parametrize(
  "kind, where, entry, value, said",
  SILENT_EDITS,
  ids=[f"{k}-{w}-{e}" for k, w, e, _, _ in SILENT_EDITS],
)
def test_a_configuration_edited_out_of_shape_is_refused_not_defaulted(
  trained, tmp_path, capsys, kind, where, entry, value, said
):
  ck = tmp_path / "ck"
  shutil.copytree(trained / kind, ck)
  meta_file = ck / "meta" / "metadata"
  meta = json.loads(meta_file.read_text())
  if value is DROP:
    del meta[where][entry]
  else:
    meta[where][entry] = value
  meta_file.write_text(json.dumps(meta))
  assert cli.main(["eval", str(ck)]) == 2
  err = " ".join(capsys.readouterr().err.split())
  assert said in err and str(meta_file) in err, err


def test_every_saved_configuration_is_read_back_whole(trained):
  """What `config_from` rebuilds is the configuration that was saved, field for field (lists
  saved by JSON come back as the tuples the dataclasses hold)."""
  import dataclasses

  from jaxdata.tasks import checkpoint, rgcn
  from jaxdata.train import attention, gpt, sage

  classes = {
    "rgcn": rgcn.TrainConfig,
    "rgat": attention.TrainConfig,
    "hgt": attention.TrainConfig,
    "rgcn-mag": attention.TrainConfig,
    "sage": sage.SageConfig,
    "gpt": gpt.GPTTrainConfig,
  }
  for kind, cls in classes.items():
    saved = checkpoint.read_meta(trained / kind)["config"]
    saved.pop("mesh", None)  # sage's: the mesh it trained on, beside its configuration
    config = checkpoint.config_from(cls, saved)
    assert json.loads(json.dumps(dataclasses.asdict(config))) == saved, kind
    assert all(not isinstance(v, list) for v in dataclasses.asdict(config).values()), kind


def test_eval_data_on_a_checkpoint_of_generated_data_is_refused(trained, tmp_path, capsys):
  archive = tmp_path / "aifb.tgz"
  archive.write_bytes(b"")
  assert cli.main(["eval", str(trained / "rgat"), "--data", str(archive)]) == 2
  err = capsys.readouterr().err
  assert len(err.strip().splitlines()) == 1 and "argument --data" in err, err


def test_metrics_measured_on_sampled_batches_say_so_at_training_and_at_eval(
  trained, tmp_path, capsys
):
  """Under --device-bytes a mini-batch run measures its final accuracies on sampled batches, and
  eval measures the whole graph: both outputs say how the saved values were measured."""
  out = tmp_path / "ck"
  assert (
    cli.main(
      [
        "train",
        "rgat",
        "--scale",
        "2e-4",
        "--classes",
        "4",
        "--epochs",
        "2",
        "--hidden",
        "8",
        "--heads",
        "2",
        "--minibatch",
        "--batch-size",
        "64",
        "--fanouts",
        "3,3",
        "--device-bytes",
        "1MB",
        "--out",
        str(out),
      ]
    )
    == 0
  )
  said = "on sampled mini-batches (fanouts 3,3, 64 seeds each), not the whole graph"
  assert said in " ".join(capsys.readouterr().out.split())
  assert cli.main(["eval", str(out)]) == 0
  assert f"the values at save were measured {said}" in " ".join(capsys.readouterr().out.split())
  # a full-graph run's checkpoint (the module's RGAT) says nothing of the kind
  assert cli.main(["eval", str(trained / "rgat")]) == 0
  assert "measured on" not in capsys.readouterr().out


def test_a_saved_run_gets_its_history_plotted_and_stays_replaceable(tmp_path, monkeypatch):
  """`plot_history` draws history.json beside it (a PNG), the folder stays a checkpoint `save`
  may replace, and without matplotlib nothing is drawn."""
  import sys

  from jaxdata.tasks import checkpoint
  from jaxdata.train.common import plot_history

  history = [{"epoch": e, "loss": 1 / e, "val_accuracy": e / 4} for e in range(1, 5)]
  out = checkpoint.save(
    tmp_path / "run",
    kind="rgcn",
    params={"w": np.ones(2)},
    config={},
    data={},
    step=4,
    history=history,
  )
  png = plot_history(out)
  assert png == str(tmp_path / "run" / "history.png")
  assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
  assert checkpoint.check_out(out, ("rgcn",)) == out  # the plot is one of its own files
  monkeypatch.setitem(sys.modules, "matplotlib", None)
  assert plot_history(out) is None
