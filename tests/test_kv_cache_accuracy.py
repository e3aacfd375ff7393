"""The latent cache formats' accuracy, as benchmarks/kv_cache_accuracy.py measures it (docs/kernels.md)."""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import kv_cache_accuracy  # noqa: E402


def test_fp8_latents_cost_more_than_bf16_and_stay_within_the_measured_range():
  r = kv_cache_accuracy.measure(ROOT / "tests" / "fixtures" / "hf" / "tiny", num_prompts=6, new_tokens=8)
  bf16, fp8 = r["bfloat16"], r["fp8"]
  # e4m3 keeps 3 mantissa bits against bf16's 8: the fp8 cache really is read (larger error), and
  # its error stays in the range measured over 32 prompts x 32 tokens (mean 1e-2, max 0.7).
  assert bf16["logprob_abs_diff_mean"] < 1e-3
  assert 2 * bf16["logprob_abs_diff_mean"] < fp8["logprob_abs_diff_mean"] < 3e-2
  assert fp8["logprob_abs_diff_max"] < 1.0
  assert bf16["token_agreement"] >= 0.9 and fp8["token_agreement"] >= 0.4
