"""GLM-5.3-Flash (``glm5_next``): configuration, KV-cache layout, Flax model and checkpoint loading."""

from models.glm5_next.checkpoint import load_checkpoint, save_checkpoint
from models.glm5_next.config import BUILTIN_CONFIGS, Glm5NextConfig, get_config, load_config
from models.glm5_next.kv_cache import (
  KDA_BACKEND,
  KPOOL_TAIL_BACKEND,
  PAGED_MQA_PAGE_SIZES,
  SPARSE_MLA_BACKEND,
  get_kv_cache_layers,
  indexer_backend,
  tail_ring_size,
)
from models.glm5_next.model import Glm5NextForCausalLM

__all__ = [
  "BUILTIN_CONFIGS",
  "Glm5NextConfig",
  "Glm5NextForCausalLM",
  "get_config",
  "load_config",
  "load_checkpoint",
  "save_checkpoint",
  "KDA_BACKEND",
  "KPOOL_TAIL_BACKEND",
  "PAGED_MQA_PAGE_SIZES",
  "SPARSE_MLA_BACKEND",
  "get_kv_cache_layers",
  "indexer_backend",
  "tail_ring_size",
]
