"""The Pallas top-k against jax.lax.top_k (values and ids), and its order on the float32 bits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.engine import sampler
from pallas_kernels.top_k import MAX_K, top_k, top_k_reference


def _rows(rng, shape, kind):
  x = rng.standard_normal(shape).astype(np.float32) * 3
  if kind == "ties":  # few distinct values: the order of equal ones decides the ids
    x = np.round(x) + 0.0  # +0.0: no -0.0, whose place beside +0.0 the order test checks
  elif kind == "log_softmax":  # the sampler's input, with masked (-inf) tokens
    x[rng.random(shape) < 0.3] = -np.inf
    x = np.asarray(jax.nn.log_softmax(jnp.asarray(x), axis=-1))
  elif kind == "few_finite":  # fewer finite entries than k: -inf ones fill the rest in index order
    x[..., 3:] = -np.inf
  return x


@pytest.mark.parametrize(
  "shape,k,block,last_block",
  [
    ((3, 5000), 20, 256, 1024),  # two launches, a partial last block
    ((2, 3, 1500), 5, 64, 128),  # leading dims; four launches of ever fewer candidates
    ((5, 777), 33, 128, 128),  # k not a power of two above 32; odd N
    ((4, 16), 16, 32, 32),  # k = N: every entry
    ((1, 40), 1, 8, 8),
  ],
)
@pytest.mark.parametrize("kind", ["random", "ties", "log_softmax", "few_finite"])
def test_top_k_matches_lax_top_k(shape, k, block, last_block, kind):
  rng = np.random.default_rng(hash((shape, k, kind)) % 2**32)
  x = jnp.asarray(_rows(rng, shape, kind))
  values, ids = top_k(x, k, block=block, last_block=last_block, implementation="pallas")
  ref_values, ref_ids = top_k_reference(x, k)
  assert values.shape == ids.shape == (*shape[:-1], k) and ids.dtype == jnp.int32
  np.testing.assert_array_equal(ids, ref_ids)
  np.testing.assert_array_equal(values, ref_values)


def test_a_single_row_and_no_rows():
  values, ids = top_k(jnp.asarray([3.0, -1.0, 7.0, 3.0, 0.5]), 3, implementation="pallas")
  np.testing.assert_array_equal(ids, [2, 0, 3])
  np.testing.assert_array_equal(values, [7.0, 3.0, 3.0])
  values, ids = top_k(jnp.ones((0, 100)), 5, implementation="pallas")
  assert values.shape == ids.shape == (0, 5)


def test_bfloat16_rows_keep_their_dtype_and_order():
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((3, 3000)), jnp.bfloat16)  # bf16: many exact ties
  values, ids = top_k(x, 20, block=512, implementation="pallas")
  ref_values, ref_ids = jax.lax.top_k(x, 20)
  assert values.dtype == jnp.bfloat16
  np.testing.assert_array_equal(ids, ref_ids)
  np.testing.assert_array_equal(values, ref_values)


def test_order_is_float32_total_order_on_the_bits():
  # -0.0 below +0.0, NaN above +inf: the documented order, checked against a NumPy sort of
  # (value bits as the sort key, index) rather than against XLA.
  rng = np.random.default_rng(2)
  x = rng.standard_normal((2, 600)).astype(np.float32)
  x[:, rng.choice(600, 40, replace=False)] = 0.0
  x[:, rng.choice(600, 40, replace=False)] = -0.0
  x[0, [5, 77]] = np.nan
  x[1, [9, 300]] = np.inf
  values, ids = top_k(jnp.asarray(x), 100, block=256, implementation="pallas")
  bits = x.view(np.int32)
  keys = bits ^ ((bits >> 31) & 0x7FFFFFFF)
  for r in range(2):
    want = np.lexsort((np.arange(600), -keys[r].astype(np.int64)))[:100]
    np.testing.assert_array_equal(ids[r], want)
    np.testing.assert_array_equal(np.asarray(values[r]).view(np.int32), bits[r, want])  # the exact bits


def test_the_lowest_key_ties_with_padding_and_taken_entries_yet_each_id_comes_once():
  # The negative NaN of all-ones bits has the lowest key, which padding and taken entries get too.
  x = np.full((1, 200), np.nan, np.float32)
  x.view(np.int32)[:] = -1
  x[0, [3, 150, 199]] = [1.0, 2.0, -5.0]
  values, ids = top_k(jnp.asarray(x), 20, block=64, last_block=64, implementation="pallas")
  want = [150, 3, 199] + [i for i in range(200) if i not in (3, 150, 199)][:17]
  np.testing.assert_array_equal(ids[0], want)
  assert (np.asarray(values[0, 3:]).view(np.int32) == -1).all()


def test_the_sampler_takes_the_runner_s_top_k_with_the_same_answer():
  rng = np.random.default_rng(3)
  logits = jnp.asarray(np.round(rng.standard_normal((4, 2, 3000)) * 4).astype(np.float32))  # ties
  tokens = jnp.asarray(rng.integers(0, 3000, (4, 2)), jnp.int32)
  called = []

  def kernel(x, k):
    called.append((x.shape, k))
    return top_k(x, k, implementation="pallas")

  by_xla = sampler.logprob_stats(logits, tokens)
  by_kernel = sampler.logprob_stats(logits, tokens, kernel)
  assert called == [((4, 2, 3000), 20)]
  for a, b in zip(by_xla, by_kernel):
    np.testing.assert_array_equal(a, b)


def test_the_glm_runner_s_top_k_is_the_kernel_on_any_gpu(monkeypatch):
  from models.glm5_next import paged

  # Here: the reference on the CPU, the kernel on a GPU (the suite runs on both: README.md).
  here = "pallas" if jax.default_backend() in ("gpu", "cuda") else "xla"
  assert paged.kernel_implementation("top_k", "xla") == here
  monkeypatch.setattr(paged, "resolve_implementation", lambda impl: "pallas" if impl == "auto" else impl)
  assert paged.kernel_implementation("top_k", "xla") == "pallas"  # on a GPU, whatever the switch


def test_bad_arguments_name_the_values():
  x = jnp.ones((2, 100), jnp.float32)
  with pytest.raises(ValueError, match=r"k must be in \[1, min\(128, N=100\)\], got 101"):
    top_k(x, 101)
  with pytest.raises(ValueError, match=r"got 0"):
    top_k(x, 0)
  with pytest.raises(ValueError, match=rf"k must be in \[1, min\({MAX_K}, N=300\)\], got {MAX_K + 1}"):
    top_k(jnp.ones((1, 300)), MAX_K + 1)
  with pytest.raises(ValueError, match=r"at least 2 \* next_power_of_2\(k\) = 64 .* got 32"):
    top_k(x, 20, block=32)
  with pytest.raises(ValueError, match=r"power of two .* got 1000"):
    top_k(x, 20, block=1000)
  with pytest.raises(ValueError, match=r"float32 or bfloat16 .* got int32"):
    top_k(jnp.ones((2, 100), jnp.int32), 5)
  with pytest.raises(ValueError, match=r"\[\.\.\., N\] with N >= 1, got shape \[2, 0\]"):
    top_k(jnp.ones((2, 0)), 1)
