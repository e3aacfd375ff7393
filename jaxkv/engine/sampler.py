"""Sampling on device: greedy, temperature, top-k, top-p, per-request seeds, speculative verification
(rejection sampling of greedy drafts); top-k log-probabilities."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxkv.engine.request import MAX_LOGPROBS

__all__ = ["sample", "nucleus_floor", "top_k_by_kernel"]


def nucleus_ways(rows: int) -> int:
  """Width of the top-p nucleus search for ``rows`` sampled positions a step, the fastest measured
  (``benchmarks/sampler.py`` on the H200, GLM-5.3-Flash's vocabulary, docs/performance.md): 8 ways
  (10 passes of 7 sums) up to 8 rows, where the search is bound by its dependent launches (124 us
  at 1 row against 131 for 32 ways and 187 for a bisection); 4 ways (15 passes of 3) above, where
  it is bound by the vocabulary reads (273 us at 32 rows, 693 at 128, against 280 and 908 for a
  bisection). Each width is an exact search of the same float32 bits; only its passes differ."""
  return 8 if rows <= 8 else 4


def _check_ways(ways: int) -> int:
  """``log2(ways)``; a ValueError unless ``ways`` splits 30 bits into whole passes."""
  bits = ways.bit_length() - 1
  if ways < 2 or ways != 1 << bits or 30 % bits:
    raise ValueError(f"ways must be 2, 4, 8, 32 or 1024 (30 bits in whole passes), got {ways}.")
  return bits


def nucleus_floor(
  probs: Float[Array, "... V"], top_p: Float[Array, "... 1"], ways: int, top_k: Int[Array, "... 1"] | None = None
) -> Float[Array, "... 1"]:
  """The least probability that top-p (and top-k) sampling keeps: token ``i`` is kept iff
  ``probs[i] >= floor``, i.e. iff the tokens strictly more probable than it hold less than
  ``top_p`` of the mass and (with ``top_k > 0``) number fewer than ``top_k``.

  A ``ways``-way search over the float32 bit patterns of ``[0, 2)`` (monotone for non-negative
  floats), in place of a sort of the vocabulary: ``30 / log2(ways)`` dependent passes of
  ``ways - 1`` masked sums each (one fusion per pass; ``ways=2`` is a bisection). Both limits
  are monotone in the threshold, so one search finds the larger of their floors; the count rides
  in the same pass as the mass, over the same reads.
  """
  bits = _check_ways(ways)
  # top_p = 1 keeps every token exactly (float32 sums of nearly all the mass round either way), so
  # it never binds; nor does a top_k of 0 (off) or of the whole vocabulary.
  p_limit = jnp.where(top_p >= 1.0, jnp.inf, top_p)
  k_limit = None if top_k is None else jnp.where(top_k > 0, top_k, probs.shape[-1] + 1)
  # Invariant: above f(lo + ways * 2**shift) a limit is not reached, and above f(lo) one is (lo = -1:
  # below every probability, 0 included); the candidates are lo + j * 2**shift, j = 1 .. ways - 1.
  lo = jnp.full(top_p.shape, -1, jnp.int32)
  for shift in range(30 - bits, -1, -bits):
    candidates = lo + (jnp.arange(1, ways, dtype=jnp.int32) << shift)  # [..., ways - 1]
    x = jax.lax.bitcast_convert_type(candidates, jnp.float32)[..., None]
    above = probs[..., None, :] > x
    reached = jnp.sum(jnp.where(above, probs[..., None, :], 0.0), axis=-1) >= p_limit  # [..., ways - 1]
    if k_limit is not None:
      reached |= jnp.sum(above, axis=-1, dtype=jnp.int32) >= k_limit
    lo = lo + (jnp.sum(reached, axis=-1, keepdims=True, dtype=jnp.int32) << shift)
  return jax.lax.bitcast_convert_type(lo + 1, jnp.float32)


def sample(
  logits: Float[Array, "R S V"],
  temperature: Float[Array, " R"],
  top_p: Float[Array, " R"],
  top_k: Int[Array, " R"],
  seeds: Int[Array, " R"],
  steps: Int[Array, " R"],
  draft_ids: Int[Array, "R S-1"],
  num_drafts: Int[Array, " R"],
  select_top=None,
  *,
  greedy_only: bool = False,
) -> tuple[Int[Array, "R S"], Int[Array, " R"], Float[Array, "R S K"], Int[Array, "R S K"]]:
  """Verifies each row's drafts and samples its next tokens.

  Row ``r`` has the target's logits at ``S`` consecutive positions: position ``i`` scores the token
  after draft ``i`` (position 0: after the last committed token). Drafts are verified in order and
  the first rejection ends them (vLLM's rejection sampler with a greedy drafter, whose proposal is a
  point mass):

  * ``temperature == 0``: draft ``i`` is accepted iff it is the argmax (lowest id on ties) at ``i``;
    the token at the first mismatch, or after the last draft, is that argmax. Tokens are therefore
    those of plain greedy decoding, whatever the drafts.
  * otherwise, with ``p_i = softmax(logits_i / temperature)`` restricted to the tokens that are in
    both the top-k (fewer than ``top_k`` tokens are more probable; ``top_k <= 0``: off) and the top-p
    nucleus (the tokens whose more probable tokens hold less than ``top_p`` of the mass); equal
    probabilities are kept or dropped together:
    the token at ``i`` is drawn from ``p_i`` with the key ``fold_in(key(seed), steps + i)`` (its
    output index), and draft ``i`` is accepted iff it equals that draw. For a point-mass proposal
    this is speculative sampling (Leviathan et al. 2023) exactly: the draft is accepted with
    probability ``p_i(d)``, and a rejection emits a draw from ``p_i`` without ``d``, renormalized.
    Since the draw at an output index does not depend on the drafts, a seeded request's tokens
    never depend on its batch, its drafts or a preemption that drops them.

  Args:
    logits: ``[R, S, V]``.
    temperature, top_p, top_k, seeds: per row. steps: output index of the row's first token this step.
    draft_ids: ``[R, S-1]`` drafts (entries past ``num_drafts`` are ignored).
    num_drafts: ``[R]`` drafts to verify, ``0 .. S-1``.
    select_top: the top-k of the log-probs (``logprob_stats``).
    greedy_only: every row is greedy and wants no log-probs (static; vLLM's ``all_greedy`` with no
      ``max_num_logprobs``): the tokens are the argmaxes, exactly as above, and neither the
      distribution, its nucleus and draw nor the log-probs are computed: those outputs are zeros.

  Returns:
    ``tokens [R, S]`` (entries ``0 .. num_accepted`` are the row's new tokens), ``num_accepted
    [R]``, the top ``MAX_LOGPROBS`` log-probabilities ``[R, S, K]`` of the raw distribution (K =
    min(MAX_LOGPROBS, V)) with their ids, and each token's own log-probability ``[R, S]`` and rank
    ``[R, S]`` (1: most probable; vLLM returns the sampled token's beside the top-k).
  """
  r, s, v = logits.shape
  logits = logits.astype(jnp.float32)
  greedy = jnp.argmax(logits, axis=-1)  # [R, S]
  idx = jnp.arange(s)
  is_draft = idx[None, :] < num_drafts[:, None]  # [R, S]: position i verifies draft i
  drafts = jnp.concatenate([draft_ids, jnp.zeros((r, 1), draft_ids.dtype)], axis=1).astype(jnp.int32)
  tokens = greedy.astype(jnp.int32) if greedy_only else _draw(logits, greedy, temperature, top_p, top_k, seeds, steps)
  # Drafts are accepted while they equal the tokens; the token after them is the next one.
  num_accepted = jnp.sum(jnp.cumprod((drafts == tokens) & is_draft, axis=1), axis=1).astype(jnp.int32)
  if greedy_only:
    top = min(MAX_LOGPROBS, v)
    no_stats = (
      jnp.zeros((r, s, top), jnp.float32),
      jnp.zeros((r, s, top), jnp.int32),
      jnp.zeros((r, s), jnp.float32),
      jnp.zeros((r, s), jnp.int32),
    )
    return (tokens, num_accepted) + no_stats
  return (tokens, num_accepted) + logprob_stats(logits, tokens, select_top)


def _draw(logits, greedy, temperature, top_p, top_k, seeds, steps) -> Int[Array, "R S"]:
  """``sample``'s tokens: each hot row's draw from its top-k / top-p distribution, each greedy
  row's argmax (``greedy [R, S]``)."""
  r, s, v = logits.shape
  hot = temperature > 0
  # One executable for every batch, greedy or not, and no device-to-host sync inside the step:
  # a ``lax.cond`` on "any row samples" reads its predicate on the host (XLA's GPU conditional),
  # which stopped the host from dispatching a step ahead (the host picks ``greedy_only`` instead).
  # The nucleus is found without a sort.
  scaled = logits / jnp.where(hot, temperature, 1.0)[:, None, None]
  # One materialized copy for the floor search and the mask: XLA's GPU fusions may each recompute
  # the softmax, rounding differently, and a floor found on one copy can then lie above every
  # entry of the other (on the H200, top_k=1 drew token 0 for 13 of 64 rows).
  probs = jax.lax.optimization_barrier(jax.nn.softmax(scaled, axis=-1))
  # Greedy rows get limits that cannot bind: their nucleus is not used.
  row_limits = [
    jnp.broadcast_to(jnp.where(hot, x, off)[:, None, None], (r, s, 1)) for x, off in ((top_p, 1.0), (top_k, 0))
  ]
  floor = nucleus_floor(probs, row_limits[0], nucleus_ways(r * s), row_limits[1])
  masked = jnp.where(probs >= floor, scaled, -jnp.inf)  # log-weights of p_i
  keys = jax.vmap(lambda sd, st: jax.random.fold_in(jax.random.key(sd), st))(
    jnp.repeat(seeds, s), (steps[:, None] + jnp.arange(s)).reshape(-1)
  )  # [R * S]
  drawn = jax.vmap(jax.random.categorical)(keys, masked.reshape(r * s, v)).reshape(r, s)
  return jnp.where(hot[:, None], drawn, greedy).astype(jnp.int32)


def logprob_stats(logits: Float[Array, "... V"], token_ids: Int[Array, "..."], select_top=None):
  """The float32 log-softmax of ``logits``: its top ``MAX_LOGPROBS`` log-probs and their ids
  ``[..., K]`` (K = min(MAX_LOGPROBS, V)), and the log-prob ``[...]`` and rank ``[...]`` (1: most
  probable; ties count for the token) of ``token_ids``. The sampler's outputs, and the prompt
  log-probs' (``jaxkv.engine.step_executor._next_token_logprobs``).

  ``select_top(x, k)``: ``jax.lax.top_k``'s answer by whatever computes it fastest (the step passes
  its runner's ``top_k``, a Pallas kernel on a GPU); default ``top_k_by_kernel``."""
  select_top = select_top or top_k_by_kernel
  logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  top_lp, top_ids = select_top(logprobs, min(MAX_LOGPROBS, logprobs.shape[-1]))
  token_lp = jnp.take_along_axis(logprobs, token_ids[..., None], axis=-1)
  rank = (jnp.sum(logprobs > token_lp, axis=-1) + 1).astype(jnp.int32)
  return top_lp, top_ids.astype(jnp.int32), token_lp[..., 0], rank


# XLA's GPU top-k kernel takes k <= 16 over rows of 1,024 to 1M float32 or bf16 entries, one thread
# block a row; any other top-k lowers to a segmented radix sort of every row. The top 20 of
# GLM-5.3-Flash's vocabulary on the H200 (benchmarks/sampler.py --top-logprobs, docs/performance.md),
# at 1 / 8 / 32 / 128 rows: by the sort 249 / 528 / 1,457 / 1,687 us; by the kernel on whole rows
# 581 / 586 / 744 / 758 (one block walks 155k entries); on 1,024-entry chunks (a block each), then
# on their candidates, 257 / 416 / 944 / 2,658. Chunks up to 8 rows, whole rows above.
_KERNEL_MAX_K = 16
_CHUNK = 1024
_CHUNKED_MAX_ROWS = 8


def top_k_by_kernel(x: Float[Array, "... N"], k: int) -> tuple[Float[Array, "... k"], Int[Array, "... k"]]:
  """``jax.lax.top_k(x, k)`` by XLA's GPU top-k kernel rather than a sort of each row: in passes of
  at most 16, a pass taking the next ones after masking those already taken; on few rows, the top
  ``k`` of each 1,024-entry chunk first, then the top ``k`` of those candidates.

  The same values and ids as ``jax.lax.top_k`` (decreasing, equal values in increasing index: the
  candidates are in chunk order, each chunk's in its own order) for every input but one: a ``-inf``
  entry and one equal to float32's lowest finite value may come in either order after the first
  pass (a mask must lie below every entry it has not taken).
  """
  lead, n = x.shape[:-1], x.shape[-1]
  rows = x.reshape(-1, n)  # the kernel takes [batch, n] only
  if rows.shape[0] > _CHUNKED_MAX_ROWS or n < 2 * _CHUNK or k > _CHUNK:
    ids = _top_k_ids(rows, k)
  else:
    chunks = -(-n // _CHUNK)
    # -inf padding has the largest ids: the first chunk alone holds k real entries above or tied with it.
    padded = jnp.pad(rows, ((0, 0), (0, chunks * _CHUNK - n)), constant_values=-jnp.inf)
    local = _top_k_ids(padded.reshape(-1, _CHUNK), k).reshape(rows.shape[0], chunks, k)
    candidates = (local + (jnp.arange(chunks, dtype=local.dtype) * _CHUNK)[:, None]).reshape(rows.shape[0], -1)
    pick = _top_k_ids(jnp.take_along_axis(padded, candidates, axis=-1), k)
    ids = jnp.take_along_axis(candidates, pick, axis=-1)
  vals = jnp.take_along_axis(rows, ids, axis=-1)
  return vals.reshape(*lead, k), ids.reshape(*lead, k)


def _top_k_ids(rows: Float[Array, "R N"], k: int) -> Int[Array, "R k"]:
  """Ids of ``jax.lax.top_k(rows, k)`` in passes of at most 16 (see ``top_k_by_kernel``)."""
  taken = [jax.lax.top_k(rows, min(_KERNEL_MAX_K, k))[1]]
  rest = jnp.maximum(rows, jnp.finfo(rows.dtype).min)  # untaken -inf entries stay above the mask
  row = jnp.arange(rows.shape[0])[:, None]
  for start in range(_KERNEL_MAX_K, k, _KERNEL_MAX_K):
    rest = rest.at[row, taken[-1]].set(-jnp.inf)
    taken.append(jax.lax.top_k(rest, min(_KERNEL_MAX_K, k - start))[1])
  return jnp.concatenate(taken, axis=-1)
