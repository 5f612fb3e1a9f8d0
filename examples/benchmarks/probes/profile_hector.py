"""One forward+backward step of a hector layer, bracketed for Nsight Compute.

Usage (on the GPU machine, after `bash .ci/gpu build`):
  ncu --clock-control none --profile-from-start off --csv --metrics gpu__time_duration.sum \
      python3 profile_hector.py rgcn mutag 64

Compiles and warms the step of `jaxdata bench rgnn` (or `--model rgat|hgt`) for one graph and
dim, then runs it once between cuProfilerStart and cuProfilerStop, so ncu sees exactly one
step's kernels (hector's generated kernels are all named jaxdata_hector_kernel; their order
is the plan's, printed first).
"""

import ctypes
import os
import sys

import jax

from benchmarks import rgnn, rgnn_attention
from benchmarks import rgnn_peers as peers
from jaxdata.reference import rgcn as rgcn_ref


def build_step(
  model: str,
  graph: str,
  dim: int,
  precision: str = "highest",
  dtype: str = "float32",
  mode: str = "train",
):
  """The compiled step of `jaxdata bench rgnn` (`peers.compile_step`) for one layer, graph and
  dim: `precision` is the layer's matmul precision and `dtype` that of x and the weights (the
  tensor-core kernels run unless JAXDATA_HECTOR_TENSOR_CORES=0); `mode` "train" is a forward +
  backward step, "inference" a forward alone (`jaxdata bench rgnn --mode`)."""
  data_dir = os.environ.get("JAXDATA_DATA_DIR")
  device = jax.devices()[0]
  cast = lambda tree: jax.tree.map(lambda a: a.astype(dtype), tree)  # noqa: E731
  if model == "rgcn":
    g, why = rgnn.load_graph(graph, data_dir=data_dir, quick=False)
    assert g is not None, why
    form = peers.jaxdata_formulation(g.hetero, precision=precision)
    x, w, ct = jax.device_put(rgnn.case_arrays(g, dim), device)
  else:
    case, why = rgnn_attention.load_case(model, graph, data_dir=data_dir, quick=False)
    assert case is not None, why
    arrays = rgnn_attention.graph_arrays(case)
    x, w, ct = jax.device_put(rgnn_attention.case_arrays(model, case, dim, 4), device)
    if model == "rgat":
      form = rgnn_attention.rgat_jaxdata_formulation(arrays, None, precision=precision)
    else:
      form = rgnn_attention.hgt_jaxdata_formulation(arrays, None, precision=precision)
  x, w = cast(x), cast(w)
  return peers.compile_step(form, x, w, ct, mode=mode)


def main(
  model: str,
  graph: str,
  dim: int,
  precision: str = "highest",
  dtype: str = "float32",
  mode: str = "train",
) -> None:
  """One step of `build_step(...)` between cuProfilerStart and cuProfilerStop."""
  compiled = build_step(model, graph, dim, precision, dtype, mode)
  for _ in range(3):
    jax.block_until_ready(compiled.run())
  _print_plans()
  try:
    cuda = ctypes.CDLL("libcuda.so.1")
  except OSError:  # no GPU driver: just run the step
    cuda = None
  if cuda is not None:
    cuda.cuProfilerStart()
  jax.block_until_ready(compiled.run())
  if cuda is not None:
    cuda.cuProfilerStop()
  print(f"profiled one {mode} step: {model} {graph} dim {dim} {precision} {dtype}", flush=True)


def _print_plans() -> None:
  """The kernel instances of every plan built so far, in launch order."""
  from jaxdata import hector  # pylint: disable=g-import-not-at-top
  from jaxdata.hector import compiled as hc  # pylint: disable=g-import-not-at-top

  seen = set()
  for mod in (hector, *(getattr(hector, m) for m in ("rgcn", "rgat", "hgt"))):
    for layer in vars(mod).values():
      if isinstance(layer, hc.Layer) and id(layer) not in seen:
        seen.add(id(layer))
        for plan in layer._plans.values():  # pylint: disable=protected-access
          for title, kernels in (
            ("forward", plan.forward_kernels),
            ("backward", plan.backward_kernels),
          ):
            # the output's domain and feature shape tell the grids of ncu's table apart
            print(
              f"{title} kernels:",
              *(f"{k}   -> {k.output.domain} {k.output.shape}" for k in kernels),
              sep="\n  ",
            )


def latency_vs_throughput(graph: str, dims: str) -> None:
  """jaxdata and transform-all-then-gather (precision highest, as `jaxdata bench rgnn` runs it):
  one step waited for alone against 20 steps queued back to back and waited for once."""
  from jaxdata.timing import median_seconds  # pylint: disable=g-import-not-at-top

  g, why = rgnn.load_graph(graph, data_dir=os.environ.get("JAXDATA_DATA_DIR"), quick=False)
  assert g is not None, why
  edges = rgcn_ref.EdgeArrays.build(
    g.src, g.dst, g.etype, num_nodes=g.num_nodes, num_relations=g.num_relations, norm=g.norm
  )
  for dim in map(int, dims.split(",")):
    x, w, ct = jax.device_put(rgnn.case_arrays(g, dim), jax.devices()[0])
    forms = [peers.jaxdata_formulation(g.hetero)]
    forms.append(
      peers.plain_jax(
        "transform-all-then-gather", edges, g.num_nodes, precision=jax.lax.Precision.HIGHEST
      )
    )
    for form in forms:
      c = peers.compile_step(form, x, w, ct)
      one = median_seconds(c.run, warmup=3, repeats=15)
      many = median_seconds(c.run, warmup=3, repeats=15, queued=20)
      print(
        f"{graph} dim {dim} {form.name:<28} alone {one * 1e3:7.3f} ms   "
        f"queued {many * 1e3:7.3f} ms",
        flush=True,
      )


#: the H200's DRAM bandwidth (HBM3e, bytes per second) for the roofline fraction in `summarize`
H200_DRAM_BYTES_PER_S = 4.8e12

#: Nsight Compute's speed-of-light metrics (percent of each unit's peak) and their short names.
#: `gpu__compute_memory_throughput` is the busiest memory level's (the largest of the others):
#: the fraction of the roofline that binds a kernel that is memory-bound at some level.
SOL = {
  "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed": "memory",
  "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram",
  "lts__throughput.avg.pct_of_peak_sustained_elapsed": "L2",
  "l1tex__throughput.avg.pct_of_peak_sustained_active": "L1",
  "sm__throughput.avg.pct_of_peak_sustained_elapsed": "SM",
  "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": "tensor",
  "sm__warps_active.avg.pct_of_peak_sustained_active": "warps",
}


def summarize(path: str) -> None:
  """A table of an `ncu --csv` report: one line per kernel, its time, then the speed-of-light
  percentages (`SOL`, those the report has; "binds" names the busiest memory level), any other
  metric by its full name, and the DRAM traffic per second (dram__bytes over the kernel's time)
  with its fraction of the H200's 4.8 TB/s, where the report has dram__bytes."""
  import csv  # pylint: disable=g-import-not-at-top

  with open(path) as f:
    lines = [l for l in f if l.startswith('"')]
  rows = {}
  for r in csv.DictReader(lines):
    k = rows.setdefault(
      r["ID"], {"name": r["Kernel Name"][:32], "grid": r["Grid Size"], "block": r["Block Size"]}
    )
    k[r["Metric Name"]] = r["Metric Value"]
  num = lambda v: float(str(v or 0).replace(",", ""))  # noqa: E731
  total = sum(num(k.get("gpu__time_duration.sum")) for k in rows.values())
  print(f"{len(rows)} kernels, {total / 1e3:.1f} us in all; speed of light in % of peak")
  for i, k in rows.items():
    t = num(k.get("gpu__time_duration.sum"))
    sol = [f"{short}={num(k[m]):.1f}" for m, short in SOL.items() if m in k]
    levels = {
      short: num(k[m]) for m, short in SOL.items() if short in ("dram", "L2", "L1") and m in k
    }
    if levels:
      sol.append(f"binds={max(levels, key=levels.get)}")
    other = [
      f"{m}={v}"
      for m, v in k.items()
      if m not in SOL and m not in ("name", "grid", "block", "gpu__time_duration.sum")
    ]
    if "dram__bytes.sum" in k and t > 0:
      rate = num(k["dram__bytes.sum"]) / (t * 1e-9)
      other.append(f"dram={rate / 1e12:.2f}TB/s ({rate / H200_DRAM_BYTES_PER_S:.0%} of 4.8)")
    print(
      f"{i:>4} {t / 1e3:9.1f} us {k['name']:<32} grid {k['grid']} block {k['block']}", *sol, *other
    )


if __name__ == "__main__":
  if sys.argv[1] == "--summarize":
    summarize(sys.argv[2])
  elif sys.argv[1] == "--time":
    latency_vs_throughput(sys.argv[2], sys.argv[3])
  else:
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), *sys.argv[4:])
