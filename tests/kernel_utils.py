"""Shared helpers of the kernel tests: a planned GLM-5.3-Flash-tiny cache and a batch builder."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxkv import (
  map_group_to_kernel_blocks,
  CacheConfig,
  MultiGroupBlockTable,
  compute_circular_slot_mapping,
  compute_compressed_slot_mapping,
  compute_slot_mapping,
  plan_kv_cache,
)
from models.glm5_next import get_config, get_kv_cache_layers


def tiny_plan(
  layout="packed",
  block_size=512,
  indexer_cache_dtype="fp8",
  kv_cache_dtype="bfloat16",
  num_spec=0,
  state_dtype="float32",
  memory_bytes=48 << 20,
  max_model_len=2048,
  **overrides,
):
  cfg = get_config("glm-5.3-flash-tiny")
  if overrides:
    cfg = dataclasses.replace(cfg, **overrides)
  cache = CacheConfig(
    block_size=block_size,
    layout=layout,
    kv_cache_dtype=kv_cache_dtype,
    indexer_cache_dtype=indexer_cache_dtype,
    state_dtype=state_dtype,
    num_speculative_tokens=num_spec,
    memory_bytes=memory_bytes,
    max_model_len=max_model_len,
  )
  return cfg, plan_kv_cache(get_kv_cache_layers(cfg, cache), cache)


@dataclasses.dataclass
class Batch:
  positions: np.ndarray
  req_indices: np.ndarray


def build_batch(chunks: list[tuple[int, int, int]], num_tokens: int) -> Batch:
  """``chunks`` of ``(row, start_pos, length)`` -> padded per-token arrays."""
  pos, req = [], []
  for row, start, n in chunks:
    pos += list(range(start, start + n))
    req += [row] * n
  pad = num_tokens - len(pos)
  assert pad >= 0
  return Batch(np.array(pos + [0] * pad, np.int32), np.array(req + [-1] * pad, np.int32))


def random_tables(plan, num_reqs, lengths, rng):
  """Block tables with random, permuted blocks for every group of ``plan``."""
  widths = plan.block_table_widths()
  tables = MultiGroupBlockTable([g.kv_cache_spec.block_size for g in plan.kv_cache_groups], num_reqs, widths)
  free = list(rng.permutation(np.arange(1, plan.num_blocks)))
  for r, n in enumerate(lengths):
    ids = []
    for g in plan.kv_cache_groups:
      k = g.kv_cache_spec.max_num_blocks_per_req(n)
      ids.append([int(free.pop()) for _ in range(k)])
    tables.add_row(ids, r)
  return tables


def group_of(plan, layer_name):
  v = plan.view(layer_name)
  return v.kv_cache_group_id, plan.attention_groups[v.attention_group_id], v


def slots_for(plan, tables, batch, layer_name):
  """The slot mapping the layer's writer uses (generic, circular or compressed)."""
  gid, ag, b = group_of(plan, layer_name)
  bt = tables[gid]
  table, counts = jnp.asarray(bt.block_table), jnp.asarray(bt.num_blocks_per_row)
  reqs, pos = jnp.asarray(batch.req_indices), jnp.asarray(batch.positions)
  spec = ag.kv_cache_spec
  if not spec.uses_slot_mapping:
    return compute_circular_slot_mapping(table, reqs, pos, ring_size=spec.block_size)
  if spec.tokens_per_state > 1:
    kt = map_group_to_kernel_blocks(ag, table)
    return compute_compressed_slot_mapping(
      kt,
      counts * ag.blocks_per_kernel_block,
      reqs,
      pos,
      states_per_page=ag.states_per_kernel_page,
      compress_ratio=spec.tokens_per_state,
    )
  return compute_slot_mapping(table, counts, reqs, pos, block_size=spec.block_size)
