"""--resume and --save-every (`jaxdata train rgat|hgt`, full graph): a run stopped and resumed
ends with the parameters of one that never stopped (CPU, fixed seed); periodic saves land at
their epochs; a checkpoint of other settings is refused."""

import json

import jax
import numpy as np
from flax import nnx

import jaxdata
from jaxdata import cli
from jaxdata.data import synthetic_mag
from jaxdata.train import attention

RUN = ["train", "hgt", "--scale", "0.001", "--hidden", "8", "--heads", "2", "--classes", "4"]


def _params(path):
  return jax.tree.leaves(nnx.state(jaxdata.load_model(str(path)).model, nnx.Param))


def test_a_resumed_run_ends_where_an_uninterrupted_one_does(tmp_path, capsys):
  whole, part = tmp_path / "whole", tmp_path / "part"
  assert cli.main([*RUN, "--epochs", "6", "--out", str(whole)]) == 0
  assert cli.main([*RUN, "--epochs", "3", "--out", str(part)]) == 0
  assert cli.main([*RUN, "--epochs", "6", "--resume", str(part), "--out", str(part)]) == 0
  for a, b in zip(_params(whole), _params(part), strict=True):
    np.testing.assert_array_equal(a, b)
  history = json.load(open(part / "history.json"))
  assert [r["epoch"] for r in history] == list(range(1, 7))
  capsys.readouterr()
  assert cli.main([*RUN, "--epochs", "6", "--hidden", "16", "--resume", str(part)]) == 2
  assert "was trained with other settings (hidden)" in capsys.readouterr().err
  assert cli.main([*RUN, "--epochs", "6", "--resume", str(part)]) == 2
  assert "has trained 6 epochs already" in capsys.readouterr().err
  assert cli.main([*RUN, "--minibatch", "--resume", str(part)]) == 2
  assert "argument --resume: for full-graph training on one device" in capsys.readouterr().err


def test_save_every_hands_over_the_run_at_its_epochs():
  ds = synthetic_mag(scale=0.001, num_classes=4)
  config = attention.TrainConfig(model="rgat", epochs=5, hidden=8, heads=2)
  saved = []
  attention.train(ds, config, save_every=2, on_save=lambda r: saved.append(len(r.history)))
  assert saved == [2, 4]  # the end (5) is the trainer's own save
