"""Issue 19, small graphs: what one RGCN forward costs on the host, and what each lever buys.

Usage (GPU machine, after `bash .ci/gpu build`): python3 probe_inference.py [graph ...]
(default: aifb mutag; the archives from $JAXDATA_DATA_DIR)

On AIFB and MUTAG a forward of jaxdata's RGCN (dim 32, precision "default") takes 70-100 us
against 0.4-0.8 ms of PyG's FastRGCNConv: the bar is 10x PyG, and the time is the host's, not the
kernels'. This times, interleaved over rounds (each round 20 calls queued, waited for once, as
`jaxdata bench rgnn --mode inference` does; the median and the fastest round are printed):

* PyG's FastRGCNConv, the faster PyG layer on both graphs (the ratio's denominator);
* jaxdata's forward as it is, and with each of session 26's two levers taken back in this
  process only (the first run of this probe, on e0c014d, applied them to the forward before):
  - *tiles by jnp.cumsum*: the per-relation tile offsets by `jnp.cumsum` (which XLA splits into
    several kernels) rather than one masked sum over a [R+1, R] matrix (`runtime.tiles`);
  - *GEMM reading the mask*: the GEMM reading ok(e) from a `valid` mask computed per call
    rather than loading and checking each row's ids itself (`codegen.common.reads_valid`);
  - both (the forward of session 25);
* floors: a jitted `x * 2` alone; taking the same arguments as the forward (x, W and the 17
  arrays of `GraphArrays`), unused (jit drops them) and kept (`keep_unused=True`); and taking x,
  W and 4 graph arrays (what the plain-JAX per-edge formulation takes).

Each variant's compiled program is also summarized: how many parameters and top-level
instructions (kernels, custom calls) its optimized HLO has.
"""

import functools
import os
import re
import statistics
import sys

import jax
import jax.numpy as jnp

from benchmarks import rgnn
from benchmarks import rgnn_peers as peers
from jaxdata.hector import codegen, runtime
from jaxdata.timing import median_seconds

ROUNDS = int(os.environ.get("PROBE_ROUNDS", 7))


def summary(compiled) -> str:
  text = compiled.as_text()
  entry = text[text.rfind("ENTRY") :]
  params = len(re.findall(r"\bparameter\(", entry))
  ops = [
    m.group(1)
    for m in re.finditer(
      r"= [^ ]+ (fusion|custom-call|copy|slice|concatenate"
      r"|reduce-window|reduce|add|compare)\(",
      entry,
    )
  ]
  return f"{params} params, ops: " + ", ".join(f"{o} x{ops.count(o)}" for o in sorted(set(ops)))


def forward(form, x, w, ct, *, cumsum=False, mask=False):
  old_sum, old_reads = runtime.TILES_ONE_SUM, codegen.common.reads_valid
  try:
    if cumsum:
      runtime.TILES_ONE_SUM = -1
    if mask:
      codegen.common.reads_valid = lambda k: True
    c = peers.compile_step(form, x, w, ct, mode="inference")
    if c.tunes:  # time the tilings once, then compile again (as bench rgnn does)
      jax.block_until_ready(c.run())
      c = peers.compile_step(form, x, w, ct, mode="inference")
    out = jax.block_until_ready(c.run())
    lowered = peers.forward_only(form).lower(x, w, form.graph_args)
    return c.run, out, summary(lowered.compile())
  finally:
    runtime.TILES_ONE_SUM, codegen.common.reads_valid = old_sum, old_reads


def main(graphs) -> None:
  print("jax", jax.__version__, jax.devices(), flush=True)
  for name in graphs:
    g, why = rgnn.load_graph(name, data_dir=os.environ.get("JAXDATA_DATA_DIR"), quick=False)
    assert g is not None, why
    x, w, ct = jax.device_put(rgnn.case_arrays(g, 32), jax.devices()[0])
    pyg = peers.time_pyg(
      g.src,
      g.dst,
      g.etype,
      *rgnn.case_arrays(g, 32),
      mode="inference",
      layer="FastRGCNConv",
      repeats=ROUNDS,
    ).seconds
    form = peers.jaxdata_formulation(g.hetero, precision=jax.lax.Precision.DEFAULT)
    args = form.graph_args
    leaves = jax.tree.leaves(args)
    cases, reference = {}, None
    for label, kw in (
      ("jaxdata forward, as is", {}),
      ("  tiles by jnp.cumsum", dict(cumsum=True)),
      ("  GEMM reading the mask", dict(mask=True)),
      ("  both (session 25)", dict(cumsum=True, mask=True)),
    ):
      run, out, about = forward(form, x, w, ct, **kw)
      if reference is None:
        reference = out
      err = float(jnp.max(jnp.abs(out - reference)))
      cases[label] = (run, f"{about}; max |diff| vs as is {err:.1e}")
    f = jax.jit(lambda x: x * 2).lower(x).compile()
    cases["x * 2 alone"] = (functools.partial(f, x), summary(f))
    f17 = jax.jit(lambda x, w, g: x * 2).lower(x, w, args).compile()
    cases["x * 2, the same 19 arguments, unused"] = (
      functools.partial(f17, x, w, args),
      summary(f17),
    )
    k17 = jax.jit(lambda x, w, g: x * 2, keep_unused=True).lower(x, w, args).compile()
    cases["x * 2, the same 19 arguments, kept"] = (functools.partial(k17, x, w, args), summary(k17))
    four = leaves[:4]
    k4 = jax.jit(lambda x, w, g: x * 2, keep_unused=True).lower(x, w, four).compile()
    cases["x * 2, x, W and 4 graph arrays, kept"] = (functools.partial(k4, x, w, four), summary(k4))
    times = {label: [] for label in cases}
    for _ in range(ROUNDS):
      for label, (run, _) in cases.items():
        times[label].append(median_seconds(run, warmup=3, repeats=5, queued=20))
    print(
      f"\n{name}: {g.num_nodes:,} nodes, {len(g.src):,} edges; PyG FastRGCNConv "
      f"{pyg * 1e6:.1f} us per forward; 10x needs {pyg * 1e5:.1f} us",
      flush=True,
    )
    for label, (_, about) in cases.items():
      med, best = statistics.median(times[label]) * 1e6, min(times[label]) * 1e6
      ratio = f"{pyg * 1e6 / med:5.2f}x PyG" if label.startswith(("jaxdata", "  ")) else " " * 11
      print(
        f"  {label:<42} median {med:7.1f} us  fastest {best:7.1f} us  {ratio}  [{about}]",
        flush=True,
      )


if __name__ == "__main__":
  main(sys.argv[1:] or ["aifb", "mutag"])
