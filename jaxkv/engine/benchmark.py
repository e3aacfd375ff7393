"""The engine benchmark behind ``jaxkv bench``: warm-up, prefill, timed decode steps, a profile."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence

import numpy as np

from jaxkv.engine.engine import LLMEngine
from jaxkv.engine.request import SamplingParams
from jaxkv.utils import cdiv

__all__ = ["benchmark_decode", "decode_new_tokens", "prefill_steps"]


def prefill_steps(batch: int, context: int, max_num_batched_tokens: int, long_prefill_token_threshold: int = 0) -> int:
  """At most the steps that prefill ``batch`` prompts of ``context`` tokens: one per
  ``max_num_batched_tokens`` prompt tokens, or one per ``long_prefill_token_threshold`` tokens of a
  prompt where that is more (each step either spends the budget or gives every prompt its share)."""
  steps = cdiv(batch * context, max_num_batched_tokens)
  return max(steps, cdiv(context, long_prefill_token_threshold)) if long_prefill_token_threshold > 0 else steps


def decode_new_tokens(
  batch: int,
  context: int,
  max_num_batched_tokens: int,
  steps: int,
  profile_steps: int = 0,
  num_spec: int = 0,
  long_prefill_token_threshold: int = 0,
) -> int:
  """``max_tokens`` that keeps every request decoding through the timed and profiled steps:
  requests prefilled early decode (up to ``1 + num_spec`` tokens a step) while later ones prefill,
  for up to ``prefill_steps`` steps and one more."""
  prefill = prefill_steps(batch, context, max_num_batched_tokens, long_prefill_token_threshold) + 1
  return (prefill + steps + profile_steps) * (1 + num_spec) + 1


def benchmark_decode(
  engine: LLMEngine,
  prompts: Sequence[Sequence[int]],
  *,
  steps: int,
  new_tokens: int,
  profile_dir: str | None = None,
  profile_steps: int = 8,
  hlo_dir: str | None = None,
) -> dict:
  """Serves ``prompts`` to completion of prefill, then times ``steps`` steps in which every request
  decodes; optionally traces ``profile_steps`` more with ``jax.profiler`` into ``profile_dir``
  (with ``hlo_dir``, ``jaxkv.profiling.enable_hlo_dump``'s, each model part's kernels as well).
  With prefix caching on, the same prompts' prefill is then timed again, warm from the device's
  prefix cache (``prefill_warm_s``, ``num_cached_tokens``).

  Returns the measured numbers (prefill seconds, per-step latency percentiles, decode tokens/s,
  acceptance rate, compile counts, and ``profile`` when traced) and a digest of the tokens the
  requests had by the end of the timed steps (``output_tokens_sha256``).
  """
  t0 = time.perf_counter()
  engine.warmup()  # every token bucket, as vLLM captures its graphs
  warmup_s = time.perf_counter() - t0
  compiled_warm = engine.num_compilations
  reqs = [engine.add_request(f"bench-{i}", p, SamplingParams(max_tokens=new_tokens)) for i, p in enumerate(prompts)]
  t0 = time.perf_counter()
  while not all(r.output_token_ids for r in reqs):
    engine.step()
  prefill_s = time.perf_counter() - t0
  compiled_prefill = engine.num_compilations
  lat, tokens = [], 0
  drafted, accepted = engine.num_draft_tokens, engine.num_accepted_tokens
  for _ in range(steps):
    t = time.perf_counter()
    outs = engine.step()
    lat.append(time.perf_counter() - t)
    tokens += sum(len(o.new_token_ids) for o in outs)
  ended = {r.request_id: r.finish_reason for r in reqs if r.finish_reason is not None}
  if ended:  # the steps were not all of len(prompts) requests
    raise RuntimeError(
      f"{len(ended)} of {len(prompts)} requests ended before the timed steps did ({ended}; errors: "
      f"{[r.error for r in reqs if r.finish_reason == 'error']}); give them max_tokens >= "
      f"decode_new_tokens(...) = room for the steps they decode while the others prefill."
    )
  drafted, accepted = engine.num_draft_tokens - drafted, engine.num_accepted_tokens - accepted
  # What the requests said by the end of the timed steps: equal digests, equal tokens (an A/B of
  # two settings that must not change them, on the device that timed them).
  digest = hashlib.sha256(json.dumps([r.output_token_ids for r in reqs]).encode()).hexdigest()[:16]
  profile = None
  if profile_dir is not None:
    import jax

    from jaxkv.profiling import summarize_trace

    jax.profiler.start_trace(profile_dir, create_perfetto_trace=True)
    for _ in range(profile_steps):
      engine.step()
    jax.profiler.stop_trace()
    profile = summarize_trace(profile_dir, profile_steps, hlo_dir=hlo_dir)
  finished_early = sum(r.finish_reason is not None for r in reqs)
  for r in reqs:
    engine.abort(r.request_id)
  warm = {}
  if engine.kv.enable_caching:
    while engine.has_unfinished():
      engine.step()
    again = [engine.add_request(f"bench-warm-{i}", p, SamplingParams(max_tokens=1)) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    while not all(r.output_token_ids for r in again):
      engine.step()
    warm = {"prefill_warm_s": time.perf_counter() - t0, "num_cached_tokens": sum(r.num_cached_tokens for r in again)}
  if profile_dir is not None:  # the same prompts' prefill again, traced, on the warm engine
    while engine.has_unfinished():
      engine.step()
    again = [engine.add_request(f"bench-prefill-{i}", p, SamplingParams(max_tokens=1)) for i, p in enumerate(prompts)]
    jax.profiler.start_trace(f"{profile_dir}/prefill", create_perfetto_trace=True)
    num_prefill_steps = 0
    while not all(r.output_token_ids for r in again):
      engine.step()
      num_prefill_steps += 1
    jax.profiler.stop_trace()
    profile["prefill"] = summarize_trace(f"{profile_dir}/prefill", num_prefill_steps, hlo_dir=hlo_dir)
    while engine.has_unfinished():
      engine.step()
  lat_ms = np.asarray(lat) * 1e3
  return {
    "batch": len(prompts),
    "context": len(prompts[0]),
    "decode_steps": len(lat),
    "decode_tokens": tokens,
    "output_tokens_sha256": digest,
    "finished_before_the_end": finished_early,
    "prefill_s": prefill_s,
    **warm,
    "decode_tokens_per_s": tokens / max(sum(lat), 1e-9),
    "num_spec": engine.config.num_speculative_tokens,
    "long_prefill_token_threshold": engine.config.long_prefill_token_threshold,
    "acceptance_rate": accepted / drafted if drafted else None,
    "step_ms_p50": float(np.percentile(lat_ms, 50)),
    "step_ms_p90": float(np.percentile(lat_ms, 90)),
    "step_ms_p99": float(np.percentile(lat_ms, 99)),
    "warmup_s": warmup_s,
    "slowest_step": int(np.argmax(lat_ms)),
    "compilations_after_warmup": compiled_warm,
    "compilations_after_prefill": compiled_prefill,
    "compilations_at_end": engine.num_compilations,
    **({"profile": profile} if profile else {}),
  }
