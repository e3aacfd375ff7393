"""``SamplingParams.prompt_logprobs``: every prompt token's log-probability given the tokens before
it, with its rank and the top candidates, from steps that run the LM head over all their tokens."""

import numpy as np
import pytest

from jaxkv import LLM, CacheConfig
from jaxkv.tokenizer import Tokenizer, builtin_tokenizer_dir
from jaxkv.engine import EngineConfig, SamplingParams
from test_engine_equivalence import LLMEngine, cfg, prompts, runner

K = 5


def _check_against_sampling(engine, prompt, entries):
  """Entry ``p`` is the distribution the sampler sees after ``prompt[:p + 1]``: its top-K log-probs
  (a one-token request of that prefix) and the prompt token's place in it."""
  assert [e.token_id for e in entries] == list(prompt[1:])
  for p in sorted({*range(0, len(prompt) - 1, 5), len(prompt) - 2}):
    want = engine.generate([prompt[: p + 1]], SamplingParams(max_tokens=1, logprobs=K))[0].output_logprobs[0]
    got = entries[p]
    assert [t for t, _ in got.top] == [t for t, _ in want], p
    np.testing.assert_allclose([v for _, v in got.top], [v for _, v in want], rtol=0, atol=2e-6)
    better = [v for _, v in want if v > got.logprob + 2e-6]
    if len(better) < K:  # the prompt token is within the top K: its rank is its place there
      assert got.rank == len(better) + 1 and got.logprob <= want[0][1] + 2e-6, (p, got, want)
    else:
      assert got.rank > K


def test_prompt_logprobs_are_the_distributions_the_sampler_sees():
  engine = LLMEngine(runner(), cfg())
  prompt = list(prompts()[1])
  r = engine.generate([prompt], SamplingParams(max_tokens=3, logprobs=K, prompt_logprobs=K))[0]
  assert len(r.prompt_logprobs) == len(prompt) - 1
  assert all(len(e.top) == K for e in r.prompt_logprobs)
  _check_against_sampling(engine, prompt, r.prompt_logprobs)
  # Its generated tokens are the ones a request without prompt log-probs gets.
  plain = engine.generate([prompt], SamplingParams(max_tokens=3, logprobs=K))[0]
  assert r.output_token_ids == plain.output_token_ids
  assert r.output_logprobs == plain.output_logprobs


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_chunked_prompt_beside_other_requests(async_scheduling):
  """A prompt over several steps (16-token budget), beside requests that ask for none: the same
  entries as in one step, and the others' outputs unchanged."""
  ps = [list(p) for p in prompts()]
  sampling = [SamplingParams(max_tokens=4, logprobs=K, prompt_logprobs=K if i == 1 else None) for i in range(len(ps))]
  one_step = LLMEngine(runner(), cfg()).generate([ps[1]], sampling[1])[0].prompt_logprobs
  engine = LLMEngine(runner(), cfg(max_num_batched_tokens=16, async_scheduling=async_scheduling))
  got = engine.generate(ps, sampling)
  alone = LLMEngine(runner(), cfg(max_num_batched_tokens=16)).generate(
    ps, [SamplingParams(max_tokens=4, logprobs=K)] * 4
  )
  assert len(got[1].prompt_logprobs) == len(ps[1]) - 1
  for a, b in zip(got[1].prompt_logprobs, one_step):
    assert (a.token_id, a.rank, [t for t, _ in a.top]) == (b.token_id, b.rank, [t for t, _ in b.top])
    np.testing.assert_allclose([a.logprob] + [v for _, v in a.top], [b.logprob] + [v for _, v in b.top], atol=2e-6)
  for i in (0, 2, 3):
    assert got[i].prompt_logprobs == [] and got[i].output_token_ids == alone[i].output_token_ids
  assert [r.output_token_ids for r in got] == [r.output_token_ids for r in alone]


def test_no_prefix_cache_hit_for_a_request_that_wants_them():
  # test_prefix_caching's settings: the same compiled step where pytest's worker ran those tests.
  engine = LLMEngine(
    runner(),
    EngineConfig(
      cache=CacheConfig(block_size=128, max_model_len=512),
      buckets=(128,),
      max_num_batched_tokens=128,
      enable_prefix_caching=True,
      async_scheduling=False,
    ),
  )
  prompt = [int(t) for t in np.random.default_rng(3).integers(1, 256, 276)]
  engine.generate([prompt], SamplingParams(max_tokens=2))
  hit = engine.generate([prompt], SamplingParams(max_tokens=2))[0]
  assert hit.num_cached_tokens == 256  # two whole blocks
  r = engine.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=2))[0]
  assert r.num_cached_tokens == 0 and len(r.prompt_logprobs) == len(prompt) - 1
  assert r.output_token_ids == hit.output_token_ids


def test_warmup_compiles_the_prompt_logprob_steps():
  engine = LLMEngine(runner(), cfg())
  warm = engine.warmup(prompt_logprobs=True)
  engine.generate([list(prompts()[0])], SamplingParams(max_tokens=2, prompt_logprobs=1))
  assert engine.num_compilations == warm


def test_llm_returns_vllm_shaped_prompt_logprobs():
  # The tiny model's tokenizer over the engine the other tests use (its compiled steps too).
  llm = LLM.from_engine(LLMEngine(runner(), cfg()), tokenizer=Tokenizer(builtin_tokenizer_dir("glm-5.3-flash-tiny")))
  out = llm.generate(
    "hello world, hello", SamplingParams(max_tokens=2, prompt_logprobs=3, n=2, seed=1, temperature=1.0)
  )[0]
  ids = out.prompt_token_ids
  assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
  for t, entry in zip(ids[1:], out.prompt_logprobs[1:]):
    first = next(iter(entry))
    assert first == t and entry[t].decoded_token == llm.tokenizer.decode([t], skip_special_tokens=False)
    assert {lp.rank for lp in entry.values()} >= {1, 2, 3}
    assert len(entry) == (3 if entry[t].rank <= 3 else 4)  # the prompt token, then the top 3 (it may be one)
  assert llm.generate("hello", SamplingParams(max_tokens=1))[0].prompt_logprobs is None


def test_sampled_tokens_carry_their_own_logprob_in_or_out_of_the_top_k():
  """Hot sampling with logprobs=1 emits tokens below the top one: each still has its log-prob and
  rank, and they are what the prompt log-probs of the same sequence say (another path: the LM
  head over every token)."""
  engine = LLMEngine(runner(), cfg())
  prompt = list(prompts()[0])
  r = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=3.0, seed=5, logprobs=1))[0]
  own = r.output_token_logprobs
  assert len(own) == 8 and any(rank > 1 for _, rank in own)
  for (lp, rank), top, t in zip(own, r.output_logprobs, r.output_token_ids):
    assert (rank == 1) == (top[0][0] == t) and (rank > 1 or lp == top[0][1])
  again = engine.generate([prompt + r.output_token_ids], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
  entries = again.prompt_logprobs[len(prompt) - 1 :]
  assert [e.token_id for e in entries] == r.output_token_ids
  assert [e.rank for e in entries] == [rank for _, rank in own]
  np.testing.assert_allclose([e.logprob for e in entries], [lp for lp, _ in own], atol=2e-6)
  # jaxkv.LLM: the sampled token first in each position's dict, as vLLM orders it.
  llm = LLM.from_engine(engine)
  seq = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=3.0, seed=5, logprobs=1))[0].outputs[0]
  assert seq.token_ids == r.output_token_ids
  for t, entry, (lp, rank) in zip(seq.token_ids, seq.logprobs, own):
    assert next(iter(entry)) == t and entry[t].rank == rank and entry[t].logprob == lp
