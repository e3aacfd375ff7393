"""The least probability top-p and top-k sampling keep, found without sorting the vocabulary.

``nucleus_floor`` is the search in plain jnp (XLA's passes: the CPU path, and the reference of
``pallas_kernels.top_p_floor``, which runs it as one GPU program a row). It lives below the engine
and the kernels so that both use this one definition.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

__all__ = ["nucleus_floor", "check_ways"]


def check_ways(ways: int) -> int:
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
  bits = check_ways(ways)
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
