"""Host managers: block pool, per-group managers, prefix caching, and a scheduler-style fuzz."""

import numpy as np
import pytest

from jaxkv import (
  BlockPool,
  CircularBufferSpec,
  FullAttentionSpec,
  KVCacheManager,
  LinearAttentionStateSpec,
  MLAAttentionSpec,
  SlidingWindowSpec,
)

BS = 16
FULL = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype="float32")
MLA = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=32, dtype="bfloat16")
RING = CircularBufferSpec(block_size=4, num_kv_heads=2, head_size=16, head_size_v=0, dtype="bfloat16")
KDA = LinearAttentionStateSpec(block_size=BS, shapes=((3, 64), (4, 16, 16)), dtypes=("bfloat16", "float32"))
SWA = SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype="float32", sliding_window=20)


def test_block_pool_null_block_and_errors():
  pool = BlockPool(5)
  assert pool.get_num_free_blocks() == 4
  blocks = pool.get_new_blocks(4)
  assert sorted(b.block_id for b in blocks) == [1, 2, 3, 4]
  with pytest.raises(ValueError, match="Cannot get 1 free blocks from the pool"):
    pool.get_new_blocks(1)
  pool.free_blocks(blocks)
  with pytest.raises(RuntimeError, match="Double free of block"):
    pool.free_blocks(blocks[:1])
  pool.free_blocks([pool.null_block])  # the null block is never freed or counted
  assert pool.get_num_free_blocks() == 4
  with pytest.raises(ValueError, match="num_blocks must be >= 2"):
    BlockPool(1)


def test_hybrid_groups_allocate_one_state_block_per_request():
  m = KVCacheManager([MLA, KDA, RING], num_blocks=20)
  assert m.enable_caching  # hybrid: states by checkpoint, the ring needs no restore (tests/test_prefix_caching.py)
  ids = m.allocate_slots("a", 40)
  assert [len(g) for g in ids] == [3, 1, 1]
  assert m.allocate_slots("a", 48) == ([], [], [])
  assert [len(g) for g in m.allocate_slots("a", 49)] == [1, 0, 0]
  assert m.num_free_blocks == 19 - 6
  m.free("a")
  assert m.num_free_blocks == 19


def test_a_request_within_its_blocks_allocates_nothing_until_it_outgrows_them():
  m = KVCacheManager([MLA, KDA, RING, SWA], num_blocks=30, enable_caching=False)
  assert [len(g) for g in m.allocate_slots("a", 20)] == [2, 1, 1, 2]
  free = m.num_free_blocks
  assert m.allocate_slots("a", 32, num_computed_tokens=20) == ([], [], [], [])
  assert m.num_free_blocks == free
  assert [len(g) for g in m.allocate_slots("a", 33, num_computed_tokens=32)] == [1, 0, 0, 1]
  # Within its blocks the sliding window still frees what left it (60 computed, window 20): the
  # two blocks 33 tokens took are back.
  assert m.allocate_slots("a", 48, num_computed_tokens=60) == ([], [], [], [])
  assert m.block_ids("a")[3][:2] == [0, 0] and m.num_free_blocks == free
  m.free("a")
  # The same id again owns nothing: what its blocks held ended with them.
  assert [len(g) for g in m.allocate_slots("a", 1)] == [1, 1, 1, 1]


def test_allocation_failure_changes_nothing():
  m = KVCacheManager([FULL], num_blocks=4)
  assert m.allocate_slots("a", 32) is not None
  free = m.num_free_blocks
  assert m.allocate_slots("b", 32) is None
  assert m.num_free_blocks == free and m.block_ids("b") == ([],)


def test_prefix_cache_hits_and_eviction_order():
  m = KVCacheManager([FULL], num_blocks=10)
  prompt = list(range(50))
  hits, n = m.get_computed_blocks("a", prompt)
  assert n == 0
  ids_a = m.allocate_slots("a", 50)
  m.cache_blocks("a", prompt, 50)
  m.free("a")
  hits, n = m.get_computed_blocks("b", prompt[:40] + [999] * 10)
  assert n == 32 and [b.block_id for b in hits[0]] == ids_a[0][:2]
  ids_b = m.allocate_slots("b", 50, new_computed_blocks=hits)
  assert ids_b[0][:2] == ids_a[0][:2] and len(ids_b[0]) == 4
  # Exact full-block prompt: the last token is always recomputed.
  _, n = m.get_computed_blocks("c", prompt[:48])
  assert n == 32
  m.free("b")
  assert m.num_free_blocks == 9


def test_sliding_window_frees_blocks_that_leave_the_window():
  m = KVCacheManager([SWA], num_blocks=10)
  m.allocate_slots("a", 64)
  assert m.num_free_blocks == 5
  # 60 computed tokens, window 20: tokens < 41 are no longer attended -> blocks 0, 1 are freed.
  m.allocate_slots("a", 64, num_computed_tokens=60)
  assert m.num_free_blocks == 7
  assert m.block_ids("a")[0][:2] == [0, 0]
  m.free("a")
  assert m.num_free_blocks == 9


def test_scheduler_fuzz_no_leak_no_double_ownership():
  rng = np.random.default_rng(0)
  specs = [MLA, KDA, RING]
  m = KVCacheManager(specs, num_blocks=64)
  initial = m.num_free_blocks
  live: dict[str, int] = {}
  next_id = 0
  for step in range(3000):
    op = rng.random()
    if op < 0.3 or not live:
      rid = f"r{next_id}"
      next_id += 1
      n = int(rng.integers(1, 100))
      if m.allocate_slots(rid, n) is not None:
        live[rid] = n
      else:
        assert m.block_ids(rid) == ([], [], [])
    elif op < 0.75:
      rid = rng.choice(sorted(live))
      n = live[rid] + int(rng.integers(1, 20))
      if m.allocate_slots(rid, n, num_computed_tokens=live[rid]) is not None:
        live[rid] = n
      else:  # preempt by recompute: everything goes back
        m.free(rid)
        del live[rid]
    else:  # finish or abort
      rid = rng.choice(sorted(live))
      m.free(rid)
      del live[rid]
    owned = [b for rid in live for g in m.block_ids(rid) for b in g]
    assert 0 not in owned, "the null block was handed out"
    assert len(owned) == len(set(owned)), f"a block is owned twice at step {step}"
    assert len(owned) + m.num_free_blocks == initial, f"leak at step {step}"
    for rid, n in live.items():
      mla, kda, ring = m.block_ids(rid)
      assert len(mla) == -(-n // BS) and len(kda) == 1 and len(ring) == 1
  for rid in list(live):
    m.free(rid)
  assert m.num_free_blocks == initial
  pool = m.block_pool
  assert all(b.ref_cnt == 0 for b in pool.blocks[1:])


def test_prefix_caching_fuzz_keeps_refcounts_consistent():
  rng = np.random.default_rng(1)
  m = KVCacheManager([FULL, SWA], num_blocks=48)
  initial = m.num_free_blocks
  prompts = [list(rng.integers(0, 5, 64)) for _ in range(4)]
  live = {}
  for i in range(400):
    if live and rng.random() < 0.4:
      rid = rng.choice(sorted(live))
      m.free(rid)
      del live[rid]
      continue
    rid = f"r{i}"
    prompt = prompts[rng.integers(0, 4)][: int(rng.integers(2, 64))]
    hits, n = m.get_computed_blocks(rid, prompt)
    assert n % BS == 0 and n < len(prompt)
    ids = m.allocate_slots(rid, len(prompt), new_computed_blocks=hits)
    if ids is None:
      m.free(rid)
      continue
    m.cache_blocks(rid, prompt, len(prompt))
    live[rid] = prompt
    refs = sum(b.ref_cnt for b in m.block_pool.blocks[1:])
    owned = sum(len([x for x in g if x]) for r in live for g in m.block_ids(r))
    assert refs == owned
  for rid in list(live):
    m.free(rid)
  assert m.num_free_blocks == initial
