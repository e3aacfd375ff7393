"""Slot-mapped cache writes against the reference, on dense and packed planned caches."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import KernelView
from kernel_utils import build_batch, random_tables, slots_for, tiny_plan
from pallas_kernels.cache_write import decode_entries, encode_entries, entry_bytes, write_to_paged_cache


@pytest.mark.parametrize("layout", ["dense", "packed"])
@pytest.mark.parametrize("cache_dtype", ["bfloat16", "fp8", "float32"])
def test_cache_write_matches_reference(layout, cache_dtype):
  rng = np.random.default_rng(hash((layout, cache_dtype)) % 2**32)
  cfg, plan = tiny_plan(layout=layout, kv_cache_dtype=cache_dtype, block_size=512)
  name = f"layers.{cfg.dsa_layers[0]}.self_attn.mla"
  v = plan.view(name)
  tables = random_tables(plan, 3, [700, 30, 1100], rng)
  batch = build_batch([(0, 509, 7), (1, 0, 30), (2, 1023, 3)], num_tokens=48)  # crosses blocks; padded
  slots = slots_for(plan, tables, batch, name)
  assert int((slots >= 0).sum()) == 40
  x = jnp.asarray(rng.standard_normal((48, cfg.kv_lora_rank)).astype(np.float32))
  entries = encode_entries(x, cache_dtype)
  assert entries.shape == (48, entry_bytes(cfg.kv_lora_rank, cache_dtype))
  t = [t for t in plan.tensors if t.name == v.tensor][0]
  poison = jnp.asarray(rng.integers(0, 256, (t.num_rows, t.row_bytes), dtype=np.uint8))
  outs = {
    impl: write_to_paged_cache(jnp.copy(poison), entries, slots, view=v, implementation=impl)
    for impl in ("pallas", "xla")
  }
  np.testing.assert_array_equal(outs["pallas"], outs["xla"])
  # Independent check: every live token's bytes at block*page + offset, nothing else touched.
  expect = np.asarray(poison).copy().reshape(-1)
  e = entries.shape[1]
  for i, s in enumerate(np.asarray(slots)):
    if s >= 0:
      blk, off = divmod(int(s), plan.block_size)
      start = blk * v.block_stride_bytes + v.tensor_offset_bytes + off * e
      expect[start : start + e] = np.asarray(entries[i])
  np.testing.assert_array_equal(np.asarray(outs["pallas"]).reshape(-1), expect)
  back = decode_entries(entries, cache_dtype, cfg.kv_lora_rank)
  tol = 0.07 if cache_dtype == "fp8" else (1e-2 if cache_dtype == "bfloat16" else 0)
  np.testing.assert_allclose(back, x, rtol=tol, atol=tol * 0.1)


def test_cache_write_is_in_place_and_validates():
  cache = jnp.zeros((4, 64), jnp.uint8) + 3
  entries = jnp.ones((2, 8), jnp.uint8)
  view = KernelView.for_rows(64, tokens_per_row=8)
  out = write_to_paged_cache(cache, entries, jnp.array([1, -1], jnp.int32), view=view)
  assert cache.is_deleted()
  np.testing.assert_array_equal(out[0, 8:16], 1)
  assert int((out == 1).sum()) == 8 and int(out[3, -1]) == 3  # -1 did not wrap to the last row
  with pytest.raises(ValueError, match=r"ends at byte 72, past the view row of 64 bytes"):
    write_to_paged_cache(out, entries, jnp.array([1, 2], jnp.int32), view=view.with_offset(8))
  with pytest.raises(ValueError, match=r"slots must be int32\[2\]"):
    write_to_paged_cache(jnp.zeros((4, 64), jnp.uint8), entries, jnp.array([1, 2, 3], jnp.int32), view=view)
  with pytest.raises(ValueError, match="whole 48-byte view rows"):
    write_to_paged_cache(
      jnp.zeros((4, 64), jnp.uint8),
      entries,
      jnp.array([1, 2], jnp.int32),
      view=KernelView.for_rows(48, tokens_per_row=6),
    )
  with pytest.raises(ValueError, match="implementation must be one of"):
    write_to_paged_cache(
      jnp.zeros((4, 64), jnp.uint8), entries, jnp.array([1, 2], jnp.int32), view=view, implementation="cuda"
    )


def test_round_to_e4m3_is_one_rounding_to_nearest_even():
  """Every e4m3 value, the midpoints between neighbours (ties), their float32 neighbours and random
  values round as ml_dtypes' single rounding does, so the fp8 cast after it is exact everywhere."""
  import ml_dtypes

  from pallas_kernels._common import round_to_e4m3

  rng = np.random.default_rng(0)
  grid = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  grid = np.unique(grid[np.isfinite(grid)])
  mids = ((grid[:-1].astype(np.float64) + grid[1:]) / 2).astype(np.float32)
  x = np.concatenate(
    [
      grid,
      mids,
      np.nextafter(mids, np.float32(np.inf)),
      np.nextafter(mids, np.float32(-np.inf)),
      rng.uniform(-448, 448, 20000).astype(np.float32),
      (rng.standard_normal(20000) * 0.01).astype(np.float32),
    ]
  )
  x = np.clip(x, -448, 448)
  got = np.asarray(round_to_e4m3(jnp.asarray(x)))
  want = x.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
  np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
  np.testing.assert_array_equal(np.asarray(jnp.asarray(got).astype(jnp.float8_e4m3fn).astype(jnp.float32)), got)


def test_round_to_model_dtype_is_the_bfloat16_rounding():
  """Integer rounding to bfloat16 (which XLA cannot elide on a GPU) equals the conversion, ties included."""
  from pallas_kernels._common import round_to_model_dtype

  rng = np.random.default_rng(1)
  x = np.concatenate(
    [
      rng.standard_normal(50000).astype(np.float32) * 10.0 ** rng.integers(-20, 20, 50000),
      # ties: a bfloat16 value plus half its last place, both parities
      (np.arange(1, 5000, dtype=np.uint32) << 16 | 0x8000).view(np.float32),
    ]
  ).astype(np.float32)
  want = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))
  np.testing.assert_array_equal(np.asarray(round_to_model_dtype(jnp.asarray(x), jnp.bfloat16)), want)
  np.testing.assert_array_equal(np.asarray(round_to_model_dtype(jnp.asarray(x), jnp.float32)), x)
  with pytest.raises(ValueError, match="float16"):
    round_to_model_dtype(jnp.asarray(x), jnp.float16)


def test_compiled_kernels_refuse_byte_arrays_their_offsets_cannot_reach():
  """Pallas's Triton lowering uses 32-bit element offsets up to 4 GiB arrays: a uint8 or fp8 view
  of 2-4 GiB cannot be addressed past 2 GiB, so the compiled kernels refuse it with the sizes
  (abstract arrays: nothing is allocated); 2 GiB, above 4 GiB and interpret mode are accepted."""
  import functools

  import jax

  from pallas_kernels.paged_mqa_logits import paged_mqa_logits

  row = 1 << 20
  write = lambda rows, interpret: jax.eval_shape(
    functools.partial(
      write_to_paged_cache, view=KernelView.for_rows(row, tokens_per_row=1024, layer_name="lat"), interpret=interpret
    ),
    jax.ShapeDtypeStruct((rows, row), jnp.uint8),
    jax.ShapeDtypeStruct((8, 1024), jnp.uint8),
    jax.ShapeDtypeStruct((8,), jnp.int32),
  )
  with pytest.raises(ValueError, match=r"the cache array of lat is 3221225472 bytes \(3.00 GiB\)"):
    write(3072, interpret=False)
  for rows, interpret in ((2048, False), (4097, False), (3072, True)):
    assert write(rows, interpret).shape == (rows, row)
  p, d, b = 64, 128, 4
  view = KernelView.for_rows(p * (d + 4), entries_per_page=p, layer_name="idx", cache_dtype="fp8")
  mqa = lambda pages: jax.eval_shape(
    functools.partial(paged_mqa_logits, view=view, interpret=False),
    jax.ShapeDtypeStruct((b, 1, 32, d), jnp.float8_e4m3fn),
    jax.ShapeDtypeStruct((pages, p * (d + 4)), jnp.uint8),
    jax.ShapeDtypeStruct((b, 32), jnp.float32),
    jax.ShapeDtypeStruct((b, 1), jnp.int32),
    jax.ShapeDtypeStruct((b, 8), jnp.int32),
  )
  with pytest.raises(ValueError, match="indexer cache array of idx"):
    mqa(400_000)  # 3.4 GB
  assert mqa(200_000).shape == (b, 8 * p)
