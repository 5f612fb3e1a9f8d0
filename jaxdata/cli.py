"""The `jaxdata` command: `train ...`, `launch`, `eval`, `bench ...`, `rok` and `info`.

Each command's module owns its options (`add_arguments(parser)`) and its run (`main(args)`);
this module only puts them together. Mistakes are one line and exit code 2 (`jaxdata.command`);
a run whose loss stops being finite is one line and exit code 1, having saved nothing; Ctrl-C
is one line ("interrupted") and exit code 130, SIGTERM one line ("terminated") and exit code 143
(`command.signals_stop`). A trainer saves its checkpoint when training ends (and every
--save-every epochs where it takes that flag): Ctrl-C or SIGTERM to a one-process `train` ends
it after the step in progress, which it saves to --out, then exits 130 or 143 (a second signal
stops at once, saving nothing more; one stopped while saving keeps the previous checkpoint;
`command.soft_stop`). A multi-process job stops at once: its processes could not agree on a
last step.
Every `train` command also takes the multi-process flags of `jaxdata.distributed`, and joins
its job before it runs; a trainer module that sets `MULTI_PROCESS = True` runs with several
processes, the others refuse to.
`bench ...` and `rok` run the benchmarks of a clone (examples/benchmarks/, the `benchmarks`
package, not part of the wheel): `pip install -e ".[bench]"` from the clone.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pathlib
import signal
import sys
from collections.abc import Callable

import jax
import rich.table
from jax._src import dispatch

import jaxdata
from jaxdata import _ffi, command, distributed
from jaxdata.hector import compiler
from jaxdata.hector.compiler import CacheDirError
from jaxdata.tasks import checkpoint
from jaxdata.tasks.checkpoint import CheckpointLocked
from jaxdata.train import attention, link
from jaxdata.train.common import LossNotFinite, mistakes

#: name -> (module, help). Modules are imported when the parser is built: each defines
#: add_arguments(parser) and main(args).
TRAIN = {
  "rgcn": (
    "jaxdata.train.attention",
    "RGCN entity classification (synthetic graph by default, or an RDF archive; "
    "--scale: paper classification on a synthetic ogbn-mag)",
  ),
  "rgat": (
    "jaxdata.train.attention",
    "RGAT paper classification on a synthetic ogbn-mag heterograph",
  ),
  "hgt": (
    "jaxdata.train.attention",
    "HGT paper classification on a synthetic ogbn-mag heterograph",
  ),
  "sage": (
    "jaxdata.train.sage",
    "mini-batch GraphSAGE on a synthetic power-law graph in host memory",
  ),
  "gpt": (
    "jaxdata.train.gpt",
    "a GPT on a synthetic token chain, optionally with activation offload",
  ),
}
BENCH = {
  "gather": ("benchmarks.gather", "host_gather vs NumPy gather + device_put vs pinned memcpy"),
  "rgnn": (
    "benchmarks.rgnn_command",
    "one RGCN, RGAT or HGT layer (fwd+bwd): jaxdata vs plain JAX vs PyG",
  ),
  "tensor-cores": (
    "benchmarks.tensor_cores",
    "hector's RGCN/RGAT fwd+bwd at float32 highest vs TF32 vs bfloat16 vs plain JAX, side by side",
  ),
  "minibatch": (
    "benchmarks.minibatch",
    "mini-batch GraphSAGE epoch: all-in-GPU vs CPU-centric vs jaxdata's GPU-centric pipeline",
  ),
  "hetero": (
    "benchmarks.hetero",
    "mini-batch RGAT/HGT epoch on a heterograph: jaxdata GPU-centric vs all-in-GPU "
    "vs CPU-centric vs PyG",
  ),
  "gnn-offload": (
    "benchmarks.gnn_offload",
    "a deep HGT/RGAT full-graph step without and with an offload plan under a device budget",
  ),
  "one-process": (
    "benchmarks.one_process",
    "each trainer plain vs as one process of a jax.distributed job (jaxdata "
    "launch -n 1): steady-state time and final loss",
  ),
}
ROK = ("benchmarks.rok", "the recompute-offload-keep curve of a GPT stack")
LAUNCH = ("jaxdata.launch", "run a train command as N local processes of one jax.distributed job")


def _info(args: argparse.Namespace) -> int:
  """`jaxdata info`: versions, the kernel compiler and cache, backends, FFI targets."""
  del args
  console = command.console(width=120)
  versions = rich.table.Table(title="jaxdata", show_header=False)
  versions.add_row("jaxdata", jaxdata.__version__)
  versions.add_row("jax / jaxlib", f"{jax.__version__} / {jax.lib.__version__}")
  for name in ("flax", "optax", "numpy"):
    try:
      versions.add_row(name, importlib.import_module(name).__version__)
    except ImportError:
      versions.add_row(name, "not installed")
  versions.add_row("python", sys.version.split()[0])
  ext = _ffi.ext
  if ext.built_with_cuda():
    runtime, driver = _ffi.cuda_versions()
    versions.add_row("CUDA runtime (built in)", runtime)
    versions.add_row("CUDA driver", driver)
  versions.add_row("host RAM", f"{ext.physical_memory_bytes() / 2**30:.1f} GiB")
  try:
    cxx = compiler.cxx()
  except Exception as e:  # noqa: BLE001 - whatever the reason, it is what info must show
    cxx = None
    versions.add_row("C++ compiler (hector, CPU)", f"none: {e}")
  else:
    versions.add_row("C++ compiler (hector, CPU)", cxx)
  try:
    versions.add_row("kernel cache (hector)", str(compiler.cache_dir()))
  except compiler.CacheDirError as e:
    versions.add_row("kernel cache (hector)", f"[red]{e.strerror}")
  console.print(versions)

  gpus = _ffi.jax_gpus()
  backends = rich.table.Table(title="backends")
  for col in ("platform", "built", "usable now", "why"):
    backends.add_column(col)
  cpu_why = f"{len(jax.devices('cpu'))} CPU device(s)"
  backends.add_row(
    "cpu",
    "yes",
    "yes" if cxx else "host only",
    cpu_why if cxx else cpu_why + "; hector kernels need a C++ compiler ($CXX)",
  )
  if not ext.built_with_cuda():
    backends.add_row(
      "CUDA", "no", "no", "built without a CUDA toolkit (JAXDATA_CUDA=ON to require)"
    )
  elif not gpus:
    backends.add_row(
      "CUDA", "yes", "no", f"JAX sees no GPU (CUDA runtime sees {_ffi.cuda_device_count()})"
    )
  else:
    backends.add_row(
      "CUDA", "yes", "yes", ", ".join(sorted({d.device_kind for d in gpus})) + f" x{len(gpus)}"
    )
  console.print(backends)

  targets = rich.table.Table(title="registered XLA FFI targets")
  targets.add_column("target")
  targets.add_column("platforms")
  for name, platforms in sorted(_ffi.TARGETS.items()):
    targets.add_row(name, ", ".join(platforms))
  console.print(targets)
  return 0


def _eval(args: argparse.Namespace) -> int:
  """`jaxdata eval DIR`: rebuilds a saved model and measures it again on its data."""
  overrides = {"path": os.path.abspath(args.data)} if args.data else {}
  if not args.checkpoint:
    raise command.UsageError(
      "argument DIR: empty (give the folder `jaxdata train ... --out` wrote; '.' for this one)"
    )
  with (  # (a DataOverrideError is a ValueError: the inner one names --data)
    mistakes("", FileNotFoundError, ValueError),
    mistakes("--data", checkpoint.DataOverrideError),
  ):
    loaded = checkpoint.load_model(args.checkpoint, **overrides)
  console = command.console()
  console.print(f"[bold]{loaded.kind}[/] checkpoint {args.checkpoint}: step {loaded.meta['step']}")
  try:
    measured = loaded.evaluate()
  except ValueError as e:  # e.g. a sampled evaluation that needs more devices than are here
    raise command.UsageError(str(e)) from None
  except (TypeError, AttributeError, RuntimeError) as e:  # e.g. a hand-edited configuration
    first = str(e).splitlines()[0] if str(e) else ""
    raise command.UsageError(
      f"{os.path.abspath(args.checkpoint)}: measuring the saved model failed; was its "
      f"meta/metadata edited? ({type(e).__name__}: {first[:200]})"
    ) from None
  note = loaded.meta.get("metrics_note")
  for name, value in measured.items():
    saved = loaded.metrics.get(name)
    console.print(f"{name} {value:.4f}" + ("" if saved is None else f" (at save: {saved:.4f})"))
  if isinstance(note, str) and note and any(n in loaded.metrics for n in measured):
    console.print(f"the values at save were measured {note}")
  return 0


def _train_rgcn(args: argparse.Namespace) -> int:
  """`jaxdata train rgcn`: node classification (`jaxdata.train.attention`), or with --task link
  link prediction (`jaxdata.train.link`); joined here, as trainers import no other."""
  if args.task == "link":
    if args.out == "rgcn-checkpoint":  # the default names the node-classification model's
      args.out = "rgcn-link-checkpoint"
  elif args.layers == 0:
    raise command.UsageError("argument --layers: 0 layers (DistMult alone) is for --task link")
  elif args.negatives != 1 or args.eval_every:
    flag = "--negatives" if args.negatives != 1 else "--eval-every"
    raise command.UsageError(f"argument {flag}: for --task link")
  # --out's type lets a checkpoint of any of train rgcn's kinds through: here, the task's own
  with mistakes("--out"):
    checkpoint.check_out(args.out, ("rgcn-link",) if args.task == "link" else ("rgcn", "rgcn-mag"))
  return link.main(args) if args.task == "link" else attention.main(args)


#: Where a clone keeps the benchmarks, beside the package (an editable install runs from it).
EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def _benchmarks_missing(args: argparse.Namespace) -> int:
  raise command.UsageError(
    f"`jaxdata {args.prog.split(' ', 1)[1]}` runs the benchmarks of a clone, which this install "
    "lacks: clone the repository and `pip install -e '.[bench]'` from it, or put its examples/ "
    "folder on PYTHONPATH"
  )


def _add(sub, name: str, module_name: str, help_text: str, *extra, train: bool = False) -> None:
  try:
    module = importlib.import_module(module_name)
  except ModuleNotFoundError as e:
    if e.name != "benchmarks":
      raise
    parser = sub.add_parser(name, help=help_text, description=help_text)
    parser.set_defaults(run=_benchmarks_missing, prog=parser.prog)  # whatever its flags (main)
    return
  parser = sub.add_parser(name, help=help_text, description=help_text)
  module.add_arguments(parser, *extra)
  parser.set_defaults(run=module.main, prog=parser.prog)
  if train:  # every trainer: the multi-process flags, and whether it can use them
    distributed.add_arguments(parser)
    parser.set_defaults(multi_process=getattr(module, "MULTI_PROCESS", False))


def _multi_process_trainers() -> str:
  """The trainers that run as several processes, as a sentence's end: "sage and gpt do"."""
  names = [
    n for n, (m, _) in TRAIN.items() if getattr(importlib.import_module(m), "MULTI_PROCESS", False)
  ]
  return (" and ".join(names) + " do") if len(names) > 1 else f"only {names[0]} does"


def _join(args: argparse.Namespace) -> bool:
  """Before a trainer runs: joins its multi-process job, if the flags ask for one; whether this
  is a one-process run."""
  setup = distributed.setup_from(args)

  def refuse(how: str) -> None:
    if setup.num_processes > 1 and not args.multi_process:
      raise command.UsageError(
        f"jaxdata train {args.model} does not support multi-process runs yet ({how}); of the "
        f"trainers, {_multi_process_trainers()}"
      )

  refuse(f"--num-processes {setup.num_processes}")
  setup = distributed.initialize(setup)
  refuse(f"{setup.num_processes} processes detected")  # found by --distributed auto
  return setup.num_processes == 1


def parser() -> command.Parser:
  """The whole command line."""
  top = command.Parser(
    prog="jaxdata",
    description="jaxdata: data-efficient GPU training for "
    "JAX (host tables, generated relational GNN kernels, activation offload)",
  )
  top.add_argument("--version", action="version", version=f"jaxdata {jaxdata.__version__}")
  sub = top.add_subparsers(dest="command", metavar="COMMAND")
  info = sub.add_parser("info", help="versions, compiler, kernel cache, backends, FFI targets")
  info.set_defaults(run=_info, prog=info.prog)
  train = sub.add_parser("train", help="train a model").add_subparsers(
    dest="model", metavar="MODEL", required=True
  )
  for name, (module, text) in TRAIN.items():
    _add(train, name, module, text, *((name,) if module.endswith("attention") else ()), train=True)
  train.choices["rgcn"].set_defaults(run=_train_rgcn)  # --scale: RGCN on synthetic_mag
  if (EXAMPLES / "benchmarks" / "__init__.py").exists() and str(EXAMPLES) not in sys.path:
    sys.path.append(str(EXAMPLES))  # a clone's benchmarks (`_add` says where they are missing)
  bench = sub.add_parser("bench", help="side-by-side benchmarks").add_subparsers(
    dest="bench", metavar="BENCHMARK", required=True
  )
  for name, (module, text) in BENCH.items():
    _add(bench, name, module, text)
  ev = sub.add_parser("eval", help="rebuild a saved model (train --out DIR) and measure it again")
  ev.add_argument("checkpoint", metavar="DIR", help="a checkpoint folder (train --out)")
  ev.add_argument(
    "--data",
    metavar="PATH",
    type=command.existing_file,
    help="the data file, where it has moved since training (RDF archives)",
  )
  ev.set_defaults(run=_eval, prog=ev.prog)
  _add(sub, "rok", *ROK)
  _add(sub, "launch", *LAUNCH)
  return top


def main(argv: list[str] | None = None) -> int:
  top = parser()
  args, unknown = top.parse_known_args(argv)
  if unknown and getattr(args, "run", None) is not _benchmarks_missing:
    top.error(f"unrecognized arguments: {' '.join(unknown)}")  # what parse_args says
  if getattr(args, "run", None) is None:  # `jaxdata` alone
    top.print_help()
    return 0
  with command.signals_stop() as take_signals_back:
    return _run(args, take_signals_back)


def _run(args: argparse.Namespace, take_signals_back: Callable[[], None]) -> int:
  """`main` once the command line is parsed: runs the command, reports its failures in one line
  and returns the exit code (`take_signals_back`: `command.signals_stop`'s)."""
  stopped_by = None  # the signal that stopped the command
  try:
    alone = False
    if getattr(args, "command", None) == "train":
      alone = _join(args)
      take_signals_back()  # jax.distributed.initialize took SIGTERM (only to log it)
    # One process: a SIGTERM ends the run after its step, and the trainer saves it (--out).
    with command.soft_stop(enabled=alone):
      code = args.run(args)
    if command.stop_requested() and code == 0:
      signum = command.stop_signal()
      said = "terminated (SIGTERM)" if signum == signal.SIGTERM else "interrupted (Ctrl-C)"
      print(f"{args.prog}: {said} after its last completed step", file=sys.stderr)
      code = 128 + signum
  except command.UsageError as e:
    code = command.fail(args.prog, e)
  except LossNotFinite as e:  # a diverged run: stopped, nothing saved
    code = command.fail(args.prog, e, code=1)
  except CheckpointLocked as e:  # another save of --out did not end in time: nothing saved
    code = command.fail(args.prog, e, code=1)
  except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (command.Terminated)
    signum = getattr(e, "signum", signal.SIGINT)
    said = "terminated (SIGTERM)" if signum == signal.SIGTERM else "interrupted"
    print(f"{args.prog}: {said}", file=sys.stderr)
    code = 128 + signum
    stopped_by = signal.Signals(signum).name
  except MemoryError as e:  # e.g. a graph of 10^14 edges: NumPy's "Unable to allocate 728. TiB"
    why = str(e).splitlines()[0] if str(e) else "MemoryError"
    code = command.fail(args.prog, f"out of host memory ({why}): ask for a smaller run", code=1)
  except Exception as e:  # pylint: disable=broad-except
    if isinstance(e, CacheDirError):
      code = command.fail(args.prog, e.strerror, code=1)
    else:
      full = _ram_tier_full(e)
      if full is None:
        raise
      code = command.fail(args.prog, full)
      _forget_failed_effects()
  # A crash leaves through JAX's own exit hook, after its traceback has been printed.
  if distributed.leave(ok=code == 0, why=stopped_by) and code:
    # A job that stopped with an error: its peers may be gone, and the interpreter's own exit
    # then waited on them while collecting JAX's objects (CI: process 1 of a job stopped for
    # unequal --num-processes printed its error, left the job, and hung in finalization past
    # 90 s). Nothing is left to write (no checkpoint is saved on an error), so end here.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
  return code


def _ram_tier_full(error: BaseException) -> str | None:
  """The one line for an offload whose activations outgrew --ram (the store's spill error,
  raised by XLA as a JaxRuntimeError), or None for any other error."""
  text = str(error)
  at = text.find("offload spill: the RAM tier is full: ")
  if at < 0:
    return None
  what = text[at:].split(";")[0].removeprefix("offload spill: ")
  return f"argument --ram: {what}: raise --ram, or give --ssd-dir for what does not fit"


def _forget_failed_effects() -> None:
  """Drops JAX's runtime tokens of ordered effects (the offload's spills are ordered): one that
  failed is raised again by each of JAX's exit hooks, two more tracebacks after the one line.
  (JAX's private `dispatch.runtime_tokens`; where it is missing, the hooks print as before.)"""
  try:
    dispatch.runtime_tokens.clear()
  except (ImportError, AttributeError):
    pass


if __name__ == "__main__":
  sys.exit(main())
