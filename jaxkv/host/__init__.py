"""The host layer: NumPy bookkeeping of blocks (pool, per-type managers, block tables)."""

from jaxkv.host.block_pool import BlockPool, KVCacheBlock
from jaxkv.host.block_table import BlockTable, MultiGroupBlockTable, get_block_table_width
from jaxkv.host.kv_cache_manager import (
  CircularBufferManager,
  FullAttentionManager,
  KVCacheManager,
  LinearAttentionStateManager,
  SingleTypeKVCacheManager,
  SlidingWindowManager,
  hash_block_tokens,
)

__all__ = [
  "BlockPool",
  "KVCacheBlock",
  "KVCacheManager",
  "SingleTypeKVCacheManager",
  "FullAttentionManager",
  "SlidingWindowManager",
  "CircularBufferManager",
  "LinearAttentionStateManager",
  "hash_block_tokens",
  "BlockTable",
  "MultiGroupBlockTable",
  "get_block_table_width",
]
