"""Slot-mapped cache writes: scatter per-token entries into a paged cache, in place.

The cache is the real backing array, ``uint8[num_rows, row_bytes]``: a dense layer array (rows are
manager pages, or kernel pages when split at allocation) or the packed arena (rows are packed
blocks). The layer's ``KernelView`` says where: slot ``s`` lives in view row
``base_row + s // tokens_per_row`` at byte ``offset_bytes + (s % tokens_per_row) * entry_bytes``; a
dense split has ``tokens_per_row = kernel_block_size``, which addresses the same bytes as the
manager slot because ``b*bs + off == (b*bpk + off//kbs)*kbs + off%kbs``. Slot -1 writes nothing.

Entries are bytes (``encode_entries``): bf16/f32 values bitcast, or fp8 e4m3 values followed by
one power-of-two fp32 scale per 128 values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Int, UInt8

from jaxkv.cache.kernel_view import KernelView
from jaxkv.utils import cdiv
from pallas_kernels._common import (
  FP8_DTYPE,
  FP8_GROUP,
  check_byte_addressable,
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
  """Bytes of one cache entry of ``dim`` values: fp8 values plus one fp32 scale per 128 of them."""
  if cache_dtype == "fp8":
    return dim + cdiv(dim, FP8_GROUP) * 4
  return dim * jnp.dtype(cache_dtype).itemsize


def encode_entries(x: jax.Array, cache_dtype: str) -> UInt8[Array, "T E"]:
  """Per-token entries ``x[T, D]`` as cache bytes ``[T, entry_bytes(D)]``."""
  t, d = x.shape
  if cache_dtype != "fp8":
    return jax.lax.bitcast_convert_type(x.astype(cache_dtype), jnp.uint8).reshape(t, -1)
  groups = cdiv(d, FP8_GROUP)
  padded = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, groups * FP8_GROUP - d)))
  q, scale = quantize_fp8_pow2(padded.reshape(t, groups, FP8_GROUP))
  values = jax.lax.bitcast_convert_type(q.reshape(t, -1)[:, :d], jnp.uint8)
  return jnp.concatenate([values, f32_bytes(scale[..., 0]).reshape(t, groups * 4)], axis=1)


def decode_entries(entries: UInt8[Array, "T E"], cache_dtype: str, dim: int) -> jax.Array:
  """Inverse of ``encode_entries`` (fp8: dequantized to float32)."""
  t = entries.shape[0]
  if cache_dtype != "fp8":
    return jax.lax.bitcast_convert_type(entries.reshape(t, dim, -1), jnp.dtype(cache_dtype))
  groups = cdiv(dim, FP8_GROUP)
  values = jax.lax.bitcast_convert_type(entries[:, :dim], FP8_DTYPE).astype(jnp.float32)
  scales = jax.lax.bitcast_convert_type(entries[:, dim : dim + 4 * groups].reshape(t, groups, 4), jnp.float32)
  return values * jnp.repeat(scales, FP8_GROUP, axis=1)[:, :dim]


def _cache_write_kernel(slots_ref, entries_ref, cache_in_ref, cache_ref, *, view: KernelView):
  # slots_ref: [T]; entries_ref: [T, E]; cache_ref: [view rows, row_bytes] (aliases cache_in_ref).
  del cache_in_ref
  t = pl.program_id(0)
  slot = slots_ref[t]
  e = entries_ref.shape[1]

  @pl.when(slot >= 0)
  def _():
    row = view.base_row + slot // view.tokens_per_row
    col = view.offset_bytes + (slot % view.tokens_per_row) * e
    # Triton blocks are powers of two: a 528-byte fp8 entry is stored as 512 + 16.
    for start, size in pow2_chunks(e):
      cache_ref[row, pl.ds(col + start, size)] = entries_ref[t, pl.ds(start, size)]


def _validate(cache, entries, slots, view: KernelView):
  if cache.ndim != 2 or cache.dtype != jnp.uint8 or cache.size % view.row_bytes:
    raise ValueError(
      f"cache must be uint8[num_rows, row_bytes] of whole {view.row_bytes}-byte view rows of "
      f"{view.layer_name}, got {cache.dtype}{list(cache.shape)}."
    )
  if entries.ndim != 2 or entries.dtype != jnp.uint8:
    raise ValueError(f"entries must be uint8[num_tokens, entry_bytes], got {entries.dtype}{list(entries.shape)}.")
  if slots.shape != entries.shape[:1] or slots.dtype != jnp.int32:
    raise ValueError(f"slots must be int32[{entries.shape[0]}], got {slots.dtype}{list(slots.shape)}.")
  end = view.offset_bytes + view.tokens_per_row * entries.shape[1]
  if view.tokens_per_row <= 0 or view.offset_bytes < 0 or end > view.row_bytes:
    raise ValueError(
      f"a page of {view.tokens_per_row} entries of {entries.shape[1]} bytes at offset {view.offset_bytes} "
      f"ends at byte {end}, past the view row of {view.row_bytes} bytes ({view.layer_name})."
    )


@functools.partial(
  jax.jit,
  static_argnames=("view", "implementation", "interpret"),
  donate_argnames=("cache",),
)
def write_to_paged_cache(
  cache: UInt8[Array, "N R"],
  entries: UInt8[Array, "T E"],
  slots: Int[Array, " T"],
  *,
  view: KernelView,
  implementation: str = "pallas",
  interpret: bool | None = None,
) -> UInt8[Array, "N R"]:
  """Writes ``entries[t]`` at manager-unit slot ``slots[t]`` of one layer; the cache is donated.

  Args:
    cache: uint8 ``[num_rows, row_bytes]`` backing array (updated in place).
    entries: uint8 ``[num_tokens, entry_bytes]`` (``encode_entries``).
    slots: int32 ``[num_tokens]``, -1 for tokens that write nothing. Slots must be distinct.
    view: the layer's ``KernelView`` (rows, base row, page offset, entries per row).
    implementation: ``"pallas"`` or ``"xla"`` (the reference).
  """
  check_implementation(implementation)
  _validate(cache, entries, slots, view)
  if implementation == "xla":
    return write_to_paged_cache_reference(cache, entries, slots, view=view)
  rows = cache.reshape(-1, view.row_bytes)
  check_byte_addressable(rows, f"the cache array of {view.layer_name}", default_interpret(interpret))
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  return pl.pallas_call(
    functools.partial(_cache_write_kernel, view=view),
    out_shape=jax.ShapeDtypeStruct(rows.shape, rows.dtype),
    grid=(entries.shape[0],),
    in_specs=[any_spec, any_spec, any_spec],
    out_specs=any_spec,
    input_output_aliases={2: 0},
    interpret=default_interpret(interpret),
    name="cache_write",
  )(slots, entries, rows).reshape(cache.shape)


def write_to_paged_cache_reference(cache, entries, slots, *, view: KernelView):
  """Plain jnp: one scatter of the entry bytes; -1 slots go out of range and are dropped."""
  rows = cache.reshape(-1, view.row_bytes)
  e = entries.shape[1]
  valid = slots >= 0
  # A -1 index would wrap to the last row: send it past the end instead.
  row = jnp.where(valid, view.base_row + slots // view.tokens_per_row, rows.shape[0])
  cols = view.offset_bytes + (slots % view.tokens_per_row)[:, None] * e + jnp.arange(e)
  return rows.at[row[:, None], cols].set(entries, mode="drop").reshape(cache.shape)
