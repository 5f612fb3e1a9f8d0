"""Measures hand-written plans on `jaxdata rok`'s full-size GPT next to keep everything.

    python3 rok_plan.py "5x(offload[mlp]+in,offload[mlp]+in,offload[in]),keep[dots]" \
        --spill 768MiB --load 768MiB [--budget 0.1]

A plan is policy names (`jaxdata.nn.gpt_plan.policy_named`), comma-separated, `Nx(...)` repeating a
group; it must name one policy per layer. Each plan runs with a TensorStore capping spill staging at
--spill and loads held at --load; printed: step time against keep's, XLA's temporaries, the store's
staging peak, and whether their sum fits --budget (a fraction of keep's memory).
"""

import argparse
import re

from benchmarks import rok
from jaxdata import offload
from jaxdata.nn import gpt_plan
from jaxdata.timing import median_seconds


def expand(text: str) -> list[str]:
  while m := re.search(r"(\d+)x\(([^()]*)\)", text):
    text = text[: m.start()] + ",".join([m.group(2)] * int(m.group(1))) + text[m.end() :]
  out = []
  for part in text.split(","):
    m = re.fullmatch(r"(?:(\d+)x\s*)?(.+)", part.strip())
    out += [m.group(2)] * int(m.group(1) or 1)
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("plans", nargs="+")
  ap.add_argument("--spill", default="768MiB")
  ap.add_argument("--load", default="0")
  ap.add_argument("--budget", type=float, default=0.1)
  ap.add_argument("--repeats", type=int, default=3)
  args = ap.parse_args()
  model, tokens = rok.model_and_tokens(**rok.FULL, loss_chunk=256)
  layers = model.cfg.layers
  fn, keep_temp, _ = rok._step(model, tokens, None)
  keep_s = median_seconds(fn, warmup=2, repeats=args.repeats)
  budget = args.budget * keep_temp
  print(
    f"keep everything: {keep_s * 1e3:.1f} ms, {keep_temp / 2**30:.2f} GiB; budget "
    f"{args.budget:g} x keep = {budget / 2**30:.2f} GiB"
  )
  del fn
  for text in args.plans:
    names = expand(text)
    if len(names) != layers:
      raise SystemExit(f"{text!r}: {len(names)} policies for {layers} layers")
    with offload.TensorStore(
      ram_bytes=16 << 30, device_bytes=args.spill, load_bytes=args.load
    ) as store:
      plan = [gpt_plan.policy_named(n, store) for n in names]
      fn, temp, _ = rok._step(model, tokens, plan)
      s = median_seconds(fn, warmup=2, repeats=args.repeats)
      st = store.stats()
    total = temp + st["device_peak"]
    print(
      f"{text}\n  {s * 1e3:.1f} ms = {s / keep_s:.3f} x keep; XLA {temp / 2**30:.2f} GiB + "
      f"staging {st['device_peak'] / 2**30:.2f} GiB (spills {st['spill_peak'] / 2**30:.2f}, "
      f"loads {st['load_peak'] / 2**30:.2f}) = {total / 2**30:.2f} GiB: "
      f"{'fits' if total <= budget else 'OVER'} the budget"
    )
    del fn


if __name__ == "__main__":
  main()
