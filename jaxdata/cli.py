"""The `jaxdata` command: `train ...`, `bench ...` and `info`."""
from __future__ import annotations

import argparse
import os
import shlex
import sys


def _console(width: int):
  """A rich console; when printing to a log rather than a terminal, `width` columns wide so the
  tables keep their columns whole."""
  import rich.console  # pylint: disable=g-import-not-at-top
  console = rich.console.Console()
  return console if console.is_terminal else rich.console.Console(width=width)


def _info(args: argparse.Namespace) -> int:
  del args
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import rich.console  # pylint: disable=g-import-not-at-top
  import rich.table  # pylint: disable=g-import-not-at-top

  import jaxdata  # pylint: disable=g-import-not-at-top
  from jaxdata import _ffi  # pylint: disable=g-import-not-at-top

  console = rich.console.Console()
  versions = rich.table.Table(title="jaxdata", show_header=False)
  versions.add_row("jaxdata", jaxdata.__version__)
  versions.add_row("jax / jaxlib", f"{jax.__version__} / {jax.lib.__version__}")
  versions.add_row("numpy", np.__version__)
  versions.add_row("python", sys.version.split()[0])
  ext = _ffi.ext
  if ext.built_with_cuda():
    runtime, driver = _ffi.cuda_versions()
    versions.add_row("CUDA runtime (built in)", runtime)
    versions.add_row("CUDA driver", driver)
  versions.add_row("host RAM", f"{ext.physical_memory_bytes() / 2**30:.1f} GiB")
  console.print(versions)

  gpus = _ffi.jax_gpus()
  backends = rich.table.Table(title="backends")
  for col in ("platform", "built", "usable now", "why"):
    backends.add_column(col)
  backends.add_row("cpu", "yes", "yes", f"{len(jax.devices('cpu'))} CPU device(s)")
  if not ext.built_with_cuda():
    backends.add_row("CUDA", "no", "no", "built without a CUDA toolkit (JAXDATA_CUDA=ON to require)")
  elif not gpus:
    backends.add_row("CUDA", "yes", "no", f"JAX sees no GPU (CUDA runtime sees "
                     f"{_ffi.cuda_device_count()})")
  else:
    backends.add_row("CUDA", "yes", "yes", ", ".join(sorted({d.device_kind for d in gpus})) +
                     f" x{len(gpus)}")
  console.print(backends)

  targets = rich.table.Table(title="registered XLA FFI targets")
  targets.add_column("target")
  targets.add_column("platforms")
  for name, platforms in sorted(_ffi.TARGETS.items()):
    targets.add_row(name, ", ".join(platforms))
  console.print(targets)
  return 0


def _command() -> str:
  """This command line, as a benchmark table records it."""
  return "jaxdata " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def _print_table(console, title: str, header, body, notes, left=()) -> None:
  import rich.markup  # pylint: disable=g-import-not-at-top
  import rich.table  # pylint: disable=g-import-not-at-top
  table = rich.table.Table(title=title)
  for h in header:
    table.add_column(h, justify="left" if h in left else "right")
  for r in body:  # cells are text, not markup: "keep[dots]" must print as written
    table.add_row(*(rich.markup.escape(str(c)) for c in r))
  console.print(table)
  for n in notes:
    console.print(f"[yellow]{rich.markup.escape(n)}")


def _write(console, path: str, text: str) -> None:
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w") as f:
    f.write(text)
  console.print(f"wrote {path}")


def _bench_gather(args: argparse.Namespace) -> int:
  from jaxdata.bench import gather  # pylint: disable=g-import-not-at-top

  if args.quick:
    tables, rows, repeats, batch = ["64M"], [64, 512, 4096], 3, 32 << 20
  else:
    tables = args.tables or gather.TABLE_BYTES
    rows, repeats, batch = args.rows or gather.ROW_BYTES, args.repeats, args.batch
  console = _console(width=140)
  results, notes = gather.run(tables, rows, batch_bytes=batch, cpu_batch_bytes=min(batch, 64 << 20),
                              repeats=repeats, console=console)
  _print_table(console, "random-row gather from a host table (GB/s of rows delivered)",
               *gather.table_rows(results), notes)
  if args.write:
    _write(console, args.write, gather.markdown(results, notes, _command()))
    png = args.write.rsplit(".", 1)[0] + ".png"
    if gather.plot(results, png):
      console.print(f"wrote {png}")
  return 0


def _bench_rgnn(args: argparse.Namespace) -> int:
  # Before JAX creates its GPU client: allocate as needed (so the measured peak is real, and
  # torch, which runs first, finds the device free) and let JAX grow to most of the device.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
  if args.model != "rgcn":
    return _bench_rgnn_attention(args)
  if args.formulations:
    raise SystemExit("jaxdata bench rgnn: --formulations is for --model rgat or hgt")

  from jaxdata.bench import rgnn  # pylint: disable=g-import-not-at-top

  if args.quick:
    graphs = args.graphs or rgnn.QUICK["graphs"]
    dims = args.dims or rgnn.QUICK["dims"]
    repeats = rgnn.QUICK["repeats"]
  else:
    graphs, dims, repeats = args.graphs or rgnn.GRAPHS, args.dims or rgnn.DIMS, args.repeats
  for g in graphs:
    if g not in rgnn.GRAPHS:
      raise SystemExit(f"jaxdata bench rgnn: unknown graph {g!r}; choose from "
                       f"{', '.join(rgnn.GRAPHS)}")
  data_dir = args.data_dir if args.data_dir is not None else rgnn.default_data_dir()
  console = _console(width=160)
  results, notes, loaded = rgnn.run(graphs, dims, data_dir=data_dir, quick=args.quick,
                                    repeats=repeats, precision=args.precision, console=console)
  for g in loaded:
    console.print(g.describe())
  _print_table(console, "one RGCN layer, relational part: forward + backward",
               *rgnn.table_rows(results), notes, left=("graph", "formulation"))
  if args.write:
    _write(console, args.write,
           rgnn.markdown(results, notes, loaded, _command(), precision=args.precision))
  return 0


def _bench_rgnn_attention(args: argparse.Namespace) -> int:
  """`bench rgnn --model rgat|hgt` (environment already set by _bench_rgnn)."""
  import rich.markup  # pylint: disable=g-import-not-at-top

  from jaxdata.bench import rgnn, rgnn_attention  # pylint: disable=g-import-not-at-top

  model = args.model
  quick = rgnn_attention.QUICK[model]
  graphs = args.graphs or (quick["graphs"] if args.quick else rgnn_attention.GRAPHS[model])
  dims = args.dims or (quick["dims"] if args.quick else rgnn_attention.DIMS)
  repeats = quick["repeats"] if args.quick else args.repeats
  for g in graphs:
    if g not in rgnn_attention.GRAPHS[model]:
      raise SystemExit(f"jaxdata bench rgnn --model {model}: unknown graph {g!r}; choose from "
                       f"{', '.join(rgnn_attention.GRAPHS[model])}")
  for d in dims:
    if d <= 0 or args.heads <= 0 or d % args.heads:
      raise SystemExit(f"jaxdata bench rgnn: dim {d} is not a positive multiple of "
                       f"--heads {args.heads}")
  formulations = args.formulations or rgnn_attention.FORMULATIONS
  unknown = [f for f in formulations if f not in rgnn_attention.FORMULATIONS]
  if unknown:
    raise SystemExit(f"jaxdata bench rgnn: unknown formulations {unknown}; choose from "
                     f"{', '.join(rgnn_attention.FORMULATIONS)}")
  data_dir = args.data_dir if args.data_dir is not None else rgnn.default_data_dir()
  console = _console(width=180)
  results, notes, cases = rgnn_attention.run(
      model, graphs, dims, heads=args.heads, formulations=formulations, data_dir=data_dir,
      quick=args.quick, mag_scale=args.mag_scale, repeats=repeats, precision=args.precision,
      console=console)
  for c in cases:
    console.print(c.describe())
  _print_table(console, rgnn_attention.TITLES[model], *rgnn_attention.table_rows(results), [],
               left=("graph", "formulation"))
  header, rows, summary = rgnn_attention.ablation(results)
  if rows:
    _print_table(console, "what each pass buys (jaxdata against itself with no passes)", header,
                 rows, summary, left=("graph", "passes"))
  for n in notes:
    console.print(f"[yellow]{rich.markup.escape(n)}")
  if args.write:
    previous = None
    if os.path.exists(args.write):
      with open(args.write) as f:
        previous = f.read()
    section = rgnn_attention.markdown(model, results, notes, cases, _command(), heads=args.heads,
                                      precision=args.precision)
    _write(console, args.write, rgnn_attention.document(previous, model, section))
  return 0


def _bench_minibatch(args: argparse.Namespace) -> int:
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

  from jaxdata.bench import minibatch  # pylint: disable=g-import-not-at-top

  size = dict(minibatch.QUICK if args.quick else minibatch.FULL)
  for k in ("nodes", "edges", "features"):
    if getattr(args, k) is not None:
      size[k] = getattr(args, k)
  batches = args.batches or (10 if args.quick else 100)
  console = _console(width=160)
  results, notes, dataset = minibatch.run(
      **size, fanouts=args.fanouts, batch_size=args.batch_size, batches=batches,
      devices=args.devices, console=console)
  _print_table(console, "mini-batch GraphSAGE: epoch through three pipelines",
               *minibatch.table_rows(results), notes, left=("pipeline",))
  if args.write:
    _write(console, args.write, minibatch.markdown(results, notes, dataset, _command(),
                                                   args.fanouts, args.batch_size, batches))
  return 0


def _rok(args: argparse.Namespace) -> int:
  if args.write and os.path.splitext(args.write)[1].lower() != ".md":
    raise SystemExit(f"jaxdata rok: --write takes a .md path (the plot goes beside it as .png), "
                     f"got {args.write!r}")
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

  from jaxdata.bench import rok  # pylint: disable=g-import-not-at-top

  size = dict(rok.QUICK if args.quick else rok.FULL)
  for k in size:
    if getattr(args, k) is not None:
      size[k] = getattr(args, k)
  size["loss_chunk"] = args.loss_chunk
  size["param_dtype"] = args.param_dtype
  console = _console(width=200)
  rows, notes = rok.run(**size, fractions=args.fractions, ssd_dir=args.ssd_dir,
                        repeats=args.repeats, say=lambda text: console.print(text, markup=False))
  _print_table(console, "recompute-offload-keep: step time against device memory",
               *rok.table_rows(rows, notes), [], left=("policy", "plan"))
  if args.write:
    png = os.path.splitext(args.write)[0] + ".png"  # rok.md -> rok.png beside it
    _write(console, args.write,
           rok.markdown(rows, notes, _command(), size, png=os.path.basename(png)))
    if rok.plot(rows, png):
      console.print(f"wrote {png}")
  return 0


def _parse_bytes(text: str) -> int:
  from jaxdata.sizes import parse_bytes  # pylint: disable=g-import-not-at-top
  return parse_bytes(text)


def _csv(kind):
  return lambda text: [kind(x) for x in text.split(",") if x]


def rok_defaults() -> dict[str, int]:
  return {"layers": 16, "hidden": 4096, "heads": 32, "seq": 2048, "batch": 8, "vocab": 8192}


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="jaxdata", description=__doc__)
  sub = parser.add_subparsers(dest="command", required=True)
  sub.add_parser("info", help="versions, built and usable backends, registered FFI targets")
  train = sub.add_parser("train", help="train a model").add_subparsers(dest="model", required=True)
  from jaxdata.train import rgcn as train_rgcn  # pylint: disable=g-import-not-at-top
  train_rgcn.add_arguments(train.add_parser(
      "rgcn", help="RGCN entity classification (synthetic graph by default, or an RDF archive)"))
  from jaxdata.train import sage as train_sage  # pylint: disable=g-import-not-at-top
  train_sage.add_arguments(train.add_parser(
      "sage", help="mini-batch GraphSAGE on a synthetic power-law graph in host memory"))
  from jaxdata.train import gpt as train_gpt  # pylint: disable=g-import-not-at-top
  train_gpt.add_arguments(train.add_parser(
      "gpt", help="a GPT on a synthetic token chain, optionally with activation offload"))
  from jaxdata.train import attention as train_attention  # pylint: disable=g-import-not-at-top
  for name in train_attention.MODELS:
    train_attention.add_arguments(train.add_parser(
        name, help=f"{name.upper()} paper classification on a synthetic ogbn-mag heterograph"),
        name)
  bench = sub.add_parser("bench", help="side-by-side benchmarks").add_subparsers(
      dest="bench", required=True)
  g = bench.add_parser("gather", help="host_gather vs NumPy gather + device_put vs pinned memcpy")
  g.add_argument("--tables", type=_csv(str),
                 help="table sizes, comma-separated (default 256M,16G; skipped if RAM is short)")
  g.add_argument("--rows", type=_csv(int),
                 help="row sizes in bytes, comma-separated (default 64 to 4096, powers of two)")
  g.add_argument("--batch", type=_parse_bytes,
                 default=256 << 20, help="bytes gathered per call (default 256M)")
  g.add_argument("--repeats", type=int, default=7, help="timed calls per measurement (median)")
  g.add_argument("--quick", action="store_true", help="a small run (64 MiB table, 3 row sizes)")
  g.add_argument("--write", metavar="PATH.md", help="write the table (and a .png plot) here")
  r = bench.add_parser("rgnn", help="one RGCN, RGAT or HGT layer (fwd+bwd): jaxdata vs plain "
                                     "JAX vs PyG")
  r.add_argument("--model", choices=("rgcn", "rgat", "hgt"), default="rgcn",
                 help="the layer (default rgcn); rgat and hgt also run jaxdata with its passes "
                      "switched off (the ablation), and --write keeps a section per model")
  r.add_argument("--dims", type=_csv(int), help="hidden sizes, comma-separated (default 32,64,128)")
  r.add_argument("--graphs", type=_csv(str),
                 help="graphs, comma-separated: rgcn and rgat from aifb,mutag,synthetic (default "
                      "all three; rgat's synthetic graph has 535 relations), hgt: mag")
  r.add_argument("--heads", type=int, default=4,
                 help="rgat/hgt: attention heads, each of dim/heads features (default 4)")
  r.add_argument("--mag-scale", type=float,
                 help="hgt: synthetic_mag's scale (default 1.0, ogbn-mag's size; --quick 0.001)")
  r.add_argument("--formulations", type=_csv(str),
                 help="rgat/hgt: rows to run, comma-separated (default all: jaxdata, "
                      "'jaxdata (no passes)', 'jaxdata (compact only)', 'jaxdata (reorder "
                      "only)', transform-all-then-gather, ragged_dot, 'per-edge weights', PyG)")
  r.add_argument("--data-dir", metavar="DIR",
                 help="folder holding aifb.tgz and mutag.tgz (default: the shared data folder)")
  r.add_argument("--repeats", type=int, default=7, help="timed steps per measurement (median)")
  r.add_argument("--precision", choices=("highest", "default"), default="highest",
                 help="matmul precision: highest = full float32 on both sides; default = XLA's "
                      "default and TF32 in torch")
  r.add_argument("--quick", action="store_true",
                 help="a small run (AIFB and a small synthetic graph, dim 32, 3 repeats; "
                      "hgt: synthetic_mag at scale 0.001)")
  r.add_argument("--write", metavar="PATH.md", help="write the table here")
  m = bench.add_parser("minibatch", help="mini-batch GraphSAGE epoch: all-in-GPU vs CPU-centric "
                                          "vs jaxdata's GPU-centric pipeline")
  m.add_argument("--nodes", type=int, help="graph nodes (default 10M; --quick 100k)")
  m.add_argument("--edges", type=int, help="graph edges (default 200M; --quick 2M)")
  m.add_argument("--features", type=int, help="feature size (default 256; --quick 64)")
  m.add_argument("--fanouts", type=_csv(int), default=[15, 10], help="default 15,10")
  m.add_argument("--batch-size", type=int, default=1024, help="seeds per GPU per batch")
  m.add_argument("--batches", type=int, help="batches per (timed) epoch (default 100)")
  m.add_argument("--devices", type=_csv(int), default=[1, 2],
                 help="GPU counts to run the GPU-centric path on (default 1,2; more than are "
                      "visible are skipped)")
  m.add_argument("--quick", action="store_true", help="a small graph and 10 batches")
  m.add_argument("--write", metavar="PATH.md", help="write the table here")
  for rk in (sub.add_parser("rok", help="the recompute-offload-keep curve (same as bench rok)"),
             bench.add_parser("rok", help="the recompute-offload-keep curve of a GPT stack")):
    for k, v in rok_defaults().items():
      rk.add_argument("--" + k, type=int, help=f"default {v} (--quick: smaller)")
    rk.add_argument("--fractions", type=_csv(float), default=[1.0, 0.5, 0.3, 0.2, 0.1],
                    help="budgets as fractions of keep-everything's device memory")
    rk.add_argument("--ssd-dir", metavar="DIR", help="also run a plan on the SSD tier here")
    rk.add_argument("--loss-chunk", type=int, default=0, metavar="N",
                    help="cross entropy in chunks of N positions, so the float32 logits of one "
                         "chunk are live at a time (default 0: all at once)")
    rk.add_argument("--param-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="parameter (and gradient) dtype; compute is bfloat16 either way "
                         "(default float32: master weights, cast per layer)")
    rk.add_argument("--repeats", type=int, default=5, help="timed steps per measurement")
    rk.add_argument("--quick", action="store_true", help="a small model")
    rk.add_argument("--write", metavar="PATH.md",
                    help="write the table (and the plot beside it: PATH.png)")
  args = parser.parse_args(argv)
  if args.command == "rok" or getattr(args, "bench", None) == "rok":
    return _rok(args)
  if args.command == "info":
    return _info(args)
  if args.command == "train":
    if args.model == "gpt":
      return train_gpt.main(args)
    if args.model in train_attention.MODELS:
      return train_attention.main(args)
    return train_sage.main(args) if args.model == "sage" else train_rgcn.main(args)
  if args.bench == "rgnn":
    return _bench_rgnn(args)
  if args.bench == "minibatch":
    return _bench_minibatch(args)
  return _bench_gather(args)


if __name__ == "__main__":
  sys.exit(main())
