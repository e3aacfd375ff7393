"""KV-cache specs: what one layer stores per manager block, as frozen dataclasses.

Mirrors vLLM's ``vllm/v1/kv_cache_interface.py``. A spec describes one layer's page: the bytes
one manager block of ``block_size`` tokens occupies. Pages are made of *states* (one per token for
token caches, one per ``tokens_per_state`` tokens for compressed caches), each
``state_content_size_bytes`` long, times ``num_heads`` head slots.

Sizes are in bytes throughout; dtypes are names accepted by ``numpy.dtype`` once ``ml_dtypes`` is
imported (``"bfloat16"``, ``"float8_e4m3fn"``, ``"float32"``, ``"uint8"``).
"""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes  # noqa: F401  (registers bfloat16 / float8 names with numpy)
import numpy as np

from jaxkv.cache.cache_dtype import check_cache_dtype
from jaxkv.utils import cdiv

__all__ = [
  "MultipleOf",
  "KVCacheSpec",
  "AttentionSpec",
  "FullAttentionSpec",
  "MLAAttentionSpec",
  "SlidingWindowSpec",
  "CircularBufferSpec",
  "LinearAttentionStateSpec",
  "dtype_size",
]


def dtype_size(dtype: str) -> int:
  """Bytes per element of a dtype name."""
  return np.dtype(dtype).itemsize


@dataclasses.dataclass(frozen=True)
class MultipleOf:
  """A kernel block size constraint: any multiple of ``base`` tokens (vLLM's ``MultipleOf``)."""

  base: int

  def __post_init__(self):
    if self.base <= 0:
      raise ValueError(f"MultipleOf base must be positive, got {self.base}.")

  def __str__(self) -> str:
    return f"MultipleOf({self.base})"


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
  """Base spec.

  Attributes:
    block_size: tokens per KV-cache-manager block.
    block_stride_alignment: bytes the stride between physical blocks must be a multiple of:
      an int, ``MultipleOf(tokens)`` (resolved by ``get_block_stride_alignment`` against the
      final block size), or None (no constraint).
  """

  block_size: int
  block_stride_alignment: int | MultipleOf | None = None

  def __post_init__(self):
    if self.block_size <= 0:
      raise ValueError(f"block_size must be positive, got {self.block_size}.")
    a = self.block_stride_alignment
    if isinstance(a, int) and not isinstance(a, bool) and a <= 0:
      raise ValueError(f"block_stride_alignment must be positive, got {a}.")

  # Overridden by subclasses.
  @property
  def page_size_bytes(self) -> int:
    raise NotImplementedError

  @property
  def tokens_per_state(self) -> int:
    """Tokens per stored state: 1 for token caches, >1 compressed, -1 for per-request state."""
    return 1

  @property
  def uses_slot_mapping(self) -> bool:
    """Whether the generic manager-unit slot mapping addresses this cache."""
    return True

  @property
  def prefix_cacheable(self) -> bool:
    return True

  @property
  def is_state(self) -> bool:
    """One block per request for its lifetime (ring or recurrent state)."""
    return False

  def get_num_kernel_states(self, kernel_block_size: int) -> int:
    """States in one page of ``kernel_block_size`` tokens."""
    tps = self.tokens_per_state
    return kernel_block_size // tps if tps > 0 else 1

  @property
  def num_states(self) -> int:
    return self.get_num_kernel_states(self.block_size)

  def max_num_blocks_per_req(self, max_model_len: int) -> int:
    return cdiv(max_model_len, self.block_size)

  def max_memory_usage_bytes(self, max_model_len: int) -> int:
    """Bytes one request of ``max_model_len`` tokens can hold in this layer."""
    return self.max_num_blocks_per_req(max_model_len) * self.page_size_bytes

  def copy_with_new_block_size(self, block_size: int) -> KVCacheSpec:
    return dataclasses.replace(self, block_size=block_size)

  def get_block_stride_alignment(self) -> int:
    """Resolves ``block_stride_alignment`` to bytes against the final block size.

    ``MultipleOf(base)`` means the backend reads ``gcd(base, block_size)``-token kernel pages;
    the block stride must then be a whole number of such pages, or anything (1) when one kernel
    page is the whole block.
    """
    a = self.block_stride_alignment
    if not isinstance(a, MultipleOf):
      return a or 1
    k = math.gcd(a.base, self.block_size)
    if k == self.block_size:
      return 1
    return self.copy_with_new_block_size(k).page_size_bytes

  def describe(self) -> dict:
    """A JSON-ready summary (used by ``jaxkv inspect``)."""
    out = {"type": type(self).__name__}
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      out[f.name] = str(v) if isinstance(v, MultipleOf) else v
    out["page_size_bytes"] = self.page_size_bytes
    out["tokens_per_state"] = self.tokens_per_state
    out["uses_slot_mapping"] = self.uses_slot_mapping
    out["resolved_block_stride_alignment"] = self.get_block_stride_alignment()
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
  """A paged attention cache: ``num_heads`` head slots x ``num_states`` states x content bytes.

  Attributes:
    num_kv_heads: KV heads (head slots unless ``num_head_slots`` is given).
    head_size: K width; ``head_size_v`` the V width (0 for latent/indexer caches).
    dtype: element dtype name of the content as stored (``"uint8"`` for fp8 entries with scales).
    cache_dtype: the entry encoding the kernels decode (``CacheDType``: ``"bfloat16"``,
      ``"float32"`` or ``"fp8"``); None for a cache no kernel decodes (``dtype`` then says all).
    state_content_bytes: explicit content bytes per state (packed fp8 rows with scales).
    compress_ratio: tokens per state (> 1: compressed cache such as pooled indexer keys).
    page_size_padded: pad each page to this many bytes (pages cannot then be split).
  """

  num_kv_heads: int
  head_size: int
  dtype: str
  cache_dtype: str | None = None
  head_size_v: int | None = None
  num_head_slots: int | None = None
  state_content_bytes: int | None = None
  compress_ratio: int = 1
  page_size_padded: int | None = None

  def __post_init__(self):
    super().__post_init__()
    if self.cache_dtype is not None:
      check_cache_dtype(self.cache_dtype, name="cache_dtype")
    if self.compress_ratio < 1:
      raise ValueError(f"compress_ratio must be >= 1, got {self.compress_ratio}.")
    if self.block_size % self.compress_ratio:
      raise ValueError(
        f"block_size {self.block_size} must be a multiple of the compression ratio "
        f"{self.compress_ratio} (a state never straddles two blocks)."
      )
    if self.page_size_padded is not None and self.page_size_padded < self.unpadded_page_size_bytes:
      raise ValueError(
        f"page_size_padded {self.page_size_padded} is smaller than the page {self.unpadded_page_size_bytes}."
      )

  @property
  def tokens_per_state(self) -> int:
    return self.compress_ratio

  @property
  def num_heads(self) -> int:
    return self.num_head_slots or self.num_kv_heads

  @property
  def state_content_size_bytes(self) -> int:
    if self.state_content_bytes is not None:
      return self.state_content_bytes
    hv = self.head_size if self.head_size_v is None else self.head_size_v
    return (self.head_size + hv) * dtype_size(self.dtype)

  @property
  def unpadded_page_size_bytes(self) -> int:
    return self.num_heads * self.num_states * self.state_content_size_bytes

  @property
  def page_size_bytes(self) -> int:
    return self.page_size_padded or self.unpadded_page_size_bytes


@dataclasses.dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
  """Every token's K/V is kept for the request's life."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
  """An MLA latent cache or an indexer key cache (``cache_role``); one head slot, no V.

  The GLM-5.3-Flash pooled indexer key is ``MLAAttentionSpec(head_size=128, dtype="uint8",
  cache_dtype="fp8", state_content_bytes=132, compress_ratio=4, cache_role="indexer")``: 128 fp8 values and one fp32
  scale per 4 tokens.
  """

  head_size_v: int | None = 0
  cache_role: str = "latent"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
  """Only the last ``sliding_window`` tokens are attended; older blocks are freed."""

  sliding_window: int

  def max_num_blocks_per_req(self, max_model_len: int) -> int:
    # Blocks wholly below the window are released, but the table row keeps their (null) slots.
    return cdiv(max_model_len, self.block_size)

  def max_memory_usage_bytes(self, max_model_len: int) -> int:
    live = cdiv(min(self.sliding_window - 1 + self.block_size, max_model_len), self.block_size) + 1
    return min(live, self.max_num_blocks_per_req(max_model_len)) * self.page_size_bytes


@dataclasses.dataclass(frozen=True, kw_only=True)
class CircularBufferSpec(AttentionSpec):
  """A ring of ``block_size`` token slots, one block per request for life (the kpool tail).

  Addressed by ``table[r, 0] * ring + pos % ring`` (``compute_circular_slot_mapping``), never by
  the generic slot mapping, whose column ``pos // block_size`` is unbounded on a one-column row.
  """

  @property
  def uses_slot_mapping(self) -> bool:
    return False

  @property
  def prefix_cacheable(self) -> bool:
    return False

  @property
  def is_state(self) -> bool:
    return True

  def max_num_blocks_per_req(self, max_model_len: int) -> int:
    return 1

  def max_memory_usage_bytes(self, max_model_len: int) -> int:
    return self.page_size_bytes


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinearAttentionStateSpec(KVCacheSpec):
  """Per-request recurrent state of a linear-attention layer (KDA conv windows + delta state).

  One slot (block) per request for life, independent of its length, plus one per speculative
  token (vLLM's ``MambaSpec.num_speculative_blocks``): a verify step writes the state after each of
  its last ``1 + num_speculative_blocks`` tokens to its own slot, and the next step reads the slot
  of the last accepted token, so rejected drafts never touch the state it continues from.
  ``block_size`` is nominal (the manager block size) and does not change the page.

  Attributes:
    shapes: shape of each state tensor, e.g. ``((3, 8192),) * 3 + ((64, 128, 128),)``.
    dtypes: dtype name of each state tensor.
    num_speculative_blocks: extra state slots per request for speculative decoding.
  """

  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[str, ...]
  num_speculative_blocks: int = 0

  def __post_init__(self):
    super().__post_init__()
    if len(self.shapes) != len(self.dtypes):
      raise ValueError(f"{len(self.shapes)} state shapes but {len(self.dtypes)} dtypes.")
    if self.num_speculative_blocks < 0:
      raise ValueError(f"num_speculative_blocks must be >= 0, got {self.num_speculative_blocks}.")

  @property
  def tokens_per_state(self) -> int:
    return -1

  @property
  def uses_slot_mapping(self) -> bool:
    return False

  @property
  def prefix_cacheable(self) -> bool:
    return False

  @property
  def is_state(self) -> bool:
    return True

  @property
  def tensor_bytes(self) -> tuple[int, ...]:
    return tuple(math.prod(s) * dtype_size(d) for s, d in zip(self.shapes, self.dtypes))

  @property
  def page_size_bytes(self) -> int:
    return sum(self.tensor_bytes)

  def max_num_blocks_per_req(self, max_model_len: int) -> int:
    return 1 + self.num_speculative_blocks

  def max_memory_usage_bytes(self, max_model_len: int) -> int:
    return self.max_num_blocks_per_req(max_model_len) * self.page_size_bytes
