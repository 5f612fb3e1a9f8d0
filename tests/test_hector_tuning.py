"""jaxdata.hector.tuning: the tilings of the tensor-core kernels, their choice files, and (on a
GPU) the launcher's timing of them on a call's own operands."""

import concurrent.futures
import os
import pathlib
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from isolation import run_isolated

from jaxdata import hector
from jaxdata.data import HeteroGraph
from jaxdata.hector import codegen, compiler, tuning
from jaxdata.hector.codegen import cuda
from jaxdata.hector.lowering import Dense, Gemm, WeightGrad


def random_graph(rng, n=300, e=6000, r=9):
  return HeteroGraph.from_edges(
    rng.integers(0, n, e), rng.integers(0, n, e), rng.integers(0, r, e), num_nodes=n
  )


def instances(layer, ga, dtype, dim, heads=None):
  """[head, source] of every CUDA kernel of `layer`'s plan at precision "default", in every
  tiling."""
  n, r = ga.num_nodes, ga.num_relations
  if heads is None:
    inputs = dict(x=jnp.zeros((n, dim), dtype), W=jnp.zeros((r, dim, dim), dtype))
  else:
    hd = dim // heads
    inputs = dict(
      x=jnp.zeros((n, dim), dtype),
      W=jnp.zeros((r, dim, dim), dtype),
      a_src=jnp.zeros((r, heads, hd), dtype),
      a_dst=jnp.zeros((r, heads, hd), dtype),
    )
  text = layer.sources(ga, "cuda", precision="default", tilings=True, **inputs)
  return [p.split("\n", 1) for p in text.split("// ---- ")[1:]]


def test_tensor_core_instances_have_tilings_with_the_default_first():
  """A tensor-core GEMM or weight gradient of 128 columns: 128 and 64 columns per block, each
  without and with a register cap; CUDA-core kernels: one way. The first tiling is what
  `generate` emits when none is given; each launches the threads and blocks its columns need."""
  rng = np.random.default_rng(0)
  ga = hector.GraphArrays.from_graph(random_graph(rng))
  plan = hector.rgcn_layer.plan(
    ga,
    x=jnp.zeros((ga.num_nodes, 128), jnp.bfloat16),
    W=jnp.zeros((ga.num_relations, 128, 128), jnp.bfloat16),
  )
  found = [
    i
    for i in plan.forward_kernels + plan.backward_kernels
    if isinstance(i.kernel, (Gemm, WeightGrad))
  ]
  assert len(found) == 3  # forward GEMM, backward GEMM, weight gradient
  for inst in found:
    k, dtypes = inst.kernel, ("bfloat16",) * len(inst.inputs)
    kind = codegen.math(k, dtypes)  # "tf32" for the weight gradient: its rows are scaled
    assert kind in ("bf16", "tf32") and cuda.tilings(k, "fma") == [None]
    tiles = cuda.tilings(k, kind)
    assert [(t.columns, t.min_blocks) for t in tiles] == [(128, 0), (128, 4), (64, 0), (64, 8)]
    default = codegen.generate(k, dtypes, "cuda")
    assert default == codegen.generate(k, dtypes, "cuda", tile=tiles[0])
    others = {codegen.generate(k, dtypes, "cuda", tile=t) for t in tiles[1:]}
    assert len(others) == 3 and default not in others
    for t in tiles:
      blocks, threads = codegen.launch(k, 10, 640, 300, kind, t)
      assert threads == (256 if t.columns == 128 else 128)
      rows_blocks = 2 if isinstance(k, WeightGrad) else 1  # dW's 128 rows in blocks of 64
      assert blocks == 10 * rows_blocks * (128 // t.columns)
      bounds = re.search(
        r"__launch_bounds__\(([^)]*)\)", codegen.generate(k, dtypes, "cuda", tile=t)
      ).group(1)
      assert bounds == (f"{threads}, {t.min_blocks}" if t.min_blocks else str(threads))
      assert t.min_blocks in (0, cuda.MMA_RESIDENT_THREADS // threads)


def test_every_kernel_of_rgat_launches_in_each_of_its_tilings():
  """`codegen.launch` in every tiling of every kernel of RGAT's plan (traversals, thin GEMMs
  and the edge softmax included): a grid and a block the launcher accepts."""
  rng = np.random.default_rng(2)
  ga = hector.GraphArrays.from_graph(random_graph(rng))
  n, r = ga.num_nodes, ga.num_relations
  plan = hector.rgat_layer.plan(
    ga,
    x=jnp.zeros((n, 64), jnp.bfloat16),
    W=jnp.zeros((r, 64, 64), jnp.bfloat16),
    a_src=jnp.zeros((r, 4, 16), jnp.bfloat16),
    a_dst=jnp.zeros((r, 4, 16), jnp.bfloat16),
  )
  kinds = set()
  for inst in plan.forward_kernels + plan.backward_kernels:
    if isinstance(inst.kernel, Dense):
      continue  # run by XLA
    kind = codegen.math(inst.kernel, ("bfloat16",) * len(inst.inputs))
    kinds.add(kind)
    for t in cuda.tilings(inst.kernel, kind):
      blocks, threads = codegen.launch(inst.kernel, 10, 6000, n, kind, t)
      assert blocks > 0 and 0 < threads <= 1024 and threads % 32 == 0, inst.kernel
  assert kinds == {"fma", "bf16"}


def test_choice_files_key_the_instance_gpu_rows_skew_and_tilings(tmp_path, monkeypatch):
  monkeypatch.setenv("JAXDATA_CACHE_DIR", str(tmp_path))
  tiles = [cuda.Tile(128), cuda.Tile(64)]
  src = "// label %1\nkernel text"
  path = tuning.choice_file(src, 90, 2_000_000, tiles)
  assert path.parent == compiler.cache_dir() and path.suffix == ".tune"
  # the label line (IR value ids) is not part of the key; rows in the same power of two are one
  assert tuning.choice_file("// label %7\nkernel text", 90, 1_600_000, tiles) == path
  for other in (
    tuning.choice_file(src, 80, 2_000_000, tiles),
    tuning.choice_file(src, 90, 200_000, tiles),
    tuning.choice_file(src, 90, 2_000_000, tiles[:1]),
    tuning.choice_file("// label %1\nother kernel", 90, 2_000_000, tiles),
    tuning.choice_file(src, 90, 2_000_000, tiles, pairs=300_000),  # hub sources: 6.7 per pair
  ):
    assert other != path
  # a uniform graph's edges are about one per pair: the same choice as no pair count
  assert tuning.choice_file(src, 90, 2_000_000, tiles, pairs=1_740_000) == path


def test_read_choice_trusts_only_a_whole_file_for_the_same_tilings(tmp_path):
  path = tmp_path / "k.tune"
  assert tuning.read_choice(path, 4) is None  # none yet
  good = f"{tuning.HEADER}\nchoice 2\ntimes_us 310.5 inf 201.25 288.0\n"
  path.write_text(good)
  assert tuning.read_choice(path, 4) == tuning.Choice(2, (310.5, float("inf"), 201.25, 288.0))
  bad = [
    good.replace("1\n", "2\n", 1),  # another format version
    good[: len(good) // 2],  # torn
    good.replace("choice 2", "choice 4"),  # out of range
    good.replace("choice 2", "choice 0"),  # not the fastest
    good.replace("201.25", "inf").replace("310.5", "inf").replace("288.0", "inf"),
    good.replace("times_us 310.5 ", "times_us "),  # three times for four tilings
    good.replace("201.25", "fast"),
    "\x00\xff binary",
  ]
  for text in bad:
    path.write_text(text)
    assert tuning.read_choice(path, 4) is None, text
  path.write_bytes(b"\xff\xfe\x00")
  assert tuning.read_choice(path, 4) is None


@pytest.mark.skipif(
  shutil.which("nvcc") is None and compiler.nvrtc() is None, reason="neither nvcc nor NVRTC here"
)
def test_every_tiling_compiles(tmp_path, monkeypatch):
  """Each tiling of RGCN's (bfloat16, dim 128) and RGAT's (TF32, 4 heads, dim 64) tensor-core
  kernels compiles for sm_90 (checked without a GPU, in CI)."""
  monkeypatch.setenv("JAXDATA_CACHE_DIR", str(tmp_path))
  rng = np.random.default_rng(1)
  ga = hector.GraphArrays.from_graph(random_graph(rng, n=40, e=300, r=5))
  parts = instances(hector.rgcn_layer, ga, jnp.bfloat16, 128) + instances(
    hector.rgat_layer, ga, jnp.float32, 64, heads=4
  )
  tiled = [body for head, body in parts if re.search(r"\(\d+ columns", head)]
  assert len(tiled) == 3 * 4 + 3 * 4 + 2 * 2  # RGAT's 4-column ones: 16 columns, 2 tilings
  with concurrent.futures.ThreadPoolExecutor(os.cpu_count()) as pool:
    for path in pool.map(lambda s: compiler.compile_cuda(s, 90), tiled):
      assert path.stat().st_size > 0


def _tune_files(lowered_text: str) -> list[str]:
  return re.findall(r'tune_file = "([^"]*)"', lowered_text)


def _targets(lowered_text: str) -> list[str]:
  """The FFI target of every hector call, in the order of `_tune_files`."""
  return re.findall(r"custom_call @(jaxdata_hector_\w+)", lowered_text)


def _check_targets(lowered_text: str) -> None:
  """A call that tunes goes to jaxdata_hector_tune (kept out of XLA's CUDA graphs: its first
  run times the tilings), every other to jaxdata_hector_launch (command-buffer compatible)."""
  want = [
    "jaxdata_hector_tune" if f else "jaxdata_hector_launch" for f in _tune_files(lowered_text)
  ]
  assert want and _targets(lowered_text) == want


@pytest.mark.gpu
@pytest.mark.default_precision
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_first_run_times_every_tiling_records_the_fastest_and_computes_the_same(
  device, dtype, tmp_path, monkeypatch
):
  """RGCN forward + backward at dim 128 on tensor cores (bf16; TF32): lowered with an empty
  cache, each of its 3 tensor-core kernels carries its 4 tilings and a choice file; the first
  run writes each file with a finite time for every tiling and the fastest chosen, and gives
  what the default tiling gives (untuned, JAXDATA_HECTOR_AUTOTUNE=0); lowered again, each
  kernel launches only its recorded tiling; a corrupt file is tuned anew, not trusted."""
  if device.platform != "gpu":
    pytest.skip("tuning times CUDA kernels")
  monkeypatch.setenv("JAXDATA_CACHE_DIR", str(tmp_path))
  rng = np.random.default_rng(3)
  g = random_graph(rng, n=3000, e=120_000, r=45)  # 1.5 edges per pair: fused
  ga = hector.GraphArrays.from_graph(g)
  x = jnp.asarray(rng.standard_normal((g.num_nodes, 128)), dtype)
  w = jnp.asarray(rng.standard_normal((g.num_relations, 128, 128)) / 11, dtype)
  ct = jnp.asarray(rng.standard_normal((g.num_nodes, 128)), jnp.float32)

  def step():  # a new function each time: lowered anew
    def loss(x, w):
      return jnp.vdot(hector.rgcn_message(ga, x, w).astype(jnp.float32), ct)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

  monkeypatch.setenv(tuning.AUTOTUNE_ENV, "0")
  untuned = step()
  assert _tune_files(untuned.lower(x, w).as_text()) == ["", "", ""]
  _check_targets(untuned.lower(x, w).as_text())
  want = jax.block_until_ready(untuned(x, w))
  monkeypatch.setenv(tuning.AUTOTUNE_ENV, "1")
  tuned = step()
  before = tuning.tuning_lowerings()
  files = _tune_files(tuned.lower(x, w).as_text())
  assert len(files) == 3 and all(files) and len(set(files)) == 3
  assert tuning.tuning_lowerings() - before == 3  # what `bench rgnn` reads (Compiled.tunes)
  _check_targets(tuned.lower(x, w).as_text())
  assert not any(os.path.exists(f) for f in files)
  got = jax.block_until_ready(tuned(x, w))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    # float32 sums in another order; a bfloat16 gradient (dx) may round to the next value
    rtol = 2.0**-7 if a.dtype == jnp.bfloat16 else 0.0
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    np.testing.assert_allclose(a, b, rtol=rtol, atol=2e-5 * np.abs(b).max())
  for f in files:
    choice = tuning.read_choice(pathlib.Path(f), 4)
    assert choice is not None and all(np.isfinite(choice.times_us)), open(f).read()
    assert min(choice.times_us) > 0
  before = tuning.tuning_lowerings()
  assert _tune_files(step().lower(x, w).as_text()) == ["", "", ""]  # read, not tuned again
  assert tuning.tuning_lowerings() == before
  pathlib.Path(files[1]).write_text("jaxdata-hector-tune 1\nchoice 9\n")
  again = _tune_files(step().lower(x, w).as_text())
  assert sorted(again) == sorted(["", "", files[1]])


def _rgcn_step_in_cuda_graphs() -> dict:
  """(Run in a fresh process whose XLA makes a CUDA graph of any run of commands, with an empty
  kernel cache.) RGCN forward + backward at dim 128 on bfloat16 tensor cores: lowered first
  with its three tensor-core calls tuning and run once on each of two inputs; then lowered
  again (the choices recorded: plain launches) and run 4 times on each input. Returns the
  targets of both lowerings, the launcher's (direct, captured) counts around the second
  executable's runs, and the largest difference of its results from the first executable's."""
  from jaxdata import _xla_ffi as ext

  rng = np.random.default_rng(4)
  g = random_graph(rng, n=3000, e=120_000, r=45)  # 1.5 edges per pair: fused
  ga = hector.GraphArrays.from_graph(g)
  xs = [jnp.asarray(rng.standard_normal((g.num_nodes, 128)), jnp.bfloat16) for _ in range(2)]
  w = jnp.asarray(rng.standard_normal((g.num_relations, 128, 128)) / 11, jnp.bfloat16)
  ct = jnp.asarray(rng.standard_normal((g.num_nodes, 128)), jnp.float32)

  def step():  # a new function each time: lowered anew
    def loss(x, w):
      return jnp.vdot(hector.rgcn_message(ga, x, w).astype(jnp.float32), ct)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

  def run(f, x):
    return [np.asarray(a, np.float64) for a in jax.tree.leaves(jax.block_until_ready(f(x, w)))]

  first = step()
  first_text = first.lower(xs[0], w).as_text()
  want = [run(first, x) for x in xs]
  second = step()
  second_text = second.lower(xs[0], w).as_text()
  before = ext.hector_launch_counts()
  worst = 0.0
  for i, x in enumerate(xs):
    for _ in range(4):  # a graph that dropped its memsets would sum into the last run's output
      for a, b in zip(run(second, x), want[i]):
        worst = max(worst, float(np.max(np.abs(a - b)) / np.max(np.abs(b))))
  after = ext.hector_launch_counts()
  return dict(
    first=_targets(first_text),
    second=_targets(second_text),
    second_tunes=_tune_files(second_text),
    before=before,
    after=after,
    worst=worst,
  )


@pytest.mark.gpu
@pytest.mark.default_precision
def test_launches_join_xlas_cuda_graphs_and_replay_correctly(device, tmp_path):
  """XLA records jaxdata_hector_launch into its CUDA graphs (command buffers) and replays it
  without calling the handler; the calls that tune stay outside until their choice is recorded.
  Over 8 runs of the second executable the handler runs directly at most once per call (XLA's
  warm-up run), is captured at least once per call, and in all fewer than 8 times per call
  (replays); every run gives the first executable's results (zeroed outputs are zeroed again
  on every replay)."""
  if device.platform != "gpu":
    pytest.skip("CUDA graphs are a GPU feature")
  got = run_isolated(
    _rgcn_step_in_cuda_graphs,
    timeout=600,
    env={"XLA_FLAGS": "--xla_gpu_graph_min_graph_size=1", "JAXDATA_CACHE_DIR": str(tmp_path)},
  )
  assert got["first"].count("jaxdata_hector_tune") == 3, got
  assert set(got["second"]) == {"jaxdata_hector_launch"} and not any(got["second_tunes"]), got
  calls = len(got["second"])
  direct = got["after"][0] - got["before"][0]
  captured = got["after"][1] - got["before"][1]
  assert direct <= calls and captured >= calls and direct + captured < 8 * calls, got
  assert got["worst"] <= 2.0**-7, got  # bfloat16 outputs; float32 sums in another order
