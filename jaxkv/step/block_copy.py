"""Whole manager blocks moved on the device: copied, gathered out, scattered in (vLLM's
``copy_blocks`` / ``swap_blocks`` cache ops, in manager-block ids, never kernel blocks).

A manager block's bytes in one backing tensor are a contiguous range of row ``b`` once the tensor
is viewed as ``[num_blocks, block_stride_bytes]`` (a free reshape inside jit): in the packed arena
the whole block is one row, every layer of its group included; in the dense layout each layer's
tensor holds the block as ``blocks_per_kernel_block`` consecutive kernel rows. ``BlockRegions``
lists those ranges once per plan (for all groups, or the groups one caller moves), and every
function here is one gather or scatter per tensor over fixed-shape id vectors: padding ids
(``-1``) read the null block and write nothing.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int, UInt8

from jaxkv.cache.kv_cache_config import KVCacheConfig

__all__ = [
  "BlockRegion",
  "BlockRegions",
  "copy_blocks",
  "gather_blocks",
  "scatter_blocks",
  "copy_blocks_reference",
  "pad_block_ids",
]


@dataclasses.dataclass(frozen=True)
class BlockRegion:
  """Bytes ``[offset, offset + size)`` of each block's row in ``tensor`` viewed as
  ``[num_blocks, block_stride]``."""

  tensor: str
  block_stride: int
  offset: int
  size: int


@dataclasses.dataclass(frozen=True)
class BlockRegions:
  """Where a block's bytes live, tensor by tensor (static: a jit argument).

  ``bytes_per_block``: what one block of these groups occupies in all (what a tier stores).
  """

  num_blocks: int
  regions: tuple[BlockRegion, ...]

  @classmethod
  def from_plan(cls, plan: KVCacheConfig, group_ids: Iterable[int] | None = None) -> BlockRegions:
    """The bytes of the groups ``group_ids`` (default: every group).

    Packed: one range of the arena row, from byte 0 to the end of the last page of those groups
    (groups alias from byte 0, so a block of any of them lies in it). Dense: each layer's page; a
    tensor split over devices (``KVCacheTensor.shards``) holds one page per row on each device,
    so its region is the whole row of the array, every device's share.
    """
    ids = set(range(len(plan.kv_cache_groups)) if group_ids is None else group_ids)
    names = {n for g in ids for n in plan.kv_cache_groups[g].layer_names}
    views = [v for v in plan.views if v.layer_name in names]
    if plan.layout == "packed":
      end = max(v.tensor_offset_bytes + v.page_bytes for v in views)
      regions = (BlockRegion(views[0].tensor, plan.bytes_per_block, 0, end),)
    else:
      shards = {t.name: t.shards for t in plan.tensors}
      regions = []
      for v in views:
        n = shards[v.tensor]
        if n > 1 and not (v.tensor_offset_bytes == 0 and v.page_bytes == v.block_stride_bytes == v.row_bytes):
          raise ValueError(
            f"{v.layer_name}: a cache split over devices must fill its rows (one manager page "
            f"per row), got page {v.page_bytes} B at {v.tensor_offset_bytes} of {v.row_bytes} B rows."
          )
        regions.append(BlockRegion(v.tensor, n * v.block_stride_bytes, n * v.tensor_offset_bytes, n * v.page_bytes))
      regions = tuple(regions)
    return cls(plan.num_blocks, regions)

  @property
  def bytes_per_block(self) -> int:
    return sum(r.size for r in self.regions)


def _rows(caches: Mapping[str, jax.Array], r: BlockRegion, num_blocks: int) -> jax.Array:
  return caches[r.tensor].reshape(num_blocks, r.block_stride)


def _check_ids(name: str, ids) -> None:
  if ids.ndim != 1 or not jnp.issubdtype(ids.dtype, jnp.integer):
    raise ValueError(f"{name} must be a 1-D integer vector of block ids, got {ids.dtype}{list(ids.shape)}.")


@functools.partial(jax.jit, static_argnames="regions")
def gather_blocks(
  caches: Mapping[str, jax.Array], block_ids: Int[Array, " N"], *, regions: BlockRegions
) -> UInt8[Array, "N bytes_per_block"]:
  """The bytes of blocks ``block_ids`` (``-1``: the null block's), regions side by side."""
  _check_ids("block_ids", block_ids)
  ids = jnp.maximum(block_ids, 0)
  return jnp.concatenate(
    [_rows(caches, r, regions.num_blocks)[ids, r.offset : r.offset + r.size] for r in regions.regions], axis=1
  )


def _scatter(caches, block_ids, data, regions: BlockRegions):
  caches = dict(caches)
  ids = jnp.where(block_ids >= 0, block_ids, regions.num_blocks)  # -1 (padding) -> dropped
  at = 0
  for r in regions.regions:
    rows = _rows(caches, r, regions.num_blocks)
    rows = rows.at[ids, r.offset : r.offset + r.size].set(data[:, at : at + r.size], mode="drop")
    caches[r.tensor] = rows.reshape(caches[r.tensor].shape)
    at += r.size
  return caches


@functools.partial(jax.jit, static_argnames="regions", donate_argnums=0)
def scatter_blocks(
  caches: Mapping[str, jax.Array],
  block_ids: Int[Array, " N"],
  data: UInt8[Array, "N bytes_per_block"],
  *,
  regions: BlockRegions,
) -> dict[str, jax.Array]:
  """Writes ``data`` (as ``gather_blocks`` returns it) into blocks ``block_ids`` (``-1``: skipped);
  the caches are donated and updated in place."""
  _check_ids("block_ids", block_ids)
  if data.shape != (block_ids.shape[0], regions.bytes_per_block) or data.dtype != jnp.uint8:
    raise ValueError(
      f"data must be uint8[{block_ids.shape[0]}, {regions.bytes_per_block}] (one row per block id), "
      f"got {data.dtype}{list(data.shape)}."
    )
  return _scatter(caches, block_ids, data, regions)


@functools.partial(jax.jit, static_argnames="regions", donate_argnums=0)
def copy_blocks(
  caches: Mapping[str, jax.Array], src: Int[Array, " N"], dst: Int[Array, " N"], *, regions: BlockRegions
) -> dict[str, jax.Array]:
  """Copies block ``src[i]`` to block ``dst[i]`` (``dst[i] = -1``: skipped). Every source is read
  before any destination is written; destinations must be distinct. Caches donated."""
  _check_ids("src", src)
  _check_ids("dst", dst)
  if src.shape != dst.shape:
    raise ValueError(f"src {list(src.shape)} and dst {list(dst.shape)} must have one shape.")
  return _scatter(caches, dst, gather_blocks(caches, src, regions=regions), regions)


def copy_blocks_reference(
  caches: Mapping[str, np.ndarray], src, dst, *, regions: BlockRegions
) -> dict[str, np.ndarray]:
  """``copy_blocks`` in NumPy, pair by pair (tests)."""
  out = {k: np.array(v) for k, v in caches.items()}
  for s, d in zip(np.asarray(src), np.asarray(dst)):
    if d < 0:
      continue
    for r in regions.regions:
      rows = out[r.tensor].reshape(regions.num_blocks, r.block_stride)
      rows[d, r.offset : r.offset + r.size] = np.asarray(caches[r.tensor]).reshape(regions.num_blocks, r.block_stride)[
        max(s, 0), r.offset : r.offset + r.size
      ]
  return out


def pad_block_ids(pairs: list[tuple[int, int]], size: int) -> tuple[np.ndarray, np.ndarray]:
  """``(src, dst)`` int32 vectors of ``size`` entries from ``(src, dst)`` pairs, padded with -1."""
  if len(pairs) > size:
    raise ValueError(f"{len(pairs)} block copies exceed the {size} a call takes.")
  ids = np.full((2, size), -1, np.int32)
  if pairs:
    ids[:, : len(pairs)] = np.asarray(pairs, np.int32).T
  return ids[0], ids[1]
