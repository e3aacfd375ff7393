"""The step layer: pure jitted functions of a step's tables (slot mappings, kernel blocks, step
metadata and inputs, whole-block copies)."""

from jaxkv.step.block_copy import BlockRegion, BlockRegions, copy_blocks, gather_blocks, scatter_blocks
from jaxkv.step.kernel_blocks import map_group_to_kernel_blocks, map_to_kernel_blocks
from jaxkv.step.slot_mapping import (
  PAD_SLOT_ID,
  compute_circular_slot_mapping,
  compute_compressed_slot_mapping,
  compute_slot_mapping,
  req_indices_from_query_start_loc,
)
from jaxkv.step.step_inputs import StepInputs
from jaxkv.step.step_metadata import KernelTableGroup, SlotGroup, StepMetadata, StepMetadataSpec

__all__ = [
  "PAD_SLOT_ID",
  "compute_slot_mapping",
  "compute_circular_slot_mapping",
  "compute_compressed_slot_mapping",
  "req_indices_from_query_start_loc",
  "map_to_kernel_blocks",
  "map_group_to_kernel_blocks",
  "StepInputs",
  "StepMetadata",
  "StepMetadataSpec",
  "SlotGroup",
  "KernelTableGroup",
  "BlockRegion",
  "BlockRegions",
  "copy_blocks",
  "gather_blocks",
  "scatter_blocks",
]
