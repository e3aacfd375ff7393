"""Sparse MLA decode: attention over the latent cache rows of selected tokens (absorbed form).

For query token ``t`` (of request ``req_indices[t]``) and each selected token index ``i`` of
``token_indices[t]`` (-1: none), the latent row ``c_i`` (``L`` = ``kv_lora_rank`` wide) is both
key and value:

    out[t, h] = sum_i softmax_i(sm_scale * q[t, h] . c_i) * c_i

Token ``i`` of request ``r`` is manager slot ``table[r, i // bs] * bs + i % bs`` of the latent
layer, at the same bytes ``write_to_paged_cache`` wrote it: row ``slot // tokens_per_row``, byte
``page_offset + (slot % tokens_per_row) * entry_bytes`` of the backing array (dense layer array or
packed arena), read in place through free typed bitcasts. Latent entries are bf16/f32 values or
fp8 e4m3 with one fp32 scale per 128 values (one per entry below 128, as ``encode_entries`` writes
them). Several queries per request (speculative verification) are several rows ``t`` with their
own indices.
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
from jaxkv.step.slot_mapping import block_slots
from jaxkv.utils import cdiv
from pallas_kernels._common import (
  FP8_DTYPE,
  FP8_GROUP,
  MIN_DOT_ROWS,
  check_byte_addressable,
  check_implementation,
  default_interpret,
  device_multiprocessors,
  device_shared_memory_bytes,
  without_ref,
)
from pallas_kernels.cache_write import decode_entries, entry_bytes

__all__ = [
  "sparse_mla_decode",
  "sparse_mla_decode_reference",
  "sparse_mla_decode_tiles",
  "sparse_mla_num_splits",
  "sparse_mla_shared_memory",
]

# Tiles tried largest first: (block_h, block_k). The token tile shrinks first: every head tile
# reads the selected rows again, so a smaller head tile costs bandwidth, a smaller token tile not.
_TILES = ((64, 64), (64, 32), (64, 16), (32, 16), (16, 16))


def _token_rows(block_table, req, tok, *, view: KernelView, entry_bytes_: int):
  """View row and byte column of each token's latent entry (the writer's slot, ``block_slots``)."""
  slot, _ = block_slots(block_table, req, tok, block_size=view.block_size)
  return view.base_row + slot // view.tokens_per_row, view.offset_bytes + (slot % view.tokens_per_row) * entry_bytes_


def _sparse_mla_kernel(
  q_ref,
  rows_ref,
  cols_ref,
  count_ref,
  values_ref,
  scales_ref,
  acc_ref,
  m_ref,
  l_ref,
  *,
  latent_dim,
  block_k,
  sm_scale,
  cache_dtype,
  col_align,
  latent_block,
):
  # q_ref: [T, Hp, L]; rows_ref / cols_ref: [T, Kp] latent row (-1: none) and element column, the
  # selected rows of each query first; count_ref: [T] selected rows per query;
  # values_ref: [rows, row_elems]; scales_ref: [rows, row_words] f32 (fp8) or None;
  # acc_ref: [T, S, Hp, L], m_ref / l_ref: [T, S, Hp] partial softmax state of split S.
  t = pl.program_id(0)
  hb = pl.program_id(1)
  split = pl.program_id(2)
  bh = q_ref.shape[1] // pl.num_programs(1)
  l = latent_dim
  dot_dtype = jnp.float32 if cache_dtype == "float32" else jnp.bfloat16
  precision = jax.lax.Precision.HIGHEST if dot_dtype == jnp.float32 else None
  bl = latent_block
  sl = range(l // bl)
  group = min(l, FP8_GROUP)  # fp8: values per scale
  qs = [q_ref[t, pl.ds(hb * bh, bh), j * bl : (j + 1) * bl].astype(dot_dtype) for j in sl]  # [BH, BL] each

  def body(i, carry):
    m, s_sum, *acc = carry
    start = (first + i) * block_k
    row = rows_ref[t, pl.ds(start, block_k)]  # [BK]
    # Every entry starts col_align elements into its row (the view's static offsets): the hint lets
    # Triton load each row in 16-byte vectors instead of element by element.
    col = pl.multiple_of(cols_ref[t, pl.ds(start, block_k)], col_align)
    valid = row >= 0
    row = jnp.maximum(row, 0)
    # Masked loads skip the unselected rows' bytes (the null block's may decode to NaN, and 0 * NaN
    # would poison p @ c); bf16/f32 ones read zeros there and feed the dots directly.
    # The latent in column slices of bl (latent_block; whole rows by default): fewer addresses live
    # at once, the two products summed over the slices.
    cs = []
    for j in sl:
      cols = col[:, None] + jnp.arange(j * bl, (j + 1) * bl)[None, :]
      if scales_ref is None:
        c = pltriton.load(values_ref.at[row[:, None], cols], mask=valid[:, None], other=0).astype(dot_dtype)  # [BK, BL]
      else:  # fp8 (Triton has no fp8 fill value): one fp32 scale per group of values, right after the values
        # An e4m3 value times its power-of-two scale is exact in bf16 (the dot's dtype): dequantized
        # there directly, the same bits as through float32 without a float32 tile.
        c = pltriton.load(values_ref.at[row[:, None], cols], mask=valid[:, None]).astype(dot_dtype)
        ng = max(bl // group, 1)
        sc = pltriton.load(
          scales_ref.at[
            row[:, None], ((col + l) // 4)[:, None] + jnp.arange(j * bl // group, j * bl // group + ng)[None, :]
          ],
          mask=valid[:, None],
        ).astype(dot_dtype)  # [BK, NG]
        c = (c.reshape(block_k, ng, bl // ng) * sc[:, :, None]).reshape(block_k, bl)
        c = jnp.where(valid[:, None], c, 0.0)
      cs.append(c)
    s = functools.reduce(
      operator.add, [jnp.dot(qj, c.T, precision=precision, preferred_element_type=jnp.float32) for qj, c in zip(qs, cs)]
    )
    s = s * sm_scale  # [BH, BK]
    s = jnp.where(valid[None, :], s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    # Rows that have seen no valid token keep m = -inf: use 0 there so exp() stays finite.
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m - m_safe)
    p = jnp.exp(s - m_safe[:, None])
    s_sum = s_sum * alpha + jnp.sum(p, axis=1)
    acc = [
      a * alpha[:, None] + jnp.dot(p.astype(dot_dtype), c, precision=precision, preferred_element_type=jnp.float32)
      for a, c in zip(acc, cs)
    ]
    return m_new, s_sum, *acc

  # The selected rows come first, so the tiles holding any are a prefix: each split takes an even
  # share of them (not a fixed run of the K columns, which short contexts leave empty past the
  # first splits) and loops over exactly those, without a branch in its body (which would keep
  # Triton from pipelining it). A query's share depends only on its own count and the split count.
  n = (count_ref[t] + block_k - 1) // block_k
  per = (n + pl.num_programs(2) - 1) // pl.num_programs(2)
  first = split * per
  tiles = jnp.clip(n - first, 0, per)
  init = (
    jnp.full((bh,), -jnp.inf, jnp.float32),
    jnp.zeros((bh,), jnp.float32),
    *[jnp.zeros((bh, bl), jnp.float32) for _ in sl],
  )
  m, s_sum, *acc = jax.lax.fori_loop(0, tiles, body, init)
  for j, a in zip(sl, acc):
    acc_ref[t, split, pl.ds(hb * bh, bh), j * bl : (j + 1) * bl] = a
  m_ref[t, split, pl.ds(hb * bh, bh)] = m
  l_ref[t, split, pl.ds(hb * bh, bh)] = s_sum


def _combine_splits(acc, m, s_sum):
  """Merges the splits' softmax states: ``[T, S, H, L], [T, S, H], [T, S, H] -> [T, H, L]``."""
  m_max = jnp.max(m, axis=1, keepdims=True)
  w = jnp.exp(m - jnp.where(m_max == -jnp.inf, 0.0, m_max))  # exp(-inf) = 0 for empty splits
  denom = jnp.sum(w * s_sum, axis=1)
  return jnp.sum(w[..., None] * acc, axis=1) / jnp.where(denom == 0, 1.0, denom)[..., None]


def sparse_mla_shared_memory(block_h: int, block_k: int, latent_dim: int, cache_dtype: str) -> int:
  """Shared memory (bytes) one program asks for: both dot operands, the queries ``[BH, L]`` and
  the selected rows ``[BK, L]`` in the dot dtype (float32 for float32 latents, else bf16), the
  probabilities ``[BH, BK]`` in float32, and 1 KiB of Triton's own. On the H200, float32 latents
  of 512 at 64 x 64 asked for exactly this (279,552 bytes, over its 232,448)."""
  item = 4 if cache_dtype == "float32" else 2
  return (block_h + block_k) * latent_dim * item + block_h * block_k * 4 + 1024


def sparse_mla_decode_tiles(
  heads: int, latent_dim: int, cache_dtype: str, shared_memory_bytes: int | None
) -> tuple[int, int]:
  """``(block_h, block_k)`` for ``heads`` query heads: the largest of ``_TILES`` whose shared
  memory fits ``shared_memory_bytes`` (None: no limit, interpret mode).

  Raises:
    ValueError: when not even 16 x 16 tiles fit (the kernel cannot run on this device: use the
      XLA path).
  """
  hp = max(MIN_DOT_ROWS, pl.next_power_of_2(heads))
  for block_h, block_k in _TILES:
    block_h = min(block_h, hp)
    need = sparse_mla_shared_memory(block_h, block_k, latent_dim, cache_dtype)
    if shared_memory_bytes is None or need <= shared_memory_bytes:
      return block_h, block_k
  raise ValueError(
    f"sparse_mla_decode: {cache_dtype} latents of {latent_dim} need {need:,} bytes of shared memory "
    f"at the smallest tiles (16 x 16), more than the {shared_memory_bytes:,} this device gives one "
    "program; run it with implementation='xla' (--implementation xla) or a narrower "
    "--kv-cache-dtype."
  )


def sparse_mla_num_splits(
  programs: int, num_blocks: int, tile_bytes: int, partial_bytes: int, multiprocessors: int | None
) -> int:
  """Splits of each query's ``num_blocks`` token tiles over programs (flash-decoding).

  Args:
    programs: programs per split (queries x head tiles).
    num_blocks: token tiles of a query.
    tile_bytes: bytes one program reads per tile (``block_k`` entries).
    partial_bytes: bytes of one program's partial result (``[BH, L]`` plus two ``[BH]``, float32),
      written by the kernel and read back by the combine.
    multiprocessors: the GPU's SMs (None, interpret mode: an H100/H200's 132).

  When a program per tile fits in two programs per SM (up to 8 queries over 33 tiles on 132 SMs),
  every tile is its own split. A query's result then does not depend on how many queries share
  its step, so a batch verifying drafts (1 + k queries a request) computes each query as the same
  batch decoding does: the bitwise equality with and without speculation at any context.

  Above that, a 64 x 64 tile takes most of an SM's shared memory, so one program runs per SM and a
  split costs (waves of programs) x (tiles per program) x ``tile_bytes`` on each SM, plus its share
  of the partial results' traffic. Splits stay at most what gives two programs per SM (more only
  adds partials); the cheapest count wins, the fewest on ties. 64 queries over 32 tiles run as 2
  splits (one wave of 16 tiles), not the 5 that filling two programs per SM gave (three waves of 7).
  """
  slots = multiprocessors or 132
  if programs * num_blocks <= 2 * slots:
    return num_blocks

  def cost(s):
    return cdiv(programs * s, slots) * cdiv(num_blocks, s) * tile_bytes + 2 * programs * s * partial_bytes / slots

  return min(range(1, min(num_blocks, cdiv(2 * slots, programs)) + 1), key=lambda s: (cost(s), s))


def _validate(q, cache, token_indices, req_indices, block_table, *, view: KernelView) -> str:
  """Checks the arguments; returns the view's entry encoding."""
  cache_dtype = view.require_cache_dtype("sparse_mla_decode", CACHE_DTYPES)
  block_size, tokens_per_row, page_offset_bytes = view.block_size, view.tokens_per_row, view.offset_bytes
  if q.ndim != 3:
    raise ValueError(f"q must be [num_tokens, heads, latent_dim], got {list(q.shape)}.")
  t, _, l = q.shape
  if token_indices.ndim != 2 or token_indices.shape[0] != t or token_indices.dtype != jnp.int32:
    raise ValueError(f"token_indices must be int32[{t}, K], got {token_indices.dtype}{list(token_indices.shape)}.")
  if req_indices.shape != (t,) or req_indices.dtype != jnp.int32:
    raise ValueError(f"req_indices must be int32[{t}], got {req_indices.dtype}{list(req_indices.shape)}.")
  if block_table.ndim != 2 or block_table.dtype != jnp.int32:
    raise ValueError(f"block_table must be int32[rows, width], got {block_table.dtype}{list(block_table.shape)}.")
  if cache_dtype == "fp8" and l > FP8_GROUP and l % FP8_GROUP:
    raise ValueError(
      f"fp8 latent caches need a latent dim below {FP8_GROUP} (one scale) or a multiple of "
      f"{FP8_GROUP} (one scale per {FP8_GROUP} values), got {l}."
    )
  e = entry_bytes(l, cache_dtype)
  align = 4 if cache_dtype == "fp8" else jnp.dtype(cache_dtype).itemsize
  if (
    cache.ndim != 2
    or cache.dtype != jnp.uint8
    or view.row_bytes % align
    or page_offset_bytes % align
    or cache.size % view.row_bytes
  ):
    raise ValueError(
      f"cache must be uint8[num_rows, row_bytes] with rows and page offset ({page_offset_bytes}) "
      f"multiples of {align} bytes, got {cache.dtype}{list(cache.shape)}."
    )
  if page_offset_bytes + tokens_per_row * e > view.row_bytes or block_size % tokens_per_row:
    raise ValueError(
      f"{tokens_per_row} latent entries of {e} bytes at offset {page_offset_bytes} do not fit rows of "
      f"{view.row_bytes} bytes, or do not divide the block size {block_size}."
    )
  return cache_dtype


@functools.partial(
  jax.jit,
  static_argnames=(
    "view",
    "sm_scale",
    "block_k",
    "block_h",
    "num_splits",
    "num_warps",
    "num_stages",
    "latent_block",
    "implementation",
    "interpret",
  ),
)
def sparse_mla_decode(
  q: Float[Array, "T H L"],
  cache: UInt8[Array, "N R"],
  token_indices: Int[Array, "T K"],
  req_indices: Int[Array, " T"],
  block_table: Int[Array, "Rq W"],
  *,
  view: KernelView,
  sm_scale: float,
  block_k: int | None = None,
  block_h: int | None = None,
  num_splits: int | None = None,
  num_warps: int | None = 8,
  num_stages: int | None = None,
  latent_block: int | None = None,
  implementation: str = "pallas",
  interpret: bool | None = None,
) -> Float[Array, "T H L"]:
  """Absorbed-MLA attention of each query token over its selected latent rows (float32 out).

  Args:
    q: ``[num_tokens, heads, L]`` absorbed queries (``q_nope @ W_UK``).
    cache: uint8 ``[num_rows, row_bytes]`` backing array of the latent layer.
    token_indices: int32 ``[num_tokens, K]`` selected token positions, -1 for none.
    req_indices: int32 ``[num_tokens]`` block-table row of each query, -1 for padding queries.
    block_table: int32 ``[rows, width]`` the latent group's manager block table.
    view: the latent layer's ``KernelView`` (manager block size, entries per row, page offset,
      entry encoding: ``"bfloat16"``, ``"float32"`` or ``"fp8"``).
    sm_scale: softmax scale.
    block_k, block_h: tiles of selected tokens and heads (None: ``sparse_mla_decode_tiles`` for the
      entry size and the device's shared memory; 64 x 64 for bf16 and fp8 latents).
    num_splits, num_warps, num_stages: splits of the selected tokens over programs
      (flash-decoding; None: ``sparse_mla_num_splits``), and Triton's launch knobs (tuning;
      ``benchmarks/kernels.py`` sweeps them).
    latent_block: columns of the latent each load and product takes (a power of two >= 16
      dividing ``L``; None: ``L``, whole rows). Narrower slices hold fewer addresses live at once
      (tuning: fewer spills when built for sm_90, docs/kernels.md).
  """
  check_implementation(implementation)
  cache_dtype = _validate(q, cache, token_indices, req_indices, block_table, view=view)
  kw = dict(view=view, sm_scale=sm_scale)
  if implementation == "xla":
    return sparse_mla_decode_reference(q, cache, token_indices, req_indices, block_table, **kw)
  t, h, l = q.shape
  if latent_block is not None and (
    latent_block < MIN_DOT_ROWS or l % latent_block or latent_block & (latent_block - 1)
  ):
    raise ValueError(
      f"latent_block must be a power of two >= {MIN_DOT_ROWS} dividing the latent dim {l}, got {latent_block}."
    )
  interpret = default_interpret(interpret)
  if block_h is None or block_k is None:
    smem = None if interpret else device_shared_memory_bytes()
    tile_h, tile_k = sparse_mla_decode_tiles(h, l, cache_dtype, smem)
    block_h, block_k = block_h or tile_h, block_k or tile_k
  hp = max(MIN_DOT_ROWS, pl.next_power_of_2(h))
  bh = min(block_h, hp)
  if hp != h:
    q = jnp.pad(q, ((0, 0), (0, hp - h), (0, 0)))
  # Token -> (row, column) in XLA: a small [T, K] integer pass that takes the block-table lookup
  # off the kernel's chain of dependent loads.
  e = entry_bytes(l, cache_dtype)
  valid = (token_indices >= 0) & (req_indices[:, None] >= 0)
  rows, cols = _token_rows(
    block_table, jnp.maximum(req_indices, 0)[:, None], jnp.maximum(token_indices, 0), view=view, entry_bytes_=e
  )
  elem = 1 if cache_dtype == "fp8" else jnp.dtype(cache_dtype).itemsize
  cols = cols // elem
  k = token_indices.shape[1]
  num_blocks = cdiv(k, block_k)
  if num_splits is None:
    num_splits = sparse_mla_num_splits(
      t * (hp // bh), num_blocks, block_k * e, bh * (l + 2) * 4, None if interpret else device_multiprocessors()
    )
  kp = num_blocks * block_k  # the splits share each query's tiles at run time: no padding per split
  # Each query's selected rows first, in their order (a stable partition by one scatter): the
  # kernel loops over the tiles that hold any and no further.
  count = jnp.sum(valid, axis=1, dtype=jnp.int32)
  # Unselected columns go to distinct places past the end (dropped): every index is unique.
  dest = jnp.where(valid, jnp.cumsum(valid, axis=1, dtype=jnp.int32) - 1, kp + jnp.arange(k, dtype=jnp.int32))
  at = (jnp.arange(t)[:, None], dest)
  rows = jnp.full((t, kp), -1, jnp.int32).at[at].set(rows, mode="drop", unique_indices=True)
  cols = jnp.zeros((t, kp), jnp.int32).at[at].set(cols, mode="drop", unique_indices=True)
  cache = cache.reshape(-1, view.row_bytes)
  n = cache.shape[0]
  if cache_dtype == "fp8":
    check_byte_addressable(cache, f"the latent cache array of {view.layer_name}", interpret)
    values = jax.lax.bitcast_convert_type(cache, FP8_DTYPE)
    scales = jax.lax.bitcast_convert_type(cache.reshape(n, -1, 4), jnp.float32)
  else:
    values = jax.lax.bitcast_convert_type(cache.reshape(n, -1, elem), jnp.dtype(cache_dtype))
    scales = None
  kernel = functools.partial(
    _sparse_mla_kernel,
    latent_dim=l,
    block_k=block_k,
    sm_scale=sm_scale,
    cache_dtype=cache_dtype,
    col_align=math.gcd(view.offset_bytes, e) // elem,
    latent_block=latent_block or l,
  )
  operands = [q, rows, cols, count, values]
  if scales is None:
    kernel = without_ref(kernel, 5)
  else:
    operands.append(scales)
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  acc, m, s_sum = pl.pallas_call(
    kernel,
    out_shape=(
      jax.ShapeDtypeStruct((t, num_splits, hp, l), jnp.float32),
      jax.ShapeDtypeStruct((t, num_splits, hp), jnp.float32),
      jax.ShapeDtypeStruct((t, num_splits, hp), jnp.float32),
    ),
    grid=(t, hp // bh, num_splits),
    in_specs=[any_spec] * len(operands),
    out_specs=(any_spec, any_spec, any_spec),
    interpret=interpret,
    compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
    name="sparse_mla_decode",
  )(*operands)
  return _combine_splits(acc, m, s_sum)[:, :h]


def sparse_mla_decode_reference(
  q, cache, token_indices, req_indices, block_table, *, view: KernelView, sm_scale: float
):
  """Plain jnp: gather the selected latent rows, masked softmax, weighted sum (float32)."""
  cache_dtype = view.require_cache_dtype("sparse_mla_decode_reference", CACHE_DTYPES)
  cache = cache.reshape(-1, view.row_bytes)
  t, h, l = q.shape
  e = entry_bytes(l, cache_dtype)
  valid = (token_indices >= 0) & (req_indices[:, None] >= 0)
  row, col = _token_rows(
    block_table, jnp.maximum(req_indices, 0)[:, None], jnp.maximum(token_indices, 0), view=view, entry_bytes_=e
  )
  raw = cache[row[..., None], col[..., None] + jnp.arange(e)]  # [T, K, E]
  c = decode_entries(raw.reshape(-1, e), cache_dtype, l).astype(jnp.float32).reshape(t, -1, l)
  s = jnp.einsum("thl,tkl->thk", q.astype(jnp.float32), c, precision=jax.lax.Precision.HIGHEST) * sm_scale
  s = jnp.where(valid[:, None, :], s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.exp(s - jnp.where(m == -jnp.inf, 0.0, m))
  denom = jnp.sum(p, axis=-1, keepdims=True)
  return jnp.einsum("thk,tkl->thl", p, c, precision=jax.lax.Precision.HIGHEST) / jnp.where(denom == 0, 1.0, denom)
