"""StepInputs: what one step tells the model, in fixed (bucketed) shapes (a pytree of arrays)."""

from __future__ import annotations

import dataclasses
import functools

import jax

from jaxtyping import Array, Int

from jaxkv.step.step_metadata import StepMetadata

__all__ = ["StepInputs"]


@functools.partial(jax.tree_util.register_dataclass)
@dataclasses.dataclass(frozen=True)
class StepInputs:
  """One step's per-token inputs, every group's block table, and the metadata derived from them.

  Attributes:
    input_ids, positions, req_indices: int32 ``[T]`` (padding tokens: ``req_indices == -1``); a
      request's tokens are contiguous and in position order.
    block_tables: per KV-cache group, int32 ``[max_num_reqs, width]`` manager block ids.
    num_blocks: per KV-cache group, int32 ``[max_num_reqs]``.
    metadata: the step's slot mappings and kernel-block tables
      (``pallas_kernels.compute_step_metadata`` over the tables and tokens above).
    state_slots: int32 ``[max_num_reqs]``: the linear-attention state slot each request
      continues from (the last, ``num_speculative_tokens``, unless drafts were rejected).
    num_prompt_tokens: int32 ``[max_num_reqs]``: each request's prompt length (chunked
      linear-attention prefill runs the positions below its last chunk boundary chunkwise); None
      when no token of the step lies below that bound (decode steps: the chunked path is left
      out of the compiled step) or the plan has no chunked prefill.
  """

  input_ids: Int[Array, " T"]
  positions: Int[Array, " T"]
  req_indices: Int[Array, " T"]
  block_tables: tuple[Int[Array, "R W"], ...]
  num_blocks: tuple[Int[Array, " R"], ...]
  metadata: StepMetadata
  state_slots: Int[Array, " R"]
  num_prompt_tokens: Int[Array, " R"] | None = None
