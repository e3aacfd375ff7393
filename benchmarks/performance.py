"""Real-size speed, side by side in one lease: jaxkv against the HF eager peer on the same model.

Runs the HF peer (``shared/tools/hf_peer_bench.py``: transformers eager + flash-linear-attention,
bf16, 4-layer slice of the released dimensions, random weights) in a subprocess first, so it has
the GPU to itself and frees it on exit; then measures the device's memory ceiling and serves the
same model with jaxkv (``glm-5.3-flash-slice4``, bf16 weights, fp8 indexer keys, bf16 latents,
packed layout, block 1024) at each batch: prefill of ``batch x context`` tokens, then timed decode
steps in which every request decodes (``jaxkv.engine.benchmark.benchmark_decode``).

Rooflines, from what the step does, over rates measured in the same run (the memory ceiling twice,
before and after the timed runs, each after a second of the same calls; the larger is the ceiling:
one H100 lease of 2026-12-06 read 2.15 to 2.56 TB/s from a single cold measurement, which moved a
row's fraction of its roofline by up to 18 points). The ceiling is the larger of a copy's rate
(read + written) and a reduction's (read only), as a step mostly reads:

* decode: the weight bytes a step reads (lm_head, attention and KDA projections, dense MLPs, shared
  experts, and the distinct routed experts each MoE layer's router chose in the timed steps) plus
  the KV bytes, over the ceiling. The distinct experts are counted by a second pass over the
  same requests (same weights, prompts and greedy tokens, so the same routing) with the router's
  output sent to the host (``jax.debug.callback``), which the timed pass does not have. Random
  weights route unevenly: fewer distinct experts than uniform routing's expectation
  ``E (1 - (1 - k/E)^batch)``, which is also reported.
* prefill: per step (``ceil(batch x context / budget)`` equal steps), the larger of its multiply-add
  FLOPs (2 x active parameters per token, sparse MLA over each token's selected rows, the indexer's
  pooled keys, the KDA recurrence) over the rate of a large bf16 GEMM and its weight reads (the
  dense weights and the distinct routed experts the router chose in the prefill steps, counted
  as for decode) over the ceiling: every step re-reads the experts its tokens route to, so
  the step size moves this floor. The FLOPs alone over the GEMM rate are reported as well
  (``prefill_compute_floor_s``).

Writes one JSON line per measurement to ``--out`` and prints the table of docs/performance.md.

    python benchmarks/performance.py --out docs/results/performance-h200.jsonl --peer shared/tools/hf_peer_bench.py
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run_peer(peer: str, context: int) -> tuple[dict[int, dict], str | None]:
  """The peer's JSON lines by batch, and its error's last line if it failed (at 32k tokens HF
  eager may run out of memory after the batches it finished: both are results)."""
  proc = subprocess.run([sys.executable, peer, str(context)], capture_output=True, text=True)
  rows = {}
  for line in proc.stdout.splitlines():
    if line.startswith("{"):
      row = json.loads(line)
      if "batch" in row:
        rows[row["batch"]] = row
  error = None
  if proc.returncode:
    print(f"peer failed ({proc.returncode}): {proc.stderr[-2000:]}", file=sys.stderr)
    lines = proc.stderr.strip().splitlines()
    error = f"exit {proc.returncode}: {lines[-1] if lines else 'no output'}"
  return rows, error


def _median_s(f, *args, iters: int) -> float:
  """Median seconds of ``iters`` calls of ``f(*args)`` after one warm-up call."""
  import jax
  import numpy as np

  jax.block_until_ready(f(*args))
  times = []
  for _ in range(iters):
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    times.append(time.perf_counter() - t)
  return float(np.median(times))


def _warm_rate(f, x, nbytes: int, iters: int, warm_s: float) -> float:
  """``nbytes`` per median second of ``f(x)`` (``iters`` calls), timed after ``warm_s`` seconds of
  the same calls (the card at its working clocks, not idle ones)."""
  import jax

  end = time.perf_counter() + warm_s
  while time.perf_counter() < end:
    jax.block_until_ready(f(x))
  return nbytes / _median_s(f, x, iters=iters)


def _random_words(nbytes: int):
  import jax
  import jax.numpy as jnp

  return jax.random.bits(jax.random.key(0), (nbytes // 4,), jnp.uint32)


def copy_bandwidth(nbytes: int = 2 << 30, iters: int = 50, warm_s: float = 1.0) -> float:
  """Bytes read + written per second by a device copy of ``nbytes``."""
  import jax
  import jax.numpy as jnp

  return _warm_rate(jax.jit(lambda a: a ^ jnp.uint32(1)), _random_words(nbytes), 2 * nbytes, iters, warm_s)


def read_bandwidth(nbytes: int = 2 << 30, iters: int = 50, warm_s: float = 1.0) -> float:
  """Bytes read per second by a device reduction of ``nbytes`` (a decode step mostly reads)."""
  import jax
  import jax.numpy as jnp

  return _warm_rate(jax.jit(jnp.max), _random_words(nbytes), nbytes, iters, warm_s)


def memory_ceiling() -> tuple[float, dict]:
  """The roofline's bandwidth, the larger of a copy's and a read's rate, and both readings (TB/s,
  for the output). A step is mostly reads (its weights), and on some cards the copy runs well below
  them: one H100 of 2026-12-06 copied at 1.96 TB/s while the step's expert reads ran faster, which
  put a row at 116% of its roofline."""
  copy, read = copy_bandwidth(), read_bandwidth()
  return max(copy, read), {"copy_bandwidth_TBps": copy / 1e12, "read_bandwidth_TBps": read / 1e12}


def gemm_rate(n: int = 8192, iters: int = 20) -> float:
  """FLOP/s of an ``n x n x n`` bf16 matmul with float32 accumulation (median of ``iters``)."""
  import jax
  import jax.numpy as jnp

  a, b = (jax.random.normal(jax.random.key(i), (n, n), jnp.bfloat16) for i in range(2))
  return (
    2 * n**3 / _median_s(jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32)), a, b, iters=iters)
  )


def _param_sizes(runner) -> dict[str, int]:
  """Bytes and elements of the weights a step reads: ``dense`` (all but the embedding, whose rows
  are gathered, and the routed experts), ``routed`` (all experts of all MoE layers), ``lm_head``."""
  from flax import nnx

  out = {"dense_bytes": 0, "routed_bytes": 0, "dense_params": 0, "routed_params": 0, "lm_head_params": 0}
  for path, leaf in nnx.to_flat_state(runner.params):
    value = leaf.get_value()
    name = ".".join(str(p) for p in path)
    if name.startswith("embed_tokens"):
      continue
    kind = "routed" if ".experts_" in name else "dense"
    out[f"{kind}_bytes"] += value.nbytes
    out[f"{kind}_params"] += value.size
    if name.startswith("lm_head"):
      out["lm_head_params"] += value.size
  return out


def expected_distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
  """Distinct experts ``tokens`` tokens reach when each picks ``top_k`` of ``num_experts`` uniformly."""
  return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


def decode_bytes(runner, batch: int, context: int, distinct_experts: float, kv_cache_dtype: str = "bfloat16") -> dict:
  """Bytes one decode step must read: weights (each MoE layer's ``distinct_experts`` routed experts)
  and KV (each DSA layer's selected latents and pooled keys; the KDA states read and written)."""
  from pallas_kernels.cache_write import entry_bytes

  cfg = runner.config
  sizes = _param_sizes(runner)
  experts = sizes["routed_bytes"] * distinct_experts / cfg.n_routed_experts
  dsa = len(cfg.dsa_layers)
  selected = min(context, cfg.index_topk + cfg.index_kpool - 1)
  kv = (
    batch
    * dsa
    * (
      selected * entry_bytes(cfg.kv_lora_rank, kv_cache_dtype) + (context // cfg.index_kpool) * (cfg.index_head_dim + 4)
    )
  )
  kda_state = cfg.linear_num_heads * cfg.linear_head_dim**2 * 4
  kv += batch * len(cfg.kda_layers) * 2 * kda_state
  return {
    "dense_weight_bytes": sizes["dense_bytes"],
    "routed_expert_bytes": experts,
    "distinct_experts": distinct_experts,
    "kv_bytes": kv,
    "total_bytes": sizes["dense_bytes"] + experts + kv,
  }


def prefill_flops(runner, batch: int, context: int) -> float:
  """Multiply-add FLOPs of prefilling ``batch`` prompts of ``context`` tokens (2 per multiply-add):
  the projections and MLPs at their active parameters (``k`` of the routed experts; the LM head
  once a request), sparse MLA over the rows each token selects (latent scores and values, absorbed
  form, no RoPE dims), the indexer over the pooled keys each token sees, and the KDA recurrence's state update."""
  cfg = runner.config
  sizes = _param_sizes(runner)
  active = (
    sizes["dense_params"]
    - sizes["lm_head_params"]
    + sizes["routed_params"] * cfg.num_experts_per_tok / cfg.n_routed_experts
  )
  flops = 2.0 * active * batch * context + 2.0 * sizes["lm_head_params"] * batch
  pos = range(1, context + 1)
  selected = sum(min(p, cfg.index_topk + cfg.index_kpool - 1) for p in pos)
  pooled = sum(p // cfg.index_kpool for p in pos)
  per_layer = (
    2.0 * cfg.num_attention_heads * selected * 2 * cfg.kv_lora_rank
    + 2.0 * cfg.index_n_heads * cfg.index_head_dim * pooled
  )
  flops += batch * len(cfg.dsa_layers) * per_layer
  # decay, k^T S, the rank-one update and q^T S: four passes over the [K, V] state a token.
  flops += batch * context * len(cfg.kda_layers) * 4 * 2.0 * cfg.linear_num_heads * cfg.linear_head_dim**2
  return flops


def prefill_roofline(runner, flops: float, steps: int, distinct_experts: float, bandwidth: float, gemm: float) -> dict:
  """Least time of a prefill of ``flops`` in ``steps`` equal steps: each step at least its FLOPs at
  the GEMM rate and at least its weight reads at the memory ceiling (the dense weights, and each MoE
  layer's ``distinct_experts`` routed experts: re-read by every step, which is what a larger step
  amortizes)."""
  cfg = runner.config
  sizes = _param_sizes(runner)
  step_bytes = sizes["dense_bytes"] + sizes["routed_bytes"] * distinct_experts / cfg.n_routed_experts
  compute_s, read_s = flops / steps / gemm, step_bytes / bandwidth
  return {
    "prefill_steps": steps,
    "prefill_distinct_experts": distinct_experts,
    "prefill_step_weight_bytes": step_bytes,
    "prefill_step_compute_s": compute_s,
    "prefill_step_read_s": read_s,
    "prefill_roofline_s": steps * max(compute_s, read_s),
  }


def routed_experts_per_step(engine, prompts, new_tokens: int, steps: int) -> dict:
  """Distinct routed experts per MoE layer in the first ``steps`` steps in which every request
  decodes, and in each prefill step before them, counted from the router's output: ``engine`` must
  be fresh (nothing compiled with its statics), so its step is traced with ``MoE.route`` reporting
  to the host."""
  from unittest import mock

  import jax
  import numpy as np

  from jaxkv.engine.request import SamplingParams
  from models.glm5_next.model import MoE

  batch, counts, prefill = len(prompts), [], []
  route = MoE.route

  def record(idx):
    # Decode steps run exactly `batch` tokens; prefill steps the budget (its padding rows are routed
    # and multiplied as well, so they count).
    (counts if idx.shape[0] == batch else prefill).append(len(np.unique(idx)))

  def reporting_route(self, x):
    idx, w = route(self, x)
    jax.debug.callback(record, idx.reshape(-1, idx.shape[-1]))
    return idx, w

  with mock.patch.object(MoE, "route", reporting_route):
    reqs = [engine.add_request(f"route-{i}", p, SamplingParams(max_tokens=new_tokens)) for i, p in enumerate(prompts)]
    while not all(r.output_token_ids for r in reqs):
      engine.step()
    jax.effects_barrier()
    counts.clear()
    prefill_calls = list(prefill)
    for _ in range(steps):
      engine.step()
    jax.effects_barrier()
  layers = sum(t == "sparse" for t in engine.runner.config.mlp_layer_types)
  if len(counts) < steps * layers:
    raise RuntimeError(f"the router reported {len(counts)} decode calls, expected {steps} steps x {layers} MoE layers.")
  return {
    "distinct_experts": float(np.mean(counts)),
    "distinct_experts_min": int(np.min(counts)),
    "distinct_experts_max": int(np.max(counts)),
    "routing_calls": len(counts),
    "prefill_distinct_experts": float(np.mean(prefill_calls)) if prefill_calls else 0.0,
    "prefill_routing_calls": len(prefill_calls),
    "prefill_steps_routed": len(prefill_calls) // layers,
  }


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", default=None, help="JSON lines file")
  p.add_argument("--peer", default=None, help="path of hf_peer_bench.py (skipped when absent)")
  p.add_argument("--batches", default="1,8,32")
  p.add_argument("--context", type=int, default=1024)
  p.add_argument("--steps", type=int, default=32)
  p.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens (prefill chunk)")
  p.add_argument(
    "--long-prefill-token-threshold",
    default="0",
    help="EngineConfig.long_prefill_token_threshold (tokens of one request a step; 0: off), or several "
    "comma-separated, each run in turn",
  )
  p.add_argument("--implementation", default="auto", choices=("auto", "xla", "pallas"))
  p.add_argument(
    "--profile", default=None, help="trace each batch's decode steps into DIR/bB (the step's HLO into DIR/hlo)"
  )
  p.add_argument(
    "--metadata-implementations",
    default="auto",
    help="comma-separated EngineConfig.step_metadata_implementation values, each run in turn",
  )
  p.add_argument("--config", default="glm-5.3-flash-slice4")
  p.add_argument("--memory-gib", type=float, default=8.0, help="KV-cache budget")
  p.add_argument(
    "--max-model-len",
    type=int,
    default=None,
    help="the server's limit (default: the run's longest request); it sets the block tables' width, "
    "so the indexer's rows of scores (max_model_len / 4 entries)",
  )
  p.add_argument(
    "--greedy-step",
    default="on",
    help="EngineConfig.greedy_step: on, off, or both comma-separated, each run in turn (one process: "
    "the full sampler's executable compiles once)",
  )
  p.add_argument("--explain-cache-misses", action="store_true", help="log why each trace missed jit's cache")
  p.add_argument("--kv-cache-dtype", default="bfloat16", choices=("bfloat16", "fp8"), help="MLA latent cache")
  p.add_argument(
    "--linear-prefill",
    default="recurrent",
    help="KDA prompt tokens (CacheConfig): recurrent, chunked, or both comma-separated, each run in turn",
  )
  args = p.parse_args()
  batches = [int(b) for b in args.batches.split(",")]
  if not set(args.greedy_step.split(",")) <= {"on", "off"}:
    p.error(f"--greedy-step {args.greedy_step!r}: want on, off or on,off")
  greedy_steps = [g == "on" for g in args.greedy_step.split(",")]
  thresholds = [int(t) for t in args.long_prefill_token_threshold.split(",")]
  rows = []

  def emit(row):
    rows.append(row)
    print(json.dumps(row), flush=True)
    if args.out:
      with open(args.out, "a") as f:
        f.write(json.dumps(row) + "\n")

  peer, peer_error = (
    run_peer(args.peer, args.context) if args.peer and pathlib.Path(args.peer).is_file() else ({}, None)
  )
  for b, row in sorted(peer.items()):
    emit({"system": "hf_peer", **row})
  if peer_error:
    emit({"system": "hf_peer", "context": args.context, "finished_batches": sorted(peer), "error": peer_error})

  import jax

  from jaxkv.profiling import hlo_dump_beside

  hlo_dir = hlo_dump_beside(args.profile)  # each model part's kernels (before JAX starts its backend)
  try:  # before the timed runs: the routing pass after them needs the CPU (2026-12-07's runs lost it)
    jax.devices("cpu")
  except RuntimeError as e:
    raise RuntimeError(
      "the roofline's routing pass sends the router's output to the host (jax.debug.callback), which "
      f"needs JAX's CPU backend; JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS')!r} leaves it out: "
      "list it after the GPU, JAX_PLATFORMS=cuda,cpu"
    ) from e
  if args.explain_cache_misses:  # a compilation after warm-up says why
    jax.config.update("jax_explain_cache_misses", True)
  from jaxkv.engine import EngineConfig, LLMEngine, get_model_family
  from jaxkv.engine.benchmark import benchmark_decode, decode_new_tokens
  from jaxkv.cache.kv_cache_config import CacheConfig
  import numpy as np

  (bandwidth, readings), gemm = memory_ceiling(), gemm_rate()
  emit(
    {
      "system": "device",
      **readings,
      "bf16_gemm_TFLOPs": gemm / 1e12,
      "device": str(jax.devices()[0].device_kind),
      "jax": jax.__version__,
      # The same tokens in two processes need XLA's deterministic ops: its GEMM autotuner may pick
      # another algorithm at each compile (docs/conformance.md), so digests compare only so.
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
  )
  family = get_model_family("glm5_next")
  config = family.builtin_config(args.config)
  t0 = time.perf_counter()
  runner = family.from_random(config, dtype="bfloat16", seed=0, implementation=args.implementation)
  jax.block_until_ready(runner.params)
  build_s = time.perf_counter() - t0
  rng = np.random.default_rng(0)
  runs = []
  for batch in batches:
    prompts = [list(rng.integers(1, config.vocab_size, args.context)) for _ in range(batch)]
    new_tokens = max(
      decode_new_tokens(batch, args.context, args.budget, args.steps, 8 if args.profile else 0, 0, t)
      for t in thresholds
    )
    for linear_prefill in args.linear_prefill.split(","):
      cache = CacheConfig(
        block_size=1024,
        layout="packed",
        kv_cache_dtype=args.kv_cache_dtype,
        indexer_cache_dtype="fp8",
        state_dtype="bfloat16",
        linear_prefill=linear_prefill,
        memory_bytes=int(args.memory_gib * 2**30),
        max_model_len=args.max_model_len or args.context + new_tokens + 64,
      )
      for meta, greedy_step, threshold in itertools.product(
        args.metadata_implementations.split(","), greedy_steps, thresholds
      ):
        # Decode steps run exactly `batch` tokens (no padding routed through the MoE); prefill the budget.
        engine_config = EngineConfig(
          cache=cache,
          max_num_reqs=batch,
          max_num_batched_tokens=args.budget,
          long_prefill_token_threshold=threshold,
          buckets=tuple(sorted({batch, args.budget})),
          step_metadata_implementation=meta,
          greedy_step=greedy_step,
        )
        engine = LLMEngine(runner, engine_config)
        result = benchmark_decode(
          engine,
          prompts,
          steps=args.steps,
          new_tokens=new_tokens,
          profile_dir=f"{args.profile}/b{batch}-{meta}-{linear_prefill}-greedy-{'on' if greedy_step else 'off'}"
          f"-lp{threshold}"
          if args.profile
          else None,
          hlo_dir=hlo_dir,
        )
        del engine
        flops = prefill_flops(runner, batch, args.context)
        row = {
          "system": "jaxkv",
          "config": args.config,
          "build_s": build_s,
          "budget": args.budget,
          "context": args.context,
          "kv_cache_dtype": args.kv_cache_dtype,
          "linear_prefill": linear_prefill,
          "implementation": runner.implementation,
          "step_metadata_implementation": meta,
          "greedy_step": greedy_step,
          **result,
          "prefill_flops": flops,
          "prefill_compute_floor_s": flops / gemm,
        }
        emit(row)
        runs.append((row, prompts, new_tokens, engine_config))
  # The ceiling again, after the card has run the engine; the larger reading is the roofline's.
  end_bandwidth, readings = memory_ceiling()
  bandwidth = max(bandwidth, end_bandwidth)
  emit({"system": "device", "when": "after the timed runs", **readings})
  # The routing pass after every timed one: tracing it with host callbacks needs jit's caches
  # cleared. Runs of one batch and prefill path serve the same tokens (equal digests), so route alike.
  routings = {}
  for row, prompts, new_tokens, engine_config in runs:
    key = (row["batch"], row["linear_prefill"], row["long_prefill_token_threshold"], row["output_tokens_sha256"])
    if key not in routings:
      jax.clear_caches()
      routings[key] = routed_experts_per_step(LLMEngine(runner, engine_config), prompts, new_tokens, args.steps)
    routing = routings[key]
    need = decode_bytes(runner, row["batch"], args.context, routing["distinct_experts"], args.kv_cache_dtype)
    roof_ms = need["total_bytes"] / bandwidth * 1e3
    uniform = expected_distinct_experts(config.n_routed_experts, config.num_experts_per_tok, row["batch"])
    uniform_bytes = decode_bytes(runner, row["batch"], args.context, uniform, args.kv_cache_dtype)["total_bytes"]
    row.update(
      {
        **routing,
        **need,
        "roofline_bandwidth_TBps": bandwidth / 1e12,
        "uniform_distinct_experts": uniform,
        "uniform_routing_roofline_ms": uniform_bytes / bandwidth * 1e3,
        "roofline_ms": roof_ms,
        "roofline_fraction": roof_ms / row["step_ms_p50"],
      }
    )
    steps = routing["prefill_steps_routed"]  # as the engine scheduled them
    pre = prefill_roofline(runner, row["prefill_flops"], steps, routing["prefill_distinct_experts"], bandwidth, gemm)
    row.update({**pre, "prefill_roofline_fraction": pre["prefill_roofline_s"] / row["prefill_s"]})
    emit({**row, "system": "jaxkv_roofline"})

  print(
    "\n| batch | jaxkv ms/step | HF ms/step | speed-up | jaxkv tok/s | HF tok/s | roofline ms | of roofline |"
    " distinct experts (uniform) | jaxkv prefill s | HF prefill s | prefill of roofline |"
  )
  print("|---|---|---|---|---|---|---|---|---|---|---|---|")
  for r, *_ in runs:
    h = peer.get(r["batch"], {})
    speed = f"{h['step_ms'] / r['step_ms_p50']:.1f}x" if h else "-"
    label = f"{r['batch']}" + ("" if r["greedy_step"] else " (greedy step off)")
    if r["long_prefill_token_threshold"]:
      label += f" ({r['long_prefill_token_threshold']} tokens a request a step)"
    print(
      f"| {label} | {r['step_ms_p50']:.2f} | {h.get('step_ms', '-')} | {speed} | "
      f"{r['decode_tokens_per_s']:.1f} | {h.get('decode_tok_s', '-')} | {r['roofline_ms']:.2f} | "
      f"{r['roofline_fraction']:.0%} | {r['distinct_experts']:.1f} ({r['uniform_distinct_experts']:.1f}) | {r['prefill_s']:.2f} | "
      f"{h.get('prefill_s', '-')} | {r['prefill_roofline_fraction']:.0%} |"
    )
  return 0


if __name__ == "__main__":
  sys.exit(main())
