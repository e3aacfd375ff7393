"""Sparse MLA decode over planned (dense and packed) latent caches against reference and oracle."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import KernelView
from kernel_utils import build_batch, random_tables, slots_for, tiny_plan
from pallas_kernels.cache_write import decode_entries, encode_entries, write_to_paged_cache
from pallas_kernels.sparse_mla_decode import (
  sparse_mla_decode,
  sparse_mla_decode_tiles,
  sparse_mla_num_splits,
  sparse_mla_shared_memory,
)


@pytest.mark.parametrize("layout", ["dense", "packed"])
@pytest.mark.parametrize("cache_dtype, rank", [("bfloat16", 32), ("float32", 32), ("fp8", 256), ("fp8", 32)])
def test_sparse_mla_decode(layout, cache_dtype, rank):
  rng = np.random.default_rng(rank + len(layout) + len(cache_dtype))
  cfg, plan = tiny_plan(layout=layout, kv_cache_dtype=cache_dtype, block_size=512, kv_lora_rank=rank)
  name = f"layers.{cfg.dsa_layers[1]}.self_attn.mla"
  b = plan.view(name)
  lengths = [700, 45, 1024]
  tables = random_tables(plan, 3, lengths, rng)
  t_arr = [t for t in plan.tensors if t.name == b.tensor][0]
  cache = jnp.asarray(rng.integers(0, 256, (t_arr.num_rows, t_arr.row_bytes), dtype=np.uint8))  # poison
  latents = []
  for r, n in enumerate(lengths):  # prefill each request's latents through the slot mapping
    x = rng.standard_normal((n, rank)).astype(np.float32)
    batch = build_batch([(r, 0, n)], n)
    entries = encode_entries(jnp.asarray(x), cache_dtype)
    cache = write_to_paged_cache(cache, entries, slots_for(plan, tables, batch, name), view=b)
    latents.append(np.asarray(decode_entries(entries, cache_dtype, rank), np.float64))
  # Queries: decode rows of each request, one padded query, spec-style consecutive rows of request 2.
  reqs = np.array([0, 1, 2, 2, 2, -1], np.int32)
  k, h = 40, cfg.num_attention_heads
  idx = np.full((len(reqs), k), -1, np.int32)
  for i, r in enumerate(reqs):
    if r >= 0:
      n = int(rng.integers(0, k + 1)) if i else 0  # row 0 selects nothing
      idx[i, :n] = rng.choice(lengths[r], size=min(n, lengths[r]), replace=False)
  idx[1, :] = rng.permutation(45)[:k] if k <= 45 else idx[1]
  # The selector leaves its -1 columns between the pools and the tail: rows 2-4 scatter theirs.
  idx[2:5] = rng.permuted(idx[2:5], axis=1)
  q = rng.standard_normal((len(reqs), h, rank)).astype(np.float32)
  sm_scale = 1.0 / np.sqrt(rank)
  table = jnp.asarray(tables[b.kv_cache_group_id].block_table)
  kw = dict(view=b, sm_scale=float(sm_scale))
  args = (jnp.asarray(q), cache, jnp.asarray(idx), jnp.asarray(reqs), table)
  got = np.asarray(sparse_mla_decode(*args, **kw, implementation="pallas", block_k=16))
  ref = np.asarray(sparse_mla_decode(*args, **kw, implementation="xla"))
  # The default tiles too (64 tokens, the selected rows of a query in one tile), and two splits of
  # the three 16-token tiles: a query's selected tiles spread over them (2 + 1, or 1 + none).
  default_tiles = [np.asarray(sparse_mla_decode(*args, **kw, implementation="pallas"))] if layout == "dense" else []
  two_splits = np.asarray(sparse_mla_decode(*args, **kw, implementation="pallas", block_k=16, num_splits=2))
  # Rows loaded and multiplied in latent slices (narrower than an fp8 scale group at rank 256).
  slices = np.asarray(
    sparse_mla_decode(*args, **kw, implementation="pallas", block_k=16, latent_block=max(16, rank // 4))
  )
  want = np.zeros_like(got, np.float64)
  for i, r in enumerate(reqs):
    sel = idx[i][idx[i] >= 0]
    if r < 0 or not len(sel):
      continue
    c = latents[r][sel]
    s = q[i].astype(np.float64) @ c.T * sm_scale
    p = np.exp(s - s.max(-1, keepdims=True))
    want[i] = (p / p.sum(-1, keepdims=True)) @ c
  tol = 1e-5 if cache_dtype == "float32" else 3e-2
  for out in (got, ref, two_splits, slices, *default_tiles):
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, want, rtol=tol, atol=tol)
  assert not got[0].any() and not got[-1].any()  # nothing selected -> zeros, not NaN


def test_validation():
  def decode(q, num_reqs=2, latent_block=None, **view):
    view = KernelView.for_rows(64 * 64, tokens_per_row=64, **view)
    args = (jnp.zeros((4, 64 * 64), jnp.uint8), jnp.zeros((2, 8), jnp.int32), jnp.zeros(num_reqs, jnp.int32))
    return sparse_mla_decode(q, *args, jnp.zeros((2, 2), jnp.int32), view=view, sm_scale=1.0, latent_block=latent_block)

  q = jnp.zeros((2, 4, 32), jnp.float32)
  with pytest.raises(ValueError, match=r"req_indices must be int32\[2\]"):
    decode(q, num_reqs=3, cache_dtype="bfloat16")
  with pytest.raises(ValueError, match="multiple of 128.*got 160"):
    decode(jnp.zeros((2, 4, 160), jnp.float32), cache_dtype="fp8")
  with pytest.raises(ValueError, match=r"latent_block must be a power of two >= 16 dividing the latent dim 32, got 24"):
    decode(q, cache_dtype="bfloat16", latent_block=24)
  with pytest.raises(ValueError, match=r"latent_block must be .*got 0"):
    decode(q, cache_dtype="bfloat16", latent_block=0)
  # The entry encoding comes with the view: a view that does not say it is refused by name.
  with pytest.raises(ValueError, match=r"view of lat has cache_dtype None.*for_rows\(\.\.\., cache_dtype"):
    decode(q, layer_name="lat")


H200_SHARED_MEMORY = 232_448  # cuDeviceGetAttribute(MAX_SHARED_MEMORY_PER_BLOCK_OPTIN) on the H200


def test_tiles_follow_entry_size_and_shared_memory():
  # The released model's latent (512) at 64 heads: float32 64 x 64 tiles asked the H200 for 279,552
  # bytes (RESOURCE_EXHAUSTED in the first step); the estimate is exactly that.
  assert sparse_mla_shared_memory(64, 64, 512, "float32") == 279_552
  assert sparse_mla_decode_tiles(64, 512, "bfloat16", H200_SHARED_MEMORY) == (64, 64)
  assert sparse_mla_decode_tiles(64, 512, "fp8", H200_SHARED_MEMORY) == (64, 64)
  assert sparse_mla_decode_tiles(64, 512, "float32", H200_SHARED_MEMORY) == (64, 32)  # the token tile shrinks first
  assert sparse_mla_decode_tiles(64, 512, "float32", None) == (64, 64)  # interpret mode: no limit
  assert sparse_mla_decode_tiles(4, 512, "float32", None) == (16, 64)  # head tile at most the padded heads
  for smem in (101_376, 166_912, H200_SHARED_MEMORY):  # sm_86/89/120, A100, H100/H200
    for dtype in ("float32", "bfloat16", "fp8"):
      bh, bk = sparse_mla_decode_tiles(64, 512, dtype, smem)
      assert sparse_mla_shared_memory(bh, bk, 512, dtype) <= smem
  assert sparse_mla_decode_tiles(64, 512, "float32", 101_376) == (32, 16)
  with pytest.raises(
    ValueError, match=r"float32 latents of 512 need 67,584 bytes .* than the 49,152 .*--implementation xla"
  ):
    sparse_mla_decode_tiles(64, 512, "float32", 49_152)


def test_num_splits_fill_one_wave_of_programs():
  # The released latent (bf16, 1 KiB entries) in 64 x 64 tiles; 2,048 selected rows are 32 tiles.
  tile, partial = 64 * 1024, 64 * (512 + 2) * 4
  # 64 queries on 132 SMs: 2 splits are one wave of 16 tiles; 5 (the old rule) were three waves of 7.
  assert sparse_mla_num_splits(64, 32, tile, partial, 132) == 2
  assert sparse_mla_num_splits(1, 32, tile, partial, 132) == 32  # one query spreads over its tiles
  # Up to 8 queries: a tile per program, so a request verifying 3 drafts (4 queries a request)
  # splits each query as decoding does (bitwise the same with and without speculation).
  for batch in (1, 2):
    assert sparse_mla_num_splits(4 * batch, 33, tile, partial, 132) == sparse_mla_num_splits(
      batch, 33, tile, partial, 132
    )
  assert sparse_mla_num_splits(2048, 32, tile, partial, 132) == 1  # a prefill step fills the GPU as it is
  assert sparse_mla_num_splits(1, 3, tile, partial, 132) == 3  # never more splits than tiles
  for programs in (1, 8, 32, 64, 200):  # at most two programs per SM
    assert sparse_mla_num_splits(programs, 32, tile, partial, 132) <= max(1, -(-264 // programs))
