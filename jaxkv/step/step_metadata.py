"""A step's block-table metadata: every group's slot mapping and every attention group's kernel table.

What the model needs of the block tables in one step, computed together before it runs
(``pallas_kernels.compute_step_metadata``: one Pallas launch on a GPU, the jnp functions of
``jaxkv.step.slot_mapping`` and ``jaxkv.step.kernel_blocks`` as reference and CPU path):

* per KV-cache group, the tokens' manager-unit slots (token groups, ``compute_slot_mapping``) or
  ring slots (``CircularBufferSpec`` groups, ``compute_circular_slot_mapping``); None for
  recurrent-state groups, which are addressed by state slot;
* per attention group of a compressed cache (pooled indexer keys), the page-unit slots of the
  states its tokens complete (``compute_compressed_slot_mapping`` over the group's kernel table);
* per attention group with a kernel split, its kernel-block table (``b * stride + j``), written
  into its persistent, donated buffer.

``StepMetadataSpec`` is the static part (from the plan, hashable: one jit argument);
``StepMetadata`` holds the arrays (a pytree, carried in ``StepInputs.metadata``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jaxtyping import Array, Int

from jaxkv.cache.attention_group import AttentionGroup
from jaxkv.cache.kv_cache_spec import CircularBufferSpec

__all__ = ["SlotGroup", "KernelTableGroup", "StepMetadataSpec", "StepMetadata"]

SLOT_KINDS = ("tokens", "ring", "none")


@dataclasses.dataclass(frozen=True)
class SlotGroup:
  """How one KV-cache group's tokens are addressed.

  Attributes:
    kind: ``"tokens"`` (manager-unit slots), ``"ring"`` (circular buffer of ``block_size``
      slots) or ``"none"`` (recurrent state: no per-token slot).
    block_size: the group's manager block size (the ring capacity for a ring).
  """

  kind: str
  block_size: int

  def __post_init__(self):
    if self.kind not in SLOT_KINDS or self.block_size < 1:
      raise ValueError(
        f"SlotGroup kind must be one of {SLOT_KINDS} with block_size >= 1, got {self.kind!r}, {self.block_size}."
      )


@dataclasses.dataclass(frozen=True)
class KernelTableGroup:
  """One attention group's share of the metadata.

  Attributes:
    kv_cache_group_id: the block table it maps.
    blocks_per_kernel_block, stride: kernel block ``j`` of block ``b`` is ``b * stride + j``.
    mapped: whether it has a kernel split (a kernel-block table is written).
    states_per_page, compress_ratio: for a compressed cache (``compress_ratio > 1``), its states
      per kernel page and tokens per state; 0 otherwise (no compressed slots).
  """

  kv_cache_group_id: int
  blocks_per_kernel_block: int = 1
  stride: int = 1
  mapped: bool = False
  states_per_page: int = 0
  compress_ratio: int = 0

  def __post_init__(self):
    if self.blocks_per_kernel_block < 1 or self.stride < self.blocks_per_kernel_block:
      raise ValueError(
        f"blocks_per_kernel_block={self.blocks_per_kernel_block} must be >= 1 and "
        f"stride={self.stride} >= it (a block's kernel pages cannot overlap the next block's)."
      )
    if self.compressed and self.states_per_page < 1:
      raise ValueError(
        f"a compressed cache (compress_ratio {self.compress_ratio}) needs states_per_page >= 1, "
        f"got {self.states_per_page}."
      )

  @classmethod
  def from_attention_group(cls, group: AttentionGroup) -> KernelTableGroup:
    """The step's share of a resolved ``AttentionGroup`` (its stride taken from the arrays): the
    one place its numbers are read, so the two records cannot disagree."""
    spec = group.kv_cache_spec
    compressed = not spec.is_state and spec.tokens_per_state > 1
    return cls(
      group.kv_cache_group_id,
      group.blocks_per_kernel_block,
      group.stride,
      mapped=group.kernel_block_size is not None,
      states_per_page=group.states_per_kernel_page if compressed else 0,
      compress_ratio=spec.tokens_per_state if compressed else 0,
    )

  @property
  def compressed(self) -> bool:
    return self.compress_ratio > 1


@dataclasses.dataclass(frozen=True)
class StepMetadataSpec:
  """The static description of a step's metadata (``from_plan``), one jit argument.

  Attributes:
    slot_groups: per KV-cache group.
    attention_groups: per attention group of the plan.
    dcp_size, dcp_rank, dcp_interleave: decode-context parallelism of the token groups (this
      rank's share, as ``compute_slot_mapping``).
    implementation: ``"pallas"`` (one launch), ``"xla"`` (the jnp functions) or ``"auto"`` (the
      kernel on a GPU, jnp on the CPU); the results are identical integers either way.
  """

  slot_groups: tuple[SlotGroup, ...]
  attention_groups: tuple[KernelTableGroup, ...]
  dcp_size: int = 1
  dcp_rank: int = 0
  dcp_interleave: int = 1
  implementation: str = "auto"

  def __post_init__(self):
    if self.implementation not in ("auto", "pallas", "xla"):
      raise ValueError(f"implementation must be 'auto', 'pallas' or 'xla', got {self.implementation!r}.")
    if not 0 <= self.dcp_rank < self.dcp_size or self.dcp_interleave < 1:
      raise ValueError(
        f"invalid DCP sharding: rank {self.dcp_rank} of {self.dcp_size}, interleave {self.dcp_interleave}."
      )
    for i, ag in enumerate(self.attention_groups):
      if not 0 <= ag.kv_cache_group_id < len(self.slot_groups):
        raise ValueError(
          f"attention group {i} names KV-cache group {ag.kv_cache_group_id}; the spec has {len(self.slot_groups)}."
        )
      if (ag.mapped or ag.compressed) and self.slot_groups[ag.kv_cache_group_id].kind != "tokens":
        raise ValueError(
          f"attention group {i} maps KV-cache group {ag.kv_cache_group_id}, a "
          f"{self.slot_groups[ag.kv_cache_group_id].kind!r} group; only token groups have kernel "
          "blocks."
        )

  @classmethod
  def from_plan(
    cls, plan, *, dcp_size: int = 1, dcp_rank: int = 0, dcp_interleave: int = 1, implementation: str = "auto"
  ) -> StepMetadataSpec:
    """The spec of a ``KVCacheConfig``'s groups and resolved attention groups."""
    slot_groups = []
    for g in plan.kv_cache_groups:
      spec = g.kv_cache_spec
      kind = "ring" if isinstance(spec, CircularBufferSpec) else "none" if spec.is_state else "tokens"
      slot_groups.append(SlotGroup(kind, spec.block_size))
    attention_groups = tuple(KernelTableGroup.from_attention_group(ag) for ag in plan.attention_groups)
    return cls(tuple(slot_groups), attention_groups, dcp_size, dcp_rank, dcp_interleave, implementation)

  @property
  def slot_outputs(self) -> tuple[tuple[str, int], ...]:
    """The rows of the kernel's stacked slot output, in order: ``("group", g)`` per token or ring
    group, then ``("compressed", a)`` per compressed attention group."""
    return tuple(("group", g) for g, sg in enumerate(self.slot_groups) if sg.kind != "none") + tuple(
      ("compressed", a) for a, ag in enumerate(self.attention_groups) if ag.compressed
    )

  @property
  def mapped_groups(self) -> tuple[int, ...]:
    """Attention groups that have a kernel-block table."""
    return tuple(a for a, ag in enumerate(self.attention_groups) if ag.mapped)


@functools.partial(
  jax.tree_util.register_dataclass,
  data_fields=["slot_mappings", "compressed_slot_mappings", "kernel_block_tables"],
  meta_fields=["spec"],
)
@dataclasses.dataclass(frozen=True)
class StepMetadata:
  """One step's metadata arrays (``compute_step_metadata``); None where a group has none.

  Attributes:
    spec: the static spec they were computed with (a draft step over the same tables recomputes
      its slots with it).
    slot_mappings: per KV-cache group, int32 ``[T]`` manager-unit or ring slots (-1: writes
      nothing), None for recurrent-state groups.
    compressed_slot_mappings: per attention group, int32 ``[T]`` page-unit slots of the state
      each token completes (-1: none), None for groups without a compressed cache.
    kernel_block_tables: per attention group, int32 ``[max_num_reqs, width * bpk]`` kernel-block
      table, None without a split (the manager table is read as is).
  """

  slot_mappings: tuple[Int[Array, " T"] | None, ...]
  compressed_slot_mappings: tuple[Int[Array, " T"] | None, ...]
  kernel_block_tables: tuple[Int[Array, "R Wk"] | None, ...]
  spec: StepMetadataSpec
