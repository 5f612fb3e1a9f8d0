"""load_entities against PyG's `Entities` dataset (torch_geometric + rdflib + pandas, CPU).

Node and relation numberings differ between the two, so the test compares what does not depend
on them: sizes, per-relation edge counts, degree sequences, per-node relation profiles, splits
and class histograms.

One known difference is reproduced rather than ignored: PyG keys nodes by `str(term)`, so an IRI
and a literal with the same text (AIFB has one such pair: the class IRI
`<http://swrc.ontoware.org/ontology#ResearchTopic>` and the string literal of the same text)
share one node id there, and one id is left without edges. jaxdata keeps them apart (they are
two RDF terms); the test merges them the same way before comparing degrees.
"""

import collections
import os
import re
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest

from jaxdata.data import load_entities

pytest.importorskip("rdflib")
pytest.importorskip("pandas")
torch_geometric_datasets = pytest.importorskip("torch_geometric.datasets")

DATA = Path(
  os.environ.get("JAXDATA_DATA_DIR")
  or (Path(__file__).parents[1] / ".." / "shared" / "data").resolve()
)
_LITERAL = re.compile(r'"(.*)"(?:@[^"]*|\^\^<[^>]*>)?', re.S)
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n", "\\r": "\r"}


def _pyg_key(name: str) -> str:
  """What `str()` of the rdflib term gives, from jaxdata's canonical N-Triples spelling."""
  if name.startswith("<"):
    return name[1:-1]
  if name.startswith("_:"):
    return name  # rdflib renames blank nodes; they never collide with IRIs or literals
  lexical = _LITERAL.fullmatch(name).group(1)
  return re.sub(r'\\[\\"nr]', lambda m: _ESCAPES[m.group(0)], lexical)


def _profiles(dst, etype, num_nodes):
  """Per node: the sorted in-edge counts per relation (independent of relation numbering)."""
  counts = collections.Counter(zip(dst.tolist(), etype.tolist()))
  per_node = collections.defaultdict(list)
  for (v, _), k in counts.items():
    per_node[v].append(k)
  return sorted(tuple(sorted(per_node.get(v, ()))) for v in range(num_nodes))


@pytest.mark.parametrize("name", ["aifb", "mutag"])
def test_load_entities_matches_pyg(name, tmp_path):
  archive = DATA / f"{name}.tgz"
  if not archive.exists():
    pytest.skip(f"{archive} is not here")
  raw = tmp_path / name / "raw"  # where Entities looks for its files; it downloads nothing then
  raw.mkdir(parents=True)
  with tarfile.open(archive) as tar:
    for member in tar.getmembers():
      if member.isfile():
        with tar.extractfile(member) as src, open(raw / Path(member.name).name, "wb") as dst:
          shutil.copyfileobj(src, dst)
  pyg = torch_geometric_datasets.Entities(str(tmp_path), name)[0]
  ds = load_entities(archive)
  g = ds.graph

  # Sizes and per-relation edge counts.
  p_src, p_dst = pyg.edge_index.numpy()
  p_type = pyg.edge_type.numpy()
  assert g.num_nodes == pyg.num_nodes
  assert g.num_edges == len(p_type)
  assert g.num_relations == int(p_type.max()) + 1
  assert sorted(np.diff(g.relation_offsets)) == sorted(
    np.bincount(p_type, minlength=g.num_relations)
  )

  # Degrees and relation profiles, after merging nodes the way PyG does (see the module doc).
  keys = [_pyg_key(n) for n in ds.node_names]
  merged_names = sorted(set(keys))
  merged_id = {k: i for i, k in enumerate(merged_names)}
  merge = np.array([merged_id[k] for k in keys])
  unused = g.num_nodes - len(merged_names)
  assert unused == (1 if name == "aifb" else 0)
  for ours, theirs in ((g.dst, p_dst), (g.src, p_src)):
    degree = np.bincount(merge[ours], minlength=len(merged_names))
    degree = np.concatenate([degree, np.zeros(unused, np.int64)])
    np.testing.assert_array_equal(
      np.sort(degree), np.sort(np.bincount(theirs, minlength=g.num_nodes))
    )
  ours = _profiles(merge[g.dst], g.etype, len(merged_names)) + [()] * unused
  assert sorted(ours) == _profiles(p_dst, p_type, g.num_nodes)

  # Splits: sizes, class histograms, and which labelled nodes share a class with which degree.
  for idx, y, p_idx, p_y in (
    (ds.train_idx, ds.train_y, pyg.train_idx, pyg.train_y),
    (ds.test_idx, ds.test_y, pyg.test_idx, pyg.test_y),
  ):
    p_idx, p_y = p_idx.numpy(), p_y.numpy()
    assert len(idx) == len(p_idx)
    ours_hist = np.bincount(y, minlength=ds.num_classes)
    assert sorted(ours_hist) == sorted(np.bincount(p_y, minlength=ds.num_classes))
    in_degree, p_in_degree = g.in_degree(), np.bincount(p_dst, minlength=g.num_nodes)
    assert sorted(zip(in_degree[idx].tolist(), ours_hist[y].tolist())) == sorted(
      zip(p_in_degree[p_idx].tolist(), np.bincount(p_y)[p_y].tolist())
    )
