"""Checks the benchmark tests share."""

import math

import jax


def assert_losses_agree(results, notes):
  """Every formulation of a case computed the same loss (and the bench noted no difference).

  On a GPU, rows at precision "default" run their matmuls on TF32 (PyG too, where the bench
  turns TF32 on for it): on the tests' tiny graphs the loss sum(out * ct) can cancel to near 0,
  where TF32's rounding of the terms (about 1e-3 of each) is no longer small next to it (the
  H200 gate saw -1.025 against -1.065). Those rows are left out there; on the CPU "default" is
  float32 and every row is compared.
  """
  tf32 = jax.default_backend() != "cpu"

  def loose(r) -> bool:
    return tf32 and (r.precision == "default" or r.formulation.startswith("PyG"))

  assert not [
    n for n in notes if "differs" in n and not (tf32 and ("(default)" in n or "PyG" in n))
  ], notes
  by_case = {}
  for r in results:
    if r.ok and not loose(r):
      by_case.setdefault((r.graph, r.dim), []).append(r)
  for rs in by_case.values():
    ref = rs[0].loss
    for r in rs:
      assert math.isclose(r.loss, ref, rel_tol=1e-3, abs_tol=1e-3), (r.formulation, r.loss, ref)


def breakdown_cells(text: str) -> dict[str, float]:
  """A benchmark's "Where the GPU-centric step's time goes" table (`--breakdown`), {row: ms},
  checked: `common.PARTS` first, each >= 0 with a whole number of kernels per step (some where
  it takes time), the device's busy time between the largest part and their sum, and the idle
  time the steady step less the busy time. Then its busiest kernels: each of a part, busiest
  first, none longer than its part."""
  import pytest  # pylint: disable=g-import-not-at-top

  from benchmarks import common  # pylint: disable=g-import-not-at-top

  section = text.split("## Where the GPU-centric step's time goes")[1]
  section, kernels = section.split("The busiest kernels")
  lines = [
    [c.strip() for c in line.split("|")[1:-1]]
    for line in section.splitlines()
    if line.startswith("| ") and not line.startswith("| part") and "---" not in line
  ]
  cells = {c[0]: float(c[1]) for c in lines}
  assert list(cells)[: len(common.PARTS)] == list(common.PARTS)
  for c in lines[: len(common.PARTS)]:
    launches = float(c[3])
    assert launches == int(launches) and (launches > 0) == (float(c[1]) > 0), c
  parts = [cells[p] for p in common.PARTS]
  busy, steady, idle = (cells[k] for k in list(cells)[len(common.PARTS) : len(common.PARTS) + 3])
  assert min(parts) >= 0 and max(parts) - 0.002 <= busy <= sum(parts) + 0.002
  assert idle == pytest.approx(max(0.0, steady - busy), abs=0.002)
  rows = [
    [c.strip() for c in line.split("|")[1:-1]]
    for line in kernels.splitlines()
    if line.startswith("| ") and not line.startswith("| part") and "---" not in line
  ]
  assert rows
  us = [float(r[3]) for r in rows]
  assert us == sorted(us, reverse=True)
  for part, _, launches, t in rows:
    assert part in common.PARTS and float(launches) > 0
    assert float(t) <= 1e3 * cells[part] + 0.1
  return cells
