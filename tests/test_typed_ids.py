"""Ids, counts, relation names and fanouts of typed graphs keep their meaning or are refused.

Every id is checked in the dtype the caller gave, before a cast could wrap it into another
node; a relation name names one relation; a count is reported as given; a fanout too large for
the kernels is a Python error, not an abort. Tiny graphs, no training.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdata.data.graph import HeteroGraph
from jaxdata.hector.block import block_graph, edges_numpy, frontier
from jaxdata.host.graph import HostGraph
from jaxdata.host.sample import DeviceGraph, sample_neighbors
from jaxdata.loader.blocks import gather_typed, node_types, sample_blocks

KEY = jax.random.key(0)


def _no_x64():
  return jax.enable_x64(False) if hasattr(jax, "enable_x64") else jax.experimental.disable_x64()


@pytest.fixture
def typed():
  with HostGraph.from_edges([0, 1, 2, 3], [1, 2, 3, 0], 4, etypes=[0, 1, 0, 1]) as g:
    yield g


# -- seeds ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("wrap", [np.array, jnp.array])
def test_sample_blocks_refuses_a_seed_past_int32_as_sample_neighbors_does(typed, wrap):
  seeds = wrap(np.array([1, 2**32 + 2], np.int64))  # int32 would make it node 2
  for sample in (sample_neighbors, sample_blocks):
    with pytest.raises(ValueError, match=f"{sample.__name__}: seed 4294967298 is outside"):
      sample(typed, seeds, (2,), KEY)


def test_sample_blocks_under_jit_pads_a_seed_past_int32(typed):
  sample = jax.jit(lambda s: sample_blocks(typed, s, (2,), KEY))
  blocks = sample(jnp.array([1, 2**32 + 2, -(2**32) + 3], jnp.int64))
  np.testing.assert_array_equal(blocks.nodes[0], [1, -1, -1, -1])
  np.testing.assert_array_equal(blocks.masks[0], [True, False, False, False])


@pytest.mark.parametrize("x64", [True, False])
def test_frontier_pads_64_bit_seeds_outside_int32(x64):
  seeds = np.array([3, 2**32 + 1, -(2**32) + 2, 2**31], np.int64)
  with _no_x64() if not x64 else jax.enable_x64(True):
    nodes, mask = frontier(seeds)
    np.testing.assert_array_equal(nodes, [3, -1, -1, -1, -1])
    np.testing.assert_array_equal(mask, [True, False, False, False, False])
    if x64:
      nodes, _ = jax.jit(frontier)(jnp.asarray(seeds))
      np.testing.assert_array_equal(nodes, [3, -1, -1, -1, -1])


# -- counts and names -----------------------------------------------------------------------------


@pytest.mark.parametrize("num_relations", [6.9, 2.0, True, "2"])
def test_a_relation_count_that_is_not_an_int_is_refused(typed, num_relations):
  with pytest.raises(TypeError, match="sample_blocks: num_relations must be an int"):
    sample_blocks(typed, np.array([1]), (2,), KEY, num_relations=num_relations)
  z = jnp.zeros(2, jnp.int32)
  with pytest.raises(TypeError, match="block_graph: num_relations must be an int"):
    block_graph(z, z, z, z > 0, num_nodes=3, num_relations=num_relations)


def test_fewer_relations_than_the_graph_has_are_refused(typed):
  with pytest.raises(ValueError, match="num_relations must be >= 1 and >= the graph's 2, got 1"):
    sample_blocks(typed, np.array([1]), (2,), KEY, num_relations=1)


def test_a_generated_inverse_may_not_take_a_given_relation_name():
  edges = {("a", "r", "b"): ([0], [0]), ("b", "rev_r", "a"): ([0], [0])}
  with pytest.raises(ValueError, match="generated inverse of \\('a', 'r', 'b'\\) would be named"):
    HeteroGraph.from_typed_edges(edges, {"a": 1, "b": 1})
  g = HeteroGraph.from_typed_edges(edges, {"a": 1, "b": 1}, add_inverse=False)
  assert g.relation_names == ("r", "rev_r")
  with pytest.raises(ValueError, match="inverse of relation 'r' 'rev_r'"):
    HeteroGraph.from_edges([0], [1], [0], relation_names=("r", "rev_r"), add_inverse=True)
  with pytest.raises(ValueError, match="'r' is used by two relations"):
    HeteroGraph.from_edges([0], [1], [0], relation_names=("r", "r"))


@pytest.mark.parametrize(
  "counts,total",
  [
    ({"a": 2**62, "b": 2**62}, 2**63),
    ({"a": 2**63 + 5}, 2**63 + 5),
    ({"a": np.uint64(2**64 - 1), "b": 1}, 2**64),
  ],
)
def test_node_counts_past_int64_are_reported_as_given(counts, total):
  with pytest.raises(ValueError, match=f"at most 2\\*\\*31 - 1 nodes in all, got {total}$"):
    HeteroGraph.from_typed_edges({}, counts)


def test_uint64_ids_past_int64_are_reported_as_given():
  big = np.array([0, 2**64 - 1], np.uint64)  # an int64 cast would make it -1
  with pytest.raises(ValueError, match="src: value 18446744073709551615 does not fit int64"):
    HeteroGraph.from_edges(big, np.array([0, 1]), np.array([0, 0]), num_nodes=2)
  with pytest.raises(ValueError, match="value 18446744073709551615 does not fit int64"):
    HeteroGraph.from_typed_edges({("a", "r", "a"): (big, [0, 1])}, {"a": 2})


# -- fanouts --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "fanouts,error,match",
  [
    (2.5, TypeError, "fanouts must be an int or a sequence of ints, got 2.5"),
    (None, TypeError, "fanouts must be an int or a sequence of ints, got None"),
    ("2", TypeError, "fanouts must be an int or a sequence of ints"),
    ((2, 2.5), TypeError, "fanouts must be Python ints, got 2.5"),
    ((2, 0), ValueError, "fanouts must be positive ints"),
    (2**62, ValueError, "a fanout must be at most 2\\*\\*31 - 1, got 4611686018427387904"),
    ((2**16, 2**16), ValueError, "hop 2 would hold"),
  ],
)
def test_bad_fanouts_are_clear_errors(typed, fanouts, error, match):
  for sample in (sample_neighbors, sample_blocks):
    with pytest.raises(error, match=f"{sample.__name__}: {match}"):
      sample(typed, np.array([1]), fanouts, KEY)


def test_the_sampling_kernel_refuses_a_fanout_whose_slots_overflow(typed):
  # 4 rows of 2**62 + 1 slots are 2**64 + 4, 4 in wrapped int64: the (4, 1) outputs must not
  # pass as their shape, or the kernel writes far past them.
  dg = DeviceGraph.from_host(typed)
  out = (jax.ShapeDtypeStruct((4, 1), jnp.int32), jax.ShapeDtypeStruct((4, 1), bool))
  call = jax.ffi.ffi_call("jaxdata_sample", out, vmap_method="sequential")
  with pytest.raises(Exception, match="fanout must be in \\[1, 2\\*\\*31 - 1\\]"):
    jax.block_until_ready(
      call(
        dg.indptr,
        dg.indices,
        jnp.arange(4, dtype=jnp.int32),
        jnp.zeros(2, jnp.uint32),
        fanout=np.int64(2**62 + 1),
        replace=np.int32(0),
      )
    )


def test_a_graph_without_relations_needs_a_relation_count_for_blocks():
  g = HeteroGraph.from_typed_edges({}, {"a": 2})
  with HostGraph.from_hetero(g) as host:
    with pytest.raises(ValueError, match="sample_blocks: the graph has no relations"):
      sample_blocks(host, np.array([1]), (2,), KEY)
    blocks = sample_blocks(host, np.array([1]), (2,), KEY, num_relations=1)
    assert not np.asarray(blocks.graphs[0].norm).any()  # no edges, only padding


def test_host_graph_counts_past_int32_are_reported_as_given():
  big = np.array([0, 2**64 - 1], np.uint64)
  with pytest.raises(ValueError, match="18446744073709551616 nodes do not fit int32"):
    HostGraph.from_edges(big, np.array([1, 0], np.uint64))
  with pytest.raises(ValueError, match="1099511627776 nodes do not fit int32"):
    HostGraph.from_edges([0], [1], 2**40)  # refused before a counts array of that size
  with pytest.raises(ValueError, match="num_relations 1099511627776 does not fit int32"):
    HostGraph.from_edges([0], [1], 2, etypes=[0], num_relations=2**40)


@pytest.mark.parametrize(
  "fanouts,error",
  [(2.5, TypeError), (None, TypeError), ((3, 2.5), TypeError), ((3, 0), ValueError)],
)
def test_a_trainer_config_checks_fanouts_as_the_samplers_do(fanouts, error):
  from jaxdata.train.common import MinibatchConfig  # an app module: only this test needs it

  with pytest.raises(error, match="MinibatchConfig: fanouts must be"):
    MinibatchConfig(fanouts=fanouts)
  assert MinibatchConfig(fanouts=[3, np.int64(2)]).fanouts == (3, 2)


@pytest.mark.parametrize("x64", [True, False])
def test_block_graph_drops_an_edge_whose_id_int32_cannot_hold(x64):
  src = np.array([0, 2**32 + 1, 1], np.int64)  # int32 would make the second edge 1 -> 0
  dst = np.array([1, 0, 0], np.int64)
  with _no_x64() if not x64 else jax.enable_x64(True):
    g = block_graph(src, dst, np.zeros(3, np.int64), np.ones(3, bool), num_nodes=3, num_relations=1)
    s, d, _, norm = edges_numpy(g)
    assert sorted(zip(s.tolist(), d.tolist())) == [(0, 1), (1, 0)]
    np.testing.assert_array_equal(norm, [1.0, 1.0])
    if x64:  # JAX int64 arrays take the jnp path, the one a traced call takes
      g = block_graph(
        jnp.asarray(src),
        jnp.asarray(dst),
        jnp.zeros(3, jnp.int64),
        jnp.ones(3, bool),
        num_nodes=3,
        num_relations=1,
      )
      assert sorted(zip(*edges_numpy(g)[:2])) == [(0, 1), (1, 0)]


def test_node_type_offsets_that_are_not_ints_are_refused():
  nodes, mask = jnp.array([0, 3, -1], jnp.int32), jnp.array([True, True, False])
  tables = [jnp.ones((2, 1)), jnp.ones((3, 1))]
  with pytest.raises(TypeError, match="gather_typed: type_offsets must be ints, got 2.5"):
    gather_typed(tables, [0, 2.5, 5], nodes, mask)
  with pytest.raises(TypeError, match="node_types: type_offsets must be ints"):
    node_types([0, 2.5, 5], nodes)
  with pytest.raises(ValueError, match="must rise from >= 0"):
    node_types([0, 3, 2], nodes)
  np.testing.assert_array_equal(node_types(np.array([0, 2, 5]), nodes), [0, 1, -1])
  got = gather_typed(tables, (0, 2, 5), nodes, mask)
  np.testing.assert_array_equal(np.concatenate(got, axis=1), [[1, 0], [0, 1], [0, 0]])


def test_a_hand_built_device_graph_keeps_its_ids_or_is_refused():
  """int64 indices sample as int32 ones do; an index int32 cannot hold (2**32 + 1 would wrap to
  node 1) or outside the nodes, an indptr that falls, and non-integer fields are refused."""
  indptr, indices, seeds = np.array([0, 1, 2, 3]), np.array([1, 2, 0]), np.array([0, 1, 2])

  def graph(ptr, idx, dtype=jnp.int32):
    return DeviceGraph(jnp.asarray(ptr, dtype), jnp.asarray(idx, dtype))

  want = sample_neighbors(graph(indptr, indices), seeds, (2,), KEY)
  got = sample_neighbors(graph(indptr, indices, jnp.int64), seeds, (2,), KEY)
  np.testing.assert_array_equal(got.nodes[1], want.nodes[1])
  with pytest.raises(ValueError, match=r"outside the graph's 3 nodes \(1 .. 4294967297\)"):
    sample_neighbors(graph(indptr, [1, 2, 2**32 + 1], jnp.int64), seeds, (2,), KEY)
  with pytest.raises(ValueError, match="outside the graph's 3 nodes"):
    sample_neighbors(DeviceGraph(indptr, np.array([1, 3, 0])), seeds, (2,), KEY)
  with pytest.raises(ValueError, match="must rise from 0 to len"):
    sample_neighbors(DeviceGraph(np.array([0, 2, 1, 3]), indices), seeds, (2,), KEY)
  with pytest.raises(TypeError, match="indptr must be an integer array, got float32"):
    sample_neighbors(DeviceGraph(indptr.astype(np.float32), indices), seeds, (2,), KEY)
  with pytest.raises(TypeError, match="indices must be an integer array, got list"):
    sample_neighbors(DeviceGraph(indptr, [1, 2, 0]), seeds, (2,), KEY)


def test_a_node_with_2_31_in_edges_is_refused():
  """The samplers draw int32 positions among a node's in-edges: a node with 2**31 of them
  would wrap (checked on the degrees; a real graph that large does not fit CI)."""
  from jaxdata.host.graph import check_in_degrees

  check_in_degrees(np.diff(np.array([0, 5, 2**31 - 1 + 5], np.int64)), "HostGraph")
  with pytest.raises(ValueError, match="a node has 2147483648 in-edges"):
    check_in_degrees(np.diff(np.array([0, 3, 2**31 + 3], np.int64)), "HostGraph")
  with pytest.raises(ValueError, match="a node has 2147483648 in-edges"):
    check_in_degrees(jnp.diff(jnp.array([0, 2**31], jnp.int64)), "sample_neighbors: DeviceGraph")
