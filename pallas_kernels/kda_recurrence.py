"""Fused recurrent KDA: every request's tokens of a step advanced through its delta-rule state in one launch.

For request ``r`` (its tokens contiguous and in order in the flat batch, as ``StepInputs`` lays them
out) and head ``h``, from ``s = state[r, h]`` (``[K, V]`` float32), token by token:

    s <- diag(exp(g_t)) s;   u = beta_t (v_t - s^T k_t);   s <- s + k_t u^T;   o_t = s^T q_t

(or, given ``src``, from the state in page row ``src[r]``: zeros when out of range), and the
state after token ``t`` is saved when ``0 <= slot[t] < S`` (``S`` state slots per request:
the last ``S`` tokens' states, for speculative rollback) to the page of that slot,
``pages[dest[r, slot[t]]]``, as float32 bits at word ``offset`` of the row. ``pages`` is the
cache's own backing array seen as 32-bit words: the kernel reads and writes the states where they
live, so a step moves each state once in and once out, the traffic the decode roofline counts (a
states buffer gathered from the pages and scattered back moved it four more times:
docs/performance.md).

Why a kernel: one program per (request, head, block of V) runs its request's tokens in order with
the same code whatever else is in the batch, so a token's output and states are bitwise the same
decoded alone, in a batch, or inside a prefill chunk of any length. XLA's batched (a decode batch)
and unbatched (one token of a scan) forms of the same math round differently on the GPU, which
breaks the engine's bitwise equivalence across schedules. It is also the fast path: the state
stays in registers across a prefill chunk's tokens instead of one XLA loop iteration per token
(``docs/performance.md``). fla's ``fused_recurrent_kda`` is the same idea in Triton.

``"xla"`` is the CPU path and the reference: a ``lax.scan`` over the flat tokens.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float, Int, UInt8, UInt32

from pallas_kernels._common import (
  as_bytes,
  as_words,
  default_interpret,
  read_rows,
  resolve_implementation,
  write_rows,
)

__all__ = [
  "fused_recurrent_kda",
  "fused_recurrent_kda_reference",
  "delta_rule_step",
  "check_delta_rule_inputs",
  "request_spans",
]


def _kda_kernel(
  start_ref,
  len_ref,
  slot_ref,
  dest_ref,
  q_ref,
  k_ref,
  v_ref,
  g_ref,
  beta_ref,
  init_ref,
  pages_in_ref,
  o_ref,
  pages_ref,
  *,
  block_v,
  num_slots,
  offset,
  from_pages,
):
  # start_ref / len_ref: [R] first flat token and token count of each request; slot_ref: [T];
  # dest_ref: [R, S] page of each slot; q/k/g: [T, H, K], v: [T, H, V], beta: [T, H];
  # init_ref: the states [R, H, K, V], or (from_pages) [R] the page row of each request's;
  # o_ref: [T, H, V]; pages_ref: uint32 [N, W] (aliases pages_in_ref).
  r, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  cols = pl.ds(vb * block_v, block_v)
  start, end = start_ref[r], start_ref[r] + len_ref[r]
  kd, vd = q_ref.shape[2], v_ref.shape[2]
  # This program's [K, block_v] tile of the state in a page row: [H, K, V] from word ``offset``.
  words = (
    offset
    + h * (kd * vd)
    + jax.lax.broadcasted_iota(jnp.int32, (kd, block_v), 0) * vd
    + vb * block_v
    + jax.lax.broadcasted_iota(jnp.int32, (kd, block_v), 1)
  )

  # The request's slot pages, read once: a page read inside the loop would be a dependent load
  # (slot, then page) whose branch every token waits on.
  dests = [dest_ref[r, i] for i in range(num_slots)]

  def load(t):
    return (q_ref[t, h, :], k_ref[t, h, :], v_ref[t, h, cols], g_ref[t, h, :], beta_ref[t, h], slot_ref[t])

  def body(t, carry):
    s, (q, k, v, g, beta, slot) = carry
    # Issue the next token's loads before this token's math: the loop is a chain of dependent
    # updates, so hiding the global-load latency behind it is what a long prefill chunk gains.
    nxt = load(jnp.minimum(t + 1, end - 1))
    s = s * jnp.exp(g)[:, None]
    u = beta * (v - jnp.sum(s * k[:, None], axis=0))
    s = s + k[:, None] * u[None, :]
    o_ref[t, h, cols] = jnp.sum(s * q[:, None], axis=0)

    page = dests[0]
    for i in range(1, num_slots):
      page = jnp.where(slot == i, dests[i], page)

    @pl.when((slot >= 0) & (slot < num_slots) & (page >= 0) & (page < pages_ref.shape[0]))
    def _():
      pages_ref[page, words] = jax.lax.bitcast_convert_type(s, jnp.uint32)

    return s, nxt

  @pl.when(end > start)
  def _():
    if from_pages:
      # Read before any write of this tile: only this program reads or writes it.
      row = init_ref[r]
      found = (row >= 0) & (row < pages_ref.shape[0])
      tile = pages_in_ref[jnp.clip(row, 0, pages_ref.shape[0] - 1), words]
      s = jnp.where(found, jax.lax.bitcast_convert_type(tile, jnp.float32), 0.0)
    else:
      s = init_ref[r, h, :, cols]
    jax.lax.fori_loop(start, end, body, (s, load(start)))


def request_spans(req_indices, num_reqs: int):
  """Each request's first flat token (``T`` if none) and token count, ``int32 [R]`` each, from
  ``req_indices`` (-1: skipped); a request's tokens are contiguous."""
  t = req_indices.shape[0]
  seen = jnp.where(req_indices >= 0, req_indices, num_reqs)
  start = jnp.full((num_reqs,), t, jnp.int32).at[seen].min(jnp.arange(t, dtype=jnp.int32), mode="drop")
  return start, jnp.zeros((num_reqs,), jnp.int32).at[seen].add(1, mode="drop")


def check_delta_rule_inputs(q, k, v, g, beta, state, *float32_arrays, **index_arrays) -> None:
  """The checks both KDA kernels share: ``q, k, g [T, H, K]``, ``v [T, H, V]``, ``beta [T, H]``,
  ``state [R, H, K, V]``, each of ``index_arrays`` int32 ``[T]``, all of them and
  ``float32_arrays`` (the kernel's other state) float32."""
  t, h, kd = q.shape
  vd = state.shape[-1]
  if k.shape != q.shape or g.shape != q.shape or v.shape != (t, h, vd) or beta.shape != (t, h):
    raise ValueError(
      f"q, k, g must be [T, H, K], v [T, H, V] and beta [T, H] of one T, H; got q {list(q.shape)}, "
      f"k {list(k.shape)}, g {list(g.shape)}, v {list(v.shape)}, beta {list(beta.shape)}."
    )
  if state.ndim != 4 or state.shape[1:] != (h, kd, vd):
    raise ValueError(f"state must be [R, H, K, V] = [R, {h}, {kd}, {vd}], got {list(state.shape)}.")
  for name, a in index_arrays.items():
    if a.shape != (t,) or a.dtype != jnp.int32:
      raise ValueError(f"{name} must be int32[{t}], got {a.dtype}{list(a.shape)}.")
  if any(a.dtype != jnp.float32 for a in (q, k, v, g, beta, state, *float32_arrays)):
    raise ValueError("q, k, v, g, beta and the states must be float32 (the recurrence runs in float32).")


def _validate(q, k, v, g, beta, state, pages, dest, req_indices, slot, offset, src):
  if (state is None) == (src is None):
    raise ValueError(
      "Give the starting states either as state [R, H, K, V] or as src [R] (their page rows), not both or neither."
    )
  if state is None:
    if src.ndim != 1 or src.dtype != jnp.int32:
      raise ValueError(f"src must be int32 [R] (each request's page row), got {src.dtype}{list(src.shape)}.")
    state = jax.ShapeDtypeStruct((src.shape[0], *q.shape[1:], v.shape[-1]), jnp.float32)
  check_delta_rule_inputs(q, k, v, g, beta, state, req_indices=req_indices, slot=slot)
  r, h, kd, vd = state.shape
  if pages.ndim != 2 or not (pages.dtype == jnp.uint32 or (pages.dtype == jnp.uint8 and pages.shape[1] % 4 == 0)):
    raise ValueError(
      "pages must be uint32 [N, W] (the pages' 32-bit words) or their bytes uint8 [N, 4W], got "
      f"{pages.dtype}{list(pages.shape)}."
    )
  w = pages.shape[1] * pages.dtype.itemsize // 4
  if dest.ndim != 2 or dest.shape[0] != r or dest.dtype != jnp.int32:
    raise ValueError(f"dest must be int32 [R, S] with R = {r}, got {dest.dtype}{list(dest.shape)}.")
  if not 0 <= offset <= w - h * kd * vd:
    raise ValueError(
      f"offset must place a state of H * K * V = {h * kd * vd} words inside a page of W = {w} "
      f"words, got offset {offset}."
    )


@functools.partial(
  jax.jit,
  static_argnames=("offset", "block_v", "num_warps", "implementation", "interpret"),
  donate_argnames=("pages",),
)
def fused_recurrent_kda(
  q: Float[Array, "T H K"],
  k: Float[Array, "T H K"],
  v: Float[Array, "T H V"],
  g: Float[Array, "T H K"],
  beta: Float[Array, "T H"],
  state: Float[Array, "R H K V"] | None,
  pages: UInt32[Array, "N W"] | UInt8[Array, "N W4"],
  dest: Int[Array, "R S"],
  req_indices: Int[Array, " T"],
  slot: Int[Array, " T"],
  *,
  src: Int[Array, " R"] | None = None,
  offset: int = 0,
  block_v: int = 32,
  num_warps: int = 2,
  implementation: str = "auto",
  interpret: bool | None = None,
) -> tuple[Float[Array, "T H V"], UInt32[Array, "N W"] | UInt8[Array, "N W4"]]:
  """The delta rule over each request's tokens; returns ``(o, pages)``.

  Args:
    q, k, g: float32 ``[T, H, K]`` (normed query and key, log-decay); v: ``[T, H, V]``;
      beta: ``[T, H]`` write strength.
    state: float32 ``[R, H, K, V]`` the state each request starts from; None with ``src``.
    pages: uint32 ``[N, W]``, or the same words' bytes uint8 ``[N, 4W]`` (donated): the state
      after token ``t`` of request ``r`` goes, as float32 bits in ``[H, K, V]`` order, to words
      ``[offset, offset + H*K*V)`` of row ``dest[r, slot[t]]``; every other word keeps its value.
    dest: int32 ``[R, S]`` the page row of each request's ``S`` state slots; out of ``[0, N)``:
      not saved.
    req_indices: int32 ``[T]`` request of each token, -1 for padding; a request's tokens are
      contiguous and in order (``StepInputs``).
    slot: int32 ``[T]`` state slot of each token; outside ``[0, S)``: not saved.
    src: int32 ``[R]`` instead of ``state``: each request starts from the state at ``offset`` of
      page row ``src[r]`` (out of ``[0, N)``: zeros), read by the kernel. No request's ``dest``
      may name another's ``src`` row: on a GPU that read would race with the write.
    offset: the state's first word in a page row (static).
    block_v, num_warps: the kernel's tile of V and Triton's warps.
    implementation: ``"pallas"``, ``"xla"`` or ``"auto"`` (``resolve_implementation``).
  Returns:
    ``o`` float32 ``[T, H, V]`` (zero for padding tokens) and the updated ``pages`` (their dtype
    and shape).
  """
  _validate(q, k, v, g, beta, state, pages, dest, req_indices, slot, offset, src)
  if resolve_implementation(implementation) == "xla":
    return fused_recurrent_kda_reference(
      q, k, v, g, beta, state, pages, dest, req_indices, slot, src=src, offset=offset
    )
  t, h, _ = q.shape
  r, num_slots = dest.shape
  vd = v.shape[-1]
  bv = min(block_v, vd)
  if vd % bv or bv & (bv - 1):
    raise ValueError(f"block_v must be a power of two dividing V = {vd}, got {bv}.")
  start, count = request_spans(req_indices, r)
  words = as_words(pages)
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  o, words = pl.pallas_call(
    functools.partial(_kda_kernel, block_v=bv, num_slots=num_slots, offset=offset, from_pages=state is None),
    out_shape=(jax.ShapeDtypeStruct((t, h, vd), jnp.float32), jax.ShapeDtypeStruct(words.shape, jnp.uint32)),
    # Requests first. The blocks of V first (programs sharing q, k, g rows side by side, as
    # chunk_kda's state kernel runs) measured 13% slower at 32 x 256 tokens on an H100 (docs/kernels.md).
    grid=(r, h, vd // bv),
    in_specs=[any_spec] * 11,
    out_specs=(any_spec, any_spec),
    input_output_aliases={10: 1},
    interpret=default_interpret(interpret),
    compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
    name="fused_recurrent_kda",
  )(start, count, slot, dest, q, k, v, g, beta, src if state is None else state, words)
  # Padding tokens belong to no program: their rows were never written.
  return jnp.where((req_indices >= 0)[:, None, None], o, 0.0), as_bytes(words, pages)


def fused_recurrent_kda_reference(q, k, v, g, beta, state, pages, dest, req_indices, slot, *, src=None, offset=0):
  """Plain jnp, same arguments: a scan over the flat tokens, each on its own request's state, then
  the saved states written to their pages."""
  r, num_slots = dest.shape
  if state is None:
    n, size = pages.shape[0], q.shape[1] * q.shape[2] * v.shape[2]
    words = read_rows(pages, jnp.clip(src, 0, n - 1), offset, size)
    found = ((src >= 0) & (src < n))[:, None]
    state = jnp.where(found, jax.lax.bitcast_convert_type(words, jnp.float32), 0.0).reshape(r, *q.shape[1:], -1)
  dst = jnp.where(req_indices >= 0, req_indices, r)  # padding: out of range, dropped
  sl = jnp.where((slot >= 0) & (slot < num_slots), slot, num_slots)

  def step(carry, inp):
    s_all, saved = carry
    d, sl_t, qt, kt, vt, gt, bt = inp
    new, o = delta_rule_step(s_all[jnp.minimum(d, r - 1)], qt, kt, vt, gt, bt)
    s_all = s_all.at[d].set(new, mode="drop")
    saved = saved.at[d, sl_t].set(new, mode="drop")
    return (s_all, saved), jnp.where(d < r, o, 0.0)

  saved = jnp.zeros((r, num_slots, *state.shape[1:]), jnp.float32)
  (_, saved), o = jax.lax.scan(step, (state, saved), (dst, sl, q, k, v, g, beta))
  named = jnp.zeros((r, num_slots), bool).at[dst, sl].set(True, mode="drop")
  rows = jnp.where(named, dest, pages.shape[0]).reshape(-1)  # not named, or out of range: dropped
  words = jax.lax.bitcast_convert_type(saved, jnp.uint32).reshape(r * num_slots, -1)
  return o, write_rows(pages, rows, offset, words)


def delta_rule_step(s, q, k, v, g, beta):
  """One token of the delta rule for any leading dims: ``s [..., K, V]``, ``q, k, g [..., K]``,
  ``v [..., V]``, ``beta [...]`` -> ``(s, o [..., V])`` (the model's reference uses it too)."""
  hp = jax.lax.Precision.HIGHEST
  s = s * jnp.exp(g)[..., None]
  u = beta[..., None] * (v - jnp.einsum("...kv,...k->...v", s, k, precision=hp))
  s = s + k[..., None] * u[..., None, :]
  return s, jnp.einsum("...kv,...k->...v", s, q, precision=hp)
