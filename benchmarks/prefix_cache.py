"""Time to first token with the prefix cache: cold, warm from the device, from host memory, from disk.

Serves ``glm-5.3-flash-slice4`` (the released dimensions in 4 layers, bf16 random weights, fp8
pooled keys, packed layout, block 1024) one request at a time, a prompt of ``--context`` tokens
(default 8192 + 128: a hit covers 8 blocks and leaves 128 tokens to compute), and times the first
token of each case after warm-up (median of ``--repeats`` fresh prompts):

* cold: nothing cached (prefix caching on: chunks end at block boundaries, states checkpointed);
* device: the same prompt again, its blocks and KDA checkpoint still on the device;
* host: the device's index reset (``reset_prefix_cache``), the blocks read back from the host tier;
* disk: likewise from the disk tier, in an engine of its own.

Each warm case checks its tokens against the cold run (greedy, bitwise). The bytes moved per hit
and the implied transfer rate are written next to the times.

    python benchmarks/prefix_cache.py --out docs/results/prefix-cache-h200.jsonl --disk-dir /tmp/jaxkv-disk
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--config", default="glm-5.3-flash-slice4")
  p.add_argument("--context", type=int, default=8192 + 128, help="prompt tokens")
  p.add_argument("--block-size", type=int, default=1024)
  p.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens (prefill chunk)")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--memory-gib", type=float, default=8.0, help="device KV-cache budget")
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--disk-dir", default=None, help="disk tier directory (default: a temporary one)")
  p.add_argument("--out", default=None, help="JSON lines file")
  args = p.parse_args()

  import jax
  import numpy as np

  from jaxkv.engine import EngineConfig, LLMEngine, SamplingParams, get_model_family
  from jaxkv.cache.kv_cache_config import CacheConfig

  family = get_model_family("glm5_next")
  config = family.builtin_config(args.config)
  runner = family.from_random(config, dtype=args.dtype, seed=0, implementation="xla")
  jax.block_until_ready(runner.params)
  fp8 = args.dtype == "bfloat16"
  cache = CacheConfig(
    block_size=args.block_size,
    layout="packed",
    kv_cache_dtype=args.dtype,
    indexer_cache_dtype="fp8" if fp8 else args.dtype,
    state_dtype=args.dtype,
    memory_bytes=int(args.memory_gib * 2**30),
    max_model_len=args.context + 64,
  )
  rest = args.context % args.block_size or args.block_size
  buckets = tuple(sorted({min(rest, args.budget), args.budget}))
  disk_dir = args.disk_dir or tempfile.mkdtemp(prefix="jaxkv-disk-")

  def engine(tier: str) -> LLMEngine:
    return LLMEngine(
      runner,
      EngineConfig(
        cache=cache,
        max_num_reqs=1,
        max_num_batched_tokens=args.budget,
        buckets=buckets,
        enable_prefix_caching=True,
        kv_offload=tier,
        kv_offload_bytes=64 << 30,
        kv_offload_dir=disk_dir,
      ),
    )

  def first_token(e: LLMEngine, prompt) -> tuple[float, object]:
    """Seconds from admission to the first token read back, and the request."""
    e.wait_for_save()  # earlier saves are not this request's time
    req = e.add_request(f"r{time.perf_counter_ns()}", prompt, SamplingParams(max_tokens=2))
    t0 = time.perf_counter()
    while not req.output_token_ids:
      e.step()
    dt = time.perf_counter() - t0
    while e.has_unfinished():
      e.step()
    return dt, req

  host, disk = engine("host"), engine("disk")
  for e in (host, disk):
    e.warmup()
  rng = np.random.default_rng(0)
  prompts = [[int(t) for t in rng.integers(1, config.vocab_size, args.context)] for _ in range(args.repeats + 1)]
  first_token(host, prompts[-1])  # a first pass on every path (loads, saves, copies compile once)
  host.kv.reset_prefix_cache()
  first_token(host, prompts[-1])
  times: dict[str, list[float]] = {k: [] for k in ("cold", "device", "host", "disk")}
  cached: dict[str, list[int]] = {k: [] for k in times}
  loaded_blocks = {"host": [], "disk": []}
  loaded_bytes = {"host": [], "disk": []}

  def measure(case: str, e: LLMEngine, prompt, cold=None):
    """One timed first token of ``case``; from a tier after the device's index is reset."""
    if case in loaded_blocks:
      e.kv.reset_prefix_cache()
      n, nb = e.connector.num_loaded_blocks, e.connector.num_loaded_bytes
    t, r = first_token(e, prompt)
    if cold is not None:
      assert r.output_token_ids[:1] == cold.output_token_ids[:1], f"{case} hit changed the first token"
    times[case].append(t)
    cached[case].append(r.num_cached_tokens)
    if case in loaded_blocks:
      loaded_blocks[case].append(e.connector.num_loaded_blocks - n)
      loaded_bytes[case].append(e.connector.num_loaded_bytes - nb)
    return r

  for prompt in prompts[:-1]:
    cold = measure("cold", host, prompt)
    measure("device", host, prompt, cold)
    measure("host", host, prompt, cold)
    first_token(disk, prompt)  # fills the disk tier (and the disk engine's device cache)
    disk.wait_for_save()
    measure("disk", disk, prompt, cold)
  rows = []
  for case, ts in times.items():
    med = float(np.median(ts))
    row = {
      "case": case,
      "config": args.config,
      "context": args.context,
      "block_size": host.plan.block_size,
      "ttft_s_median": med,
      "ttft_s_all": ts,
      "num_cached_tokens": cached[case][0],
      "device": str(jax.devices()[0].device_kind),
      "jax": jax.__version__,
    }
    if case in loaded_blocks:
      row |= {
        "loaded_blocks": loaded_blocks[case][0],
        "loaded_bytes": loaded_bytes[case][0],
        "load_GBps": loaded_bytes[case][0] / med / 1e9,
      }
    rows.append(row)
    print(json.dumps(row), flush=True)
    if args.out:
      with open(args.out, "a") as f:
        f.write(json.dumps(row) + "\n")
  print(f"\n| case | TTFT (median of {args.repeats}) | vs cold | cached tokens | blocks loaded | MB loaded |")
  print("|---|---|---|---|---|---|")
  cold_s = rows[0]["ttft_s_median"]
  for r in rows:
    moved = f"{r['loaded_blocks']} | {r['loaded_bytes'] / 1e6:.1f}" if "loaded_bytes" in r else "- | -"
    print(
      f"| {r['case']} | {r['ttft_s_median'] * 1e3:.1f} ms | {cold_s / r['ttft_s_median']:.1f}x | "
      f"{r['num_cached_tokens']} | {moved} |"
    )
  return 0


if __name__ == "__main__":
  sys.exit(main())
