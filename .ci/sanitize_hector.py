"""Runs hector's generated CUDA kernels (RGCN and RGAT, forward and backward) on graphs with ids
and views out of range, for compute-sanitizer (see .ci/gpu): the cases of
tests/test_hector_graph.py, whose rule is that such edges contribute nothing and nothing is read
or written out of bounds. Exits non-zero if an output is not finite."""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from test_hector_graph import BAD_IDS, BAD_VIEWS, run_with_bad_ids  # noqa: E402

cases = [("src", 0, 0, "setattr")] + BAD_IDS + [(f, i, v, "setattr") for f, i, v in BAD_VIEWS]
bad = 0
for (field, i, value, how), outs in zip(cases, run_with_bad_ids("gpu", cases)):
  finite = all(np.isfinite(a).all() for a in outs[:2])
  bad += not finite
  print(f"{field}[{i}] = {value} ({how}): {'ok' if finite else 'NOT FINITE'}")
print("mismatches:", bad)
raise SystemExit(1 if bad else 0)
