"""Checkpoints of trained models, with Orbax: parameters, optimizer state and step, plus what it
takes to rebuild the model and its data (the training configuration and a description of the
data), the training history and the metrics measured at the end of training.

Every `jaxdata train ...` saves one (`--out DIR`); `load_model` rebuilds a ready model from it in a
fresh process, and `jaxdata eval DIR` (`jaxdata.cli`) measures it again on its data:

    from jaxdata import load_model
    loaded = load_model("rgcn-checkpoint")
    print(loaded.kind, loaded.evaluate())          # e.g. rgcn {'test_accuracy': 0.9444}
    logits = loaded.predict()                       # the model on its data (per kind)

A checkpoint is a folder: Orbax's `state` (arrays) and `meta` (JSON) items, and `history.json`
(per epoch or logged step) for people and plots. Orbax writes each item whole or not at all, so
a run killed while saving leaves the previous checkpoint readable.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
from typing import Any, Callable

import jax
import numpy as np

from jaxdata import command

FORMAT = 1
#: kind -> the training module that builds and evaluates it (each defines `restore`).
KINDS = {"rgcn": "jaxdata.train.rgcn", "rgat": "jaxdata.train.attention",
         "hgt": "jaxdata.train.attention", "rgcn-mag": "jaxdata.train.attention", "sage": "jaxdata.train.sage",
         "gpt": "jaxdata.train.gpt"}


@dataclasses.dataclass
class Loaded:
  """A model rebuilt from a checkpoint, ready to use.

  `evaluate()` measures what training measured at its end (test accuracy, held-out loss) on the
  same data; `predict` runs the model on its data: class logits (rgcn) or predicted classes
  (rgat, hgt, rgcn-mag) for every paper, `predict(tokens)` next-token logits (gpt),
  `predict(nodes)` predicted classes from sampled neighbourhoods (sage).
  """
  kind: str
  model: Any
  meta: dict
  evaluate: Callable[[], dict]
  predict: Callable[..., Any] | None
  optimizer_state: Any = None
  tables: dict[str, Any] | None = None  # host tables trained in place (sage: "embedding")

  @property
  def metrics(self) -> dict:
    """The metrics measured when the checkpoint was saved."""
    return self.meta.get("metrics", {})


def _checkpointer():
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  return ocp, ocp.Checkpointer(ocp.CompositeCheckpointHandler())


def _jsonable(value: Any) -> Any:
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    value = dataclasses.asdict(value)
  if isinstance(value, dict):
    return {str(k): _jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_jsonable(v) for v in value]
  if isinstance(value, (np.generic, np.ndarray)):
    return value.tolist()
  if isinstance(value, float) and value != value:  # NaN: JSON has none
    return None
  return value


def save(path: str | os.PathLike, *, kind: str, params: Any, config: Any, data: dict,
         step: int, history: list[dict] = (), metrics: dict | None = None,
         optimizer_state: Any = None) -> str:
  """Writes a checkpoint folder at `path` (replacing one there); returns its absolute path.

  Args:
    kind: one of `KINDS`: how `load_model` rebuilds it.
    params: the model's parameters, a pytree of arrays (`nnx.state(model, nnx.Param)`'s pure
      dict for NNX models).
    config: the training configuration (a dataclass or dict; saved as JSON).
    data: what rebuilds the data (JSON-able; each training module defines its own).
    step: optimizer steps taken.
    history: per-epoch (or logged step) records, also written to `history.json`.
    metrics: what training measured at its end (`load_model(...).evaluate()` measures it again).
    optimizer_state: the optimizer's state pytree, if the run is to be resumable.

  In a multi-process job (`jaxdata.distributed`) every process calls `save` with the same
  host values; Orbax writes them once, from process 0, and the others wait at its barriers.
  """
  if kind not in KINDS:
    raise ValueError(f"checkpoint.save: kind must be one of {sorted(KINDS)}, got {kind!r}")
  import jaxdata  # pylint: disable=g-import-not-at-top
  path = os.path.abspath(os.fspath(path))
  # Orbax replaces the whole folder: never someone else's. Process 0 checks (the others could
  # look while it writes); the CLI checked --out in every process before training.
  if jax.process_index() == 0 and not command.is_replaceable(path):
    raise ValueError(f"checkpoint.save: {path} exists and is neither empty nor a checkpoint")
  state = {"params": jax.device_get(params)}
  if optimizer_state is not None:
    state["optimizer"] = jax.device_get(optimizer_state)
  meta = _jsonable(dict(format=FORMAT, kind=kind, jaxdata=jaxdata.__version__, step=int(step),
                        config=config, data=data, metrics=metrics or {},
                        has_optimizer=optimizer_state is not None, history=list(history)))
  ocp, checkpointer = _checkpointer()
  checkpointer.save(path, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                  meta=ocp.args.JsonSave(meta)), force=True)
  if jax.process_index() == 0:  # in a multi-process job every process calls save; one writes
    with open(os.path.join(path, "history.json"), "w") as f:
      json.dump(meta["history"], f, indent=1)
  return path


def read_meta(path: str | os.PathLike) -> dict:
  """The checkpoint's JSON part (kind, config, data, step, metrics, history), checked."""
  path = os.path.abspath(os.fspath(path))
  if not os.path.isdir(path):
    raise FileNotFoundError(f"load_model: no checkpoint folder at {path}")
  if not os.path.isdir(os.path.join(path, "meta")) or not os.path.isdir(
      os.path.join(path, "state")):
    raise ValueError(f"load_model: {path} is not a jaxdata checkpoint (no 'meta' and 'state' "
                     f"items); `jaxdata train ... --out DIR` writes one")
  ocp, checkpointer = _checkpointer()
  try:
    meta = checkpointer.restore(path, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  except Exception as e:  # noqa: BLE001 - Orbax raises many kinds; the user needs one sentence
    raise ValueError(f"load_model: {path}: the checkpoint's metadata cannot be read "
                     f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e
  if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("kind") not in KINDS:
    raise ValueError(f"load_model: {path} is a checkpoint of an unknown format or kind "
                     f"(format {meta.get('format') if isinstance(meta, dict) else None}, kind "
                     f"{meta.get('kind') if isinstance(meta, dict) else None}); this jaxdata "
                     f"reads format {FORMAT} of kinds {sorted(KINDS)}")
  return meta


def restore_state(path: str | os.PathLike, target: dict) -> dict:
  """The checkpoint's arrays, in the structure (and dtypes) of `target`: {"params": ...,
  "optimizer": ...} as a freshly built model and optimizer have them."""
  path = os.path.abspath(os.fspath(path))
  ocp, checkpointer = _checkpointer()
  try:
    return checkpointer.restore(path, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target)))["state"]
  except Exception as e:  # noqa: BLE001
    raise ValueError(f"load_model: {path}: the saved arrays do not fit the model its "
                     f"configuration builds ({type(e).__name__}: "
                     f"{str(e).splitlines()[0] if str(e) else ''})") from e


def restore_nnx(path: str, meta: dict, model, optimizer=None) -> bool:
  """Restores a saved NNX model's parameters (and `optimizer`'s state, where the checkpoint has
  it) in place into freshly built ones of the same configuration; returns whether the optimizer
  state was restored."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  params = nnx.state(model, nnx.Param)
  target = {"params": nnx.to_pure_dict(params)}
  if optimizer is not None and meta.get("has_optimizer"):
    target["optimizer"] = nnx.to_pure_dict(nnx.state(optimizer))
  state = restore_state(path, target)
  nnx.replace_by_pure_dict(params, state["params"])
  nnx.update(model, params)
  if "optimizer" in state:
    opt_state = nnx.state(optimizer)
    nnx.replace_by_pure_dict(opt_state, state["optimizer"])
    nnx.update(optimizer, opt_state)
  return "optimizer" in state


def save_nnx(path: str | os.PathLike, *, kind: str, model, optimizer=None, **rest: Any) -> str:
  """`save` for an NNX model and its `nnx.Optimizer` (`rest`: save's other arguments)."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  return save(path, kind=kind, params=nnx.to_pure_dict(nnx.state(model, nnx.Param)),
              optimizer_state=None if optimizer is None else nnx.to_pure_dict(nnx.state(optimizer)),
              **rest)


def load_model(path: str | os.PathLike, /, **data_overrides: Any) -> Loaded:
  """Rebuilds the model saved at `path` (a folder `jaxdata train ... --out` wrote).

  `data_overrides` replace entries of the saved data description, e.g. ``path=...`` where an
  RDF archive has moved since training. Raises FileNotFoundError / ValueError naming the problem
  for a missing folder, a folder that is not a checkpoint, or arrays that do not fit.
  """
  meta = read_meta(path)
  meta["data"] = {**meta["data"], **data_overrides}
  module = importlib.import_module(KINDS[meta["kind"]])
  return module.restore(os.path.abspath(os.fspath(path)), meta)
