"""Sampling on device: greedy, temperature, top-p, per-request seeds; top-k log-probabilities."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxkv.engine.request import MAX_LOGPROBS

__all__ = ["sample"]


def sample(
    logits: Float[Array, "R V"],
    temperature: Float[Array, "R"],
    top_p: Float[Array, "R"],
    seeds: Int[Array, "R"],
    steps: Int[Array, "R"],
) -> tuple[Int[Array, "R"], Float[Array, "R K"], Int[Array, "R K"]]:
  """Next token per row and the top ``MAX_LOGPROBS`` log-probabilities of the raw distribution.

  Rows with ``temperature == 0`` take the argmax (lowest id on ties). Others sample from
  ``softmax(logits / temperature)`` restricted to the smallest set of tokens whose mass reaches
  ``top_p``, with the key ``fold_in(key(seed), step)``: a row's draw depends on its own seed and
  output index only, never on the batch it shares.
  """
  logits = logits.astype(jnp.float32)
  logprobs = jax.nn.log_softmax(logits, axis=-1)
  top_lp, top_ids = jax.lax.top_k(logprobs, MAX_LOGPROBS)
  greedy = jnp.argmax(logits, axis=-1)
  scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
  order = jnp.argsort(-scaled, axis=-1)
  sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
  probs = jax.nn.softmax(sorted_logits, axis=-1)
  # Keep a token if the mass before it is < top_p (the first token is always kept).
  keep_sorted = (jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]
  keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
  masked = jnp.where(keep, scaled, -jnp.inf)
  keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, steps)
  drawn = jax.vmap(jax.random.categorical)(keys, masked)
  return jnp.where(temperature > 0, drawn, greedy).astype(jnp.int32), top_lp, top_ids.astype(jnp.int32)
