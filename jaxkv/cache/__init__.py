"""The cache layer: specs, backends, attention groups, kernel views and the planner (static records)."""

from jaxkv.cache.attention_backend import (
  AttentionBackend,
  customize_attention_spec,
  is_block_size_supported,
  select_common_block_size,
)
from jaxkv.cache.attention_group import AttentionGroup
from jaxkv.cache.cache_dtype import CACHE_DTYPES, MODEL_DTYPES, CacheDType, check_cache_dtype
from jaxkv.cache.kernel_view import KernelView, find_view
from jaxkv.cache.kv_cache_config import (
  LAYOUTS,
  LINEAR_PREFILL_CHUNK,
  LINEAR_PREFILLS,
  CacheConfig,
  KVCacheConfig,
  KVCacheGroupSpec,
  KVCacheLayer,
  KVCacheTensor,
  plan_kv_cache,
)
from jaxkv.cache.kv_cache_report import render_plan
from jaxkv.cache.kv_cache_spec import (
  AttentionSpec,
  CircularBufferSpec,
  FullAttentionSpec,
  KVCacheSpec,
  LinearAttentionStateSpec,
  MLAAttentionSpec,
  MultipleOf,
  SlidingWindowSpec,
)

__all__ = [
  "CacheDType",
  "CACHE_DTYPES",
  "MODEL_DTYPES",
  "check_cache_dtype",
  "KVCacheSpec",
  "AttentionSpec",
  "FullAttentionSpec",
  "MLAAttentionSpec",
  "SlidingWindowSpec",
  "CircularBufferSpec",
  "LinearAttentionStateSpec",
  "MultipleOf",
  "AttentionBackend",
  "customize_attention_spec",
  "is_block_size_supported",
  "select_common_block_size",
  "AttentionGroup",
  "KernelView",
  "find_view",
  "LAYOUTS",
  "LINEAR_PREFILLS",
  "LINEAR_PREFILL_CHUNK",
  "CacheConfig",
  "KVCacheConfig",
  "KVCacheGroupSpec",
  "KVCacheLayer",
  "KVCacheTensor",
  "plan_kv_cache",
  "render_plan",
]
