import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.topk_selection import select_topk_tokens, select_topk_tokens_reference


@pytest.mark.parametrize("seed", range(4))
def test_selection_matches_loop_definition_with_ties(seed):
  rng = np.random.default_rng(seed)
  t, e, kpool, topk = 16, 40, 4, 32
  # Few distinct values: many ties, and ReLU-like exact zeros.
  logits = np.maximum(rng.integers(-2, 3, (t, e)).astype(np.float32), 0)
  seq_lens = rng.integers(1, e * kpool + 1, t).astype(np.int32)
  seq_lens[:3] = [1, kpool * 8, kpool * 8 + 3]  # no pool; exactly k pools; k pools + tail
  got = np.asarray(select_topk_tokens(jnp.asarray(logits), jnp.asarray(seq_lens), kpool=kpool, index_topk=topk))
  want = select_topk_tokens_reference(logits, seq_lens, kpool=kpool, index_topk=topk)
  np.testing.assert_array_equal(got, want)
  assert got.shape == (t, topk + kpool - 1)
  for r in range(t):  # every selected token is causal and unique
    sel = got[r][got[r] >= 0]
    assert (sel < seq_lens[r]).all() and len(set(sel)) == len(sel)


def test_short_rows_select_everything():
  seq_lens = jnp.array([11, 8, 3], jnp.int32)
  logits = jnp.asarray(np.random.default_rng(0).standard_normal((3, 2)).astype(np.float32))
  got = np.asarray(select_topk_tokens(logits, seq_lens, kpool=4, index_topk=8))
  for r, n in enumerate([11, 8, 3]):
    assert sorted(got[r][got[r] >= 0]) == list(range(n))
