"""load_entities: the RGCN paper's RDF entity-classification benchmarks (AIFB, MUTAG, ...).

Each benchmark is a `.tgz` archive holding an N-Triples graph (`<name>_stripped.nt.gz`) and the
labelled entities (`trainingSet.tsv`, `testSet.tsv`). jaxdata reads the archive as it is: no
extraction to disk and no RDF library, just a small N-Triples parser.
"""

from __future__ import annotations

import csv
import gzip
import io
import os
import re
import tarfile
from pathlib import PurePosixPath

import numpy as np

from jaxdata.data.dataset import EntityDataset
from jaxdata.data.graph import HeteroGraph

_TRAIN, _TEST = "trainingSet.tsv", "testSet.tsv"

# One N-Triples statement per line: subject (IRI or blank node), predicate (IRI), object (IRI,
# blank node or literal with an optional @language or ^^<datatype>), then '.'.
_IRI = r"<([^>]*)>"
_BNODE = r"_:([^\s.<>\"]+(?:\.+[^\s.<>\"]+)*)"
_LITERAL = r'"([^"\\]*(?:\\.[^"\\]*)*)"(?:@([A-Za-z]+(?:-[A-Za-z0-9]+)*)|\^\^<([^>]*)>)?'
_STATEMENT = re.compile(
  rf"\s*(?:{_IRI}|{_BNODE})\s*{_IRI}\s*(?:{_IRI}|{_BNODE}|{_LITERAL})\s*\.\s*(?:#.*)?"
)
_ESCAPE = re.compile(r"\\(?:u([0-9A-Fa-f]{4})|U([0-9A-Fa-f]{8})|(.))")
_ECHARS = {"t": "\t", "b": "\b", "n": "\n", "r": "\r", "f": "\f", '"': '"', "'": "'", "\\": "\\"}


def _unescape_match(match: re.Match) -> str:
  code = match.group(1) or match.group(2)
  if code:
    return chr(int(code, 16))
  char = match.group(3)
  if char not in _ECHARS:
    raise ValueError(f"unknown escape \\{char}")
  return _ECHARS[char]


def _unescape(text: str) -> str:
  return _ESCAPE.sub(_unescape_match, text) if "\\" in text else text


def _literal_key(lexical: str, language: str | None, datatype: str | None) -> str:
  """A literal in canonical N-Triples form: one spelling per RDF term."""
  if "\\" in lexical:
    lexical = (
      _unescape(lexical)
      .replace("\\", "\\\\")
      .replace('"', '\\"')
      .replace("\n", "\\n")
      .replace("\r", "\\r")
    )
  if language:
    return f'"{lexical}"@{language.lower()}'  # language tags are case-insensitive
  if datatype is not None:
    return f'"{lexical}"^^<{_unescape(datatype)}>'
  return f'"{lexical}"'


def parse_ntriples(lines, source: str = "<string>") -> tuple[list[str], list[str], list[str]]:
  """Parses N-Triples lines into (subjects, predicates, objects), one entry per statement.

  Terms come back in canonical N-Triples form, so that one RDF term has one spelling:
  `<iri>` (escapes decoded), `_:label`, and literals `"lexical"`, `"lexical"@lang` (lower-case)
  or `"lexical"^^<datatype>` with only `\\\\`, `\\"`, `\\n`, `\\r` escaped. Predicates are bare
  IRIs. Blank lines and comments are skipped; anything else raises ValueError naming the line.

  Example:
    >>> parse_ntriples(['<a> <p> "x\\\\u00e9"@EN .'])
    (['<a>'], ['p'], ['"xé"@en'])
  """
  subjects, predicates, objects = [], [], []
  match_statement = _STATEMENT.fullmatch
  for number, line in enumerate(lines, 1):
    match = match_statement(line)
    if match is None:
      stripped = line.strip()
      if not stripped or stripped[0] == "#":
        continue
      raise ValueError(f"{source}:{number}: not an N-Triples statement: {line[:200]!r}")
    s_iri, s_bnode, p, o_iri, o_bnode, lexical, language, datatype = match.groups()
    try:
      subjects.append(f"<{_unescape(s_iri)}>" if s_bnode is None else f"_:{s_bnode}")
      predicates.append(_unescape(p))
      if o_iri is not None:
        objects.append(f"<{_unescape(o_iri)}>")
      elif o_bnode is not None:
        objects.append(f"_:{o_bnode}")
      else:
        objects.append(_literal_key(lexical, language, datatype))
    except ValueError as e:
      raise ValueError(f"{source}:{number}: {e}") from None
  return subjects, predicates, objects


def _read(archive: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
  file = archive.extractfile(member)
  assert file is not None  # a regular file: `_members` keeps only those
  return file.read()


def _members(archive: tarfile.TarFile, path: str) -> dict[str, tarfile.TarInfo]:
  """The graph and the two label files of the archive, by role."""
  files = {PurePosixPath(m.name).name: m for m in archive.getmembers() if m.isfile()}
  graphs = sorted(n for n in files if n.endswith((".nt.gz", ".nt")))
  stripped = [n for n in graphs if "_stripped." in n]
  found = {}
  if stripped or graphs:
    found["graph"] = files[(stripped or graphs)[0]]
  for role in (_TRAIN, _TEST):
    if role in files:
      found[role] = files[role]
  missing = [
    w
    for w, key in (("an N-Triples graph (*.nt.gz)", "graph"), (_TRAIN, _TRAIN), (_TEST, _TEST))
    if key not in found
  ]
  if missing:
    raise ValueError(
      f"load_entities: {path} lacks {', '.join(missing)}; it holds {sorted(files) or 'no files'}"
    )
  return found


def _read_labels(data: bytes, source: str) -> tuple[list[str], list[str]]:
  """(entity IRIs, label strings) from a TSV whose first column names the entity."""
  rows = list(csv.reader(io.StringIO(data.decode("utf-8")), delimiter="\t"))
  if not rows:
    raise ValueError(f"load_entities: {source} is empty")
  header = rows[0]
  label_columns = [i for i, name in enumerate(header) if name.startswith("label_")]
  if not label_columns:
    raise ValueError(f"load_entities: {source} has no label_* column; header: {header}")
  column = label_columns[0]
  entities, labels = [], []
  for number, row in enumerate(rows[1:], 2):
    if not row or not any(row):
      continue
    if len(row) <= column:
      raise ValueError(f"load_entities: {source}:{number}: too few columns: {row}")
    entities.append(row[0])
    labels.append(row[column])
  return entities, labels


def load_entities(path: str | os.PathLike) -> EntityDataset:
  """Loads an RDF entity-classification archive (AIFB, MUTAG, BGS, AM) as an `EntityDataset`.

  The graph is built the way the RGCN paper and PyG's `Entities` dataset build it: every
  distinct subject and object of the N-Triples file is a node (literals too: a literal is
  identified by its lexical form with its language or datatype, so `"x"` and the IRI `<x>` are
  two nodes), the file is read as a set of triples (repeated statements count once), each
  predicate p is a relation for the edges subject -> object, and relation "rev_<p>" holds the
  same edges reversed (with P predicates, relation r + P is the inverse of relation r).
  Node ids follow the sorted canonical N-Triples spelling of the terms (`node_names`), relation
  ids the sorted predicate IRIs; classes are numbered in sorted order of their names over the
  train and test files. The graph is featureless (`features=None`).

  Example:
    >>> ds = load_entities("aifb.tgz")
    >>> ds.graph
    HeteroGraph(num_nodes=8285, num_edges=58086, num_relations=90)
    >>> len(ds.train_idx), len(ds.test_idx), ds.num_classes
    (140, 36, 4)

  Args:
    path: the `.tgz` archive, as distributed (e.g. aifb.tgz, mutag.tgz).

  Raises:
    FileNotFoundError: no file at `path`.
    ValueError: not a tar archive, members missing, a line that does not parse, or a labelled
      entity that is not in the graph.
  """
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"load_entities: no archive at {path!r}")
  try:
    archive = tarfile.open(path, "r:*")
  except tarfile.TarError as e:
    first = str(e).splitlines()[0].rstrip(":") if str(e) else type(e).__name__
    raise ValueError(f"load_entities: {path} is not a (compressed) tar archive ({first})") from e
  with archive:
    members = _members(archive, path)
    data = {role: _read(archive, member) for role, member in members.items()}
  graph_name = PurePosixPath(members["graph"].name).name
  text = data["graph"]
  if graph_name.endswith(".gz"):
    text = gzip.decompress(text)
  # N-Triples lines end in LF or CRLF; str.splitlines would also split at U+2028 and friends.
  lines = text.decode("utf-8").split("\n")
  subjects, predicates, objects = parse_ntriples(lines, f"{path}:{graph_name}")

  node_names = sorted(set(subjects).union(objects))
  relation_names = sorted(set(predicates))
  node_id = {name: i for i, name in enumerate(node_names)}
  relation_id = {name: i for i, name in enumerate(relation_names)}
  triples = np.stack(
    [
      np.fromiter(map(node_id.__getitem__, subjects), np.int64, len(subjects)),
      np.fromiter(map(relation_id.__getitem__, predicates), np.int64, len(predicates)),
      np.fromiter(map(node_id.__getitem__, objects), np.int64, len(objects)),
    ],
    axis=1,
  )
  triples = np.unique(triples.reshape(-1, 3), axis=0)  # an RDF graph is a set of triples
  graph = HeteroGraph.from_edges(
    triples[:, 0],
    triples[:, 2],
    triples[:, 1],
    num_nodes=len(node_names),
    relation_names=relation_names,
    add_inverse=True,
  )

  splits = {role: _read_labels(data[role], f"{path}:{role}") for role in (_TRAIN, _TEST)}
  class_names = sorted(set(splits[_TRAIN][1]).union(splits[_TEST][1]))
  class_id = {name: i for i, name in enumerate(class_names)}
  arrays = {}
  for role, (entities, labels) in splits.items():
    idx = []
    for entity in entities:
      key = f"<{entity}>"
      if key not in node_id:
        raise ValueError(
          f"load_entities: {path}:{role} labels {entity!r}, which is not a node of the graph"
        )
      idx.append(node_id[key])
    arrays[role] = (
      np.array(idx, np.int64),
      np.array([class_id[label] for label in labels], np.int32),
    )

  name = (
    graph_name.split("_stripped")[0]
    if "_stripped" in graph_name
    else (PurePosixPath(path).name.split(".")[0])
  )
  return EntityDataset(
    name=name,
    graph=graph,
    num_classes=len(class_names),
    train_idx=arrays[_TRAIN][0],
    train_y=arrays[_TRAIN][1],
    test_idx=arrays[_TEST][0],
    test_y=arrays[_TEST][1],
    class_names=tuple(class_names),
    features=None,
    node_names=tuple(node_names),
  )
