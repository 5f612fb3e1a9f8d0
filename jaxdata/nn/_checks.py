"""Argument checks the graph layers share: sizes are ints, inputs are arrays of the shape the
layer and the graph ask for, and an error names the argument and the shape it expected."""

from __future__ import annotations

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
