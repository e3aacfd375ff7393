"""AttentionGroup: layers of one KV-cache group that share a spec and a backend.

The kernel-block view is this object's concern, not the block table's (vLLM's
``vllm/v1/worker/utils.py``): the group chooses its kernel block size from its backend, takes the
stride from the real cache array when it binds it, and maps the manager-unit block table to kernel
blocks right before its metadata is built. Normal, padded (capture-size) and drafting builds all go
through the one ``map_to_kernel_block_table``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxkv.attention_backend import AttentionBackend, select_common_block_size
from jaxkv.attention_metadata import CommonAttentionMetadata
from jaxkv.kernel_blocks import map_to_kernel_blocks
from jaxkv.kv_cache_spec import AttentionSpec, KVCacheSpec

__all__ = ["AttentionGroup", "KernelPagedView"]


@dataclasses.dataclass(frozen=True)
class KernelPagedView:
  """A bound cache as kernel pages: kernel block ``k`` is ``rows[base_row + k, offset:offset + page_bytes]``.

  ``rows`` is the backing array, reshaped (free inside jit) when a packed compressed cache is
  re-strided into kernel pages; a packed arena keeps the other layers' bytes between this
  layer's pages, which kernel block ids skip over (``stride > blocks_per_kernel_block``).
  """

  rows: jax.Array | jax.ShapeDtypeStruct  # uint8 [num_rows, row_bytes]
  base_row: int
  offset_bytes: int
  page_bytes: int


@dataclasses.dataclass(eq=False)
class AttentionGroup:
  """Layers of one KV-cache group with the same spec and backend.

  Attributes:
    backend: the kernel family reading these layers.
    layer_names: the layers.
    kv_cache_spec: their (per-layer) spec, in manager blocks.
    kv_cache_group_id: index of the KV-cache group (block table) they use.
    kernel_block_size: tokens per kernel block when smaller than the manager block, else None.
    kernel_block_stride: kernel blocks between manager blocks; 0 until a packed cache is bound
      (then taken from the arena), meaning ``blocks_per_kernel_block``.
  """

  backend: AttentionBackend
  layer_names: tuple[str, ...]
  kv_cache_spec: KVCacheSpec
  kv_cache_group_id: int
  kernel_block_size: int | None = None
  kernel_block_stride: int = 0

  @classmethod
  def create(
      cls,
      backend: AttentionBackend,
      layer_names: tuple[str, ...],
      kv_cache_spec: KVCacheSpec,
      kv_cache_group_id: int,
      *,
      kernel_block_size: int | None = None,
  ) -> AttentionGroup:
    """Resolves the group's kernel block size.

    Args:
      kernel_block_size: the KV-cache group's requested kernel size (e.g. ``--kernel-block-size``
        for a dense split); the backend narrows it further if it cannot read it.

    Raises:
      ValueError: the size does not divide the manager block size, or no size fits the backend.
    """
    group = cls(backend, tuple(layer_names), kv_cache_spec, kv_cache_group_id)
    bs = kv_cache_spec.block_size
    if kv_cache_spec.is_state or not backend.supported_kernel_block_sizes:
      return group
    requested = bs if kernel_block_size is None else kernel_block_size
    if requested <= 0 or bs % requested:
      raise ValueError(
          f"Kernel block size {requested} does not divide the KV cache block size {bs} "
          f"(layers {', '.join(layer_names[:3])}{'...' if len(layer_names) > 3 else ''}). "
          f"Use a kernel block size that divides {bs}."
      )
    k = select_common_block_size(requested, [backend])
    if k != bs:
      group.kernel_block_size = k
    return group

  @property
  def blocks_per_kernel_block(self) -> int:
    if self.kernel_block_size is None:
      return 1
    return self.kv_cache_spec.block_size // self.kernel_block_size

  @property
  def stride(self) -> int:
    """Kernel blocks between consecutive manager blocks."""
    return self.kernel_block_stride or self.blocks_per_kernel_block

  @property
  def kernel_page_bytes(self) -> int:
    spec = self.kv_cache_spec
    return spec.copy_with_new_block_size(self.kernel_block_size or spec.block_size).page_size_bytes

  @property
  def states_per_kernel_page(self) -> int:
    return self.kv_cache_spec.get_num_kernel_states(self.kernel_block_size or self.kv_cache_spec.block_size)

  def map_kv_cache_to_kernel_blocks(
      self, kv_cache: jax.Array | jax.ShapeDtypeStruct, *, page_offset_bytes: int = 0
  ) -> KernelPagedView:
    """Views one layer's bound cache as kernel pages and sets ``kernel_block_stride``.

    Args:
      kv_cache: the real backing array, ``uint8[num_rows, row_bytes]``: a dense layer array
        already split into kernel pages (``row_bytes == kernel page``: stride stays
        ``blocks_per_kernel_block``), a dense layer array of whole manager pages, or the packed
        arena ``[num_blocks, bytes_per_block]`` (re-strided: stride = ``row_bytes / kernel page``).
      page_offset_bytes: where this layer's page starts inside each row (packed arenas).

    Raises:
      ValueError: the cache is a token cache (``tokens_per_state == 1``), has several head
        slots, or its rows are not whole kernel pages: "... cannot be split into ...".
    """
    spec = self.kv_cache_spec
    if kv_cache.ndim != 2 or kv_cache.dtype != jnp.uint8:
      raise ValueError(
          f"expected a uint8[num_rows, row_bytes] cache for {self.layer_names[0]}, got "
          f"{kv_cache.dtype}{list(kv_cache.shape)}."
      )
    page = self.kernel_page_bytes
    row_bytes = kv_cache.shape[1]
    if self.kernel_block_size is None or (row_bytes == page and page_offset_bytes == 0):
      # Unsplit, or a dense cache allocated already split: kernel block k is row k.
      return KernelPagedView(kv_cache, 0, page_offset_bytes, page)
    padded = isinstance(spec, AttentionSpec) and spec.page_size_padded is not None
    # Token caches are written through manager-unit slots, which address page b*bpk + off//kbs;
    # only compressed caches (written from the kernel table itself) may be re-strided.
    if (
        spec.tokens_per_state <= 1
        or padded
        or not isinstance(spec, AttentionSpec)
        or spec.num_heads != 1
        or row_bytes % page
        or page_offset_bytes % page
    ):
      kbs = self.kernel_block_size
      raise ValueError(
          f"{self.backend.name} needs {kbs}-token kernel blocks, which packed "
          f"{spec.block_size}-token KV cache blocks of {self.layer_names[0]} (rows of {row_bytes} "
          f"bytes, page offset {page_offset_bytes}, kernel page {page} bytes, "
          f"tokens_per_state {spec.tokens_per_state}) cannot be split into. Reduce --block-size "
          f"to {kbs} or use --layout dense."
      )
    self.kernel_block_stride = row_bytes // page
    return KernelPagedView(_as_pages(kv_cache, page), page_offset_bytes // page, 0, page)

  def map_to_kernel_block_table(
      self, block_table: jax.Array, kernel_block_table: jax.Array | None = None
  ) -> jax.Array:
    """The group's block table in kernel blocks (the manager table itself without a split).

    ``kernel_block_table`` is the group's persistent buffer; it is donated and reused.
    """
    if self.kernel_block_size is None:
      return block_table
    return map_to_kernel_blocks(block_table, self.blocks_per_kernel_block, self.stride, kernel_block_table)

  def init_kernel_block_table(self, max_num_reqs: int, width: int) -> jax.Array | None:
    """The persistent int32 ``[max_num_reqs, width * bpk]`` buffer, or None without a split."""
    if self.kernel_block_size is None:
      return None
    return jnp.zeros((max_num_reqs, width * self.blocks_per_kernel_block), jnp.int32)

  def build_metadata(
      self, common: CommonAttentionMetadata, kernel_block_table: jax.Array | None = None
  ) -> CommonAttentionMetadata:
    """Metadata of a normal step: the block table mapped to kernel blocks, slots unchanged."""
    return dataclasses.replace(common, block_table=self.map_to_kernel_block_table(common.block_table, kernel_block_table))

  # Padded (bucket-size) and drafting builds use the very same mapping: one code path, so a
  # draft or a padded batch can never see a differently mapped table.
  build_metadata_for_padded_batch = build_metadata
  build_metadata_for_drafting = build_metadata

  def describe(self) -> dict:
    return {
        "backend": str(self.backend),
        "layers": list(self.layer_names),
        "kv_cache_group_id": self.kv_cache_group_id,
        "kernel_block_size": self.kernel_block_size,
        "blocks_per_kernel_block": self.blocks_per_kernel_block,
        "kernel_block_stride": self.stride,
        "kernel_page_bytes": self.kernel_page_bytes,
    }


def _as_pages(kv_cache, page_bytes: int):
  num_rows, row_bytes = kv_cache.shape
  if isinstance(kv_cache, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct((num_rows * row_bytes // page_bytes, page_bytes), kv_cache.dtype)
  return kv_cache.reshape(num_rows * row_bytes // page_bytes, page_bytes)
