"""Property: a token written through its manager-unit slot is read back through the kernel-block
table, for every layout and split, under jit and eager (hypothesis), with the slots and tables
from the jnp functions and from the step-metadata kernel (interpret mode)."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxkv import (
  map_group_to_kernel_blocks,
  AttentionBackend,
  AttentionGroup,
  KernelTableGroup,
  MLAAttentionSpec,
  SlotGroup,
  StepMetadataSpec,
  compute_compressed_slot_mapping,
  compute_slot_mapping,
  map_to_kernel_blocks,
)
from jaxkv.step.kernel_blocks import map_to_kernel_blocks_reference
from pallas_kernels import compute_step_metadata

MODES = ["jit", "eager"]


def kernel_metadata(batch, group: KernelTableGroup):
  """Slots and the kernel-block table of one token group from ``compute_step_metadata``."""
  table = jnp.asarray(batch["table"])
  spec = StepMetadataSpec((SlotGroup("tokens", batch["bs"]),), (group,))
  meta = compute_step_metadata(
    (table,),
    (jnp.asarray(batch["counts"]),),
    jnp.asarray(batch["reqs"]),
    jnp.asarray(batch["pos"]),
    (jnp.full((table.shape[0], table.shape[1] * batch["bpk"]), -7, jnp.int32),),
    spec=spec,
    implementation="pallas",
  )
  return meta


def run_mode(mode):
  return jax.disable_jit() if mode == "eager" else contextlib.nullcontext()


@st.composite
def paged_batch(draw, compress_ratio=1):
  kbs = draw(st.sampled_from([1, 2, 4, 8, 16])) * compress_ratio
  bpk = draw(st.sampled_from([1, 2, 3, 4, 8]))
  bs = kbs * bpk
  num_reqs = draw(st.integers(1, 4))
  width = draw(st.integers(1, 4))
  counts = [draw(st.integers(0, width)) for _ in range(num_reqs)]
  num_blocks = 1 + sum(counts) + draw(st.integers(0, 3))
  seed = draw(st.integers(0, 2**31 - 1))
  rng = np.random.default_rng(seed)
  ids = rng.permutation(np.arange(1, num_blocks))  # random, permuted, distinct; 0 is the null block
  table = np.zeros((num_reqs, width), np.int32)
  at = 0
  for r, c in enumerate(counts):
    table[r, :c] = ids[at : at + c]
    # Stale garbage past the count must never be used.
    table[r, c:] = rng.integers(0, num_blocks, width - c)
    at += c
  num_tokens = draw(st.integers(1, 24))
  reqs = rng.integers(-1, num_reqs, num_tokens).astype(np.int32)
  cap = np.array(counts + [0])[reqs] * bs
  pos = np.where(cap > 0, rng.integers(0, np.maximum(cap, 1)), rng.integers(0, bs * width + 1, num_tokens))
  # One token per (request, position): later duplicates become padding tokens.
  _, first = np.unique(np.stack([reqs, pos]), axis=1, return_index=True)
  dup = np.ones(num_tokens, bool)
  dup[first] = False
  reqs[dup] = -1
  return dict(
    kbs=kbs,
    bpk=bpk,
    bs=bs,
    table=table,
    counts=np.array(counts, np.int32),
    num_blocks=num_blocks,
    reqs=reqs,
    pos=pos.astype(np.int32),
    rng=rng,
  )


@pytest.mark.parametrize("mode", MODES)
@given(batch=paged_batch())
def test_dense_split_round_trip(mode, batch):
  with run_mode(mode):
    slots = np.asarray(
      compute_slot_mapping(
        jnp.asarray(batch["table"]),
        jnp.asarray(batch["counts"]),
        jnp.asarray(batch["reqs"]),
        jnp.asarray(batch["pos"]),
        block_size=batch["bs"],
      )
    )
    kt = np.asarray(map_to_kernel_blocks(jnp.asarray(batch["table"]), batch["bpk"], batch["bpk"]))
  check_dense_round_trip(batch, slots, kt)


@given(batch=paged_batch())
def test_dense_split_round_trip_through_the_step_metadata_kernel(batch):
  meta = kernel_metadata(batch, KernelTableGroup(0, batch["bpk"], batch["bpk"], mapped=True))
  check_dense_round_trip(batch, np.asarray(meta.slot_mappings[0]), np.asarray(meta.kernel_block_tables[0]))


def check_dense_round_trip(batch, slots, kt):
  kbs, bpk, bs, table = batch["kbs"], batch["bpk"], batch["bs"], batch["table"]
  n_slots = batch["num_blocks"] * bs
  cache = np.full((n_slots, 3), -7, np.int32)  # poisoned
  values = batch["rng"].integers(0, 1 << 30, (len(batch["pos"]), 3)).astype(np.int32)
  np.testing.assert_array_equal(kt, map_to_kernel_blocks_reference(table, bpk, bpk))
  live = slots >= 0
  counts = np.append(batch["counts"], 0)
  expect_live = (batch["reqs"] >= 0) & (batch["pos"] < counts[batch["reqs"]] * bs)
  np.testing.assert_array_equal(live, expect_live)
  cache[slots[live]] = values[live]
  kernel_view = cache.reshape(batch["num_blocks"] * bpk, kbs, 3)
  for t in np.flatnonzero(live):
    r, p = batch["reqs"][t], batch["pos"][t]
    b, off = table[r, p // bs], p % bs
    assert b * bs + off == (b * bpk + off // kbs) * kbs + off % kbs == slots[t]
    np.testing.assert_array_equal(kernel_view[kt[r, p // kbs], p % kbs], values[t])


@pytest.mark.parametrize("mode", MODES)
@given(batch=paged_batch(compress_ratio=4), extra_pages=st.integers(0, 3), lead_pages=st.integers(0, 2))
def test_packed_compressed_round_trip(mode, batch, extra_pages, lead_pages):
  """Pooled entries written through the re-strided kernel table land in their manager block."""

  def slots_of(group, P, ratio):
    with run_mode(mode):
      kt = map_group_to_kernel_blocks(group, jnp.asarray(batch["table"]))
      return np.asarray(
        compute_compressed_slot_mapping(
          kt,
          jnp.asarray(batch["counts"] * group.blocks_per_kernel_block),
          jnp.asarray(batch["reqs"]),
          jnp.asarray(batch["pos"]),
          states_per_page=P,
          compress_ratio=ratio,
        )
      )

  check_packed_round_trip(batch, extra_pages, lead_pages, slots_of)


@given(batch=paged_batch(compress_ratio=4), extra_pages=st.integers(0, 3), lead_pages=st.integers(0, 2))
def test_packed_compressed_round_trip_through_the_step_metadata_kernel(batch, extra_pages, lead_pages):
  def slots_of(group, P, ratio):
    meta = kernel_metadata(
      batch,
      KernelTableGroup(
        0, group.blocks_per_kernel_block, group.stride, mapped=True, states_per_page=P, compress_ratio=ratio
      ),
    )
    return np.asarray(meta.compressed_slot_mappings[0])

  check_packed_round_trip(batch, extra_pages, lead_pages, slots_of)


def check_packed_round_trip(batch, extra_pages, lead_pages, slots_of):
  ratio, row = 4, 12
  kbs, bpk, bs, table = batch["kbs"], batch["bpk"], batch["bs"], batch["table"]
  P = kbs // ratio
  spec = MLAAttentionSpec(
    block_size=bs, num_kv_heads=1, head_size=8, dtype="uint8", state_content_bytes=row, compress_ratio=ratio
  )
  group = AttentionGroup.create(AttentionBackend("pages", (kbs,)), ("idx",), spec, 0)
  # Each packed block: other layers' pages before and after this layer's bpk pages.
  block_bytes = (lead_pages + bpk + extra_pages) * P * row
  arena = np.full((batch["num_blocks"], block_bytes), 0xAB, np.uint8)  # poisoned
  view = group.map_kv_cache_to_kernel_blocks("idx", "arena", arena.shape, page_offset_bytes=lead_pages * P * row)
  group = group.resolve(view.stride)
  if bpk == 1:
    assert group.kernel_block_size is None
    return
  assert group.stride == lead_pages + bpk + extra_pages
  slots = slots_of(group, P, ratio)
  pages = arena.reshape(-1, view.row_bytes).copy()
  values = batch["rng"].integers(0, 255, (len(slots), row)).astype(np.uint8)
  for t in np.flatnonzero(slots >= 0):
    page, entry = divmod(int(slots[t]), P)
    pages[view.base_row + page, entry * row : (entry + 1) * row] = values[t]
  written = pages.reshape(arena.shape)
  for t in np.flatnonzero(slots >= 0):
    r, p = batch["reqs"][t], batch["pos"][t]
    b, e = table[r, p // bs], (p % bs) // ratio
    start = lead_pages * P * row + e * row
    np.testing.assert_array_equal(written[b, start : start + row], values[t])
  # Nothing outside this layer's pages of the written blocks changed.
  mask = np.ones_like(arena, bool)
  for t in np.flatnonzero(slots >= 0):
    r, p = batch["reqs"][t], batch["pos"][t]
    b, e = table[r, p // bs], (p % bs) // ratio
    mask[b, lead_pages * P * row + e * row : lead_pages * P * row + (e + 1) * row] = False
  assert (written[mask] == 0xAB).all()
