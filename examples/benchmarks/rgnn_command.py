"""The `jaxdata bench rgnn` command: its options, and the run of the RGCN benchmark
(`benchmarks.rgnn`) or, with `--model rgat|hgt`, the attention one (`bench.rgnn_attention`)."""

from __future__ import annotations

import os

from benchmarks import rgnn, rgnn_attention
from jaxdata import command


def add_arguments(parser) -> None:
  """`jaxdata bench rgnn` options."""
  parser.add_argument(
    "--model",
    choices=("rgcn", "rgat", "hgt"),
    default="rgcn",
    help="the layer; rgat and hgt also run jaxdata with its passes switched off "
    "(the ablation), and --write keeps a section per model",
  )
  parser.add_argument(
    "--dims",
    type=command.listing(command.positive_int),
    help="hidden sizes, comma-separated (default 32,64,128; --quick 32)",
  )
  parser.add_argument(
    "--graphs",
    type=command.listing(str),
    help="graphs, comma-separated: rgcn and rgat from aifb,mutag,synthetic "
    "(default all three; rgat's synthetic graph has 535 relations), uniform and the hub-heavy "
    "zipf-src-E, zipf-dst-E, zipf-both-E (Zipf exponent E > 1, the synthetic graph's sizes), "
    "hgt: mag",
  )
  parser.add_argument(
    "--heads",
    type=command.positive_int,
    default=4,
    help="rgat/hgt: attention heads, each of dim/heads features",
  )
  parser.add_argument(
    "--mag-scale",
    type=command.positive_float,
    help="hgt: synthetic_mag's scale (default 1.0, ogbn-mag's size; --quick 0.001)",
  )
  parser.add_argument(
    "--formulations",
    type=command.listing(str),
    help="rgat/hgt: rows to run, comma-separated (default all: jaxdata, "
    "'jaxdata (no passes)', 'jaxdata (compact only)', 'jaxdata (reorder "
    "only)', transform-all-then-gather, ragged_dot, 'per-edge weights', PyG)",
  )
  parser.add_argument(
    "--data-dir",
    metavar="DIR",
    help="folder holding aifb.tgz and mutag.tgz (default: $JAXDATA_DATA_DIR or "
    "the shared data folder)",
  )
  parser.add_argument(
    "--repeats",
    type=command.positive_int,
    help="timed steps per measurement, median (default 7; --quick 3)",
  )
  parser.add_argument(
    "--mode",
    choices=rgnn.MODES,
    default="train",
    help="train: one forward + backward step per measurement; inference: the "
    "forward pass alone (nothing kept for a backward pass; PyG in eval "
    "mode under torch.inference_mode()), --write keeps a section per "
    "model in one file (docs/benchmarks/rgnn_inference.md)",
  )
  parser.add_argument(
    "--precision",
    choices=rgnn.PRECISION_CHOICES,
    default="both",
    help="matmul precision: both (default) = plain JAX at highest and at "
    "default, jaxdata at highest, PyG with TF32 on; highest = full "
    "float32 on every side; default = XLA's default and TF32 in torch",
  )
  parser.add_argument(
    "--quick",
    action="store_true",
    help="a small run: AIFB and a small synthetic graph, dim 32, 3 repeats; hgt: "
    "synthetic_mag at scale 0.001 (flags given still apply)",
  )
  parser.add_argument(
    "--write", metavar="PATH.md", type=command.output_path, help="write the table here"
  )


def main(args) -> int:
  """`jaxdata bench rgnn`."""
  # Before JAX creates its GPU client: allocate as needed (so the measured peak is real, and
  # torch, which runs first, finds the device free) and let JAX grow to most of the device.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
  if args.data_dir is not None and not os.path.isdir(args.data_dir):
    raise command.UsageError(f"argument --data-dir: {args.data_dir!r} is not a folder")
  return (rgnn if args.model == "rgcn" else rgnn_attention).main(args)
