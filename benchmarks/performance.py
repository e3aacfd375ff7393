"""Real-size speed, side by side in one lease: jaxkv against the HF eager peer on the same model.

Runs the HF peer (``shared/tools/hf_peer_bench.py``: transformers eager + flash-linear-attention,
bf16, 4-layer slice of the released dimensions, random weights) in a subprocess first, so it has
the GPU to itself and frees it on exit; then measures the device's copy bandwidth and serves the
same model with jaxkv (``glm-5.3-flash-slice4``, bf16 weights, fp8 indexer keys, bf16 latents,
packed layout, block 1024) at each batch: prefill of ``batch x context`` tokens, then timed decode
steps in which every request decodes (``jaxkv.engine.benchmark.benchmark_decode``). The roofline
of a decode step is the weight bytes it must read (lm_head, attention and KDA projections, dense
MLPs, shared experts and the distinct routed experts the batch touches, expected under uniform
routing) plus the KV bytes, over the bandwidth measured in the same run.

Writes one JSON line per measurement to ``--out`` and prints the table of docs/performance.md.

    python benchmarks/performance.py --out docs/results/performance-h200.jsonl --peer shared/tools/hf_peer_bench.py
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run_peer(peer: str, context: int) -> dict[int, dict]:
  """The peer's JSON lines by batch ({} when it cannot run here)."""
  proc = subprocess.run([sys.executable, peer, str(context)], capture_output=True, text=True)
  rows = {}
  for line in proc.stdout.splitlines():
    if line.startswith("{"):
      row = json.loads(line)
      if "batch" in row:
        rows[row["batch"]] = row
  if proc.returncode:
    print(f"peer failed ({proc.returncode}): {proc.stderr[-2000:]}", file=sys.stderr)
  return rows


def copy_bandwidth(nbytes: int = 2 << 30, iters: int = 20) -> float:
  """Bytes read + written per second by a device copy of ``nbytes`` (median of ``iters``)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  x = jax.random.bits(jax.random.key(0), (nbytes // 4,), jnp.uint32)
  f = jax.jit(lambda a: a ^ jnp.uint32(1))
  f(x).block_until_ready()
  times = []
  for _ in range(iters):
    t = time.perf_counter()
    f(x).block_until_ready()
    times.append(time.perf_counter() - t)
  return 2 * nbytes / float(np.median(times))


def decode_bytes(runner, batch: int, context: int, plan, kv_cache_dtype: str = "bfloat16") -> dict:
  """Bytes one decode step must read: weights (routed experts by expected distinct count) + KV."""
  import jax
  from flax import nnx

  from pallas_kernels.cache_write import entry_bytes

  cfg = runner.config
  dense = routed = 0
  for path, leaf in nnx.to_flat_state(runner.params):
    n = leaf.get_value().nbytes
    name = ".".join(str(p) for p in path)
    if name.startswith("embed_tokens"):
      continue  # gathered rows only
    if ".experts_" in name:
      routed += n
    else:
      dense += n
  e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
  distinct = e * (1 - (1 - k / e) ** batch)
  experts = routed * distinct / e
  # KV read per step: each DSA layer's selected latents and its pooled keys; KDA states read + written.
  dsa = len(cfg.dsa_layers)
  selected = min(context, cfg.index_topk + cfg.index_kpool - 1)
  kv = batch * dsa * (selected * entry_bytes(cfg.kv_lora_rank, kv_cache_dtype) + (context // cfg.index_kpool) * (cfg.index_head_dim + 4))
  kda_state = cfg.linear_num_heads * cfg.linear_head_dim ** 2 * 4
  kv += batch * len(cfg.kda_layers) * 2 * kda_state
  del jax, plan
  return {"dense_weight_bytes": dense, "routed_expert_bytes": experts, "distinct_experts": distinct,
          "kv_bytes": kv, "total_bytes": dense + experts + kv}


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", default=None, help="JSON lines file")
  p.add_argument("--peer", default=None, help="path of hf_peer_bench.py (skipped when absent)")
  p.add_argument("--batches", default="1,8,32")
  p.add_argument("--context", type=int, default=1024)
  p.add_argument("--steps", type=int, default=32)
  p.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens (prefill chunk)")
  p.add_argument("--implementation", default="auto", choices=("auto", "xla", "pallas"))
  p.add_argument("--profile", default=None, help="trace each batch's decode steps into DIR/bB")
  p.add_argument("--metadata-implementations", default="auto",
                 help="comma-separated EngineConfig.step_metadata_implementation values, each run in turn")
  p.add_argument("--config", default="glm-5.3-flash-slice4")
  p.add_argument("--memory-gib", type=float, default=8.0, help="KV-cache budget")
  p.add_argument("--explain-cache-misses", action="store_true", help="log why each trace missed jit's cache")
  p.add_argument("--kv-cache-dtype", default="bfloat16", choices=("bfloat16", "fp8"), help="MLA latent cache")
  args = p.parse_args()
  batches = [int(b) for b in args.batches.split(",")]
  rows = []

  def emit(row):
    rows.append(row)
    print(json.dumps(row), flush=True)
    if args.out:
      with open(args.out, "a") as f:
        f.write(json.dumps(row) + "\n")

  peer = run_peer(args.peer, args.context) if args.peer and pathlib.Path(args.peer).is_file() else {}
  for b, row in sorted(peer.items()):
    emit({"system": "hf_peer", **row})

  import jax

  if args.explain_cache_misses:  # a compilation after warm-up says why
    jax.config.update("jax_explain_cache_misses", True)
  from jaxkv.engine import EngineConfig, LLMEngine, get_model_family
  from jaxkv.engine.benchmark import benchmark_decode, decode_new_tokens
  from jaxkv.kv_cache_config import CacheConfig
  import numpy as np

  bandwidth = copy_bandwidth()
  emit({"system": "device", "copy_bandwidth_TBps": bandwidth / 1e12, "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__})
  family = get_model_family("glm5_next")
  config = family.builtin_config(args.config)
  t0 = time.perf_counter()
  runner = family.from_random(config, dtype="bfloat16", seed=0, implementation=args.implementation)
  jax.block_until_ready(runner.params)
  build_s = time.perf_counter() - t0
  rng = np.random.default_rng(0)
  for batch in batches:
    prompts = [list(rng.integers(1, config.vocab_size, args.context)) for _ in range(batch)]
    new_tokens = decode_new_tokens(batch, args.context, args.budget, args.steps, 8 if args.profile else 0)
    cache = CacheConfig(block_size=1024, layout="packed", kv_cache_dtype=args.kv_cache_dtype, indexer_cache_dtype="fp8",
                        state_dtype="bfloat16", memory_bytes=int(args.memory_gib * 2**30), max_model_len=args.context + new_tokens + 64)
    for meta in args.metadata_implementations.split(","):
      # Decode steps run exactly `batch` tokens (no padding routed through the MoE); prefill the budget.
      engine = LLMEngine(runner, EngineConfig(cache=cache, max_num_reqs=batch, max_num_batched_tokens=args.budget,
                                              buckets=tuple(sorted({batch, args.budget})),
                                              step_metadata_implementation=meta))
      result = benchmark_decode(engine, prompts, steps=args.steps, new_tokens=new_tokens,
                                profile_dir=f"{args.profile}/b{batch}-{meta}" if args.profile else None)
      need = decode_bytes(runner, batch, args.context, engine.plan, args.kv_cache_dtype)
      roof_ms = need["total_bytes"] / bandwidth * 1e3
      emit({"system": "jaxkv", "config": args.config, "build_s": build_s, "budget": args.budget,
            "context": args.context, "kv_cache_dtype": args.kv_cache_dtype,
            "implementation": runner.implementation, "step_metadata_implementation": meta, **result, **need,
            "roofline_ms": roof_ms, "roofline_fraction": roof_ms / result["step_ms_p50"]})
      del engine

  print(f"\n| batch | jaxkv ms/step | HF ms/step | speed-up | jaxkv tok/s | HF tok/s | roofline ms | of roofline |"
        f" jaxkv prefill s | HF prefill s |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for r in (r for r in rows if r["system"] == "jaxkv"):
    h = peer.get(r["batch"], {})
    speed = f"{h['step_ms'] / r['step_ms_p50']:.1f}x" if h else "-"
    print(f"| {r['batch']} | {r['step_ms_p50']:.2f} | {h.get('step_ms', '-')} | {speed} | "
          f"{r['decode_tokens_per_s']:.1f} | {h.get('decode_tok_s', '-')} | {r['roofline_ms']:.2f} | "
          f"{r['roofline_fraction']:.0%} | {r['prefill_s']:.2f} | {h.get('prefill_s', '-')} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
