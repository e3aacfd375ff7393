"""Sparse MLA decode: attention over the latent cache rows of selected tokens (absorbed form).

For query token ``t`` (of request ``req_indices[t]``) and each selected token index ``i`` of
``token_indices[t]`` (-1: none), the latent row ``c_i`` (``L`` = ``kv_lora_rank`` wide) is both
key and value:

    out[t, h] = sum_i softmax_i(sm_scale * q[t, h] . c_i) * c_i

Token ``i`` of request ``r`` is manager slot ``table[r, i // bs] * bs + i % bs`` of the latent
layer, at the same bytes ``write_to_paged_cache`` wrote it: row ``slot // tokens_per_row``, byte
``page_offset + (slot % tokens_per_row) * entry_bytes`` of the backing array (dense layer array or
packed arena), read in place through free typed bitcasts. Latent entries are bf16/f32 values or
fp8 e4m3 with one fp32 scale per 128 values. Several queries per request (speculative
verification) are several rows ``t`` with their own indices.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float, Int, UInt8

from pallas_kernels._common import FP8_DTYPE, FP8_GROUP, MIN_DOT_ROWS, check_implementation, default_interpret
from pallas_kernels.cache_write import decode_entries, entry_bytes

__all__ = ["sparse_mla_decode", "sparse_mla_decode_reference"]


def _token_rows(block_table, req, tok, *, block_size, tokens_per_row, entry_bytes_, page_offset_bytes):
  """Row and byte column of each token's latent entry."""
  width = block_table.shape[1]
  col = jnp.minimum(tok // block_size, width - 1)
  slot = block_table[req, col] * block_size + tok % block_size
  return slot // tokens_per_row, page_offset_bytes + (slot % tokens_per_row) * entry_bytes_


def _sparse_mla_kernel(q_ref, rows_ref, cols_ref, values_ref, scales_ref, acc_ref, m_ref, l_ref, *, latent_dim,
                       block_k, blocks_per_split, sm_scale, cache_dtype):
  # q_ref: [T, Hp, L]; rows_ref / cols_ref: [T, Kp] latent row (-1: none) and element column;
  # values_ref: [rows, row_elems]; scales_ref: [rows, row_words] f32 (fp8) or None;
  # acc_ref: [T, S, Hp, L], m_ref / l_ref: [T, S, Hp] partial softmax state of split S.
  t = pl.program_id(0)
  hb = pl.program_id(1)
  split = pl.program_id(2)
  bh = q_ref.shape[1] // pl.num_programs(1)
  l = latent_dim
  dot_dtype = jnp.float32 if cache_dtype == "float32" else jnp.bfloat16
  precision = jax.lax.Precision.HIGHEST if dot_dtype == jnp.float32 else None
  q = q_ref[t, pl.ds(hb * bh, bh), :].astype(dot_dtype)  # [BH, L]

  def body(i, carry):
    m, s_sum, acc = carry
    start = (split * blocks_per_split + i) * block_k
    row = rows_ref[t, pl.ds(start, block_k)]  # [BK]
    col = cols_ref[t, pl.ds(start, block_k)]
    valid = row >= 0
    row = jnp.maximum(row, 0)
    c = values_ref[row[:, None], col[:, None] + jnp.arange(l)[None, :]].astype(jnp.float32)  # [BK, L]
    if scales_ref is not None:  # fp8: one fp32 scale per 128 values, right after the values
      groups = l // FP8_GROUP
      sc = scales_ref[row[:, None], ((col + l) // 4)[:, None] + jnp.arange(groups)[None, :]]  # [BK, G]
      c = (c.reshape(block_k, groups, FP8_GROUP) * sc[:, :, None]).reshape(block_k, l)
    # Masked rows read the null block, whose bytes may decode to NaN: 0 * NaN would poison p @ c.
    c = jnp.where(valid[:, None], c, 0.0).astype(dot_dtype)
    s = jnp.dot(q, c.T, precision=precision, preferred_element_type=jnp.float32) * sm_scale  # [BH, BK]
    s = jnp.where(valid[None, :], s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    # Rows that have seen no valid token keep m = -inf: use 0 there so exp() stays finite.
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m - m_safe)
    p = jnp.exp(s - m_safe[:, None])
    s_sum = s_sum * alpha + jnp.sum(p, axis=1)
    acc = acc * alpha[:, None] + jnp.dot(p.astype(dot_dtype), c, precision=precision,
                                         preferred_element_type=jnp.float32)
    return m_new, s_sum, acc

  init = (jnp.full((bh,), -jnp.inf, jnp.float32), jnp.zeros((bh,), jnp.float32), jnp.zeros((bh, l), jnp.float32))
  m, s_sum, acc = jax.lax.fori_loop(0, blocks_per_split, body, init)
  acc_ref[t, split, pl.ds(hb * bh, bh), :] = acc
  m_ref[t, split, pl.ds(hb * bh, bh)] = m
  l_ref[t, split, pl.ds(hb * bh, bh)] = s_sum


def _combine_splits(acc, m, s_sum):
  """Merges the splits' softmax states: ``[T, S, H, L], [T, S, H], [T, S, H] -> [T, H, L]``."""
  m_max = jnp.max(m, axis=1, keepdims=True)
  w = jnp.exp(m - jnp.where(m_max == -jnp.inf, 0.0, m_max))  # exp(-inf) = 0 for empty splits
  denom = jnp.sum(w * s_sum, axis=1)
  return jnp.sum(w[..., None] * acc, axis=1) / jnp.where(denom == 0, 1.0, denom)[..., None]


def _validate(q, cache, token_indices, req_indices, block_table, *, block_size, tokens_per_row, page_offset_bytes,
              cache_dtype):
  if q.ndim != 3:
    raise ValueError(f"q must be [num_tokens, heads, latent_dim], got {list(q.shape)}.")
  t, _, l = q.shape
  if token_indices.ndim != 2 or token_indices.shape[0] != t or token_indices.dtype != jnp.int32:
    raise ValueError(f"token_indices must be int32[{t}, K], got {token_indices.dtype}{list(token_indices.shape)}.")
  if req_indices.shape != (t,) or req_indices.dtype != jnp.int32:
    raise ValueError(f"req_indices must be int32[{t}], got {req_indices.dtype}{list(req_indices.shape)}.")
  if block_table.ndim != 2 or block_table.dtype != jnp.int32:
    raise ValueError(f"block_table must be int32[rows, width], got {block_table.dtype}{list(block_table.shape)}.")
  if cache_dtype not in ("bfloat16", "float32", "fp8"):
    raise ValueError(f"cache_dtype must be bfloat16, float32 or fp8, got {cache_dtype!r}.")
  if cache_dtype == "fp8" and l % FP8_GROUP:
    raise ValueError(f"fp8 latent caches need a latent dim that is a multiple of {FP8_GROUP}, got {l}.")
  e = entry_bytes(l, cache_dtype)
  align = 4 if cache_dtype == "fp8" else jnp.dtype(cache_dtype).itemsize
  if cache.ndim != 2 or cache.dtype != jnp.uint8 or cache.shape[1] % align or page_offset_bytes % align:
    raise ValueError(f"cache must be uint8[num_rows, row_bytes] with rows and page offset ({page_offset_bytes}) "
                     f"multiples of {align} bytes, got {cache.dtype}{list(cache.shape)}.")
  if page_offset_bytes + tokens_per_row * e > cache.shape[1] or block_size % tokens_per_row:
    raise ValueError(f"{tokens_per_row} latent entries of {e} bytes at offset {page_offset_bytes} do not fit rows of "
                     f"{cache.shape[1]} bytes, or do not divide the block size {block_size}.")


@functools.partial(
    jax.jit,
    static_argnames=("block_size", "tokens_per_row", "page_offset_bytes", "cache_dtype", "sm_scale", "block_k",
                     "block_h", "num_splits", "num_warps", "num_stages", "implementation", "interpret"),
)
def sparse_mla_decode(
    q: Float[Array, "T H L"],
    cache: UInt8[Array, "N R"],
    token_indices: Int[Array, "T K"],
    req_indices: Int[Array, "T"],
    block_table: Int[Array, "Rq W"],
    *,
    block_size: int,
    tokens_per_row: int | None = None,
    page_offset_bytes: int = 0,
    cache_dtype: str = "bfloat16",
    sm_scale: float,
    block_k: int = 64,
    block_h: int = 64,
    num_splits: int | None = None,
    num_warps: int | None = 8,
    num_stages: int | None = None,
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
    block_size: manager block size; ``tokens_per_row``: entries per array row (block size, or the
      kernel block size for a dense split); ``page_offset_bytes``: the layer's page offset.
    cache_dtype: ``"bfloat16"``, ``"float32"`` or ``"fp8"``.
    sm_scale: softmax scale.
    block_k, block_h, num_splits, num_warps, num_stages: tiles of selected tokens and heads, splits
      of the selected tokens over programs (flash-decoding; None: enough to fill the GPU), and
      Triton's launch knobs (tuning; ``benchmarks/kernels.py`` sweeps them).
  """
  check_implementation(implementation)
  tokens_per_row = tokens_per_row or block_size
  _validate(q, cache, token_indices, req_indices, block_table, block_size=block_size, tokens_per_row=tokens_per_row,
            page_offset_bytes=page_offset_bytes, cache_dtype=cache_dtype)
  kw = dict(block_size=block_size, tokens_per_row=tokens_per_row, page_offset_bytes=page_offset_bytes,
            cache_dtype=cache_dtype, sm_scale=sm_scale)
  if implementation == "xla":
    return sparse_mla_decode_reference(q, cache, token_indices, req_indices, block_table, **kw)
  t, h, l = q.shape
  hp = max(MIN_DOT_ROWS, pl.next_power_of_2(h))
  bh = min(block_h, hp)
  if hp != h:
    q = jnp.pad(q, ((0, 0), (0, hp - h), (0, 0)))
  # Token -> (row, column) in XLA: a small [T, K] integer pass that takes the block-table lookup
  # off the kernel's chain of dependent loads.
  e = entry_bytes(l, cache_dtype)
  valid = (token_indices >= 0) & (req_indices[:, None] >= 0)
  rows, cols = _token_rows(block_table, jnp.maximum(req_indices, 0)[:, None], jnp.maximum(token_indices, 0),
                           block_size=block_size, tokens_per_row=tokens_per_row, entry_bytes_=e,
                           page_offset_bytes=page_offset_bytes)
  rows = jnp.where(valid, rows, -1)
  elem = 1 if cache_dtype == "fp8" else jnp.dtype(cache_dtype).itemsize
  cols = cols // elem
  k = token_indices.shape[1]
  num_blocks = -(-k // block_k)
  if num_splits is None:
    # Enough programs to fill the GPU (~2 per SM of an H100/H200) without many tiny splits.
    num_splits = max(1, min(num_blocks, -(-264 // (t * (hp // bh)))))
  blocks_per_split = -(-num_blocks // num_splits)
  kp = num_splits * blocks_per_split * block_k
  rows = jnp.pad(rows, ((0, 0), (0, kp - k)), constant_values=-1)
  cols = jnp.pad(cols, ((0, 0), (0, kp - k)))
  n = cache.shape[0]
  if cache_dtype == "fp8":
    values = jax.lax.bitcast_convert_type(cache, FP8_DTYPE)
    scales = jax.lax.bitcast_convert_type(cache.reshape(n, -1, 4), jnp.float32)
  else:
    values = jax.lax.bitcast_convert_type(cache.reshape(n, -1, elem), jnp.dtype(cache_dtype))
    scales = None
  kernel = functools.partial(_sparse_mla_kernel, latent_dim=l, block_k=block_k, blocks_per_split=blocks_per_split,
                             sm_scale=sm_scale, cache_dtype=cache_dtype)
  operands = [q, rows, cols, values]
  if scales is None:
    kernel = functools.partial(_no_scales, kernel)
  else:
    operands.append(scales)
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  acc, m, s_sum = pl.pallas_call(
      kernel,
      out_shape=(jax.ShapeDtypeStruct((t, num_splits, hp, l), jnp.float32),
                 jax.ShapeDtypeStruct((t, num_splits, hp), jnp.float32),
                 jax.ShapeDtypeStruct((t, num_splits, hp), jnp.float32)),
      grid=(t, hp // bh, num_splits),
      in_specs=[any_spec] * len(operands),
      out_specs=(any_spec, any_spec, any_spec),
      interpret=default_interpret(interpret),
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      name="sparse_mla_decode",
  )(*operands)
  return _combine_splits(acc, m, s_sum)[:, :h]


def _no_scales(kernel, q_ref, rows_ref, cols_ref, values_ref, acc_ref, m_ref, l_ref):
  kernel(q_ref, rows_ref, cols_ref, values_ref, None, acc_ref, m_ref, l_ref)


def sparse_mla_decode_reference(q, cache, token_indices, req_indices, block_table, *, block_size: int,
                                tokens_per_row: int | None = None, page_offset_bytes: int = 0,
                                cache_dtype: str = "bfloat16", sm_scale: float):
  """Plain jnp: gather the selected latent rows, masked softmax, weighted sum (float32)."""
  tokens_per_row = tokens_per_row or block_size
  t, h, l = q.shape
  e = entry_bytes(l, cache_dtype)
  valid = (token_indices >= 0) & (req_indices[:, None] >= 0)
  row, col = _token_rows(block_table, jnp.maximum(req_indices, 0)[:, None], jnp.maximum(token_indices, 0),
                         block_size=block_size, tokens_per_row=tokens_per_row, entry_bytes_=e,
                         page_offset_bytes=page_offset_bytes)
  raw = cache[row[..., None], col[..., None] + jnp.arange(e)]  # [T, K, E]
  c = decode_entries(raw.reshape(-1, e), cache_dtype, l).astype(jnp.float32).reshape(t, -1, l)
  s = jnp.einsum("thl,tkl->thk", q.astype(jnp.float32), c, precision=jax.lax.Precision.HIGHEST) * sm_scale
  s = jnp.where(valid[:, None, :], s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.exp(s - jnp.where(m == -jnp.inf, 0.0, m))
  denom = jnp.sum(p, axis=-1, keepdims=True)
  return jnp.einsum("thk,tkl->thl", p, c, precision=jax.lax.Precision.HIGHEST) / jnp.where(denom == 0, 1.0, denom)
