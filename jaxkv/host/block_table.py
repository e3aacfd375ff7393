"""Host block tables in KV-cache-manager blocks (NumPy), committed to the device once per step.

Mirrors vLLM's ``BlockTable`` / ``MultiGroupBlockTable`` after the kernel-block change: rows hold
manager block ids only; kernel blocks are an attention group's concern.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from jaxkv.utils import cdiv

__all__ = ["BlockTable", "MultiGroupBlockTable", "get_block_table_width"]


def get_block_table_width(max_num_blocks: int, block_size: int, *, token_alignment: int | None = None) -> int:
  """Row width, rounded up so a row spans a multiple of ``token_alignment`` tokens if given."""
  if token_alignment is None:
    return max_num_blocks
  step = token_alignment // np.gcd(token_alignment, block_size)
  return cdiv(max_num_blocks, step) * step


class BlockTable:
  """``int32[max_num_reqs, width]`` manager block ids of one KV-cache group, plus row counts."""

  def __init__(self, block_size: int, max_num_reqs: int, max_num_blocks_per_req: int, *, group_id: int = 0):
    if block_size <= 0 or max_num_reqs <= 0 or max_num_blocks_per_req <= 0:
      raise ValueError(
        f"block_size {block_size}, max_num_reqs {max_num_reqs} and max_num_blocks_per_req "
        f"{max_num_blocks_per_req} must all be positive."
      )
    self.block_size = block_size
    self.group_id = group_id
    self.block_table = np.zeros((max_num_reqs, max_num_blocks_per_req), np.int32)
    self.num_blocks_per_row = np.zeros(max_num_reqs, np.int32)

  @property
  def max_num_reqs(self) -> int:
    return self.block_table.shape[0]

  @property
  def width(self) -> int:
    return self.block_table.shape[1]

  def _check_row(self, row: int) -> None:
    if not 0 <= row < self.max_num_reqs:
      raise RuntimeError(f"Block table row {row} of group {self.group_id} is outside [0, {self.max_num_reqs}).")

  def _check_append(self, row: int, num_new: int) -> int:
    """The row's end after appending ``num_new`` ids; raises before anything is written."""
    self._check_row(row)
    end = int(self.num_blocks_per_row[row]) + num_new
    if end > self.width:
      raise RuntimeError(
        f"Block table write for request {row}, group {self.group_id} exceeds row capacity "
        f"({end} > {self.width}). Raise max_model_len or free blocks first."
      )
    return end

  def append_row(self, block_ids: Sequence[int], row: int) -> None:
    """Appends manager block ids after the row's current ones."""
    end = self._check_append(row, len(block_ids))
    self.block_table[row, end - len(block_ids) : end] = block_ids
    self.num_blocks_per_row[row] = end

  def add_row(self, block_ids: Sequence[int], row: int) -> None:
    """Replaces the row with ``block_ids``."""
    self._check_row(row)
    self.num_blocks_per_row[row] = 0
    self.append_row(block_ids, row)

  def clear_row(self, row: int) -> None:
    self._check_row(row)
    self.block_table[row] = 0
    self.num_blocks_per_row[row] = 0

  def move_row(self, src: int, tgt: int) -> None:
    """Moves row ``src`` to ``tgt`` and zeroes ``src`` (stale ids must not look like live slots)."""
    self._check_row(src)
    self._check_row(tgt)
    self.block_table[tgt] = self.block_table[src]
    self.num_blocks_per_row[tgt] = self.num_blocks_per_row[src]
    self.clear_row(src)

  def swap_row(self, a: int, b: int) -> None:
    self._check_row(a)
    self._check_row(b)
    self.block_table[[a, b]] = self.block_table[[b, a]]
    self.num_blocks_per_row[[a, b]] = self.num_blocks_per_row[[b, a]]

  def clear(self) -> None:
    self.block_table.fill(0)
    self.num_blocks_per_row.fill(0)


class MultiGroupBlockTable:
  """One ``BlockTable`` per KV-cache group, with row operations applied to all of them."""

  def __init__(self, block_sizes: Sequence[int], max_num_reqs: int, max_num_blocks: Sequence[int]):
    if len(block_sizes) != len(max_num_blocks):
      raise ValueError(f"{len(block_sizes)} block sizes but {len(max_num_blocks)} widths.")
    self.block_tables = [
      BlockTable(bs, max_num_reqs, w, group_id=g) for g, (bs, w) in enumerate(zip(block_sizes, max_num_blocks))
    ]

  def __getitem__(self, group: int) -> BlockTable:
    return self.block_tables[group]

  def __len__(self) -> int:
    return len(self.block_tables)

  def append_row(self, block_ids: Sequence[Sequence[int]], row: int) -> None:
    """``block_ids[g]`` are appended to group ``g``'s row. All groups are checked before any write."""
    for bt, ids in zip(self.block_tables, block_ids, strict=True):
      bt._check_append(row, len(ids))
    for bt, ids in zip(self.block_tables, block_ids):
      bt.append_row(ids, row)

  def add_row(self, block_ids: Sequence[Sequence[int]], row: int) -> None:
    for bt in self.block_tables:
      bt.clear_row(row)
    self.append_row(block_ids, row)

  def clear_row(self, row: int) -> None:
    for bt in self.block_tables:
      bt.clear_row(row)

  def move_row(self, src: int, tgt: int) -> None:
    for bt in self.block_tables:
      bt.move_row(src, tgt)

  def swap_row(self, a: int, b: int) -> None:
    for bt in self.block_tables:
      bt.swap_row(a, b)

  def clear(self) -> None:
    for bt in self.block_tables:
      bt.clear()

  def commit(self, device=None) -> tuple[tuple[jax.Array, jax.Array], ...]:
    """All groups' ``(block_table, num_blocks_per_row)`` in one host-to-device transfer.

    Shapes are fixed (``[max_num_reqs, width]``), so jitted consumers never recompile.
    """
    # Copies: on the CPU backend device_put may alias NumPy memory that the next step mutates.
    host = tuple((bt.block_table.copy(), bt.num_blocks_per_row.copy()) for bt in self.block_tables)
    return jax.device_put(host, device)
