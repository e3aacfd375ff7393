"""Ports of vLLM's tests/v1/worker/test_attn_utils.py (packed and split mapping, token-cache error)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import (
  map_group_to_kernel_blocks,
  AttentionBackend,
  AttentionGroup,
  FullAttentionSpec,
  MLAAttentionSpec,
  MultipleOf,
)

INDEXER = AttentionBackend("glm5_indexer", (128, 256))
ROW = 132


def bind(group, shape, page_offset_bytes=0):
  """The planner's two steps: view the array, then resolve the group's stride from the view."""
  view = group.map_kv_cache_to_kernel_blocks(group.layer_names[0], "arena", shape, page_offset_bytes=page_offset_bytes)
  return group.resolve(view.stride), view


def rows_of(arena, view):
  return np.asarray(arena).reshape(-1, view.row_bytes)


def kpool_spec(block_size=1024, tps=4, row=ROW):
  return MLAAttentionSpec(
    block_size=block_size,
    num_kv_heads=1,
    head_size=128,
    dtype="uint8",
    state_content_bytes=row,
    compress_ratio=tps,
    block_stride_alignment=MultipleOf(256),
  )


def test_packed_compressed_group_gets_restrided_kernel_table():
  group = AttentionGroup.create(INDEXER, ("idx",), kpool_spec(), 0, kernel_block_size=1024)
  assert group.kernel_block_size == 256 and group.blocks_per_kernel_block == 4
  # Three packed blocks of 320 rows of 132 bytes; this layer's 256 states are the first 256 rows.
  rng = np.random.default_rng(0)
  arena = jnp.asarray(rng.integers(0, 256, (3, 320 * ROW), dtype=np.uint8))
  group, view = bind(group, arena.shape)
  assert group.kernel_block_stride == 5 and view.stride == 5
  assert view.row_bytes == 64 * ROW and view.base_row == 0 and view.kernel_page_bytes == 64 * ROW
  kt = map_group_to_kernel_blocks(group, jnp.array([[0, 2]], jnp.int32))
  np.testing.assert_array_equal(kt, [[0, 1, 2, 3, 10, 11, 12, 13]])
  # Pages 10..13, flattened, are manager block 2's 256 states.
  pages = rows_of(arena, view)[np.asarray(kt[0, 4:])].reshape(-1)
  np.testing.assert_array_equal(pages, np.asarray(arena)[2, : 256 * ROW])


def test_split_group_keeps_dense_stride():
  group = AttentionGroup.create(INDEXER, ("idx",), kpool_spec(), 0, kernel_block_size=256)
  cache = jnp.zeros((12, 64 * ROW), jnp.uint8)  # allocated already split: 3 blocks x 4 pages
  group, view = bind(group, cache.shape)
  assert view.row_bytes == cache.shape[1] and view.base_row == 0 and group.stride == 4
  np.testing.assert_array_equal(
    map_group_to_kernel_blocks(group, jnp.array([[0, 2]], jnp.int32)), [[0, 1, 2, 3, 8, 9, 10, 11]]
  )


def test_packed_token_cache_cannot_be_split():
  spec = MLAAttentionSpec(block_size=1024, num_kv_heads=1, head_size=1152, dtype="uint8", state_content_bytes=1152)
  group = AttentionGroup.create(AttentionBackend("sparse", (64,)), ("mla",), spec, 0, kernel_block_size=1024)
  assert group.kernel_block_size == 64
  arena = jax.ShapeDtypeStruct((3, 2048 * 1152), jnp.uint8)
  with pytest.raises(ValueError, match="cannot be split into. Reduce block_size to 64 or use layout='dense'"):
    bind(group, arena.shape)


def test_packed_compressed_cache_misaligned_offset_raises():
  group = AttentionGroup.create(INDEXER, ("idx",), kpool_spec(), 0)
  with pytest.raises(ValueError, match="page offset 132"):
    bind(group, (3, 320 * ROW), page_offset_bytes=ROW)


def test_packed_offset_layer_addresses_its_own_pages():
  group = AttentionGroup.create(INDEXER, ("idx",), kpool_spec(), 0)
  rng = np.random.default_rng(1)
  arena = jnp.asarray(rng.integers(0, 256, (3, 384 * ROW), dtype=np.uint8))
  group, view = bind(group, arena.shape, page_offset_bytes=64 * ROW)  # another layer's page first
  assert group.kernel_block_stride == 6 and view.base_row == 1
  kt = np.asarray(map_group_to_kernel_blocks(group, jnp.array([[1]], jnp.int32)))
  got = rows_of(arena, view)[view.base_row + kt[0]].reshape(-1)
  np.testing.assert_array_equal(got, np.asarray(arena)[1, 64 * ROW : 320 * ROW])


def test_kernel_block_size_must_divide_block_size():
  with pytest.raises(ValueError, match="Kernel block size 96 does not divide the KV cache block size 1024"):
    AttentionGroup.create(AttentionBackend("any", (MultipleOf(32),)), ("l",), kpool_spec(), 0, kernel_block_size=96)


def test_no_split_without_kernel_size():
  spec = FullAttentionSpec(block_size=64, num_kv_heads=1, head_size=8, dtype="float32")
  group = AttentionGroup.create(AttentionBackend("any"), ("l",), spec, 0)
  assert group.kernel_block_size is None and group.stride == 1
  table = jnp.array([[3, 4]], jnp.int32)
  assert map_group_to_kernel_blocks(group, table) is table


def test_group_is_frozen_and_resolved_once():
  group = AttentionGroup.create(INDEXER, ("idx",), kpool_spec(), 0)
  with pytest.raises(dataclasses.FrozenInstanceError):
    group.kernel_block_stride = 3
  resolved, _ = bind(group, (8, 320 * ROW))
  assert group.kernel_block_stride is None and resolved.stride == 5  # binding returned a new group
  with pytest.raises(ValueError, match="stride 3 of idx is below its 4 kernel blocks per block"):
    group.resolve(3)


def test_persistent_kernel_table_is_donated_and_rewritten():
  group, _ = bind(AttentionGroup.create(INDEXER, ("idx",), kpool_spec(), 0), (8, 320 * ROW))
  rng = np.random.default_rng(2)
  buf = group.init_kernel_block_table(4, 2)
  for _ in range(3):
    table = jnp.asarray(rng.permutation(8)[:6].reshape(3, 2).astype(np.int32))
    out = map_group_to_kernel_blocks(group, table, buf)
    assert buf.is_deleted() and out.shape == (4, 8)
    np.testing.assert_array_equal(np.asarray(out)[:3], (np.asarray(table)[:, :, None] * 5 + np.arange(4)).reshape(3, 8))
    buf = out
