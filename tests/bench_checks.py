"""Checks the benchmark tests share."""
import math


def assert_losses_agree(results, notes):
  assert not [n for n in notes if "differs" in n]
  by_case = {}
  for r in results:
    if r.ok:
      by_case.setdefault((r.graph, r.dim), []).append(r)
  for rs in by_case.values():
    ref = rs[0].loss
    for r in rs:
      assert math.isclose(r.loss, ref, rel_tol=1e-3, abs_tol=1e-3), (r.formulation, r.loss, ref)
