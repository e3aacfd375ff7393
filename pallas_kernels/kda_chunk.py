"""Chunkwise KDA: the delta rule over 64-position chunks of a fixed grid, for prefill.

The recurrence of ``kda_recurrence`` (per token: ``s <- diag(exp(g)) s``, ``u = beta (v - s^T k)``,
``s <- s + k u^T``, ``o = s^T q``) has a chunked form (the WY form of the delta rule,
flash-linear-attention's ``chunk_kda``): with ``gam`` the cumulative log-decay from a chunk's start
and ``S0`` the state there, a chunk's ``C`` outputs and its end state are a few ``C x C`` and
``C x K`` matrix products instead of ``C`` dependent steps:

    A[i, j] = beta_i sum_k k_ik k_jk exp(gam_ik - gam_jk)        (j < i)
    M[i, j] =        sum_k q_ik k_jk exp(gam_ik - gam_jk)        (j <= i)
    U  = (I + A)^-1 (beta v - (beta k exp(gam)) S0)
    o  = (q exp(gam)) S0 + M U
    S1 = diag(exp(gam_last)) S0 + (k exp(gam_last - gam))^T U

**Why a fixed grid.** A position's output depends on where its chunk starts. Chunk ``c`` of a
request is always its positions ``[cC, cC + C)``, so a position is computed the same way, bit for
bit, however the prompt is cut into steps (the scheduler's prefill chunks, a recompute after
preemption). A step that ends inside a chunk leaves the state at the chunk's start and the chunk's
rows so far (``k, g, v, beta``: the *prefix*); the next step recomputes that chunk from them with
its own rows added. Every row's results depend only on the rows before it, and the rows not yet
there are zeros, which add exact zeros.

Layout: a request's tokens are contiguous and in position order in the flat batch (``StepInputs``);
this step's tokens of request ``r`` continue from ``state[r]`` (the state at the start of the chunk
holding its first position) and ``prefix`` (that chunk's rows before it). The wrapper gathers the
step's chunks, prefix rows included, into chunk-major rows. Three kernels, as fla splits its own:
``chunk_kda_scores``, one program per (chunk, head, 16-row sub-block), computes the sub-block's rows
of ``A`` and ``M`` and the inverse of ``I + A``'s diagonal block by forward substitution (fla's
``chunk_kda_fwd_intra``); ``chunk_kda_prepare``, one per (chunk, head), joins the blocks below the
diagonal by products (fla's ``solve_tril``) and computes the rest of what does not depend on the
state (``W = (I + A)^-1 (beta k exp(gam))``, ``U0 = (I + A)^-1 beta v``, the decayed ``q`` and
``k``); then ``chunk_kda``, one program per (request, head, block of V), carries the state
through its request's chunks in order with three products per chunk (``u = U0 - W S``,
``o = (q exp(gam)) S + M u``, ``S' = diag(exp(gam_last)) S + (k exp(gam_last - gam))^T u``). One
kernel doing all of it held ``[C, K]`` tiles of q, k, g and their decays at once and spilled 100 KB
a thread (``jaxkv lower --build``, docs/kernels.md); one per-chunk kernel for the first two ran 63
dependent substitution steps on ``[C, C]`` tiles (about 1,600 barriers a program in all).

``"xla"`` is the CPU path and the reference: a scan over the same chunks, each by
``chunk_delta_rule`` (which the model's ``kda_chunked`` uses too).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float, Int

from pallas_kernels._common import default_interpret, resolve_implementation
from pallas_kernels.kda_recurrence import check_delta_rule_inputs, request_spans

__all__ = ["chunk_kda", "chunk_kda_reference", "chunk_delta_rule", "ChunkPrefix", "CHUNK_SIZE"]

# The grid every request's positions are cut on (fla's chunk size).
CHUNK_SIZE = 64
# Rows of a diagonal sub-block: decays inside one are taken element by element (exact for any
# gate); across sub-blocks they factor through the later block's first row (both factors <= 1).
_SUB = 16
_HP = jax.lax.Precision.HIGHEST
# The kernel's matrix products: IEEE float32 (CUDA cores), or three TF32 tensor-core products
# (float32-level accuracy; fla's form runs on tensor cores). Interpret mode takes float32: XLA's
# CPU dot has no TF32.
PRECISIONS = {"float32": _HP, "tf32x3": jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3}


def _column_blocks(width: int, block_k: int) -> list[pl.Slice]:
  """K's columns in blocks of ``block_k`` (the decays are per column, so any block is exact)."""
  return [pl.ds(j * block_k, block_k) for j in range(width // block_k)]


def _scores_kernel(
  owner_ref,
  q_ref,
  k_ref,
  g_ref,
  beta_ref,
  a_ref,
  m_ref,
  dinv_ref,
  *,
  num_reqs,
  chunk,
  block_k,
  precision,
):
  # One chunk, head and sub-block of SUB rows: the sub-block's rows of A (beta-scaled) and M, and
  # the inverse of I + A's diagonal block. owner_ref: [N] request of each chunk (num_reqs: unused).
  # q/k/g: [SUB + N*C, H, K] (SUB leading zero rows), beta: [.., H]. Out: a, m, dinv [N, H, C, C]
  # (dinv: zero off the diagonal blocks). Small tiles ([SUB, K] and [SUB, C]) and four programs a
  # chunk and head: the sequential steps (sub-diagonals, substitution) run on a sub-block's rows
  # only, many programs to an SM (the one-program form held [C, C] tiles at 255 registers).
  s, n, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  c, b = chunk, _SUB
  i0 = s * b
  base = b + n * c
  mine = pl.ds(base + i0, b)
  r = jax.lax.broadcasted_iota(jnp.int32, (b, 1), 0)  # row in the sub-block
  rc = jax.lax.broadcasted_iota(jnp.int32, (c, 1), 0)  # row in the chunk
  col = jax.lax.broadcasted_iota(jnp.int32, (1, c), 1)
  _dot = lambda x, y: jnp.dot(x, y, precision=precision, preferred_element_type=jnp.float32)

  @pl.when(owner_ref[n] < num_reqs)
  def _():
    a = m = jnp.zeros((b, c), jnp.float32)
    for ks in _column_blocks(q_ref.shape[2], block_k):
      # Earlier sub-blocks: through row i0, exp(gam_i - gam_i0) exp(gam_i0 - gam_j), both <= 1.
      gam = jnp.cumsum(g_ref[pl.ds(base, c), h, ks], axis=0)  # [C, BK]
      g0 = jnp.sum(jnp.where(rc == i0, gam, 0.0), axis=0)[None, :]  # [1, BK]
      before = rc < i0
      right = jnp.where(before, k_ref[pl.ds(base, c), h, ks] * jnp.exp(jnp.where(before, g0 - gam, 0.0)), 0.0)
      e = jnp.exp(jnp.cumsum(jnp.where(r == 0, 0.0, g_ref[mine, h, ks]), axis=0))  # exp(gam_i - gam_i0)
      a += _dot(k_ref[mine, h, ks] * e, right.T)
      m += _dot(q_ref[mine, h, ks] * e, right.T)
    # Inside the sub-block, all of K at once (a sequential step is a few barriers whatever its
    # width): the d-th sub-diagonal from rows shifted d up (rows of the leading zeros or the chunk
    # before are masked), its decay the sum of the d latest g's.
    q, k = q_ref[mine, h, :], k_ref[mine, h, :]  # [SUB, K]

    def diagonal(d, carry):
      a, m, win = carry
      win = win + g_ref[pl.ds(base + i0 - d + 1, b), h, :]
      kd = k_ref[pl.ds(base + i0 - d, b), h, :] * jnp.exp(win)
      place = (r >= d) & (col == i0 + r - d)
      a = a + jnp.where(place, jnp.sum(k * kd, axis=1, keepdims=True), 0.0)
      m = m + jnp.where(place, jnp.sum(q * kd, axis=1, keepdims=True), 0.0)
      return a, m, win

    a, m, _ = jax.lax.fori_loop(1, b, diagonal, (a, m, jnp.zeros_like(q)))
    m += jnp.where(col == i0 + r, jnp.sum(q * k, axis=1, keepdims=True), 0.0)
    a = beta_ref[mine, h][:, None] * a
    # (I + A)^-1 of the diagonal block by forward substitution, column by column: step j takes row
    # j (final) out of the rows below it. Not by the power series of -A: for a repeated key, I + A
    # nears the all-ones triangle and the series' terms explode before they cancel (tested).

    def substitute(j, inv):
      aj = jnp.sum(jnp.where(col == i0 + j, a, 0.0), axis=1, keepdims=True)  # [SUB, 1]: A[:, i0 + j]
      xj = jnp.sum(jnp.where(r == j, inv, 0.0), axis=0, keepdims=True)  # [1, C]: row j
      return inv - jnp.where(r > j, aj, 0.0) * xj

    out = pl.ds(i0, b)
    a_ref[n, h, out, :] = a
    m_ref[n, h, out, :] = m
    dinv_ref[n, h, out, :] = jax.lax.fori_loop(0, b - 1, substitute, (col == i0 + r).astype(jnp.float32))


def _prepare_kernel(
  owner_ref,
  q_ref,
  k_ref,
  g_ref,
  v_ref,
  beta_ref,
  a_ref,
  dinv_ref,
  w_ref,
  u0_ref,
  qe_ref,
  kd_ref,
  decay_ref,
  *,
  num_reqs,
  chunk,
  block_k,
  precision,
):
  # One chunk and head: the rest of what does not depend on the state. a / dinv: _scores_kernel's.
  # Out: w, qe, kd [N*C, H, K], u0 [N*C, H, V], decay [N, H, K]. (I + A)^-1 from its diagonal
  # blocks, the blocks below them by products (fla's solve_tril): block row r is
  # X_r,<r = -X_rr (A_r,<r X_<r), the earlier block rows final.
  n, h = pl.program_id(0), pl.program_id(1)
  c = chunk
  row = jax.lax.broadcasted_iota(jnp.int32, (c, 1), 0)
  col = jax.lax.broadcasted_iota(jnp.int32, (1, c), 1)
  _dot = lambda x, y: jnp.dot(x, y, precision=precision, preferred_element_type=jnp.float32)
  rows = pl.ds(_SUB + n * c, c)

  @pl.when(owner_ref[n] < num_reqs)
  def _():
    a, inv = a_ref[n, h], dinv_ref[n, h]
    same = (row // _SUB) == (col // _SUB)  # [C, C]: the diagonal blocks
    for r0 in range(_SUB, c, _SUB):
      at = (row >= r0) & (row < r0 + _SUB)
      t = _dot(jnp.where(at & (col < r0), a, 0.0), inv)  # block row r: A_r,<r X_<r
      inv = inv - _dot(jnp.where(at & same, inv, 0.0), t)
    beta = beta_ref[rows, h][:, None]  # [C, 1]
    out = pl.ds(n * c, c)
    u0_ref[out, h, :] = _dot(inv, beta * v_ref[rows, h, :])
    for ks in _column_blocks(q_ref.shape[2], block_k):
      k = k_ref[rows, h, ks]
      gam = jnp.cumsum(g_ref[rows, h, ks], axis=0)
      eg = jnp.exp(gam)
      w_ref[out, h, ks] = _dot(inv, beta * k * eg)
      qe_ref[out, h, ks] = q_ref[rows, h, ks] * eg
      last = jnp.sum(jnp.where(row == c - 1, gam, 0.0), axis=0)  # [BK]
      kd_ref[out, h, ks] = k * jnp.exp(last[None, :] - gam)
      decay_ref[n, h, ks] = jnp.exp(last)


def _chunk_kda_kernel(
  first_ref,
  num_ref,
  rem_ref,
  w_ref,
  u0_ref,
  qe_ref,
  kd_ref,
  m_ref,
  decay_ref,
  state_ref,
  o_ref,
  state_out_ref,
  *,
  chunk,
  block_v,
  precision,
):
  # One request, head and block of V, over the request's chunks in order: the state's part.
  # first_ref / num_ref / rem_ref: [R] first chunk, chunk count, rows of the last chunk (0:
  # complete); w/u0/qe/kd/m/decay: _prepare_kernel's; state_ref / state_out_ref: [R, H, K, V] (one
  # buffer: a request without chunks is not touched); o_ref: [N*C, H, V].
  vb, r, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  cols = pl.ds(vb * block_v, block_v)
  c = chunk
  _dot = lambda a, b: jnp.dot(a, b, precision=precision, preferred_element_type=jnp.float32)
  num, rem = num_ref[r], rem_ref[r]

  def chunk(i, s):
    n = first_ref[r] + i
    rows = pl.ds(n * c, c)
    u = u0_ref[rows, h, cols] - _dot(w_ref[rows, h, :], s)  # [C, BV]
    o_ref[rows, h, cols] = _dot(qe_ref[rows, h, :], s) + _dot(m_ref[n, h], u)
    s1 = s * decay_ref[n, h, :][:, None] + _dot(kd_ref[rows, h, :].T, u)
    # A chunk the step does not finish leaves the state at its start (the prefix carries its rows).
    return jnp.where((i < num - 1) | (rem == 0), s1, s)

  @pl.when(num > 0)
  def _():
    state_out_ref[r, h, :, cols] = jax.lax.fori_loop(0, num, chunk, state_ref[r, h, :, cols])


class ChunkPrefix(NamedTuple):
  """Each request's rows of its unfinished chunk (rows ``[0, positions % C)``; zeros after):
  ``k, g: [R, C, H, K]``, ``v: [R, C, H, V]``, ``beta: [R, C, H]`` (float32). ``C`` is the grid."""

  k: Float[Array, "R C H K"]
  g: Float[Array, "R C H K"]
  v: Float[Array, "R C H V"]
  beta: Float[Array, "R C H"]

  @classmethod
  def zeros(cls, num_reqs: int, heads: int, head_dim: int, value_dim: int, chunk_size: int = CHUNK_SIZE):
    z = lambda *s: jnp.zeros((num_reqs, chunk_size, heads, *s), jnp.float32)
    return cls(z(head_dim), z(head_dim), z(value_dim), z())


@dataclasses.dataclass(frozen=True)
class _Chunks:
  """The step's chunks: ``src [SUB + N*C]`` row each chunk row is gathered from (the step's tokens
  ``[0, T)``, the prefix rows ``[T, T + R*C)``, a zero row ``T + R*C``); per request ``first``
  chunk, ``num`` chunks, ``rem`` rows of the last (0: complete), ``count`` tokens; per chunk its
  ``owner`` (``R``: unused); per token its chunk row ``tok_row`` (``[0, N*C)``)."""

  src: Int[Array, " X"]
  first: Int[Array, " R"]
  num: Int[Array, " R"]
  rem: Int[Array, " R"]
  count: Int[Array, " R"]
  owner: Int[Array, " N"]
  tok_row: Int[Array, " T"]


def _chunks(req_indices, positions, num_reqs: int, c: int) -> _Chunks:
  t, r = req_indices.shape[0], num_reqs
  tok = jnp.arange(t, dtype=jnp.int32)
  first_tok, count = request_spans(req_indices, r)
  offset = jnp.where(count > 0, positions[jnp.minimum(first_tok, t - 1)] % c, 0)
  num = (offset + count + c - 1) // c
  first = jnp.cumsum(num) - num
  # Chunks hold at least one token each, and a request's offset and tail add at most two.
  n = max(1, min(t, t // c + 2 * r))
  owner = jnp.searchsorted(jnp.cumsum(num), jnp.arange(n, dtype=jnp.int32), side="right").astype(jnp.int32)
  o = jnp.minimum(owner, r - 1)[:, None]
  idx = jnp.arange(c, dtype=jnp.int32)[None, :]
  ci = jnp.arange(n, dtype=jnp.int32)[:, None] - first[o]
  j = ci * c + idx - offset[o]  # position in the step's tokens of the request
  used = owner[:, None] < r
  from_tok = used & (j >= 0) & (j < count[o])
  from_prefix = used & (ci == 0) & (idx < offset[o])
  src = jnp.where(from_tok, first_tok[o] + j, jnp.where(from_prefix, t + o * c + idx, t + r * c))
  src = jnp.concatenate([jnp.full((_SUB,), t + r * c, jnp.int32), src.reshape(-1)])
  ri = jnp.maximum(req_indices, 0)
  tok_row = first[ri] * c + offset[ri] + tok - first_tok[ri]
  return _Chunks(src, first, num, (offset + count) % c, count, owner, tok_row)


def _gather(x, pre, src):
  """``x [T, H, ...]`` and the prefix's ``pre [R, C, H, ...]`` (None: zeros) -> chunk rows."""
  t = x.shape[0]
  zero = jnp.zeros((1, *x.shape[1:]), x.dtype)
  if pre is None:
    return jnp.concatenate([x, zero])[jnp.where(src < t, src, t)]
  return jnp.concatenate([x, pre.reshape(-1, *x.shape[1:]), zero])[src]


def _finish(o_rows, state, prefix, rows, ch: _Chunks, req_indices, c: int):
  """Each token's output from its chunk row; the prefix: the rows of each request's unfinished
  chunk (unchanged for requests without tokens)."""
  o = jnp.where((req_indices >= 0)[:, None, None], o_rows[ch.tok_row], 0.0)
  last = _SUB + (ch.first + ch.num - 1) * c
  idx = jnp.arange(c, dtype=jnp.int32)
  take = jnp.maximum(last, 0)[:, None] + idx[None, :]  # [R, C]
  keep = idx[None, :] < ch.rem[:, None]
  fresh = lambda x: jnp.where(keep.reshape(*keep.shape, *(1,) * (x.ndim - 1)), x[take], 0.0)
  new = ChunkPrefix(*(fresh(x) for x in rows))
  stay = ch.count == 0
  prefix = jax.tree.map(lambda old, n: jnp.where(stay.reshape(-1, *(1,) * (old.ndim - 1)), old, n), prefix, new)
  return o, state, prefix


def _validate(q, k, v, g, beta, state, prefix, req_indices, positions) -> int:
  """The checks; returns the grid ``C``."""
  check_delta_rule_inputs(q, k, v, g, beta, state, *prefix, req_indices=req_indices, positions=positions)
  r, h, kd, vd = state.shape
  c = prefix.k.shape[1] if prefix.k.ndim == 4 else -1
  want = ChunkPrefix((r, c, h, kd), (r, c, h, kd), (r, c, h, vd), (r, c, h))
  got = ChunkPrefix(*(tuple(x.shape) for x in prefix))
  if got != want or c < _SUB or c & (c - 1):
    raise ValueError(
      f"prefix must be k, g [R, C, H, K], v [R, C, H, V], beta [R, C, H] with R = {r}, H = {h}, K = {kd}, "
      f"V = {vd} and C a power of two >= {_SUB} (the chunk grid); got {[list(s) for s in got]}."
    )
  return c


@functools.partial(
  jax.jit,
  static_argnames=(
    "block_v",
    "num_warps",
    "prepare_block_k",
    "prepare_warps",
    "scores_warps",
    "precision",
    "implementation",
    "interpret",
  ),
  donate_argnames=("state", "prefix"),
)
def chunk_kda(
  q: Float[Array, "T H K"],
  k: Float[Array, "T H K"],
  v: Float[Array, "T H V"],
  g: Float[Array, "T H K"],
  beta: Float[Array, "T H"],
  state: Float[Array, "R H K V"],
  prefix: ChunkPrefix,
  req_indices: Int[Array, " T"],
  positions: Int[Array, " T"],
  *,
  block_v: int = 32,
  num_warps: int = 4,
  prepare_block_k: int = 32,
  prepare_warps: int = 4,
  scores_warps: int = 2,
  precision: str = "tf32x3",
  implementation: str = "auto",
  interpret: bool | None = None,
) -> tuple[Float[Array, "T H V"], Float[Array, "R H K V"], ChunkPrefix]:
  """The delta rule over each request's tokens, chunk by chunk on the grid of ``prefix``'s ``C``.

  Args:
    q, k, g: float32 ``[T, H, K]`` (normed query and key, log-decay <= 0); v: ``[T, H, V]``;
      beta: ``[T, H]`` write strength.
    state: float32 ``[R, H, K, V]`` (donated): each request's state at the start of the chunk
      holding its first position this step.
    prefix: ``ChunkPrefix`` (donated): that chunk's rows before the first position (what the
      call that computed them returned; ``ChunkPrefix.zeros`` for requests at position 0).
    req_indices: int32 ``[T]`` request of each token, -1 for tokens this call skips (padding, or
      tokens the caller runs recurrently); a request's tokens are contiguous and in order.
    positions: int32 ``[T]`` each token's position in its request.
    block_v, num_warps: the state kernel's tile of V and Triton's warps; prepare_block_k: the
      tile of K of the two per-chunk kernels; prepare_warps, scores_warps: their warps (the
      per-chunk kernel's and the per-sub-block one's).
    precision: the kernel's matrix products, ``"float32"`` or ``"tf32x3"`` (``PRECISIONS``;
      interpreted: float32).
    implementation: ``"pallas"``, ``"xla"`` or ``"auto"`` (``resolve_implementation``).
  Returns:
    ``o`` float32 ``[T, H, V]`` (zero for skipped tokens); each request's ``state`` at the start of
    the chunk holding its next position, and the ``prefix`` rows of that chunk (requests without
    tokens: both unchanged).
  """
  c = _validate(q, k, v, g, beta, state, prefix, req_indices, positions)
  if resolve_implementation(implementation) == "xla":
    return chunk_kda_reference(q, k, v, g, beta, state, prefix, req_indices, positions)
  r, h, kd, vd = state.shape
  bv = min(block_v, vd)
  if precision not in PRECISIONS:
    raise ValueError(f"precision must be one of {tuple(PRECISIONS)}, got {precision!r}.")
  interpret = default_interpret(interpret)
  if vd % bv or bv & (bv - 1) or bv < _SUB:
    raise ValueError(f"block_v must be a power of two >= {_SUB} dividing V = {vd}, got {bv}.")
  bk = min(prepare_block_k, kd)
  if kd % bk or bk & (bk - 1) or bk < _SUB:
    raise ValueError(f"prepare_block_k must be a power of two >= {_SUB} dividing K = {kd}, got {bk}.")
  ch = _chunks(req_indices, positions, r, c)
  rows = tuple(_gather(x, pre, ch.src) for x, pre in zip((k, g, v, beta), prefix))
  n = ch.owner.shape[0]
  q_rows = _gather(q, None, ch.src)
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  prec = PRECISIONS["float32" if interpret else precision]
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  kw = dict(num_reqs=r, chunk=c, block_k=bk, precision=prec)
  # Per chunk, head and sub-block: A and M's rows, the inverses of I + A's diagonal blocks.
  a, m, dinv = pl.pallas_call(
    functools.partial(_scores_kernel, **kw),
    out_shape=(f32(n, h, c, c),) * 3,
    grid=(c // _SUB, n, h),  # sub-blocks first: they read one chunk's rows
    in_specs=[any_spec] * 5,
    out_specs=(any_spec,) * 3,
    interpret=interpret,
    compiler_params=pltriton.CompilerParams(num_warps=scores_warps, num_stages=1),
    name="chunk_kda_scores",
  )(ch.owner, q_rows, rows[0], rows[1], rows[3])
  # Per chunk and head: (I + A)^-1 and the products with it; none depends on the state.
  w, u0, qe, kdec, decay = pl.pallas_call(
    functools.partial(_prepare_kernel, **kw),
    out_shape=(f32(n * c, h, kd), f32(n * c, h, vd), f32(n * c, h, kd), f32(n * c, h, kd), f32(n, h, kd)),
    grid=(n, h),
    in_specs=[any_spec] * 8,
    out_specs=(any_spec,) * 5,
    interpret=interpret,
    compiler_params=pltriton.CompilerParams(num_warps=prepare_warps, num_stages=1),
    name="chunk_kda_prepare",
  )(ch.owner, q_rows, *rows, a, dinv)
  # Per request, head and block of V: the state through the request's chunks, in order.
  o_rows, new_state = pl.pallas_call(
    functools.partial(_chunk_kda_kernel, chunk=c, block_v=bv, precision=prec),
    out_shape=(f32(n * c, h, vd), f32(*state.shape)),
    grid=(vd // bv, r, h),  # blocks of V first: they read one chunk's w, qe, kd
    in_specs=[any_spec] * 10,
    out_specs=(any_spec, any_spec),
    input_output_aliases={9: 1},  # the state, updated in place (donated)
    interpret=interpret,
    compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
    name="chunk_kda",
  )(ch.first, ch.num, ch.rem, w, u0, qe, kdec, m, decay, state)
  return _finish(o_rows, new_state, prefix, rows, ch, req_indices, c)


def chunk_kda_reference(q, k, v, g, beta, state, prefix, req_indices, positions):
  """Plain jnp, same arguments: a scan over the step's chunks, each by ``chunk_delta_rule`` on its
  request's state."""
  r, c = state.shape[0], prefix.k.shape[1]
  ch = _chunks(req_indices, positions, r, c)
  rows = tuple(_gather(x, pre, ch.src) for x, pre in zip((k, g, v, beta), prefix))
  n = ch.owner.shape[0]
  per_chunk = lambda x: x[_SUB:].reshape(n, c, *x.shape[1:])

  def step(states, inp):
    i, qc, kc, gc, vc, bc = inp
    owner = ch.owner[i]
    o = jnp.minimum(owner, r - 1)
    s1, out = chunk_delta_rule(states[o], qc, kc, vc, gc, bc)
    done = (i - ch.first[o] < ch.num[o] - 1) | (ch.rem[o] == 0)
    return states.at[owner].set(jnp.where(done, s1, states[o]), mode="drop"), out

  xs = (jnp.arange(n), per_chunk(_gather(q, None, ch.src)), *(per_chunk(x) for x in rows))
  new_state, o_rows = jax.lax.scan(step, state, xs)
  return _finish(o_rows.reshape(n * c, *o_rows.shape[2:]), new_state, prefix, rows, ch, req_indices, c)


def chunk_delta_rule(s0, q, k, v, g, beta):
  """One chunk of the delta rule: ``s0 [H, K, V]``, ``q, k, g [C, H, K]``, ``v [C, H, V]``,
  ``beta [C, H]`` -> ``(s1 [H, K, V], o [C, H, V])`` (the model's ``kda_chunked`` uses it too).
  Decays are taken per element, masked in the exponent (``exp`` of a later-minus-earlier ``gam`` can
  overflow), and ``(I + A)^-1`` by a triangular solve."""
  hp = _HP
  c = q.shape[0]
  gam = jnp.cumsum(g, axis=0)  # [C, H, K]
  diff = gam[:, None] - gam[None, :]  # [i, j, H, K]
  tri = jnp.tril(jnp.ones((c, c), bool))[:, :, None, None]
  strict = jnp.tril(jnp.ones((c, c), bool), -1)[:, :, None, None]
  decay_strict = jnp.exp(jnp.where(strict, diff, -jnp.inf))
  decay = jnp.exp(jnp.where(tri, diff, -jnp.inf))
  a = beta.T[:, :, None] * jnp.einsum("ihk,jhk,ijhk->hij", k, k, decay_strict, precision=hp)  # [H, C, C]
  eye = jnp.eye(c, dtype=a.dtype)
  inv = jax.scipy.linalg.solve_triangular(eye + a, jnp.broadcast_to(eye, a.shape), lower=True, unit_diagonal=True)
  # u = (I + A)^-1 (beta v - (beta k exp(gam)) s0), associated as the kernel does: the products
  # with the inverse do not depend on the state (w, u0), the state enters last.
  w = jnp.einsum("hij,jhk->hik", inv, beta[..., None] * k * jnp.exp(gam), precision=hp)  # [H, C, K]
  u0 = jnp.einsum("hij,jhv->hiv", inv, beta[..., None] * v, precision=hp)
  u = u0 - jnp.einsum("hck,hkv->hcv", w, s0, precision=hp)  # [H, C, V]
  m = jnp.einsum("ihk,jhk,ijhk->hij", q, k, decay, precision=hp)
  o = jnp.einsum("chk,hkv->hcv", q * jnp.exp(gam), s0, precision=hp) + jnp.einsum("hij,hjv->hiv", m, u, precision=hp)
  last = gam[-1]  # [H, K]
  s1 = s0 * jnp.exp(last)[..., None] + jnp.einsum("chk,hcv->hkv", k * jnp.exp(last[None] - gam), u, precision=hp)
  return s1, o.transpose(1, 0, 2)
