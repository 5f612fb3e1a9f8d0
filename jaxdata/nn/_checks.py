"""Argument checks the graph layers share: sizes are ints, inputs are arrays of the shape the
layer and the graph ask for, and an error names the argument and the shape it expected."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdata.hector import GraphArrays


def size(value: Any, name: str, who: str, minimum: int = 1) -> int:
  """`value` as a Python int >= `minimum`: a float such as 6.9 is refused, not truncated."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{who}: {name} must be an int, got {value!r}")
  if value < minimum:
    raise ValueError(f"{who}: {name} must be >= {minimum}, got {value}")
  return int(value)


def graph(g: Any, who: str) -> GraphArrays:
  if not isinstance(g, GraphArrays):
    raise TypeError(f"{who}: graph must be a jaxdata.hector.GraphArrays, got {type(g).__name__}")
  return g


def by_type(g: GraphArrays, xs: Mapping, name: str, who: str) -> list:
  """``{node type: array}`` as a list in the graph's node-type order, or a ValueError naming the
  types that are unknown or missing."""
  names = g.node_type_names
  if names is None:
    raise ValueError(
      f"{who}: {name} is a dict by node type, but the graph names no node types (build it with "
      "GraphArrays.from_graph of a HeteroGraph with node types, or pass arrays)"
    )
  unknown = sorted(set(xs) - set(names), key=str)
  missing = [n for n in names if n not in xs]
  if unknown or missing:
    raise ValueError(
      f"{who}: {name} "
      + (f"names node types {unknown} " if unknown else f"lacks node types {missing} ")
      + f"(the graph's types are {list(names)})"
    )
  return [xs[n] for n in names]


def split_by_type(g: GraphArrays, h: jax.Array) -> dict[str, jax.Array]:
  """A layer's output over all nodes as ``{node type: its rows}``."""
  offsets, names = g.node_type_offsets, g.node_type_names
  assert offsets is not None and names is not None  # by_type checked the graph has them
  return {n: h[a:b] for n, a, b in zip(names, offsets[:-1], offsets[1:])}


def concat_by_type(g: GraphArrays, xs: Mapping, who: str, width: int | None) -> jax.Array:
  """``{node type: [N_t, width]}`` as one ``[num_nodes, width]`` array in type order, each
  checked by name against its type's node count and the layer's width."""
  parts = by_type(g, xs, "x", who)
  counts = g.node_type_rows() or ()
  names = g.node_type_names or ()
  return jnp.concatenate(
    [rows(x, f"x[{n!r}]", who, c, width) for n, c, x in zip(names, counts, parts)]
  )


def relations(g: GraphArrays, num_relations: int, who: str) -> None:
  """The layer's relations are the graph's: a weight per relation, read by relation id."""
  if g.num_relations != num_relations:
    raise ValueError(
      f"{who}: the layer was built for num_relations={num_relations}, the graph has "
      f"{g.num_relations} relations"
    )


def rows(
  x: Any,
  name: str,
  who: str,
  num_rows: int | None,
  width: int | None,
  width_name: str = "in_features",
) -> jax.Array:
  """`x` (an array or nested sequences of numbers) as a 2-D JAX array ``[num_rows, width]``
  (None: any), or a TypeError / ValueError naming `name` and the shape expected."""
  if not isinstance(x, jax.Array):
    try:
      x = np.asarray(x)
    except (TypeError, ValueError) as e:  # ragged nested lists
      raise TypeError(f"{who}: {name} must be an array, got {type(x).__name__} ({e})") from None
  if not (jnp.issubdtype(x.dtype, jnp.number) or x.dtype == np.bool_):
    raise TypeError(f"{who}: {name} must hold numbers, got dtype {x.dtype}")
  x = jnp.asarray(x)
  want = (
    "num_nodes" if num_rows is None else f"num_nodes={num_rows}",
    width_name if width is None else f"{width_name}={width}",
  )
  if (
    x.ndim != 2
    or (num_rows is not None and x.shape[0] != num_rows)
    or (width is not None and x.shape[1] != width)
  ):
    raise ValueError(f"{who}: {name} must have shape [{want[0]}, {want[1]}], got {x.shape}")
  return x
