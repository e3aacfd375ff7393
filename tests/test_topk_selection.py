"""The indexer's selection: the kernel (interpreted) and the jnp reference against a loop
definition of the rule, on fresh random rows with many ties, over one and several launches."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.topk_selection import select_topk_tokens, select_topk_tokens_reference


def _definition(logits, seq_lens, *, kpool: int, index_topk: int):
  """The rule as a loop: the k best visible pools (higher score first, then lower index; float32's
  total order), listed in increasing pool index, each as its kpool tokens; then the tail."""
  logits, seq_lens = np.asarray(logits, np.float32), np.asarray(seq_lens)
  bits = logits.view(np.int32)
  keys = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # float32's total order as signed integers
  k = index_topk // kpool
  out = np.full((logits.shape[0], index_topk + kpool - 1), -1, np.int32)
  for r in range(logits.shape[0]):
    pool_len = max(int(seq_lens[r]), 0) // kpool
    best = sorted(range(min(pool_len, logits.shape[1])), key=lambda g: (-int(keys[r, g]), g))[:k]
    for c, g in enumerate(sorted(best)):
      out[r, c * kpool : (c + 1) * kpool] = np.arange(g * kpool, (g + 1) * kpool)
    for i in range(max(int(seq_lens[r]), 0) - pool_len * kpool):
      out[r, index_topk + i] = pool_len * kpool + i
  return out


def _rows(rng, t, e, kind, k):
  if kind == "standouts":  # exactly k entries above the rest: a count of k is where the search stops
    x = np.ones((t, e), np.float32)
    for r in range(t):
      x[r, rng.permutation(e)[:k]] = 2.0 + rng.integers(0, 3, k)
    return x
  if kind == "close":  # neighbours on the float grid: the search's last digit decides
    return (1.0 + rng.integers(0, 64, (t, e)) * np.float32(2**-23)).astype(np.float32)
  if kind == "ties":  # few distinct values, ReLU-like exact zeros: the tie rule decides
    return np.maximum(rng.integers(-2, 4, (t, e)), 0).astype(np.float32)
  x = rng.standard_normal((t, e)).astype(np.float32)
  if kind == "signs":  # both zeros, infinities and NaN: the order is on the bits
    x[:, ::7] = 0.0
    x[:, 1::7] = -0.0
    x[:, 2::11] = -np.inf
    x[:, 3::13] = np.inf
    x[:, 4::17] = np.nan
  return x


def _seq_lens(rng, t, e, kpool, k):
  seq_lens = rng.integers(1, e * kpool + 2 * kpool, t).astype(np.int32)
  # No pool; exactly k pools; k pools and a tail; every entry visible; past the row's end; padding.
  edge = [1, k * kpool, k * kpool + kpool - 1, e * kpool, e * kpool + 3 * kpool, 0]
  seq_lens[: len(edge)] = edge[:t]
  return seq_lens


@pytest.mark.parametrize(
  "t,e,kpool,topk,seg,block",
  [
    (9, 300, 4, 64, 512, 512),  # one launch, one read a program
    (9, 300, 4, 64, 64, 16),  # 5 segments, then 2, then 1: three launches
    (7, 1000, 2, 34, 64, 32),  # k = 17, not a power of two; a partial last segment
    (6, 40, 4, 32, 16, 16),  # k = 8 of 40 entries
  ],
)
@pytest.mark.parametrize("kind", ["random", "ties", "signs", "standouts", "close"])
def test_kernel_matches_definition(t, e, kpool, topk, seg, block, kind):
  rng = np.random.default_rng(hash((t, e, kpool, topk, seg, kind)) % 2**32)
  logits = _rows(rng, t, e, kind, topk // kpool)
  seq_lens = _seq_lens(rng, t, e, kpool, topk // kpool)
  want = _definition(logits, seq_lens, kpool=kpool, index_topk=topk)
  args = (jnp.asarray(logits), jnp.asarray(seq_lens))
  got = select_topk_tokens(*args, kpool=kpool, index_topk=topk, seg=seg, block=block, implementation="pallas")
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(select_topk_tokens_reference(*args, kpool=kpool, index_topk=topk), want)
  for r in range(t):  # every selected token is causal and unique
    sel = np.asarray(got[r])[np.asarray(got[r]) >= 0]
    assert (sel < seq_lens[r]).all() and len(set(sel)) == len(sel)


def test_invisible_entries_are_never_read():
  """What lies past a row's visible pools (stale scores of another request, NaN) changes nothing."""
  rng = np.random.default_rng(3)
  logits = rng.standard_normal((5, 600)).astype(np.float32)
  seq_lens = np.array([4 * 100, 4 * 33 + 1, 4 * 599, 3, 4 * 600], np.int32)
  poisoned = logits.copy()
  for r, n in enumerate(seq_lens // 4):
    poisoned[r, n:] = [np.nan, np.inf, 1e30][r % 3]
  for x in (logits, poisoned):
    got = select_topk_tokens(
      jnp.asarray(x), jnp.asarray(seq_lens), kpool=4, index_topk=128, seg=128, block=64, implementation="pallas"
    )
    np.testing.assert_array_equal(got, _definition(logits, seq_lens, kpool=4, index_topk=128))


def test_rows_of_at_most_k_entries_select_everything_in_order():
  seq_lens = jnp.array([11, 8, 3, 40], jnp.int32)
  logits = jnp.asarray(np.random.default_rng(0).standard_normal((4, 2)).astype(np.float32))
  for implementation in ("pallas", "xla"):
    got = np.asarray(select_topk_tokens(logits, seq_lens, kpool=4, index_topk=8, implementation=implementation))
    for r, n in enumerate([11, 8, 3, 8]):  # the last row sees 10 pools, but the cache holds 2
      assert list(got[r][got[r] >= 0]) == list(range(n)), got[r]


def test_bfloat16_scores_and_no_rows():
  rng = np.random.default_rng(1)
  logits = jnp.asarray(rng.standard_normal((4, 256)), jnp.bfloat16)  # many exact ties
  seq_lens = jnp.array([1024, 700, 129, 1000], jnp.int32)
  got = select_topk_tokens(logits, seq_lens, kpool=4, index_topk=128, seg=128, block=32, implementation="pallas")
  want = _definition(np.asarray(logits.astype(jnp.float32)), seq_lens, kpool=4, index_topk=128)
  np.testing.assert_array_equal(got, want)
  empty = select_topk_tokens(jnp.zeros((0, 256)), jnp.zeros((0,), jnp.int32), kpool=4, index_topk=128)
  assert empty.shape == (0, 131)


@pytest.mark.parametrize(
  "kwargs,match",
  [
    (dict(kpool=3, index_topk=64), "index_topk 64 must be a positive multiple of kpool 3"),
    (
      dict(kpool=4, index_topk=64, seg=24),
      r"seg must be a power of two of at least 2 \* next_power_of_2\(k\) = 32.*got seg 24",
    ),
    (dict(kpool=4, index_topk=64, seg=64, block=128), r"block a power of two in \[16, seg\].*block 128"),
    (dict(kpool=4, index_topk=64, implementation="triton"), "implementation must be one of"),
  ],
)
def test_bad_arguments_name_their_values(kwargs, match):
  with pytest.raises(ValueError, match=match):
    select_topk_tokens(jnp.ones((2, 100)), jnp.array([8, 9]), **kwargs)


def test_bad_shapes_name_them():
  with pytest.raises(ValueError, match=r"got \[2, 100\] and \[3\]"):
    select_topk_tokens(jnp.ones((2, 100)), jnp.array([8, 9, 10]), kpool=4, index_topk=64)
  with pytest.raises(ValueError, match="float32 or bfloat16 and seq_lens integer, got int32"):
    select_topk_tokens(jnp.ones((2, 100), jnp.int32), jnp.array([8, 9]), kpool=4, index_topk=64)
