"""KernelView: one layer's cache as the kernels address it, resolved once by the planner.

The backing tensor ``uint8[num_rows, tensor_row_bytes]`` is viewed (a free reshape inside jit) as
rows of ``row_bytes``; the layer's kernel block ``k`` is view row ``base_row + k``, its page
starting at byte ``offset_bytes`` of that row. Three cases cover every layer:

* unsplit (kernel block = manager block), dense or packed: view rows are the tensor's rows,
  ``base_row = 0``, ``offset_bytes`` = the layer's page offset in a packed block;
* dense split: the layer's own tensor was allocated as kernel pages, so again rows are rows and
  ``stride = blocks_per_kernel_block``;
* packed re-strided compressed cache: rows of one kernel page over the whole arena,
  ``base_row = page_offset / kernel_page``, ``offset_bytes = 0`` and
  ``stride = bytes_per_block / kernel_page`` (other layers' bytes lie between this layer's pages).

The view also carries how an entry is encoded (``cache_dtype``, from the layer's spec), so a
kernel takes the view alone: where the pages are and how to read them come from one record.

The view is frozen and hashable: kernels take it as one static argument.
"""

from __future__ import annotations

import dataclasses

__all__ = ["KernelView", "find_view"]


@dataclasses.dataclass(frozen=True)
class KernelView:
  """Where one layer's pages live and how its kernels index them.

  Attributes:
    layer_name: the cache (``layers.3.self_attn.indexer``).
    tensor: name of the backing array in the plan's tensors.
    kv_cache_group_id: the block table this layer uses; attention_group_id: its attention group.
    block_size: manager block size of the layer's group (ring capacity for a circular buffer).
    kernel_block_size: tokens per kernel block when the backend splits blocks, else None.
    blocks_per_kernel_block: kernel blocks per manager block (1 without a split).
    stride: kernel blocks between consecutive manager blocks (``b * stride + j``).
    row_bytes: length of a view row; base_row: the layer's first view row; offset_bytes: its page
      inside a view row.
    page_bytes: the manager page of the layer; kernel_page_bytes: one kernel block's page.
    tokens_per_row: token entries per view row (slot-addressed caches: ``slot // tokens_per_row``).
    entries_per_page: cache entries per kernel page (pooled entries for compressed caches).
    tensor_offset_bytes: the page's offset inside a row of the backing tensor.
    block_stride_bytes: bytes between consecutive manager blocks' pages in the tensor.
    cache_dtype: the entry encoding (``CacheDType``: ``"bfloat16"``, ``"float32"``, ``"fp8"``);
      None for caches no kernel decodes (tail rings, states).
  """

  layer_name: str
  tensor: str
  kv_cache_group_id: int
  attention_group_id: int
  block_size: int
  kernel_block_size: int | None
  blocks_per_kernel_block: int
  stride: int
  row_bytes: int
  base_row: int
  offset_bytes: int
  page_bytes: int
  kernel_page_bytes: int
  tokens_per_row: int
  entries_per_page: int
  tensor_offset_bytes: int
  block_stride_bytes: int
  cache_dtype: str | None = None

  @classmethod
  def for_rows(
    cls,
    row_bytes: int,
    *,
    tokens_per_row: int = 1,
    entries_per_page: int = 1,
    base_row: int = 0,
    offset_bytes: int = 0,
    block_size: int | None = None,
    layer_name: str = "cache",
    cache_dtype: str | None = None,
  ) -> KernelView:
    """A view of a bare ``uint8[num_rows, row_bytes]`` array, one kernel block per row (tests,
    benchmarks, caches not made by the planner)."""
    bs = block_size or tokens_per_row
    return cls(
      layer_name=layer_name,
      tensor=layer_name,
      kv_cache_group_id=0,
      attention_group_id=0,
      block_size=bs,
      kernel_block_size=None,
      blocks_per_kernel_block=1,
      stride=1,
      row_bytes=row_bytes,
      base_row=base_row,
      offset_bytes=offset_bytes,
      page_bytes=row_bytes,
      kernel_page_bytes=row_bytes,
      tokens_per_row=tokens_per_row,
      entries_per_page=entries_per_page,
      tensor_offset_bytes=offset_bytes,
      block_stride_bytes=row_bytes,
      cache_dtype=cache_dtype,
    )

  def require_cache_dtype(self, kernel: str, allowed: tuple[str, ...]) -> str:
    """The entry encoding, checked against what ``kernel`` reads (ValueError naming both)."""
    if self.cache_dtype not in allowed:
      raise ValueError(
        f"{kernel} reads {allowed} entries, but the view of {self.layer_name} has cache_dtype "
        f"{self.cache_dtype!r}; plan the cache with one of them or give "
        "KernelView.for_rows(..., cache_dtype=...)."
      )
    return self.cache_dtype

  def with_offset(self, extra_bytes: int) -> KernelView:
    """The same rows, addressed ``extra_bytes`` further into the page (a second head slot)."""
    return dataclasses.replace(self, offset_bytes=self.offset_bytes + extra_bytes)


def find_view(views: tuple[KernelView, ...], layer_name: str) -> KernelView:
  """The view of ``layer_name`` among a plan's ``views`` (KeyError naming the first few there)."""
  for v in views:
    if v.layer_name == layer_name:
      return v
  raise KeyError(f"no layer {layer_name!r} in the plan; it has {', '.join(v.layer_name for v in views[:4])}...")
