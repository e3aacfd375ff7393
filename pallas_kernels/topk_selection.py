"""Sparse selection: the top ``index_topk / kpool`` pools per query, expanded to tokens, plus the tail.

Row ``t`` of ``logits`` scores the pooled entries its query sees; ``seq_lens[t]`` is the number of
tokens it attends to (its position + 1), so its first ``pool_len = seq_len // kpool`` entries are
visible and the rest are ignored whatever they hold. The result has ``index_topk + kpool - 1``
token indices per row: column ``c < index_topk`` is token ``g * kpool + c % kpool`` of the
``c // kpool``-th selected pool ``g``, and the last ``kpool - 1`` columns are the tail tokens
``pool_len * kpool + i`` that exist; everything else is -1.

Rule (exact, deterministic): the ``k = index_topk / kpool`` pools of highest score, equal scores
in increasing pool index (``jax.lax.top_k``'s set, float32's total order on the bits), **listed
in increasing pool index**, -1 after them. A row with at most ``k`` visible pools selects all of
them, which makes sparse attention equal dense attention. The listing order is the sequence
order, as HF's mask-based attention reads the selected tokens, and it needs no sort.

Why a kernel: ``jax.lax.top_k`` with ``k = 512`` is a segmented radix sort of every row, and a
row is as long as the block table (``max_model_len / kpool`` entries: 32,768 for a 128k server),
whatever the request's context. The kernel reads only a row's visible entries and finds the
``k``-th largest sort key by a radix search (``_WAYS``-way, ``32 / _RADIX_BITS`` passes over
the row), then lists the pools above it, and the first of those equal to it, in one pass with a
running count. Rows longer than ``seg`` are cut into segments, each a program that keeps its
own top ``k`` as candidates for the next launch (in increasing pool order, so the order
survives), until one segment holds them all: a few long rows still spread over many programs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float, Int

from pallas_kernels._common import default_interpret, resolve_implementation, without_ref

# The top-k kernel's sort keys, and its padding: the least key, and an id past every entry.
from pallas_kernels.top_k import _ID_NONE, _KEY_MIN, sort_keys

__all__ = ["select_topk_tokens", "select_topk_tokens_reference"]

_RADIX_BITS = 4
_WAYS = 2**_RADIX_BITS


def _select_kernel(x_ref, ids_ref, n_ref, keys_out_ref, ids_out_ref, *, seg: int, block: int, k: int, width: int):
  # x_ref: [T, E] float scores (the first launch; ids_ref None, n_ref [T] visible entries) or
  # [T, W] int32 sort keys of the candidates (later launches; ids_ref [T, W] their pools, n_ref
  # None). keys_out_ref / ids_out_ref: [T, segments * width]; segment s's top k (increasing pool
  # order, then padding) at columns s * width ...
  r, s = pl.program_id(0), pl.program_id(1)
  first = ids_ref is None
  size = x_ref.shape[1]
  limit = jnp.minimum(seg, size - s * seg)  # the last segment may be short
  # Entries of this segment to read: in the first launch a row's visible ones, none past them.
  n = jnp.clip(n_ref[r] - s * seg, 0, limit) if first else limit
  chunks = pl.cdiv(n, block)
  lane = jnp.arange(block, dtype=jnp.int32)

  def load(c):
    at = c * block + lane
    inside = at < n
    cols = s * seg + at
    if first:
      x = pltriton.load(x_ref.at[r, pl.ds(s * seg + c * block, block)], mask=inside, other=0)
      return jnp.where(inside, sort_keys(x), _KEY_MIN), jnp.where(inside, cols, _ID_NONE), inside
    keys = pltriton.load(x_ref.at[r, pl.ds(s * seg + c * block, block)], mask=inside, other=_KEY_MIN)
    ids = pltriton.load(ids_ref.at[r, pl.ds(s * seg + c * block, block)], mask=inside, other=_ID_NONE)
    return keys, ids, ids != _ID_NONE

  def count(pred, rows: int = 1):
    """Per row of ``pred(keys) -> [rows, block]``, the segment's valid entries it holds."""

    def body(c, acc):
      keys, _, valid = load(c)
      return acc + jnp.sum((valid[None, :] & pred(keys)).astype(jnp.int32), axis=1)

    return jax.lax.fori_loop(0, chunks, body, jnp.zeros((rows,), jnp.int32))

  total = n if first else jnp.sum(count(lambda keys: jnp.ones((1, block), jnp.bool_)))
  digits = jnp.arange(_WAYS, dtype=jnp.int32)

  # The k-th largest key, a digit of its bits a pass (bits as unsigned: the sign bit flipped,
  # so unsigned order is the keys' signed order). Counts fall with the digit: the largest digit
  # still counting k or more is the k-th key's. Rows with at most k entries take them all.
  def radix_pass(p, prefix):
    shift = 32 - _RADIX_BITS * (p + 1)
    bounds = (prefix | (digits << shift)) ^ _KEY_MIN
    at_least = count(lambda keys: keys[None, :] >= bounds[:, None], _WAYS)
    digit = jnp.sum((at_least >= k).astype(jnp.int32)) - 1
    return prefix | (digit << shift)

  passes = (total > k).astype(jnp.int32) * (32 // _RADIX_BITS)
  kth = jax.lax.fori_loop(0, passes, radix_pass, jnp.int32(0)) ^ _KEY_MIN
  above = jnp.sum(count(lambda keys: (keys > kth)[None, :]))
  ties = k - above  # equal to the k-th key: the first ones in pool order

  def emit(c, carry):
    taken, tied = carry
    keys, ids, valid = load(c)
    eq = valid & (keys == kth)
    tie_rank = tied + jnp.cumsum(eq.astype(jnp.int32)) - 1
    take = valid & ((keys > kth) | (eq & (tie_rank < ties)))
    at = s * width + taken + jnp.cumsum(take.astype(jnp.int32)) - 1
    # Lanes not stored point past the row, each elsewhere: interpret mode's scatter writes every
    # lane (a masked one its old value), so they must not meet a stored one.
    at = jnp.where(take, at, keys_out_ref.shape[1] + lane)
    pltriton.store(keys_out_ref.at[r, at], keys, mask=take)
    pltriton.store(ids_out_ref.at[r, at], ids, mask=take)
    return taken + jnp.sum(take.astype(jnp.int32)), tied + jnp.sum(eq.astype(jnp.int32))

  taken, _ = jax.lax.fori_loop(0, chunks, emit, (jnp.int32(0), jnp.int32(0)))
  slot = jnp.arange(width, dtype=jnp.int32)
  pad = slot >= taken  # disjoint from the columns written above: no two stores meet
  pltriton.store(keys_out_ref.at[r, pl.ds(s * width, width)], jnp.full((width,), _KEY_MIN, jnp.int32), mask=pad)
  pltriton.store(ids_out_ref.at[r, pl.ds(s * width, width)], jnp.full((width,), _ID_NONE, jnp.int32), mask=pad)


def _check(logits, seq_lens, kpool: int, index_topk: int):
  if kpool < 1 or index_topk < 1 or index_topk % kpool:
    raise ValueError(f"index_topk {index_topk} must be a positive multiple of kpool {kpool}.")
  if logits.ndim != 2 or seq_lens.shape != logits.shape[:1]:
    raise ValueError(
      f"logits must be [T, entries] and seq_lens [T], got {list(logits.shape)} and {list(seq_lens.shape)}."
    )
  if logits.dtype not in (jnp.float32, jnp.bfloat16) or not jnp.issubdtype(seq_lens.dtype, jnp.integer):
    raise ValueError(
      f"logits must be float32 or bfloat16 and seq_lens integer, got {logits.dtype} and {seq_lens.dtype}."
    )


def _tokens(pools: Int[Array, "T k"], seq_lens: Int[Array, " T"], kpool: int) -> Int[Array, "T K"]:
  """Selected pools (-1 padded) -> their tokens, then the tail's: ``[T, k * kpool + kpool - 1]``."""
  t, k = pools.shape
  seq_lens = seq_lens.astype(jnp.int32)
  tokens = pools[:, :, None] * kpool + jnp.arange(kpool, dtype=jnp.int32)
  # Exactly -1: a slot the kernel left unwritten (any other value) shows in the tokens.
  tokens = jnp.where(pools[:, :, None] != -1, tokens, -1).reshape(t, k * kpool)
  tail = (seq_lens // kpool)[:, None] * kpool + jnp.arange(kpool - 1, dtype=jnp.int32)
  tail = jnp.where((tail >= 0) & (tail < seq_lens[:, None]), tail, -1)
  return jnp.concatenate([tokens, tail], axis=1)


def _all_visible(e: int, k: int, pool_len: Int[Array, " T"]) -> Int[Array, "T k"]:
  """Rows of at most ``k`` entries (``E <= k``): every visible pool, in order."""
  pools = jnp.arange(k, dtype=jnp.int32)[None, :]
  return jnp.where(pools < jnp.minimum(pool_len, e)[:, None], pools, -1)


@functools.partial(
  jax.jit, static_argnames=("kpool", "index_topk", "seg", "block", "num_warps", "implementation", "interpret")
)
def select_topk_tokens(
  logits: Float[Array, "T E"],
  seq_lens: Int[Array, " T"],
  *,
  kpool: int,
  index_topk: int,
  seg: int | None = None,
  block: int | None = None,
  num_warps: int = 8,
  implementation: str = "auto",
  interpret: bool | None = None,
) -> Int[Array, "T K"]:
  """Token indices ``int32[T, index_topk + kpool - 1]`` (-1 padded) for sparse attention; the rule
  is the module docstring's.

  Args:
    logits: ``[T, E]`` pool scores, float32 or bfloat16 (compared exactly as float32).
    seq_lens: ``[T]`` tokens each query sees; its first ``seq_len // kpool`` entries are visible.
    seg: entries per program of a launch (a power of two, at least ``2 * next_power_of_2(k)``);
      a row's candidates go on to further launches until one program holds them all. None: 4,096,
      or 1,024 where that leaves fewer than 128 programs (few long rows; H100 sweep,
      docs/kernels.md).
    block: entries a program reads at a time (a power of two, at most ``seg``; None: 1,024 or
      ``seg``).
    num_warps: Triton's warps per program.
    implementation: ``"pallas"``, ``"xla"`` (``select_topk_tokens_reference``) or ``"auto"`` (the
      kernel on a GPU). Both give the same integers; rows of at most ``k`` entries need neither.

  Example:
    >>> select_topk_tokens(scores, positions + 1, kpool=4, index_topk=2048)  # [T, 2051]
  """
  _check(logits, seq_lens, kpool, index_topk)
  t, e = logits.shape
  k = index_topk // kpool
  width = pl.next_power_of_2(k)
  if seg is None:
    seg = 4096 if t * pl.cdiv(e, 4096) >= 128 else max(1024, 2 * width)
  block = min(1024, seg) if block is None else block
  if seg & (seg - 1) or seg < 2 * width or block & (block - 1) or not 16 <= block <= seg:
    raise ValueError(
      f"seg must be a power of two of at least 2 * next_power_of_2(k) = {2 * width} and block a power "
      f"of two in [16, seg], got seg {seg} and block {block}."
    )
  path = resolve_implementation(implementation)
  pool_len = seq_lens.astype(jnp.int32) // kpool
  if e <= k:
    return _tokens(_all_visible(e, k, pool_len), seq_lens, kpool)
  if path == "xla" or t == 0:
    return select_topk_tokens_reference(logits, seq_lens, kpool=kpool, index_topk=index_topk)
  keys, ids, n = logits, None, jnp.clip(pool_len, 0, e)
  kernel = functools.partial(_select_kernel, seg=seg, block=block, k=k, width=width)
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  while True:
    segments = pl.cdiv(keys.shape[1], seg)
    operands = (keys, n) if ids is None else (keys, ids)
    keys, ids = pl.pallas_call(
      without_ref(kernel, 1) if ids is None else without_ref(kernel, 2),
      out_shape=(jax.ShapeDtypeStruct((t, segments * width), jnp.int32),) * 2,
      grid=(t, segments),
      in_specs=[any_spec] * 2,
      out_specs=(any_spec, any_spec),
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=default_interpret(interpret),
      name="select_topk",
    )(*operands)
    if segments == 1:
      break
  pools = jnp.where(ids[:, :k] == _ID_NONE, -1, ids[:, :k])
  return _tokens(pools, seq_lens, kpool)


def select_topk_tokens_reference(
  logits: Float[Array, "T E"], seq_lens: Int[Array, " T"], *, kpool: int, index_topk: int
) -> Int[Array, "T K"]:
  """Plain jnp, same rule: ``jax.lax.top_k`` over the sort keys (invisible entries lowest), the
  chosen pools sorted into increasing order."""
  _check(logits, seq_lens, kpool, index_topk)
  t, e = logits.shape
  k = index_topk // kpool
  pool_len = seq_lens.astype(jnp.int32) // kpool
  if e <= k:
    return _tokens(_all_visible(e, k, pool_len), seq_lens, kpool)
  visible = jnp.arange(e)[None, :] < pool_len[:, None]
  _, pools = jax.lax.top_k(jnp.where(visible, sort_keys(logits), _KEY_MIN), k)
  pools = jnp.sort(pools.astype(jnp.int32), axis=1)  # invisible ones, if any, are the largest
  return _tokens(jnp.where(pools < pool_len[:, None], pools, -1), seq_lens, kpool)
