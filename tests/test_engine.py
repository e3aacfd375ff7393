"""Engine behaviour beyond equivalence: aborts, bad requests, sampling parameters."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.engine import RequestStatus, SamplingParams
from test_engine_equivalence import LLMEngine, cfg, prompts, runner


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_abort_frees_everything_and_others_continue(async_scheduling):
  engine = LLMEngine(runner(), cfg(async_scheduling=async_scheduling))
  initial = engine.kv.num_free_blocks
  a = engine.add_request("a", prompts()[0], SamplingParams(max_new_tokens=6))
  b = engine.add_request("b", prompts()[1], SamplingParams(max_new_tokens=6))
  engine.step()
  engine.abort("a")  # async: a's first token is still in flight, and is dropped with it
  assert a.status == RequestStatus.ABORTED and a.row == -1
  while engine.has_unfinished():
    engine.step()
  assert len(a.output_token_ids) == (0 if async_scheduling else 1)
  assert len(b.output_token_ids) == 6 and b.finish_reason == "length"
  assert engine.kv.num_free_blocks == initial
  assert sorted(engine.scheduler.free_rows) == list(range(engine.config.max_num_reqs))


def test_stop_token_ends_a_request():
  engine = LLMEngine(runner(), cfg())
  first = engine.generate([prompts()[0]], SamplingParams(max_new_tokens=4))[0].output_token_ids
  stopped = engine.generate([prompts()[0]], SamplingParams(max_new_tokens=4, stop_token_ids=(first[1],)))[0]
  assert stopped.output_token_ids == first[:2] and stopped.finish_reason == "stop"


def test_bad_requests_are_refused_with_their_values():
  engine = LLMEngine(runner(), cfg(max_model_len=64))
  with pytest.raises(ValueError, match=r"prompt token ids must be non-empty and in \[0, 256\)"):
    engine.add_request("x", [1, 999])
  with pytest.raises(ValueError, match="60 prompt \\+ 8 new tokens exceed max_model_len 64"):
    engine.add_request("y", list(range(1, 61)), SamplingParams(max_new_tokens=8))
  engine.add_request("z", [1, 2, 3])
  with pytest.raises(ValueError, match="already in use"):
    engine.add_request("z", [1, 2, 3])
  with pytest.raises(ValueError, match="top_p must be in"):
    SamplingParams(top_p=0.0)
  with pytest.raises(ValueError, match="logprobs must be in"):
    SamplingParams(logprobs=21)


def test_temperature_sampling_follows_the_distribution():
  # With top_p tiny, sampling must pick the argmax: only the first token survives the nucleus.
  engine = LLMEngine(runner(), cfg())
  greedy = engine.generate([prompts()[2]], SamplingParams(max_new_tokens=3))[0].output_token_ids
  nucleus = engine.generate([prompts()[2]], SamplingParams(max_new_tokens=3, temperature=1.5, top_p=1e-6,
                                                           seed=3))[0].output_token_ids
  assert nucleus == greedy
  hot = [engine.generate([prompts()[2]], SamplingParams(max_new_tokens=3, temperature=5.0, seed=s))[0].output_token_ids
         for s in range(4)]
  assert len({tuple(h) for h in hot}) > 1
  assert all(0 <= t < 256 for h in hot for t in h)


def test_warmup_compiles_every_bucket_and_writes_nothing():
  engine = LLMEngine(runner(), cfg(max_num_batched_tokens=32, num_speculative_tokens=2, buckets=None))
  rng = np.random.default_rng(0)
  engine.caches = {k: jnp.asarray(rng.integers(0, 256, v.shape, dtype=np.uint8)) for k, v in engine.caches.items()}
  before = {k: np.asarray(v) for k, v in engine.caches.items()}
  assert engine.config.token_buckets == (8, 16, 32)
  fresh = engine.num_compilations
  warm = engine.warmup()  # equal engines share executables: a bucket compiled before is reused
  assert 0 <= warm - fresh <= 3
  for k, v in engine.caches.items():
    assert np.array_equal(np.asarray(v), before[k]), k
  engine.generate(prompts(), SamplingParams(max_new_tokens=6))
  assert engine.num_compilations == warm


def test_async_steps_return_the_step_before_and_schedule_nothing_past_the_end():
  """Step n+1 is dispatched before step n is read back: step() streams step n's tokens, the
  request's next decode token comes from the device, and a request whose last token is in
  flight is not scheduled again."""
  sync = LLMEngine(runner(), cfg(async_scheduling=False))
  want = sync.generate([prompts()[0]], SamplingParams(max_new_tokens=3, logprobs=2))[0]
  engine = LLMEngine(runner(), cfg())
  req = engine.add_request("a", prompts()[0], SamplingParams(max_new_tokens=3, logprobs=2))
  streamed = [engine.step() for _ in range(4)]
  assert [len(o) for o in streamed] == [0, 1, 1, 1]
  assert [o[0].new_token_ids[0] for o in streamed[1:]] == want.output_token_ids
  assert streamed[-1][0].finished and req.finish_reason == "length"
  assert engine.num_steps == 3 and not engine.has_unfinished()  # prefill + 2 decode steps, no fourth
  assert req.output_logprobs == want.output_logprobs
