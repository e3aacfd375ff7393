"""The mHC weights kernel against its jnp reference (the model's mHC), and a token's weights
independent of its batch and block."""

import jax.numpy as jnp
import numpy as np
import pytest

from models.glm5_next import get_config
from pallas_kernels.mhc_mix import mhc_mix, mhc_mix_reference


def _inputs(rng, lead, n):
  width = (2 + n) * n
  mixed = rng.standard_normal((*lead, width)).astype(np.float32) * 3
  scale = rng.uniform(0.5, 1.5, 3).astype(np.float32)
  base = (rng.standard_normal(width) * 0.5).astype(np.float32)
  return jnp.asarray(mixed), jnp.asarray(scale), jnp.asarray(base)


@pytest.mark.parametrize(
  "lead,n,iters,block",
  [
    ((37,), 4, 20, 8),  # five programs, the last one part-full; the released n and iters
    ((2, 5), 4, 20, 128),  # leading dims; one program, mostly masked
    ((1,), 4, 1, 16),  # a decode step of one token; no round after the column normalization
    ((9,), 3, 0, 4),  # n not a power of two; iters 0 as 1
    ((6,), 1, 5, 2),  # one stream: every weight of comb is 1 / (1 + eps)-ish
  ],
)
def test_mhc_mix_matches_reference(lead, n, iters, block):
  rng = np.random.default_rng(hash((lead, n, iters)) % 2**32)
  mixed, scale, base = _inputs(rng, lead, n)
  eps = 1e-6
  got = mhc_mix(mixed, scale, base, n=n, eps=eps, iters=iters, block=block, implementation="pallas")
  want = mhc_mix_reference(mixed, scale, base, n=n, eps=eps, iters=iters)
  for g, w, shape in zip(got, want, [(*lead, n), (*lead, n), (*lead, n, n)]):
    assert g.shape == w.shape == shape and g.dtype == jnp.float32
    # Every weight is positive, so an element the kernel left unwritten cannot match.
    assert np.all(np.asarray(w) > 0)
    np.testing.assert_allclose(g, w, rtol=4e-6, atol=0)


def test_sinkhorn_rounds_make_comb_doubly_stochastic():
  """The kernel runs the rounds it is asked for: the columns sum to one after each, the rows come
  closer with every round (a kernel that skipped them would pass the reference test at iters 1)."""
  mixed, scale, base = _inputs(np.random.default_rng(3), (64,), 4)
  row_error = {}
  for iters in (1, 20):
    comb = mhc_mix(mixed, scale, base, n=4, eps=1e-6, iters=iters, block=32, implementation="pallas")[2]
    np.testing.assert_allclose(comb.sum(-2), 1.0, atol=2e-4)  # eps / (a small column's sum)
    row_error[iters] = float(np.max(np.abs(comb.sum(-1) - 1.0)))
  assert row_error[20] < 0.05 and row_error[1] > 10 * row_error[20], row_error


def test_a_tokens_weights_do_not_depend_on_its_batch_or_block():
  """Bitwise: the engine's equivalence across batches and schedules rests on it."""
  mixed, scale, base = _inputs(np.random.default_rng(4), (45,), 4)
  kw = dict(n=4, eps=1e-6, iters=20, implementation="pallas")
  whole = mhc_mix(mixed, scale, base, block=8, **kw)
  part = mhc_mix(mixed[7:30], scale, base, block=32, **kw)
  alone = mhc_mix(mixed[11:12], scale, base, block=1, **kw)
  for w, p, a in zip(whole, part, alone):
    np.testing.assert_array_equal(w[7:30], p)
    np.testing.assert_array_equal(w[11:12], a)


def test_released_config_through_the_model_hyper_connection():
  """The model's mHC with the kernel as its ``mix`` gives the reference's streams (the paged
  step's use), at the released n and iterations."""
  from flax import nnx

  from models.glm5_next.model import HyperConnection

  config = get_config("glm-5.3-flash-tiny")
  hc = HyperConnection(config, dtype=jnp.float32, rngs=nnx.Rngs(0))
  streams = jnp.asarray(
    np.random.default_rng(5).standard_normal((1, 13, config.hc_mult, config.hidden_size)), jnp.float32
  )
  got = hc(streams, mix=lambda *a, **k: mhc_mix(*a, **k, implementation="pallas"))
  want = hc(streams)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_bf16_streams_project_as_float64_would():
  """The model's mHC in bf16 projects the streams in bf16 with float32 products and sums, rho
  applied after the GEMM: its weights agree with the spec's float64 arithmetic (normalize, then
  project) to float32 rounding, where a bf16 sum is off by ~1e-3."""
  from flax import nnx

  from models.glm5_next.model import HyperConnection

  config = get_config("glm-5.3-flash-tiny")
  hc = HyperConnection(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(1))
  shape = (2, 9, config.hc_mult, config.hidden_size)
  streams = jnp.asarray(np.random.default_rng(6).standard_normal(shape) * 4, jnp.bfloat16)
  post, comb, _ = hc(streams)
  x = np.asarray(streams.astype(jnp.float32), np.float64).reshape(2, 9, -1)
  x = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + config.rms_norm_eps)
  mixed = x @ np.asarray(hc.fn[...].astype(jnp.float32), np.float64).T
  _, want_post, want_comb = mhc_mix_reference(
    jnp.asarray(mixed, jnp.float32),
    hc.scale[...],
    hc.base[...],
    n=config.hc_mult,
    eps=config.hc_eps,
    iters=config.hc_sinkhorn_iters,
  )
  np.testing.assert_allclose(post, want_post, rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(comb, want_comb, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize(
  "mixed_shape,scale_shape,base_shape,kw,match",
  [
    ((5, 23), (3,), (24,), {}, r"mixed must be \[\.\.\., \(2 \+ n\) \* n = 24\] for n = 4, got shape \[5, 23\]"),
    ((5, 24), (2,), (24,), {}, r"scale must be \[3\] and base \[24\], got \[2\] and \[24\]"),
    ((5, 24), (3,), (24,), {"block": 48}, r"block must be a power of two .*got 48"),
    ((5, 24), (3,), (24,), {"iters": -1}, r"n must be >= 1 and iters >= 0, got n=4, iters=-1"),
  ],
)
def test_bad_arguments_name_the_values(mixed_shape, scale_shape, base_shape, kw, match):
  args = (jnp.ones(mixed_shape), jnp.ones(scale_shape), jnp.ones(base_shape))
  with pytest.raises(ValueError, match=match):
    mhc_mix(*args, **{"n": 4, "eps": 1e-6, "iters": 20, "implementation": "pallas", **kw})
