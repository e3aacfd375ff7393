"""What an offload tier is: a store of whole manager blocks keyed by ``(block hash, group id)``.

The key is the device prefix cache's own (``BlockPool``): a tier is a second level of that index.
A token block's entry holds its group's pages of that block; a state checkpoint's entry the state
after the block. Reads return the block's bytes or None: a missing, evicted or corrupt entry is a
miss, never wrong bytes.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import numpy as np

__all__ = ["OffloadKey", "OffloadTier"]

OffloadKey = tuple[bytes, int]  # (chained block hash, KV-cache group id)


class OffloadTier(abc.ABC):
  """``capacity_bytes``: what the tier may hold; ``used_bytes``: what it holds."""

  name: str
  capacity_bytes: int
  used_bytes: int

  @abc.abstractmethod
  def contains(self, key: OffloadKey) -> bool:
    """Whether ``get`` may find the key (it can still miss if the entry turns out corrupt)."""

  @abc.abstractmethod
  def get(self, key: OffloadKey) -> np.ndarray | None:
    """The block's bytes (``uint8[bytes]``), or None."""

  @abc.abstractmethod
  def put(self, keys: Sequence[OffloadKey], rows) -> None:
    """Stores row ``i`` of ``rows`` (``uint8[n, bytes]``, host or device array) under ``keys[i]``;
    may return before the bytes are stored."""

  def flush(self) -> None:
    """Waits for every ``put`` to be stored."""
