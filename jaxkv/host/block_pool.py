"""The pool of KV-cache-manager blocks: free queue, null block, prefix-cache index (host, NumPy-free).

Mirrors vLLM's ``vllm/v1/core/block_pool.py``. Block 0 is the null block: never handed out, never
freed; table rows of padded requests hold it. Free blocks are kept in eviction order (an ordered
dict stands in for vLLM's doubly linked list: O(1) pop-front, append and removal from the middle).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

__all__ = ["KVCacheBlock", "BlockPool", "BlockHash"]

BlockHash = bytes


class KVCacheBlock:
  __slots__ = ("block_id", "ref_cnt", "block_hash")

  def __init__(self, block_id: int):
    self.block_id = block_id
    self.ref_cnt = 0
    # (hash, group id) while the block is in the prefix-cache index.
    self.block_hash: tuple[BlockHash, int] | None = None

  @property
  def is_null(self) -> bool:
    return self.block_id == 0

  def __repr__(self) -> str:
    return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt})"


class BlockPool:
  """``num_blocks`` blocks; block 0 is the null block.

  A freed block keeps its hash (and stays findable for prefix hits) until it is handed out again.
  """

  def __init__(self, num_blocks: int, *, enable_caching: bool = True):
    if num_blocks < 2:
      raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}.")
    self.num_blocks = num_blocks
    self.enable_caching = enable_caching
    self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
    self.null_block = self.blocks[0]
    self._free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(1, num_blocks))
    self._cached: dict[tuple[BlockHash, int], KVCacheBlock] = {}

  def get_num_free_blocks(self) -> int:
    return len(self._free)

  def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
    """Pops ``num_blocks`` blocks from the front of the free queue (evicting their hashes)."""
    if num_blocks > len(self._free):
      raise ValueError(f"Cannot get {num_blocks} free blocks from the pool ({len(self._free)} free).")
    out = []
    for _ in range(num_blocks):
      block = self.blocks[self._free.popitem(last=False)[0]]
      self._evict(block)
      block.ref_cnt = 1
      out.append(block)
    return out

  def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
    """Takes a reference on (cached) blocks, pulling free ones out of the free queue."""
    for block in blocks:
      if block.is_null:
        continue
      if block.ref_cnt == 0:
        del self._free[block.block_id]
      block.ref_cnt += 1

  def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
    """Drops a reference; blocks reaching zero go to the tail (evicted last among free ones)."""
    for block in ordered_blocks:
      if block.is_null:
        continue
      if block.ref_cnt <= 0:
        raise RuntimeError(f"Double free of block {block.block_id} (ref_cnt {block.ref_cnt}).")
      block.ref_cnt -= 1
      if block.ref_cnt == 0:
        self._free[block.block_id] = None

  def get_cached_block(self, block_hash: BlockHash, group_id: int) -> KVCacheBlock | None:
    return self._cached.get((block_hash, group_id))

  def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash, group_id: int) -> bool:
    """Indexes a full block by its chained hash (first writer wins; duplicates stay uncached).
    Returns whether it was newly indexed."""
    if not self.enable_caching or block.is_null or block.block_hash is not None:
      return False
    key = (block_hash, group_id)
    if key in self._cached:
      return False
    self._cached[key] = block
    block.block_hash = key
    return True

  def cache_free_block(self, block_hash: BlockHash, group_id: int) -> KVCacheBlock:
    """A free block indexed under ``(block_hash, group_id)`` and left free: found by the next hit
    search and evicted in LRU order like any cached block (state checkpoints, blocks loaded from an
    offload tier). The caller writes its contents before anything can read it."""
    (block,) = self.get_new_blocks(1)
    self.cache_full_block(block, block_hash, group_id)
    self.free_blocks([block])
    return block

  def _evict(self, block: KVCacheBlock) -> None:
    if block.block_hash is not None:
      if self._cached.get(block.block_hash) is block:
        del self._cached[block.block_hash]
      block.block_hash = None

  def reset_prefix_cache(self) -> None:
    for block in list(self._cached.values()):
      self._evict(block)
