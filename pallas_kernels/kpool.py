"""kpool compression: pooled indexer keys written into paged caches, through the kpool tail ring.

GLM-5.3-Flash's indexer scores *pools* of ``kpool`` tokens. The raw key and gate of each token of
the unfinished pool live in the request's tail ring (a ``CircularBufferSpec`` block of ``ring``
slots, slot ``table[r, 0] * ring + pos % ring``). When a token completes a pool
(``pos % kpool == kpool - 1``) the pool's tokens are combined per channel,

    w[i, d] = softmax_i(gate[i, d] + ape[i, d]),   k_pool[d] = sum_i w[i, d] * key[i, d],

rounded to the model dtype, and written as one entry of the compressed cache page that the
kernel-block table addresses (slot from ``compute_compressed_slot_mapping``: page ``slot // P``,
entry ``slot % P`` of the re-strided kernel view).

Page layout (P entries of D channels): fp8 ``[P x D e4m3 | P x fp32 power-of-two scale]``
(132-byte entries for D = 128, as vLLM/DeepGEMM lay them out), or ``[P x D]`` bf16/f32 values
for exact runs.

A step's tokens of one request are contiguous and in position order, so a pool's earlier tokens
come from the batch when they are in it and from the ring otherwise; a chunk may start and end
mid-pool and complete many pools. After compression, each request's last ``ring`` tokens of the
step are stashed into the ring (keys in head slot 0, gates in head slot 1).
"""

from __future__ import annotations

import functools
import math
import operator

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float, Int, UInt8

from jaxkv.cache.cache_dtype import CACHE_DTYPES
from jaxkv.cache.kernel_view import KernelView
from pallas_kernels._common import (
  FP8_DTYPE,
  check_byte_addressable,
  check_implementation,
  default_interpret,
  quantize_fp8_pow2,
  round_to_model_dtype,
  value_bytes,
  without_ref,
)
from pallas_kernels.cache_write import encode_entries, entry_bytes, write_to_paged_cache

__all__ = [
  "kpool_compress_and_write",
  "kpool_compress_and_write_reference",
  "combine_pool",
  "indexer_page_bytes",
  "read_indexer_entries",
]


def indexer_page_bytes(states_per_page: int, head_dim: int, cache_dtype: str) -> int:
  """A page of P pooled entries: the values of all P, then (fp8) their P scales; ``P * entry_bytes``."""
  return states_per_page * entry_bytes(head_dim, cache_dtype)


def combine_pool(keys: Float[Array, "... K D"], gates: Float[Array, "... K D"], ape: Float[Array, "K D"]):
  """Per-channel softmax over the pool's tokens of ``gate + ape`` weighting the keys (float32)."""
  k = keys.shape[-2]
  return _combine_tokens(
    [keys[..., i, :] for i in range(k)], [gates[..., i, :] for i in range(k)], [ape[i] for i in range(k)]
  )


def _combine_tokens(keys, gates, apes):
  """``combine_pool`` over lists of the pool's K tokens' ``[..., D]`` rows, one token after the other:
  elementwise operations only, the same in XLA and in the Triton kernel (which cannot stack rows)."""
  s = [g.astype(jnp.float32) + a.astype(jnp.float32) for g, a in zip(gates, apes)]
  m = functools.reduce(jnp.maximum, s)
  w = [jnp.exp(x - m) for x in s]
  total = functools.reduce(operator.add, w)
  return functools.reduce(operator.add, [(wi / total) * k.astype(jnp.float32) for wi, k in zip(w, keys)])


def _encode_pooled(x: Float[Array, "... D"], model_dtype, cache_dtype: str):
  """Pooled key rounded to the model dtype, then as cache bytes: (values, 4 scale bytes or None)."""
  x = round_to_model_dtype(x, model_dtype)
  if cache_dtype != "fp8":
    return value_bytes(x.astype(cache_dtype)), None
  q, scale = quantize_fp8_pow2(x)
  return value_bytes(q), value_bytes(scale)


def _kpool_kernel(
  slots_ref,
  pos_ref,
  req_ref,
  tail_slots_ref,
  keys_ref,
  gates_ref,
  ape_ref,
  ring_ref,
  cache_in_ref,
  cache_ref,
  *,
  view: KernelView,
  kpool,
  ring,
  ring_rows_per_block,
  tail_offset_bytes,
):
  # slots_ref / pos_ref / req_ref / tail_slots_ref: [T]; keys_ref / gates_ref: [T, D]; ape_ref: [K, D];
  # ring_ref: uint8 [rows, W] holding the tail ring (tail block b is rows b * ring_rows_per_block...),
  # or None when the ring lives in the cache itself (read through cache_ref, which aliases
  # cache_in_ref: the pages written and the ring bytes read are disjoint);
  # cache_ref: [num_rows, page_bytes] kernel pages.
  del cache_in_ref
  ring_ref = cache_ref if ring_ref is None else ring_ref
  t = pl.program_id(0)
  slot = slots_ref[t]
  d = keys_ref.shape[1]
  dtype = keys_ref.dtype
  itemsize = jnp.dtype(dtype).itemsize
  width = ring_ref.shape[1]

  def ring_entry(head, p, needed):
    # The ring's float32 values of position p, head 0 (keys) or 1 (gates): gathered byte by byte
    # (uint8 rows, any alignment) and put together little-endian into 32-bit words; a bf16 is
    # the top half of its float32. Loaded only where ``needed`` (the token is not in the batch).
    mask = jnp.broadcast_to(needed, (d,))
    start = tail_offset_bytes + (head * ring + p % ring) * d * itemsize + itemsize * jnp.arange(d)
    row0 = (jnp.maximum(tail_slots_ref[t], 0) // ring) * ring_rows_per_block
    word = jnp.zeros((d,), jnp.uint32)
    for byte in range(itemsize):
      at = start + byte
      raw = pltriton.load(ring_ref.at[row0 + at // width, at % width], mask=mask, other=0)
      word = word | (raw.astype(jnp.uint32) << (8 * (byte + 4 - itemsize)))
    return jax.lax.bitcast_convert_type(word, jnp.float32)

  @pl.when(slot >= 0)
  def _():
    # The pool's earlier tokens: from the batch where the step holds them (a request's tokens are
    # contiguous and in order), else from the ring, read before this step's stash overwrites it.
    pos, req = pos_ref[t], req_ref[t]
    ks, gs = [], []
    for j in range(kpool - 1, -1, -1):
      src = jnp.maximum(t - j, 0)
      in_batch = (t >= j) & (req_ref[src] == req) & (pos_ref[src] == pos - j)
      ks.append(jnp.where(in_batch, keys_ref[src].astype(jnp.float32), ring_entry(0, pos - j, ~in_batch)))
      gs.append(jnp.where(in_batch, gates_ref[src].astype(jnp.float32), ring_entry(1, pos - j, ~in_batch)))
    pooled = _combine_tokens(ks, gs, [ape_ref[i] for i in range(kpool)])
    values, scale = _encode_pooled(pooled, dtype, view.cache_dtype)
    p = view.entries_per_page
    row = view.base_row + slot // p
    entry = slot % p
    value_width = values.shape[-1]
    cache_ref[row, pl.ds(view.offset_bytes + entry * value_width, value_width)] = values
    if scale is not None:
      cache_ref[row, pl.ds(view.offset_bytes + p * value_width + entry * 4, 4)] = scale


def _pool_sources(tail, keys, gates, positions, req_indices, tail_slots, *, kpool, ring, tail_page_offset_bytes):
  """Keys and gates ``[T, kpool, D]`` of the pool ending at each token (batch first, then ring)."""
  t, d = keys.shape
  e = d * keys.dtype.itemsize
  # Ring entries are gathered as whole rows of ``unit`` bytes (not byte by byte): the tail viewed
  # as ``[-1, unit]`` rows, unit the largest size dividing the entry, the row and the page offset.
  unit = math.gcd(e, tail.shape[1], tail_page_offset_bytes)
  units = tail.reshape(-1, unit)
  per_row, per_entry = tail.shape[1] // unit, e // unit
  block = jnp.maximum(tail_slots, 0) // ring
  base = block * per_row + tail_page_offset_bytes // unit

  def ring_entries(head, p):
    first = base + (head * ring + p % ring) * per_entry
    rows = units[first[:, None] + jnp.arange(per_entry)]  # [T, per_entry, unit]
    return jax.lax.bitcast_convert_type(rows.reshape(t, d, -1), keys.dtype)

  srcs_k, srcs_g = [], []
  for j in range(kpool - 1, -1, -1):  # token pos - j
    p = positions - j
    idx = jnp.maximum(jnp.arange(t) - j, 0)
    in_batch = (jnp.arange(t) >= j) & (req_indices[idx] == req_indices) & (positions[idx] == p)
    srcs_k.append(jnp.where(in_batch[:, None], keys[idx], ring_entries(0, p)))
    srcs_g.append(jnp.where(in_batch[:, None], gates[idx], ring_entries(1, p)))
  return jnp.stack(srcs_k, axis=1), jnp.stack(srcs_g, axis=1)


def _stash_slots(positions, req_indices, tail_slots, ring):
  """Tail slots of each request's last ``ring`` tokens of the step; -1 for the others."""
  t = positions.shape[0]
  later = jnp.minimum(jnp.arange(t) + ring, t - 1)
  overwritten = (
    (jnp.arange(t) + ring < t) & (req_indices[later] == req_indices) & (positions[later] == positions + ring)
  )
  return jnp.where(overwritten, -1, tail_slots)


def _validate(
  cache,
  tail,
  keys,
  gates,
  ape,
  positions,
  req_indices,
  tail_slots,
  compressed_slots,
  *,
  kpool,
  view: KernelView,
  tail_view: KernelView,
) -> None:
  cache_dtype = view.require_cache_dtype("kpool_compress_and_write", CACHE_DTYPES)
  ring, states_per_page, base_row = tail_view.block_size, view.entries_per_page, view.base_row
  page_offset_bytes, tail_page_offset_bytes = view.offset_bytes, tail_view.offset_bytes
  t, d = keys.shape if keys.ndim == 2 else (None, None)
  if keys.ndim != 2 or gates.shape != keys.shape or gates.dtype != keys.dtype:
    raise ValueError(
      f"keys and gates must be [num_tokens, D] of one dtype, got {keys.dtype}{list(keys.shape)} "
      f"and {gates.dtype}{list(gates.shape)}."
    )
  if keys.dtype not in (jnp.bfloat16, jnp.float32):
    raise ValueError(f"keys and gates must be bfloat16 or float32 (the model dtypes), got {keys.dtype}.")
  if ape.shape != (kpool, d):
    raise ValueError(f"ape must be [{kpool}, {d}], got {list(ape.shape)}.")
  for name, a in (
    ("positions", positions),
    ("req_indices", req_indices),
    ("tail_slots", tail_slots),
    ("compressed_slots", compressed_slots),
  ):
    if a.shape != (t,) or a.dtype != jnp.int32:
      raise ValueError(f"{name} must be int32[{t}], got {a.dtype}{list(a.shape)}.")
  page = indexer_page_bytes(states_per_page, d, cache_dtype)
  if cache.ndim != 2 or cache.dtype != jnp.uint8 or page_offset_bytes + page > cache.shape[1]:
    raise ValueError(
      f"cache rows must hold a {page}-byte page ({states_per_page} entries of {d} channels, "
      f"{cache_dtype}) at byte {page_offset_bytes}, got {cache.dtype}{list(cache.shape)}."
    )
  if not 0 <= base_row < cache.shape[0]:
    raise ValueError(f"base_row {base_row} is outside the cache's {cache.shape[0]} pages.")
  if ring < kpool or ring % kpool:
    raise ValueError(f"the tail ring of {ring} slots must be a multiple of kpool {kpool}.")
  end = tail_page_offset_bytes + 2 * ring * d * keys.dtype.itemsize
  if tail.ndim != 2 or tail.dtype != jnp.uint8 or end > tail.shape[1]:
    raise ValueError(
      f"tail must be uint8[num_blocks, row_bytes] holding a [2, {ring}, {d}] {keys.dtype} page at "
      f"byte {tail_page_offset_bytes}, got {tail.dtype}{list(tail.shape)}."
    )


@functools.partial(
  jax.jit,
  static_argnames=("view", "tail_view", "kpool", "implementation", "interpret"),
  donate_argnames=("cache", "tail"),
)
def kpool_compress_and_write(
  cache: UInt8[Array, "N R"],
  tail: UInt8[Array, "Nt Rt"] | None,
  keys: Float[Array, "T D"],
  gates: Float[Array, "T D"],
  ape: Float[Array, "K D"],
  positions: Int[Array, " T"],
  req_indices: Int[Array, " T"],
  tail_slots: Int[Array, " T"],
  compressed_slots: Int[Array, " T"],
  *,
  view: KernelView,
  tail_view: KernelView,
  kpool: int,
  implementation: str = "pallas",
  interpret: bool | None = None,
):
  """Compresses completed pools into the indexer cache and stashes the step's tail tokens.

  Args:
    cache: uint8 backing array of the indexer (the packed arena, or a dense layer array of kernel
      pages), seen through ``view``: kernel block ``k`` is view row ``base_row + k`` at byte
      ``offset_bytes``, ``entries_per_page`` entries per page. Donated.
    tail: uint8 ``[num_blocks, row_bytes]`` holding the tail ring pages, or None when the ring
      lives in ``cache`` itself (packed layout: one arena). Donated.
    keys, gates: ``[num_tokens, D]`` raw indexer key (after its LayerNorm) and gate, model dtype.
    ape: float32 ``[kpool, D]`` position bias of the pool's tokens.
    positions, req_indices: int32 ``[num_tokens]``; a request's tokens contiguous, in order.
    tail_slots: int32 ``[num_tokens]`` from ``compute_circular_slot_mapping`` (-1: padding).
    compressed_slots: int32 ``[num_tokens]`` from ``compute_compressed_slot_mapping``.
    view, tail_view: the indexer's and the tail ring's ``KernelView`` (the indexer's entry
      encoding: ``"fp8"`` with scales, ``"bfloat16"`` or ``"float32"``; the ring's block size is
      its capacity).
    kpool: pool size.

  Returns:
    ``(cache, tail)`` updated (``tail`` is None when it lives in ``cache``).
  """
  check_implementation(implementation)
  shared = tail is None
  tail_rows = cache if shared else tail
  ring = tail_view.block_size
  rb = view.row_bytes
  if cache.ndim != 2 or cache.dtype != jnp.uint8 or cache.shape[1] % rb:
    raise ValueError(
      f"cache must be uint8[num_rows, row_bytes] with rows of whole {rb}-byte view rows of "
      f"{view.layer_name}, got {cache.dtype}{list(cache.shape)}."
    )
  pages = cache.reshape(-1, rb)
  _validate(
    pages,
    tail_rows,
    keys,
    gates,
    ape,
    positions,
    req_indices,
    tail_slots,
    compressed_slots,
    kpool=kpool,
    view=view,
    tail_view=tail_view,
  )
  if implementation == "xla":
    # Read the pools' earlier tokens from the ring before this step overwrites it.
    pool_k, pool_g = _pool_sources(
      tail_rows,
      keys,
      gates,
      positions,
      req_indices,
      tail_slots,
      kpool=kpool,
      ring=ring,
      tail_page_offset_bytes=tail_view.offset_bytes,
    )
    pages = _write_pools_reference(pages, pool_k, pool_g, ape, compressed_slots, view=view)
  else:
    # One program per token (those completing no pool return at once), reading its pool from the
    # batch and the ring in place: no [T, kpool, D] pool copies in XLA.
    kernel = functools.partial(
      _kpool_kernel,
      view=view,
      kpool=kpool,
      ring=ring,
      ring_rows_per_block=tail_rows.shape[1] // (rb if shared else tail_rows.shape[1]),
      tail_offset_bytes=tail_view.offset_bytes,
    )
    check_byte_addressable(pages, f"the indexer cache array of {view.layer_name}", default_interpret(interpret))
    if not shared:
      check_byte_addressable(tail, f"the tail ring array of {tail_view.layer_name}", default_interpret(interpret))
    operands = [compressed_slots, positions, req_indices, tail_slots, keys, gates, ape.astype(jnp.float32)]
    if shared:
      kernel = without_ref(kernel, len(operands))
    else:
      operands.append(tail)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    pages = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct(pages.shape, pages.dtype),
      grid=(keys.shape[0],),
      in_specs=[any_spec] * (len(operands) + 1),
      out_specs=any_spec,
      input_output_aliases={len(operands): 0},
      interpret=default_interpret(interpret),
      name="kpool_compress",
    )(*operands, pages)
  cache = pages.reshape(cache.shape)
  # Stash the raw keys (head slot 0) and gates (head slot 1) of each request's last ring tokens.
  stash = _stash_slots(positions, req_indices, tail_slots, ring)
  tail_rows = cache if shared else tail
  head_bytes = ring * keys.shape[1] * keys.dtype.itemsize
  for head, x in enumerate((keys, gates)):
    tail_rows = write_to_paged_cache(
      tail_rows,
      encode_entries(x, jnp.dtype(keys.dtype).name),
      stash,
      view=tail_view.with_offset(head * head_bytes),
      implementation=implementation,
      interpret=interpret,
    )
  return (tail_rows, None) if shared else (cache, tail_rows)


def _write_pools_reference(cache, pool_k, pool_g, ape, slots, *, view: KernelView):
  base_row, page_offset, states_per_page = view.base_row, view.offset_bytes, view.entries_per_page
  pooled = combine_pool(pool_k, pool_g, ape)
  values, scale = _encode_pooled(pooled, pool_k.dtype, view.cache_dtype)
  valid = slots >= 0
  rows = jnp.where(valid, base_row + slots // states_per_page, cache.shape[0])
  entry = (slots % states_per_page)[:, None]
  width = values.shape[-1]
  cache = cache.at[rows[:, None], page_offset + entry * width + jnp.arange(width)].set(values, mode="drop")
  if scale is not None:
    cache = cache.at[rows[:, None], page_offset + states_per_page * width + entry * 4 + jnp.arange(4)].set(
      scale, mode="drop"
    )
  return cache


def kpool_compress_and_write_reference(
  cache, tail, keys, gates, ape, positions, req_indices, tail_slots, compressed_slots, **kwargs
):
  """Plain jnp (XLA) implementation with the same arguments."""
  return kpool_compress_and_write(
    cache, tail, keys, gates, ape, positions, req_indices, tail_slots, compressed_slots, **kwargs, implementation="xla"
  )


def read_indexer_entries(
  cache: UInt8[Array, "N Rb"], kernel_blocks: Int[Array, "..."], *, view: KernelView, head_dim: int
) -> tuple[jax.Array, jax.Array]:
  """Entries of whole kernel pages ``[..., P, D]`` (float32 values as stored) and their scales ``[..., P]``."""
  cache_dtype = view.require_cache_dtype("read_indexer_entries", CACHE_DTYPES)
  p, d = view.entries_per_page, head_dim
  page = indexer_page_bytes(p, d, cache_dtype)
  rows = cache.reshape(-1, view.row_bytes)[view.base_row + kernel_blocks][
    ..., view.offset_bytes : view.offset_bytes + page
  ]
  if cache_dtype == "fp8":
    values = jax.lax.bitcast_convert_type(rows[..., : p * d], FP8_DTYPE).astype(jnp.float32)
    scales = jax.lax.bitcast_convert_type(rows[..., p * d : p * d + 4 * p].reshape(*rows.shape[:-1], p, 4), jnp.float32)
    return values.reshape(*rows.shape[:-1], p, d), scales
  itemsize = jnp.dtype(cache_dtype).itemsize
  values = jax.lax.bitcast_convert_type(rows.reshape(*rows.shape[:-1], p, d, itemsize), jnp.dtype(cache_dtype))
  return values.astype(jnp.float32), jnp.ones(rows.shape[:-1] + (p,), jnp.float32)
