"""AttentionGroup: layers of one KV-cache group that share a spec and a backend.

The kernel-block view is this object's concern, not the block table's (vLLM's
``vllm/v1/worker/utils.py``): the group chooses its kernel block size from its backend, the planner
resolves its stride from the real cache array, and the step maps the manager-unit block table to
kernel blocks into the group's persistent buffer. Normal, padded (bucket-size) and drafting steps
all map it the same way (``map_to_kernel_block_table``; in the engine, with the slot mappings
in one launch: ``pallas_kernels.compute_step_metadata``). The group is frozen: the planner builds it
resolved (``resolve``), nothing changes it afterwards.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxkv.cache.attention_backend import AttentionBackend, select_common_block_size
from jaxkv.cache.kernel_view import KernelView
from jaxkv.cache.kv_cache_spec import AttentionSpec, KVCacheSpec

__all__ = ["AttentionGroup"]


@dataclasses.dataclass(frozen=True)
class AttentionGroup:
  """Layers of one KV-cache group with the same spec and backend.

  Attributes:
    backend: the kernel family reading these layers.
    layer_names: the layers.
    kv_cache_spec: their (per-layer) spec, in manager blocks.
    kv_cache_group_id: index of the KV-cache group (block table) they use.
    kernel_block_size: tokens per kernel block when smaller than the manager block, else None.
    kernel_block_stride: kernel blocks between manager blocks, as the planner resolved it from
      the backing arrays (None before: ``blocks_per_kernel_block``).
  """

  backend: AttentionBackend
  layer_names: tuple[str, ...]
  kv_cache_spec: KVCacheSpec
  kv_cache_group_id: int
  kernel_block_size: int | None = None
  kernel_block_stride: int | None = None

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
      kernel_block_size: the KV-cache group's requested kernel size (a dense split); the backend
        narrows it further if it cannot read it.

    Raises:
      ValueError: the size does not divide the manager block size, or no size fits the backend.
    """
    bs = kv_cache_spec.block_size
    names = tuple(layer_names)
    if kv_cache_spec.is_state or not backend.supported_kernel_block_sizes:
      return cls(backend, names, kv_cache_spec, kv_cache_group_id)
    requested = bs if kernel_block_size is None else kernel_block_size
    if requested <= 0 or bs % requested:
      raise ValueError(
        f"Kernel block size {requested} does not divide the KV cache block size {bs} "
        f"(layers {', '.join(names[:3])}{'...' if len(names) > 3 else ''}). "
        f"Use a kernel_block_size that divides {bs}."
      )
    k = select_common_block_size(requested, [backend])
    return cls(backend, names, kv_cache_spec, kv_cache_group_id, None if k == bs else k)

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
    self,
    layer_name: str,
    tensor: str,
    tensor_shape: tuple[int, int],
    *,
    page_offset_bytes: int = 0,
    block_stride_bytes: int | None = None,
    attention_group_id: int = 0,
  ) -> KernelView:
    """Views one layer's backing array as kernel pages (pure: the stride is in the returned view).

    Args:
      layer_name, tensor: the layer and the name of its backing array.
      tensor_shape: ``(num_rows, row_bytes)`` of the uint8 backing array: a dense layer array
        already split into kernel pages (``row_bytes == kernel page``: stride stays
        ``blocks_per_kernel_block``), a dense layer array of whole manager pages, or the packed
        arena ``[num_blocks, bytes_per_block]`` (re-strided: stride = ``row_bytes / kernel page``).
      page_offset_bytes: where this layer's page starts inside each row (packed arenas).
      block_stride_bytes: bytes between manager blocks (default: one row).
      attention_group_id: this group's index in the plan.

    Raises:
      ValueError: the cache is a token cache (``tokens_per_state == 1``), has several head
        slots, or its rows are not whole kernel pages: "... cannot be split into ...".
    """
    spec = self.kv_cache_spec
    num_rows, row_bytes = tensor_shape
    page = self.kernel_page_bytes
    bpk = self.blocks_per_kernel_block
    kbs = self.kernel_block_size
    common = dict(
      layer_name=layer_name,
      tensor=tensor,
      kv_cache_group_id=self.kv_cache_group_id,
      attention_group_id=attention_group_id,
      block_size=spec.block_size,
      kernel_block_size=kbs,
      blocks_per_kernel_block=bpk,
      page_bytes=spec.page_size_bytes,
      kernel_page_bytes=page,
      entries_per_page=self.states_per_kernel_page,
      tensor_offset_bytes=page_offset_bytes,
      block_stride_bytes=row_bytes if block_stride_bytes is None else block_stride_bytes,
      cache_dtype=spec.cache_dtype if isinstance(spec, AttentionSpec) else None,
    )
    if kbs is None or (row_bytes == page and page_offset_bytes == 0):
      # Unsplit, or a dense cache allocated already split: kernel block k is row k.
      return KernelView(
        stride=bpk,
        row_bytes=row_bytes,
        base_row=0,
        offset_bytes=page_offset_bytes,
        tokens_per_row=kbs or spec.block_size,
        **common,
      )
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
      raise ValueError(
        f"{self.backend.name} needs {kbs}-token kernel blocks, which packed "
        f"{spec.block_size}-token KV cache blocks of {layer_name} (rows of {row_bytes} "
        f"bytes, page offset {page_offset_bytes}, kernel page {page} bytes, "
        f"tokens_per_state {spec.tokens_per_state}) cannot be split into. Reduce block_size "
        f"to {kbs} or use layout='dense'."
      )
    return KernelView(
      stride=row_bytes // page,
      row_bytes=page,
      base_row=page_offset_bytes // page,
      offset_bytes=0,
      tokens_per_row=kbs,
      **common,
    )

  def resolve(self, stride: int) -> AttentionGroup:
    """The group with its stride taken from the backing arrays (the planner calls this once)."""
    if stride < self.blocks_per_kernel_block:
      raise ValueError(
        f"stride {stride} of {self.layer_names[0]} is below its {self.blocks_per_kernel_block} "
        "kernel blocks per block (a block's pages would overlap the next block's)."
      )
    return dataclasses.replace(self, kernel_block_stride=stride)

  def init_kernel_block_table(self, max_num_reqs: int, width: int) -> jax.Array | None:
    """The persistent int32 ``[max_num_reqs, width * bpk]`` buffer, or None without a split."""
    if self.kernel_block_size is None:
      return None
    return jnp.zeros((max_num_reqs, width * self.blocks_per_kernel_block), jnp.int32)

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
