"""What every `jaxdata` command shares: its argument parser, argument types that check values,
one-line errors, and the console it prints to.

A mistake (a bad number, a missing file, an output folder that does not exist) is reported as
one line naming the flag, with exit code 2 and no traceback, before any work starts:

    $ jaxdata train rgcn --seeds 0
    jaxdata train rgcn: error: argument --seeds: must be at least 1, got 0 (see --help)

Every `--help` shows each option's default. Commands raise `UsageError` for mistakes they can
only see later (a corrupt data file); `jaxdata.cli.main` prints it the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import rich.console

from jaxdata.sizes import parse_bytes


class UsageError(Exception):
  """A mistake in what the user asked for: printed as one line, exit code 2."""


class Terminated(KeyboardInterrupt):
  """SIGTERM, raised where the command is as Ctrl-C raises KeyboardInterrupt (`signals_stop`), so
  that what cleans up after one cleans up after the other; `jaxdata.cli` reports it in one line,
  exit code 143 (128 + SIGTERM, as a shell reports a process SIGTERM ended)."""

  signum = signal.SIGTERM


#: Set by the first SIGTERM or Ctrl-C inside `soft_stop`: training loops finish the step they
#: are in and stop (`stop_requested`), and the command saves what it trained.
_stop_requested = threading.Event()
_soft = threading.Event()
_stop_signal = [signal.SIGTERM]  # the signal that asked for the stop


def stop_requested() -> bool:
  """Whether a SIGTERM or Ctrl-C asked the command to stop after its current step
  (`soft_stop`)."""
  return _stop_requested.is_set()


def stop_signal() -> int:
  """The signal behind `stop_requested` (SIGTERM or SIGINT)."""
  return _stop_signal[0]


@contextlib.contextmanager
def soft_stop(enabled: bool = True) -> Iterator[None]:
  """While inside (and `enabled`), the first SIGTERM or Ctrl-C does not raise: it sets
  `stop_requested`, which training loops check after every step, so the run ends after its
  last completed step and saves it; a second one stops at once as `signals_stop` does. Not for
  multi-process jobs, whose processes must stop at the same step."""
  if enabled:
    _soft.set()
  try:
    yield
  finally:
    _soft.clear()


@contextlib.contextmanager
def signals_stop() -> Iterator[Callable[[], None]]:
  """While inside, SIGINT raises KeyboardInterrupt and SIGTERM raises `Terminated` in the main
  thread (inside `soft_stop`, the first SIGTERM asks for a stop after the current step), the
  first one only: a signal that arrives while the command is already stopping is
  ignored (`jaxdata launch` passes on the Ctrl-C a terminal also sent to its processes). Yields
  a function that installs the handlers again, for after code that takes SIGTERM for itself
  (`jax.distributed.initialize`: XLA's preemption notifier only logs it). Outside the main
  thread, where Python cannot handle signals, it does nothing."""
  if threading.current_thread() is not threading.main_thread():
    yield lambda: None
    return
  stopping = False

  def stop(signum, frame):
    nonlocal stopping
    if _soft.is_set() and not _stop_requested.is_set():
      _stop_signal[0] = signum
      _stop_requested.set()  # the training loop stops after this step (`soft_stop`)
      name = "SIGTERM" if signum == signal.SIGTERM else "Ctrl-C"
      print(f"jaxdata: {name}: stopping after this step (again to stop now)", file=sys.stderr)
      return
    if not stopping:
      stopping = True
      raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()

  def install():
    for s in (signal.SIGINT, signal.SIGTERM):
      signal.signal(s, stop)

  previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
  install()
  try:
    yield install
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler if handler is not None else signal.SIG_DFL)


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
  """Shows "(default: X)" where there is a default to show and the help does not give it."""

  def _get_help_string(self, action: argparse.Action) -> str:
    text = action.help or ""
    if (
      action.default in (None, False, argparse.SUPPRESS)
      or "default" in text
      or not action.option_strings
    ):
      return text
    default = action.default
    if isinstance(default, (list, tuple)):
      default = ",".join(str(d) for d in default)
    return f"{text} (default: {default})".strip()


class Parser(argparse.ArgumentParser):
  """An ArgumentParser whose errors are one line (exit code 2) and whose help shows defaults.

  Subcommand parsers made from it are Parsers too."""

  def __init__(self, *args: Any, **kwargs: Any):
    kwargs.setdefault("formatter_class", _Formatter)
    super().__init__(*args, **kwargs)

  def error(self, message: str):  # argparse's own: usage + message; ours: one line
    self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def fail(prog: str, error: BaseException, code: int = 2) -> int:
  """Prints `error` as the one line a mistake gets; returns the exit `code`."""
  print(f"{prog}: error: {error}", file=sys.stderr)
  return code


def _checked(kind: Callable[[str], Any], test: Callable[[Any], bool], need: str):
  def parse(text: str):
    try:
      value = kind(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{text!r} is not {need}") from None
    if not test(value):
      raise argparse.ArgumentTypeError(f"must be {need}, got {text}")
    return value

  parse.__name__ = need
  return parse


def integer(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
  """An integer of at least `minimum` (and at most `maximum`)."""
  if maximum is None:
    return _checked(int, lambda v: v >= minimum, f"an integer of at least {minimum}")
  return _checked(int, lambda v: minimum <= v <= maximum, f"an integer from {minimum} to {maximum}")


positive_int = integer(1)
natural_int = integer(0)
#: A random seed: JAX keys and NumPy generators take it, and offsets of it (seed + 1, ...).
seed = integer(0, 2**32 - 1)
positive_float = _checked(float, lambda v: v > 0 and v != float("inf"), "a positive number")
natural_float = _checked(float, lambda v: 0 <= v < float("inf"), "a number of at least 0")
fraction = _checked(float, lambda v: 0 <= v <= 1, "a fraction between 0 and 1")


def choice(names: tuple[str, ...]) -> Callable[[str], str]:
  """One of `names` (for items of a `listing`; a single choice is argparse's `choices=`)."""
  return _checked(str, lambda v: v in names, "one of " + ", ".join(names))


def listing(kind: Callable[[str], Any]) -> Callable[[str], list]:
  """Comma-separated values of `kind` (one of the checked types above, or str): "15,10"."""

  def parse(text: str) -> list:
    items = text.split(",")
    if not text.strip() or any(not i.strip() for i in items):
      raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list (e.g. 15,10)")
    return [kind(i.strip()) for i in items]

  parse.__name__ = "list"
  return parse


def size(text: str) -> int:
  """Bytes, with units: 512MiB, 2GiB (binary), 2GB (decimal); see `jaxdata.sizes`."""
  try:
    return parse_bytes(text)
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None


def size_or_auto(text: str) -> int | str:
  """A `size`, or "auto" (the caller decides what auto means; `--device-bytes`: a quarter of
  the feature and embedding tables)."""
  return "auto" if text == "auto" else size(text)


def existing_dir(text: str) -> str:
  """A path to a folder that exists."""
  if not os.path.isdir(text):
    raise argparse.ArgumentTypeError(
      f"{text!r} is not a folder" if os.path.exists(text) else f"{text!r} does not exist"
    )
  return text


def existing_path(text: str) -> str:
  """A path to a file or folder that exists."""
  return existing_dir(text) if os.path.isdir(text) else existing_file(text)


def existing_file(text: str) -> str:
  """A path to a file that exists and can be read."""
  if not os.path.isfile(text):
    raise argparse.ArgumentTypeError(
      f"{text!r} is not a file" if os.path.exists(text) else f"{text!r} does not exist"
    )
  if not os.access(text, os.R_OK):
    raise argparse.ArgumentTypeError(f"{text!r} cannot be read")
  return text


def _parent_writable(text: str) -> None:
  folder = os.path.dirname(os.path.abspath(text))
  if not os.path.isdir(folder):
    raise argparse.ArgumentTypeError(
      f"the folder {os.path.dirname(text) or '.'!r} of {text!r} does not exist"
    )
  if not os.access(folder, os.W_OK):
    raise argparse.ArgumentTypeError(f"cannot write into {os.path.dirname(text) or '.'!r}")


def output_path(text: str) -> str:
  """A file to write: its folder must exist and be writable now, not after hours of training."""
  _parent_writable(text)
  if os.path.isdir(text):
    raise argparse.ArgumentTypeError(f"{text!r} is a folder")
  plot = os.path.splitext(text)[0] + ".png"  # where a bench with a figure draws it
  if text.endswith(".md") and os.path.isdir(plot):
    raise argparse.ArgumentTypeError(
      f"{plot!r}, where the figure beside {text!r} goes, is a folder"
    )
  return text


def output_folder(text: str) -> str:
  """A folder to write into: one that exists (and can be written), or one whose parent does."""
  if os.path.isdir(text):
    if not os.access(text, os.W_OK):
      raise argparse.ArgumentTypeError(f"cannot write into {text!r}")
    return text
  if os.path.exists(text):
    raise argparse.ArgumentTypeError(f"{text!r} is not a folder")
  _parent_writable(text)
  return text


def console(width: int = 160):
  """A rich console; when printing to a log rather than a terminal, `width` columns wide so
  tables keep their columns whole."""
  out = rich.console.Console()
  return out if out.is_terminal else rich.console.Console(width=width)
