"""Swap on preemption (vLLM's ``--preemption-mode swap`` and ``--swap-space``): a preempted
request's blocks move to host memory and back, instead of being recomputed.

A ``KVTransfer``, as the offload connector is: the scheduler side is swap's own (a preempted
request's blocks by request id, not by content hash). The scheduler preempts a request:
``swap_out`` records its blocks (every group: latents, pooled keys, tail ring, KDA state slots, by
manager-block id) and the blocks go back to the pool at once. Before anything else in the next
dispatch, ``start_store_kv`` gathers them on the device and copies them to host memory, so the new
owners' writes, dispatched after, cannot reach them. When the request is admitted again with fresh
blocks, ``swap_in`` pairs its saved blocks with the new ids (same group, same column) and
``start_load_kv`` scatters them back before its step: it
resumes with ``num_computed_tokens`` and its KDA state slot as they were. When the swap space is
full, the request is recomputed instead: nothing accepted is lost either way.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxkv.step.block_copy import BlockRegions, gather_blocks, scatter_blocks
from jaxkv.cache.kv_cache_config import KVCacheConfig
from jaxkv.engine.offload.transfer import KVTransfer, pinned_host_put, to_device
from jaxkv.utils import next_power_of_2

__all__ = ["SwapSpace"]


class SwapSpace(KVTransfer):
  """Args: plan: the engine's KV-cache plan; capacity_bytes: host bytes for swapped blocks."""

  def __init__(self, plan: KVCacheConfig, capacity_bytes: int):
    if capacity_bytes < 0:
      raise ValueError(f"swap space must be >= 0 bytes, got {capacity_bytes}.")
    self.capacity_bytes = capacity_bytes
    self.used_bytes = 0
    self.regions = [BlockRegions.from_plan(plan, [g]) for g in range(len(plan.kv_cache_groups))]
    self._out: list[tuple[str, int, list[int]]] = []  # (request, group, block ids) to gather
    self._swapped: dict[str, dict[int, tuple[object, int]]] = {}  # request -> group -> (host rows, count)
    self._bytes: dict[str, int] = {}
    self._in: list[tuple[object, np.ndarray, int]] = []  # (host rows, ids, group) to scatter
    self.num_swapped_out = 0
    self.num_swapped_in = 0

  def is_swapped(self, request_id: str) -> bool:
    return request_id in self._swapped

  def swap_out(self, request_id: str, block_ids: tuple[list[int], ...]) -> bool:
    """Takes a preempted request's blocks (the caller frees them next); False when they do not fit."""
    nbytes = sum(len(ids) * self.regions[g].bytes_per_block for g, ids in enumerate(block_ids))
    if self.used_bytes + nbytes > self.capacity_bytes:
      return False
    self.used_bytes += nbytes
    self._bytes[request_id] = nbytes
    self._swapped[request_id] = {}
    for g, ids in enumerate(block_ids):
      if ids:
        self._out.append((request_id, g, list(ids)))
    self.num_swapped_out += 1
    return True

  def start_store_kv(self, caches: dict[str, jax.Array]) -> None:
    """Gathers the blocks of requests preempted since the last call and starts their copy to host."""
    for request_id, g, ids in self._out:
      padded = np.full((next_power_of_2(len(ids)),), -1, np.int32)
      padded[: len(ids)] = ids
      self._swapped[request_id][g] = (pinned_host_put(gather_blocks(caches, padded, regions=self.regions[g])), len(ids))
    self._out = []

  def swap_in(self, request_id: str, block_ids: tuple[list[int], ...]) -> None:
    """Pairs a re-admitted request's saved blocks with its new ``block_ids`` (first columns of each group)."""
    if any(r == request_id for r, _, _ in self._out):  # the scheduler waits one step to re-admit
      raise RuntimeError(f"request {request_id!r} was re-admitted before its swap-out was dispatched.")
    saved = self._swapped.pop(request_id)
    self.used_bytes -= self._bytes.pop(request_id)
    for g, (rows, count) in saved.items():
      # A request preempted after rejected drafts held a block for the draft positions; re-admitted,
      # it allocates for its accepted tokens only: the saved blocks past those hold no token of it.
      count = min(count, len(block_ids[g]))
      ids = np.full((rows.shape[0],), -1, np.int32)
      ids[:count] = block_ids[g][:count]
      self._in.append((rows, ids, g))
    self.num_swapped_in += 1

  def start_load_kv(self, caches: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Scatters the blocks of requests re-admitted since the last call (caches donated)."""
    for rows, ids, g in self._in:
      caches = scatter_blocks(caches, ids, to_device(rows, caches), regions=self.regions[g])
    self._in = []
    return caches

  def discard(self, request_id: str) -> None:
    """Forgets a swapped request that ended (aborted while waiting)."""
    self._swapped.pop(request_id, None)
    self._out = [o for o in self._out if o[0] != request_id]
    self.used_bytes -= self._bytes.pop(request_id, 0)
