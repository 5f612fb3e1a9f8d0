"""`jaxdata bench hetero` (examples/benchmarks/hetero.py) and its NumPy NeighborLoader stand-in
(examples/benchmarks/pyg_sampler.py), at a tiny scale on the CPU."""

import collections
import importlib.util
import logging

import jax
import numpy as np
import pytest
from bench_checks import breakdown_cells

from benchmarks import common, hetero, pyg_sampler
from jaxdata import cli
from jaxdata.data import synthetic_mag

# Its tests take 5 s to minutes each: the fast tier (-m "not slow") leaves this file out.
pytestmark = pytest.mark.slow

HAS_PYG = importlib.util.find_spec("torch_geometric") is not None
TINY = dict(
  scale=0.002, batch_size=32, batches=2, warmup=1, fanouts=(4, 3), classes=8, hidden=16, heads=2
)


class _Compiles(logging.Handler):
  def __init__(self):
    super().__init__(logging.DEBUG)
    self.steps = 0

  def emit(self, record):
    self.steps += record.getMessage().startswith("Compiling jit(step)")


@pytest.fixture(scope="module")
def tiny_run():
  """The run, and how many times a training step was compiled during it."""
  handler, logger = _Compiles(), logging.getLogger("jax")
  logger.addHandler(handler)
  try:
    with jax.log_compiles(True):
      out = hetero.run(model="hgt", **TINY)
  finally:
    logger.removeHandler(handler)
  return out + (handler.steps,)


def _by_name(results):
  return {r.name: r for r in results}


def test_every_pipeline_runs_and_reports_time_loss_and_edges(tiny_run):
  results, link, notes, _, _ = tiny_run
  got = _by_name(results)
  assert list(got) == list(hetero.PIPELINES)
  ran = ["host", "host-cache", "device", "cpu"] + (["pyg"] if HAS_PYG else [])
  for name in ran:
    r = got[name]
    assert r.batch_ms is not None and r.batch_ms > 0, (name, r.note)
    assert r.epoch_seconds > 0 and r.seeds_per_second > 0
    assert np.isfinite(r.loss) and len(r.losses) == TINY["batches"]
    assert r.edges_per_batch > 0
  if not HAS_PYG:
    assert got["pyg"].batch_ms is None and "torch_geometric" in got["pyg"].note
  assert link is not None and link.feature_bytes > 0 and link.memcpy_gbps > 0
  assert link.feature_bytes == got["host"].feature_bytes
  assert not [n for n in notes if "failed" in n], notes


def test_jaxdata_pipelines_see_the_same_samples_and_train_to_the_same_losses(tiny_run):
  got = _by_name(tiny_run[0])
  host = got["host"]
  for name in ("host-cache", "device", "cpu"):
    np.testing.assert_allclose(got[name].losses, host.losses, rtol=1e-5, atol=1e-6, err_msg=name)
    assert got[name].edges_per_batch == host.edges_per_batch
    if name != "host-cache":
      assert got[name].feature_bytes == host.feature_bytes
  # the cache holds rows the batches read: fewer bytes cross from host memory
  assert 0 < got["host-cache"].feature_bytes < host.feature_bytes
  # the second timed batch follows an update: losses differ from batch to batch
  assert host.losses[0] != host.losses[1]


def test_link_bound_counts_the_gathered_rows_of_the_outermost_frontier():
  """The bytes `batch_stats` reports are those of the rows gather_typed reads, counted here
  from the sample itself with NumPy."""
  from jaxdata.loader.blocks import sample_blocks  # pylint: disable=g-import-not-at-top
  from jaxdata.train.attention.minibatch import make_loader  # pylint: disable=g-import-not-at-top

  ds = synthetic_mag(scale=0.002, num_classes=8)
  row_bytes = [x.shape[1] * 4 for x in ds.features]
  seeds = np.asarray(ds.train_papers[:16], np.int32)
  key = jax.random.key(3)
  with make_loader(ds, "host", (4, 3)) as data:
    blocks = sample_blocks(data.graph, seeds, (4, 3), key, num_relations=data.num_relations)
    edges, nbytes = hetero.batch_stats(blocks, data.type_offsets, row_bytes)
    nodes = np.asarray(blocks.nodes[-1])
    offsets = np.asarray(data.type_offsets)
  nodes = nodes[nodes >= 0]
  types = np.searchsorted(offsets, nodes, side="right") - 1
  assert float(nbytes) == sum(row_bytes[t] for t in types)
  assert len(set(nodes.tolist())) == len(nodes)
  assert int(edges) == sum(int((np.asarray(g.norm) > 0).sum()) for g in blocks.graphs)
  assert 0 < int(edges) <= 16 * 4 + 16 * 5 * 3


def test_each_jaxdata_step_compiles_once_so_the_timed_batches_compile_nothing(tiny_run):
  # host, host-cache, device, cpu: one each (a second would be timed)
  assert tiny_run[-1] == 4


def test_markdown_states_command_hardware_rows_and_the_link_bound(tiny_run, tmp_path):
  results, link, notes, dataset, _ = tiny_run
  text = hetero.markdown(
    results,
    link,
    notes,
    dataset,
    "jaxdata bench hetero --quick",
    model="hgt",
    fanouts=TINY["fanouts"],
    batch_size=TINY["batch_size"],
    batches=TINY["batches"],
    warmup=TINY["warmup"],
    hidden=16,
    heads=2,
  )
  for want in (
    "Command: `jaxdata bench hetero --quick`",
    "- device: ",
    "- software: jax ",
    "- date: ",
    "GPU-centric (jaxdata)",
    "all-in-GPU (jaxdata)",
    "CPU-centric",
    "PyG",
    "NeighborLoader",
    "extrapolated",
    "link bound",
    "x the bound",
    "Link bound: ",
  ):
    assert want in text, want
  table = text.split("## The bars")[0]
  table = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
  assert len(table) == 1 + len(hetero.PIPELINES) + 1  # header, pipelines, link bound
  assert "GPU-centric step within 1.3x of its link-bound time" in text


def test_bars_are_judged_from_the_measured_ratios():
  R = hetero.Result
  results = [
    R("host", "g", batch_ms=10.0, epoch_seconds=1.0),
    R("cpu", "c", batch_ms=60.0, epoch_seconds=6.0),
    R("pyg", "p", batch_ms=40.0, epoch_seconds=4.0),
  ]
  link = hetero.LinkBound(feature_bytes=8e8, memcpy_gbps=100.0, copy_bytes=1)  # 8 ms
  _, rows = hetero.bars(results, link)
  assert [r[2] for r in rows] == ["**not met**", "met", "met"]
  assert rows[0][1] == "4.00x" and rows[1][1] == "6.00x" and rows[2][1].endswith("1.25x")
  _, rows = hetero.bars(results[:1], None)
  assert [r[2] for r in rows] == ["open", "open", "open"]


def test_cli_writes_the_page_and_a_skipped_pipeline_is_a_row_not_a_crash(
  tmp_path, capsys, monkeypatch
):
  monkeypatch.setattr(hetero, "_fits_on_device", lambda ds: "pretend it is too large")
  out = tmp_path / "hetero.md"
  code = cli.main(
    [
      "bench",
      "hetero",
      "--quick",
      "--scale",
      "0.002",
      "--batch-size",
      "16",
      "--batches",
      "1",
      "--warmup",
      "0",
      "--fanouts",
      "3,2",
      "--hidden",
      "8",
      "--heads",
      "2",
      "--model",
      "rgat",
      "--pipelines",
      "host,device",
      "--breakdown",
      "--out",
      str(out),
    ]
  )
  assert code == 0
  text = out.read_text()
  assert "# Mini-batch RGAT" in text and "RGATConv" in text
  assert "skipped: pretend it is too large" in text
  assert "GPU-centric (jaxdata) | " in text
  # the step's device time by part (on the CPU: XLA's operations), then busy, steady and idle
  cells = breakdown_cells(text)
  assert cells["sampling"] > 0 and cells["forward"] > 0
  assert cells["backward"] > 0 and cells["optimizer (Adam)"] > 0


def test_part_of_attributes_op_names_by_scope_then_pass():
  assert common.part_of("jit(step)/jvp()/sampling/jit(sort)/sort") == "sampling"
  assert common.part_of("jit(step)/jvp(blocks)/cummax") == "block building"
  assert common.part_of("jit(step)/transpose(jvp(gathers))/mul") == "feature gathers"
  assert common.part_of("jit(step)/optimizer/add") == "optimizer (Adam)"
  assert common.part_of("jit(step)/transpose(jvp(HGT))/dot_general") == "backward"
  assert common.part_of("jit(step)/jvp(HGT)/dot_general") == "forward"
  assert common.part_of("jit(step)/jvp()/my_blocks/add") == "forward"  # a scope is a whole name
  assert common.part_of("") == "copies and memsets"


def test_cli_rejects_three_fanouts(capsys):
  assert cli.main(["bench", "hetero", "--fanouts", "3,2,2"]) == 2
  assert "--fanouts" in capsys.readouterr().err


def test_prefetched_yields_in_order_and_reraises_the_producers_error():
  assert list(hetero.prefetched(iter(range(7)), depth=2)) == list(range(7))

  def failing():
    yield 1
    raise RuntimeError("boom")

  it = hetero.prefetched(failing())
  assert next(it) == 1
  with pytest.raises(RuntimeError, match="boom"):
    next(it)


# ----------------------------------------------------------------------------- the sampler
@pytest.fixture(scope="module")
def mag():
  return synthetic_mag(scale=1e-3, seed=1, num_classes=8)


def _graph_edges(ds):
  g = ds.graph
  return collections.Counter(
    zip(np.asarray(g.src).tolist(), np.asarray(g.dst).tolist(), np.asarray(g.etype).tolist())
  )


def _in_degree(ds, relation: int) -> collections.Counter:
  g = ds.graph
  mine = np.asarray(g.etype) == relation
  return collections.Counter(np.asarray(g.dst)[mine].tolist())


@pytest.mark.parametrize("fanouts", [(3, 2), (1, 1), (50, 50)])
def test_sampler_does_what_neighborloader_does(mag, fanouts):
  sampler = pyg_sampler.HeteroNeighborSampler(mag)
  offsets = np.asarray(mag.graph.node_type_offsets)
  types = list(mag.graph.node_type_names)
  rels = [tuple(r) for r in mag.relation_types]
  seeds = np.asarray(mag.train_papers[:40])
  batch = sampler.sample(seeds, fanouts, np.random.default_rng(0))

  # nodes: distinct per type, the seeds first, rounds add up
  paper = types.index("paper")
  np.testing.assert_array_equal(batch.node_ids[paper][: len(seeds)], seeds)
  for t, ids in enumerate(batch.node_ids):
    assert len(np.unique(ids)) == len(ids)
    assert sum(batch.num_sampled_nodes[t]) == len(ids)
    assert len(batch.num_sampled_nodes[t]) == len(fanouts) + 1
  assert batch.batch_size == len(seeds)

  # every sampled edge is an edge of the graph with its relation; draws are distinct edges
  edges = _graph_edges(mag)
  drawn = collections.Counter()  # (dst global, relation) -> edges drawn
  for r, (st, _, dt) in enumerate(rels):
    s, d = types.index(st), types.index(dt)
    src_pos, dst_pos = batch.edges[r]
    src = batch.node_ids[s][src_pos] + offsets[s]
    dst = batch.node_ids[d][dst_pos] + offsets[d]
    used = collections.Counter(zip(src.tolist(), dst.tolist()))
    for (a, b), k in used.items():
      assert edges[(a, b, r)] >= k, (
        f"edge {a}->{b} of relation {r} drawn {k}x, graph has {edges[(a, b, r)]}"
      )
    assert len(np.unique(batch.edge_ids[r])) == len(batch.edge_ids[r])  # no edge twice
    drawn.update((int(v), r) for v in dst.tolist())

  # fanout per node, per edge type, per hop: all in-edges when there are at most fanout,
  # exactly fanout otherwise; nodes of the last round are not sampled
  for t, name in enumerate(types):
    bounds = np.cumsum([0] + batch.num_sampled_nodes[t])
    for hop in range(len(fanouts) + 1):
      for v in batch.node_ids[t][bounds[hop] : bounds[hop + 1]] + offsets[t]:
        for r, rel in enumerate(rels):
          if rel[2] != name:
            continue
          deg = _in_degree(mag, r)[int(v)]
          want = 0 if hop == len(fanouts) else min(deg, fanouts[hop])
          assert drawn[(int(v), r)] == want, (name, int(v), rel, hop, deg)


def test_sampler_draws_uniformly_without_replacement(mag):
  sampler = pyg_sampler.HeteroNeighborSampler(mag)
  r = [tuple(x)[1] for x in mag.relation_types].index("rev_has_topic")
  indptr, _ = sampler.csc[r]
  degree = np.diff(indptr)
  v = int(np.flatnonzero(degree >= 6)[0])  # a paper with at least 6 topics
  n, fanout, trials = int(degree[v]), 3, 4000
  rng = np.random.default_rng(0)
  counts = np.zeros(n)
  for _ in range(trials):
    e_ids, which = sampler.draw(r, np.array([v]), fanout, rng)
    assert len(e_ids) == fanout and len(np.unique(e_ids)) == fanout
    assert (which == 0).all()
    counts += np.bincount(e_ids - indptr[v], minlength=n)
  expected = trials * fanout / n
  assert np.all(np.abs(counts - expected) < 5 * np.sqrt(expected)), (counts, expected)


def test_sampler_leaves_no_state_between_batches(mag):
  sampler = pyg_sampler.HeteroNeighborSampler(mag)
  seeds = np.asarray(mag.train_papers[:20])
  first = sampler.sample(seeds, (3, 2), np.random.default_rng(5))
  sampler.sample(np.asarray(mag.train_papers[20:60]), (3, 2), np.random.default_rng(6))
  again = sampler.sample(seeds, (3, 2), np.random.default_rng(5))
  for a, b in zip(first.node_ids, again.node_ids):
    np.testing.assert_array_equal(a, b)
  assert all((p == -1).all() for p in sampler._pos)  # pylint: disable=protected-access


@pytest.mark.parametrize("kind", ["hgt", "rgat"])
def test_pyg_model_trains_on_the_sampled_heterodata(mag, kind):
  torch = pytest.importorskip("torch")
  pytest.importorskip("torch_geometric")
  sampler = pyg_sampler.HeteroNeighborSampler(mag)
  batch = sampler.sample(np.asarray(mag.train_papers[:24]), (3, 2), np.random.default_rng(0))
  data = pyg_sampler.hetero_data(batch, mag)
  assert data["paper"].batch_size == 24
  for t, name in enumerate(mag.graph.node_type_names):
    np.testing.assert_array_equal(data[name].x.numpy(), mag.features[t][batch.node_ids[t]])
  model = pyg_sampler.pyg_model(kind, mag, hidden=16, heads=2)
  logits = model(data.x_dict, data.edge_index_dict)
  assert logits.shape == (len(batch.node_ids[0]), mag.num_classes)
  loss = torch.nn.functional.cross_entropy(logits[:24], data["paper"].y)
  loss.backward()
  assert torch.isfinite(loss)
  assert float(model.classify.weight.grad.abs().sum()) > 0
  # gradients reach the first layer (some PyG parameters are unused by design: HGTConv's
  # skip gate of a type whose width changes, RGATConv's other attention modes)
  first = model.conv1 if kind == "hgt" else model.convs[0]
  assert any(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in first.parameters())
