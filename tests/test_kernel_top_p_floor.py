"""The top-p floor kernel against its reference (XLA's passes), rows whose limits cannot bind, and a
row's floor independent of its batch. What the floor keeps against a float64 sort:
tests/test_speculative.py (both paths)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.top_p_floor import top_p_floor, top_p_floor_reference


def _rows(rng, lead, v):
  logits = rng.normal(size=(*lead, v)) * rng.uniform(0.3, 6.0, size=(*lead, 1))
  return jax.nn.softmax(jnp.asarray(logits, jnp.float32), axis=-1)


@pytest.mark.parametrize(
  "lead,v,ways,block",
  [
    ((5, 1), 3000, 8, 256),  # 12 blocks, the last part-full
    ((2, 3), 777, 4, 128),  # a step's [R, S] positions; odd V
    ((3,), 64, 2, 64),  # one block; a bisection
    ((4, 1), 2000, 32, 512),
  ],
)
def test_top_p_floor_matches_reference(lead, v, ways, block):
  rng = np.random.default_rng(hash((lead, v, ways)) % 2**32)
  probs = _rows(rng, lead, v)
  top_p = jnp.asarray(rng.choice([0.3, 0.8, 0.95, 1.0], size=(*lead, 1)), jnp.float32)
  top_k = jnp.asarray(rng.choice([0, 1, 7, 40, v, v + 5], size=(*lead, 1)), jnp.int32)
  got = top_p_floor(probs, top_p, ways, top_k, block=block, implementation="pallas")
  want = top_p_floor_reference(probs, top_p, ways, top_k)
  assert got.shape == (*lead, 1) and got.dtype == jnp.float32
  np.testing.assert_array_equal(got, want)
  # The search's answer is some row's probability or 0: never an unwritten value.
  p = np.asarray(probs)
  assert all(g == 0 or g in p[i] for i, g in np.ndenumerate(np.asarray(got)[..., 0]))


def test_rows_whose_limits_cannot_bind_get_floor_zero():
  """top_p >= 1 with top_k 0 or above the vocabulary: the kernel skips the row; the reference's
  search finds the same 0 (every token kept). A binding row in the same launch is searched."""
  probs = _rows(np.random.default_rng(1), (4, 1), 500)
  top_p = jnp.asarray([1.0, 1.5, 1.0, 0.5], jnp.float32)[:, None, None]
  top_k = jnp.asarray([0, 0, 501, 0], jnp.int32)[:, None, None]
  got = np.asarray(top_p_floor(probs, top_p, 8, top_k, block=128, implementation="pallas"))
  np.testing.assert_array_equal(got[:3], 0.0)
  assert got[3, 0, 0] > 0
  np.testing.assert_array_equal(got, top_p_floor_reference(probs, top_p, 8, top_k))


def test_a_rows_floor_does_not_depend_on_its_batch():
  probs = _rows(np.random.default_rng(2), (6, 1), 2500)
  top_p = jnp.full((6, 1, 1), 0.9, jnp.float32)
  whole = top_p_floor(probs, top_p, 4, block=256, implementation="pallas")
  alone = top_p_floor(probs[4:5], top_p[4:5], 4, block=256, implementation="pallas")
  np.testing.assert_array_equal(whole[4:5], alone)


@pytest.mark.parametrize(
  "args,kw,match",
  [
    ((jnp.ones((2, 1, 8)), jnp.ones((2, 1, 1)), 16), {}, "ways must be 2, 4, 8, 32 or 1024"),
    ((jnp.ones((2, 1, 8)), jnp.ones((2, 1)), 8), {}, r"top_p must be \[\.\.\., 1\] = \[2, 1, 1\]"),
    ((jnp.ones((2, 8), jnp.bfloat16), jnp.ones((2, 1)), 8), {}, "probs must be float32"),
    ((jnp.ones((2, 8)), jnp.ones((2, 1)), 8), {"block": 100}, "block must be a power of two"),
  ],
)
def test_bad_arguments_name_the_values(args, kw, match):
  with pytest.raises(ValueError, match=match):
    top_p_floor(*args, implementation="pallas", **kw)
