"""KV offload in manager blocks: warm from host and from disk equals cold, bitwise; the disk tier
across processes, corrupt files, eviction; one load for two requests; aborts; swap on preemption.

Modelled on vLLM's ``tests/v1/kv_offload`` (warm output equals cold output, hits above zero).
"""

import collections
import functools
import pathlib
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import CacheConfig
from jaxkv.engine import EngineConfig, LLMEngine, SamplingParams
from jaxkv.engine.offload import DiskTier, HostTier, offload_fingerprint
from test_engine_equivalence import runner
from test_prefix_caching import BS, SAMPLING, prompts

PROMPT = prompts()[0]  # 2 blocks + 20 tokens: hits of 2 blocks (1 with drafts)


def engine(**kw) -> LLMEngine:
  cache = CacheConfig(
    block_size=BS,
    max_model_len=512,
    layout=kw.pop("layout", "packed"),
    num_speculative_tokens=kw.pop("k", 0),
    memory_bytes=kw.pop("memory_bytes", 64 << 20),
  )
  return LLMEngine(runner(), EngineConfig(cache=cache, buckets=(136,), max_num_batched_tokens=128, **kw))


def result(r):
  return r.output_token_ids, r.output_logprobs


@functools.lru_cache(maxsize=None)
def cold(layout="packed", k=0):
  return result(engine(layout=layout, k=k).generate([PROMPT], SAMPLING)[0])


@pytest.mark.parametrize("layout", ["packed", "dense"])
def test_warm_from_host_equals_cold(layout):
  e = engine(layout=layout, enable_prefix_caching=True, kv_offload="host", kv_offload_bytes=64 << 20)
  first = e.generate([PROMPT], SAMPLING)[0]
  assert first.num_cached_tokens == 0 and e.connector.num_saved_blocks > 0
  e.kv.reset_prefix_cache()  # the device forgets: only the host tier has the blocks
  (warm,) = e.generate([PROMPT], SAMPLING)
  assert warm.num_cached_tokens == 2 * BS
  assert e.connector.num_loaded_blocks == 3  # two token blocks and the KDA checkpoint after them
  assert result(warm) == result(first) == cold(layout=layout)
  assert e.kv.num_free_blocks == e.plan.num_blocks - 1


def test_warm_from_host_with_mtp_drafts():
  e = engine(k=2, enable_prefix_caching=True, kv_offload="host")
  e.generate([PROMPT], SAMPLING)
  e.kv.reset_prefix_cache()
  (warm,) = e.generate([PROMPT], SAMPLING)
  assert warm.num_cached_tokens == BS and e.num_draft_tokens > 0
  assert result(warm) == cold(k=2)


def test_two_requests_with_one_prefix_load_it_once_and_aborts_leak_nothing():
  e = engine(enable_prefix_caching=True, kv_offload="host")
  e.generate([PROMPT], SAMPLING)
  e.kv.reset_prefix_cache()
  a, b = e.generate([PROMPT, PROMPT], SAMPLING)
  assert a.num_cached_tokens == b.num_cached_tokens == 2 * BS
  assert e.connector.num_loaded_blocks == 3
  assert result(a) == result(b) == cold()
  # A request aborted right after its load was dispatched gives its blocks back; the loaded
  # blocks stay indexed and serve the next request.
  e.kv.reset_prefix_cache()
  e.add_request("x", PROMPT, SAMPLING)
  e.step()
  e.abort("x")
  while e.has_unfinished():
    e.step()
  assert e.kv.num_free_blocks == e.plan.num_blocks - 1
  assert all(blk.ref_cnt == 0 for blk in e.kv.block_pool.blocks[1:])
  (again,) = e.generate([PROMPT], SAMPLING)
  assert again.num_cached_tokens == 2 * BS and e.connector.num_loaded_blocks == 6
  assert result(again) == cold()


def test_warm_from_disk_in_a_second_process_and_corrupt_files_are_misses(tmp_path):
  script = textwrap.dedent(f"""
      import sys
      sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r})
      from test_kv_offload import PROMPT, SAMPLING, engine
      e = engine(enable_prefix_caching=True, kv_offload="disk", kv_offload_dir={str(tmp_path)!r})
      (r,) = e.generate([PROMPT], SAMPLING)
      print(r.output_token_ids)
      """)
  subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True)
  files = sorted(tmp_path.rglob("*.blk"))
  assert len(files) == 4 and len(list(tmp_path.rglob("manifest.json"))) == 1  # 2 token blocks, 2 checkpoints
  e = engine(enable_prefix_caching=True, kv_offload="disk", kv_offload_dir=str(tmp_path))
  (warm,) = e.generate([PROMPT], SAMPLING)
  assert warm.num_cached_tokens == 2 * BS and result(warm) == cold()
  # Corrupt one byte of each checkpoint's payload: both are misses (and deleted), the output is the same.
  ckpts = [f for f in files if f.name.endswith("-g1.blk")]
  for f in ckpts:
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0xFF
    f.write_bytes(bytes(raw))
  e = engine(enable_prefix_caching=True, kv_offload="disk", kv_offload_dir=str(tmp_path))
  (again,) = e.generate([PROMPT], SAMPLING)
  assert again.num_cached_tokens == 0 and result(again) == cold()
  e.wait_for_save()
  assert all(f.exists() for f in ckpts)  # recomputed and saved anew, intact
  assert all(DiskTier(tmp_path, 1 << 30, f.parent.name).get(DiskTier._key(f)) is not None for f in ckpts)


def test_disk_tier_checks_evicts_and_survives_a_restart(tmp_path):
  rng = np.random.default_rng(0)
  keys = [(bytes([i]) * 32, i % 2) for i in range(6)]
  rows = rng.integers(0, 256, (6, 100), dtype=np.uint8)
  tier = DiskTier(tmp_path, 400, "ab12")
  tier.put(keys[:3], jnp.asarray(rows[:3]))  # a device array: copied to host on the writer thread
  tier.flush()
  assert [np.array_equal(tier.get(k), r) for k, r in zip(keys[:3], rows)] == [True] * 3
  tier.put(keys[3:], rows[3:])
  tier.flush()
  assert tier.used_bytes <= 400 and len(tier) == 4 and tier.get(keys[0]) is None  # least recently used went
  restarted = DiskTier(tmp_path, 400, "ab12")
  assert len(restarted) == 4 and np.array_equal(restarted.get(keys[5]), rows[5])
  assert DiskTier(tmp_path, 400, "cd34").get(keys[5]) is None  # another fingerprint, another directory
  path = restarted._path(keys[4])
  path.write_bytes(path.read_bytes()[:30])  # truncated
  assert restarted.get(keys[4]) is None and not path.exists()
  restarted._path(keys[3]).unlink()  # missing
  assert restarted.get(keys[3]) is None and not restarted.contains(keys[3])
  with pytest.raises(ValueError, match="capacity must be positive"):
    DiskTier(tmp_path, 0, "ab12")
  with pytest.raises(ValueError, match="lowercase hex"):
    DiskTier(tmp_path, 10, "../x")


def test_host_tier_evicts_least_recently_used():
  tier = HostTier(250)
  rows = np.arange(300, dtype=np.uint8).reshape(3, 100)
  tier.put([(b"a", 0), (b"b", 0)], rows[:2])
  assert np.array_equal(tier.get((b"a", 0)), rows[0])  # a is now the most recent
  tier.put([(b"c", 0)], rows[2:])
  # a and b came in one transfer, which lives while either does: both go to make room for c.
  assert tier.get((b"b", 0)) is None and tier.get((b"a", 0)) is None
  assert np.array_equal(tier.get((b"c", 0)), rows[2]) and tier.used_bytes == 100
  with pytest.raises(ValueError, match="capacity must be positive"):
    HostTier(0)


def test_offload_needs_prefix_caching_and_a_directory():
  with pytest.raises(ValueError, match="set enable_prefix_caching=True"):
    EngineConfig(kv_offload="host")
  with pytest.raises(ValueError, match="needs kv_offload_dir"):
    EngineConfig(kv_offload="disk", enable_prefix_caching=True)
  with pytest.raises(ValueError, match="preemption_mode must be"):
    EngineConfig(preemption_mode="drop")


# -- swap on preemption ---------------------------------------------------------------------------


@pytest.mark.parametrize("k", [0, 3])
def test_swap_preempted_requests_produce_what_they_produce_unpreempted(k):
  """With drafts (k=3) a request is preempted holding a block for rejected draft positions; it
  comes back with fewer blocks than it swapped out, and only its tokens' blocks are restored."""
  probe = engine(k=k)
  state_blocks = probe.plan.blocks_per_request(1) - 1  # KDA groups + tail ring
  # Each request fits in two token blocks; only one can grow into its third at a time.
  tight = (1 + 3 * (state_blocks + 2) + 1) * probe.plan.bytes_per_block
  rng = np.random.default_rng(8)
  ps = [[int(t) for t in rng.integers(1, 256, n)] for n in (2 * BS - 4, 2 * BS - 6, 2 * BS - 3)]
  sampling = SamplingParams(max_tokens=8, logprobs=5)  # each crosses into its third block
  roomy = [result(r) for r in engine(k=k).generate(ps, sampling)]
  # Async steps: the preempted request's last token is still in flight when it is swapped out.
  e = engine(memory_bytes=tight, preemption_mode="swap", k=k)
  warm = e.warmup()
  got = [result(r) for r in e.generate(ps, sampling)]
  assert e.swap.num_swapped_out > 0 and e.swap.num_swapped_in == e.swap.num_swapped_out
  assert e.num_compilations == warm  # swap-in keeps the caches' placement: nothing compiles again
  assert got == roomy
  assert e.kv.num_free_blocks == e.plan.num_blocks - 1 and e.swap.used_bytes == 0
  if k:
    return
  # A swap space too small for a request's blocks: it is recomputed instead, with the same output.
  e = engine(memory_bytes=tight, preemption_mode="swap", swap_space_bytes=1)
  assert [result(r) for r in e.generate(ps, sampling)] == roomy
  assert e.scheduler.num_preemptions > 0 and e.swap.num_swapped_out == 0


def test_fingerprint_separates_models_and_layouts():
  """The disk tier's directory: equal for the same weights and layout, different otherwise."""
  import jax

  params = runner().params
  plan = engine().plan
  fp = offload_fingerprint(plan, params)
  assert fp == offload_fingerprint(plan, params) and len(fp) == 64
  leaves, treedef = jax.tree.flatten(params)
  leaves[0] = leaves[0].at[(0,) * leaves[0].ndim].add(1)  # one weight changed
  assert offload_fingerprint(plan, jax.tree.unflatten(treedef, leaves)) != fp
  assert offload_fingerprint(engine(layout="dense").plan, params) != fp


# -- tier reliability (issue 32) ----------------------------------------------------------------


def test_host_tier_counts_whole_transfers_within_capacity():
  """A padded save batch stays alive while any of its keys does: the tier counts all of it."""
  rows = np.arange(800, dtype=np.uint8).reshape(8, 100)  # one key, padded to 8 rows
  tier = HostTier(100)
  tier.put([(b"a", 0)], rows)
  assert len(tier) == 0 and tier.used_bytes == 0  # the transfer alone is larger than the tier
  tier = HostTier(1000)
  tier.put([(b"a", 0)], rows)
  tier.put([(b"b", 0)], rows + 1)
  assert tier.used_bytes == 800 and len(tier) == 1 and np.array_equal(tier.get((b"b", 0)), rows[0] + 1)


def test_offload_admission_reserves_before_touching():
  """Free blocks that are the device's own prefix blocks are not free for loads: a hit that would
  need them is a miss, never 'Cannot get 1 free blocks' out of step()."""
  from jaxkv.host.kv_cache_manager import LinearAttentionStateManager

  e = engine(enable_prefix_caching=True, kv_offload="host", kv_offload_bytes=64 << 20)
  e.generate([PROMPT], SAMPLING)
  e.wait_for_save()
  kv, pool = e.kv, e.kv.block_pool
  hashes = kv.block_hashes("probe", PROMPT)
  states = [m.group_id for m in kv.managers if isinstance(m, LinearAttentionStateManager)]
  for g in states:  # the device forgets the checkpoints at the hit's end: only the tier has them
    pool._evict(pool.get_cached_block(hashes[1], g))
  token_groups = [m.group_id for m in kv.managers if not m.spec.is_state]
  prefix = {pool.get_cached_block(hashes[i], g).block_id for i in range(2) for g in token_groups}
  # Leave free: the prefix blocks and one block fewer than the loads.
  others = [i for i in list(pool._free) if i not in prefix]
  pool.touch([pool.blocks[i] for i in others[len(states) - 1 :]])
  assert pool.get_num_free_blocks() == len(prefix) + len(states) - 1 >= len(states)
  assert e.connector.get_num_new_matched_tokens(kv, "probe", PROMPT) == 0
  assert all(pool.blocks[i].ref_cnt == 0 for i in prefix)  # untouched, still free and cached
  assert pool.get_num_free_blocks() == len(prefix) + len(states) - 1


def test_disk_tier_failures_never_stop_the_engine(tmp_path, monkeypatch):
  """A directory removed while serving (saves fail) and a store that refuses touching (read-only):
  outputs come back, hits still work where the files are readable."""
  import os
  import shutil

  d = tmp_path / "blocks"
  e = engine(enable_prefix_caching=True, kv_offload="disk", kv_offload_dir=str(d))
  (first,) = e.generate([PROMPT], SAMPLING)
  shutil.rmtree(d)  # removed while serving
  other = prompts()[3]
  (second,) = e.generate([other], SAMPLING)  # its saves fail: logged and skipped
  assert result(first) == cold() and second.output_token_ids
  e2 = engine(enable_prefix_caching=True, kv_offload="disk", kv_offload_dir=str(tmp_path / "ro"))
  e2.generate([PROMPT], SAMPLING)
  e2.wait_for_save()

  def refuse(*args, **kw):
    raise OSError(30, "Read-only file system")

  monkeypatch.setattr(os, "utime", refuse)
  e3 = engine(enable_prefix_caching=True, kv_offload="disk", kv_offload_dir=str(tmp_path / "ro"))
  (warm,) = e3.generate([PROMPT], SAMPLING)
  assert warm.num_cached_tokens == 2 * BS and result(warm) == cold()


def test_two_writers_of_one_block_and_wrong_sized_payloads(tmp_path):
  import struct
  import threading

  row = np.arange(100, dtype=np.uint8)
  key = (b"\x01" * 32, 0)
  tiers = [DiskTier(tmp_path, 1 << 20, "ab12", payload_bytes={0: 100}) for _ in range(2)]
  assert tiers[0]._tmp_path(tiers[0]._path(key)) != tiers[0]._path(key).with_suffix(".tmp")
  errors = []

  def write(t):
    try:
      for _ in range(20):
        t._write([key], row[None])
        t._entries.clear()  # write again: the other writer's file is there
    except Exception as err:  # noqa: BLE001
      errors.append(err)

  threads = [threading.Thread(target=write, args=(t,)) for t in tiers]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors and np.array_equal(DiskTier(tmp_path, 1 << 20, "ab12").get(key), row)
  # A self-consistent file (header, size, checksum all agree) of another block size is a miss.
  import hashlib

  payload = bytes(200)
  path = tiers[0]._path(key)
  path.write_bytes(struct.pack("<8sQ32s", b"JAXKVBLK", 200, hashlib.sha256(payload).digest()) + payload)
  checked = DiskTier(tmp_path, 1 << 20, "ab12", payload_bytes={0: 100})
  assert checked.get(key) is None and not path.exists()


def test_fingerprint_covers_every_weight_element():
  """One element anywhere (not only where a sample would look) changes the fingerprint."""
  import jax

  params = runner().params
  plan = engine().plan
  fp = offload_fingerprint(plan, params)
  leaves, treedef = jax.tree.flatten(params)
  big = max(range(len(leaves)), key=lambda i: leaves[i].size)
  for flat_index in (1, leaves[big].size // 2 + 3, leaves[big].size - 1):
    changed = list(leaves)
    x = leaves[big].reshape(-1)
    changed[big] = x.at[flat_index].set(x[flat_index] + 1).reshape(leaves[big].shape)
    assert offload_fingerprint(plan, jax.tree.unflatten(treedef, changed)) != fp


def test_swap_in_with_fewer_blocks_than_swapped_out():
  """A request preempted with a block held for rejected draft positions is re-admitted with one
  block fewer in that group: its tokens' blocks are restored, nothing else is written."""
  from jaxkv.engine.offload import SwapSpace

  e = engine(k=3)
  rng = np.random.default_rng(5)
  caches = {n: jnp.asarray(rng.integers(0, 256, a.shape, dtype=np.uint8)) for n, a in e.executor.caches.items()}
  before = {n: np.asarray(a) for n, a in caches.items()}
  groups = len(e.plan.kv_cache_groups)
  swap = SwapSpace(e.plan, 1 << 30)
  out = tuple([3, 4] if g == 0 else [] for g in range(groups))
  assert swap.swap_out("r", out)
  swap.start_store_kv(caches)
  back = tuple([7] if g == 0 else [] for g in range(groups))  # one block fewer, elsewhere
  swap.swap_in("r", back)
  after = {n: np.asarray(a) for n, a in swap.start_load_kv(caches).items()}
  assert e.plan.layout == "packed"  # one arena: a block is one row
  (arena,) = after
  changed = after[arena] != before[arena]
  assert set(np.nonzero(changed.any(axis=1))[0].tolist()) == {7}  # only the new block is written
  # ... with block 3's bytes of group 0 (block 4, past the accepted tokens, is not restored).
  assert np.array_equal(after[arena][7][changed[7]], before[arena][3][changed[7]])
  assert swap.used_bytes == 0


def _ownership_holds(e: LLMEngine) -> None:
  """Every block's references are its owners among the live requests; free blocks are exactly
  those with none; no request holds the null block."""
  owners = collections.Counter(b.block_id for m in e.kv.managers for blocks in m.req_to_blocks.values() for b in blocks)
  pool = e.kv.block_pool
  assert 0 not in owners
  for b in pool.blocks[1:]:
    assert b.ref_cnt == owners.get(b.block_id, 0), (b, owners.get(b.block_id, 0))
  assert pool.get_num_free_blocks() == sum(b.ref_cnt == 0 for b in pool.blocks[1:])


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_randomized_tier_stress(tier, tmp_path):
  """Shared prefixes, a small tier (evictions), swap preemption with drafts, aborts, requests
  arriving while others run: every finished request's tokens are its tokens alone, the ownership
  invariants hold after every step, and nothing raises."""
  rng = np.random.default_rng(32 if tier == "host" else 33)
  bases = [[int(t) for t in rng.integers(1, 256, 2 * BS + 8)] for _ in range(2)]
  # Prompts a few tokens short of two blocks, sharing a random part of one of two bases: decoding
  # grows each into its third block, which the tight cache cannot give them all.
  prompts_ = []
  for _ in range(10):
    target = 2 * BS - int(rng.integers(2, 6))
    share = int(rng.integers(BS - 8, target - 1))
    prompts_.append(bases[int(rng.integers(2))][:share] + [int(t) for t in rng.integers(1, 256, target - share)])
  sampling = SamplingParams(max_tokens=6)
  alone = [r.output_token_ids for r in engine(k=2).generate(prompts_, sampling)]
  probe = engine(k=2)
  tight = (1 + 3 * (probe.plan.blocks_per_request(1) + 1) + 1) * probe.plan.bytes_per_block
  e = engine(
    k=2,
    memory_bytes=tight,
    preemption_mode="swap",
    enable_prefix_caching=True,
    kv_offload=tier,
    kv_offload_bytes=6 * probe.plan.bytes_per_block,
    **({"kv_offload_dir": str(tmp_path)} if tier == "disk" else {}),
  )
  pending, aborted, done = list(range(len(prompts_))), set(), set()
  streamed = collections.defaultdict(list)
  while pending or e.has_unfinished():
    for _ in range(int(rng.integers(0, 3))):
      if pending:
        i = pending.pop(0)
        e.add_request(str(i), prompts_[i], sampling)
    if rng.random() < 0.05 and e.has_unfinished():
      victim = str(int(rng.integers(len(prompts_))))
      if victim in e._requests:
        e.abort(victim)
        aborted.add(int(victim))
    for out in e.step():
      streamed[int(out.request_id)] += out.new_token_ids
      if out.finished:
        done.add(int(out.request_id))
    _ownership_holds(e)
  e.wait_for_save()
  assert e.scheduler.num_preemptions > 0 and e.swap.num_swapped_out > 0 and e.num_draft_tokens > 0
  finished = done - aborted
  assert finished | aborted == set(range(len(prompts_)))  # every request ended, none lost
  for i in finished:
    assert streamed[i] == alone[i], i
