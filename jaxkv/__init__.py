"""jaxkv: paged KV-cache management for LLM inference in JAX and Pallas.

Block tables and slot mappings are in KV-cache-manager blocks; each attention group maps its table
to the kernel blocks its backend reads (kernel block ``j`` of block ``b`` is ``b * stride + j``).
"""

import importlib.util as _importlib_util
import os as _os


def _check_sibling_packages() -> None:
  # jaxkv ships three top-level packages (the repository's layout). Another distribution's
  # ``models`` or ``pallas_kernels`` earlier on sys.path would otherwise be imported in their place
  # and fail far from here, or worse, not fail.
  root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
  for name in ("models", "pallas_kernels"):
    spec = _importlib_util.find_spec(name)
    where = None if spec is None or spec.origin is None else _os.path.dirname(_os.path.dirname(spec.origin))
    if where is None or _os.path.realpath(where) != _os.path.realpath(root):
      found = "nothing" if spec is None else (spec.origin or "a namespace package")
      raise ImportError(
        f"jaxkv needs its own top-level package {name!r} next to it in {root}, but importing {name!r} finds "
        f"{found}: another package of that name shadows it. Install jaxkv in its own environment (as "
        f"`sh .ci/venv.sh` does) or remove the other {name!r} from sys.path."
      )


_check_sibling_packages()

from jaxkv.cache import (
  CACHE_DTYPES,
  LAYOUTS,
  CacheDType,
  AttentionBackend,
  AttentionGroup,
  AttentionSpec,
  CacheConfig,
  CircularBufferSpec,
  FullAttentionSpec,
  KernelView,
  KVCacheConfig,
  KVCacheGroupSpec,
  KVCacheLayer,
  KVCacheSpec,
  KVCacheTensor,
  LinearAttentionStateSpec,
  MLAAttentionSpec,
  MultipleOf,
  SlidingWindowSpec,
  customize_attention_spec,
  is_block_size_supported,
  plan_kv_cache,
  render_plan,
  select_common_block_size,
)
from jaxkv.host import (
  BlockPool,
  BlockTable,
  CircularBufferManager,
  FullAttentionManager,
  KVCacheBlock,
  KVCacheManager,
  LinearAttentionStateManager,
  MultiGroupBlockTable,
  SingleTypeKVCacheManager,
  SlidingWindowManager,
  get_block_table_width,
  hash_block_tokens,
)
from jaxkv.step import (
  PAD_SLOT_ID,
  BlockRegion,
  BlockRegions,
  KernelTableGroup,
  SlotGroup,
  StepInputs,
  StepMetadata,
  StepMetadataSpec,
  compute_circular_slot_mapping,
  compute_compressed_slot_mapping,
  compute_slot_mapping,
  copy_blocks,
  gather_blocks,
  map_group_to_kernel_blocks,
  map_to_kernel_blocks,
  req_indices_from_query_start_loc,
  scatter_blocks,
)
from jaxkv.utils import cdiv, round_up

__version__ = "0.1.0"

# vLLM's front door, imported on first use (it brings the engine and the model).
_LAZY = {
  "LLM": "jaxkv.entrypoints.llm",
  "SamplingParams": "jaxkv.engine.request",
  "RequestOutput": "jaxkv.outputs",
  "CompletionOutput": "jaxkv.outputs",
  "Logprob": "jaxkv.outputs",
}


def __getattr__(name: str):
  if name in _LAZY:
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)
  raise AttributeError(f"module 'jaxkv' has no attribute {name!r}")


__all__ = [
  # vLLM's offline API (jaxkv.entrypoints)
  "LLM",
  "SamplingParams",
  "RequestOutput",
  "CompletionOutput",
  "Logprob",
  # The cache layer (jaxkv.cache): specs
  "KVCacheSpec",
  "AttentionSpec",
  "FullAttentionSpec",
  "MLAAttentionSpec",
  "SlidingWindowSpec",
  "CircularBufferSpec",
  "LinearAttentionStateSpec",
  "MultipleOf",
  "CacheDType",
  "CACHE_DTYPES",
  # Backends and attention groups
  "AttentionBackend",
  "customize_attention_spec",
  "is_block_size_supported",
  "select_common_block_size",
  "AttentionGroup",
  "KernelView",
  # Planner
  "LAYOUTS",
  "CacheConfig",
  "KVCacheConfig",
  "KVCacheGroupSpec",
  "KVCacheLayer",
  "KVCacheTensor",
  "plan_kv_cache",
  "render_plan",
  # The host layer (jaxkv.host)
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
  # The step layer (jaxkv.step): jitted functions
  "PAD_SLOT_ID",
  "compute_slot_mapping",
  "compute_circular_slot_mapping",
  "compute_compressed_slot_mapping",
  "req_indices_from_query_start_loc",
  "map_to_kernel_blocks",
  "map_group_to_kernel_blocks",
  "StepInputs",
  "StepMetadata",
  "StepMetadataSpec",
  "SlotGroup",
  "KernelTableGroup",
  # Whole manager blocks on the device (prefix-cache checkpoints, offload, swap: jaxkv.engine.offload)
  "BlockRegion",
  "BlockRegions",
  "copy_blocks",
  "gather_blocks",
  "scatter_blocks",
  "cdiv",
  "round_up",
]
