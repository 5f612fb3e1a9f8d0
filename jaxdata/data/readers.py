"""Dataset readers into `HeteroData`: OGB's raw node-property layout, and a folder of edge lists.

`read(path)` picks the reader by what the folder holds; `jaxdata train rgcn|rgat|hgt --data DIR
--target TYPE` trains on either.

**OGB** (`read_ogb`): the folder of a node-property-prediction dataset as OGB ships it, before
any conversion (download the dataset's zip from the OGB website, e.g. ogbn-mag or ogbn-arxiv,
and unzip it): ``raw/`` with the graph's CSVs and ``split/<scheme>/`` with the split's ids.
Heterogeneous: ``raw/num-node-dict.csv.gz``, ``raw/triplet-type-list.csv.gz``,
``raw/relations/<src>___<relation>___<dst>/edge.csv.gz``, ``raw/node-feat/<type>/node-feat.csv.gz``,
``raw/node-label/<type>/node-label.csv.gz``, ``split/<scheme>/<type>/{train,valid,test}.csv.gz``.
Homogeneous (one node type, "node"; one relation, "to"): ``raw/edge.csv.gz``,
``raw/num-node-list.csv.gz``, ``raw/node-feat.csv.gz``, ``raw/node-label.csv.gz``,
``split/<scheme>/{train,valid,test}.csv.gz``. Beside any ``X.csv.gz`` a ``X.npy`` is read
instead, memory-mapped: convert the features of a large graph once (``np.save``) and they stay
on disk until sampled.

**Edge lists** (`read_edge_lists`), a layout for one's own data:

    DIR/edges/<src>__<relation>__<dst>.csv   (or .tsv, .txt: "src dst" or "src,dst" per line;
                                             or .npy: [2, E] or [E, 2]; or .parquet: columns
                                             "src" and "dst", else the first two; needs
                                             pyarrow, the `parquet` extra)
    DIR/features/<type>.npy                  (memory-mapped)
    DIR/labels/<type>.npy                    (ints, negative: none)
    DIR/splits/<type>/{train,val,test}.npy   (node ids)
    DIR/num_nodes.json                       ({type: count}, optional)

Ids are local to their node type, from 0.
"""

from __future__ import annotations

import csv
import gzip
import json
import os
from pathlib import Path

import numpy as np

from jaxdata.data.hetero import HeteroData

#: OGB's split files and the container's names for them.
_OGB_SPLITS = {"train": "train", "valid": "val", "test": "test"}


def read(path: str | os.PathLike) -> HeteroData:
  """Reads a dataset folder in either layout (OGB's if it holds ``raw/``, else edge lists)."""
  root = Path(path)
  if not root.is_dir():
    raise FileNotFoundError(f"read: {root} is not a folder")
  return read_ogb(root) if (root / "raw").is_dir() else read_edge_lists(root)


def _npy(path: Path) -> Path:
  """The ``.npy`` that stands in for a ``.csv(.gz)``."""
  return path.with_name(path.name.removesuffix(".gz").removesuffix(".csv") + ".npy")


def _has(path: Path) -> bool:
  return path.exists() or _npy(path).exists()


def _csv(path: Path, dtype, *, header: bool = False) -> np.ndarray:
  """A CSV (gzipped or not) as a 2-D array; ``path.npy`` beside it wins, memory-mapped."""
  npy = _npy(path)
  if npy.exists():
    return np.load(npy, mmap_mode="r")
  if not path.exists():
    raise FileNotFoundError(f"{path}: missing (nor is there {npy.name})")
  opener = gzip.open if path.suffix == ".gz" else open
  with opener(path, "rt", newline="") as f:
    rows = list(csv.reader(f))
  if header:
    rows = rows[1:]
  rows = [r for r in rows if r]
  try:
    return np.array(rows, dtype=dtype).reshape(len(rows), -1)
  except ValueError as e:
    raise ValueError(f"{path}: not a table of {np.dtype(dtype).name} ({e})") from None


def _header(path: Path) -> list[str]:
  opener = gzip.open if path.suffix == ".gz" else open
  with opener(path, "rt", newline="") as f:
    return next(csv.reader(f))


def _ogb_split(folder: Path) -> Path:
  schemes = sorted(p for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []
  if not schemes:
    raise FileNotFoundError(f"read_ogb: {folder} holds no split (split/<scheme>/...)")
  return schemes[0]


def read_ogb(path: str | os.PathLike) -> HeteroData:
  """Reads an OGB node-property-prediction folder (module docstring) into a `HeteroData`."""
  root = Path(path)
  raw = root / "raw"
  if not raw.is_dir():
    raise FileNotFoundError(f"read_ogb: {root} has no raw/ folder (OGB's layout)")
  split = _ogb_split(root / "split")
  if (raw / "num-node-dict.csv.gz").exists():
    counts_path = raw / "num-node-dict.csv.gz"
    types = _header(counts_path)
    counts = _csv(counts_path, np.int64, header=True)[0]
    num_nodes = dict(zip(types, (int(c) for c in counts)))
    triplets = [tuple(r) for r in _csv(raw / "triplet-type-list.csv.gz", str)]
    edges = {
      t: _csv(raw / "relations" / "___".join(t) / "edge.csv.gz", np.int64).T for t in triplets
    }
    x, y, masks = {}, {}, {s: {} for s in _OGB_SPLITS.values()}
    for t in types:
      feat = raw / "node-feat" / t / "node-feat.csv.gz"
      if _has(feat):
        x[t] = _csv(feat, np.float32)
      label = raw / "node-label" / t / "node-label.csv.gz"
      if _has(label):
        y[t] = _labels(_csv(label, np.float64))
      for name, ours in _OGB_SPLITS.items():
        ids = split / t / f"{name}.csv.gz"
        if ids.exists():
          masks[ours][t] = _csv(ids, np.int64)[:, 0]
  else:
    num_nodes = {"node": int(_csv(raw / "num-node-list.csv.gz", np.int64)[0, 0])}
    edges = {("node", "to", "node"): _csv(raw / "edge.csv.gz", np.int64).T}
    feat = raw / "node-feat.csv.gz"
    x = {"node": _csv(feat, np.float32)} if _has(feat) else {}
    y = {"node": _labels(_csv(raw / "node-label.csv.gz", np.float64))}
    masks = {
      ours: {"node": _csv(split / f"{name}.csv.gz", np.int64)[:, 0]}
      for name, ours in _OGB_SPLITS.items()
    }
  return HeteroData(edges, num_nodes=num_nodes, x=x, y=y, **_splits(masks))


def _labels(column: np.ndarray) -> np.ndarray:
  """OGB's label column (NaN: no label) as int64, -1 where missing."""
  column = np.asarray(column, np.float64).reshape(len(column), -1)[:, 0]
  return np.where(np.isnan(column), -1, column).astype(np.int64)


def _splits(masks: dict) -> dict:
  return {name: ids for name, ids in masks.items() if ids}


def _parquet(path: Path) -> np.ndarray:
  """A Parquet edge file's ids as [2, E]: columns "src" and "dst", else the first two."""
  try:
    import pyarrow.parquet as pq  # optional (the parquet extra)
  except ImportError:
    raise ImportError(
      f"read_edge_lists: {path} is Parquet, which needs pyarrow: pip install 'jaxdata[parquet]'"
    ) from None
  table = pq.read_table(path)
  names = ["src", "dst"] if {"src", "dst"} <= set(table.column_names) else table.column_names[:2]
  if len(names) < 2:
    raise ValueError(f"read_edge_lists: {path}: expected two columns of node ids, got {names}")
  columns = [table.column(n).to_numpy() for n in names]
  if not all(np.issubdtype(c.dtype, np.integer) for c in columns):
    raise ValueError(
      f"read_edge_lists: {path}: columns {names} must hold integer node ids, got "
      f"{[str(c.dtype) for c in columns]}"
    )
  return np.stack(columns).astype(np.int64, copy=False)


def _edge_file(path: Path) -> np.ndarray:
  if path.suffix == ".parquet":
    return _parquet(path)
  if path.suffix == ".npy":
    index = np.load(path, mmap_mode="r")
  else:
    with open(path) as f:
      rows = [line.replace(",", " ").split() for line in f if line.strip() and line[0] != "#"]
    try:
      index = np.array(rows, np.int64).reshape(len(rows), -1)
    except ValueError:
      raise ValueError(f"read_edge_lists: {path}: expected two node ids per line") from None
  if index.ndim != 2 or 2 not in index.shape:
    raise ValueError(f"read_edge_lists: {path}: expected [2, E] or [E, 2] ids, got {index.shape}")
  return index if index.shape[0] == 2 and index.shape[1] != 2 else np.asarray(index).T


def read_edge_lists(path: str | os.PathLike) -> HeteroData:
  """Reads an edge-list folder (module docstring) into a `HeteroData`."""
  root = Path(path)
  files = sorted((root / "edges").glob("*")) if (root / "edges").is_dir() else []
  if not files:
    raise FileNotFoundError(
      f"read_edge_lists: {root}/edges/ holds no edge files (<src>__<relation>__<dst>.csv)"
    )
  edges = {}
  for f in files:
    key = tuple(f.stem.split("__"))
    if len(key) != 3 or not all(key):
      raise ValueError(
        f"read_edge_lists: {f.name}: name edge files <src>__<relation>__<dst> (two underscores)"
      )
    edges[key] = _edge_file(f)
  num_nodes = None
  if (root / "num_nodes.json").exists():
    num_nodes = json.loads((root / "num_nodes.json").read_text())
  x = {p.stem: np.load(p, mmap_mode="r") for p in sorted((root / "features").glob("*.npy"))}
  y = {p.stem: np.load(p) for p in sorted((root / "labels").glob("*.npy"))}
  masks: dict[str, dict] = {s: {} for s in ("train", "val", "test")}
  for folder in sorted((root / "splits").glob("*")):
    for s in masks:
      if (folder / f"{s}.npy").exists():
        masks[s][folder.name] = np.load(folder / f"{s}.npy")
  return HeteroData(edges, num_nodes=num_nodes, x=x, y=y, **_splits(masks))
