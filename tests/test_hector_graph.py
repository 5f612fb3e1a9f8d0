"""hector.GraphArrays: validation on construction, per-type node offsets, and what the generated
kernels do with ids out of range that got past it (docs/hector.md, "Ids out of range").

Kernels fed bad ids run in a subprocess (`run_isolated`): a crash fails the test, not the session.
"""

import copy
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from isolation import run_isolated

from jaxdata import hector
from jaxdata.data import HeteroGraph
from jaxdata.nn import HGT
from jaxdata.reference import attention as attention_ref
from jaxdata.reference import rgcn as rgcn_ref

N, R, E = 12, 3, 40
#: a child process shares the GPU with this one: it allocates as it goes
CHILD_ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
D_IN, D_OUT, HEADS, D_HEAD = 5, 4, 2, 3


def small_graph(seed=0) -> HeteroGraph:
  """12 nodes (a hub, node 11 isolated), 3 relations, 40 edges with duplicates and self loops."""
  rng = np.random.default_rng(seed)
  src = rng.integers(0, N - 1, E)
  dst = np.where(rng.random(E) < 0.3, 0, rng.integers(0, N - 1, E))  # node 0 is a hub
  src[:3] = dst[:3]
  et = rng.integers(0, R, E)
  return HeteroGraph.from_edges(
    src,
    dst,
    et,
    num_nodes=N,
    relation_names=["a", "b", "c"],
    node_type_names=["p", "q"],
    node_type_offsets=[0, 7, N],
  )


def test_from_graph_validates_and_carries_node_type_offsets():
  ga = hector.GraphArrays.from_graph(small_graph())
  assert ga.node_type_offsets == (0, 7, N) and ga.node_type_rows() == (7, 5)
  single = HeteroGraph.from_edges([0, 1], [1, 0], [0, 0], num_nodes=2)
  assert hector.GraphArrays.from_graph(single).node_type_offsets is None


def _replaced(ga, field, how):
  a = np.asarray(getattr(ga, field)).copy()
  if how == "big":
    a[len(a) // 2] = 10**8
  elif how == "negative":
    a[0] = -1
  elif how == "int64":
    a = a.astype(np.int64)
  elif how == "short":
    a = a[:-1]
  elif how == "swap":  # in range, but the views no longer agree with the edges
    a[[0, -1]] = a[[-1, 0]]
    if np.array_equal(a, np.asarray(getattr(ga, field))):
      a[0] = (a[0] + 1) % max(int(a.max()) + 1, 2)
  return {field: jnp.asarray(a) if how != "int64" else a}


@pytest.mark.parametrize(
  "field,how",
  [
    ("src", "big"),
    ("dst", "negative"),
    ("etype", "big"),
    ("src", "int64"),
    ("norm", "short"),
    ("rel_offsets", "swap"),
    ("csr_edges", "big"),
    ("csc_offsets", "swap"),
    ("csc_edges", "swap"),
    ("pair", "big"),
    ("pair_src", "negative"),
    ("pair_edges", "swap"),
    ("pair_etype", "big"),
    ("pair_rel_offsets", "swap"),
    ("pair_csr_edges", "swap"),
    ("pair_offsets", "short"),
  ],
)
def test_replace_with_inconsistent_array_raises_naming_the_field(field, how):
  ga = hector.GraphArrays.from_graph(small_graph())
  with pytest.raises(ValueError, match=f"GraphArrays: {field}"):
    dataclasses.replace(ga, **_replaced(ga, field, how))


def test_sizes_smaller_than_the_ids_or_bad_type_offsets_raise():
  ga = hector.GraphArrays.from_graph(small_graph())
  with pytest.raises(ValueError, match="GraphArrays: (src|csr_offsets)"):
    dataclasses.replace(ga, num_nodes=N - 2, node_type_offsets=None)
  with pytest.raises(ValueError, match="GraphArrays: (etype|rel_offsets)"):
    dataclasses.replace(ga, num_relations=R - 1)
  with pytest.raises(ValueError, match="GraphArrays: num_nodes"):
    dataclasses.replace(ga, num_nodes=-1)
  with pytest.raises(ValueError, match="GraphArrays: node_type_offsets"):
    dataclasses.replace(ga, node_type_offsets=(0, 7, N + 1))
  with pytest.raises(ValueError, match="GraphArrays: src must be a int32"):
    dataclasses.replace(ga, src=np.asarray(ga.src, np.float32))
  with pytest.raises(ValueError, match="GraphArrays: dst must be a int32 array, got list"):
    dataclasses.replace(ga, dst=np.asarray(ga.dst).tolist())


def test_unflattening_with_tracers_and_placeholders_works_and_checks_once(monkeypatch):
  from jaxdata.hector import runtime

  ga = hector.GraphArrays.from_graph(small_graph())
  calls, check = [], runtime._check_values
  monkeypatch.setattr(runtime, "_check_values", lambda g: (calls.append(1), check(g)))
  leaves, tree = jax.tree.flatten(ga)
  for _ in range(3):  # the same concrete arrays: checked (at most) once
    assert jax.tree.unflatten(tree, leaves).num_edges == E
  assert len(calls) <= 1
  x = jnp.ones((N, D_IN), jnp.float32)
  w = jnp.ones((R, D_IN, D_OUT), jnp.float32)
  f = jax.jit(lambda g, x, w: hector.rgcn_message(g, x, w))
  np.testing.assert_allclose(f(ga, x, w), hector.rgcn_message(ga, x, w), rtol=1e-6)
  jax.grad(lambda g, x: f(g, x, w).sum(), allow_int=True)(ga, x)  # float0 cotangents unflatten
  jax.vmap(lambda x: hector.rgcn_message(ga, x, w))(jnp.stack([x, 2 * x]))
  jax.tree.map(lambda a: None, ga)  # placeholders: nothing to check
  jax.eval_shape(lambda g: g, ga)


def run_with_short_offsets():
  ga = copy.copy(hector.GraphArrays.from_graph(small_graph()))
  object.__setattr__(ga, "csc_offsets", ga.csc_offsets[:-3])
  return hector.rgcn_message(ga, jnp.ones((N, D_IN)), jnp.ones((R, D_IN, D_OUT)))


def test_kernels_reject_arrays_of_the_wrong_shape_set_behind_the_dataclass():
  with pytest.raises(ValueError, match="csc_offsets must have shape"):
    run_isolated(run_with_short_offsets)


# ---------------------------------------------------------------------------- ids out of range
#: (field, edge or pair index, value, how it gets in): "setattr" bypasses the dataclass,
#: "traced" computes the array under jit (no value check is possible there)
BAD_IDS = [
  ("src", 5, 10**8, "setattr"),
  ("dst", 0, -(10**8), "setattr"),
  ("etype", 17, R, "setattr"),
  ("pair", 9, 10**8, "setattr"),
  ("src", 30, -1, "traced"),
  ("dst", 2, N, "traced"),
  ("etype", 39, -(10**8), "traced"),
]
#: offsets and edge lists out of range: unspecified values, but no crash and no stray access
BAD_VIEWS = [
  ("csc_offsets", 4, 10**8),
  ("csr_edges", 3, -(10**8)),
  ("rel_offsets", 1, -7),
  ("pair_offsets", 2, 10**8),
  ("pair_csr_edges", 0, 10**8),
  ("csc_edges", 1, E),
]


def _inputs(seed=1):
  rng = np.random.default_rng(seed)
  f = lambda *s: (rng.standard_normal(s) * 0.5).astype(np.float32)  # noqa: E731
  return dict(
    x=f(N, D_IN),
    w=f(R, D_IN, D_OUT),
    ct=f(N, D_OUT),
    wa=f(R, D_IN, HEADS * D_HEAD),
    a_src=f(R, HEADS, D_HEAD),
    a_dst=f(R, HEADS, D_HEAD),
    cta=f(N, HEADS * D_HEAD),
  )


def _layers(ga, p):
  """RGCN (edge GEMMs, weight gradient) and RGAT (pairs, softmax) outputs and gradients."""

  def rgcn(x, w):
    return jnp.vdot(hector.rgcn_message(ga, x, w), p["ct"])

  def rgat(x, w, a_src, a_dst):
    return jnp.vdot(hector.rgat_message(ga, x, w, a_src, a_dst), p["cta"])

  out = [
    hector.rgcn_message(ga, p["x"], p["w"]),
    hector.rgat_message(ga, p["x"], p["wa"], p["a_src"], p["a_dst"]),
  ]
  out += jax.grad(rgcn, argnums=(0, 1))(p["x"], p["w"])
  out += jax.grad(rgat, argnums=(0, 1, 2, 3))(p["x"], p["wa"], p["a_src"], p["a_dst"])
  return out


def run_with_bad_ids(platform, cases):
  """In a subprocess: the layers' outputs on the small graph with each case's id replaced."""
  with jax.default_device(jax.devices(platform)[0]):
    ga = hector.GraphArrays.from_graph(small_graph())
    p = {k: jnp.asarray(v) for k, v in _inputs().items()}
    results = []
    for field, i, value, how in cases:
      bad = jnp.asarray(getattr(ga, field)).at[i].set(value)
      if how == "traced":
        run = jax.jit(lambda g, b, field=field: _layers(dataclasses.replace(g, **{field: b}), p))
        out = run(ga, bad)
      else:
        g = copy.copy(ga)
        object.__setattr__(g, field, bad)
        out = jax.jit(lambda g: _layers(g, p))(g)
      results.append([np.asarray(a) for a in out])
    return results


def reference_without(g: HeteroGraph, drop: int):
  """The same outputs and gradients in float64 plain JAX, edge `drop` removed."""
  keep = np.arange(g.num_edges) != drop
  src, dst, et = (jnp.asarray(a[keep]) for a in (g.src, g.dst, g.etype))
  norm = jnp.asarray(g.edge_norm("mean").astype(np.float64)[keep])
  p = {k: jnp.asarray(v, jnp.float64) for k, v in _inputs().items()}

  def rgcn(x, w):
    return rgcn_ref.per_edge_weights(src, dst, et, norm, N, x, w)

  def rgat(x, w, a_src, a_dst):
    params = attention_ref.RGATParams(w, a_src, a_dst)
    return attention_ref.RGAT["per-edge weights"](src, dst, et, x, params)

  out = [rgcn(p["x"], p["w"]), rgat(p["x"], p["wa"], p["a_src"], p["a_dst"])]
  out += jax.grad(lambda *a: jnp.vdot(rgcn(*a), p["ct"]), argnums=(0, 1))(p["x"], p["w"])
  out += jax.grad(lambda *a: jnp.vdot(rgat(*a), p["cta"]), argnums=(0, 1, 2, 3))(
    p["x"], p["wa"], p["a_src"], p["a_dst"]
  )
  return out


def test_edges_with_ids_out_of_range_contribute_nothing(device):
  """The documented rule, on CPU and GPU: such an edge is left out of every sum, softmax and
  gradient; nothing crashes. Offsets and edge lists out of range do not crash either."""
  g = small_graph()
  cases = BAD_IDS + [(f, i, v, "setattr") for f, i, v in BAD_VIEWS]
  got = run_isolated(run_with_bad_ids, device.platform, cases, env=CHILD_ENV)
  for (field, i, _, _), outs in zip(BAD_IDS, got):
    # edge i's id was replaced: the outputs are those of the graph without edge i
    for k, (a, b) in enumerate(zip(outs, reference_without(g, i))):
      np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5, err_msg=f"{field} output {k}")
  for outs in got[len(BAD_IDS) :]:
    assert all(np.isfinite(a).all() for a in outs[:2])


# ---------------------------------------------------------------------------- node types
def test_hgt_rejects_features_split_unlike_the_graphs_node_types():
  """Defect 7: rows 7 + 5 in the graph; features given as 6 + 6 must not run."""
  ga = hector.GraphArrays.from_graph(small_graph())
  layer = HGT((4, 3), 4, num_relations=R, heads=2, rngs=nnx.Rngs(0))
  ok = layer(ga, [jnp.ones((7, 4)), jnp.ones((5, 3))])
  assert [o.shape for o in ok] == [(7, 4), (5, 4)]
  with pytest.raises(ValueError, match=r"HGT: feature rows per node type \[6, 6\].*\[7, 5\]"):
    layer(ga, [jnp.ones((6, 4)), jnp.ones((6, 3))])
  with pytest.raises(ValueError, match=r"HGT: feature rows per node type \[12\] do not"):
    HGT((4,), 4, num_relations=R, heads=2, rngs=nnx.Rngs(0))(ga, [jnp.ones((N, 4))])
  with pytest.raises(ValueError, match=r"feature rows per node type \[6, 6\]"):
    nnx.jit(lambda m, g, xs: m(g, xs))(layer, ga, [jnp.ones((6, 4)), jnp.ones((6, 3))])
