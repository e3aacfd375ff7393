"""KV offload in manager blocks: warm from host and from disk equals cold, bitwise; the disk tier
across processes, corrupt files, eviction; one load for two requests; aborts; swap on preemption.

Modelled on vLLM's ``tests/v1/kv_offload`` (warm output equals cold output, hits above zero).
"""

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
from jaxkv.kv_offload import DiskTier, HostTier, offload_fingerprint
from test_engine_equivalence import runner
from test_prefix_caching import BS, SAMPLING, prompts

PROMPT = prompts()[0]  # 2 blocks + 20 tokens: hits of 2 blocks (1 with drafts)


def engine(**kw) -> LLMEngine:
  cache = CacheConfig(block_size=BS, max_model_len=512, layout=kw.pop("layout", "packed"),
                      num_speculative_tokens=kw.pop("k", 0), memory_bytes=kw.pop("memory_bytes", 64 << 20))
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
  assert tier.get((b"b", 0)) is None and np.array_equal(tier.get((b"c", 0)), rows[2]) and tier.used_bytes == 200
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

def test_swap_preempted_requests_produce_what_they_produce_unpreempted():
  probe = engine()
  state_blocks = probe.plan.blocks_per_request(1) - 1  # KDA groups + tail ring
  # Each request fits in two token blocks; only one can grow into its third at a time.
  tight = (1 + 3 * (state_blocks + 2) + 1) * probe.plan.bytes_per_block
  rng = np.random.default_rng(8)
  ps = [[int(t) for t in rng.integers(1, 256, n)] for n in (2 * BS - 4, 2 * BS - 6, 2 * BS - 3)]
  sampling = SamplingParams(max_new_tokens=8, logprobs=5)  # each crosses into its third block
  roomy = [result(r) for r in engine().generate(ps, sampling)]
  # Async steps: the preempted request's last token is still in flight when it is swapped out.
  e = engine(memory_bytes=tight, preemption_mode="swap")
  got = [result(r) for r in e.generate(ps, sampling)]
  assert e.swap.num_swapped_out > 0 and e.swap.num_swapped_in == e.swap.num_swapped_out
  assert got == roomy
  assert e.kv.num_free_blocks == e.plan.num_blocks - 1 and e.swap.used_bytes == 0
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
