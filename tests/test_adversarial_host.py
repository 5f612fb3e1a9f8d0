"""Adversarial property tests of host tables: every case ends in the right answer or a clear error.

Random tables of many dtypes, random indices of every integer dtype reaching past both ends and
sitting on the int32/uint32 edges, random fill values (huge, negative, non-finite) and modes:
`host_gather` against `jnp.take`, `host_scatter_add` against `np.add.at`. Misuse that could
crash the process (closed and stale tables inside compiled programs, foreign handles, vmap over a
table) runs in a subprocess through `run_isolated`, many cases per process.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from isolation import run_isolated

from jaxdata.host import HostTable, host_gather, host_scatter_add

TABLE_DTYPES = [np.float32, ml_dtypes.bfloat16, np.int8, np.int32, np.int64, np.float64]
SCATTER_DTYPES = [np.float32, ml_dtypes.bfloat16, np.int32, np.int64, np.float64]
INDEX_DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
EDGES = [0, 1, -1, 2**31 - 1, -(2**31), 2**31, 2**32 - 1, 2**32, 2**63 - 1, -(2**63), 2**64 - 1]
FILLS = [
  None,
  0,
  -1,
  1.5,
  -2.5,
  2**40,
  -(2**40),
  2**63 - 1,
  300,
  -129,
  np.inf,
  -np.inf,
  np.nan,
  np.float32(7),
  np.int64(-(2**62)),
  True,
]

SETTINGS = settings(
  max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def random_table(rng, rows, cols, dtype):
  dtype = np.dtype(dtype)
  if np.issubdtype(dtype, np.integer):
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=(rows, cols), dtype=dtype, endpoint=True)
  return (rng.standard_normal((rows, cols)) * 8).astype(dtype)


@st.composite
def index_arrays(draw, rows):
  """Indices of one integer dtype: around [-rows, rows), past it, and on the dtype's edges."""
  dtype = np.dtype(draw(st.sampled_from(INDEX_DTYPES)))
  info = np.iinfo(dtype)
  near = st.integers(-2 * rows - 2, 2 * rows + 2)
  edges = st.sampled_from([e for e in EDGES + [rows, -rows, rows - 1, -rows - 1]])
  values = draw(st.lists(st.one_of(near, edges), min_size=0, max_size=24))
  shape = draw(st.sampled_from([(len(values),), None]))
  values = [v for v in values if info.min <= v <= info.max]
  idx = np.array(values, dtype=dtype)
  if shape is None and idx.size % 2 == 0:
    idx = idx.reshape(2, -1)
  return idx


def canonical(idx, rows):
  """The same meaning in int64: past either end becomes just past it (fill/drop or clamp alike)."""
  exact = np.array([int(v) for v in idx.reshape(-1)], dtype=object)
  return np.clip(exact, -rows - 1, rows).astype(np.int64).reshape(idx.shape)


def assert_bits(got, want):
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape)
  np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


@SETTINGS
@given(
  data=st.data(),
  rows=st.integers(1, 40),
  cols=st.integers(1, 9),
  dtype=st.sampled_from(TABLE_DTYPES),
  mode=st.sampled_from(["fill", "clip"]),
  fill=st.sampled_from(FILLS),
  seed=st.integers(0, 2**32 - 1),
  jit=st.booleans(),
)
def test_gather_equals_take_for_any_indices_and_fill(
  device, data, rows, cols, dtype, mode, fill, seed, jit
):
  table_data = random_table(np.random.default_rng(seed), rows, cols, dtype)
  idx = data.draw(index_arrays(rows))
  # The reference runs on the CPU: a non-finite fill of an integer table converts as the CPU
  # converts it, and host_gather promises that value on every device.
  with jax.default_device(jax.devices("cpu")[0]):
    try:
      want = jnp.take(
        jnp.asarray(table_data),
        jnp.asarray(canonical(idx, rows)),
        axis=0,
        mode=mode,
        fill_value=fill,
      )
    except (TypeError, ValueError, OverflowError):
      want = None
  with HostTable(table_data) as table:
    gather = (
      jax.jit(lambda i: host_gather(table, i, mode=mode, fill_value=fill))
      if jit
      else (lambda i: host_gather(table, i, mode=mode, fill_value=fill))
    )
    if want is None:  # jnp.take refuses this fill value: so does host_gather, clearly
      with pytest.raises(ValueError, match="host_gather: fill_value"):
        gather(jnp.asarray(idx))
      return
    got = jax.block_until_ready(gather(jnp.asarray(idx)))
  assert_bits(got, want)


def add_at_reference(data, idx, updates):
  """np.add.at with x.at[idx].add's rules: [-rows, 0) from the end, the rest outside dropped."""
  rows = data.shape[0]
  flat = canonical(idx, rows).reshape(-1)
  flat = np.where(flat < 0, flat + rows, flat)
  keep = (flat >= 0) & (flat < rows)
  out = data.copy()
  np.add.at(out, flat[keep], updates.reshape(-1, data.shape[1]).astype(data.dtype)[keep])
  return out


@SETTINGS
@given(
  data=st.data(),
  rows=st.integers(1, 30),
  cols=st.integers(1, 6),
  dtype=st.sampled_from(SCATTER_DTYPES),
  seed=st.integers(0, 2**32 - 1),
  calls=st.integers(1, 3),
)
def test_scatter_add_equals_add_at_for_any_indices(device, data, rows, cols, dtype, seed, calls):
  rng = np.random.default_rng(seed)
  table_data = random_table(rng, rows, cols, dtype)
  want = table_data
  with HostTable(table_data) as table:
    step = jax.jit(host_scatter_add)
    for _ in range(calls):
      idx = data.draw(index_arrays(rows))
      updates = random_table(rng, max(idx.size, 1), cols, dtype)[: idx.size].reshape(
        idx.shape + (cols,)
      )
      jax.block_until_ready(step(table, jnp.asarray(idx), jnp.asarray(updates)))
      want = add_at_reference(want, idx, updates)
    got = table.as_numpy().copy()
  assert_bits(got, want)


# -- misuse that must not crash the process ------------------------------------------------------


def _misuse_cases(seed):
  """Runs many misuses in this (sub)process; returns (case, outcome) pairs.

  The outcome is "ok" when the call gave the right answer, or "TypeName: message" for an error.
  A wrong answer is reported as "WRONG ..."; a crash kills the process (and fails the test).
  """
  import os

  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jaxdata.host import HostGraph, HostTable, host_gather, host_scatter_add, sample_neighbors

  jax.config.update("jax_enable_x64", True)
  rng = np.random.default_rng(seed)
  out = []

  probe = HostTable(np.zeros((1, 1), np.float32))

  def attempt(name, fn, check=None):
    try:
      result = jax.block_until_ready(fn())
      if any(
        d.platform == "gpu"
        for leaf in jax.tree.leaves(result)
        if isinstance(leaf, jax.Array)
        for d in leaf.devices()
      ):
        # A GPU kernel that met a bad handle read nothing and left the error for the next
        # jaxdata host call on the device: make that call, and take its error as this one's.
        jax.block_until_ready(host_gather(probe, jnp.zeros(1, jnp.int32)))
      ok = check is None or check(result)
      out.append((name, "ok" if ok else f"WRONG {np.asarray(result)!r}"[:300]))
    except Exception as e:  # noqa: BLE001 - every error is reported to the parent
      out.append((name, f"{type(e).__name__}: {e}"[:300]))

  gather = jax.jit(host_gather)
  scatter = jax.jit(host_scatter_add)

  def table_cases(k):
    """Gathers and scatters on one random table, right and wrong ones, then on it closed."""
    rows, cols = int(rng.integers(1, 50)), int(rng.integers(1, 8))
    data = rng.standard_normal((rows, cols)).astype(np.float32)
    table = HostTable(data)
    idx = jnp.asarray(rng.integers(-3 * rows, 3 * rows, size=int(rng.integers(0, 40))))
    closure = jax.jit(lambda i, t=table: host_gather(t, i))
    attempt(
      f"gather, compiled closure {k}",
      lambda: closure(idx),
      lambda r: np.array_equal(
        np.asarray(r), np.asarray(jnp.take(data, idx, axis=0)), equal_nan=True
      ),
    )
    attempt(
      f"gather {k}",
      lambda: gather(table, idx),
      lambda r: np.array_equal(
        np.asarray(r), np.asarray(jnp.take(data, idx, axis=0)), equal_nan=True
      ),
    )
    other = HostTable(np.zeros((rows + 1, cols), np.float32))
    foreign = jax.tree.unflatten(jax.tree.structure(table), [other.handle])
    attempt(f"foreign handle {k}", lambda: gather(foreign, idx))
    attempt(
      f"forged handle {k}",
      lambda: gather(
        jax.tree.unflatten(jax.tree.structure(table), [np.int32(rng.integers(-(2**31), 2**31))]),
        idx,
      ),
    )
    attempt(f"scatter wrong rows {k}", lambda: scatter(foreign, idx, jnp.ones(idx.shape + (cols,))))
    attempt(f"vmap over a table {k}", lambda: jax.vmap(host_gather)(table, idx[None]))
    table.close()
    other.close()
    attempt(f"closed, compiled {k}", lambda: closure(idx))
    attempt(f"closed, as argument {k}", lambda: gather(table, idx))
    attempt(f"closed, scatter {k}", lambda: scatter(table, idx, jnp.ones(idx.shape + (cols,))))

  for k in range(12):
    table_cases(k)
  graph = HostGraph.from_edges(rng.integers(0, 20, 60), rng.integers(0, 20, 60), 20)
  sample = jax.jit(lambda s: sample_neighbors(graph, s, (3, 2), jax.random.key(0)))
  attempt("sample", lambda: sample(jnp.arange(-2, 22, dtype=jnp.int32)).nodes[-1])
  graph.close()
  attempt("sample, closed graph", lambda: sample(jnp.arange(4, dtype=jnp.int32)).nodes[-1])
  return out


def test_misuse_ends_in_a_right_answer_or_a_clear_error_never_a_crash():
  outcomes = dict(run_isolated(_misuse_cases, 7))
  for name, outcome in outcomes.items():
    assert not outcome.startswith("WRONG"), (name, outcome)
    kind = name.split(" ")[0]
    if name.startswith(("gather", "sample")) and "closed" not in name:
      assert outcome == "ok", (name, outcome)
    elif name.startswith(("foreign", "scatter wrong")):
      assert "rows" in outcome and "built for" in outcome, (name, outcome)
    elif name.startswith("forged"):
      assert "is closed" in outcome or "built for" in outcome, (name, outcome)
    elif name.startswith("vmap"):
      assert outcome.startswith(("ValueError", "TypeError")) or "handle" in outcome, (name, outcome)
    else:
      assert "closed" in outcome, (kind, name, outcome)
