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
(per epoch or logged step) for people and plots. `save` writes the new checkpoint beside the old
one (`.NAME.jaxdata-tmp`) and swaps the two folders in one atomic rename, so a run killed while
saving leaves the previous checkpoint readable, and the next save clears what it left behind; a
save that fails (a full disk) clears its temporaries itself. One save of a folder runs at a time:
each holds a lock on `.NAME.jaxdata-lock` beside it, and a second save (another thread or
process) waits for it, up to `LOCK_TIMEOUT` seconds.
A folder holding anything a checkpoint does not (`OWNED`), someone's notes or plots, or one
whose `meta` is not a jaxdata checkpoint's, is never replaced: `check_out` refuses it before
training starts. The meta records a checksum of every array (Orbax and TensorStore check their
index, not the arrays' bytes), so a damaged array file is an error naming the array, never a
model that quietly differs from the one saved.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import dataclasses
import errno
import fcntl
import gc
import hashlib
import importlib
import json
import os
import shutil
import sys
import threading
import time
import types
import typing
from collections.abc import Callable, Collection
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

from jaxdata._version import __version__

FORMAT = 1
#: kind -> the task that rebuilds and measures it (each defines `restore(path, meta)`).
KINDS = {
  "rgcn": "jaxdata.tasks.rgcn",
  "rgat": "jaxdata.tasks.hetero",
  "hgt": "jaxdata.tasks.hetero",
  "rgcn-mag": "jaxdata.tasks.hetero",
  "rgcn-link": "jaxdata.tasks.link",
  "sage": "jaxdata.tasks.sage",
  "gpt": "jaxdata.tasks.gpt",
}
#: What a checkpoint folder holds: its items, Orbax's markers, history.json and its plot. `save`
#: replaces the whole folder, so one holding anything else is refused rather than wiped.
OWNED = frozenset(
  {"meta", "state", "history.json", "history.png", "_CHECKPOINT_METADATA", "commit_success.txt"}
)
#: The entries of `meta` that `load_model` needs, and their JSON types.
META_FIELDS = {
  "kind": str,
  "step": int,
  "config": dict,
  "data": dict,
  "metrics": dict,
  "history": list,
}
_JSON_TYPES = {str: "string", int: "integer", dict: "object", list: "array"}
#: Seconds a save waits for another save of the same folder to finish before it gives up.
LOCK_TIMEOUT = 600.0
#: Seconds a failed save waits for the writes it started to end before it removes its temporaries.
SETTLE_TIMEOUT = 30.0


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


def check_out(path: str | os.PathLike, kinds: Collection[str] = ()) -> str:
  """Where a checkpoint may be written, as an absolute path; raises ValueError saying why not.
  With `kinds` (those the run may save), a checkpoint of another kind is refused too: a GPT run
  does not replace an RGCN model.

  Accepted: a new name in an existing, writable folder; an empty folder; a checkpoint holding
  only what checkpoints hold (`OWNED`), which `save` replaces. Refused: an empty name, a
  symbolic link (replacing it would replace the link, not the folder it names), a file, a
  folder that is not a checkpoint, and a checkpoint holding other files (they would be lost).
  """
  text = os.fspath(path)
  if not text.strip():
    raise ValueError("the checkpoint folder's name is empty")
  full = os.path.abspath(text)
  parent, name = os.path.split(full)
  if os.path.islink(full):
    raise ValueError(
      f"{text!r} is a symbolic link (to {os.readlink(full)!r}): give the folder itself"
    )
  if not name:
    raise ValueError(f"{text!r} names no folder")
  if not os.path.isdir(parent):
    raise ValueError(f"the folder {parent!r} of {text!r} does not exist")
  if not os.access(parent, os.W_OK):
    raise ValueError(f"cannot write into {parent!r}")
  if os.path.lexists(full):
    if not os.path.isdir(full):
      raise ValueError(f"{text!r} exists and is not a folder")
    entries = set(os.listdir(full))
    if entries and not {"meta", "state"} <= entries:
      raise ValueError(
        f"{text!r} exists and is not a checkpoint folder: choose a new or empty folder"
      )
    if entries - OWNED:
      raise ValueError(
        f"{text!r} is a checkpoint that also holds {', '.join(sorted(entries - OWNED))}"
        f": saving replaces the whole folder, so move them out or choose another "
        f"folder"
      )
    kind = _saved_kind(full) if entries else None
    if entries and kind is None:
      raise ValueError(
        f"{text!r} exists and holds 'meta' and 'state' folders but no jaxdata "
        f"checkpoint's meta/metadata: not replaced; choose a new or empty folder"
      )
    if kind is not None and kinds and kind not in kinds:
      raise ValueError(
        f"{text!r} holds a {kind} checkpoint, and this run saves a {' or '.join(kinds)} model: "
        f"not replaced; choose another folder (or move that checkpoint away)"
      )
  return full


def _saved_kind(path: str) -> str | None:
  """The kind in `path`/meta/metadata where it is the JSON a jaxdata checkpoint's `save` wrote (a
  format and a kind), else None: a folder of someone's own 'meta' and 'state' is not one, and is
  never replaced."""
  try:
    with open(os.path.join(path, "meta", "metadata"), encoding="utf-8") as f:
      meta = json.load(f)
  except (OSError, ValueError):
    return None
  if not isinstance(meta, dict) or "format" not in meta or "kind" not in meta:
    return None
  return str(meta["kind"])


def out_dir(text: str, kinds: Collection[str] = ()) -> str:
  """`check_out` as an argparse type: every train command's `--out`, checked before training."""
  try:
    check_out(text, kinds)
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None
  return text


def _temporaries(path: str) -> tuple[str, str]:
  """The siblings a save of `path` uses: the new checkpoint while it is written, and (where the
  system cannot swap folders atomically) the old one between two renames."""
  parent, name = os.path.split(path)
  return os.path.join(parent, f".{name}.jaxdata-tmp"), os.path.join(parent, f".{name}.jaxdata-old")


class CheckpointLocked(TimeoutError):
  """Another save of the same checkpoint folder (another thread or process) held its lock for
  longer than `LOCK_TIMEOUT` seconds; nothing was written."""


@contextlib.contextmanager
def _locked(path: str, timeout: float):
  """Holds the lock of the checkpoint `path` while inside: an exclusive `flock` of the file
  `.NAME.jaxdata-lock` beside it (not inside: the folder is swapped whole), waiting up to
  `timeout` seconds for another holder (CheckpointLocked after). The file is removed on release,
  so none is left behind; a waiter that then holds the removed file takes the new one instead."""
  parent, name = os.path.split(path)
  lock = os.path.join(parent, f".{name}.jaxdata-lock")
  deadline = time.monotonic() + timeout
  while True:
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      while True:
        try:
          fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
          break
        except BlockingIOError:
          if time.monotonic() >= deadline:
            raise CheckpointLocked(
              f"checkpoint.save: another save of {path} (another process or thread) still "
              f"holds its lock {lock} after {timeout:g} s; nothing was written"
            ) from None
          time.sleep(0.05)
      try:
        current = os.path.samestat(os.fstat(fd), os.stat(lock))
      except FileNotFoundError:
        current = False
    except BaseException:
      os.close(fd)
      raise
    if current:
      break
    os.close(fd)  # the previous holder removed this file on release: lock the new one
  try:
    yield
  finally:
    os.unlink(lock)  # while still held, so no waiter holds a file that is no longer the lock
    os.close(fd)


def _settle(threads: set[threading.Thread], timeout: float) -> None:
  """Waits up to `timeout` seconds in all for `threads` to end: the writes of a save that failed
  part-way still run on the threads Orbax started for it (when one item's write fails, the
  others' go on), and would create the temporary folder again after it was removed."""
  deadline = time.monotonic() + timeout
  for t in threads:
    while True:
      try:
        t.join(max(0.0, deadline - time.monotonic()))
        break
      except RuntimeError:  # started, not yet running ("cannot join thread before it is started")
        if time.monotonic() >= deadline:
          break
        time.sleep(0.001)


def _clear_leftovers(path: str) -> None:
  """Removes what a killed save of `path` left: its temporary folder (and Orbax's own temporary
  beside it); an old checkpoint moved aside by a fallback swap goes back where it was."""
  new, old = _temporaries(path)
  if os.path.isdir(old) and not os.path.lexists(path):
    os.rename(old, path)
  parent, base = os.path.split(new)
  for entry in os.listdir(parent):
    if (
      entry == base
      or entry.startswith(base + ".orbax-checkpoint-tmp")
      or entry == (os.path.basename(old))
    ):
      shutil.rmtree(os.path.join(parent, entry))


def _exchange(a: str, b: str) -> bool:
  """Swaps two folders in one atomic step (Linux's renameat2 RENAME_EXCHANGE); False where this
  system or file system cannot."""
  renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
  if renameat2 is None:
    return False
  at_fdcwd, rename_exchange = -100, 2
  if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
    return True
  code = ctypes.get_errno()
  if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
    return False
  raise OSError(code, os.strerror(code), b)


def _put_in_place(new: str, path: str) -> None:
  """Moves the complete checkpoint folder `new` to `path`, replacing what is there, so that at
  every instant `path` holds the old or the new checkpoint whole. Without an atomic exchange
  (not Linux) there are two renames, and a save killed between them leaves the old checkpoint
  beside `path`, which the next save puts back."""
  if not os.path.lexists(path):
    os.rename(new, path)
    return
  replaced = new
  if not _exchange(new, path):
    replaced = _temporaries(path)[1]
    os.rename(path, replaced)
    os.rename(new, path)
  shutil.rmtree(replaced)


def save(
  path: str | os.PathLike,
  *,
  kind: str,
  params: Any,
  config: Any,
  data: dict,
  step: int,
  history: list[dict] = (),
  metrics: dict | None = None,
  optimizer_state: Any = None,
  metrics_note: str = "",
  settings: dict | None = None,
) -> str:
  """Writes a checkpoint folder at `path` (replacing one there); returns its absolute path.

  The new checkpoint is written beside `path` and swapped in whole: a save that fails or is
  killed leaves the previous checkpoint at `path` readable; one that fails removes its
  temporaries, and the next save clears those of one that was killed. `path` must pass
  `check_out` (ValueError otherwise). Saves of one folder run one at a time (threads and
  processes alike): a save waits for another to finish, and raises CheckpointLocked, having
  written nothing, if it has not within `LOCK_TIMEOUT` seconds.

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
    metrics_note: how `metrics` were measured where `evaluate()` measures them otherwise (e.g.
      "on sampled mini-batches ..."); `jaxdata eval` says it beside them.
    settings: what else a resumed run must repeat (JSON-able; e.g. the mini-batch settings).

  In a multi-process job (`jaxdata.distributed`) every process calls `save` with the same
  host values; Orbax writes them once, from process 0, and the others wait at its barriers.
  """
  if kind not in KINDS:
    raise ValueError(f"checkpoint.save: kind must be one of {sorted(KINDS)}, got {kind!r}")

  path = os.path.abspath(os.fspath(path))
  # Process 0 checks, holds the folder's lock and writes (the others could look while it does);
  # the CLI checked --out in every process before training.
  primary = jax.process_index() == 0
  if primary:
    try:
      check_out(path, (kind,))
    except ValueError as e:
      raise ValueError(f"checkpoint.save: {e}") from None
  state = {"params": jax.device_get(params)}
  if optimizer_state is not None:
    state["optimizer"] = jax.device_get(optimizer_state)
  meta = _jsonable(
    dict(
      format=FORMAT,
      kind=kind,
      jaxdata=__version__,
      step=int(step),
      config=config,
      data=data,
      metrics=metrics or {},
      has_optimizer=optimizer_state is not None,
      history=list(history),
      digests=_digests(state),
      metrics_note=str(metrics_note),
      settings=settings or {},
    )
  )
  new = _temporaries(path)[0]
  with _locked(path, LOCK_TIMEOUT) if primary else contextlib.nullcontext():
    if primary:
      _clear_leftovers(path)  # of a killed save: no other save runs now
    before = set(threading.enumerate())
    try:
      ocp, checkpointer = _checkpointer()
      checkpointer.save(
        new,
        args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
        force=True,
      )
      if primary:
        with open(os.path.join(new, "history.json"), "w") as f:
          json.dump(meta["history"], f, indent=1)
        _put_in_place(new, path)
    except BaseException:
      if primary:  # a full disk, Ctrl-C: the previous checkpoint stays, the temporaries go
        _settle(set(threading.enumerate()) - before, SETTLE_TIMEOUT)
        with contextlib.suppress(OSError):
          _clear_leftovers(path)
      raise
  if jax.process_count() > 1:  # no process returns before the checkpoint is at `path`
    ocp.multihost.sync_global_processes("jaxdata_checkpoint_in_place")
  return path


def _path_keys(path) -> tuple[str, ...]:
  """A key path's keys as strings, as Orbax saves them."""

  def key(entry):
    for attr in ("key", "idx", "name"):
      if hasattr(entry, attr):
        return str(getattr(entry, attr))
    return str(entry)

  return tuple(key(k) for k in path)


def _digests(state: dict) -> dict[str, str]:
  """Each array of `state` by name -> "dtype:sha256 of its bytes" (the first 16 hex digits):
  what `restore_state` checks the restored arrays against, since neither Orbax nor TensorStore
  checks the bytes they read (a flipped bit in an array file restores as a wrong value)."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    a = np.ascontiguousarray(np.asarray(leaf))
    out["/".join(_path_keys(path))] = (
      f"{a.dtype}:{hashlib.sha256(a.view(np.uint8).reshape(-1)).hexdigest()[:16]}"
    )
  return out


def _check_digests(where: str, restored: dict, digests: Any) -> None:
  """ValueError naming the first restored array whose bytes differ from those saved (`digests`,
  from `_digests` at save; checkpoints written before it have none and are not checked). An
  array restored in another dtype than it was saved in is not compared."""
  if not isinstance(digests, dict):
    return
  for name, digest in _digests(restored).items():
    saved = digests.get(name)
    if isinstance(saved, str) and saved.split(":")[0] == digest.split(":")[0] and saved != digest:
      raise ValueError(
        f"load_model: {where}: the saved array {name} is damaged (its bytes differ "
        f"from those saved: checksum {digest.split(':')[1]}, saved "
        f"{saved.split(':')[-1]})"
      )


def _collect_quietly() -> None:
  """Collects what a failed Orbax restore left behind: the coroutines of its other reads, each
  holding its own error, which Python would otherwise report one by one ("Exception ignored
  in ...", several lines each) when it finalizes them, after the one-line error was printed."""
  hook = sys.unraisablehook
  sys.unraisablehook = lambda unraisable: None
  try:
    gc.collect()
  finally:
    sys.unraisablehook = hook


def _first_line(e: BaseException) -> str:
  return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def read_meta(path: str | os.PathLike) -> dict:
  """The checkpoint's JSON part (kind, config, data, step, metrics, history), checked: ValueError
  naming the file where it cannot be read or lacks an entry of `META_FIELDS`."""
  path = os.path.abspath(os.fspath(path))
  if not os.path.isdir(path):
    raise FileNotFoundError(f"load_model: no checkpoint folder at {path}")
  if not os.path.isdir(os.path.join(path, "meta")) or not os.path.isdir(
    os.path.join(path, "state")
  ):
    raise ValueError(
      f"load_model: {path} is not a jaxdata checkpoint (no 'meta' and 'state' "
      f"items); `jaxdata train ... --out DIR` writes one"
    )
  where = os.path.join(path, "meta", "metadata")
  ocp, checkpointer = _checkpointer()
  try:
    meta = checkpointer.restore(path, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  except Exception as e:  # noqa: BLE001 - Orbax raises many kinds; the user needs one sentence
    raise ValueError(
      f"load_model: {where}: the checkpoint's metadata cannot be read ({_first_line(e)})"
    ) from e
  if (
    not isinstance(meta, dict)
    or meta.get("format") != FORMAT
    or not isinstance(meta.get("kind"), str)
    or meta["kind"] not in KINDS
  ):
    raise ValueError(
      f"load_model: {where}: a checkpoint of an unknown format or kind "
      f"(format {meta.get('format') if isinstance(meta, dict) else None!r}, kind "
      f"{meta.get('kind') if isinstance(meta, dict) else None!r}); this jaxdata "
      f"reads format {FORMAT} of kinds {sorted(KINDS)}"
    )
  for name, kind in META_FIELDS.items():
    if not isinstance(meta.get(name), kind) or isinstance(meta.get(name), bool):
      raise ValueError(
        f"load_model: {where}: the checkpoint's metadata has no {name!r} (a JSON "
        f"{ {str: 'string', int: 'integer', dict: 'object', list: 'array'}[kind] }"
        f"), found {meta.get(name)!r:.60}"
      )
  if not all(isinstance(v, (int, float)) or v is None for v in meta["metrics"].values()):
    raise ValueError(f"load_model: {where}: the checkpoint's metrics are not all numbers")
  return meta


def json_value(value: Any, annotation: Any, name: str) -> Any:
  """`value` (read from JSON) as a value of the type `annotation` names: a list becomes a tuple
  where a tuple is declared, an integer a float where a float is; ValueError otherwise."""
  origin, args = typing.get_origin(annotation), typing.get_args(annotation)
  if origin in (typing.Union, types.UnionType):
    for option in args:
      try:
        return json_value(value, option, name)
      except ValueError:
        pass
  elif annotation is type(None):
    if value is None:
      return None
  elif origin is tuple and len(args) == 2 and args[1] is Ellipsis:
    if isinstance(value, (list, tuple)):
      return tuple(json_value(v, args[0], name) for v in value)
  elif annotation is bool:
    if isinstance(value, bool):
      return value
  elif annotation is int:
    if isinstance(value, int) and not isinstance(value, bool):
      return value
  elif annotation is float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      return float(value)
  elif annotation is str:
    if isinstance(value, str):
      return value
  else:
    raise TypeError(f"checkpoint: no JSON form for the type {annotation!r} of {name}")
  shown = getattr(annotation, "__name__", None) or str(annotation).replace("NoneType", "None")
  raise ValueError(f"{name} must be {shown}, found {json.dumps(value)[:60]}")


def config_from(cls: type, saved: Any, *, newer: tuple[str, ...] = ()) -> Any:
  """The training configuration `cls` (a dataclass) that a checkpoint's meta `config` holds.

  Every field must be there with a value of its declared type (a hand-edited meta that drops
  `dtype` would otherwise rebuild a bfloat16 model in float32, one with `"seed": null` a random
  one): ValueError naming the entry. `newer`: fields added after checkpoints were first written,
  which take their defaults where missing. Entries the dataclass does not have are refused too.
  """
  if not isinstance(saved, dict):
    raise ValueError(f"the configuration must be a JSON object, found {type(saved).__name__}")
  fields = [f.name for f in dataclasses.fields(cls) if f.init]
  hints = typing.get_type_hints(cls)
  unknown = sorted(set(saved) - set(fields))
  if unknown:
    raise ValueError(f"the configuration has entries {cls.__name__} does not: {unknown}")
  missing = [n for n in fields if n not in saved and n not in newer]
  if missing:
    raise ValueError(f"the configuration lacks {missing} (every {cls.__name__} field is saved)")
  return cls(**{n: json_value(v, hints[n], f"the configuration's {n!r}") for n, v in saved.items()})


def check_entries(data: Any, spec: dict[str, type], what: str) -> dict:
  """`data` (a checkpoint's data description), checked to hold exactly the entries of `spec`,
  each a JSON value of its type (`json_value`); returns it with the values converted.
  ValueError naming the entry otherwise (`what`: the description, for the message)."""
  if not isinstance(data, dict) or set(data) != set(spec):
    found = sorted(data) if isinstance(data, dict) else type(data).__name__
    raise ValueError(
      f"the data description of {what} must have the entries {sorted(spec)}, found {found}"
    )
  return {n: json_value(data[n], t, f"the data description's {n!r}") for n, t in spec.items()}


class DataOverrideError(ValueError):
  """`load_model`'s data overrides name an entry the saved data description does not have (a
  data file given for a checkpoint whose data is generated from its description)."""


def _leaves(tree: Any) -> dict[tuple[str, ...], tuple[int, ...]]:
  """A pytree's leaves by key path (keys as strings, as Orbax saves them) -> shape."""
  return {
    _path_keys(p): tuple(np.shape(leaf))
    for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
  }


class _ClosedLoopTolerant(asyncio.DefaultEventLoopPolicy):
  """Orbax's event loops during a restore, tolerant of the reads a failed restore abandons:
  TensorStore hands each one's end to its loop after Orbax closed it, which raised "Event loop
  is closed" and printed a traceback per read (dozens around the one-line error)."""

  def new_event_loop(self):
    loop = super().new_event_loop()
    call_soon_threadsafe = loop.call_soon_threadsafe

    def tolerant(*args, **kwargs):
      if not loop.is_closed():
        try:
          return call_soon_threadsafe(*args, **kwargs)
        except RuntimeError:
          if not loop.is_closed():
            raise
      return None

    loop.call_soon_threadsafe = tolerant
    loop.set_exception_handler(lambda loop, context: None)  # "never retrieved": ours, reported
    return loop


@contextlib.contextmanager
def _tolerant_loops():
  """Orbax's reads under `_ClosedLoopTolerant`; where they fail, the coroutines they abandoned are
  collected here, their reports dropped (Python printed one traceback each, at exit)."""
  previous = asyncio.get_event_loop_policy()
  asyncio.set_event_loop_policy(_ClosedLoopTolerant())
  try:
    yield
  except Exception:
    unraisablehook, sys.unraisablehook = sys.unraisablehook, lambda report: None
    try:
      gc.collect()
    finally:
      sys.unraisablehook = unraisablehook
    raise
  finally:
    asyncio.set_event_loop_policy(previous)


def restore_state(path: str | os.PathLike, target: dict, digests: Any = None) -> dict:
  """The checkpoint's arrays, in the structure (and dtypes) of `target`: {"params": ...,
  "optimizer": ...} as a freshly built model and optimizer have them.

  ValueError, one line: "do not fit" where the saved arrays' names or shapes differ from
  `target`'s; "cannot be read" naming the folder where an array file is missing or damaged;
  "is damaged" naming the array whose bytes differ from `digests` (the meta's "digests", written
  by `save`; None for a checkpoint from before them: not checked).
  """
  path = os.path.abspath(os.fspath(path))
  where = os.path.join(path, "state")
  ocp, checkpointer = _checkpointer()

  try:
    with _tolerant_loops():
      saved = _leaves(ocp.StandardCheckpointHandler().metadata(epath.Path(where)).tree)
  except Exception as e:  # noqa: BLE001
    raise ValueError(
      f"load_model: {where}: the saved arrays' description cannot be read, a file "
      f"is missing or damaged ({_first_line(e)})"
    ) from e
  wanted = _leaves(target)
  differ = sorted(k for k in saved.keys() | wanted.keys() if saved.get(k) != wanted.get(k))
  if differ:
    k = differ[0]
    raise ValueError(
      f"load_model: {path}: the saved arrays do not fit the model its "
      f"configuration builds ({len(differ)} differ; {'/'.join(k)}: saved "
      f"{saved.get(k, 'none')}, the model's {wanted.get(k, 'none')})"
    )
  failed = None
  try:
    with _tolerant_loops():
      restored = checkpointer.restore(
        path, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))
      )["state"]
  except Exception as e:  # noqa: BLE001
    failed = _first_line(e)[:300]
  if failed is not None:
    _collect_quietly()
    raise ValueError(
      f"load_model: {where}: the saved arrays cannot be read, a file is missing "
      f"or damaged ({failed})"
    )
  _check_digests(where, restored, digests)
  return restored


def restore_nnx(path: str, meta: dict, model, optimizer=None) -> bool:
  """Restores a saved NNX model's parameters (and `optimizer`'s state, where the checkpoint has
  it) in place into freshly built ones of the same configuration; returns whether the optimizer
  state was restored."""
  params = nnx.state(model, nnx.Param)
  target = {"params": nnx.to_pure_dict(params)}
  if optimizer is not None and meta.get("has_optimizer"):
    target["optimizer"] = nnx.to_pure_dict(nnx.state(optimizer))
  state = restore_state(path, target, meta.get("digests"))
  nnx.replace_by_pure_dict(params, state["params"])
  nnx.update(model, params)
  if "optimizer" in state:
    opt_state = nnx.state(optimizer)
    nnx.replace_by_pure_dict(opt_state, state["optimizer"])
    nnx.update(optimizer, opt_state)
  return "optimizer" in state


def save_nnx(path: str | os.PathLike, *, kind: str, model, optimizer=None, **rest: Any) -> str:
  """`save` for an NNX model and its `nnx.Optimizer` (`rest`: save's other arguments)."""
  return save(
    path,
    kind=kind,
    params=nnx.to_pure_dict(nnx.state(model, nnx.Param)),
    optimizer_state=None if optimizer is None else nnx.to_pure_dict(nnx.state(optimizer)),
    **rest,
  )


def load_model(path: str | os.PathLike, /, **data_overrides: Any) -> Loaded:
  """Rebuilds the model saved at `path` (a folder `jaxdata train ... --out` wrote).

  `data_overrides` replace entries of the saved data description, e.g. ``path=...`` where an
  RDF archive has moved since training. Raises FileNotFoundError / ValueError, one line naming the
  problem and the file: a missing folder, a folder that is not a checkpoint, metadata that cannot
  be read or does not describe a model of its kind, array files missing or damaged, or arrays
  that do not fit; DataOverrideError (a ValueError) for an override of an entry the description
  does not have.
  """
  meta = read_meta(path)
  unknown = sorted(set(data_overrides) - set(meta["data"]))
  if unknown:
    raise DataOverrideError(
      f"load_model: {os.path.join(os.path.abspath(path), 'meta', 'metadata')}: its data "
      f"description has no {unknown} to replace: this checkpoint's data "
      f"({meta['data'].get('source', 'synthetic')}) is generated again from its description"
    )
  meta["data"] = {**meta["data"], **data_overrides}
  module = importlib.import_module(KINDS[meta["kind"]])
  path = os.path.abspath(os.fspath(path))
  try:
    return module.restore(path, meta)
  except (ValueError, TypeError, KeyError, AttributeError) as e:  # a hand-edited meta, ...
    if isinstance(e, ValueError) and str(e).startswith("load_model:"):
      raise  # already one line naming the file

    saved_by = meta.get("jaxdata")
    other = (
      f"; it was saved by jaxdata {saved_by}, this is {__version__}"
      if saved_by != __version__
      else ""
    )
    raise ValueError(
      f"load_model: {os.path.join(path, 'meta', 'metadata')}: the configuration "
      f"or data description does not build a {meta['kind']} model "
      f"({_first_line(e)}{other})"
    ) from e
