"""The seed's claim, end to end: where blocks live never changes what the model says.

Greedy tokens and top-5 log-probabilities are bitwise identical across manager block sizes
(128, 256, 384 (not a power of two), 1024), a kernel split (256 into 64), dense and packed layouts,
a request alone or batched with others, prefill chunk sizes (chunks ending mid-pool, or capped
per request so that prompts share a step),
preemption with recompute and synchronous or async scheduling, for one token bucket (every step padded to 64 tokens).

Where bitwise identity does not hold, the suite asserts a tolerance and says why:
- steps compiled for different token buckets (8, 16, ...): XLA picks other matmul blockings for
  other shapes, so the same row can round differently (measured: <= 2e-6 in log-probabilities,
  greedy tokens unchanged);
- jit against eager (``jax.disable_jit``): jit fuses the float32 math, eager runs each op alone
  (measured: <= 1.5e-6, greedy tokens unchanged);
- Pallas (interpret) against XLA kernels: their reductions are ordered differently.
"""

import dataclasses
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv import CacheConfig
from jaxkv.engine import EngineConfig, LLMEngine, SamplingParams
from models.glm5_next import Glm5NextForCausalLM, get_config
from models.glm5_next.checkpoint import load_checkpoint
from models.glm5_next.runner import Glm5NextRunner

CFG = get_config("glm-5.3-flash-tiny")
PROMPT_LENS = (13, 27, 5, 19)
NEW = 5
SAMPLING = SamplingParams(max_tokens=NEW, logprobs=5)


@functools.lru_cache(maxsize=None)
def model():
  return Glm5NextForCausalLM(CFG, rngs=nnx.Rngs(0))


@functools.lru_cache(maxsize=None)
def runner(implementation="xla", m=None):
  return Glm5NextRunner.from_model(m or model(), implementation=implementation)


@functools.lru_cache(maxsize=None)
def prompts():
  rng = np.random.default_rng(0)
  return tuple(tuple(int(t) for t in rng.integers(1, 256, n)) for n in PROMPT_LENS)


CACHE_FIELDS = {f.name for f in dataclasses.fields(CacheConfig)}


def cfg(**kw) -> EngineConfig:
  """One token bucket for every step, so every variant runs the same compiled shapes; cache
  options (``block_size=128``) go into the engine's ``CacheConfig``."""
  cache = CacheConfig(**{k: v for k, v in kw.items() if k in CACHE_FIELDS})
  return EngineConfig(cache=cache, **{"buckets": (64,), **{k: v for k, v in kw.items() if k not in CACHE_FIELDS}})


def run(config: EngineConfig, *, alone=False, eager=False, sampling=SAMPLING, implementation="xla", ps=None, m=None):
  ps = ps or prompts()
  groups = [[p] for p in ps] if alone else [list(ps)]
  out = []
  engine = LLMEngine(runner(implementation, m), config)  # alone: one request after another, on recycled blocks
  for group in groups:
    if eager:
      with jax.disable_jit():
        reqs = engine.generate(group, sampling)
    else:
      reqs = engine.generate(group, sampling)
    out += [(r.output_token_ids, r.output_logprobs) for r in reqs]
  return out, engine


@functools.lru_cache(maxsize=None)
def baseline():
  return run(cfg())[0]


VARIANTS = {
  "block128": cfg(block_size=128),
  "block384": cfg(block_size=384),
  "block1024": cfg(block_size=1024, max_model_len=1024),
  "dense": cfg(layout="dense"),
  "dense_split_256_into_64": cfg(layout="dense", kernel_block_size=64),
  "chunks_of_7": cfg(max_num_batched_tokens=7),  # chunks end mid-pool
  "chunks_of_13": cfg(max_num_batched_tokens=13),
  # Every prompt 4 tokens a step, side by side (vLLM's long-prefill threshold; chunks end mid-pool).
  "prompts_side_by_side": cfg(max_num_batched_tokens=16, long_prefill_token_threshold=4),
  "synchronous_steps": cfg(async_scheduling=False),  # the baseline dispatches a step ahead
  # Slots and kernel tables from the step-metadata kernel (interpreted on the CPU; the GPU's default).
  "step_metadata_kernel": cfg(step_metadata_implementation="pallas"),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_bitwise_identical_across_layouts_and_schedules(name):
  got, _ = run(VARIANTS[name])
  assert got == baseline(), name


@functools.lru_cache(maxsize=None)
def bf16_model():
  return Glm5NextForCausalLM(CFG, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)


def test_bf16_model_bitwise_across_blocks_chunks_and_batching():
  """The serving dtype. On a GPU its MoE runs the grouped matmul's Pallas decode kernel here (64
  tokens x 2 experts a step), whose rows must not depend on the other rows of a step: a request
  alone, chunked at 7 or batched puts its tokens in other rows of other expert blocks."""
  base, _ = run(cfg(), m=bf16_model())
  assert run(cfg(block_size=128), m=bf16_model())[0] == base
  assert run(cfg(max_num_batched_tokens=7), m=bf16_model())[0] == base
  assert run(cfg(), alone=True, m=bf16_model())[0] == base


def test_alone_equals_batched():
  got, _ = run(cfg(), alone=True)
  assert got == baseline()


def test_other_token_buckets_within_tolerance():
  got, _ = run(cfg(max_num_batched_tokens=13, buckets=None))  # buckets 8 and 13
  assert_close_runs(got, baseline(), atol=1e-5)


@pytest.mark.parametrize("linear_prefill", ["recurrent", "chunked"])
def test_preemption_and_recompute_change_nothing(linear_prefill):
  """Requests that grow past a 128-token block while the pool is full are preempted and recomputed
  (chunked prefill: the recompute runs the prompt's positions chunkwise and the answer's
  recurrently, as the first pass did)."""
  rng = np.random.default_rng(9)
  grown = [list(rng.integers(1, 256, n)) for n in (124, 122, 126)]
  sampling = SamplingParams(max_tokens=12, logprobs=5)

  def generate(config):
    engine = LLMEngine(runner(), config)
    reqs = engine.generate(grown, sampling)
    return [(r.output_token_ids, r.output_logprobs) for r in reqs], engine

  # Dense for chunked prefill: a packed block holding its larger KDA pages would scale to 256 tokens.
  layout = "packed" if linear_prefill == "recurrent" else "dense"
  base = functools.partial(cfg, block_size=128, max_model_len=256, layout=layout, linear_prefill=linear_prefill)
  probe = LLMEngine(runner(), base())
  state_blocks = probe.plan.blocks_per_request(1) - 1  # KDA groups + tail ring
  # Every request fits with one token block; only one can grow to its second one at a time.
  tight = base(memory_bytes=probe.plan.bytes_per_block * (1 + 3 * (state_blocks + 1) + 1))
  # Without preemption: each request alone on the same engine (a request's outputs do not depend
  # on the batch it shares; the same executables, nothing more to compile).
  alone = LLMEngine(runner(), tight)
  roomy = [(r.output_token_ids, r.output_logprobs) for p in grown for r in alone.generate([p], sampling)]
  assert alone.scheduler.num_preemptions == 0
  # Preempting a request whose next token is in flight, and not; chunked prefill's point here is
  # the recompute's arithmetic, the same either way.
  for async_scheduling in (True, False)[: 2 if linear_prefill == "recurrent" else 1]:
    got, engine = generate(dataclasses.replace(tight, async_scheduling=async_scheduling))
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv.num_free_blocks == engine.plan.num_blocks - 1  # everything went back
    assert got == roomy


def assert_close_runs(got, want, atol):
  for (tokens, lps), (ref_tokens, ref_lps) in zip(got, want):
    assert tokens == ref_tokens
    assert [[i for i, _ in s] for s in lps] == [[i for i, _ in s] for s in ref_lps]
    np.testing.assert_allclose([[v for _, v in s] for s in lps], [[v for _, v in s] for s in ref_lps], atol=atol)


def test_eager_within_tolerance_of_jit():
  sampling = SamplingParams(max_tokens=2, logprobs=5)
  jit_out, _ = run(cfg(), sampling=sampling)
  eager_out, _ = run(cfg(), eager=True, sampling=sampling)
  assert_close_runs(eager_out, jit_out, atol=1e-5)


def test_pallas_kernels_within_tolerance_of_xla():
  got, _ = run(cfg(), implementation="pallas")
  assert_close_runs(got, baseline(), atol=1e-4)


def test_engine_greedy_matches_reference_forward():
  m = model()
  length = max(PROMPT_LENS) + NEW
  # Causal model: one padded length serves every step (the filler after position n never matters).
  forward = jax.jit(lambda ids: m(ids)[0])
  for (tokens, _), p in zip(baseline(), prompts()):
    seq = list(p)
    for _ in range(NEW):
      logits = np.asarray(forward(np.asarray([seq + [1] * (length - len(seq))])))[len(seq) - 1]
      seq.append(int(np.argmax(logits)))
    assert tokens == seq[len(p) :]


def test_seeded_sampling_is_reproducible_and_batch_independent():
  sampling = SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, seed=7)
  batched, _ = run(cfg(), sampling=sampling)
  alone, _ = run(cfg(), alone=True, sampling=sampling)
  assert [t for t, _ in batched] == [t for t, _ in alone]
  other, _ = run(cfg(), sampling=SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, seed=8))
  assert [t for t, _ in other] != [t for t, _ in batched]


def test_steady_decoding_does_not_compile():
  engine = LLMEngine(runner(), cfg(buckets=None))
  for i, p in enumerate(prompts()):
    engine.add_request(str(i), p, SamplingParams(max_tokens=12))
  engine.step()  # prefill
  engine.step()  # first decode step: the 8-token bucket
  warm = engine.num_compilations
  while engine.has_unfinished():
    engine.step()
  assert engine.num_compilations == warm


# Every checkpoint HF wrote, in each config.json form HF accepts (make_hf_fixtures.py's FORMS).
@pytest.mark.parametrize("name", ["tiny", "tiny-shared", "flat-kda", "lac-only", "both"])
def test_engine_matches_hf_greedy(name):
  path = pathlib.Path(__file__).parent / "fixtures" / "hf" / name
  _, hf_model = load_checkpoint(path, dtype=jax.numpy.float32, check_weights=True)
  expected = json.loads((path / "expected.json").read_text())
  engine = LLMEngine(Glm5NextRunner.from_model(hf_model), cfg(max_model_len=256))  # the fixtures' positions
  reqs = engine.generate(expected["prompts"], SamplingParams(max_tokens=len(expected["greedy"][0])))
  for r, steps in zip(reqs, expected["greedy"]):
    assert r.output_token_ids == [s["token"] for s in steps]


# Chunked KDA prefill (``linear_prefill="chunked"``): prompts past the 64-position grid, cut by the
# 64-token bucket and by chunks of 7 off the grid everywhere. (The dense layout's chunk rows: the
# preemption test above, test_prefix_caching.py and the mesh test.)
LONG_PROMPT_LENS = (130, 9)  # two whole chunks and a recurrent tail; one prompt below the grid


@functools.lru_cache(maxsize=None)
def long_prompts():
  rng = np.random.default_rng(1)
  return tuple(tuple(int(t) for t in rng.integers(1, 256, n)) for n in LONG_PROMPT_LENS)


@functools.lru_cache(maxsize=None)
def chunked_baseline(linear_prefill="chunked"):
  return run(cfg(linear_prefill=linear_prefill), ps=long_prompts())[0]


def test_chunked_prefill_bitwise_across_schedules():
  got, _ = run(cfg(linear_prefill="chunked", max_num_batched_tokens=7), ps=long_prompts())
  assert got == chunked_baseline()


def test_chunked_prefill_alone_equals_batched():
  got, engine = run(cfg(linear_prefill="chunked"), alone=True, ps=long_prompts())
  assert got == chunked_baseline()
  # One bucket, two variants of its step (with the chunked path, and without it for decode steps,
  # which then read and write no chunk rows): nothing else compiles, however many steps ran.
  assert engine.num_compilations <= 2


def test_chunked_prefill_within_tolerance_of_recurrent():
  """Another order of the same sums: tokens equal, log-probs close, and not identical (the chunked
  path ran)."""
  assert chunked_baseline() != chunked_baseline("recurrent")
  assert_close_runs(chunked_baseline(), chunked_baseline("recurrent"), atol=1e-4)


def test_chunked_prefill_pallas_within_tolerance_of_xla():
  got, _ = run(cfg(linear_prefill="chunked"), implementation="pallas", ps=long_prompts())
  assert_close_runs(got, chunked_baseline(), atol=1e-4)
