"""Sparse selection: top ``index_topk / kpool`` pools per query, expanded to tokens, plus the tail.

Row ``t`` of ``logits`` scores the pooled entries its query sees (``-inf`` elsewhere);
``seq_lens[t]`` is the number of tokens it attends to (its position + 1). The result has
``index_topk + kpool - 1`` token indices per row: column ``c < index_topk`` is token
``g * kpool + c % kpool`` of the ``c // kpool``-th selected pool ``g``, and the last ``kpool - 1``
columns are the tail tokens ``pool_len * kpool + i`` (``pool_len = seq_len // kpool``) that exist;
everything else is -1.

Tie rule (documented, deterministic): pools are taken in decreasing score, equal scores in
increasing pool index (``jax.lax.top_k``'s order). When a row has at most ``index_topk / kpool``
complete pools, all of them are selected, which makes sparse attention equal dense attention.

This one stays XLA: it is a top-k over at most ``max_model_len / kpool`` floats per row plus
integer arithmetic, which XLA's top-k already does in one pass.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

__all__ = ["select_topk_tokens", "select_topk_tokens_reference"]


@functools.partial(jax.jit, static_argnames=("kpool", "index_topk"))
def select_topk_tokens(
  logits: Float[Array, "T E"],
  seq_lens: Int[Array, " T"],
  *,
  kpool: int,
  index_topk: int,
) -> Int[Array, "T K"]:
  """Token indices ``int32[T, index_topk + kpool - 1]`` (-1 padded) for sparse attention."""
  if index_topk % kpool:
    raise ValueError(f"index_topk {index_topk} must be a multiple of kpool {kpool}.")
  if logits.ndim != 2 or seq_lens.shape != logits.shape[:1]:
    raise ValueError(
      f"logits must be [T, entries] and seq_lens [T], got {list(logits.shape)} and {list(seq_lens.shape)}."
    )
  t, e = logits.shape
  k = index_topk // kpool
  pool_len = seq_lens.astype(jnp.int32) // kpool
  visible = jnp.arange(e)[None, :] < pool_len[:, None]
  scores = jnp.where(visible, logits.astype(jnp.float32), -jnp.inf)
  if e < k:
    scores = jnp.pad(scores, ((0, 0), (0, k - e)), constant_values=-jnp.inf)
  _, pools = jax.lax.top_k(scores, k)  # [T, k]
  pools = jnp.where(pools < pool_len[:, None], pools, -1).astype(jnp.int32)
  tokens = pools[:, :, None] * kpool + jnp.arange(kpool, dtype=jnp.int32)
  tokens = jnp.where(pools[:, :, None] >= 0, tokens, -1).reshape(t, k * kpool)
  tail = pool_len[:, None] * kpool + jnp.arange(kpool - 1, dtype=jnp.int32)
  tail = jnp.where(tail < seq_lens[:, None], tail, -1)
  return jnp.concatenate([tokens, tail], axis=1)


def select_topk_tokens_reference(logits, seq_lens, *, kpool: int, index_topk: int):
  """NumPy loop definition with the same tie rule (stable sort by descending score)."""
  import numpy as np

  logits, seq_lens = np.asarray(logits, np.float32), np.asarray(seq_lens)
  k = index_topk // kpool
  out = np.full((logits.shape[0], index_topk + kpool - 1), -1, np.int32)
  for r in range(logits.shape[0]):
    pool_len = int(seq_lens[r]) // kpool
    order = sorted(range(pool_len), key=lambda g: (-logits[r, g], g))[:k]
    for c, g in enumerate(order):
      out[r, c * kpool : (c + 1) * kpool] = np.arange(g * kpool, (g + 1) * kpool)
    for i in range(int(seq_lens[r]) - pool_len * kpool):
      out[r, index_topk + i] = pool_len * kpool + i
  return out
