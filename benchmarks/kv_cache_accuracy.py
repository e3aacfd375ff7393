"""Accuracy of the MLA latent cache formats against float32 latents, on the committed HF fixtures.

    python benchmarks/kv_cache_accuracy.py --out docs/results/kv-cache-accuracy.json   # CPU, ~1 min

Each fixture (``tests/fixtures/hf/*``, float32 weights from HF transformers) serves the same
prompts (the fixture's own and ``--prompts`` random ones, 8 to 120 tokens) greedily with the
latent cache in float32 (the reference), bfloat16 and fp8 (e4m3 values and one power-of-two fp32
scale per 128 values, or per entry when the latent is narrower). Everything else is float32 and
identical, so the differences are the latent cache's rounding alone. Reported per format: the
fraction of generated tokens equal to the reference's, how many requests diverge and where first,
and the top-5 log-probability differences over the steps before a request's first divergence
(where both runs condition on the same tokens).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FIXTURES = ROOT / "tests" / "fixtures" / "hf"
FORMATS = ("bfloat16", "fp8")


def serve(hf_model, prompts, kv_cache_dtype: str, new_tokens: int):
  """Greedy tokens and top-5 log-probabilities of every prompt, one engine per cache format."""
  from jaxkv import CacheConfig
  from jaxkv.engine import EngineConfig, LLMEngine, SamplingParams
  from models.glm5_next.runner import Glm5NextRunner

  # One token bucket: a single compiled step per format (the tiny models are cheap at any size).
  cache = CacheConfig(kv_cache_dtype=kv_cache_dtype, max_model_len=hf_model.config.max_position_embeddings)
  config = EngineConfig(cache=cache, max_num_reqs=len(prompts), max_num_batched_tokens=256, buckets=(256,))
  engine = LLMEngine(Glm5NextRunner.from_model(hf_model), config)
  reqs = engine.generate(prompts, SamplingParams(max_tokens=new_tokens, logprobs=5))
  return [(r.output_token_ids, r.output_logprobs) for r in reqs]


def compare(got, want) -> dict:
  """Token agreement and top-5 log-probability differences of ``got`` against ``want``."""
  same = total = diverged = 0
  first = []
  diffs, ids_equal, steps = [], 0, 0
  for (tokens, lps), (ref_tokens, ref_lps) in zip(got, want):
    same += sum(a == b for a, b in zip(tokens, ref_tokens))
    total += len(ref_tokens)
    n = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), None)
    if n is not None:
      diverged += 1
      first.append(n)
    # Step i's distribution conditions on tokens < i: equal up to and including the first divergence.
    for i in range(len(ref_tokens) if n is None else n + 1):
      steps += 1
      ids_equal += [t for t, _ in lps[i]] == [t for t, _ in ref_lps[i]]
      ref = dict(ref_lps[i])
      diffs += [abs(v - ref[t]) for t, v in lps[i] if t in ref]
  d = np.asarray(diffs)
  return {
    "token_agreement": same / total,
    "tokens": total,
    "requests_diverged": diverged,
    "requests": len(want),
    "first_divergence_steps": sorted(first),
    "top5_ids_identical_fraction": ids_equal / steps,
    "steps_compared": steps,
    "logprob_abs_diff_max": float(d.max()),
    "logprob_abs_diff_mean": float(d.mean()),
    "logprob_abs_diff_p99": float(np.quantile(d, 0.99)),
  }


def measure(fixture: pathlib.Path, num_prompts: int, new_tokens: int, seed: int = 0) -> dict:
  import jax.numpy as jnp

  from models.glm5_next.checkpoint import load_checkpoint

  cfg, hf_model = load_checkpoint(fixture, dtype=jnp.float32, check_weights=True)
  expected = json.loads((fixture / "expected.json").read_text())
  rng = np.random.default_rng(seed)
  prompts = [list(p) for p in expected["prompts"]]
  prompts += [[int(t) for t in rng.integers(1, cfg.vocab_size, int(n))] for n in rng.integers(8, 121, num_prompts)]
  ref = serve(hf_model, prompts, "float32", new_tokens)
  return {
    "fixture": fixture.name,
    "kv_lora_rank": cfg.kv_lora_rank,
    "prompts": len(prompts),
    "new_tokens": new_tokens,
    **{fmt: compare(serve(hf_model, prompts, fmt, new_tokens), ref) for fmt in FORMATS},
  }


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", default=None, help="JSON file for the results")
  p.add_argument("--prompts", type=int, default=30, help="random prompts besides the fixture's own")
  p.add_argument("--new-tokens", type=int, default=32)
  args = p.parse_args()
  results = [measure(f, args.prompts, args.new_tokens) for f in sorted(FIXTURES.iterdir()) if f.is_dir()]
  print(
    "| fixture | latent | token agreement | requests diverged (first step) | top-5 ids identical | "
    "max / p99 / mean abs logprob diff |"
  )
  print("|---|---|---|---|---|---|")
  for r in results:
    for fmt in FORMATS:
      m = r[fmt]
      print(
        f"| {r['fixture']} (rank {r['kv_lora_rank']}) | {fmt} | {m['token_agreement']:.2%} of {m['tokens']} | "
        f"{m['requests_diverged']} of {m['requests']} {m['first_divergence_steps']} | "
        f"{m['top5_ids_identical_fraction']:.1%} of {m['steps_compared']} steps | "
        f"{m['logprob_abs_diff_max']:.2e} / {m['logprob_abs_diff_p99']:.2e} / {m['logprob_abs_diff_mean']:.2e} |"
      )
  if args.out:
    pathlib.Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
