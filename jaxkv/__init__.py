"""jaxkv: paged KV-cache management for LLM inference in JAX and Pallas.

Block tables and slot mappings are in KV-cache-manager blocks; each attention group maps its table
to the kernel blocks its backend reads (kernel block ``j`` of block ``b`` is ``b * stride + j``).
"""

from jaxkv.attention_backend import (
    AttentionBackend,
    customize_attention_spec,
    is_block_size_supported,
    select_common_block_size,
)
from jaxkv.attention_group import AttentionGroup
from jaxkv.block_copy import BlockRegion, BlockRegions, copy_blocks, gather_blocks, scatter_blocks
from jaxkv.block_pool import BlockPool, KVCacheBlock
from jaxkv.block_table import BlockTable, MultiGroupBlockTable, get_block_table_width
from jaxkv.kernel_blocks import map_to_kernel_blocks
from jaxkv.kernel_view import KernelView
from jaxkv.kv_cache_config import (
    LAYOUTS,
    CacheConfig,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheLayer,
    KVCacheTensor,
    plan_kv_cache,
)
from jaxkv.kv_cache_report import render_plan
from jaxkv.kv_cache_manager import (
    CircularBufferManager,
    FullAttentionManager,
    KVCacheManager,
    LinearAttentionStateManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
    hash_block_tokens,
)
from jaxkv.kv_cache_spec import (
    AttentionSpec,
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheSpec,
    LinearAttentionStateSpec,
    MLAAttentionSpec,
    MultipleOf,
    SlidingWindowSpec,
)
from jaxkv.step_inputs import StepInputs
from jaxkv.step_metadata import KernelTableGroup, SlotGroup, StepMetadata, StepMetadataSpec
from jaxkv.utils import cdiv, round_up
from jaxkv.slot_mapping import (
    PAD_SLOT_ID,
    compute_circular_slot_mapping,
    compute_compressed_slot_mapping,
    compute_slot_mapping,
    req_indices_from_query_start_loc,
)

__version__ = "0.1.0"

__all__ = [
    # Specs
    "KVCacheSpec",
    "AttentionSpec",
    "FullAttentionSpec",
    "MLAAttentionSpec",
    "SlidingWindowSpec",
    "CircularBufferSpec",
    "LinearAttentionStateSpec",
    "MultipleOf",
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
    # Host bookkeeping
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
    # Jitted functions
    "PAD_SLOT_ID",
    "compute_slot_mapping",
    "compute_circular_slot_mapping",
    "compute_compressed_slot_mapping",
    "req_indices_from_query_start_loc",
    "map_to_kernel_blocks",
    "StepInputs",
    "StepMetadata",
    "StepMetadataSpec",
    "SlotGroup",
    "KernelTableGroup",
    # Whole manager blocks on the device (prefix-cache checkpoints, offload, swap: jaxkv.kv_offload)
    "BlockRegion",
    "BlockRegions",
    "copy_blocks",
    "gather_blocks",
    "scatter_blocks",
    "cdiv",
    "round_up",
]
