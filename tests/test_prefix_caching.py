"""Prefix caching of the hybrid model: token blocks shared by hash, KDA states checkpointed at block
boundaries and restored by block copy, the kpool tail ring never restored.

Modelled on vLLM's ``test_glm5next_pruned_e2e.py`` and ``test_apc_*``: warm output equals cold
output bitwise (tokens and top-5 log-probabilities) with hits above zero, for a repeated prompt and
prompts sharing several blocks, dense and packed, with MTP drafts, with chunk budgets a few tokens
off the block size, under preemption; the block copies against a NumPy reference.
"""

import functools

import jax
import numpy as np
import pytest

from jaxkv import CacheConfig, KVCacheManager, plan_kv_cache
from jaxkv.step.block_copy import (
  BlockRegions,
  copy_blocks,
  copy_blocks_reference,
  gather_blocks,
  pad_block_ids,
  scatter_blocks,
)
from jaxkv.engine import EngineConfig, LLMEngine, SamplingParams
from jaxkv.cache.kv_cache_spec import CircularBufferSpec, LinearAttentionStateSpec, MLAAttentionSpec
from models.glm5_next import get_kv_cache_layers
from test_engine_equivalence import CFG, runner

BS = 128  # the tiny model's smallest block (indexer pages of 32 x kpool 4)
SAMPLING = SamplingParams(max_tokens=4, logprobs=5)


@functools.lru_cache(maxsize=None)
def prompts():
  """A repeated prompt, one that shares two blocks of it, one that shares nothing."""
  rng = np.random.default_rng(3)
  shared = [int(t) for t in rng.integers(1, 256, 2 * BS + 20)]
  other = [int(t) for t in rng.integers(1, 256, 150)]
  return shared, shared, shared[: 2 * BS] + [int(t) for t in rng.integers(1, 256, 9)], other


def run(caching: bool, **kw):
  """The prompts one after another on one engine (so later ones can hit earlier ones' blocks)."""
  cache = CacheConfig(
    block_size=BS,
    max_model_len=512,
    layout=kw.pop("layout", "packed"),
    num_speculative_tokens=kw.pop("k", 0),
    memory_bytes=kw.pop("memory_bytes", 64 << 20),
  )
  engine = LLMEngine(
    runner(),
    EngineConfig(
      cache=cache, buckets=(136,), max_num_batched_tokens=kw.pop("budget", 128), enable_prefix_caching=caching, **kw
    ),
  )
  out = []
  for p in prompts():
    (r,) = engine.generate([p], SAMPLING)
    out.append((r.output_token_ids, r.output_logprobs, r.num_cached_tokens))
  return out, engine


@functools.lru_cache(maxsize=None)
def cold(k=0, layout="packed"):
  return run(False, k=k, layout=layout)[0]


def assert_warm_equals_cold(warm, want):
  assert [(t, lp) for t, lp, _ in warm] == [(t, lp) for t, lp, _ in want]
  assert all(n == 0 for *_, n in want)


@pytest.mark.parametrize("layout", ["packed", "dense"])
def test_warm_equals_cold_bitwise(layout):
  warm, engine = run(True, layout=layout)
  assert_warm_equals_cold(warm, cold(layout=layout))
  # Hits end at block boundaries and leave at least one token to compute.
  assert [n for *_, n in warm] == [0, 2 * BS, 2 * BS, 0]
  assert engine.kv.num_free_blocks == engine.plan.num_blocks - 1  # every block went back (cached ones are free)


@pytest.mark.parametrize("budget, threshold", [(BS - 3, 0), (BS + 5, 0), (BS + 5, 40)])
def test_chunk_budgets_off_the_block_size_stay_bitwise(budget, threshold):
  """Chunks end at block boundaries before a prompt's last token, whatever the budget (and a
  capped chunk given the step's unspent budget too)."""
  warm, _ = run(True, budget=budget, long_prefill_token_threshold=threshold)
  assert_warm_equals_cold(warm, cold())
  assert [n for *_, n in warm] == [0, 2 * BS, 2 * BS, 0]


def test_with_mtp_drafts_the_last_block_of_a_hit_is_recomputed():
  warm, engine = run(True, k=2)
  assert engine.num_draft_tokens > 0
  assert_warm_equals_cold(warm, cold(k=2))
  assert [n for *_, n in warm] == [0, BS, BS, 0]  # vLLM's use_eagle: one block fewer


def test_outputs_report_cached_tokens():
  engine = LLMEngine(
    runner(),
    EngineConfig(
      cache=CacheConfig(block_size=BS, max_model_len=512),
      buckets=(128,),
      max_num_batched_tokens=128,
      enable_prefix_caching=True,
      async_scheduling=False,
    ),
  )
  engine.generate([prompts()[0]], SAMPLING)
  engine.add_request("again", prompts()[0], SAMPLING)
  outs = []
  while engine.has_unfinished():
    outs += engine.step()
  assert outs and all(o.num_cached_tokens == 2 * BS for o in outs)


def test_preemption_with_prefix_caching_changes_nothing():
  """Three requests that cannot all hold their blocks: preempted ones re-enter at their own cached prefix."""
  probe = LLMEngine(runner(), EngineConfig(cache=CacheConfig(block_size=BS, max_model_len=512)))
  per_request = probe.plan.blocks_per_request(3 * BS)
  tight = (per_request * 2 + 2) * probe.plan.bytes_per_block
  rng = np.random.default_rng(5)
  ps = [[int(t) for t in rng.integers(1, 256, n)] for n in (2 * BS + 120, 2 * BS + 118, 2 * BS + 121)]
  sampling = SamplingParams(max_tokens=12, logprobs=5)

  def generate(caching, memory):
    cache = CacheConfig(block_size=BS, max_model_len=512, memory_bytes=memory)
    engine = LLMEngine(
      runner(), EngineConfig(cache=cache, buckets=(128,), max_num_batched_tokens=128, enable_prefix_caching=caching)
    )
    return [(r.output_token_ids, r.output_logprobs) for r in engine.generate(ps, sampling)], engine

  roomy, _ = generate(False, 64 << 20)
  got, engine = generate(True, tight)
  assert engine.scheduler.num_preemptions > 0
  assert got == roomy
  assert engine.kv.num_free_blocks == engine.plan.num_blocks - 1


def test_nothing_compiles_after_warmup_with_prefix_caching():
  engine = LLMEngine(
    runner(),
    EngineConfig(
      cache=CacheConfig(block_size=BS, max_model_len=512),
      buckets=(128,),
      max_num_batched_tokens=128,
      enable_prefix_caching=True,
    ),
  )
  engine.warmup()
  compiled = (engine.num_compilations, copy_blocks._cache_size())
  for p in prompts()[:3]:
    engine.generate([p], SAMPLING)
  assert (engine.num_compilations, copy_blocks._cache_size()) == compiled


# -- the manager: checkpoints, restores, eviction ------------------------------------------------

MB = 16
MLA = MLAAttentionSpec(block_size=MB, num_kv_heads=1, head_size=32, dtype="bfloat16")
KDA = LinearAttentionStateSpec(block_size=MB, shapes=((3, 64), (4, 16, 16)), dtypes=("bfloat16", "float32"))
RING = CircularBufferSpec(block_size=4, num_kv_heads=2, head_size=16, head_size_v=0, dtype="bfloat16")


def test_state_checkpoint_is_found_restored_and_evicted_like_a_cached_block():
  m = KVCacheManager([MLA, KDA, RING], num_blocks=12)
  prompt = list(range(40))
  assert m.allocate_slots("a", 40) is not None
  kda_a = m.block_ids("a")[1][0]
  m.cache_blocks("a", prompt, 40)
  assert m.get_computed_blocks("probe", prompt) == (([], [], []), 0)  # token blocks, but no state checkpoint
  assert m.checkpoint_states("a", prompt, 20, len(prompt)) == []  # not a boundary
  ((src, ckpt),) = m.checkpoint_states("a", prompt, 32, len(prompt))
  assert src == kda_a and ckpt not in sum(m.block_ids("a"), [])
  assert m.checkpoint_states("a", prompt, 32, len(prompt)) == []  # once per boundary
  m.free("a")
  hits, n = m.get_computed_blocks("b", prompt[:35] + [99])
  assert n == 32 and [b.block_id for b in hits[1]] == [ckpt] and hits[2] == []
  ids = m.allocate_slots("b", 36, num_computed_tokens=32, new_computed_blocks=hits)
  assert ckpt not in ids[1]  # copied into b's own slot, not shared
  assert m.block_pool.blocks[ckpt].ref_cnt == 1  # held until its copy is taken
  assert m.take_block_copies() == [(ckpt, ids[1][0])]
  assert m.block_pool.blocks[ckpt].ref_cnt == 0 and m.take_block_copies() == []
  m.free("b")
  assert m.num_free_blocks == 11
  # Eviction: handing every block out forgets the checkpoint, and the hit with it.
  m.allocate_slots("c", 16 * 9)
  m.free("c")
  assert m.get_computed_blocks("d", prompt) == (([], [], []), 0)


def test_chunked_prefill_bounds_checkpoints_and_hits_by_the_prompt():
  """With a chunk grid, states sit only below a prompt's last grid line (50 tokens: 32)."""
  m = KVCacheManager([MLA, KDA], num_blocks=12, linear_prefill_chunk=32)
  prompt = list(range(50))
  m.allocate_slots("a", 50)
  m.cache_blocks("a", prompt, 50)
  assert m.checkpoint_states("a", prompt, 48, len(prompt)) == []  # past 32
  assert m.checkpoint_states("a", prompt, 32, len(prompt))
  assert m.reusable_tokens(prompt, len(prompt)) == prompt[:33]
  longer = prompt + [7] * 30  # its own bound, 64, reaches past the 48 that "a" did not checkpoint
  assert m.get_computed_blocks("b", m.reusable_tokens(longer, len(longer)))[1] == 32
  # Without state groups there is nothing to bound.
  assert KVCacheManager([MLA], num_blocks=12, linear_prefill_chunk=32).reusable_tokens(prompt, 50) == prompt


def test_eagle_drops_the_last_block_and_a_ring_must_divide_the_block():
  prompt = list(range(50))
  for use_eagle, want in ((False, 48), (True, 32)):  # 3 blocks match; with a draft layer one is recomputed
    m = KVCacheManager([MLA, KDA], num_blocks=12, use_eagle=use_eagle)
    m.allocate_slots("a", 50)
    m.cache_blocks("a", prompt, 50)
    assert all(m.checkpoint_states("a", prompt, end, len(prompt)) for end in (16, 32, 48))
    assert m.get_computed_blocks("b", prompt)[1] == want
  with pytest.raises(ValueError, match="multiple of the tail ring's 12 slots"):
    KVCacheManager(
      [MLA, CircularBufferSpec(block_size=12, num_kv_heads=1, head_size=8, head_size_v=0, dtype="float32")],
      num_blocks=8,
    )


def test_abort_with_a_restore_pending_leaks_nothing():
  m = KVCacheManager([MLA, KDA], num_blocks=12)
  prompt = list(range(40))
  m.allocate_slots("a", 40)
  m.cache_blocks("a", prompt, 40)
  m.checkpoint_states("a", prompt, 32, len(prompt))
  m.free("a")
  hits, n = m.get_computed_blocks("b", prompt)
  m.allocate_slots("b", 40, num_computed_tokens=n, new_computed_blocks=hits)
  m.free("b")  # aborted before its step: the checkpoint's reference goes too
  assert m.take_block_copies() == []
  assert m.num_free_blocks == 11 and all(b.ref_cnt == 0 for b in m.block_pool.blocks[1:])


def test_checkpoint_fuzz_keeps_refcounts_consistent():
  rng = np.random.default_rng(2)
  m = KVCacheManager([MLA, KDA, RING], num_blocks=40)
  bases = [list(rng.integers(0, 3, 80)) for _ in range(3)]
  live: dict[str, list[int]] = {}
  for i in range(500):
    if live and rng.random() < 0.4:
      rid = sorted(live)[rng.integers(0, len(live))]
      m.free(rid)
      del live[rid]
      continue
    rid, prompt = f"r{i}", bases[rng.integers(0, 3)][: int(rng.integers(2, 80))]
    hits, n = m.get_computed_blocks(rid, prompt)
    assert n % MB == 0 and n < len(prompt)
    if m.allocate_slots(rid, len(prompt), num_computed_tokens=n, new_computed_blocks=hits) is None:
      continue
    for src, dst in m.take_block_copies():
      assert dst == m.block_ids(rid)[1][0] and src != dst
    for end in range(n + MB, len(prompt) + 1, MB):
      for src, dst in m.checkpoint_states(rid, prompt, end, len(prompt)):
        assert m.block_pool.blocks[dst].ref_cnt == 0 and src == m.block_ids(rid)[1][0]
    m.cache_blocks(rid, prompt, len(prompt))
    live[rid] = prompt
    owned = [b for r in live for g in m.block_ids(r) for b in g if b]
    refs = sum(b.ref_cnt for b in m.block_pool.blocks[1:])
    assert refs == len(owned) and len(set(owned) & set(m.block_pool._free)) == 0
  for rid in list(live):
    m.free(rid)
  assert m.num_free_blocks == 39


# -- block copies on the device -----------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def plan(layout):
  cache = CacheConfig(block_size=BS, layout=layout, memory_bytes=8 << 20, max_model_len=512)
  return plan_kv_cache(get_kv_cache_layers(CFG, cache), cache)


def random_caches(p, seed):
  rng = np.random.default_rng(seed)
  return {t.name: rng.integers(0, 256, (t.num_rows, t.row_bytes), dtype=np.uint8) for t in p.tensors}


@pytest.mark.parametrize("layout", ["packed", "dense"])
def test_copy_blocks_matches_reference_on_random_caches(layout):
  p = plan(layout)
  rng = np.random.default_rng(4)
  state_groups = [
    g for g, grp in enumerate(p.kv_cache_groups) if isinstance(grp.kv_cache_spec, LinearAttentionStateSpec)
  ]
  for groups in (state_groups, None):
    regions = BlockRegions.from_plan(p, groups)
    caches = random_caches(p, int(rng.integers(1 << 30)))
    ids = rng.permutation(np.arange(1, p.num_blocks))
    pairs = list(zip(ids[:5].tolist(), ids[5:10].tolist()))
    src, dst = pad_block_ids(pairs, 8)
    want = copy_blocks_reference(caches, src, dst, regions=regions)
    got = copy_blocks({k: jax.numpy.asarray(v) for k, v in caches.items()}, src, dst, regions=regions)
    for name in caches:
      np.testing.assert_array_equal(np.asarray(got[name]), want[name])
    changed = sum(int((np.asarray(got[n]) != caches[n]).any()) for n in caches)
    assert changed >= 1  # random bytes: the destinations did change


@pytest.mark.parametrize("layout", ["packed", "dense"])
def test_gather_scatter_round_trip_is_bit_exact_and_leaves_the_source(layout):
  p = plan(layout)
  regions = BlockRegions.from_plan(p)
  src_caches = random_caches(p, 11)
  src_dev = {k: jax.numpy.asarray(v) for k, v in src_caches.items()}
  ids = np.array([3, 1, 7, -1], np.int32)
  data = gather_blocks(src_dev, ids, regions=regions)
  assert data.shape == (4, regions.bytes_per_block)
  dst_caches = random_caches(p, 12)  # poisoned: every byte differs from what is written
  dst = np.array([5, 2, 9, -1], np.int32)
  out = scatter_blocks({k: jax.numpy.asarray(v) for k, v in dst_caches.items()}, dst, data, regions=regions)
  again = gather_blocks(out, dst[:3], regions=regions)
  np.testing.assert_array_equal(np.asarray(again), np.asarray(data[:3]))
  for name, arr in src_dev.items():
    np.testing.assert_array_equal(np.asarray(arr), src_caches[name])  # the source untouched (not donated)
  # Blocks not written keep their bytes.
  untouched = [b for b in range(p.num_blocks) if b not in (5, 2, 9)]
  rest = gather_blocks(out, np.array(untouched, np.int32), regions=regions)
  before = gather_blocks(
    {k: jax.numpy.asarray(v) for k, v in dst_caches.items()}, np.array(untouched, np.int32), regions=regions
  )
  np.testing.assert_array_equal(np.asarray(rest), np.asarray(before))


def test_block_copy_argument_errors():
  p = plan("packed")
  regions = BlockRegions.from_plan(p)
  caches = {k: jax.numpy.asarray(v) for k, v in random_caches(p, 1).items()}
  with pytest.raises(ValueError, match="one shape"):
    copy_blocks(caches, np.zeros(3, np.int32), np.zeros(2, np.int32), regions=regions)
  with pytest.raises(ValueError, match=r"data must be uint8\[2, "):
    scatter_blocks(caches, np.zeros(2, np.int32), np.zeros((2, 5), np.uint8), regions=regions)
  with pytest.raises(ValueError, match="5 block copies exceed the 4"):
    pad_block_ids([(1, 2)] * 5, 4)


def test_hit_on_another_requests_blocks_is_bitwise_cold():
  """Issue 29's case: a 300-token prompt P, then Q sharing P's first 260 tokens (two full blocks and
  one pool past them), one request at a time, the CLI's default budget and buckets, in one
  ``generate`` call: Q's tokens and top-5 log-probs are bitwise Q's alone, cold."""
  rng = np.random.default_rng(29)
  p = [int(t) for t in rng.integers(1, 256, 300)]
  q = p[:260] + [int(t) for t in rng.integers(1, 256, 40)]

  def engine():
    cache = CacheConfig(block_size=BS, max_model_len=512)
    return LLMEngine(
      runner(), EngineConfig(cache=cache, max_num_reqs=1, max_num_batched_tokens=64, enable_prefix_caching=True)
    )

  (alone,) = engine().generate([q], SAMPLING)
  _, warm = engine().generate([p, q], SAMPLING)
  assert alone.num_cached_tokens == 0 and warm.num_cached_tokens == 2 * BS
  assert warm.output_token_ids == alone.output_token_ids
  assert warm.output_logprobs == alone.output_logprobs


@pytest.mark.parametrize("linear_prefill", ["recurrent", "chunked"])
def test_second_turn_hit_is_bitwise_cold(linear_prefill):
  """A chat's second turn Q = P + P's answer + more reuses P's blocks. Recurrent prefill reuses the
  KDA state P's decode checkpointed at 256; chunked prefill computes Q's positions below 256
  chunkwise, P's past 128 (its prompt's bound) recurrently, so it reuses only up to 128. Either
  way Q's tokens and top-5 log-probs are bitwise Q's alone, cold. (Dense: a packed block holding
  the chunked pages would scale up to 256 tokens; synchronous: with a token in flight a decode
  step's boundary is not checkpointed; one token bucket: P's answer is decoded in the bucket Q's
  prompt is computed in, as bitwise claims need.)"""
  rng = np.random.default_rng(30)
  p = [int(t) for t in rng.integers(1, 256, 140)]

  def engine():
    cache = CacheConfig(block_size=BS, max_model_len=512, layout="dense", linear_prefill=linear_prefill)
    config = EngineConfig(
      cache=cache, max_num_reqs=1, enable_prefix_caching=True, async_scheduling=False, buckets=(64,)
    )
    return LLMEngine(runner(), config)

  warm = engine()
  (first,) = warm.generate([p], SamplingParams(max_tokens=130))
  q = p + first.output_token_ids[:120] + [int(t) for t in rng.integers(1, 256, 10)]
  (again,) = warm.generate([q], SAMPLING)
  (cold,) = engine().generate([q], SAMPLING)
  assert again.num_cached_tokens == (2 * BS if linear_prefill == "recurrent" else BS)
  assert again.output_token_ids == cold.output_token_ids
  assert again.output_logprobs == cold.output_logprobs
