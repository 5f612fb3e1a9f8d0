"""spill / load: move arrays out to a TensorStore and back, inside jitted programs."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxdata.offload.store import TensorStore

_TIERS = {"auto": 0, "ram": 1, "ssd": 2}
_sites = itertools.count(1)


def new_site() -> int:
  """A fresh call-site number. A site's loads must come in the reverse order of its spills."""
  return next(_sites)


def _tier(tier: str, store: TensorStore | None = None, what: str = "spill") -> int:
  """The tier's number for the FFI call; ValueError for an unknown tier, or for "ssd" on a
  store that has no SSD tier (said here, before anything runs)."""
  if tier not in _TIERS:
    raise ValueError(f"{what}: tier must be one of {sorted(_TIERS)}, got {tier!r}")
  if tier == "ssd" and store is not None and store.ssd_dir is None:
    raise ValueError(
      f"{what}: tier 'ssd' was asked for, but {store!r} has no SSD tier; "
      "configure one with TensorStore(ssd_dir=<a directory on local disk>)"
    )
  return _TIERS[tier]


def spill(
  arrays: Sequence[jax.Array], store: TensorStore, *, site: int, tier: str = "auto"
) -> jax.Array:
  """Copies `arrays` into `store` and returns a ticket (two int32) for `load`.

  On the GPU the call only copies the arrays into the store's device staging on XLA's stream;
  the copy to host RAM (and on to the SSD) runs on a side stream and I/O threads. The call has a
  side effect and is never removed; order it with data dependencies on the ticket.
  """
  if not isinstance(store, TensorStore):
    raise TypeError(f"store must be a jaxdata.offload.TensorStore, got {type(store).__name__}")
  tier_id = _tier(tier, store)
  arrays = [jnp.asarray(a) for a in arrays]
  if not arrays:
    raise ValueError("spill needs at least one array")
  return jax.ffi.ffi_call(
    "jaxdata_offload_spill",
    jax.ShapeDtypeStruct((2,), jnp.int32),
    has_side_effect=True,
    vmap_method="broadcast_all",
  )(*arrays, store=np.int64(store.store_id), site=np.int64(site), tier=np.int64(tier_id))


def load(
  ticket: jax.Array,
  like: Sequence[jax.ShapeDtypeStruct],
  store: TensorStore,
  *,
  site: int,
  after: Sequence[jax.Array] = (),
) -> list[jax.Array]:
  """The arrays spilled under `ticket` (shapes and dtypes `like`), freed from the store.

  `after`: arrays the load must wait for (not read): they place the load in the program, e.g.
  the cotangent a backward step receives, so that it does not run earlier than needed.
  """
  if not isinstance(store, TensorStore):
    raise TypeError(f"store must be a jaxdata.offload.TensorStore, got {type(store).__name__}")
  like = [jax.ShapeDtypeStruct(l.shape, l.dtype) for l in like]
  if not like:
    raise ValueError("load needs at least one output")
  ticket = jnp.asarray(ticket)
  if ticket.dtype != jnp.int32 or ticket.shape[-1:] != (2,):
    raise TypeError(
      f"ticket must be int32 pairs from spill, got {ticket.dtype}{list(ticket.shape)}"
    )
  if after:  # a data dependency without reading the arrays
    ticket, _ = jax.lax.optimization_barrier((ticket, tuple(after)))
  out = jax.ffi.ffi_call(
    "jaxdata_offload_load", like, has_side_effect=True, vmap_method="broadcast_all"
  )(ticket, store=np.int64(store.store_id), site=np.int64(site))
  return list(out)
