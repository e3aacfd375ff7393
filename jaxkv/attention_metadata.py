"""Per-step attention metadata shared by all attention groups of a KV-cache group (a pytree)."""

from __future__ import annotations

import dataclasses
import functools

import jax
from jaxtyping import Array, Int

__all__ = ["CommonAttentionMetadata"]


@functools.partial(jax.tree_util.register_dataclass)
@dataclasses.dataclass(frozen=True)
class CommonAttentionMetadata:
  """What one step tells every backend, in fixed (bucketed) shapes.

  All fields are arrays that change per step; the bucket sizes are their shapes.

  Attributes:
    block_table: int32 ``[max_num_reqs, width]`` manager block ids (kernel blocks once an
      ``AttentionGroup`` has built its metadata).
    num_blocks_per_row: int32 ``[max_num_reqs]``.
    slot_mapping: int32 ``[num_tokens]`` manager-unit slots, -1 for padding.
    req_indices: int32 ``[num_tokens]`` block-table row of each token, -1 for padding.
    positions: int32 ``[num_tokens]``.
    seq_lens: int32 ``[max_num_reqs]`` tokens each request has after this step (0 for padding).
    query_start_loc: int32 ``[max_num_reqs + 1]``.
    num_reqs: int32 ``[]`` live requests in this step.
  """

  block_table: Int[Array, "R W"]
  num_blocks_per_row: Int[Array, "R"]
  slot_mapping: Int[Array, "T"]
  req_indices: Int[Array, "T"]
  positions: Int[Array, "T"]
  seq_lens: Int[Array, "R"]
  query_start_loc: Int[Array, "R1"]
  num_reqs: Int[Array, ""]
