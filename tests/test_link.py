"""Link prediction (`jaxdata train rgcn --task link`): the filtered ranking equals a NumPy
reference, the RGCN + DistMult model beats chance by far on a knowledge graph with planted
relations, and the CLI trains on a folder of triples, saves, and measures again."""

import re

import jax.numpy as jnp
import numpy as np
import pytest

from jaxdata import cli
from jaxdata.train import link


def ranks_numpy(table, triples, known_triples):
  """Per direction (tails, then heads) and triple: 1 + the candidates scoring above the true
  one, skipping candidates that make another known triple. ``table[d][query, relation]``: the
  candidates' scores given the head (d = 0) or the tail (d = 1)."""
  known = {tuple(t) for t in known_triples.tolist()}
  out = []
  for direction in (0, 1):
    for h, r, t in triples.tolist():
      s = table[direction][h if direction == 0 else t, r]
      true = t if direction == 0 else h
      better = 0
      for c in range(len(s)):
        triple = (h, r, c) if direction == 0 else (c, r, t)
        if c != true and triple not in known and s[c] > s[true]:
          better += 1
      out.append(better + 1)
  return np.array(out)


def test_filtered_ranks_match_numpy():
  rng = np.random.default_rng(0)
  n, triples = 12, rng.integers(0, 12, (60, 3))
  triples[:, 1] %= 3
  triples = np.unique(triples, axis=0)
  test, rest = triples[:9], triples[9:]
  table = rng.standard_normal((2, n, 3, n)).astype(np.float32)

  def scores_of(part, direction):  # the rows filtered_ranks asks for, padding included
    part = np.asarray(part)
    query = part[:, 0] if direction == 0 else part[:, 2]
    return jnp.asarray(table[direction][query, part[:, 1]])

  got = link.filtered_ranks(scores_of, test, link.known_index(rest, test), batch=4)
  want = ranks_numpy(table, test, np.concatenate([rest, test]))
  np.testing.assert_array_equal(got, want)
  assert (want > 1).any() and (want == 1).any()
  m = link.rank_metrics(want)
  assert m["mrr"] == pytest.approx(np.mean(1 / want)) and m["hits@3"] == np.mean(want <= 3)


def test_planted_relations_beat_chance_by_far():
  ds = link.synthetic_kg(num_entities=400, num_triples=5000, clusters=20)
  result = link.train(ds, link.LinkConfig(epochs=60, hidden=32, num_bases=2))
  chance = np.mean(1 / np.arange(1, ds.num_entities + 1))  # a uniformly random rank
  assert result.metrics["test_mrr"] > 5 * chance
  assert result.metrics["test_hits@10"] > 0.3 and result.history[-1]["loss"] < 0.5


def test_the_cli_trains_on_triples_saves_and_measures_again(tmp_path, capsys):
  ds = link.synthetic_kg(num_entities=300, num_triples=3000, clusters=15, seed=1)
  data = tmp_path / "kg"
  data.mkdir()
  for split, name in link.SPLIT_FILES.items():
    rows = getattr(ds, split)
    (data / name).write_text(
      "".join(f"{ds.entities[h]}\t{ds.relations[r]}\t{ds.entities[t]}\n" for h, r, t in rows)
    )
  back = link.read_triples(data)
  assert back.num_relations == ds.num_relations and len(back.test) == len(ds.test)
  out = tmp_path / "lp"
  args = ["train", "rgcn", "--task", "link", "--data", str(data), "--epochs", "40"]
  assert cli.main([*args, "--hidden", "32", "--out", str(out)]) == 0
  mrr = float(re.search(r"MRR ([0-9.]+), Hits@1", capsys.readouterr().out).group(1))
  assert mrr > 0.05
  assert cli.main(["eval", str(out)]) == 0
  assert f"test_mrr {mrr:.4f}" in capsys.readouterr().out
  assert cli.main(["train", "rgcn", "--negatives", "3"]) == 2  # node classification
  assert "argument --negatives: for --task link" in capsys.readouterr().err
  assert cli.main(["train", "rgcn", "--out", str(out)]) == 2  # does not replace the link model
  assert "holds a rgcn-link checkpoint" in capsys.readouterr().err
