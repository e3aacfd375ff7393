"""Sampling on device: greedy, temperature, top-p, per-request seeds, speculative verification
(rejection sampling of greedy drafts); top-k log-probabilities."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxkv.engine.request import MAX_LOGPROBS

__all__ = ["sample"]


def sample(
    logits: Float[Array, "R S V"],
    temperature: Float[Array, "R"],
    top_p: Float[Array, "R"],
    seeds: Int[Array, "R"],
    steps: Int[Array, "R"],
    draft_ids: Int[Array, "R S-1"],
    num_drafts: Int[Array, "R"],
) -> tuple[Int[Array, "R S"], Int[Array, "R"], Float[Array, "R S K"], Int[Array, "R S K"]]:
  """Verifies each row's drafts and samples its next tokens.

  Row ``r`` has the target's logits at ``S`` consecutive positions: position ``i`` scores the token
  after draft ``i`` (position 0: after the last committed token). Drafts are verified in order and
  the first rejection ends them (vLLM's rejection sampler with a greedy drafter, whose proposal is a
  point mass):

  * ``temperature == 0``: draft ``i`` is accepted iff it is the argmax (lowest id on ties) at ``i``;
    the token at the first mismatch, or after the last draft, is that argmax. Tokens are therefore
    those of plain greedy decoding, whatever the drafts.
  * otherwise, with ``p_i = softmax(logits_i / temperature)`` restricted to the top-p nucleus:
    the token at ``i`` is drawn from ``p_i`` with the key ``fold_in(key(seed), steps + i)`` (its
    output index), and draft ``i`` is accepted iff it equals that draw. For a point-mass proposal
    this is speculative sampling (Leviathan et al. 2023) exactly: the draft is accepted with
    probability ``p_i(d)``, and a rejection emits a draw from ``p_i`` without ``d``, renormalized.
    Since the draw at an output index does not depend on the drafts, a seeded request's tokens
    never depend on its batch, its drafts or a preemption that drops them.

  Args:
    logits: ``[R, S, V]``.
    temperature, top_p, seeds: per row. steps: output index of the row's first token this step.
    draft_ids: ``[R, S-1]`` drafts (entries past ``num_drafts`` are ignored).
    num_drafts: ``[R]`` drafts to verify, ``0 .. S-1``.

  Returns:
    ``tokens [R, S]`` (entries ``0 .. num_accepted`` are the row's new tokens), ``num_accepted
    [R]``, and the top ``MAX_LOGPROBS`` log-probabilities ``[R, S, K]`` of the raw distribution (K = min(MAX_LOGPROBS, V)) with
    their ids.
  """
  r, s, v = logits.shape
  logits = logits.astype(jnp.float32)
  logprobs = jax.nn.log_softmax(logits, axis=-1)
  top_lp, top_ids = jax.lax.top_k(logprobs, min(MAX_LOGPROBS, v))
  greedy = jnp.argmax(logits, axis=-1)  # [R, S]
  hot = temperature > 0
  idx = jnp.arange(s)
  is_draft = idx[None, :] < num_drafts[:, None]  # [R, S]: position i verifies draft i
  drafts = jnp.concatenate([draft_ids, jnp.zeros((r, 1), draft_ids.dtype)], axis=1).astype(jnp.int32)

  def sampled(_):
    """The hot rows' draws: the nucleus needs a sort of the vocabulary."""
    scaled = logits / jnp.where(hot, temperature, 1.0)[:, None, None]
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # Keep a token if the mass before it is < top_p (the first token is always kept).
    keep_sorted = (jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None, None]
    keep = jnp.put_along_axis(jnp.zeros_like(keep_sorted), order, keep_sorted, axis=-1, inplace=False)
    masked = jnp.where(keep, scaled, -jnp.inf)  # [R, S, V] log-weights of p_i
    keys = jax.vmap(lambda sd, st: jax.random.fold_in(jax.random.key(sd), st))(
        jnp.repeat(seeds, s), (steps[:, None] + idx).reshape(-1))  # [R * S]
    drawn = jax.vmap(jax.random.categorical)(keys, masked.reshape(r * s, v)).reshape(r, s)
    return jnp.where(hot[:, None], drawn, greedy).astype(jnp.int32)

  # A batch without temperature skips the vocabulary sort and the draws (the common serving case).
  tokens = jax.lax.cond(jnp.any(hot), sampled, lambda _: greedy.astype(jnp.int32), None)
  # Drafts are accepted while they equal the tokens; the token after them is the next one.
  num_accepted = jnp.sum(jnp.cumprod((drafts == tokens) & is_draft, axis=1), axis=1).astype(jnp.int32)
  return tokens.astype(jnp.int32), num_accepted, top_lp, top_ids.astype(jnp.int32)
