"""HeteroData and the dataset readers: a user's own heterograph, written to disk the way OGB ships
node-property datasets and as a folder of edge lists, read back exactly (NumPy), converted to and
from PyG, jraph and DGL-style dicts without loss, and trained from the CLI (`--data DIR
--target`) and from Python, the classified type not the first."""

import csv
import functools
import gzip
import json
import re

import jax
import numpy as np
import pytest

from jaxdata import cli
from jaxdata.data import HeteroData, read, read_edge_lists, read_ogb
from jaxdata.loader import Loader
from jaxdata.train import attention

TYPES = {"author": 40, "paper": 200, "venue": 4}  # the classified type, paper, comes second
RELATIONS = [("author", "writes", "paper"), ("paper", "cites", "paper"), ("paper", "in", "venue")]


@functools.cache
def user_data() -> HeteroData:
  """Papers in one of 4 venues (their label); each paper cites papers of its venue, and its own
  features are noise, so a model must read the graph."""
  rng = np.random.default_rng(0)
  venue = rng.integers(0, 4, TYPES["paper"])
  same = [rng.choice(np.flatnonzero(venue == venue[p]), 3) for p in range(TYPES["paper"])]
  cites = np.array([(int(q), p) for p in range(TYPES["paper"]) for q in same[p]]).T
  writes = np.stack([rng.integers(0, 40, 300), rng.integers(0, TYPES["paper"], 300)])
  ids = rng.permutation(TYPES["paper"])
  return HeteroData(
    {RELATIONS[0]: writes, RELATIONS[1]: cites, RELATIONS[2]: (np.arange(200), venue)},
    num_nodes=TYPES,
    x={
      "author": rng.standard_normal((40, 3)).astype(np.float32),
      "paper": (0.1 * rng.standard_normal((200, 5))).astype(np.float32),
      "venue": np.eye(4, dtype=np.float32),
    },
    y={"paper": venue.astype(np.int64)},
    train={"paper": np.sort(ids[:120])},
    val={"paper": np.sort(ids[120:160])},
    test={"paper": np.sort(ids[160:])},
  )


def _write_csv(path, rows, header=None):
  path.parent.mkdir(parents=True, exist_ok=True)
  with gzip.open(path, "wt", newline="") as f:
    w = csv.writer(f)
    if header:
      w.writerow(header)
    w.writerows(rows)


def write_ogb(root, data: HeteroData, npy_features: bool = False):
  """`data` in OGB's raw heterogeneous layout (split scheme "random")."""
  raw = root / "raw"
  _write_csv(raw / "num-node-dict.csv.gz", [list(data.num_nodes.values())], list(data.num_nodes))
  _write_csv(raw / "triplet-type-list.csv.gz", [list(k) for k in data.edges])
  for key, index in data.edges.items():
    _write_csv(raw / "relations" / "___".join(key) / "edge.csv.gz", index.T.tolist())
  for t, x in data.x_dict.items():
    path = raw / "node-feat" / t / "node-feat.csv.gz"
    if npy_features:
      path.parent.mkdir(parents=True, exist_ok=True)
      np.save(path.with_name("node-feat.npy"), x)
    else:
      _write_csv(path, x.tolist())
  for t, y in data.y_dict.items():
    _write_csv(raw / "node-label" / t / "node-label.csv.gz", [[v] for v in y.tolist()])
  for s, ogb in (("train", "train"), ("val", "valid"), ("test", "test")):
    for t, ids in data.split(s).items():
      _write_csv(root / "split" / "random" / t / f"{ogb}.csv.gz", [[i] for i in ids.tolist()])


def write_edge_lists(root, data: HeteroData):
  """`data` as a folder of edge lists: CSV for one relation, .npy for the others."""
  (root / "edges").mkdir(parents=True)
  for i, (key, index) in enumerate(data.edges.items()):
    name = root / "edges" / "__".join(key)
    if i == 0:
      name.with_suffix(".csv").write_text("".join(f"{s},{d}\n" for s, d in index.T))
    else:
      np.save(name.with_suffix(".npy"), index.T if i == 1 else index)
  for folder, arrays in (("features", data.x_dict), ("labels", data.y_dict)):
    (root / folder).mkdir()
    for t, a in arrays.items():
      np.save(root / folder / f"{t}.npy", a)
  for s in ("train", "val", "test"):
    for t, ids in data.split(s).items():
      (root / "splits" / t).mkdir(parents=True, exist_ok=True)
      np.save(root / "splits" / t / f"{s}.npy", ids)
  (root / "num_nodes.json").write_text(json.dumps(data.num_nodes))


@pytest.mark.parametrize("npy_features", [False, True])
def test_ogb_layout_reads_back_exactly(tmp_path, npy_features):
  data = user_data()
  write_ogb(tmp_path, data, npy_features)
  got = read_ogb(tmp_path)
  assert got == data and read(tmp_path) == data
  if npy_features:  # memory-mapped, not read into memory
    assert isinstance(got.x_dict["paper"], np.memmap)


def test_homogeneous_ogb_layout(tmp_path):
  rng = np.random.default_rng(1)
  edges, x, y = rng.integers(0, 9, (14, 2)), rng.standard_normal((9, 3)), rng.integers(0, 2, 9)
  raw = tmp_path / "raw"
  _write_csv(raw / "edge.csv.gz", edges.tolist())
  _write_csv(raw / "num-node-list.csv.gz", [[9]])
  _write_csv(raw / "node-feat.csv.gz", x.tolist())
  _write_csv(raw / "node-label.csv.gz", [[float(v)] for v in y[:-1]] + [["nan"]])
  for name, ids in (("train", [0, 1, 2, 3]), ("valid", [4, 5]), ("test", [6, 7])):
    _write_csv(tmp_path / "split" / "time" / f"{name}.csv.gz", [[i] for i in ids])
  got = read_ogb(tmp_path)
  assert got.num_nodes == {"node": 9} and list(got.edges) == [("node", "to", "node")]
  np.testing.assert_array_equal(got.edges[("node", "to", "node")], edges.T)
  np.testing.assert_allclose(got.x_dict["node"], x.astype(np.float32))
  np.testing.assert_array_equal(got.y_dict["node"], np.r_[y[:-1], -1])  # NaN: no label
  np.testing.assert_array_equal(got.split("val")["node"], [4, 5])


def test_edge_list_folder_reads_back_exactly(tmp_path):
  data = user_data()
  write_edge_lists(tmp_path, data)
  assert read_edge_lists(tmp_path) == data and read(tmp_path) == data
  (tmp_path / "num_nodes.json").unlink()  # counts from the features' rows
  assert read(tmp_path).num_nodes == data.num_nodes


def test_parquet_and_row_major_edge_files(tmp_path):
  pa = pytest.importorskip("pyarrow")
  pq = pytest.importorskip("pyarrow.parquet")
  data = user_data()
  write_edge_lists(tmp_path, data)
  (writes, cites, venues), files = data.edges.values(), sorted((tmp_path / "edges").glob("*"))
  for f in files:
    f.unlink()
  stem = lambda i: tmp_path / "edges" / "__".join(list(data.edges)[i])  # noqa: E731
  table = {"dst": pa.array(writes[1]), "src": pa.array(writes[0]), "year": pa.array(writes[0])}
  pq.write_table(pa.table(table), stem(0).with_suffix(".parquet"))  # by name, in any order
  pq.write_table(pa.table({"a": cites[0], "b": cites[1]}), stem(1).with_suffix(".parquet"))
  np.save(stem(2).with_suffix(".npy"), np.asarray(venues).T)  # [E, 2]
  assert read_edge_lists(tmp_path) == data
  pq.write_table(
    pa.table({"a": cites[0].astype(float), "b": cites[1]}), stem(1).with_suffix(".parquet")
  )
  with pytest.raises(ValueError, match=r"cites.*\.parquet.*integer node ids"):
    read_edge_lists(tmp_path)


def test_conversions_are_lossless():
  data = user_data()
  assert HeteroData.from_jraph(data.to_jraph()) == data
  assert HeteroData.from_dgl_dict(data.to_dgl_dict()) == data
  g = data.to_jraph()  # types and names travel in the GraphsTuple itself
  assert list(g.globals["node_types"][0]) == list(TYPES)
  assert g.nodes["type"].tolist() == [0] * 40 + [1] * 200 + [2] * 4


def test_pyg_heterodata_round_trips_exactly():
  torch = pytest.importorskip("torch")
  pyg = pytest.importorskip("torch_geometric.data")
  data = user_data()
  assert HeteroData.from_pyg(data.to_pyg()) == data
  # a HeteroData built with PyG's own API: edge_index tensors, masks, an extra attribute
  theirs = pyg.HeteroData()
  theirs["paper"].x = torch.randn(5, 3)
  theirs["paper"].y = torch.tensor([0, 1, 1, 0, 2])
  theirs["paper"].train_mask = torch.tensor([True, True, False, False, True])
  theirs["paper"].year = torch.arange(2000, 2005)
  theirs["author"].num_nodes = 3
  theirs["author", "writes", "paper"].edge_index = torch.tensor([[0, 2, 2], [4, 0, 1]])
  back = HeteroData.from_pyg(theirs).to_pyg()
  assert set(back.node_types) == set(theirs.node_types)
  assert back.edge_types == theirs.edge_types
  for t in theirs.node_types:
    assert back[t].num_nodes == theirs[t].num_nodes
    for k, v in theirs[t].items():
      if k != "num_nodes":
        assert back[t][k].dtype == v.dtype and torch.equal(back[t][k], v), (t, k)
  for key in theirs.edge_types:
    assert torch.equal(back[key].edge_index, theirs[key].edge_index)


def test_mistakes_name_the_argument_and_type():
  with pytest.raises(ValueError, match=r"x\['paper'\] has 2 rows, node type 'paper' has 3"):
    HeteroData(
      {("a", "r", "paper"): ([0], [2])}, x={"paper": np.zeros((2, 1))}, num_nodes={"paper": 3}
    )
  with pytest.raises(
    ValueError, match=r"edges\[\('a', 'r', 'b'\)\] has destination ids outside \[0, 2\)"
  ):
    HeteroData({("a", "r", "b"): ([0], [5])}, num_nodes={"b": 2})
  with pytest.raises(TypeError, match=r"an edge type is a \(src_type, relation, dst_type\)"):
    HeteroData({("a", "b"): ([0], [1])})
  with pytest.raises(ValueError, match=r"train\['b'\] holds ids outside \[0, 2\)"):
    HeteroData({("a", "r", "b"): ([0], [1])}, train={"b": [3]})
  with pytest.raises(TypeError, match=r"y\['b'\] must be one integer label per node"):
    HeteroData({("a", "r", "b"): ([0], [1])}, y={"b": [0.5, 1.5]})
  with pytest.raises(ValueError, match=r"target 'c' is not a node type"):
    user_data().to_dataset("c")


def test_the_loader_reads_the_container():
  data = user_data()
  with Loader.from_data(data, (3, 3)) as loader:
    seeds = loader.global_ids({"paper": [0, 5]})
    batch = jax.jit(type(loader).sample)(loader, seeds.astype(np.int32), jax.random.key(0))
    assert batch.labels.tolist() == data.y_dict["paper"][[0, 5]].tolist()
    t = list(loader.node_types).index("paper")
    rows = np.asarray(batch.inputs[t])[: len(seeds)]
    np.testing.assert_array_equal(rows, data.x_dict["paper"][[0, 5]])


def test_trains_from_python_with_the_target_reordered_first():
  data = user_data()
  ds = data.to_dataset("paper")
  assert ds.graph.node_type_names == ("paper", "author", "venue") and ds.target == "paper"
  np.testing.assert_array_equal(ds.train_papers, data.split("train")["paper"])
  np.testing.assert_array_equal(ds.features[1], data.x_dict["author"])
  result = attention.train(ds, attention.TrainConfig(model="rgat", epochs=30, hidden=16, heads=2))
  assert result.val_accuracy > 0.8  # 4 venues: chance 0.25


@pytest.mark.parametrize(
  "layout, model", [(write_ogb, ["hgt", "--heads", "2"]), (write_edge_lists, ["rgcn"])]
)
def test_trains_from_the_cli_with_data_and_target(tmp_path, capsys, layout, model):
  layout(tmp_path / "data", user_data())
  out = tmp_path / "out"
  args = ["train", *model, "--data", str(tmp_path / "data"), "--epochs", "30", "--hidden", "16"]
  assert cli.main([*args, "--target", "paper", "--out", str(out)]) == 0
  printed = capsys.readouterr().out
  assert "classifying paper" in printed and "40 test paper" in printed
  accuracy = float(re.search(r"validation accuracy ([0-9.]+)", printed).group(1))
  assert accuracy > 0.8
  assert cli.main(["eval", str(out)]) == 0  # the checkpoint finds its data again
  assert f"{accuracy:.4f}" in capsys.readouterr().out
  assert cli.main([*args, "--target", "venue"]) == 2  # venues have no labels
  assert "argument --data: " in capsys.readouterr().err
