"""kpool compression through the tail ring: chunked (mid-pool) steps against whole-sequence pooling."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import map_group_to_kernel_blocks
from kernel_utils import build_batch, group_of, random_tables, slots_for, tiny_plan
from pallas_kernels.kpool import combine_pool, kpool_compress_and_write, read_indexer_entries

NUM_TOKENS = 32


def run_chunks(layout, cache_dtype, model_dtype, lengths, chunk_sizes, rng, implementation):
  cfg, plan = tiny_plan(layout=layout, indexer_cache_dtype=cache_dtype, block_size=512)
  layer = cfg.dsa_layers[0]
  idx_name, tail_name = f"layers.{layer}.self_attn.indexer", f"layers.{layer}.self_attn.indexer_tail"
  _, idx_ag, idx_b = group_of(plan, idx_name)
  _, tail_ag, tail_b = group_of(plan, tail_name)
  d, kpool, ring = cfg.index_head_dim, cfg.index_kpool, tail_ag.kv_cache_spec.block_size
  tables = random_tables(plan, len(lengths), lengths, rng)
  arrays = {t.name: jnp.asarray(rng.integers(0, 256, (t.num_rows, t.row_bytes), dtype=np.uint8)) for t in plan.tensors}
  poison = {k: np.asarray(v).copy() for k, v in arrays.items()}
  keys = [jnp.asarray(rng.standard_normal((n, d)), model_dtype) for n in lengths]
  gates = [jnp.asarray(rng.standard_normal((n, d)) * 2, model_dtype) for n in lengths]
  ape = jnp.asarray(rng.standard_normal((kpool, d)) * 0.5, jnp.float32)
  done = [0] * len(lengths)
  shared = idx_b.tensor == tail_b.tensor
  step = 0
  while any(dn < n for dn, n in zip(done, lengths)):
    chunks, ks, gs, budget = [], [], [], NUM_TOKENS
    for r, n in enumerate(lengths):
      take = min(n - done[r], chunk_sizes[step % len(chunk_sizes)], budget)
      if take > 0:
        chunks.append((r, done[r], take))
        ks.append(keys[r][done[r] : done[r] + take])
        gs.append(gates[r][done[r] : done[r] + take])
        budget -= take
    step += 1
    batch = build_batch(chunks, NUM_TOKENS)
    pad = NUM_TOKENS - sum(c[2] for c in chunks)
    k = jnp.concatenate(ks + [jnp.full((pad, d), 7.0, model_dtype)])
    g = jnp.concatenate(gs + [jnp.full((pad, d), 7.0, model_dtype)])
    tail_slots = slots_for(plan, tables, batch, tail_name)
    cslots = slots_for(plan, tables, batch, idx_name)
    cache, tail = kpool_compress_and_write(
      arrays[idx_b.tensor],
      None if shared else arrays[tail_b.tensor],
      k,
      g,
      ape,
      jnp.asarray(batch.positions),
      jnp.asarray(batch.req_indices),
      tail_slots,
      cslots,
      view=idx_b,
      tail_view=tail_b,
      kpool=kpool,
      implementation=implementation,
    )
    arrays[idx_b.tensor] = cache
    if not shared:
      arrays[tail_b.tensor] = tail
    for r, start, n in chunks:
      done[r] = start + n
  return dict(
    cfg=cfg,
    plan=plan,
    arrays=arrays,
    poison=poison,
    keys=keys,
    gates=gates,
    ape=ape,
    tables=tables,
    idx=(idx_ag, idx_b),
    tail=(tail_ag, tail_b),
    ring=ring,
  )


@pytest.mark.parametrize("layout", ["packed", "dense"])
@pytest.mark.parametrize(
  "cache_dtype, model_dtype", [("fp8", jnp.bfloat16), ("float32", jnp.float32), ("bfloat16", jnp.bfloat16)]
)
def test_chunked_compression_matches_whole_sequence_pooling(layout, cache_dtype, model_dtype):
  lengths = [37, 6, 300, 1]  # pools spanning chunks and blocks (block 512 = 128 pools), a lone token
  chunk_sizes = [5, 3, 9, 1, 14]  # starts and ends mid-pool
  runs = {
    impl: run_chunks(layout, cache_dtype, model_dtype, lengths, chunk_sizes, np.random.default_rng(7), impl)
    for impl in ("pallas", "xla")
  }
  for name in runs["xla"]["arrays"]:
    np.testing.assert_array_equal(runs["pallas"]["arrays"][name], runs["xla"]["arrays"][name], err_msg=name)
  run = runs["pallas"]
  cfg = run["cfg"]
  idx_ag, idx_b = run["idx"]
  d, kpool = cfg.index_head_dim, cfg.index_kpool
  P = idx_ag.states_per_kernel_page
  arena = run["arrays"][idx_b.tensor]
  gid = idx_b.kv_cache_group_id
  kt = np.asarray(map_group_to_kernel_blocks(idx_ag, jnp.asarray(run["tables"][gid].block_table)))
  for r, n in enumerate(lengths):
    num_pools = n // kpool
    if not num_pools:
      continue
    k = run["keys"][r][: num_pools * kpool].reshape(num_pools, kpool, d)
    g = run["gates"][r][: num_pools * kpool].reshape(num_pools, kpool, d)
    want = combine_pool(k, g, run["ape"]).astype(model_dtype).astype(jnp.float32)
    e = np.arange(num_pools)
    vals, scales = read_indexer_entries(arena, jnp.asarray(kt[r, e // P]), view=idx_b, head_dim=d)
    got = np.asarray(vals)[e, e % P] * np.asarray(scales)[e, e % P][:, None]
    if cache_dtype == "fp8":
      # e4m3 keeps 3 mantissa bits; the scale is the power of two just above amax / 448.
      amax = np.abs(np.asarray(want)).max(-1, keepdims=True)
      np.testing.assert_allclose(got, want, rtol=2**-4, atol=float(amax.max()) * 2**-9)
    else:
      # The same math fused differently may differ by a few roundings of the model dtype.
      eps = float(jnp.finfo(model_dtype).eps)
      np.testing.assert_allclose(got, want, rtol=8 * eps, atol=eps * float(np.abs(want).max()))


def test_tail_ring_holds_each_requests_last_tokens():
  rng = np.random.default_rng(3)
  lengths = [10, 23, 3]
  run = run_chunks("packed", "fp8", jnp.float32, lengths, [4, 7, 2], rng, "pallas")
  tail_ag, tail_b = run["tail"]
  ring, d = run["ring"], run["cfg"].index_head_dim
  arena = np.asarray(run["arrays"][tail_b.tensor])
  gid = tail_b.kv_cache_group_id
  for r, n in enumerate(lengths):
    block = run["tables"][gid].block_table[r, 0]
    page = arena[block, tail_b.tensor_offset_bytes : tail_b.tensor_offset_bytes + tail_b.page_bytes]
    kg = page.view(np.float32).reshape(2, ring, d)
    for p in range(max(0, n - ring), n):
      np.testing.assert_array_equal(kg[0, p % ring], np.asarray(run["keys"][r][p]))
      np.testing.assert_array_equal(kg[1, p % ring], np.asarray(run["gates"][r][p]))
