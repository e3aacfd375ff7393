"""Slot mappings: padding, DCP, disabled groups, the tail ring, compressed caches (ports of vLLM's
test_gpu_block_table.py and test_kpool_tail_slot_mapping.py)."""

import functools

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import (
  PAD_SLOT_ID,
  compute_circular_slot_mapping,
  compute_compressed_slot_mapping,
  compute_slot_mapping,
  map_to_kernel_blocks,
  req_indices_from_query_start_loc,
)
from jaxkv.step.slot_mapping import circular_slots, compressed_slots, split_block_lookup, token_slots


def i32(x):
  return jnp.asarray(np.asarray(x, np.int32))


def slots(table, counts, reqs, pos, **kw):
  return np.asarray(compute_slot_mapping(i32(table), i32(counts), i32(reqs), i32(pos), **kw))


def test_basic_and_padding():
  table = [[7, 8, 0], [0, 0, 0]]
  got = slots(table, [2, 0], [0, 0, 0, -1, 1], [1, 2, 3, 0, 0], block_size=4)
  np.testing.assert_array_equal(got, [29, 30, 31, -1, -1])


def test_blocks_past_row_count_and_width_are_padding():
  # Stale id 9 past the row's count must not be used; column 3 is past the width.
  got = slots([[5, 9, 0]], [1], [0, 0, 0, 0], [3, 4, 12, -1], block_size=4)
  np.testing.assert_array_equal(got, [23, -1, -1, -1])


def test_disabled_group_is_all_padding():
  got = slots([[12]], [1], [0, 0], [153797, 165757], block_size=262144, uses_slot_mapping=False)
  np.testing.assert_array_equal(got, [-1, -1])
  got = slots([[12]], [1], [0, 0], [153797, 165757], block_size=262144)
  np.testing.assert_array_equal(got, [12 * 262144 + 153797, 12 * 262144 + 165757])


@pytest.mark.parametrize("rank", range(4))
def test_dcp_shards_only_sharded_groups(rank):
  pos = np.arange(1024)
  reqs = np.zeros(1024)
  sharded = slots([[5, 9]], [2], reqs, pos, block_size=128, dcp_size=4, dcp_rank=rank, dcp_interleave=128)
  expected = np.full(1024, -1)
  expected[128 * rank : 128 * rank + 128] = np.arange(640, 768)
  expected[512 + 128 * rank : 512 + 128 * rank + 128] = np.arange(1152, 1280)
  np.testing.assert_array_equal(sharded, expected)
  replicated = slots([list(range(10, 18))], [8], reqs, pos, block_size=128)
  np.testing.assert_array_equal(replicated, pos + 1280)


def test_dcp_interleave_one():
  # dcp 2, interleave 1: even positions on rank 0, odd on rank 1; each rank packs its tokens densely.
  pos = np.arange(16)
  for rank in range(2):
    got = slots([[3, 6]], [2], np.zeros(16), pos, block_size=4, dcp_size=2, dcp_rank=rank, dcp_interleave=1)
    local = pos[pos % 2 == rank] // 2
    exp = np.full(16, -1)
    exp[pos % 2 == rank] = np.array([3, 6])[local // 4] * 4 + local % 4
    np.testing.assert_array_equal(got, exp)


def test_invalid_dcp_raises():
  with pytest.raises(ValueError, match="rank 2 of 2"):
    slots([[1]], [1], [0], [0], block_size=4, dcp_size=2, dcp_rank=2)


def test_circular_ring_stays_in_bounds_for_any_position():
  ring = 4
  table = i32([[5], [9], [0]])  # row 2 holds the null block
  pos = i32([0, 3, 4, 500_000, 524_287, 7, 11, 0, 2])
  reqs = i32([0, 0, 0, 0, 0, 1, 1, 2, -1])
  got = np.asarray(compute_circular_slot_mapping(table, reqs, pos, ring_size=ring))
  np.testing.assert_array_equal(got, [20, 23, 20, 20, 23, 39, 39, -1, -1])


def test_circular_slots_of_requests_are_disjoint_and_match_generic_within_first_ring():
  ring = 4
  table = i32([[5], [9]])
  reqs = i32([0] * 10 + [1] * 12)
  pos = i32(list(range(10)) + list(range(12)))
  got = np.asarray(compute_circular_slot_mapping(table, reqs, pos, ring_size=ring))
  a, b = set(got[:10]), set(got[10:])
  assert not a & b
  assert all(s // ring == 5 for s in a) and all(s // ring == 9 for s in b)
  np.testing.assert_array_equal(got % ring, np.asarray(pos) % ring)
  generic = slots([[5], [9]], [1, 1], reqs, pos, block_size=ring)
  first_ring = np.asarray(pos) < ring
  np.testing.assert_array_equal(got[first_ring], generic[first_ring])
  assert (generic[~first_ring] == PAD_SLOT_ID).all()  # generic mapping never reads past the row


def test_compressed_slot_mapping():
  # kpool 4, 64 entries per page, kernel table of one request mapped with stride 5.
  kt = i32([[0, 1, 2, 3, 10, 11, 12, 13]])
  pos = np.arange(0, 2048)
  got = np.asarray(
    compute_compressed_slot_mapping(kt, i32([8]), i32(np.zeros(2048)), i32(pos), states_per_page=64, compress_ratio=4)
  )
  done = (pos + 1) % 4 == 0
  assert (got[~done] == -1).all()
  e = pos[done] // 4
  np.testing.assert_array_equal(got[done], np.asarray(kt)[0, e // 64] * 64 + e % 64)
  # Past the row's kernel blocks: padding.
  got = compute_compressed_slot_mapping(kt, i32([4]), i32([0]), i32([1023]), states_per_page=64, compress_ratio=4)
  np.testing.assert_array_equal(got, [255])
  got = compute_compressed_slot_mapping(kt, i32([4]), i32([0]), i32([1027]), states_per_page=64, compress_ratio=4)
  np.testing.assert_array_equal(got, [-1])


def test_req_indices_from_query_start_loc():
  qsl = i32([0, 3, 3, 7, 7, 7])
  got = req_indices_from_query_start_loc(qsl, jnp.int32(3), num_tokens=10)
  np.testing.assert_array_equal(got, [0, 0, 0, 2, 2, 2, 2, -1, -1, -1])


class SlotFormulasTest(chex.TestCase):
  """The unjitted formulas (``token_slots``, ``circular_slots``, ``compressed_slots``) that the jitted
  functions and the step-metadata kernel share, traced and eager (``chex.variants``), against
  loops over the definitions."""

  def setUp(self):
    super().setUp()
    rng = np.random.default_rng(11)
    self.table = rng.permutation(np.arange(1, 40))[:12].reshape(3, 4).astype(np.int32)
    self.counts = np.array([4, 2, 0], np.int32)
    self.req = rng.integers(-1, 4, 50).astype(np.int32)
    self.pos = rng.integers(-2, 20, 50).astype(np.int32)

  @chex.variants(with_jit=True, without_jit=True)
  def test_token_slots(self):
    fn = self.variant(functools.partial(token_slots, block_size=4))
    got = np.asarray(fn(i32(self.table), i32(self.counts), i32(self.req), i32(self.pos)))
    chex.assert_shape(got, self.pos.shape)
    for t, (r, p) in enumerate(zip(self.req, self.pos)):
      live = 0 <= r < 3 and p >= 0 and p // 4 < self.counts[r]
      assert got[t] == (self.table[r, p // 4] * 4 + p % 4 if live else -1)

  @chex.variants(with_jit=True, without_jit=True)
  def test_circular_slots(self):
    fn = self.variant(functools.partial(circular_slots, ring_size=8))
    got = np.asarray(fn(i32(self.table), i32(self.req), i32(self.pos)))
    for t, (r, p) in enumerate(zip(self.req, self.pos)):
      assert got[t] == (self.table[r, 0] * 8 + p % 8 if 0 <= r < 3 and p >= 0 else -1)

  @chex.variants(with_jit=True, without_jit=True)
  def test_compressed_slots_from_the_manager_table_equal_those_from_the_kernel_table(self):
    bpk, stride = 2, 5

    def from_manager(table, counts, req, pos):
      return compressed_slots(
        split_block_lookup(table, counts, blocks_per_kernel_block=bpk, stride=stride),
        req,
        pos,
        states_per_page=2,
        compress_ratio=2,
      )

    got = self.variant(from_manager)(i32(self.table), i32(self.counts), i32(self.req), i32(self.pos))
    kt = map_to_kernel_blocks(i32(self.table), bpk, stride)
    want = compute_compressed_slot_mapping(
      kt, i32(self.counts * bpk), i32(self.req), i32(self.pos), states_per_page=2, compress_ratio=2
    )
    chex.assert_trees_all_equal(got, want)
    assert (np.asarray(want) >= 0).any()
