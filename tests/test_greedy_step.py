"""The greedy variant of the step (``EngineConfig.greedy_step``): a step whose sampling rows are all
greedy and ask for no log-probs skips the sampler's distribution, and gives the same tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import CacheConfig
from jaxkv.engine import EngineConfig, SamplingParams
from jaxkv.engine.sampler import sample
from test_engine_equivalence import CACHE_FIELDS, LLMEngine, cfg, prompts, runner
from test_speculative import ForcedDrafts, long_baseline


def _sampler_inputs(seed, r=6, s=3, v=300):
  rng = np.random.default_rng(seed)
  logits = jnp.asarray(rng.standard_normal((r, s, v)) * 4, jnp.float32)
  argmax = np.asarray(jnp.argmax(logits, -1))
  # Drafts: each row's first drafts are its argmaxes (accepted) up to a random wrong one.
  drafts = argmax[:, : s - 1].copy()
  for row, cut in enumerate(rng.integers(0, s, r)):
    if cut < s - 1:
      drafts[row, cut] = (argmax[row, cut] + 1) % v
  num_drafts = jnp.asarray(rng.integers(0, s, r), jnp.int32)
  zeros_f, zeros_i = jnp.zeros((r,), jnp.float32), jnp.zeros((r,), jnp.int32)
  return logits, zeros_f, jnp.ones((r,), jnp.float32), zeros_i, zeros_i, zeros_i, jnp.asarray(drafts), num_drafts


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_only_sampler_gives_the_full_sampler_tokens(seed):
  args = _sampler_inputs(seed)
  full = jax.jit(sample)(*args)
  fast = jax.jit(lambda *a: sample(*a, greedy_only=True))(*args)
  np.testing.assert_array_equal(fast[0], full[0])  # tokens: the argmaxes
  np.testing.assert_array_equal(fast[1], full[1])  # drafts accepted
  assert 0 < int(jnp.sum(full[1])) < int(jnp.sum(args[-1]))  # some drafts accepted, some rejected
  assert all(not np.any(np.asarray(x)) for x in fast[2:])  # no log-probs computed
  assert [x.shape for x in fast] == [x.shape for x in full] and [x.dtype for x in fast] == [x.dtype for x in full]


def _recording(engine):
  """Records each launched step's variant (``greedy_only``)."""
  seen, launch = [], engine.executor.launch

  def record(packing, buf):
    seen.append(packing.greedy_only)
    return launch(packing, buf)

  engine.executor.launch = record
  return seen


@pytest.mark.parametrize("num_speculative_tokens", [0, 2])
def test_greedy_tokens_do_not_depend_on_the_variant(num_speculative_tokens):
  """The same greedy requests: without log-probs (the greedy variant), with them (the full
  sampler), and beside a request that samples (the full sampler): identical tokens, and with
  drafts identical acceptances."""
  config = cfg(num_speculative_tokens=num_speculative_tokens)
  truth = {tuple(p): t for p, (t, _) in zip(prompts(), long_baseline())}
  # Drafts: the greedy continuation, wrong at some indices, so that every acceptance length occurs.
  drafts = ForcedDrafts(truth, lambda step, i: (step + i) % 3 == 0) if num_speculative_tokens else None
  runs = {}
  for name, mates, lp in (("greedy", [], None), ("logprobs", [], 5), ("mixed", [prompts()[3]], None)):
    engine = LLMEngine(runner(), config, **({"draft_proposer": drafts} if drafts else {}))
    seen = _recording(engine)
    greedy = [
      engine.add_request(f"g{i}", p, SamplingParams(max_tokens=6, logprobs=lp)) for i, p in enumerate(prompts()[:3])
    ]
    for i, p in enumerate(mates):
      engine.add_request(f"hot{i}", p, SamplingParams(max_tokens=9, temperature=1.0, seed=i))
    while engine.has_unfinished():
      engine.step()
    runs[name] = ([r.output_token_ids for r in greedy], engine.num_accepted_tokens if not mates else None, seen)
  assert runs["greedy"][0] == runs["logprobs"][0] == runs["mixed"][0]
  assert all(len(t) == 6 for t in runs["greedy"][0])
  if num_speculative_tokens:
    assert runs["greedy"][1] == runs["logprobs"][1] > 0
  assert all(runs["greedy"][2]) and not any(runs["logprobs"][2]) and not any(runs["mixed"][2])


def test_without_logprobs_nothing_of_them_is_reported():
  engine = LLMEngine(runner(), cfg())
  (r,) = engine.generate([prompts()[0]], SamplingParams(max_tokens=4))
  assert r.output_logprobs == [[]] * 4 and r.output_token_logprobs == []
  (w,) = engine.generate([prompts()[0]], SamplingParams(max_tokens=4, logprobs=2))
  assert w.output_token_ids == r.output_token_ids and len(w.output_token_logprobs) == 4
  assert all(len(s) == 2 and s[0][1] < 0 for s in w.output_logprobs)


def test_warmup_compiles_both_variants_and_nothing_compiles_after():
  engine = LLMEngine(runner(), cfg(buckets=(8, 64), max_num_reqs=4, max_num_batched_tokens=64))
  assert engine.config.greedy_buckets == (8,)
  fresh = engine.num_compilations
  warm = engine.warmup()
  assert warm - fresh <= 3  # 8 and 64, and 8's greedy variant (fewer: equal engines compiled them)
  seen = _recording(engine)
  engine.generate(list(prompts()), SamplingParams(max_tokens=4))
  engine.generate([prompts()[0], prompts()[1]], [SamplingParams(max_tokens=4, temperature=0.7, seed=1)] * 2)
  engine.generate([prompts()[2]], SamplingParams(max_tokens=4, logprobs=3))
  assert engine.num_compilations == warm
  assert True in seen and False in seen


def test_greedy_step_off_runs_one_variant():
  engine = LLMEngine(runner(), cfg(greedy_step=False))
  seen = _recording(engine)
  engine.generate(list(prompts()), SamplingParams(max_tokens=3))
  assert seen and not any(seen) and engine.config.greedy_buckets == ()


@pytest.mark.parametrize(
  "kw, want",
  [
    (dict(max_num_reqs=8, buckets=(8, 16, 32, 2048)), (8,)),
    (dict(max_num_reqs=8, buckets=(8, 16, 32, 2048), num_speculative_tokens=2), (8, 16, 32)),
    (dict(max_num_reqs=24, buckets=(32, 2048)), (32,)),  # 24 decode rows run in the 32 bucket
    (dict(max_num_reqs=64, buckets=(32, 48)), (32, 48)),  # no bucket holds them all: every bucket
    (dict(max_num_reqs=8, buckets=(8, 2048), greedy_step=False), ()),
  ],
)
def test_greedy_buckets_are_the_decode_buckets(kw, want):
  cache = {k: v for k, v in kw.items() if k in CACHE_FIELDS}
  engine_kw = {k: v for k, v in kw.items() if k not in CACHE_FIELDS}
  config = EngineConfig(cache=CacheConfig(**cache), max_num_batched_tokens=engine_kw["buckets"][-1], **engine_kw)
  assert config.greedy_buckets == want
