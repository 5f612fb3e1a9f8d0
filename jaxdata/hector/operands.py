"""The operands of every generated kernel, named once: codegen, the runtime and the lowering
all read this table, so the argument layout exists in one place.

A kernel call passes, in order:

* the graph operands (`GRAPH`): arrays of `GraphArrays`, or of its (source, relation) pairs
  for an instance over the compact domain, plus `tiles` and `valid`, derived per call;
* the instance's inputs ``in0``, ``in1``, ... (float32 or bfloat16);
* its one output ``out`` (float32; bfloat16 where a bfloat16 layer stores rows:
  `jaxdata.hector.compiled.out_dtype`);

and the int64 scalars (`SCALARS`) as an attribute. The native launcher
(``xla_ffi/hector/launch_*.cc``) passes buffers and scalars through in this order without
knowing their number; the generated source (`Params` on CUDA, pointer casts on both) is what
reads them by position, and it is generated from this table.

    >>> index("etype"), index("in1", num_inputs=2), index("out", num_inputs=2)
    (2, 15, 16)
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class GraphOperand:
  """One graph array a kernel reads: its name in generated code, its C element type, and the
  `GraphArrays` field it comes from over the edges (`edge`) and over the pairs (`compact`);
  None for both when it is derived per call (`tiles`, `valid`)."""

  name: str
  ctype: str
  edge: str | None
  compact: str | None

  @property
  def dtype(self) -> np.dtype:
    return np.dtype(
      {"int32_t": np.int32, "float": np.float32, "unsigned char": np.uint8}[self.ctype]
    )


#: The graph operands in call order. Over the compact domain the pairs stand in for the edges:
#: they have no destination, so `dst` and the CSC view repeat the source side, and `norm` is
#: not theirs; `pair`, `pair_offsets` and `pair_edges` link edges to pairs in both domains.
GRAPH = (
  GraphOperand("src", "int32_t", "src", "pair_src"),
  GraphOperand("dst", "int32_t", "dst", "pair_src"),
  GraphOperand("etype", "int32_t", "etype", "pair_etype"),
  GraphOperand("norm", "float", "norm", "norm"),
  GraphOperand("rel_offsets", "int32_t", "rel_offsets", "pair_rel_offsets"),
  GraphOperand("csr_offsets", "int32_t", "csr_offsets", "pair_csr_offsets"),
  GraphOperand("csr_edges", "int32_t", "csr_edges", "pair_csr_edges"),
  GraphOperand("csc_offsets", "int32_t", "csc_offsets", "pair_csr_offsets"),
  GraphOperand("csc_edges", "int32_t", "csc_edges", "pair_csr_edges"),
  # tiles[r]: row tiles of the relations before r (CUDA GEMMs; others get rel_offsets' copy)
  GraphOperand("tiles", "int32_t", None, None),
  GraphOperand("pair", "int32_t", "pair", "pair"),
  GraphOperand("pair_offsets", "int32_t", "pair_offsets", "pair_offsets"),
  GraphOperand("pair_edges", "int32_t", "pair_edges", "pair_edges"),
  # valid[e]: 1 where row e's ids are in range, else 0 (`valid_rows`; a kernel's ok(e))
  GraphOperand("valid", "unsigned char", None, None),
)
_GRAPH_INDEX = {op.name: i for i, op in enumerate(GRAPH)}


@dataclasses.dataclass(frozen=True)
class Scalar:
  """One int64 scalar: its name in generated code and the graph operand whose length gives it
  (less `minus`: offsets arrays are one longer than what they count); `operand` None: set by
  the launch (`T`)."""

  name: str
  operand: str | None
  minus: int = 0


#: E: rows of the domain (edges, or pairs); N: nodes; R: relations; T: row tiles (an upper
#: bound, CUDA GEMMs only, else 0); P: unique (source, relation) pairs.
SCALARS = (
  Scalar("E", "src"),
  Scalar("N", "csr_offsets", 1),
  Scalar("R", "rel_offsets", 1),
  Scalar("T", None),
  Scalar("P", "pair_offsets", 1),
)
SCALAR_NAMES = tuple(s.name for s in SCALARS)


def index(name: str, num_inputs: int = 0) -> int:
  """The position of operand `name` (a graph operand, ``in<s>`` or ``out``) among a call's
  buffers, for an instance of `num_inputs` inputs."""
  if name in _GRAPH_INDEX:
    return _GRAPH_INDEX[name]
  if name == "out":
    return len(GRAPH) + num_inputs
  if name.startswith("in") and name[2:].isdigit() and int(name[2:]) < num_inputs:
    return len(GRAPH) + int(name[2:])
  raise KeyError(f"hector.operands: no operand {name!r} in a kernel of {num_inputs} inputs")


def num_buffers(num_inputs: int) -> int:
  """Buffers a call passes: the graph operands, the inputs and the output."""
  return len(GRAPH) + num_inputs + 1


def scalar_index(name: str) -> int:
  return SCALAR_NAMES.index(name)


def valid_rows(ops: dict, domain: str):
  """valid[e] (uint8, one per row of the domain): 1 where row e's ids are in range, else 0:
  src and dst below N, etype below R, and over the edges the edge's pair below P (`ops`: the
  domain's graph operands by name). Ids may be computed under jit, so this is derived per call
  (one elementwise pass that XLA fuses, and merges where calls share a graph); a kernel's
  ok(e) reads it (`codegen.common.guard`) rather than loading and checking every id itself,
  which for a kernel that visits edges in another order (a softmax or a sum through the CSC
  view) were three or four scattered loads per edge."""
  size = sizes([ops.get(op.name) for op in GRAPH])
  below = lambda a, n: jnp.asarray(a).astype(jnp.uint32) < n  # noqa: E731  (negative ids too)
  ok = below(ops["src"], size["N"]) & below(ops["dst"], size["N"]) & below(ops["etype"], size["R"])
  if domain == "edge":
    ok = ok & below(ops["pair"], size["P"])
  return ok.astype(jnp.uint8)


def graph_operands(graph, domain: str, tiles, valid: bool = True) -> list:
  """The graph operands of a kernel over `domain` ("edge" or "compact"), in call order, taken
  from `graph` (a `GraphArrays`); `tiles(rel_offsets)` makes the `tiles` operand from the
  domain's relation offsets, and `valid_rows` the `valid` operand (one byte where the kernel
  does not read it: `valid` False)."""
  if domain not in ("edge", "compact"):
    raise ValueError(f"hector.operands: domain must be 'edge' or 'compact', got {domain!r}")
  ops = {}
  for op in GRAPH:
    field = op.edge if domain == "edge" else op.compact
    if field is not None:  # None (in both domains) for the operands derived per call
      ops[op.name] = getattr(graph, field)
  ops["tiles"] = tiles(ops["rel_offsets"])
  # Not zero-length: with a u8[0] constant among a custom call's operands, XLA's CPU compiler
  # (jax 0.11.2) crashes compiling a mini-batch step of a two-process job.
  ops["valid"] = valid_rows(ops, domain) if valid else np.zeros((1,), np.uint8)
  return [ops[op.name] for op in GRAPH]


def check(avals, num_inputs: int, who: str) -> None:
  """ValueError (from `who`) unless `avals` (shapes and dtypes of a call's operands, outputs
  excluded) are the graph operands with their dtypes, then `num_inputs` inputs."""
  want = num_buffers(num_inputs) - 1
  if len(avals) != want:
    raise ValueError(
      f"{who}: a kernel of {num_inputs} inputs takes {want} operands "
      f"({len(GRAPH)} graph arrays and the inputs), got {len(avals)}"
    )
  for op, aval in zip(GRAPH, avals):
    if np.dtype(aval.dtype) != op.dtype or len(aval.shape) != 1:
      raise ValueError(
        f"{who}: graph operand {op.name} must be a 1-D {op.dtype} array, got "
        f"{aval.dtype}{list(aval.shape)}"
      )


def sizes(avals) -> dict[str, int]:
  """The scalars that the graph operands' lengths give (every one but `T`), by name."""
  return {s.name: avals[index(s.operand)].shape[0] - s.minus for s in SCALARS if s.operand}


def scalar_values(values: dict[str, int]) -> np.ndarray:
  """The scalars attribute: `values` (a value per name in `SCALAR_NAMES`) in call order."""
  return np.array([values[name] for name in SCALAR_NAMES], np.int64)
