"""Manager-block tables to kernel-block tables: kernel block ``j`` of block ``b`` is ``b * stride + j``.

Dense split layouts have ``stride == blocks_per_kernel_block`` (the manager page is cut into
consecutive kernel pages). Packed layouts re-stride a compressed cache over whole packed blocks,
so the stride is taken from the real arena (``AttentionGroup.map_kv_cache_to_kernel_blocks``)
and is usually larger (e.g. 5 kernel pages per block while only 4 hold this layer's states).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from jaxkv.cache.attention_group import AttentionGroup

__all__ = ["map_to_kernel_blocks", "map_group_to_kernel_blocks", "map_to_kernel_blocks_reference"]


@functools.partial(
  jax.jit,
  static_argnames=("blocks_per_kernel_block", "stride"),
  donate_argnames=("out",),
)
def map_to_kernel_blocks(
  block_table: Int[Array, "R W"],
  blocks_per_kernel_block: int,
  stride: int,
  out: Int[Array, "R2 W2"] | None = None,
) -> Int[Array, "R2 W2"]:
  """Maps a manager-unit block table to kernel blocks.

  Every column is mapped, null entries included (they land on the null block's pages, which
  kernels never read past a row's length).

  Args:
    block_table: int32 ``[rows, width]`` manager block ids.
    blocks_per_kernel_block: kernel blocks per manager block (``bpk = block_size // kbs``).
    stride: kernel blocks between consecutive manager blocks (``bpk`` for dense splits).
    out: optional persistent int32 ``[rows2 >= rows, width2 >= width * bpk]`` buffer; it is
      donated and its top-left ``[rows, width * bpk]`` corner is overwritten, so a decode loop
      reuses the same device memory every step.

  Returns:
    ``out`` updated (or a new ``[rows, width * bpk]`` table).
  """
  rows, width = block_table.shape
  bpk = blocks_per_kernel_block
  if bpk < 1 or stride < bpk:
    raise ValueError(
      f"blocks_per_kernel_block={bpk} must be >= 1 and stride={stride} >= it "
      "(a manager block's kernel pages cannot overlap the next block's)."
    )
  offsets = jnp.arange(bpk, dtype=jnp.int32)
  mapped = (block_table.astype(jnp.int32)[:, :, None] * stride + offsets).reshape(rows, width * bpk)
  if out is None:
    return mapped
  if out.shape[0] < rows or out.shape[1] < width * bpk or out.dtype != jnp.int32:
    raise ValueError(
      f"out {out.dtype}{list(out.shape)} cannot hold the mapped int32[{rows}, {width * bpk}] "
      f"table (block_table {list(block_table.shape)} x {bpk} kernel blocks per block)."
    )
  return jax.lax.dynamic_update_slice(out, mapped, (0, 0))


def map_group_to_kernel_blocks(
  group: AttentionGroup, block_table: Int[Array, "R W"], out: Int[Array, "R2 W2"] | None = None
) -> Int[Array, "R2 W2"]:
  """``group``'s block table in kernel blocks (``map_to_kernel_blocks`` with its split and stride);
  the manager table itself when the group has no split. ``out``: its persistent buffer, donated."""
  if group.kernel_block_size is None:
    return block_table
  return map_to_kernel_blocks(block_table, group.blocks_per_kernel_block, group.stride, out)


def map_to_kernel_blocks_reference(block_table, blocks_per_kernel_block: int, stride: int):
  """Plain NumPy-style loop definition, for tests."""
  import numpy as np

  table = np.asarray(block_table)
  out = np.empty((table.shape[0], table.shape[1] * blocks_per_kernel_block), np.int32)
  for r in range(table.shape[0]):
    for c in range(table.shape[1]):
      for j in range(blocks_per_kernel_block):
        out[r, c * blocks_per_kernel_block + j] = table[r, c] * stride + j
  return out
