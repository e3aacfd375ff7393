"""KV connectors in manager blocks (after vLLM's ``KVConnectorBase_V1`` and its offloading
connector): the scheduler side finds external hits by block hash, the worker side saves and loads
whole manager blocks by id. Never through kernel blocks: in the packed layout a manager block is
one row of the arena (one copy moves every layer's cache of it), in the dense layout each layer's
page of it.

``OffloadingConnector`` keeps a second level of the device prefix cache in an ``OffloadTier``
(host memory or disk), under the same ``(block hash, group id)`` keys:

* save: every block the device cache indexes (token blocks, KDA state checkpoints) is gathered on
  the device right after the step that wrote it and copied to the tier asynchronously (to the
  ``pinned_host`` memory kind where the platform has one); the serving loop does not wait for it;
* load: when a request is admitted, the blocks of its prefix that the device lacks but the tier
  holds are read (a corrupt or missing entry ends the hit there), written into free device blocks
  (one scatter per group, dispatched before the step) and indexed in the device cache, so the
  admission that follows is an ordinary device hit: two requests with one prefix load it once,
  and aborting a request frees its blocks like any other.
"""

from __future__ import annotations

import abc
import hashlib
import json
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.step.block_copy import BlockRegions, gather_blocks, scatter_blocks
from jaxkv.host.block_pool import BlockHash
from jaxkv.cache.kv_cache_config import KVCacheConfig
from jaxkv.host.kv_cache_manager import KVCacheManager
from jaxkv.engine.offload.tier import OffloadTier
from jaxkv.engine.offload.transfer import KVTransfer, pinned_host_put
from jaxkv.utils import next_power_of_2

__all__ = ["KVConnectorBase", "OffloadingConnector", "offload_fingerprint"]


@jax.jit
def _weight_digests(leaves):
  """Two 32-bit sums of each weight's every word (``[num_leaves, 2]`` uint32), in one pass on the
  device: ``sum(w_i * (2i + 1))`` changes with any single word (odd multipliers are invertible
  mod 2^32), and a second sum of mixed words guards against changes that cancel in the first."""
  out = []
  for x in leaves:
    if x.dtype == jnp.bool_:
      x = x.astype(jnp.uint8)
    words = jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize])
    words = words.reshape(-1).astype(jnp.uint32)
    i = jnp.arange(words.shape[0], dtype=jnp.uint32)
    mixed = (words ^ (words >> 15)) * jnp.uint32(0x2C1B3C6D) + i * jnp.uint32(0x9E3779B1)
    out.append(
      jnp.stack([jnp.sum(words * (2 * i + 1), dtype=jnp.uint32), jnp.sum(mixed ^ (mixed >> 13), dtype=jnp.uint32)])
    )
  return jnp.stack(out) if out else jnp.zeros((0, 2), jnp.uint32)


def offload_fingerprint(plan: KVCacheConfig, params) -> str:
  """What stored blocks belong to: the block layout of the plan (groups, pages, offsets, dtypes,
  block size) and every weight (shape, dtype and digests of all its bytes, computed on the device
  in one pass: ``_weight_digests``), as a SHA-256 hex digest. Blocks saved under another
  fingerprint are never read: two models that differ in one weight element do not share blocks."""
  layout = {
    "layout": plan.layout,
    "block_size": plan.block_size,
    "bytes_per_block": plan.bytes_per_block,
    "groups": [[list(g.layer_names), [repr(s) for s in g.layer_specs]] for g in plan.kv_cache_groups],
    "pages": [[v.layer_name, v.tensor, v.tensor_offset_bytes, v.page_bytes, v.block_stride_bytes] for v in plan.views],
  }
  h = hashlib.sha256(json.dumps(layout, sort_keys=True).encode())
  leaves = jax.tree.leaves(params)
  digests = np.asarray(_weight_digests(leaves))
  for leaf, digest in zip(leaves, digests):
    h.update(repr((leaf.shape, str(leaf.dtype))).encode())
    h.update(digest.tobytes())
  return h.hexdigest()


class KVConnectorBase(KVTransfer):
  """The two sides of a connector, as the engine calls them each step.

  Scheduler side: ``get_num_new_matched_tokens`` before a request is admitted. Worker side (a
  ``KVTransfer``): ``start_load_kv`` before the step is dispatched, ``save_kv`` after it with the
  blocks it completed, ``wait_for_save`` when the caller needs the saves finished (end of
  ``generate``, shutdown).
  """

  @abc.abstractmethod
  def get_num_new_matched_tokens(self, kv: KVCacheManager, request_id: str, token_ids: Sequence[int]) -> int:
    """Makes the prefix blocks this connector holds (beyond the device's) device cache hits;
    returns how many tokens that adds."""

  @abc.abstractmethod
  def save_kv(self, caches: dict[str, jax.Array], blocks: Sequence[tuple[BlockHash, int, int]]) -> None:
    """Starts saving ``(block hash, group id, block id)`` blocks the last step completed."""


class OffloadingConnector(KVConnectorBase):
  """Device prefix cache <-> one ``OffloadTier``, in manager blocks (module docstring).

  Args:
    plan: the engine's KV-cache plan (each group's block bytes).
    tier: where blocks go (``HostTier``, ``DiskTier``).
  """

  def __init__(self, plan: KVCacheConfig, tier: OffloadTier):
    self.plan = plan
    self.tier = tier
    self.regions = [BlockRegions.from_plan(plan, [g]) for g in range(len(plan.kv_cache_groups))]
    self._loads: dict[int, list[tuple[int, np.ndarray]]] = {}  # group -> (block id, bytes)
    self.num_loaded_blocks = self.num_loaded_bytes = 0
    self.num_saved_blocks = 0

  # -- scheduler side ----------------------------------------------------------------------------

  def get_num_new_matched_tokens(self, kv: KVCacheManager, request_id: str, token_ids: Sequence[int]) -> int:
    read: dict[tuple[BlockHash, int], np.ndarray | None] = {}  # each tier entry read at most once

    def in_tier(block_hash: BlockHash, group_id: int) -> bool:
      key = (block_hash, group_id)
      if key not in read:
        read[key] = self._read(key)
      return read[key] is not None

    # The manager's one hit search, with the tier as a second level; then the tier's blocks of the
    # hit are placed in free device blocks and loaded before the step.
    end = kv.find_prefix_hit(request_id, token_ids, elsewhere=in_tier)
    on_device = kv.find_prefix_hit(request_id, token_ids)
    if end <= on_device:
      return 0
    placed = kv.cache_external_blocks(request_id, token_ids, end, in_tier)
    if not placed:
      return 0
    for block_hash, g, block_id in placed:
      data = read[(block_hash, g)]
      self._loads.setdefault(g, []).append((block_id, data))
      self.num_loaded_bytes += data.nbytes
    self.num_loaded_blocks += len(placed)
    return (end - on_device) * kv.hash_block_size

  def _read(self, key: tuple[BlockHash, int]) -> np.ndarray | None:
    """A block from the tier, or None: absent, unreadable, or not this layout's block size."""
    data = self.tier.get(key) if self.tier.contains(key) else None
    if data is not None and data.nbytes != self.regions[key[1]].bytes_per_block:
      return None
    return data

  # -- worker side ---------------------------------------------------------------------------------

  def start_load_kv(self, caches):
    for g, items in self._loads.items():
      size = next_power_of_2(len(items))
      ids = np.full((size,), -1, np.int32)
      data = np.zeros((size, self.regions[g].bytes_per_block), np.uint8)
      for i, (block_id, row) in enumerate(items):
        ids[i], data[i] = block_id, row
      caches = scatter_blocks(caches, ids, data, regions=self.regions[g])
    self._loads = {}
    return caches

  def save_kv(self, caches, blocks):
    by_group: dict[int, list[tuple[BlockHash, int]]] = {}
    for block_hash, g, block_id in blocks:
      if not self.tier.contains((block_hash, g)):
        by_group.setdefault(g, []).append((block_hash, block_id))
    for g, items in by_group.items():
      ids = np.full((next_power_of_2(len(items)),), -1, np.int32)
      ids[: len(items)] = [b for _, b in items]
      rows = gather_blocks(caches, ids, regions=self.regions[g])
      self.tier.put([(h, g) for h, _ in items], pinned_host_put(rows))  # rows past the keys: padding
      self.num_saved_blocks += len(items)

  def wait_for_save(self) -> None:
    self.tier.flush()
