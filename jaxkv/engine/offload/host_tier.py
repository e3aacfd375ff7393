"""The host-memory tier: whole manager blocks in host RAM, LRU-evicted by capacity.

Blocks arrive as the rows of one device-to-host transfer (``jax.device_put`` to the device's
``pinned_host`` memory kind where the platform has one, so the copy is asynchronous DMA into page-
locked memory; a NumPy array otherwise). The tier keeps each transfer's array and a row index per
key: nothing is copied again until a block is read back. A transfer's array lives while any of its
keys does, so the tier counts what it holds by transfer: all of its rows (padding included) from
its first key kept to its last key evicted; ``used_bytes`` never exceeds the capacity.
"""

from __future__ import annotations

import collections
import threading

import numpy as np

from jaxkv.engine.offload.tier import OffloadKey, OffloadTier

__all__ = ["HostTier"]


class _Batch:
  """One transfer's rows; converted to NumPy once, on first read (waits for the copy then)."""

  __slots__ = ("array", "_host", "nbytes", "refs")

  def __init__(self, array):
    self.array = array
    self._host = None
    self.nbytes = int(np.prod(array.shape)) * np.dtype(array.dtype).itemsize
    self.refs = 0  # keys of the tier that point into it

  def row(self, i: int) -> np.ndarray:
    if self._host is None:
      self._host = np.asarray(self.array)
    return self._host[i]


class HostTier(OffloadTier):
  """Args: capacity_bytes: the most block bytes kept (least recently used evicted first)."""

  name = "host"

  def __init__(self, capacity_bytes: int):
    if capacity_bytes <= 0:
      raise ValueError(f"the host tier's capacity must be positive, got {capacity_bytes} bytes.")
    self.capacity_bytes = capacity_bytes
    self.used_bytes = 0
    self._entries: collections.OrderedDict[OffloadKey, tuple[_Batch, int, int]] = collections.OrderedDict()
    self._lock = threading.Lock()

  def __len__(self) -> int:
    return len(self._entries)

  def contains(self, key: OffloadKey) -> bool:
    return key in self._entries

  def get(self, key: OffloadKey) -> np.ndarray | None:
    with self._lock:
      entry = self._entries.get(key)
      if entry is None:
        return None
      self._entries.move_to_end(key)
    batch, row, _ = entry
    return batch.row(row)

  def put(self, keys, rows) -> None:
    nbytes = int(rows.shape[1])
    batch = _Batch(rows)
    if batch.nbytes > self.capacity_bytes:
      return  # one transfer larger than the tier: nothing of it is kept
    with self._lock:
      for i, key in enumerate(keys):
        if key in self._entries:
          continue
        self._entries[key] = (batch, i, nbytes)
        if not batch.refs:
          self.used_bytes += batch.nbytes
        batch.refs += 1
      while self.used_bytes > self.capacity_bytes:
        _, (old, _, _) = self._entries.popitem(last=False)
        old.refs -= 1
        if not old.refs:
          self.used_bytes -= old.nbytes
