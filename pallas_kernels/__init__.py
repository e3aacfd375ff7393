"""Pallas GPU kernels of jaxkv, each with a plain-jnp reference of the same arguments.

Every public entry point takes ``implementation="pallas"`` (the kernel; interpret mode on the CPU)
or ``"xla"`` (the reference). Measured numbers: ``docs/kernels.md``.
"""

from pallas_kernels._common import device_shared_memory_bytes, read_rows, resolve_implementation, write_rows
from pallas_kernels.cache_write import (
  decode_entries,
  encode_entries,
  entry_bytes,
  write_to_paged_cache,
  write_to_paged_cache_reference,
)
from pallas_kernels.kda_chunk import ChunkPrefix, chunk_delta_rule, chunk_kda, chunk_kda_reference
from pallas_kernels.kda_recurrence import delta_rule_step, fused_recurrent_kda, fused_recurrent_kda_reference
from pallas_kernels.mhc_mix import mhc_mix, mhc_mix_reference
from pallas_kernels.kpool import (
  combine_pool,
  indexer_page_bytes,
  kpool_compress_and_write,
  kpool_compress_and_write_reference,
  read_indexer_entries,
)
from pallas_kernels.paged_mqa_logits import paged_mqa_logits, paged_mqa_logits_reference
from pallas_kernels.sparse_mla_decode import sparse_mla_decode, sparse_mla_decode_reference
from pallas_kernels.step_metadata import compute_step_metadata, compute_step_metadata_reference
from pallas_kernels.top_k import top_k, top_k_reference
from pallas_kernels.topk_selection import select_topk_tokens, select_topk_tokens_reference

__all__ = [
  "write_to_paged_cache",
  "write_to_paged_cache_reference",
  "encode_entries",
  "decode_entries",
  "entry_bytes",
  "fused_recurrent_kda",
  "fused_recurrent_kda_reference",
  "delta_rule_step",
  "chunk_kda",
  "chunk_kda_reference",
  "chunk_delta_rule",
  "ChunkPrefix",
  "kpool_compress_and_write",
  "kpool_compress_and_write_reference",
  "combine_pool",
  "indexer_page_bytes",
  "read_indexer_entries",
  "paged_mqa_logits",
  "paged_mqa_logits_reference",
  "select_topk_tokens",
  "select_topk_tokens_reference",
  "sparse_mla_decode",
  "sparse_mla_decode_reference",
  "compute_step_metadata",
  "compute_step_metadata_reference",
  "top_k",
  "top_k_reference",
  "mhc_mix",
  "mhc_mix_reference",
  # What "auto" means on this device, and the device's shared memory (kernel tiles).
  "resolve_implementation",
  "device_shared_memory_bytes",
  # Rows of a page array read, and written in place (the KDA kernel's reference and the KDA pages).
  "read_rows",
  "write_rows",
]
