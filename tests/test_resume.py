"""--resume and --save-every (`jaxdata train rgat|hgt`, full graph and mini-batches): a run
stopped and resumed ends with the parameters of one that never stopped (CPU, fixed seed), a
mini-batch run stopped mid-epoch going on from the next batch; periodic saves land at their
epochs; a checkpoint of other settings is refused."""

import itertools
import json
import re

import jax
import numpy as np
import pytest
from flax import nnx

import jaxdata
from jaxdata import cli, command
from jaxdata.data import synthetic_mag
from jaxdata.train import attention

RUN = ["train", "hgt", "--scale", "0.001", "--hidden", "8", "--heads", "2", "--classes", "4"]


def _params(path):
  return jax.tree.leaves(nnx.state(jaxdata.load_model(str(path)).model, nnx.Param))


def _same_params(whole, part):
  """The two checkpoints' parameters: equal bit for bit on the CPU. On a GPU the scatters'
  atomics add in another order each run, so two runs agree to float32 rounding (about 1e-7
  here), far inside what a wrong resume moves (a learning-rate step, 1e-3 or more)."""
  exact = jax.default_backend() == "cpu"
  for a, b in zip(_params(whole), _params(part), strict=True):
    if exact:
      np.testing.assert_array_equal(a, b)
    else:
      np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)


def test_a_resumed_run_ends_where_an_uninterrupted_one_does(tmp_path, capsys):
  whole, part = tmp_path / "whole", tmp_path / "part"
  assert cli.main([*RUN, "--epochs", "6", "--out", str(whole)]) == 0
  assert cli.main([*RUN, "--epochs", "3", "--out", str(part)]) == 0
  assert cli.main([*RUN, "--epochs", "6", "--resume", str(part), "--out", str(part)]) == 0
  _same_params(whole, part)
  history = json.load(open(part / "history.json"))
  assert [r["epoch"] for r in history] == list(range(1, 7))
  capsys.readouterr()
  assert cli.main([*RUN, "--epochs", "6", "--hidden", "16", "--resume", str(part)]) == 2
  assert "was trained with other settings (hidden)" in capsys.readouterr().err
  assert cli.main([*RUN, "--epochs", "6", "--resume", str(part)]) == 2
  assert "has trained 6 epochs already" in capsys.readouterr().err
  assert cli.main([*RUN, "--minibatch", "--epochs", "7", "--resume", str(part)]) == 2
  assert "other mini-batch settings (none: full graph)" in capsys.readouterr().err
  assert cli.main([*RUN, "--devices", "2", "--resume", str(part)]) == 2
  err = capsys.readouterr().err  # (a one-GPU machine refuses the two devices first)
  assert re.search(r"argument --(resume: for training on one device|devices: 2 devices)", err)


def _stopped_mid_epoch_and_resumed(run, tmp_path, monkeypatch):
  """`run` whole, then stopped at the second batch of epoch 2 (a stop request, as SIGTERM makes,
  seen by the loops' checks after every batch and every epoch) and resumed: checks that it saved
  where it stopped and ends with the whole run's parameters; returns (its folder, batches per
  epoch)."""
  whole, part = tmp_path / "whole", tmp_path / "part"
  assert cli.main([*run, "--out", str(whole)]) == 0
  per_epoch = json.load(open(whole / "history.json"))[0]["batches_per_epoch"]
  assert per_epoch >= 4
  checks = itertools.count(1)
  monkeypatch.setattr(command, "stop_requested", lambda: next(checks) >= per_epoch + 3)
  assert cli.main([*run, "--out", str(part)]) == 143  # saved, then "terminated"
  monkeypatch.undo()
  stopped = json.load(open(part / "history.json"))
  assert [(r["epoch"], r["batch"]) for r in stopped] == [(1, per_epoch), (2, 2)]
  assert cli.main([*run, "--resume", str(part), "--out", str(part)]) == 0
  _same_params(whole, part)
  return part, per_epoch


MINIBATCH = [*RUN, "--minibatch", "--fanouts", "3,3", "--batch-size", "32", "--epochs", "2"]


def test_a_minibatch_run_stopped_mid_epoch_goes_on_from_the_next_batch(
  tmp_path, monkeypatch, capsys
):
  part, per_epoch = _stopped_mid_epoch_and_resumed(MINIBATCH, tmp_path, monkeypatch)
  resumed = json.load(open(part / "history.json"))
  assert [(r["epoch"], r["batch"]) for r in resumed[2:]] == [(2, per_epoch)]
  capsys.readouterr()
  assert cli.main([*MINIBATCH, "--batch-size", "16", "--resume", str(part)]) == 2
  assert "other mini-batch settings" in capsys.readouterr().err


def test_save_every_hands_over_the_run_at_its_epochs():
  ds = synthetic_mag(scale=0.001, num_classes=4)
  config = attention.TrainConfig(model="rgat", epochs=5, hidden=8, heads=2)
  saved = []
  attention.train(ds, config, save_every=2, on_save=lambda r: saved.append(len(r.history)))
  assert saved == [2, 4]  # the end (5) is the trainer's own save


ENTITY = ["train", "rgcn", "--nodes", "2000", "--edges", "20000", "--relations", "8"]


def test_the_main_job_resumes_too(tmp_path, capsys):
  """`jaxdata train rgcn` (the README's main job, full graph): 3 epochs, then resumed to 6,
  ends where 6 in one go do; --save-every writes at its epochs."""
  whole, part = tmp_path / "whole", tmp_path / "part"
  assert cli.main([*ENTITY, "--epochs", "6", "--out", str(whole)]) == 0
  assert cli.main([*ENTITY, "--epochs", "3", "--save-every", "2", "--out", str(part)]) == 0
  assert cli.main([*ENTITY, "--epochs", "6", "--resume", str(part), "--out", str(part)]) == 0
  _same_params(whole, part)
  assert [r["epoch"] for r in json.load(open(part / "history.json"))] == list(range(1, 7))
  capsys.readouterr()
  assert cli.main([*ENTITY, "--epochs", "7", "--seeds", "2", "--resume", str(part)]) == 2
  assert "for one run (--seeds 1) of full-graph training" in capsys.readouterr().err
  assert cli.main([*ENTITY, "--epochs", "7", "--lr", "0.1", "--resume", str(part)]) == 2
  assert "other settings (learning_rate)" in capsys.readouterr().err


SAGE = ["train", "sage", "--nodes", "3000", "--edges", "30000", "--features", "8", "--hidden", "16"]
SAGE += ["--batch-size", "64", "--fanouts", "4,4", "--epochs", "3"]


@pytest.mark.parametrize("pipeline", ["host", "cpu"])
def test_graphsage_stopped_mid_epoch_goes_on_from_the_next_batch(
  tmp_path, monkeypatch, capsys, pipeline
):
  part, _ = _stopped_mid_epoch_and_resumed([*SAGE, "--pipeline", pipeline], tmp_path, monkeypatch)
  capsys.readouterr()
  assert cli.main([*SAGE, "--embed-dim", "4", "--resume", str(part)]) == 2
  assert "argument --resume: for one device, without --embed-dim" in capsys.readouterr().err


GPT = ["train", "gpt", "--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "16"]
GPT += ["--batch-size", "4", "--vocab", "32", "--log-every", "2"]


def test_gpt_stopped_at_a_step_goes_on_from_the_next(tmp_path, monkeypatch, capsys):
  whole, part = tmp_path / "whole", tmp_path / "part"
  assert cli.main([*GPT, "--steps", "8", "--out", str(whole)]) == 0
  checks = itertools.count(1)  # checked after every step
  monkeypatch.setattr(command, "stop_requested", lambda: next(checks) >= 3)
  assert cli.main([*GPT, "--steps", "8", "--save-every", "4", "--out", str(part)]) == 143
  monkeypatch.undo()
  assert json.load(open(part / "history.json"))[-1]["step"] == 3
  assert (
    cli.main([*GPT, "--steps", "8", "--save-every", "4", "--resume", str(part), "--out", str(part)])
    == 0
  )
  _same_params(whole, part)
  steps = [r["step"] for r in json.load(open(part / "history.json"))]
  assert steps == [2, 3, 4, 6, 8]  # logged every 2, at the stop, and where it saved
  capsys.readouterr()
  assert cli.main([*GPT, "--steps", "8", "--resume", str(part)]) == 2
  assert "has trained 8 steps already: ask for more with --steps" in capsys.readouterr().err


LINK = ["train", "rgcn", "--task", "link", "--nodes", "120", "--edges", "900", "--hidden", "8"]


def test_link_prediction_resumes(tmp_path):
  whole, part = tmp_path / "whole", tmp_path / "part"
  assert cli.main([*LINK, "--epochs", "6", "--out", str(whole)]) == 0
  assert cli.main([*LINK, "--epochs", "3", "--out", str(part)]) == 0
  assert cli.main([*LINK, "--epochs", "6", "--resume", str(part), "--out", str(part)]) == 0
  _same_params(whole, part)
