"""MTP speculative decoding: greedy tokens identical with and without drafts, rollback of rejected
drafts (latents, pooled keys, tail ring, KDA states), bitwise equivalence across layouts with
speculation, the rejection sampler's acceptance rule and distribution.

With random weights the MTP layer's drafts are almost never accepted, so the rollback would only
ever see "everything rejected". ``ForcedDrafts`` (the engine's ``DraftProposer``) replaces them
with the true greedy continuation, corrupted at chosen draft indices, so every acceptance length
0..k occurs.

Tolerance, stated: with speculation the head runs on ``max_num_reqs x (1 + k)`` rows instead of
``max_num_reqs``, another matmul shape, so log-probabilities may round differently from the
non-speculative run (measured <= 4.8e-7 on the CPU, 1.4e-6 on the H200); tokens are identical. Runs that share ``k`` are bitwise
identical across layouts and schedules.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv import CacheConfig
from jaxkv.engine import SamplingParams
from jaxkv.engine import sampler
from jaxkv.engine.sampler import sample
from jaxkv.host.kv_cache_manager import KVCacheManager
from models.glm5_next import Glm5NextForCausalLM, get_kv_cache_layers
from models.glm5_next.runner import Glm5NextRunner
from test_engine_equivalence import (
  CFG,
  LLMEngine,
  assert_close_runs,
  baseline,
  cfg,
  chunked_baseline,
  long_prompts,
  model,
  prompts,
  run,
  runner,
)

LONG = SamplingParams(max_tokens=12, logprobs=5)


@dataclasses.dataclass
class ForcedDrafts:
  """Drafts the known greedy continuation, except at draft indices where ``corrupt(step, i)``."""

  truth: dict  # request prompt -> greedy output tokens
  corrupt: object = lambda step, i: False

  def propose(self, request, model_drafts, *, step):
    done = len(request.output_token_ids)
    want = self.truth[tuple(request.prompt_token_ids)][done : done + len(model_drafts)]
    return [(t + 1) % CFG.vocab_size if self.corrupt(step, i) else t for i, t in enumerate(want)]


@functools.lru_cache(maxsize=None)
def long_baseline():
  return run(cfg(), sampling=LONG)[0]


def forced_run(k, corrupt, sampling=LONG, config=None):
  truth = {tuple(p): t for p, (t, _) in zip(prompts(), long_baseline())}
  engine = LLMEngine(runner(), config or cfg(num_speculative_tokens=k), draft_proposer=ForcedDrafts(truth, corrupt))
  reqs = engine.generate(prompts(), sampling)
  return [(r.output_token_ids, r.output_logprobs) for r in reqs], engine


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_tokens_identical_with_mtp_drafts(k):
  got, engine = run(cfg(num_speculative_tokens=k))
  assert engine.num_draft_tokens > 0
  assert_close_runs(got, baseline(), atol=2e-6)


def test_without_index_sharing():
  """Draft steps >= 1 then run the MTP indexer themselves (writing pooled keys and ring slots)."""
  no_share = nnx.merge(*nnx.split(model()))  # a second module on the same weights
  no_share.config = dataclasses.replace(CFG, index_share_for_mtp_iteration=False)
  engine = LLMEngine(Glm5NextRunner.from_model(no_share), cfg(num_speculative_tokens=3))
  reqs = engine.generate(prompts(), SamplingParams(max_tokens=5, logprobs=5))
  assert engine.num_draft_tokens > 0
  assert_close_runs([(r.output_token_ids, r.output_logprobs) for r in reqs], baseline(), atol=2e-6)


@pytest.mark.parametrize("pattern", ["all_accepted", "mixed"])
def test_rollback_of_rejected_drafts(pattern):
  """Accepting 0..3 drafts per step, rolled back everywhere else, changes no token."""
  corrupt = {"all_accepted": lambda step, i: False, "mixed": lambda step, i: (step + i) % 3 == 2}[pattern]
  got, engine = forced_run(3, corrupt)
  assert_close_runs(got, long_baseline(), atol=2e-6)
  if pattern == "all_accepted":
    assert engine.num_accepted_tokens == engine.num_draft_tokens > 0
    assert engine.num_steps <= 1 + -(-(LONG.max_tokens - 1) // 4) + 2  # ~4 tokens per step
  else:
    assert 0 < engine.num_accepted_tokens < engine.num_draft_tokens


def test_speculation_is_bitwise_identical_across_layouts_and_schedules():
  want, _ = forced_run(3, lambda step, i: (step + i) % 3 == 2)
  for variant in (
    cfg(num_speculative_tokens=3, block_size=384),
    cfg(num_speculative_tokens=3, layout="dense", kernel_block_size=64),
    cfg(num_speculative_tokens=3, max_num_batched_tokens=7),
  ):
    got, _ = forced_run(3, lambda step, i: (step + i) % 3 == 2, config=variant)
    assert got == want, variant


def test_speculation_with_chunked_prefill():
  """Chunked KDA prefill, prompts cut off the grid (chunks of 13), drafts accepted 0..3 at a time:
  the tokens of the run without drafts (verify steps run recurrently, past the prompts' bound)."""
  truth = {tuple(p): t for p, (t, _) in zip(long_prompts(), chunked_baseline())}
  config = cfg(num_speculative_tokens=3, max_num_batched_tokens=13, linear_prefill="chunked")
  engine = LLMEngine(runner(), config, draft_proposer=ForcedDrafts(truth, lambda step, i: (step + i) % 3 == 2))
  reqs = engine.generate(long_prompts(), SamplingParams(max_tokens=5, logprobs=5))
  assert 0 < engine.num_accepted_tokens < engine.num_draft_tokens
  assert_close_runs([(r.output_token_ids, r.output_logprobs) for r in reqs], chunked_baseline(), atol=2e-6)


def test_stop_token_inside_accepted_drafts():
  truth = [t for t, _ in long_baseline()]
  stop = truth[0][4]
  got, _ = forced_run(3, lambda step, i: False, sampling=SamplingParams(max_tokens=12, stop_token_ids=(stop,)))
  assert got[0][0] == truth[0][: truth[0].index(stop) + 1]
  for (tokens, _), ref in zip(got[1:], truth[1:]):
    assert tokens == (ref[: ref.index(stop) + 1] if stop in ref else ref)


def test_preemption_with_speculation():
  rng = np.random.default_rng(9)
  long_prompts = [list(rng.integers(1, 256, n)) for n in (124, 122, 126)]
  sampling = SamplingParams(max_tokens=12)
  roomy = LLMEngine(runner(), cfg(block_size=128, max_model_len=256)).generate(long_prompts, sampling)
  probe = LLMEngine(runner(), cfg(block_size=128, max_model_len=256, num_speculative_tokens=2))
  state_blocks = probe.plan.blocks_per_request(1) - 1
  tight = cfg(
    block_size=128,
    max_model_len=256,
    num_speculative_tokens=2,
    memory_bytes=probe.plan.bytes_per_block * (1 + 3 * (state_blocks + 1) + 1),
  )
  engine = LLMEngine(runner(), tight)
  got = engine.generate(long_prompts, sampling)
  assert engine.scheduler.num_preemptions > 0
  assert engine.kv.num_free_blocks == engine.plan.num_blocks - 1
  assert [r.output_token_ids for r in got] == [r.output_token_ids for r in roomy]


def test_seeded_sampling_with_speculation_is_batch_independent():
  sampling = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=7)
  engine = LLMEngine(runner(), cfg(num_speculative_tokens=2))
  batched = [r.output_token_ids for r in engine.generate(prompts(), sampling)]
  alone = [engine.generate([p], sampling)[0].output_token_ids for p in prompts()[:2]]
  assert batched[:2] == alone
  assert all(len(t) == 6 and all(0 <= x < CFG.vocab_size for x in t) for t in batched)


def test_steady_speculative_decoding_does_not_compile():
  engine = LLMEngine(runner(), cfg(num_speculative_tokens=3))
  for i, p in enumerate(prompts()):
    engine.add_request(str(i), p, SamplingParams(max_tokens=12))
  engine.step()
  warm = engine.num_compilations
  while engine.has_unfinished():
    engine.step()
  assert engine.num_compilations == warm


def test_state_groups_own_one_slot_per_draft():
  layers = get_kv_cache_layers(CFG, CacheConfig(block_size=256, num_speculative_tokens=3))
  assert sum(l.name.startswith(f"layers.{CFG.num_hidden_layers}.") for l in layers) == 3  # MTP latent/indexer/tail
  kda = next(l.spec for l in layers if l.name.endswith(".kda"))
  assert kda.max_num_blocks_per_req(1000) == 4
  manager = KVCacheManager([kda], num_blocks=9, enable_caching=False)
  assert len(manager.allocate_slots("a", 1)[0]) == 4
  assert len(manager.allocate_slots("a", 500)[0]) == 0  # for life
  assert manager.allocate_slots("b", 1)[0] and manager.allocate_slots("c", 1) is None


def test_speculation_needs_the_mtp_layer():
  no_mtp = dataclasses.replace(CFG, num_nextn_predict_layers=0)
  with pytest.raises(ValueError, match="num_speculative_tokens=2 drafts with the MTP layer"):
    get_kv_cache_layers(no_mtp, CacheConfig(block_size=256, num_speculative_tokens=2))
  m = Glm5NextForCausalLM(no_mtp, rngs=nnx.Rngs(0))  # as a checkpoint without layers.N.* loads
  with pytest.raises(ValueError, match="num_speculative_tokens=1 drafts with the MTP layer"):
    LLMEngine(Glm5NextRunner.from_model(m), cfg(num_speculative_tokens=1))


# -- the rejection sampler ------------------------------------------------------------------------


def _sample(logits, drafts, num_drafts, temperature, top_p=1.0, seeds=None, steps=None, top_k=0):
  r = logits.shape[0]
  seeds = jnp.arange(r, dtype=jnp.int32) if seeds is None else seeds
  steps = jnp.zeros(r, jnp.int32) if steps is None else steps
  return jax.jit(sample)(
    logits,
    jnp.full(r, temperature, jnp.float32),
    jnp.full(r, top_p, jnp.float32),
    jnp.full(r, top_k, jnp.int32),
    seeds,
    steps,
    drafts,
    num_drafts,
  )


def test_greedy_verification_accepts_the_longest_agreeing_prefix():
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(6, 4, 50)), jnp.float32)
  greedy = np.asarray(jnp.argmax(logits, -1))
  drafts = greedy[:, :3].copy()
  drafts[1, 0] += 1  # rejects at 0
  drafts[2, 1] += 1  # rejects at 1
  drafts[3, 2] += 1  # rejects at 2
  num_drafts = jnp.asarray([3, 3, 3, 3, 2, 0], jnp.int32)  # row 4: two drafts; row 5: none
  tokens, accepted, *_ = _sample(logits, jnp.asarray(drafts), num_drafts, 0.0)
  assert list(np.asarray(accepted)) == [3, 0, 1, 2, 2, 0]
  for row, a in enumerate(np.asarray(accepted)):
    assert list(np.asarray(tokens)[row, : a + 1]) == list(greedy[row, : a + 1])


def test_speculative_sampling_keeps_the_target_distribution():
  """One draft per row; the emitted first token must follow p whatever the draft (4,000 draws)."""
  n, v = 4000, 5
  base = jnp.log(jnp.asarray([0.4, 0.3, 0.15, 0.1, 0.05]))
  logits = jnp.broadcast_to(base, (n, 2, v))
  p = np.asarray(jax.nn.softmax(base))
  for draft in (0, 3):  # a likely and an unlikely draft
    tokens, accepted, *_ = _sample(logits, jnp.full((n, 1), draft, jnp.int32), jnp.ones(n, jnp.int32), 1.0)
    first = np.asarray(tokens)[:, 0]
    freq = np.bincount(first, minlength=v) / n
    assert np.all(np.abs(freq - p) < 4 * np.sqrt(p * (1 - p) / n)), (draft, freq, p)
    assert abs(np.asarray(accepted).mean() - p[draft]) < 4 * np.sqrt(p[draft] * (1 - p[draft]) / n)
    # A rejected draft is never emitted in its place.
    assert not np.any((np.asarray(accepted) == 0) & (first == draft))


def test_a_draw_does_not_depend_on_the_drafts():
  """The token at an output index is the same draw whatever was drafted before it: all drafts
  accepted, or rejected at any index, the emitted tokens are the undrafted draws."""
  rng = np.random.default_rng(3)
  n = 64
  logits = jnp.asarray(rng.normal(size=(n, 4, 50)) * 2, jnp.float32)
  seeds = jnp.asarray(rng.integers(0, 2**31 - 1, n), jnp.int32)
  steps = jnp.asarray(rng.integers(0, 100, n), jnp.int32)
  undrafted = np.asarray(
    _sample(logits, jnp.zeros((n, 3), jnp.int32), jnp.zeros(n, jnp.int32), 0.9, 0.95, seeds, steps)[0]
  )
  for reject_at in (3, 0, 1, 2):  # 3: every draft accepted
    drafts = undrafted[:, :3].copy()
    if reject_at < 3:
      drafts[:, reject_at] = (drafts[:, reject_at] + 1) % 50
    tokens, accepted, *_ = _sample(logits, jnp.asarray(drafts), jnp.full(n, 3, jnp.int32), 0.9, 0.95, seeds, steps)
    assert list(np.asarray(accepted)) == [reject_at] * n
    np.testing.assert_array_equal(np.asarray(tokens)[:, : reject_at + 1], undrafted[:, : reject_at + 1])


def test_seeded_sampling_with_accepted_drafts_survives_preemption():
  """Seeded temperature sampling with drafts that are accepted (forced to the request's own
  continuation), under preemption, emits the tokens of the undrafted, unpreempted run."""
  rng = np.random.default_rng(9)
  long_prompts = [[int(t) for t in rng.integers(1, 256, n)] for n in (124, 122, 126)]
  sampling = SamplingParams(max_tokens=12, temperature=0.8, seed=11)
  plain = LLMEngine(runner(), cfg(block_size=128, max_model_len=256)).generate(long_prompts, sampling)
  truth = {tuple(p): r.output_token_ids for p, r in zip(long_prompts, plain)}
  probe = LLMEngine(runner(), cfg(block_size=128, max_model_len=256, num_speculative_tokens=2))
  state_blocks = probe.plan.blocks_per_request(1) - 1
  tight = cfg(
    block_size=128,
    max_model_len=256,
    num_speculative_tokens=2,
    memory_bytes=probe.plan.bytes_per_block * (1 + 3 * (state_blocks + 1) + 1),
  )
  engine = LLMEngine(runner(), tight, draft_proposer=ForcedDrafts(truth))
  got = engine.generate(long_prompts, sampling)
  assert engine.scheduler.num_preemptions > 0 and engine.num_accepted_tokens > 0
  assert [r.output_token_ids for r in got] == [r.output_token_ids for r in plain]


def test_top_p_draws_follow_the_sorted_nucleus():
  """The sort-free nucleus keeps exactly the tokens a vocabulary sort keeps (those whose more
  probable tokens hold less than top_p), and draws follow p renormalized over them (4,000 draws)."""
  rng = np.random.default_rng(12)
  n, v = 4000, 40
  base = jnp.asarray(rng.normal(size=v) * 1.5, jnp.float32)
  p = np.asarray(jax.nn.softmax(base))
  for top_p in (0.3, 0.8, 1.0):
    order = np.argsort(-p, kind="stable")
    nucleus = np.zeros(v, bool)
    nucleus[order] = (np.cumsum(p[order]) - p[order]) < top_p
    tokens, *_ = _sample(
      jnp.broadcast_to(base, (n, 1, v)), jnp.zeros((n, 0), jnp.int32), jnp.zeros(n, jnp.int32), 1.0, top_p
    )
    first = np.asarray(tokens)[:, 0]
    assert nucleus[first].all(), top_p
    q = np.where(nucleus, p, 0) / p[nucleus].sum()
    freq = np.bincount(first, minlength=v) / n
    assert np.all(np.abs(freq - q) < 4 * np.sqrt(q * (1 - q) / n) + 1e-9), (top_p, freq, q)


@pytest.mark.parametrize("ways", [2, 4, 8, 32])
def test_every_nucleus_search_width_keeps_the_sorted_nucleus(ways):
  """Each width of the sort-free search (a bisection up to 6 passes of 31 sums; ``nucleus_ways``
  picks by the step's rows) keeps the tokens a float64 sort
  keeps, ties included; top_p = 1 keeps all."""
  rng = np.random.default_rng(ways)
  logits = rng.normal(size=(6, 1, 3000)) * rng.uniform(0.3, 6.0, size=(6, 1, 1))
  logits[:3] = np.round(logits[:3])  # ties: equal probabilities are kept or dropped together
  probs = jax.nn.softmax(jnp.asarray(logits, jnp.float32), axis=-1)
  top_p = jnp.asarray([0.3, 0.8, 0.95, 0.5, 0.9, 1.0], jnp.float32)[:, None, None]
  floor = np.asarray(sampler.nucleus_floor(probs, top_p, ways))
  p = np.asarray(probs, np.float64)[:, 0]
  for i in range(6):
    above = np.array([p[i][p[i] > x].sum() for x in p[i]])  # mass strictly more probable than each token
    kept = above < float(top_p[i, 0, 0]) if i < 5 else np.ones_like(above, bool)
    np.testing.assert_array_equal(p[i] >= floor[i, 0, 0], kept, err_msg=f"row {i}")
  assert sampler.nucleus_ways(1) == 8 and sampler.nucleus_ways(64) == 4
  with pytest.raises(ValueError, match="ways must be"):
    sampler.nucleus_floor(probs, top_p, 16)


@pytest.mark.parametrize("ways", [4, 8])
def test_top_k_and_top_p_keep_what_a_sort_keeps(ways):
  """top-k alone, top-p alone and both: the tokens fewer than k of which are more probable (ties kept
  or dropped together), and within the nucleus; 0 is off, and k beyond the vocabulary keeps all."""
  rng = np.random.default_rng(100 + ways)
  logits = rng.normal(size=(6, 1, 2000)) * rng.uniform(0.3, 6.0, size=(6, 1, 1))
  logits[::2] = np.round(logits[::2])  # ties
  probs = jax.nn.softmax(jnp.asarray(logits, jnp.float32), axis=-1)
  top_p = jnp.asarray([1.0, 0.9, 1.0, 0.5, 0.99, 1.0], jnp.float32)[:, None, None]
  top_k = jnp.asarray([1, 0, 50, 7, 300, 5000], jnp.int32)[:, None, None]
  floor = np.asarray(sampler.nucleus_floor(probs, top_p, ways, top_k))
  p = np.asarray(probs, np.float64)[:, 0]
  for i in range(6):
    count = np.array([(p[i] > x).sum() for x in p[i]])
    mass = np.array([p[i][p[i] > x].sum() for x in p[i]])
    k, tp = int(top_k[i, 0, 0]), float(top_p[i, 0, 0])
    kept = ((count < k) if k > 0 else True) & ((mass < tp) if tp < 1 else True)
    np.testing.assert_array_equal(p[i] >= floor[i, 0, 0], kept, err_msg=f"row {i}")
    assert kept.sum() >= 1


@pytest.mark.parametrize(
  "shape, k",
  [
    ((3, 2, 2000), 20),
    ((5, 1500), 16),
    ((4, 40), 20),
    ((2, 3000), 45),
    ((3, 5000), 20),
    ((2, 2048), 7),
    ((12, 3000), 20),
  ],
)
def test_top_k_by_kernel_is_lax_top_k(shape, k):
  """Passes of at most 16 (XLA's GPU top-k kernel, not a sort of the row), over 1,024-entry chunks and
  then their candidates (up to 8 rows of 2,048 or more, padded) or over whole rows, give lax.top_k's values and ids: on ties
  (equal values in increasing index, across chunks too) and with -inf entries, inside the top k too."""
  rng = np.random.default_rng(k)
  tied = rng.integers(-30, 5, shape).astype(np.float32) / 4
  tied[..., ::7] = -np.inf
  sparse = np.full(shape, -np.inf, np.float32)  # fewer than k finite entries: -inf ties past them
  sparse[..., 3 : shape[-1] : shape[-1] // 5] = rng.normal(size=sparse[..., 3 : shape[-1] : shape[-1] // 5].shape)
  straddling = rng.normal(size=shape).astype(np.float32)
  straddling[..., 700::700] = 10.0  # equal maxima in several chunks
  for x in (tied, sparse, straddling):
    got = jax.jit(sampler.top_k_by_kernel, static_argnums=1)(x, k)
    want = jax.lax.top_k(x, k)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_top_k_one_samples_the_argmax_and_top_k_draws_only_from_the_top():
  rng = np.random.default_rng(5)
  n, v = 64, 300
  # Distinct, nearly flat logits (no float32 ties at temperature 5, where tokens tied are kept together).
  logits = jnp.asarray(rng.permuted(np.tile(np.arange(v), (n, 1)), axis=1)[:, None] * 2e-3, jnp.float32)
  greedy = np.asarray(jnp.argmax(logits[:, 0], axis=-1))
  none = jnp.zeros((n, 0), jnp.int32)
  tokens, *_ = _sample(logits, none, jnp.zeros(n, jnp.int32), 5.0, top_k=1)
  np.testing.assert_array_equal(np.asarray(tokens)[:, 0], greedy)
  tokens, *_ = _sample(logits, none, jnp.zeros(n, jnp.int32), 5.0, top_k=3)
  top3 = np.argsort(-np.asarray(logits)[:, 0], axis=-1)[:, :3]
  got = np.asarray(tokens)[:, 0]
  assert all(t in row for t, row in zip(got, top3)) and len(set(got - greedy)) > 1  # not always the argmax
