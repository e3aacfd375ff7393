"""Where the host's time goes in a decode step (the part of a step the GPU may wait for).

Serves ``--batch`` requests of ``--context`` tokens on ``glm-5.3-flash-slice4`` (as
``benchmarks/performance.py``: bf16 weights, fp8 pooled keys, packed layout, block 1024), then
times ``--steps`` decode steps twice: plainly (step wall time, the time ``step()`` spends waiting
for the previous step's outputs, and the rest, the host's work, in its parts: scheduling, the
input's lay-out, the dispatch, the outputs' bookkeeping), and under ``cProfile`` (the heaviest host
functions). With async scheduling the GPU idles only when the host work per step
exceeds the GPU's time per step.

    python benchmarks/host_overhead.py --batch 1 --out docs/results/host-overhead-h200.json

``--no-device`` measures the host's work alone on any machine: the executor's two device calls
(the step's dispatch and its read-back) are replaced by instant stand-ins that return random tokens, so
what is timed is the scheduling, the lay-out and the bookkeeping (the ``glm-5.3-flash-tiny``
model is enough: the host's work does not depend on the model's size).

    python benchmarks/host_overhead.py --no-device --config glm-5.3-flash-tiny --dtype float32 --batch 32
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import pathlib
import pstats
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _without_device(executor, rng) -> None:
  """The executor's step dispatch and read-back as instant stand-ins: each step's outputs are
  random tokens, every draft rejected and no log-probs (the layout ``read_back`` returns)."""
  from jaxkv.engine.step_executor import _out_size, _unpack_outputs

  size, tokens = _out_size(executor.out_shapes), math.prod(executor.out_shapes[0][0])

  def launch(packing, buf):
    flat = np.zeros(size, np.int32)
    flat[:tokens] = rng.integers(1, executor.vocab_size, tokens)  # the tokens; no draft accepted
    return flat, None

  executor.launch = launch
  executor.read_back = lambda out: _unpack_outputs(out[0], executor.out_shapes) + [None]


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--config", default="glm-5.3-flash-slice4")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--context", type=int, default=1024)
  p.add_argument("--steps", type=int, default=200)
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--implementation", default="auto", choices=("auto", "xla", "pallas"), help="attention kernels")
  p.add_argument("--memory-gib", type=float, default=8.0, help="KV-cache budget")
  p.add_argument("--long-prefill-token-threshold", type=int, default=0, help="EngineConfig's (0: off)")
  p.add_argument("--no-device", action="store_true", help="the device's calls replaced by instant stand-ins")
  p.add_argument("--out", default=None, help="JSON file of the numbers and the profile's top entries")
  args = p.parse_args()

  import jax

  from jaxkv.engine import EngineConfig, LLMEngine, SamplingParams, get_model_family
  from jaxkv.cache.kv_cache_config import CacheConfig

  family = get_model_family("glm5_next")
  config = family.builtin_config(args.config)
  runner = family.from_random(config, dtype=args.dtype, seed=0, implementation=args.implementation)
  fp8 = args.dtype == "bfloat16"
  cache = CacheConfig(
    block_size=1024,
    layout="packed",
    kv_cache_dtype=args.dtype,
    indexer_cache_dtype="fp8" if fp8 else args.dtype,
    state_dtype=args.dtype,
    memory_bytes=int(args.memory_gib * 2**30),
    max_model_len=args.context + 3 * args.steps + 64,
  )
  budget = min(2048, args.batch * args.context)
  engine = LLMEngine(
    runner,
    EngineConfig(
      cache=cache,
      max_num_reqs=args.batch,
      max_num_batched_tokens=budget,
      buckets=tuple(sorted({args.batch, budget})),
      long_prefill_token_threshold=args.long_prefill_token_threshold,
    ),
  )
  if args.no_device:
    _without_device(engine.executor, np.random.default_rng(1))
  engine.warmup()
  rng = np.random.default_rng(0)
  reqs = [
    engine.add_request(
      f"r{i}",
      [int(t) for t in rng.integers(1, config.vocab_size, args.context)],
      SamplingParams(max_tokens=3 * args.steps),
    )
    for i in range(args.batch)
  ]
  while not all(r.output_token_ids for r in reqs):
    engine.step()
  for _ in range(10):
    engine.step()
  # Seconds in each part of the host's step: the wait for the step before (read_back), and the
  # host's own work split into scheduling, the input's lay-out, the dispatch (one transfer in, the
  # jitted call, the outputs' copy out started) and the outputs' bookkeeping.
  spent = {}

  def timed(obj, name, key):
    fn = getattr(obj, name)

    def wrapper(*a, **kw):
      t = time.perf_counter()
      try:
        return fn(*a, **kw)
      finally:
        spent[key] = spent.get(key, 0.0) + time.perf_counter() - t

    setattr(obj, name, wrapper)

  timed(engine.executor, "read_back", "wait")
  timed(engine.scheduler, "schedule", "schedule")
  timed(engine, "_launch", "lay_out_and_dispatch")
  timed(engine.executor, "launch", "dispatch")
  timed(engine, "_update", "update")
  lat = []
  for _ in range(args.steps):
    t = time.perf_counter()
    engine.step()
    lat.append(time.perf_counter() - t)
  step_ms = float(np.median(lat)) * 1e3
  host_ms = (sum(lat) - spent["wait"]) / args.steps * 1e3
  parts = {f"{k}_ms_per_step": v / args.steps * 1e3 for k, v in spent.items()}
  parts["lay_out_ms_per_step"] = parts.pop("lay_out_and_dispatch_ms_per_step") - parts["dispatch_ms_per_step"]
  prof = cProfile.Profile()
  prof.enable()
  for _ in range(args.steps):
    engine.step()
  prof.disable()
  text = io.StringIO()
  pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
  cum = io.StringIO()
  pstats.Stats(prof, stream=cum).sort_stats("cumulative").print_stats(r"jaxkv|models", 25)
  result = {
    "config": args.config,
    "batch": args.batch,
    "device": "none (--no-device)" if args.no_device else str(jax.devices()[0].device_kind),
    "step_ms_p50": step_ms,
    "host_ms_per_step": host_ms,
    **parts,
    "param_leaves": len(engine.executor.param_leaves),
  }
  print(json.dumps(result))
  print(text.getvalue())
  print(cum.getvalue())
  if args.out:
    pathlib.Path(args.out).write_text(
      json.dumps({**result, "profile_tottime": text.getvalue(), "profile_cumulative": cum.getvalue()}, indent=1)
    )
  return 0


if __name__ == "__main__":
  sys.exit(main())
