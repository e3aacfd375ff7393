"""Slot mappings in KV-cache-manager units, as pure jitted functions over fixed-shape buffers.

A slot is a flat token index into a layer's cache viewed as ``[num_blocks * block_size, ...]``:
``slot = table[r, p // bs] * bs + p % bs``. Because ``b*bs + off == (b*bpk + off//kbs)*kbs +
off%kbs``, the same slot addresses a dense kernel split, so writers never see kernel blocks.
``PAD_SLOT_ID`` (-1) marks tokens that write nothing; kernels must turn it into an out-of-range
index before a scatter (JAX wraps -1 to the last element).

Per-token inputs are ``req_indices[t]`` (the block-table row of token ``t``, -1 for padding) and
``positions[t]``; ``req_indices_from_query_start_loc`` derives the former from vLLM-style
``query_start_loc``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

__all__ = [
  "PAD_SLOT_ID",
  "block_slots",
  "compute_slot_mapping",
  "compute_circular_slot_mapping",
  "compute_compressed_slot_mapping",
  "req_indices_from_query_start_loc",
]

PAD_SLOT_ID = -1


def _gather_block(block_table, num_blocks_per_row, req_indices, block_idx):
  """``table[r, block_idx]`` and whether that entry is a live block of a real request."""
  rows, width = block_table.shape
  valid = (req_indices >= 0) & (req_indices < rows) & (block_idx >= 0) & (block_idx < width)
  r = jnp.where(valid, req_indices, 0)
  c = jnp.where(valid, block_idx, 0)
  valid &= block_idx < num_blocks_per_row[r]
  return block_table[r, c], valid


def block_slots(block_table, req_indices, positions, *, block_size: int, num_blocks_per_row=None):
  """The slot formula, ``table[r, p // bs] * bs + p % bs``, and whether it names a live block.

  The one definition that writers (``compute_slot_mapping``) and readers (sparse MLA) share.
  Without ``num_blocks_per_row`` every in-range column counts as live.
  """
  counts = (
    num_blocks_per_row if num_blocks_per_row is not None else jnp.full(block_table.shape[:1], block_table.shape[1])
  )
  block, valid = _gather_block(block_table, counts, req_indices, positions // block_size)
  return block * block_size + positions % block_size, valid


def token_slots(
  block_table,
  num_blocks_per_row,
  req_indices,
  positions,
  *,
  block_size: int,
  dcp_size: int = 1,
  dcp_rank: int = 0,
  dcp_interleave: int = 1,
):
  """``compute_slot_mapping``'s formula, unjitted: the tables may be arrays or Pallas refs."""
  if dcp_size > 1:
    virtual = block_size * dcp_size
    vblock, voff = positions // virtual, positions % virtual
    is_local = (voff // dcp_interleave) % dcp_size == dcp_rank
    local_pos = vblock * block_size + (voff // (dcp_interleave * dcp_size)) * dcp_interleave + voff % dcp_interleave
  else:
    is_local = True
    local_pos = positions
  slot, valid = block_slots(
    block_table, req_indices, local_pos, block_size=block_size, num_blocks_per_row=num_blocks_per_row
  )
  valid &= is_local & (positions >= 0)
  return jnp.where(valid, slot, PAD_SLOT_ID).astype(jnp.int32)


def circular_slots(block_table, req_indices, positions, *, ring_size: int):
  """``compute_circular_slot_mapping``'s formula, unjitted (arrays or Pallas refs)."""
  rows = block_table.shape[0]
  valid = (req_indices >= 0) & (req_indices < rows) & (positions >= 0)
  block = block_table[jnp.where(valid, req_indices, 0), 0]
  valid &= block > 0
  return jnp.where(valid, block * ring_size + positions % ring_size, PAD_SLOT_ID).astype(jnp.int32)


def compressed_slots(page_of, req_indices, positions, *, states_per_page: int, compress_ratio: int):
  """``compute_compressed_slot_mapping``'s formula, unjitted.

  ``page_of(req_indices, kernel_block_idx) -> (page, valid)`` looks up the kernel-block table: a
  gather from the mapped table, or (inside the step-metadata kernel) ``b * stride + j`` computed
  from the manager table directly.
  """
  state = positions // compress_ratio
  page, valid = page_of(req_indices, state // states_per_page)
  # p % r == r - 1 rather than (p + 1) % r == 0: no overflow at p = 2**31 - 1.
  valid &= (positions >= 0) & (positions % compress_ratio == compress_ratio - 1)
  return jnp.where(valid, page * states_per_page + state % states_per_page, PAD_SLOT_ID).astype(jnp.int32)


def split_block_lookup(block_table, num_blocks_per_row, *, blocks_per_kernel_block: int, stride: int):
  """``page_of`` for ``compressed_slots`` straight from the manager table: kernel block ``kb`` of a
  row is ``table[r, kb // bpk] * stride + kb % bpk``, live while ``kb // bpk`` is a live block."""

  def page_of(req_indices, kb):
    block, valid = _gather_block(block_table, num_blocks_per_row, req_indices, kb // blocks_per_kernel_block)
    return block * stride + kb % blocks_per_kernel_block, valid & (kb >= 0)

  return page_of


def _check_dcp(dcp_size: int, dcp_rank: int, dcp_interleave: int) -> None:
  if not 0 <= dcp_rank < dcp_size or dcp_interleave < 1:
    raise ValueError(f"invalid DCP sharding: rank {dcp_rank} of {dcp_size}, interleave {dcp_interleave}.")


@functools.partial(
  jax.jit,
  static_argnames=("block_size", "uses_slot_mapping", "dcp_size", "dcp_rank", "dcp_interleave"),
)
def compute_slot_mapping(
  block_table: Int[Array, "R W"],
  num_blocks_per_row: Int[Array, " R"],
  req_indices: Int[Array, " T"],
  positions: Int[Array, " T"],
  *,
  block_size: int,
  uses_slot_mapping: bool = True,
  dcp_size: int = 1,
  dcp_rank: int = 0,
  dcp_interleave: int = 1,
) -> Int[Array, " T"]:
  """Manager-unit slots for one KV-cache group.

  With decode context parallelism (``dcp_size > 1``) each rank keeps ``block_size`` tokens of
  every ``block_size * dcp_size`` logical tokens, dealt out in runs of ``dcp_interleave``; a
  token owned by another rank gets -1 (vLLM's ``_compute_slot_mappings_kernel``).

  Args:
    block_table: int32 ``[rows, width]`` manager block ids.
    num_blocks_per_row: int32 ``[rows]``; entries at or past a row's count are never read.
    req_indices: int32 ``[num_tokens]`` row of each token, -1 for padding tokens.
    positions: int32 ``[num_tokens]`` absolute token positions.
    block_size: manager block size of the group (static).
    uses_slot_mapping: False for ring and state groups: every slot is -1.
    dcp_size, dcp_rank, dcp_interleave: decode-context-parallel sharding of this group.

  Returns:
    int32 ``[num_tokens]`` slots, -1 for padding tokens, padded requests, tokens of other DCP
    ranks, disabled groups and blocks past the row's count.
  """
  if not uses_slot_mapping:
    return jnp.full(positions.shape, PAD_SLOT_ID, jnp.int32)
  _check_dcp(dcp_size, dcp_rank, dcp_interleave)
  return token_slots(
    block_table,
    num_blocks_per_row,
    req_indices,
    positions.astype(jnp.int32),
    block_size=block_size,
    dcp_size=dcp_size,
    dcp_rank=dcp_rank,
    dcp_interleave=dcp_interleave,
  )


@functools.partial(jax.jit, static_argnames=("ring_size",))
def compute_circular_slot_mapping(
  block_table: Int[Array, "R W"],
  req_indices: Int[Array, " T"],
  positions: Int[Array, " T"],
  *,
  ring_size: int,
) -> Int[Array, " T"]:
  """Slots in a ``CircularBufferSpec`` ring: ``table[r, 0] * ring + p % ring``.

  In bounds for any position (a 500k-token prompt included): only column 0 is ever read. -1 for
  padding tokens, negative positions and rows holding the null block 0.
  """
  return circular_slots(block_table, req_indices, positions, ring_size=ring_size)


@functools.partial(jax.jit, static_argnames=("states_per_page", "compress_ratio"))
def compute_compressed_slot_mapping(
  kernel_block_table: Int[Array, "R K"],
  num_kernel_blocks_per_row: Int[Array, " R"],
  req_indices: Int[Array, " T"],
  positions: Int[Array, " T"],
  *,
  states_per_page: int,
  compress_ratio: int,
) -> Int[Array, " T"]:
  """Page-unit slots of a compressed cache (e.g. pooled indexer keys), from the kernel table.

  The token completing a state (``(p + 1) % compress_ratio == 0``) gets the slot of state
  ``e = p // compress_ratio``: ``kt[r, e // P] * P + e % P`` (P = ``states_per_page``), i.e. page
  ``slot // P``, entry ``slot % P`` of the re-strided kernel view. Every other token gets -1.
  (vLLM's ``get_compressed_slot_mapping``.)
  """

  def page_of(req, kb):
    return _gather_block(kernel_block_table, num_kernel_blocks_per_row, req, kb)

  return compressed_slots(
    page_of, req_indices, positions.astype(jnp.int32), states_per_page=states_per_page, compress_ratio=compress_ratio
  )


@functools.partial(jax.jit, static_argnames=("num_tokens",))
def req_indices_from_query_start_loc(
  query_start_loc: Int[Array, " R1"],
  num_reqs: Int[Array, ""],
  *,
  num_tokens: int,
) -> Int[Array, " T"]:
  """Row of each of ``num_tokens`` (bucketed) tokens: ``r`` for ``qsl[r] <= t < qsl[r+1]``, else -1."""
  t = jnp.arange(num_tokens, dtype=jnp.int32)
  r = jnp.searchsorted(query_start_loc[1:], t, side="right").astype(jnp.int32)
  return jnp.where((r < num_reqs) & (t < query_start_loc[num_reqs]), r, -1)
