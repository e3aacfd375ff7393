"""Paged MQA logits over pooled indexer keys (DeepGEMM ``fp8_paged_mqa_logits`` semantics).

For query row ``(b, n)`` and pooled entry ``e`` of request ``b``:

    logits[b * next_n + n, e] = sum_h relu(q[b, n, h] . k[e]) * scale[e] * w[b * next_n + n, h]

and ``-inf`` for ``e >= context_lens[b, n]`` (the entries that row sees). Entry ``e`` lives in
kernel page ``kernel_block_table[b, e // P]``, slot ``e % P``, of the indexer's kernel pages:
fp8 ``[P x D e4m3 | P x fp32 scale]`` (132-byte entries for D = 128) or bf16/f32 ``[P x D]``
without scales (exact runs). The arena is read in place: the kernel takes free typed bitcasts of
it (bytes as fp8 values, words as fp32 scales).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float, Int, UInt8

from jaxkv.cache.cache_dtype import CACHE_DTYPES
from jaxkv.cache.kernel_view import KernelView
from jaxkv.utils import cdiv
from pallas_kernels._common import (
  FP8_DTYPE,
  MIN_DOT_ROWS,
  check_byte_addressable,
  check_implementation,
  default_interpret,
  device_shared_memory_bytes,
  without_ref,
)
from pallas_kernels.kpool import indexer_page_bytes, read_indexer_entries

__all__ = ["paged_mqa_logits", "paged_mqa_logits_reference", "paged_mqa_logits_stages"]


def _paged_mqa_logits_kernel(
  q_ref,
  w_ref,
  ctx_ref,
  kt_ref,
  values_ref,
  scales_ref,
  out_ref,
  *,
  base_row,
  entry_row,
  scale_word,
  states_per_page,
  next_n,
  pages_per_program,
):
  # q_ref: [B, next_n, H, D]; w_ref: [B * next_n, H]; ctx_ref: [B, next_n]; kt_ref: [B, num_pages];
  # values_ref: [rows, row_bytes // D, D] as values (a page's P entries start at entry_row);
  # scales_ref: [rows, row_bytes // 4] f32 (a page's scales start at scale_word) or None;
  # out_ref: [B * next_n, num_pages * P].
  b = pl.program_id(0)
  chunk = pl.program_id(1)
  p = states_per_page
  # fp8 and bf16 operands are exact in bf16 (tensor cores); float32 runs stay float32.
  dot_dtype = jnp.float32 if values_ref.dtype == jnp.float32 else jnp.bfloat16
  precision = jax.lax.Precision.HIGHEST if dot_dtype == jnp.float32 else None
  qs = [q_ref[b, n].astype(dot_dtype) for n in range(next_n)]  # [H, D] each
  ws = [w_ref[b * next_n + n] for n in range(next_n)]  # [H]
  ctx = [ctx_ref[b, n] for n in range(next_n)]
  max_ctx = ctx[0]
  for c in ctx[1:]:
    max_ctx = jnp.maximum(max_ctx, c)
  entry = jnp.arange(p, dtype=jnp.int32)

  def body(i, carry):
    page = chunk * pages_per_program + i
    col = page * p
    row = base_row + kt_ref[b, page]
    k = values_ref[row, pl.ds(entry_row, p), :].astype(dot_dtype)  # [P, D]
    scale = scales_ref[row, pl.ds(scale_word, p)] if scales_ref is not None else None
    for n in range(next_n):
      s = jnp.dot(qs[n], k.T, precision=precision, preferred_element_type=jnp.float32)  # [H, P]
      logit = jnp.sum(jnp.maximum(s, 0.0) * ws[n][:, None], axis=0)
      if scale is not None:
        logit = logit * scale
      out_ref[b * next_n + n, pl.ds(col, p)] = jnp.where(col + entry < ctx[n], logit, -jnp.inf)
    return carry

  def fill(i, carry):
    col = (chunk * pages_per_program + i) * p
    for n in range(next_n):
      out_ref[b * next_n + n, pl.ds(col, p)] = jnp.full((p,), -jnp.inf, jnp.float32)
    return carry

  # Pages with a visible entry, then the rest: two loops without a branch in their bodies (a branch
  # keeps Triton from pipelining the page loads). A loop, not unrolled code: measured faster on the
  # H200 (fewer live registers per program).
  live = jnp.maximum(max_ctx - chunk * pages_per_program * p, 0)
  live = jnp.minimum((live + p - 1) // p, pages_per_program)
  jax.lax.fori_loop(0, live, body, 0)
  jax.lax.fori_loop(live, pages_per_program, fill, 0)


def paged_mqa_logits_stages(
  heads: int,
  next_n: int,
  head_dim: int,
  states_per_page: int,
  cache_dtype: str,
  shared_memory_bytes: int | None,
  num_stages: int = 3,
) -> int:
  """Pipeline stages (at most ``num_stages``) whose shared memory fits ``shared_memory_bytes``
  (None: no limit): each stage holds one page ``[P, D]`` of keys in the dot dtype (float32 for
  float32 keys, else bf16); the ``next_n`` queries ``[H, D]`` and the scores ``[H, P]`` (float32)
  are held once, with 1 KiB of Triton's own. Stages change no arithmetic, only how far the page
  loads run ahead.

  Raises:
    ValueError: when not even one stage fits (use the XLA path).
  """
  item = 4 if cache_dtype == "float32" else 2
  hp = max(MIN_DOT_ROWS, pl.next_power_of_2(heads))
  fixed = next_n * hp * head_dim * item + hp * states_per_page * 4 + 1024
  for stages in range(num_stages, 0, -1):
    need = stages * states_per_page * head_dim * item + fixed
    if shared_memory_bytes is None or need <= shared_memory_bytes:
      return stages
  raise ValueError(
    f"paged_mqa_logits: {next_n} query rows of {heads} heads x {head_dim} {cache_dtype} channels over "
    f"{states_per_page}-entry pages need {need:,} bytes of shared memory, more than the "
    f"{shared_memory_bytes:,} this device gives one program; run it with implementation='xla' "
    "(--implementation xla) or a narrower --indexer-cache-dtype."
  )


def _validate(q, pages, weights, context_lens, kernel_block_table, view: KernelView) -> str:
  """Checks the arguments; returns the view's entry encoding."""
  cache_dtype = view.require_cache_dtype("paged_mqa_logits", CACHE_DTYPES)
  base_row, states_per_page, page_offset_bytes = view.base_row, view.entries_per_page, view.offset_bytes
  if q.ndim != 4:
    raise ValueError(f"q must be [batch, next_n, heads, head_dim], got {list(q.shape)}.")
  b, next_n, h, d = q.shape
  if weights.shape != (b * next_n, h) or weights.dtype != jnp.float32:
    raise ValueError(f"weights must be float32[{b * next_n}, {h}], got {weights.dtype}{list(weights.shape)}.")
  if context_lens.shape != (b, next_n) or context_lens.dtype != jnp.int32:
    raise ValueError(f"context_lens must be int32[{b}, {next_n}], got {context_lens.dtype}{list(context_lens.shape)}.")
  if kernel_block_table.ndim != 2 or kernel_block_table.shape[0] != b or kernel_block_table.dtype != jnp.int32:
    raise ValueError(
      f"kernel_block_table must be int32[{b}, max_pages], got "
      f"{kernel_block_table.dtype}{list(kernel_block_table.shape)}."
    )
  page = indexer_page_bytes(states_per_page, d, cache_dtype)
  rb = view.row_bytes
  elem = d * (1 if cache_dtype == "fp8" else jnp.dtype(cache_dtype).itemsize)
  if (
    pages.ndim != 2
    or pages.dtype != jnp.uint8
    or pages.shape[1] % rb
    or rb % elem
    or page_offset_bytes % elem
    or page_offset_bytes + page > rb
  ):
    raise ValueError(
      f"pages must be uint8[num_rows, row_bytes] of whole {rb}-byte view rows holding a {page}-byte "
      f"page ({states_per_page} entries of {d} {cache_dtype} channels) at byte {page_offset_bytes}, "
      f"rows and offset multiples of {elem} bytes; got {pages.dtype}{list(pages.shape)}."
    )
  if not 0 <= base_row < pages.shape[0] * pages.shape[1] // rb:
    raise ValueError(f"base_row {base_row} is outside the {pages.shape[0] * pages.shape[1] // rb} view rows.")
  return cache_dtype


@functools.partial(
  jax.jit,
  static_argnames=(
    "view",
    "pages_per_program",
    "num_warps",
    "num_stages",
    "implementation",
    "interpret",
  ),
)
def paged_mqa_logits(
  q: Float[Array, "B N H D"],
  pages: UInt8[Array, "R Rb"],
  weights: Float[Array, "BN H"],
  context_lens: Int[Array, "B N"],
  kernel_block_table: Int[Array, "B M"],
  *,
  view: KernelView,
  pages_per_program: int | None = None,
  num_warps: int | None = 4,
  num_stages: int | None = 3,
  implementation: str = "pallas",
  interpret: bool | None = None,
) -> Float[Array, "BN E"]:
  """Index scores of every visible pooled entry, ``float32[B * next_n, num_pages * P]``.

  Args:
    q: ``[batch, next_n, heads, head_dim]`` queries (fp8 e4m3, bf16 or f32; q scales folded into
      ``weights``).
    pages: uint8 ``[num_rows, row_bytes]``: the backing array (packed arena or dense layer array),
      read through ``view``: kernel page ``k`` is view row ``base_row + k`` at ``offset_bytes``.
    weights: float32 ``[batch * next_n, heads]`` per-head weights.
    context_lens: int32 ``[batch, next_n]`` entries visible to each query row.
    kernel_block_table: int32 ``[batch, max_pages]`` kernel page ids (``map_to_kernel_blocks``).
    view: the indexer layer's ``KernelView`` (``entries_per_page`` P is 32 or 64; ``cache_dtype``
      ``"fp8"``, ``"bfloat16"`` or ``"float32"``).
    pages_per_program: pages per program (None: enough programs to fill the GPU, at most 8 pages
      each, so batch 1 spreads its context over the SMs).
    num_warps, num_stages: Triton's launch knobs (``benchmarks/kernels.py`` sweeps these; the stages
      are lowered to what the device's shared memory holds, ``paged_mqa_logits_stages``). One
      setting for every batch: the head sum is split over the warps, so a request's logits would
      otherwise depend on the batch it runs in (docs/kernels.md, lease I).
  """
  check_implementation(implementation)
  cache_dtype = _validate(q, pages, weights, context_lens, kernel_block_table, view)
  if implementation == "xla":
    return paged_mqa_logits_reference(q, pages, weights, context_lens, kernel_block_table, view=view)
  b, next_n, h, d = q.shape
  p = view.entries_per_page
  interpret = default_interpret(interpret)
  if num_stages is not None and not interpret:
    num_stages = paged_mqa_logits_stages(h, next_n, d, p, cache_dtype, device_shared_memory_bytes(), num_stages)
  # Zero heads (zero weights) up to Triton's smallest dot tile: no effect on the sum.
  hp = max(MIN_DOT_ROWS, pl.next_power_of_2(h))
  if hp != h:
    q = jnp.pad(q, ((0, 0), (0, 0), (0, hp - h), (0, 0)))
    weights = jnp.pad(weights, ((0, 0), (0, hp - h)))
  rows = pages.reshape(-1, view.row_bytes)
  # Free typed views of the same bytes (no copy inside jit): values as [rows, page_bytes / D, D], so
  # a page's P entries are one 2-D block; fp8 scales as float32 words.
  if cache_dtype == "fp8":
    check_byte_addressable(rows, f"the indexer cache array of {view.layer_name}", interpret)
    values = jax.lax.bitcast_convert_type(rows, FP8_DTYPE).reshape(rows.shape[0], -1, d)
    scales = jax.lax.bitcast_convert_type(rows.reshape(rows.shape[0], -1, 4), jnp.float32)
  else:
    width = jnp.dtype(cache_dtype).itemsize
    values = jax.lax.bitcast_convert_type(rows.reshape(rows.shape[0], -1, d, width), jnp.dtype(cache_dtype))
    scales = None
  num_pages = kernel_block_table.shape[1]
  if pages_per_program is None:
    # Measured on the H200 (docs/kernels.md): 64 requests x 32k take 2-8 pages per program alike;
    # batch 1 x 128k is 2.2x faster with one page per program than with 8 (512 programs, not 64).
    pages_per_program = max(1, min(8, b * num_pages // 1024))
  ppp = min(pages_per_program, num_pages)
  num_chunks = cdiv(num_pages, ppp)
  if num_chunks * ppp != num_pages:  # whole chunks: pad the table with null pages (masked anyway)
    kernel_block_table = jnp.pad(kernel_block_table, ((0, 0), (0, num_chunks * ppp - num_pages)))
  elem = d * (1 if cache_dtype == "fp8" else jnp.dtype(cache_dtype).itemsize)
  kernel = functools.partial(
    _paged_mqa_logits_kernel,
    base_row=view.base_row,
    entry_row=view.offset_bytes // elem,
    scale_word=(view.offset_bytes + p * d) // 4,
    states_per_page=p,
    next_n=next_n,
    pages_per_program=ppp,
  )
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  operands = [q, weights, context_lens, kernel_block_table, values] + ([scales] if scales is not None else [])
  if scales is None:
    kernel = without_ref(kernel, 5)
  out = pl.pallas_call(
    kernel,
    out_shape=jax.ShapeDtypeStruct((b * next_n, num_chunks * ppp * p), jnp.float32),
    grid=(b, num_chunks),
    in_specs=[any_spec] * len(operands),
    out_specs=any_spec,
    interpret=interpret,
    compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
    name="paged_mqa_logits",
  )(*operands)
  return out[:, : num_pages * p]


def paged_mqa_logits_reference(q, pages, weights, context_lens, kernel_block_table, *, view: KernelView):
  """Plain jnp: gather the pages, einsum, ReLU, head-weighted sum, scale, mask."""
  b, next_n, h, d = q.shape
  p = view.entries_per_page
  m = kernel_block_table.shape[1]
  vals, scales = read_indexer_entries(pages, kernel_block_table, view=view, head_dim=d)  # [B,M,P,D], [B,M,P]
  s = jnp.einsum(
    "bnhd,bmpd->bnhmp",
    q.astype(jnp.float32),
    vals,
    precision=jax.lax.Precision.HIGHEST,
    preferred_element_type=jnp.float32,
  )
  w = weights.reshape(b, next_n, h)
  logits = jnp.einsum("bnhmp,bnh->bnmp", jnp.maximum(s, 0.0), w) * scales[:, None]
  logits = logits.reshape(b * next_n, m * p)
  visible = jnp.arange(m * p)[None, :] < context_lens.reshape(-1, 1)
  return jnp.where(visible, logits, -jnp.inf)
