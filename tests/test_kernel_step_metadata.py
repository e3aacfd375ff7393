"""The step-metadata kernel (one launch: every group's slots and kernel-block tables) against its jnp
reference and an independent NumPy oracle: random permuted tables, stale entries past the counts,
positions up to 2**31 - 1, padding, invalid rows, DCP ranks, rings, compressed caches, dense and
packed plans, poisoned kernel-table buffers. Interpret mode on the CPU, compiled on a GPU."""

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import KernelTableGroup, SlotGroup, StepMetadataSpec, map_group_to_kernel_blocks
from kernel_utils import build_batch, random_tables, slots_for, tiny_plan
from pallas_kernels import compute_step_metadata, compute_step_metadata_reference

# Eight KV-cache groups: token groups of four block sizes, two rings, two recurrent states.
SPEC = StepMetadataSpec(
  slot_groups=(
    SlotGroup("tokens", 16),
    SlotGroup("tokens", 64),
    SlotGroup("tokens", 256),
    SlotGroup("ring", 8),
    SlotGroup("ring", 128),
    SlotGroup("none", 64),
    SlotGroup("none", 64),
    SlotGroup("tokens", 1024),
  ),
  attention_groups=(
    KernelTableGroup(0),  # unsplit token cache
    KernelTableGroup(2, blocks_per_kernel_block=4, stride=4, mapped=True),  # dense split
    KernelTableGroup(
      2, blocks_per_kernel_block=2, stride=7, mapped=True, states_per_page=32, compress_ratio=4
    ),  # packed, re-strided compressed cache
    KernelTableGroup(1, states_per_page=16, compress_ratio=4),  # unsplit compressed cache
    KernelTableGroup(3),
    KernelTableGroup(4),
    KernelTableGroup(5),
    KernelTableGroup(6),
    KernelTableGroup(7, blocks_per_kernel_block=16, stride=16, mapped=True),
  ),
)
NUM_ROWS = 6


def oracle(spec, tables, counts, req, pos):
  """Python-int loops over the definitions (no int32 arithmetic anywhere)."""
  rows = tables[0].shape[0]
  slot_rows, comp_rows, kts = [], [], []
  for g, sg in enumerate(spec.slot_groups):
    if sg.kind == "none":
      slot_rows.append(None)
      continue
    out = []
    for r, p in zip(req.tolist(), pos.tolist()):
      s = -1
      if 0 <= r < rows and p >= 0:
        if sg.kind == "ring":
          b = int(tables[g][r, 0])
          s = b * sg.block_size + p % sg.block_size if b > 0 else -1
        else:
          lp, local, bs = p, True, sg.block_size
          if spec.dcp_size > 1:
            vb, vo = divmod(p, bs * spec.dcp_size)
            local = (vo // spec.dcp_interleave) % spec.dcp_size == spec.dcp_rank
            lp = (
              vb * bs + (vo // (spec.dcp_interleave * spec.dcp_size)) * spec.dcp_interleave + vo % spec.dcp_interleave
            )
          c = lp // bs
          if local and c < tables[g].shape[1] and c < counts[g][r]:
            s = int(tables[g][r, c]) * bs + lp % bs
      out.append(s)
    slot_rows.append(np.array(out, np.int64))
  for ag in spec.attention_groups:
    t, n, bpk = tables[ag.kv_cache_group_id], counts[ag.kv_cache_group_id], ag.blocks_per_kernel_block
    kt = np.array([[int(t[r, c // bpk]) * ag.stride + c % bpk for c in range(t.shape[1] * bpk)] for r in range(rows)])
    kts.append(kt if ag.mapped else None)
    if not ag.compressed:
      comp_rows.append(None)
      continue
    out = []
    for r, p in zip(req.tolist(), pos.tolist()):
      s = -1
      if 0 <= r < rows and p >= 0 and p % ag.compress_ratio == ag.compress_ratio - 1:
        e = p // ag.compress_ratio
        kb = e // ag.states_per_page
        if kb < kt.shape[1] and kb < n[r] * bpk:
          s = int(kt[r, kb]) * ag.states_per_page + e % ag.states_per_page
      out.append(s)
    comp_rows.append(np.array(out, np.int64))
  return slot_rows, comp_rows, kts


def random_step(spec, rng, num_tokens, max_id=50_000):
  """Tables with distinct, permuted live ids and stale ids past the counts; tokens mixing live
  positions, positions far past any row, the last int32 position, negative ones, invalid rows."""
  tables, counts = [], []
  for sg in spec.slot_groups:
    width = int(rng.integers(1, 9)) if sg.kind == "tokens" else 1
    t = rng.permutation(np.arange(1, max_id))[: NUM_ROWS * width].reshape(NUM_ROWS, width).astype(np.int32)
    n = rng.integers(0, width + 1, NUM_ROWS).astype(np.int32)
    if sg.kind != "tokens":
      t[rng.random(NUM_ROWS) < 0.2, 0] = 0  # rows holding the null block
      n[:] = 1
    tables.append(t)
    counts.append(n)
  req = rng.integers(-1, NUM_ROWS + 1, num_tokens).astype(np.int32)  # -1 and NUM_ROWS: no row
  kind = rng.integers(0, 5, num_tokens)
  pos = np.select(
    [kind == 0, kind == 1, kind == 2, kind == 3],
    [
      rng.integers(0, 160, num_tokens),
      rng.integers(0, 1024 * 8, num_tokens),
      rng.integers(0, 2**31, num_tokens),
      np.full(num_tokens, 2**31 - 1),
    ],
    rng.integers(-5, 0, num_tokens),
  ).astype(np.int32)
  return tables, counts, req, pos


def poisoned_buffers(spec, tables, rng):
  return tuple(
    jnp.asarray(
      rng.integers(-(2**31), 2**31 - 1, (NUM_ROWS, tables[ag.kv_cache_group_id].shape[1] * ag.blocks_per_kernel_block)),
      jnp.int32,
    )
    if ag.mapped
    else None
    for ag in spec.attention_groups
  )


def check_against_oracle(spec, meta, tables, counts, req, pos):
  slot_rows, comp_rows, kts = oracle(spec, tables, counts, req, pos)
  for got, want in zip(
    meta.slot_mappings + meta.compressed_slot_mappings + meta.kernel_block_tables, slot_rows + comp_rows + kts
  ):
    assert (got is None) == (want is None)
    if want is not None:
      np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("num_tokens", [1, 3, 64, 200, 1024])
@pytest.mark.parametrize("dcp", [(1, 0, 1), (2, 1, 1), (4, 2, 16)])
def test_kernel_matches_reference_and_oracle(num_tokens, dcp):
  spec = StepMetadataSpec(SPEC.slot_groups, SPEC.attention_groups, *dcp)
  rng = np.random.default_rng(num_tokens * 31 + dcp[0])
  tables, counts, req, pos = random_step(spec, rng, num_tokens)
  args = (tuple(map(jnp.asarray, tables)), tuple(map(jnp.asarray, counts)), jnp.asarray(req), jnp.asarray(pos))
  got = compute_step_metadata(*args, poisoned_buffers(spec, tables, rng), spec=spec, implementation="pallas")
  want = compute_step_metadata_reference(*args, poisoned_buffers(spec, tables, rng), spec=spec)
  chex.assert_trees_all_equal(got, want)
  chex.assert_shape(got.slot_mappings[0], (num_tokens,))
  check_against_oracle(spec, got, tables, counts, req, pos)
  if num_tokens >= 1024:  # live slots of every kind, not only -1
    for rows in (got.slot_mappings[0], got.slot_mappings[3], got.slot_mappings[7], got.compressed_slot_mappings[2]):
      assert (np.asarray(rows) >= 0).any()


def test_without_buffers_maps_no_table_and_gives_the_same_slots():
  rng = np.random.default_rng(5)
  tables, counts, req, pos = random_step(SPEC, rng, 64)
  args = (tuple(map(jnp.asarray, tables)), tuple(map(jnp.asarray, counts)), jnp.asarray(req), jnp.asarray(pos))
  full = compute_step_metadata(*args, poisoned_buffers(SPEC, tables, rng), spec=SPEC, implementation="pallas")
  for impl in ("pallas", "xla"):
    bare = compute_step_metadata(*args, spec=SPEC, implementation=impl)
    assert all(t is None for t in bare.kernel_block_tables)
    chex.assert_trees_all_equal(
      (bare.slot_mappings, bare.compressed_slot_mappings), (full.slot_mappings, full.compressed_slot_mappings)
    )


@pytest.mark.parametrize("layout", ["packed", "dense"])
def test_real_plans_match_the_slots_each_writer_used(layout):
  """On a planned GLM-5.3-Flash-tiny cache: the metadata equals what each layer's writer computed
  group by group (kernel_utils.slots_for), for latents, pooled keys and the tail ring."""
  _, plan = tiny_plan(layout=layout, block_size=512)
  spec = StepMetadataSpec.from_plan(plan)
  rng = np.random.default_rng(1)
  tables = random_tables(plan, 4, [1000, 300, 700, 5], rng)
  batch = build_batch([(0, 990, 10), (1, 100, 150), (2, 3, 1), (3, 0, 5)], 256)
  bt = tuple(jnp.asarray(t.block_table) for t in tables.block_tables)
  nb = tuple(jnp.asarray(t.num_blocks_per_row) for t in tables.block_tables)
  bufs = tuple(None if b is None else jnp.full(b.shape, -7, jnp.int32) for b in plan.init_kernel_block_tables(4))
  meta = compute_step_metadata(
    bt, nb, jnp.asarray(batch.req_indices), jnp.asarray(batch.positions), bufs, spec=spec, implementation="pallas"
  )
  for view in plan.views:
    ag = plan.attention_groups[view.attention_group_id]
    if spec.slot_groups[view.kv_cache_group_id].kind == "none":  # recurrent state: addressed by state slot
      continue
    want = np.asarray(slots_for(plan, tables.block_tables, batch, view.layer_name))
    compressed = meta.compressed_slot_mappings[view.attention_group_id]
    got = compressed if compressed is not None else meta.slot_mappings[view.kv_cache_group_id]
    np.testing.assert_array_equal(np.asarray(got), want, err_msg=view.layer_name)
    if ag.kernel_block_size is not None:
      np.testing.assert_array_equal(
        np.asarray(meta.kernel_block_tables[view.attention_group_id]),
        np.asarray(map_group_to_kernel_blocks(ag, bt[view.kv_cache_group_id])),
      )


def test_errors_name_the_values():
  rng = np.random.default_rng(2)
  tables, counts, req, pos = random_step(SPEC, rng, 8)
  bt, nb = tuple(map(jnp.asarray, tables)), tuple(map(jnp.asarray, counts))
  with pytest.raises(ValueError, match="8 KV-cache groups; got 7 block tables"):
    compute_step_metadata(bt[:7], nb[:7], jnp.asarray(req), jnp.asarray(pos), spec=SPEC)
  with pytest.raises(ValueError, match="int32"):
    compute_step_metadata(bt, nb, jnp.asarray(req), jnp.asarray(pos, jnp.float32), spec=SPEC)
  bufs = list(poisoned_buffers(SPEC, tables, rng))
  bufs[1] = bufs[1][:, :-1]
  with pytest.raises(ValueError, match=r"attention group 1's kernel-block table buffer must be int32\[6, "):
    compute_step_metadata(bt, nb, jnp.asarray(req), jnp.asarray(pos), tuple(bufs), spec=SPEC)
  with pytest.raises(ValueError, match="only token groups have kernel blocks"):
    StepMetadataSpec((SlotGroup("ring", 8),), (KernelTableGroup(0, 2, 2, mapped=True),))
  with pytest.raises(ValueError, match="stride=1 >= it"):
    KernelTableGroup(0, blocks_per_kernel_block=2, stride=1)
  with pytest.raises(ValueError, match="rank 2 of 2"):
    StepMetadataSpec(SPEC.slot_groups, SPEC.attention_groups, dcp_size=2, dcp_rank=2)
