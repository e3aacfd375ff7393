"""Paged MQA logits against the jnp reference and a NumPy float64 oracle, on permuted pages."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import KernelView, round_up
from pallas_kernels._common import quantize_fp8_pow2, value_bytes
from pallas_kernels.kpool import indexer_page_bytes
from pallas_kernels.paged_mqa_logits import paged_mqa_logits, paged_mqa_logits_stages


def make_pages(rng, num_pages, p, d, cache_dtype, lead_bytes=0):
  """Random entries in ``num_pages`` kernel pages of one layer; returns bytes and float entries."""
  x = rng.standard_normal((num_pages, p, d)).astype(np.float32) * rng.uniform(0.1, 4, (num_pages, p, 1))
  if cache_dtype == "fp8":
    q, scale = quantize_fp8_pow2(jnp.asarray(x))
    vals = np.asarray(value_bytes(q)).reshape(num_pages, p * d)
    sc = np.asarray(value_bytes(scale)).reshape(num_pages, 4 * p)
    raw = np.concatenate([vals, sc], axis=1)
    exact = np.asarray(q.astype(jnp.float32)) * np.asarray(scale)
  else:
    v = jnp.asarray(x).astype(cache_dtype)
    raw = np.asarray(value_bytes(v)).reshape(num_pages, -1)
    exact = np.asarray(v.astype(jnp.float32))
  assert raw.shape[1] == indexer_page_bytes(p, d, cache_dtype)
  return raw, exact


@pytest.mark.parametrize(
  "cache_dtype, q_dtype",
  [("fp8", jnp.float8_e4m3fn), ("fp8", jnp.bfloat16), ("bfloat16", jnp.bfloat16), ("float32", jnp.float32)],
)
@pytest.mark.parametrize("p, next_n", [(64, 1), (32, 2), (32, 3)])
def test_paged_mqa_logits(cache_dtype, q_dtype, p, next_n):
  rng = np.random.default_rng(p * 10 + next_n)
  b, h, d, max_pages = 4, 8, 32, 5
  ctx_last = np.array([0, 1, p * max_pages, 2 * p + 7])  # empty, one entry, full row, odd length
  ctx = np.maximum(ctx_last[:, None] - (next_n - 1 - np.arange(next_n))[None, :], 0).astype(np.int32)
  # A layer's pages spread through a larger array: base_row offset, permuted table, garbage past the end.
  total_pages = 3 + b * max_pages + 5  # even: stored as rows of two pages, like an arena
  raw, exact = make_pages(rng, total_pages, p, d, cache_dtype)
  perm = rng.permutation(np.arange(1, total_pages - 3))[: b * max_pages].reshape(b, max_pages).astype(np.int32)
  needed = (ctx.max(1) + p - 1) // p
  table = np.where(np.arange(max_pages)[None] < needed[:, None], perm, rng.integers(-5, 10**6, (b, max_pages)))
  base = 3
  page_bytes = raw.shape[1]
  pages = raw.reshape(-1, 2 * page_bytes)
  q = jnp.asarray(rng.standard_normal((b, next_n, h, d)).astype(np.float32)).astype(q_dtype)
  w = jnp.asarray(rng.standard_normal((b * next_n, h)).astype(np.float32))
  args = (q, jnp.asarray(pages), w, jnp.asarray(ctx), jnp.asarray(table))
  view = KernelView.for_rows(page_bytes, entries_per_page=p, base_row=base, cache_dtype=cache_dtype)
  kw = dict(view=view, pages_per_program=2)
  got = np.asarray(paged_mqa_logits(*args, **kw, implementation="pallas"))
  ref = np.asarray(paged_mqa_logits(*args, **kw, implementation="xla"))
  # How pages are spread over programs changes no arithmetic (batch invariance of the selection).
  for tune in (dict(pages_per_program=None), dict(pages_per_program=3)):
    np.testing.assert_array_equal(np.asarray(paged_mqa_logits(*args, **{**kw, **tune})), got)
  # Float64 oracle.
  q64 = np.asarray(q.astype(jnp.float32), np.float64)
  want = np.full((b * next_n, max_pages * p), -np.inf)
  for i in range(b):
    for n in range(next_n):
      for e in range(ctx[i, n]):
        k = exact[base + table[i, e // p], e % p].astype(np.float64)
        want[i * next_n + n, e] = np.sum(np.maximum(q64[i, n] @ k, 0) * np.asarray(w[i * next_n + n], np.float64))
  for out in (got, ref):
    assert np.array_equal(np.isinf(out), np.isinf(want))
    finite = np.isfinite(want)
    scale = np.abs(want[finite]).max() if finite.any() else 1.0
    tol = 1e-5 if cache_dtype == "float32" else 2e-2  # bf16 operands otherwise
    np.testing.assert_allclose(out[finite], want[finite], rtol=tol, atol=tol * scale)


VIEW = KernelView.for_rows(64 * 20, entries_per_page=64, cache_dtype="fp8")


def test_validation_names_shapes():
  q = jnp.zeros((2, 1, 4, 16), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"weights must be float32\[2, 4\]"):
    paged_mqa_logits(
      q,
      jnp.zeros((4, 64 * 20), jnp.uint8),
      jnp.zeros((2, 3), jnp.float32),
      jnp.zeros((2, 1), jnp.int32),
      jnp.zeros((2, 2), jnp.int32),
      view=VIEW,
    )
  with pytest.raises(ValueError, match="whole 1280-byte view rows"):
    paged_mqa_logits(
      q,
      jnp.zeros((4, 1000), jnp.uint8),
      jnp.zeros((2, 4), jnp.float32),
      jnp.zeros((2, 1), jnp.int32),
      jnp.zeros((2, 2), jnp.int32),
      view=VIEW,
    )


@pytest.mark.parametrize("cache_dtype", ["fp8", "float32"])
def test_unsplit_layer_of_a_packed_row(cache_dtype):
  """A layer whose page is one kernel page, at an offset inside rows that hold other layers too."""
  rng = np.random.default_rng(11)
  b, h, d, p, blocks = 2, 4, 16, 32, 6
  raw, exact = make_pages(rng, blocks, p, d, cache_dtype)
  page = raw.shape[1]
  offset = 512
  width = round_up(offset + page, 512) + 512  # other layers' bytes before and after
  rows = rng.integers(0, 256, (blocks, width), dtype=np.uint8)
  rows[:, offset : offset + page] = raw
  table = np.array([[3], [5]], np.int32)
  ctx = np.array([[p], [p - 7]], np.int32)
  q = jnp.asarray(rng.standard_normal((b, 1, h, d)).astype(np.float32))
  w = jnp.asarray(rng.standard_normal((b, h)).astype(np.float32))
  kw = dict(view=KernelView.for_rows(rows.shape[1], entries_per_page=p, offset_bytes=offset, cache_dtype=cache_dtype))
  got = {
    impl: np.asarray(
      paged_mqa_logits(q, jnp.asarray(rows), w, jnp.asarray(ctx), jnp.asarray(table), **kw, implementation=impl)
    )
    for impl in ("pallas", "xla")
  }
  for i in range(b):
    k = exact[table[i, 0]].astype(np.float64)
    want = (np.maximum(np.asarray(q[i, 0], np.float64) @ k.T, 0) * np.asarray(w[i], np.float64)[:, None]).sum(0)
    for out in got.values():
      np.testing.assert_allclose(out[i, : ctx[i, 0]], want[: ctx[i, 0]], rtol=2e-2, atol=2e-2 * np.abs(want).max())
      assert np.isneginf(out[i, ctx[i, 0] :]).all()


def test_stages_follow_entry_size_and_shared_memory():
  # The released indexer (32 heads x 128, 64-entry pages): three stages fit the H200 in any dtype.
  for dtype in ("fp8", "bfloat16", "float32"):
    assert paged_mqa_logits_stages(32, 1, 128, 64, dtype, 232_448) == 3
  assert paged_mqa_logits_stages(32, 1, 128, 64, "float32", None) == 3
  # A 64 KiB program: float32 keys keep one stage (32 KiB pages + 16 KiB queries + 8 KiB scores).
  assert paged_mqa_logits_stages(32, 1, 128, 64, "float32", 65_536) == 1
  assert paged_mqa_logits_stages(32, 1, 128, 64, "bfloat16", 65_536) == 2
  with pytest.raises(ValueError, match=r"paged_mqa_logits: 1 query rows of 32 heads x 128 float32 .* 49,152"):
    paged_mqa_logits_stages(32, 1, 128, 64, "float32", 49_152)
