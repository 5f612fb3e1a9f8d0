"""Adversarial property tests for hector (hypothesis): random small relational graphs with hubs,
empty relations, isolated nodes, self loops and duplicate edges give RGCN's and RGAT's outputs
and gradients of plain-JAX references (float64); malformed graph arrays end in a ValueError naming
the field; ids out of range that reach the kernels follow the documented rule, in a subprocess.

Kept CPU-cheap: feature widths are fixed (the generated kernels are specialized on widths only,
so every example reuses the compiled C++), and every graph is padded to one shape (a component
of extra nodes, edges and (source, relation) pairs beside the random part, computed by both
sides), so that the jitted programs compile once.
"""

import copy
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from isolation import run_isolated

from jaxdata import hector
from jaxdata.data import HeteroGraph
from jaxdata.reference import attention as attention_ref
from jaxdata.reference import rgcn as rgcn_ref

N, R, MAX_E = 16, 4, 48
#: the padded shape: nodes, edges, unique (source, relation) pairs
N_ALL, E_ALL, P_ALL = N + 13, 2 * MAX_E, MAX_E + 1
D_IN, D_OUT, HEADS, D_HEAD = 5, 3, 2, 3
CHEAP = settings(
  deadline=None,
  max_examples=40,
  derandomize=True,
  suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@st.composite
def graphs(draw) -> HeteroGraph:
  """N nodes, R relations: a hub, some relations empty, the last nodes isolated, self loops and
  duplicate edges, in proportions hypothesis chooses."""
  e = draw(st.integers(0, MAX_E))
  seed = draw(st.integers(0, 2**32 - 1))
  empty = draw(st.sets(st.integers(0, R - 1), max_size=R - 1))
  isolated = draw(st.integers(0, 4))
  hub_share, loops, dups = (draw(st.floats(0, 1)) for _ in range(3))
  rng = np.random.default_rng(seed)
  live = N - isolated
  src, dst = rng.integers(0, live, e), rng.integers(0, live, e)
  hub = rng.random(e) < hub_share
  dst[hub & (rng.random(e) < 0.5)] = 0
  src[hub & (rng.random(e) < 0.5)] = 0
  loop = rng.random(e) < loops * 0.3
  dst[loop] = src[loop]
  et = rng.choice([t for t in range(R) if t not in empty], e)
  if e > 1:  # duplicates: copies of earlier edges
    dup = np.flatnonzero(rng.random(e) < dups * 0.3)
    dup = dup[dup > 0]
    pick = rng.integers(0, dup, len(dup)) if len(dup) else dup
    src[dup], dst[dup], et[dup] = src[pick], dst[pick], et[pick]
  return padded(src, dst, et, rng)


def padded(src, dst, et, rng) -> HeteroGraph:
  """The graph plus edges among nodes N.. that bring it to E_ALL edges and P_ALL pairs."""
  need = P_ALL - len(set(zip(src.tolist(), et.tolist())))  # new pairs: at least 1
  pad = E_ALL - len(src)
  assert 1 <= need <= min(pad, (N_ALL - N) * R)
  k = np.concatenate([np.arange(need), np.zeros(pad - need, int)])
  return HeteroGraph.from_edges(
    np.concatenate([src, N + k // R]),
    np.concatenate([dst, rng.integers(N, N_ALL, pad)]),
    np.concatenate([et, k % R]),
    num_nodes=N_ALL,
    relation_names=[f"r{i}" for i in range(R)],
  )


def _params(seed=0):
  rng = np.random.default_rng(seed)
  f = lambda *s: (rng.standard_normal(s) * 0.5).astype(np.float32)  # noqa: E731
  return dict(
    x=f(N_ALL, D_IN),
    w=f(R, D_IN, D_OUT),
    ct=f(N_ALL, D_OUT),
    wa=f(R, D_IN, HEADS * D_HEAD),
    a_src=f(R, HEADS, D_HEAD),
    a_dst=f(R, HEADS, D_HEAD),
    cta=f(N_ALL, HEADS * D_HEAD),
  )


P = _params()


@jax.jit
def hector_outputs(ga):
  """RGCN and RGAT forward and every gradient, from the generated kernels."""
  p = {k: jnp.asarray(v) for k, v in P.items()}

  def rgcn(x, w):
    return jnp.vdot(hector.rgcn_message(ga, x, w), p["ct"])

  def rgat(x, w, a_src, a_dst):
    return jnp.vdot(hector.rgat_message(ga, x, w, a_src, a_dst), p["cta"])

  return (
    [
      hector.rgcn_message(ga, p["x"], p["w"]),
      hector.rgat_message(ga, p["x"], p["wa"], p["a_src"], p["a_dst"]),
    ]
    + list(jax.grad(rgcn, argnums=(0, 1))(p["x"], p["w"]))
    + list(jax.grad(rgat, argnums=(0, 1, 2, 3))(p["x"], p["wa"], p["a_src"], p["a_dst"]))
  )


@jax.jit
def reference_outputs(src, dst, etype, norm):
  """The same in float64 plain JAX (jaxdata.reference, per-edge formulations)."""
  src, dst, etype = (a.astype(jnp.int32) for a in (src, dst, etype))
  norm = jnp.asarray(norm, jnp.float64)
  p = {k: jnp.asarray(v, jnp.float64) for k, v in P.items()}

  def rgcn(x, w):
    return rgcn_ref.per_edge_weights(src, dst, etype, norm, N_ALL, x, w)

  def rgat(x, w, a_src, a_dst):
    return attention_ref.RGAT["per-edge weights"](
      src, dst, etype, x, attention_ref.RGATParams(w, a_src, a_dst)
    )

  return (
    [rgcn(p["x"], p["w"]), rgat(p["x"], p["wa"], p["a_src"], p["a_dst"])]
    + list(jax.grad(lambda *a: jnp.vdot(rgcn(*a), p["ct"]), argnums=(0, 1))(p["x"], p["w"]))
    + list(
      jax.grad(lambda *a: jnp.vdot(rgat(*a), p["cta"]), argnums=(0, 1, 2, 3))(
        p["x"], p["wa"], p["a_src"], p["a_dst"]
      )
    )
  )


NAMES = ["rgcn", "rgat", "rgcn dx", "rgcn dW", "rgat dx", "rgat dW", "rgat da_src", "rgat da_dst"]


def _compare(got, want):
  for name, a, b in zip(NAMES, got, want):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=name)


@CHEAP
@given(g=graphs())
def test_rgcn_and_rgat_match_reference_on_adversarial_graphs(device, g):
  ga = hector.GraphArrays.from_graph(g, device=device)
  assert (ga.num_nodes, ga.num_edges, ga.num_pairs) == (N_ALL, E_ALL, P_ALL)
  _compare(hector_outputs(ga), reference_outputs(g.src, g.dst, g.etype, g.edge_norm("mean")))


# ---------------------------------------------------------------------------- malformed arrays
def _corrupt(ga, field, where, kind):
  a = np.asarray(getattr(ga, field)).copy()
  bound = {
    "src": ga.num_nodes,
    "dst": ga.num_nodes,
    "etype": ga.num_relations,
    "pair_src": ga.num_nodes,
    "pair_etype": ga.num_relations,
  }.get(field, len(a) + 1)
  i = where % len(a)
  if kind == "too big":
    a[i] = bound + where
  elif kind == "negative":
    a[i] = -1 - where
  elif kind == "short":
    a = a[:-1]
  else:  # "wrong dtype"
    a = a.astype(np.int64 if field != "norm" else np.float64)
  return a


FIELDS = [f.name for f in dataclasses.fields(hector.GraphArrays)][:17]


@settings(deadline=None, max_examples=40, derandomize=True)
@given(
  g=graphs(),
  field=st.sampled_from(FIELDS),
  where=st.integers(0, 100),
  kind=st.sampled_from(["too big", "negative", "short", "wrong dtype"]),
)
def test_malformed_graph_arrays_raise_a_value_error_naming_the_field(g, field, where, kind):
  ga = hector.GraphArrays.from_graph(g)
  if len(getattr(ga, field)) == 0 or (field == "norm" and kind in ("too big", "negative")):
    return  # nothing to corrupt (no edges), or any float is a valid normalizer
  bad = _corrupt(ga, field, where, kind)
  with pytest.raises(ValueError, match=f"hector.GraphArrays: {field}\\b") as info:
    dataclasses.replace(ga, **{field: bad})
  assert "must" in str(info.value) or "outside" in str(info.value) or "disagrees" in str(info.value)


# ---------------------------------------------------------------------------- past validation
def run_corrupted(platform, graph_edges, cases):
  """In a subprocess: `hector_outputs` for each case, ids replaced behind the dataclass."""
  with jax.default_device(jax.devices(platform)[0]):
    ga = hector.GraphArrays.from_graph(
      HeteroGraph.from_edges(*graph_edges, num_nodes=N_ALL, relation_names=list("abcd"))
    )
    out = []
    for edits in cases:
      g = copy.copy(ga)
      for field, i, value in edits:
        object.__setattr__(g, field, jnp.asarray(getattr(g, field)).at[i].set(value))
      out.append([np.asarray(a) for a in hector_outputs(g)])
    return out


BAD = st.sampled_from([-1, -(10**8), 10**8, 2**31 - 1, -(2**31)])


@settings(
  deadline=None,
  max_examples=2,
  derandomize=True,
  suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(g=graphs(), data=st.data())
def test_ids_out_of_range_past_validation_drop_their_edges(device, g, data):
  """Several random edits per case (src / dst / etype / pair out of range), all in one
  subprocess: the outputs equal the reference on the graph without the edited edges."""
  e = g.num_edges
  edit = st.tuples(st.sampled_from(["src", "dst", "etype", "pair"]), st.integers(0, e - 1), BAD)
  cases = data.draw(st.lists(st.lists(edit, min_size=1, max_size=3), min_size=6, max_size=6))
  got = run_isolated(
    run_corrupted,
    device.platform,
    (g.src, g.dst, g.etype),
    cases,
    env={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
  )  # shares the GPU
  norm = g.edge_norm("mean")
  for edits, outs in zip(cases, got):
    keep = np.ones(e, bool)
    keep[[i for _, i, _ in edits]] = False
    _compare(outs, reference_outputs(g.src[keep], g.dst[keep], g.etype[keep], norm[keep]))
