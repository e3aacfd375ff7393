"""Slot-mapped cache writes: scatter per-token entries into a paged cache, in place.

The cache is the real backing array, ``uint8[num_rows, row_bytes]``: a dense layer array (rows are
manager pages, or kernel pages when split at allocation) or the packed arena (rows are packed
blocks, the layer's page at ``page_offset_bytes``). Token slot ``s`` (manager units) lives in row
``s // tokens_per_row`` at byte ``page_offset_bytes + (s % tokens_per_row) * entry_bytes``; for a
dense split pass ``tokens_per_row = kernel_block_size``, which addresses the same bytes because
``b*bs + off == (b*bpk + off//kbs)*kbs + off%kbs``. Slot -1 writes nothing.

Entries are bytes (``encode_entries``): bf16/f32 values bitcast, or fp8 e4m3 values followed by
one power-of-two fp32 scale per 128 values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Int, UInt8

from pallas_kernels._common import (
    FP8_DTYPE,
    FP8_GROUP,
    check_implementation,
    default_interpret,
    f32_bytes,
    pow2_chunks,
    quantize_fp8_pow2,
)

__all__ = [
    "write_to_paged_cache",
    "write_to_paged_cache_reference",
    "encode_entries",
    "decode_entries",
    "entry_bytes",
]


def entry_bytes(dim: int, cache_dtype: str) -> int:
  if cache_dtype == "fp8":
    return dim + -(-dim // FP8_GROUP) * 4
  return dim * jnp.dtype(cache_dtype).itemsize


def encode_entries(x: jax.Array, cache_dtype: str) -> UInt8[Array, "T E"]:
  """Per-token entries ``x[T, D]`` as cache bytes ``[T, entry_bytes(D)]``."""
  t, d = x.shape
  if cache_dtype != "fp8":
    return jax.lax.bitcast_convert_type(x.astype(cache_dtype), jnp.uint8).reshape(t, -1)
  groups = -(-d // FP8_GROUP)
  padded = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, groups * FP8_GROUP - d)))
  q, scale = quantize_fp8_pow2(padded.reshape(t, groups, FP8_GROUP))
  values = jax.lax.bitcast_convert_type(q.reshape(t, -1)[:, :d], jnp.uint8)
  return jnp.concatenate([values, f32_bytes(scale[..., 0]).reshape(t, groups * 4)], axis=1)


def decode_entries(entries: UInt8[Array, "T E"], cache_dtype: str, dim: int) -> jax.Array:
  """Inverse of ``encode_entries`` (fp8: dequantized to float32)."""
  t = entries.shape[0]
  if cache_dtype != "fp8":
    return jax.lax.bitcast_convert_type(entries.reshape(t, dim, -1), jnp.dtype(cache_dtype))
  groups = -(-dim // FP8_GROUP)
  values = jax.lax.bitcast_convert_type(entries[:, :dim], FP8_DTYPE).astype(jnp.float32)
  scales = jax.lax.bitcast_convert_type(entries[:, dim:dim + 4 * groups].reshape(t, groups, 4), jnp.float32)
  return values * jnp.repeat(scales, FP8_GROUP, axis=1)[:, :dim]


def _cache_write_kernel(slots_ref, entries_ref, cache_in_ref, cache_ref, *, tokens_per_row, page_offset_bytes):
  # slots_ref: [T]; entries_ref: [T, E]; cache_ref: [num_rows, row_bytes] (aliases cache_in_ref).
  del cache_in_ref
  t = pl.program_id(0)
  slot = slots_ref[t]
  e = entries_ref.shape[1]

  @pl.when(slot >= 0)
  def _():
    row = slot // tokens_per_row
    col = page_offset_bytes + (slot % tokens_per_row) * e
    # Triton blocks are powers of two: a 528-byte fp8 entry is stored as 512 + 16.
    for start, size in pow2_chunks(e):
      cache_ref[row, pl.ds(col + start, size)] = entries_ref[t, pl.ds(start, size)]


def _validate(cache, entries, slots, tokens_per_row, page_offset_bytes):
  if cache.ndim != 2 or cache.dtype != jnp.uint8:
    raise ValueError(f"cache must be uint8[num_rows, row_bytes], got {cache.dtype}{list(cache.shape)}.")
  if entries.ndim != 2 or entries.dtype != jnp.uint8:
    raise ValueError(f"entries must be uint8[num_tokens, entry_bytes], got {entries.dtype}{list(entries.shape)}.")
  if slots.shape != entries.shape[:1] or slots.dtype != jnp.int32:
    raise ValueError(f"slots must be int32[{entries.shape[0]}], got {slots.dtype}{list(slots.shape)}.")
  end = page_offset_bytes + tokens_per_row * entries.shape[1]
  if tokens_per_row <= 0 or page_offset_bytes < 0 or end > cache.shape[1]:
    raise ValueError(
        f"a page of {tokens_per_row} entries of {entries.shape[1]} bytes at offset {page_offset_bytes} "
        f"ends at byte {end}, past the cache row of {cache.shape[1]} bytes."
    )


@functools.partial(
    jax.jit,
    static_argnames=("tokens_per_row", "page_offset_bytes", "implementation", "interpret"),
    donate_argnames=("cache",),
)
def write_to_paged_cache(
    cache: UInt8[Array, "N R"],
    entries: UInt8[Array, "T E"],
    slots: Int[Array, "T"],
    *,
    tokens_per_row: int,
    page_offset_bytes: int = 0,
    implementation: str = "pallas",
    interpret: bool | None = None,
) -> UInt8[Array, "N R"]:
  """Writes ``entries[t]`` at manager-unit slot ``slots[t]`` of one layer; the cache is donated.

  Args:
    cache: uint8 ``[num_rows, row_bytes]`` backing array (updated in place).
    entries: uint8 ``[num_tokens, entry_bytes]`` (``encode_entries``).
    slots: int32 ``[num_tokens]``, -1 for tokens that write nothing. Slots must be distinct.
    tokens_per_row: entries per row of this layer (block size; kernel block size if split).
    page_offset_bytes: the layer's page offset inside each row (packed arenas).
    implementation: ``"pallas"`` or ``"xla"`` (the reference).
  """
  check_implementation(implementation)
  _validate(cache, entries, slots, tokens_per_row, page_offset_bytes)
  if implementation == "xla":
    return write_to_paged_cache_reference(cache, entries, slots, tokens_per_row=tokens_per_row,
                                          page_offset_bytes=page_offset_bytes)
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  return pl.pallas_call(
      functools.partial(_cache_write_kernel, tokens_per_row=tokens_per_row, page_offset_bytes=page_offset_bytes),
      out_shape=jax.ShapeDtypeStruct(cache.shape, cache.dtype),
      grid=(entries.shape[0],),
      in_specs=[any_spec, any_spec, any_spec],
      out_specs=any_spec,
      input_output_aliases={2: 0},
      interpret=default_interpret(interpret),
      name="cache_write",
  )(slots, entries, cache)


def write_to_paged_cache_reference(cache, entries, slots, *, tokens_per_row: int, page_offset_bytes: int = 0):
  """Plain jnp: one scatter of the entry bytes; -1 slots go out of range and are dropped."""
  num_rows = cache.shape[0]
  e = entries.shape[1]
  valid = slots >= 0
  # A -1 index would wrap to the last row: send it past the end instead.
  rows = jnp.where(valid, slots // tokens_per_row, num_rows)
  cols = page_offset_bytes + (slots % tokens_per_row)[:, None] * e + jnp.arange(e)
  return cache.at[rows[:, None], cols].set(entries, mode="drop")
