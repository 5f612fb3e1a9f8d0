"""Tuned against default tilings side by side (jaxdata.hector.tuning): for each case, the hector
step timed with JAXDATA_HECTOR_AUTOTUNE=0 (every tensor-core kernel in its default tiling) and
=1 (each in the tiling its first run chose), then every tensor-core kernel's tilings with the
median time the launcher measured for each and the one it chose.

Usage (on the GPU machine, after `bash .ci/gpu build`):
  python3 probe_tuning.py CASES
CASES: model:graph:dim:dtype[:precision], comma-separated (as probe_constants.py).
Choice files already in the cache are deleted first, so every kernel is tuned in this run.
"""

import os
import sys

import jax
from profile_hector import build_step

from jaxdata.hector import compiler, tuning
from jaxdata.timing import median_seconds


def main(cases: str) -> None:
  for f in compiler.cache_dir().glob("*.tune"):
    f.unlink()
  made = {}  # choice file -> (kernel label, tilings)
  choice_file = tuning.choice_file

  def recording(source, arch, rows, tilings, pairs=None):
    path = choice_file(source, arch, rows, tilings, pairs)
    made[path] = (source.split("\n", 1)[0].removeprefix("// jaxdata.hector "), tilings)
    return path

  tuning.choice_file = recording
  for case in cases.split(","):
    model, graph, dim, dtype, *rest = case.split(":")
    precision = rest[0] if rest else "default"
    times = {}
    for setting in ("0", "1"):
      os.environ[tuning.AUTOTUNE_ENV] = setting
      jax.clear_caches()
      made.clear()
      step = build_step(model, graph, int(dim), precision, dtype, "train")
      jax.block_until_ready(step.run())  # tunes (setting 1)
      times[setting] = median_seconds(step.run, warmup=3, repeats=9, queued=20) * 1e3
    print(
      f"{model} {graph} dim {dim} {dtype} {precision}: fwd+bwd {times['0']:.3f} ms default "
      f"tilings, {times['1']:.3f} ms tuned ({times['0'] / times['1']:.3f}x)",
      flush=True,
    )
    for path, (label, tilings) in made.items():
      choice = tuning.read_choice(path, len(tilings))
      if choice is None:
        print(f"  {label[:90]}: no choice recorded", flush=True)
        continue
      cells = ", ".join(
        f"{'*' if i == choice.index else ''}{t}: {us:.1f} us"
        for i, (t, us) in enumerate(zip(tilings, choice.times_us))
      )
      print(f"  {label[:90]}\n    {cells}", flush=True)


if __name__ == "__main__":
  main(sys.argv[1])
