"""The caches GLM-5.3-Flash keeps, as ``jaxkv`` layer specs and backends.

Per DSA layer: the MLA latent (a token cache), the pooled indexer keys (a compressed cache, one
entry per ``kpool`` tokens, read by paged MQA logits in 32/64-entry pages) and the kpool tail ring
(raw key + gate of the unfinished pool). Per KDA layer: the conv windows and recurrent state.
"""

from __future__ import annotations

from jaxkv.cache.attention_backend import AttentionBackend
from jaxkv.cache import CacheConfig, CacheDType, KVCacheLayer, check_cache_dtype
from jaxkv.cache.kv_cache_spec import CircularBufferSpec, LinearAttentionStateSpec, MLAAttentionSpec, MultipleOf
from jaxkv.utils import cdiv, next_power_of_2
from models.glm5_next.config import Glm5NextConfig
from pallas_kernels.cache_write import entry_bytes

__all__ = [
  "SPARSE_MLA_BACKEND",
  "KPOOL_TAIL_BACKEND",
  "KDA_BACKEND",
  "PAGED_MQA_PAGE_SIZES",
  "indexer_backend",
  "tail_ring_size",
  "get_kv_cache_layers",
]

# Pooled entries per page that the paged MQA logits kernel reads (DeepGEMM's block_kv).
PAGED_MQA_PAGE_SIZES = (32, 64)
# The sparse MLA kernel gathers single rows by token index: any multiple of 64 tokens.
SPARSE_MLA_BACKEND = AttentionBackend("glm5_sparse_mla", (MultipleOf(64),))
KPOOL_TAIL_BACKEND = AttentionBackend("kpool_tail", (MultipleOf(1),))
KDA_BACKEND = AttentionBackend("kda_state", ())


def indexer_backend(kpool: int) -> AttentionBackend:
  """Pages of 32 or 64 pooled entries: ``kpool * 32`` or ``kpool * 64`` tokens."""
  return AttentionBackend("glm5_indexer", tuple(kpool * p for p in PAGED_MQA_PAGE_SIZES))


def tail_ring_size(kpool: int, num_speculative_tokens: int = 0) -> int:
  """Ring slots, as vLLM 0.33.0 sizes them: ``kpool * next_pow2(cdiv(kpool + num_spec, kpool))``.

  Room for a rejected pool-completing draft without overwriting what its redo reads, rounded to a
  power of two pools so that the ring divides every power-of-two block size (kpool 4: no drafts
  4, 1-4 drafts 8, 5-12 drafts 16).
  """
  return kpool * next_power_of_2(cdiv(kpool + num_speculative_tokens, kpool))


def _cache_spec_args(dim: int, cache_dtype: str) -> dict:
  check_cache_dtype(cache_dtype, name="cache dtype")
  if cache_dtype == CacheDType.FP8:
    # dim fp8 values and one fp32 scale per 128 of them: 132 bytes for the 128-dim indexer key.
    return {"head_size": dim, "dtype": "uint8", "cache_dtype": "fp8", "state_content_bytes": entry_bytes(dim, "fp8")}
  return {"head_size": dim, "dtype": cache_dtype, "cache_dtype": cache_dtype}


def get_kv_cache_layers(
  config: Glm5NextConfig, cache_config: CacheConfig, *, tensor_parallel_size: int = 1
) -> list[KVCacheLayer]:
  """Every cache of the text tower (and of the MTP layer when drafting), in layer order.

  From ``cache_config``: ``block_size`` (token caches), ``kv_cache_dtype`` (MLA latents:
  ``"bfloat16"``, ``"float32"`` or ``"fp8"`` e4m3 + scales), ``indexer_cache_dtype`` (pooled keys:
  ``"fp8"``, 132-byte rows as vLLM serves them, or ``"bfloat16"`` / ``"float32"`` for exact runs),
  ``state_dtype`` (tail rings and KDA conv windows: the model dtype) and
  ``num_speculative_tokens`` (MTP drafts per step: adds the MTP layer's own DSA caches, layer index
  ``num_hidden_layers``, widens the tail rings and gives each KDA layer one state slot per draft,
  the rollback of rejected drafts).

  ``tensor_parallel_size``: in the dense layout each KDA layer's state is split by head over the
  tensor axis (each device's page holds its ``linear_num_heads / tp`` heads' conv windows and
  states, laid out as one device's page would be); in the packed layout one arena row holds every
  group's pages, so states stay whole on every device, as the latents and pooled keys do.
  """
  cache_config = cache_config.resolve_dtypes(config.dtype)  # "auto": the model's dtype
  block_size, state_dtype = cache_config.block_size, cache_config.state_dtype
  kv_cache_dtype, indexer_cache_dtype = cache_config.kv_cache_dtype, cache_config.indexer_cache_dtype
  num_speculative_tokens = cache_config.num_speculative_tokens
  if num_speculative_tokens and not config.num_nextn_predict_layers:
    raise ValueError(
      f"num_speculative_tokens={num_speculative_tokens} drafts with the MTP layer, but this config has "
      "num_nextn_predict_layers=0 (the checkpoint has no layers.N.* MTP tensors); use 0."
    )
  kpool = config.index_kpool
  ring = tail_ring_size(kpool, num_speculative_tokens)
  idx_backend = indexer_backend(kpool)
  tp = tensor_parallel_size
  shards = tp if cache_config.layout == "dense" else 1
  if config.linear_num_heads % shards:
    raise ValueError(
      f"tensor_parallel_size {tp} must divide linear_num_heads {config.linear_num_heads} to split "
      "the KDA states by head."
    )
  conv_width = config.linear_num_heads // shards * config.linear_head_dim
  kinds = list(config.layer_types) + (["indexed_attention"] if num_speculative_tokens else [])
  layers: list[KVCacheLayer] = []
  for i, kind in enumerate(kinds):
    prefix = f"layers.{i}.self_attn"
    if kind == "indexed_attention":
      layers.append(
        KVCacheLayer(
          f"{prefix}.mla",
          MLAAttentionSpec(
            block_size=block_size,
            num_kv_heads=1,
            cache_role="latent",
            **_cache_spec_args(config.kv_lora_rank, kv_cache_dtype),
          ),
          SPARSE_MLA_BACKEND,
        )
      )
      layers.append(
        KVCacheLayer(
          f"{prefix}.indexer",
          MLAAttentionSpec(
            block_size=block_size,
            num_kv_heads=1,
            cache_role="indexer",
            compress_ratio=kpool,
            **_cache_spec_args(config.index_head_dim, indexer_cache_dtype),
          ),
          idx_backend,
        )
      )
      layers.append(
        KVCacheLayer(
          f"{prefix}.indexer_tail",
          # Head slot 0 holds the raw key, slot 1 the gate, of each unfinished-pool token.
          CircularBufferSpec(
            block_size=ring, num_kv_heads=2, head_size=config.index_head_dim, head_size_v=0, dtype=state_dtype
          ),
          KPOOL_TAIL_BACKEND,
        )
      )
    else:
      k = config.linear_conv_kernel_dim - 1
      h, d = config.linear_num_heads // shards, config.linear_head_dim
      # Chunked prefill: the unfinished chunk's k, g, v rows and beta (fp32), after the state.
      chunk = cache_config.linear_prefill_chunk
      rows = () if chunk is None else ((chunk, h, d),) * 3 + ((chunk, h),)
      layers.append(
        KVCacheLayer(
          f"{prefix}.kda",
          # q, k, v conv windows, then the fp32 delta-rule state.
          LinearAttentionStateSpec(
            block_size=block_size,
            shapes=((k, conv_width),) * 3 + ((h, d, d),) + rows,
            dtypes=(state_dtype,) * 3 + ("float32",) * (1 + len(rows)),
            num_speculative_blocks=num_speculative_tokens,
          ),
          KDA_BACKEND,
          shards,
        )
      )
  return layers
