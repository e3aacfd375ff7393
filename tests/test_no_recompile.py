"""200 steps of changing batch composition inside one bucket compile each jitted function once."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import MultiGroupBlockTable, compute_circular_slot_mapping, compute_slot_mapping, map_to_kernel_blocks
from jaxkv.step.slot_mapping import req_indices_from_query_start_loc

MAX_REQS, WIDTH, NUM_TOKENS, BS, BPK = 8, 16, 64, 64, 4


def test_steady_state_does_not_recompile():
  rng = np.random.default_rng(0)
  tables = MultiGroupBlockTable([BS, 4], MAX_REQS, [WIDTH, 1])
  kernel_table = jnp.zeros((MAX_REQS, WIDTH * BPK), jnp.int32)
  for f in (
    compute_slot_mapping,
    map_to_kernel_blocks,
    compute_circular_slot_mapping,
    req_indices_from_query_start_loc,
  ):
    f.clear_cache()
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
    lambda name, *a, **k: compiles.append(name) if "backend_compile" in name else None
  )
  for step in range(200):
    num_reqs = int(rng.integers(1, MAX_REQS + 1))
    tables.clear()
    lens = rng.integers(1, NUM_TOKENS // num_reqs + 1, num_reqs)
    for r in range(num_reqs):
      n = int(rng.integers(1, WIDTH + 1))
      tables.add_row((list(rng.integers(1, 1000, n)), [int(rng.integers(1, 1000))]), r)
    qsl = np.full(MAX_REQS + 1, lens.sum(), np.int32)
    qsl[: num_reqs + 1] = np.concatenate([[0], np.cumsum(lens)])
    positions = rng.integers(0, BS * WIDTH, NUM_TOKENS).astype(np.int32)
    (table, counts), (ring_table, _) = tables.commit()
    reqs = req_indices_from_query_start_loc(jnp.asarray(qsl), jnp.int32(num_reqs), num_tokens=NUM_TOKENS)
    slots = compute_slot_mapping(table, counts, reqs, jnp.asarray(positions), block_size=BS)
    ring = compute_circular_slot_mapping(ring_table, reqs, jnp.asarray(positions), ring_size=4)
    old = kernel_table
    kernel_table = map_to_kernel_blocks(table, BPK, BPK, kernel_table)
    assert old.is_deleted()  # the persistent buffer was donated and reused
    assert slots.shape == ring.shape == (NUM_TOKENS,)
  for f in (
    compute_slot_mapping,
    map_to_kernel_blocks,
    compute_circular_slot_mapping,
    req_indices_from_query_start_loc,
  ):
    assert f._cache_size() == 1, f
  steady = len(compiles)
  # One more step after warm-up: nothing compiles at all.
  (table, counts), _ = tables.commit()
  jax.block_until_ready(map_to_kernel_blocks(table, BPK, BPK, kernel_table))
  assert len(compiles) == steady
