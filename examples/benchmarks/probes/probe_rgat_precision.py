"""RGAT's float32 gradients against a float64 truth, on a graph with hubs (the open question of
docs/benchmarks/tensor_cores.md: hector's dx at "highest" differs from plain JAX's by 1.0e-3 of
max |dx| on the H200).

One step as `jaxdata bench tensor-cores` runs it (loss = sum(out * ct); gradients for x, W,
a_src, a_dst; the same arrays: `rgnn_attention.case_arrays`, the same entry points:
`rgnn_attention.rgat_jaxdata_formulation` and `rgnn_peers.loss_and_grads`), three ways:

  (a) hector     `jaxdata.hector.rgat_message`, float32, precision "highest"
  (b) plain JAX  float32 at "highest": a formulation of jaxdata/reference/attention.py, or
                 "grouped" (below)
  (c) truth      the same plain-JAX formulation with every input cast to float64, computed in a
                 subprocess with JAX_ENABLE_X64=1 (nothing leaks into this process)

and prints max |d - d64| / max |d64| for out and each gradient, for (a) and (b); the edges whose
float64 score z (before the leaky ReLU) is within `--kink` of 0, where float32 rounding of z can
take the other slope (1 or 0.2) and the gradient of that edge's ends jumps, and the errors
without the rows those edges touch; then, for dx and out, the error per in-degree bucket of the
node (hubs vs light nodes) and the node where the largest error sits.

Finding (CPU, the bench's graph and arrays, seed 0): hector's dx error of 1.04e-3 sits at the two
ends of one edge (78505 -> 71974, relation 318) whose head-2 score is z64 = +5.0e-7; hector's
float32 z fell on the other side of 0, so that edge took slope 0.2 instead of 1. Without those
two nodes (and relation 318 for dW, da) both formulations are within 4e-6 of float64, hubs of
25K in-edges included.

"grouped" is plain JAX too: edges sorted by relation, cut into blocks of one relation each
(padded), one batched matmul per block (W gathered per block, not per edge), then exactly the
reference's softmax and aggregation (`attention._rgat_finish`: `edge_softmax`, `_aggregate`).
It exists because on a CPU with 24 GiB none of the reference's three formulations fits the
bench's 2M-edge graph ([R, N, F], [E, d_in, F] and ragged_dot's dense [R, E, d_in] expansion);
`--check` compares it with transform-all-then-gather on a small graph first.

Graphs: "bench" is the bench's graph (`rgnn_attention.SYNTHETIC`: synthetic_entities, 200K
nodes, 2M edges, 535 relations; `--nodes/--edges/--relations` shrink it); "hubs" is a
hand-made graph: light nodes with a few random in-edges each, plus one hub per
`--hub-degrees` entry (random sources and relations).

    python3 probe_rgat_precision.py                       # the bench's graph (~2 min, CPU)
    python3 probe_rgat_precision.py --graph hubs --hub-degrees 100,1000,10000,25000
    python3 probe_rgat_precision.py --reference transform-all-then-gather   # on an H200
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

DEGREE_BUCKETS = (0, 1, 11, 101, 1001, 10001)


def parse(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--graph", choices=("bench", "hubs"), default="bench")
  p.add_argument("--nodes", type=int, default=None)
  p.add_argument("--edges", type=int, default=None)
  p.add_argument("--relations", type=int, default=None)
  p.add_argument(
    "--hub-degrees",
    default="100,1000,10000,25000",
    help="hubs graph: the in-degree of each hub, comma-separated",
  )
  p.add_argument("--light-degree", type=int, default=5, help="hubs graph: light in-degree")
  p.add_argument("--dim", type=int, default=64)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument(
    "--reference",
    default="grouped",
    help="grouped, or a name from jaxdata.reference.attention.RGAT",
  )
  p.add_argument("--block", type=int, default=512, help="grouped: edges per block")
  p.add_argument(
    "--check",
    action="store_true",
    help="first compare grouped with transform-all-then-gather on a small graph",
  )
  p.add_argument(
    "--kink",
    type=float,
    default=1e-5,
    help="report edges whose float64 score is this close to the leaky ReLU's kink",
  )
  p.add_argument("--json", help="write the numbers here")
  p.add_argument("--truth-out", help=argparse.SUPPRESS)  # the float64 subprocess
  return p.parse_args(argv)


# ------------------------------------------------------------------------------------------------
# Graphs


def hubs_graph(hub_degrees, light_degree, num_nodes, num_relations, seed):
  """Light nodes with `light_degree` random in-edges each (sources and relations uniform), plus
  one hub per entry of `hub_degrees` with that many in-edges; the hubs are the last nodes."""
  from jaxdata.data import HeteroGraph  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(seed)
  hubs = len(hub_degrees)
  light = num_nodes - hubs
  dst = [np.repeat(np.arange(light), light_degree)]
  dst += [np.full(k, light + i) for i, k in enumerate(hub_degrees)]
  dst = np.concatenate(dst)
  src = rng.integers(0, num_nodes, dst.size)
  etype = rng.integers(0, num_relations, dst.size)
  return HeteroGraph.from_edges(
    src, dst, etype, num_nodes=num_nodes, relation_names=[f"r{i}" for i in range(num_relations)]
  )


def load(args):
  """The `rgnn_attention.Case` of the graph asked for."""
  from benchmarks import rgnn  # pylint: disable=g-import-not-at-top
  from benchmarks import rgnn_attention as attention

  if args.graph == "bench":
    sizes = dict(attention.SYNTHETIC)
    for k, v in (
      ("num_nodes", args.nodes),
      ("num_edges", args.edges),
      ("num_relations", args.relations),
    ):
      if v is not None:
        sizes[k] = v
    graph, why = rgnn.load_graph(
      "synthetic", data_dir=None, quick=False, seed=args.seed, synthetic=sizes
    )
    if graph is None:
      raise SystemExit(f"probe_rgat_precision: the bench graph: {why}")
    return attention.Case(graph)
  degrees = [int(d) for d in args.hub_degrees.split(",") if d]
  n = args.nodes or 20_000
  g = hubs_graph(degrees, args.light_degree, n, args.relations or 50, args.seed)
  return attention.Case(rgnn.Graph.from_hetero("hubs", g, "probe_rgat_precision.hubs_graph"))


# ------------------------------------------------------------------------------------------------
# The grouped plain-JAX formulation


def grouped_blocks(etype: np.ndarray, num_relations: int, block: int):
  """For edges sorted by relation: (slot -> edge index or -1 [blocks * block], block -> relation,
  edge -> slot). Each block holds edges of one relation only."""
  counts = np.bincount(etype, minlength=num_relations)
  per_rel = -(-counts // block)
  starts = np.concatenate([[0], np.cumsum(counts)])
  slots = np.full(int(per_rel.sum()) * block, -1, np.int64)
  rel = np.repeat(np.arange(num_relations), per_rel)
  edge_slot = np.empty(etype.size, np.int64)
  b = 0
  for r in range(num_relations):
    e0, e1 = starts[r], starts[r + 1]
    s0 = b * block
    slots[s0 : s0 + (e1 - e0)] = np.arange(e0, e1)
    edge_slot[e0:e1] = np.arange(s0, s0 + (e1 - e0))
    b += per_rel[r]
  return slots, rel, edge_slot


def grouped(block: int):
  """rgat_grouped(src, dst, etype, x, params, *, precision): the reference's RGAT with its matmuls
  done per block of one relation (needs edges sorted by relation, as `Edges.build` sorts)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  from jaxdata.reference import attention as ref  # pylint: disable=g-import-not-at-top

  def fn(src, dst, etype, x, params, *, precision=None, blocks=None):
    slots, rel, edge_slot = blocks
    acc, n = ref._acc(x.dtype), x.shape[0]  # pylint: disable=protected-access
    fold_src, fold_dst = ref._folded(params, precision, acc)  # pylint: disable=protected-access
    nb = rel.shape[0]
    valid = slots >= 0
    take = jnp.where(valid, slots, 0)

    def rows(v):  # [E, d] per edge -> [nb, block, d] per slot (pads read edge 0, never used)
      return v[take].reshape(nb, block, -1)

    xs, xd = rows(x[src]), rows(x[dst])

    def mm(a, w):
      return jnp.einsum("nbd,ndf->nbf", a, w, precision=precision, preferred_element_type=acc)

    def back(v):
      return v.reshape(nb * block, -1)[edge_slot]

    messages = back(mm(xs, params.w[rel]).astype(x.dtype))
    scores = back(mm(xs, fold_src.astype(x.dtype)[rel]) + mm(xd, fold_dst.astype(x.dtype)[rel]))
    return ref._rgat_finish(scores, messages, dst, n, params.heads, x.dtype)  # pylint: disable=protected-access

  return fn


def plain(name: str, edges, block: int):
  """message(edges, x, params) for the plain-JAX formulation `name`."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  from jaxdata.reference import attention as ref  # pylint: disable=g-import-not-at-top

  if name == "grouped":
    et = np.asarray(edges.etype)
    blocks = grouped_blocks(et, int(et.max()) + 1 if et.size else 1, block)
    blocks = tuple(jnp.asarray(b) for b in blocks)
    fn = grouped(block)
    return lambda g, x, p, precision=None: fn(*g, x, p, precision=precision, blocks=blocks)
  fn = ref.RGAT[name]
  return lambda g, x, p, precision=None: fn(*g, x, p, precision=precision)


def step(message, edges, x, params, ct):
  """(out, (dx, dparams)) of loss = vdot(out, ct), as `rgnn_peers.loss_and_grads` computes it."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  def loss(x, p):
    out = message(edges, x, p)
    return jnp.vdot(out, ct.astype(out.dtype)), out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, params)
  return out, grads


def as_dict(out, grads):
  dx, dp = grads
  return {
    "out": np.asarray(out),
    "dx": np.asarray(dx),
    "dW": np.asarray(dp.w),
    "da_src": np.asarray(dp.a_src),
    "da_dst": np.asarray(dp.a_dst),
  }


# ------------------------------------------------------------------------------------------------
# The three runs


def arrays(args, case):
  from benchmarks import rgnn_attention as attention  # pylint: disable=g-import-not-at-top

  return attention.case_arrays("rgat", case, args.dim, args.heads, seed=args.seed)


def truth(args):
  """(c): in this process, which the parent started with JAX_ENABLE_X64=1."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  from jaxdata.reference import attention as ref  # pylint: disable=g-import-not-at-top

  assert jax.config.jax_enable_x64, "the truth needs JAX_ENABLE_X64=1"
  case = load(args)
  g = case.graph
  x, p, ct = arrays(args, case)
  edges = ref.Edges.build(
    g.src, g.dst, g.etype, num_nodes=g.num_nodes, num_relations=g.num_relations
  )
  wide = lambda a: jnp.asarray(a, jnp.float64)  # noqa: E731
  message = plain(args.reference, edges, args.block)
  out, grads = step(
    lambda e, x, p: message(e, x, p, precision=jax.lax.Precision.HIGHEST),
    edges,
    wide(x),
    jax.tree.map(wide, p),
    wide(ct),
  )
  np.savez(args.truth_out, **as_dict(out, grads))


def run_truth(args) -> dict:
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "truth.npz")
    argv = []
    for k, v in vars(args).items():
      if v is not None and not isinstance(v, bool) and k not in ("json", "truth_out"):
        argv += [f"--{k.replace('_', '-')}", str(v)]
    env = dict(os.environ, JAX_ENABLE_X64="1")
    subprocess.run([sys.executable, __file__, *argv, "--truth-out", path], env=env, check=True)
    with np.load(path) as f:
      return {k: f[k] for k in f.files}


def float32_runs(args, case):
  """(a) and (b): {"hector": {...}, "plain": {...}}."""
  import jax  # pylint: disable=g-import-not-at-top

  from benchmarks import rgnn_attention as attention  # pylint: disable=g-import-not-at-top
  from jaxdata.reference import attention as ref  # pylint: disable=g-import-not-at-top

  hi = jax.lax.Precision.HIGHEST
  g = case.graph
  x, p, ct = jax.device_put(arrays(args, case))
  form = attention.rgat_jaxdata_formulation(attention.graph_arrays(case), None, precision=hi)
  out = {}
  t = time.perf_counter()
  out["hector"] = as_dict(*step(form.message, form.graph_args, x, p, ct))
  print(f"  (a) hector float32 highest: {time.perf_counter() - t:.1f} s", flush=True)
  edges = ref.Edges.build(
    g.src, g.dst, g.etype, num_nodes=g.num_nodes, num_relations=g.num_relations
  )
  message = plain(args.reference, edges, args.block)
  t = time.perf_counter()
  out["plain"] = as_dict(*step(lambda e, x, p: message(e, x, p, precision=hi), edges, x, p, ct))
  print(f"  (b) {args.reference} float32 highest: {time.perf_counter() - t:.1f} s", flush=True)
  return out


def check_grouped(args):
  """grouped against transform-all-then-gather, float32 highest, on a small bench-like graph."""
  import jax  # pylint: disable=g-import-not-at-top

  from jaxdata.reference import attention as ref  # pylint: disable=g-import-not-at-top

  small = argparse.Namespace(
    **{**vars(args), "graph": "bench", "nodes": 2000, "edges": 20000, "relations": 20}
  )
  case = load(small)
  g = case.graph
  x, p, ct = arrays(small, case)
  edges = ref.Edges.build(
    g.src, g.dst, g.etype, num_nodes=g.num_nodes, num_relations=g.num_relations
  )
  hi = jax.lax.Precision.HIGHEST
  runs = {}
  for name in ("grouped", "transform-all-then-gather"):
    m = plain(name, edges, 64)
    runs[name] = as_dict(*step(lambda e, x, p, m=m: m(e, x, p, precision=hi), edges, x, p, ct))
  worst = max(
    rel(runs["grouped"][k], runs["transform-all-then-gather"][k]) for k in runs["grouped"]
  )
  print(f"check: grouped vs transform-all-then-gather (float32 highest, 20K edges): {worst:.1e}")
  if worst > 1e-5:
    raise SystemExit("probe_rgat_precision: grouped does not compute the reference's RGAT")


# ------------------------------------------------------------------------------------------------
# Errors


def rel(d, ref) -> float:
  ref = np.asarray(ref, np.float64)
  return float(np.max(np.abs(np.asarray(d, np.float64) - ref)) / max(np.max(np.abs(ref)), 1e-300))


def by_degree(d, ref, in_degree):
  """Per in-degree bucket: (nodes, max |d - ref| / max |ref| over the whole array, max |ref| in
  the bucket / max |ref|)."""
  ref = np.asarray(ref, np.float64)
  top = max(np.max(np.abs(ref)), 1e-300)
  err = np.max(np.abs(np.asarray(d, np.float64) - ref), axis=1) / top
  mag = np.max(np.abs(ref), axis=1) / top
  edges = (*DEGREE_BUCKETS, np.inf)
  rows = []
  for lo, hi in zip(edges[:-1], edges[1:]):
    m = (in_degree >= lo) & (in_degree < hi)
    if m.any():
      label = f"{lo}" if hi == lo + 1 else f"{lo}-{'' if hi == np.inf else int(hi) - 1}"
      rows.append((label, int(m.sum()), float(err[m].max()), float(mag[m].max())))
  worst = int(np.argmax(err))
  return rows, worst


def scores64(args, case) -> np.ndarray:
  """Every edge's score before the leaky ReLU in float64 NumPy (edge order of the graph):
  `jaxdata.reference.attention.rgat_scores_float64`, which `jaxdata bench tensor-cores` uses too."""
  from jaxdata.reference import attention as ref  # pylint: disable=g-import-not-at-top

  g = case.graph
  x, p, _ = arrays(args, case)
  return ref.rgat_scores_float64(g.src, g.dst, g.etype, x, p)


def kinks(args, case, tol: float):
  """The edges with a score within `tol` of the leaky ReLU's kink (|z64| < tol for some head),
  where float32 rounding of z can pick the other slope (1 or 0.2): (edges, nodes they touch,
  relations they carry)."""
  g = case.graph
  z = scores64(args, case)
  near = np.where((np.abs(z) < tol).any(axis=1))[0]
  nodes = np.unique(np.concatenate([np.asarray(g.src)[near], np.asarray(g.dst)[near]]))
  rels = np.unique(np.asarray(g.etype)[near])
  return near, nodes, rels, z


def masked_rel(d, ref, rows) -> float:
  """`rel` over the rows not in `rows` (the max |ref| still over all rows)."""
  keep = np.ones(ref.shape[0], bool)
  keep[rows] = False
  ref = np.asarray(ref, np.float64)
  top = max(np.max(np.abs(ref)), 1e-300)
  return float(np.max(np.abs(np.asarray(d, np.float64)[keep] - ref[keep])) / top)


def report(args, case, runs, true) -> dict:
  g = case.graph
  in_degree = np.bincount(np.asarray(g.dst), minlength=g.num_nodes)
  out_degree = np.bincount(np.asarray(g.src), minlength=g.num_nodes)
  result = {
    "graph": case.describe(),
    "dim": args.dim,
    "heads": args.heads,
    "reference": args.reference,
    "max_in_degree": int(in_degree.max()),
    "errors": {},
    "by_degree": {},
  }
  print(f"\nmax |d - d64| / max |d64| (d64: {args.reference} in float64)")
  print(f"  {'':8s} {'(a) hector':>12s} {'(b) plain':>12s}   max |d64|")
  for k in true:
    ea, eb = rel(runs["hector"][k], true[k]), rel(runs["plain"][k], true[k])
    result["errors"][k] = {"hector": ea, "plain": eb, "max_abs": float(np.abs(true[k]).max())}
    print(f"  {k:8s} {ea:12.2e} {eb:12.2e}   {np.abs(true[k]).max():.3e}")
  result["hector_vs_plain_dx"] = rel(runs["hector"]["dx"], runs["plain"]["dx"])
  print(f"  (a) vs (b) dx, as the bench compares them: {result['hector_vs_plain_dx']:.2e}")
  near, nodes, rels, z = kinks(args, case, args.kink)
  result["kink"] = {
    "tol": args.kink,
    "edges": near.tolist(),
    "nodes": nodes.tolist(),
    "relations": rels.tolist(),
    "z64": [z[e].tolist() for e in near[:20]],
    "errors": {},
  }
  print(
    f"\nedges with |z64| < {args.kink:g} for some head (the leaky ReLU's kink: float32 "
    f"rounding of z may take the other slope there): {near.size} of {z.shape[0]:,}"
  )
  for e in near[:10]:
    print(
      f"  edge {e}: {int(case.graph.src[e])} -> {int(case.graph.dst[e])}, relation "
      f"{int(case.graph.etype[e])}, z64 = {np.array2string(z[e], precision=3)}"
    )
  print(
    f"errors without the rows those edges touch (dx, out: their {nodes.size} end nodes; "
    f"dW, da_src, da_dst: their {rels.size} relations):"
  )
  print(f"  {'':8s} {'(a) hector':>12s} {'(b) plain':>12s}")
  for k in true:
    rows = nodes if k in ("dx", "out") else rels
    ea, eb = (masked_rel(runs[w][k], true[k], rows) for w in ("hector", "plain"))
    result["kink"]["errors"][k] = {"hector": ea, "plain": eb}
    print(f"  {k:8s} {ea:12.2e} {eb:12.2e}")
  for k in ("dx", "out"):
    print(
      f"\n{k} per node in-degree bucket: max error (of max |{k}64| overall), "
      f"max |{k}64| in the bucket"
    )
    result["by_degree"][k] = {}
    for who in ("hector", "plain"):
      rows, worst = by_degree(runs[who][k], true[k], in_degree)
      result["by_degree"][k][who] = {
        "rows": rows,
        "worst_node": worst,
        "worst_in_degree": int(in_degree[worst]),
        "worst_out_degree": int(out_degree[worst]),
      }
      print(
        f"  {who}: "
        + "; ".join(f"[{lab}] {n} nodes {e:.1e} (|{k}64| {m:.2f})" for lab, n, e, m in rows)
      )
      at_kink = "an end of an edge at the kink" if worst in set(nodes.tolist()) else "no kink edge"
      result["by_degree"][k][who]["worst_at_kink"] = at_kink != "no kink edge"
      print(
        f"    worst at node {worst}: in-degree {in_degree[worst]}, out-degree "
        f"{out_degree[worst]} ({at_kink})"
      )
  return result


def main(argv=None) -> int:
  args = parse(argv)
  if args.truth_out:
    truth(args)
    return 0
  import jax  # pylint: disable=g-import-not-at-top

  print(
    f"probe_rgat_precision: jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True
  )
  if args.check:
    check_grouped(args)
  case = load(args)
  print(case.describe(), flush=True)
  runs = float32_runs(args, case)
  t = time.perf_counter()
  true = run_truth(args)
  print(f"  (c) {args.reference} float64 (subprocess): {time.perf_counter() - t:.1f} s", flush=True)
  result = report(args, case, runs, true)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
