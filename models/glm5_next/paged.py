"""The paged forward: one step over a flat batch of tokens of many requests, on the jaxkv caches.

A step's tokens are ``[T]`` (bucketed), each with its request's block-table row (``req_indices``,
-1 for padding) and position; a request's tokens are contiguous and in position order, so one step
can hold prefill chunks (starting and ending anywhere, mid-pool included) and decode tokens
together. Every cache is read and written in place through ``jaxkv``:

* MLA latent: the group's manager-unit slots -> ``write_to_paged_cache``; read back by
  ``sparse_mla_decode`` (absorbed form) over the selected tokens.
* Pooled indexer keys + tail ring: the attention group's compressed slots and the ring's slots ->
  ``kpool_compress_and_write``; scored by ``paged_mqa_logits`` over the kernel-block table;
  selected by ``select_topk_tokens``.
* KDA: the request's state slot (its one block in the layer's group) is read, advanced token by
  token, and written back; a request whose first token in the step is position 0 starts from zero.

Slot mappings and kernel-block tables come in ``StepInputs.metadata``, computed for the whole
step before the model runs (``compute_step_metadata``: one launch on a GPU); the model never
re-derives them (draft steps recompute their slots with the metadata's own spec).
``PagedLayout.from_plan(plan)`` holds each cache's resolved ``KernelView``. The layer loop is
the reference model's own (``Glm5NextForCausalLM.hidden_states``), with the cached attention
injected.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxkv.cache.kernel_view import KernelView, find_view
from jaxkv.cache.kv_cache_config import KVCacheConfig
from jaxkv.step.step_inputs import StepInputs
from models.glm5_next.config import Glm5NextConfig
from models.glm5_next.model import Glm5NextForCausalLM, KimiDeltaAttention
from pallas_kernels.cache_write import encode_entries, write_to_paged_cache
from pallas_kernels import read_rows, resolve_implementation, write_rows
from pallas_kernels.kda_chunk import ChunkPrefix, chunk_kda
from pallas_kernels.kda_recurrence import fused_recurrent_kda
from pallas_kernels.kpool import kpool_compress_and_write
from pallas_kernels.mhc_mix import mhc_mix
from pallas_kernels.paged_mqa_logits import paged_mqa_logits, paged_mqa_logits_stages
from pallas_kernels.sparse_mla_decode import sparse_mla_decode, sparse_mla_decode_tiles
from pallas_kernels.topk_selection import select_topk_tokens

__all__ = ["PagedLayout", "kernel_fallbacks", "paged_forward", "paged_hidden_states", "paged_mtp_forward"]

_HP = jax.lax.Precision.HIGHEST
# Kernels that run compiled on any GPU whatever the switch: the KDA kernel keeps a token's
# arithmetic independent of its batch (the XLA scan does not, kda_recurrence.py), and the step
# metadata kernel is exact either way and one launch instead of several fusions, the top-k
# gives jax.lax.top_k's answer exactly in a fraction of XLA's time, the indexer's selection is
# exact either way and reads a row's visible entries where XLA sorts the whole row, and the mHC
# weights are one launch a call where XLA's fusions of the Sinkhorn rounds are dozens.
_COMPILED_ON_ANY_GPU = ("fused_recurrent_kda", "compute_step_metadata", "top_k", "select_topk_tokens", "mhc_mix")


def kernel_implementation(kernel: str, implementation: str) -> str:
  """The path ``kernel`` runs in the step under the runner's switch (``"pallas"`` or ``"xla"``,
  already resolved): the switch for the attention kernels; for those of ``_COMPILED_ON_ANY_GPU``
  ``resolve_implementation``'s ``"auto"``, or the interpreted kernel when the switch asks for
  ``"pallas"`` on the CPU."""
  if kernel in _COMPILED_ON_ANY_GPU:
    return resolve_implementation("pallas" if implementation == "pallas" else "auto")
  return implementation


@dataclasses.dataclass(frozen=True)
class PagedLayout:
  """The static facts the step needs of a plan: each cache's ``KernelView`` (with its entry
  encoding), the dtype of the states and tail rings, the tensors split over the tensor axis (``KVCacheTensor.shards``; their views are one device's) and
  the attention kernels that run their XLA path on this device (``xla_kernels``: no tiles of
  theirs fit its shared memory, ``kernel_fallbacks``)."""

  state_dtype: str
  views: tuple[KernelView, ...]
  split_tensors: tuple[tuple[str, int], ...] = ()
  xla_kernels: tuple[str, ...] = ()
  linear_prefill_chunk: int | None = None  # CacheConfig.linear_prefill_chunk

  @classmethod
  def from_plan(cls, plan: KVCacheConfig) -> PagedLayout:
    cc = plan.cache_config
    if not cc.dtypes_resolved:
      raise ValueError(
        f"the plan's cache dtypes are not resolved ({cc.kv_cache_dtype}, {cc.indexer_cache_dtype}, "
        f"{cc.state_dtype}): plan with cache_config.resolve_dtypes(the model's dtype), as "
        "jaxkv.engine.plan_for does."
      )
    split = tuple((t.name, t.shards) for t in plan.tensors if t.shards > 1)
    return cls(cc.state_dtype, plan.views, split, linear_prefill_chunk=cc.linear_prefill_chunk)

  def implementation(self, kernel: str, implementation: str) -> str:
    """``kernel``'s path under the step's switch: ``"xla"`` where it cannot run as a kernel here."""
    return "xla" if kernel in self.xla_kernels else implementation

  def shards(self, tensor: str) -> int:
    """Devices ``tensor`` is split over (1: one copy per device)."""
    return dict(self.split_tensors).get(tensor, 1)

  def view(self, name: str) -> KernelView:
    return find_view(self.views, name)


def kernel_fallbacks(config: Glm5NextConfig, layout: PagedLayout, shared_memory_bytes: int | None) -> dict[str, str]:
  """The attention kernels that cannot run compiled with ``shared_memory_bytes`` per program (None:
  no limit), each with the reason (its tile check's message): ``{kernel: reason}``."""
  checks = []  # (kernel, check) for each view the kernels read
  for v in layout.views:
    if v.layer_name.endswith(".mla"):
      args = (config.num_attention_heads, config.kv_lora_rank, v.cache_dtype, shared_memory_bytes)
      checks.append(("sparse_mla_decode", functools.partial(sparse_mla_decode_tiles, *args)))
    elif v.layer_name.endswith(".indexer"):
      args = (config.index_n_heads, 1, config.index_head_dim, v.entries_per_page, v.cache_dtype, shared_memory_bytes)
      checks.append(("paged_mqa_logits", functools.partial(paged_mqa_logits_stages, *args)))
  out = {}
  for kernel, check in checks:
    try:
      check()
    except ValueError as e:
      out.setdefault(kernel, str(e))
  return out


def _per_device(attn, fn, args, in_axes, out_axes):
  """``fn(*args)``; on a mesh, per device on its share of the axes named (``attn.head_sharding``,
  see ``sharding.HeadSharding.map``), or whole on every device where a split axis does not divide
  by the tensor size (rows of a small token bucket; head counts always divide)."""
  sharding = attn.head_sharding
  if sharding is None or any(a is not None and x.shape[a] % sharding.size for x, a in zip(args, in_axes)):
    return fn(*args)
  return sharding.map(fn, args, in_axes, out_axes)


def _kda_step(attn, x, caches, view: KernelView, inputs: StepInputs, layout: PagedLayout, implementation: str):
  """KDA over the flat batch on each request's state slots (its row of the layer's state group).

  A request owns ``S = 1 + num_speculative_tokens`` slots. The step continues from slot
  ``inputs.state_slots[r]``, advances token by token (``fused_recurrent_kda``: the conv windows
  are gathered for every token at once, the delta rule runs per request), and writes the state
  after each of the request's last ``S`` tokens in the step to slots ``0 .. S-1`` in order (the
  last token's to slot ``S-1``). After a verify step whose last ``n`` drafts were rejected, the state after the last
  accepted token is in slot ``S-1-n``: the host passes that slot next step, which is the rollback.

  Chunked prefill (``layout.linear_prefill_chunk``): the positions below a request's last chunk
  boundary of its prompt run by ``chunk_kda`` on that grid, the rest recurrently from the state
  it leaves. A step whose last token is chunkwise leaves in slot ``S-1`` the state at its
  chunk's start and the chunk's rows so far (the page's prefix), which the next step continues.

  The layer's cache split by head over the mesh's tensor axis (``layout.shards``): each device
  reads and writes its heads' page (``view`` is one device's) where it runs their recurrence.
  """
  h, k, kw = attn.h, attn.k, attn.kw
  c = h * k
  table = inputs.block_tables[view.kv_cache_group_id]  # [R, S] state blocks
  num_reqs, num_slots = table.shape
  arr = caches[view.tensor]
  sdt = jnp.dtype(layout.state_dtype)
  shards = layout.shards(view.tensor)
  # The chunked path only in steps with tokens below a prompt's chunk bound (StepInputs).
  chunk = layout.linear_prefill_chunk if inputs.num_prompt_tokens is not None else None
  if shards > 1 and (attn.head_sharding is None or attn.head_sharding.size != shards):
    raise ValueError(
      f"{view.layer_name} is split over {shards} devices by head, but the layer runs on "
      f"{1 if attn.head_sharding is None else attn.head_sharding.size}; plan the caches with the "
      "engine's tensor_parallel_size."
    )
  # Without the chunked path a page's chunk rows are neither read nor written: every token of the
  # step is past its prompt's bound, so they are never needed again.
  page = _StatePage(view, h // shards, k, kw - 1, sdt, chunk)
  # Split pages are read and written on each device (its heads' bytes); whole ones where they are.
  on_pages = lambda fn, args, in_axes, out_axes: (
    attn.head_sharding.map(fn, args, in_axes, out_axes) if shards > 1 else fn(*args)
  )
  rows = jnp.take_along_axis(table, inputs.state_slots[:, None], axis=1)[:, 0]
  # The kernel writes the states into their pages where its heads and the page's split agree (one
  # device, or pages split by head); a page whole on every device under a head-split recurrence
  # (packed, on a mesh) gets the states gathered from the devices and written by XLA. It reads
  # them from the pages too unless they come from elsewhere (that case, or chunk_kda's).
  in_place = attn.head_sharding is None or shards > 1
  read_states = chunk is not None or not in_place
  state_axes = (1,) + (2,) * len(page._prefix_shapes) if read_states else ()
  conv, *states = on_pages(functools.partial(page.read, states=read_states), (arr, rows), (1, None), (3, *state_axes))
  # Requests with tokens in this step; one whose first token is position 0 starts from zero state
  # (its block may be recycled and hold another request's bytes).
  req, pos = inputs.req_indices, inputs.positions
  ri = jnp.maximum(req, 0)
  seen = jnp.where(req >= 0, req, num_reqs)
  fresh = jnp.zeros((num_reqs,), bool).at[seen].set(True, mode="drop")
  first_pos = jnp.full((num_reqs,), 2**30, jnp.int32).at[seen].min(pos, mode="drop")
  last_pos = jnp.full((num_reqs,), -1, jnp.int32).at[seen].max(pos, mode="drop")
  starts_at_zero = fresh & (first_pos == 0)
  conv = jnp.where(starts_at_zero[:, None, None, None], 0, conv).astype(x.dtype)  # [R, 3, kw-1, C]
  if read_states:
    rec, *prefix = states
    rec = jnp.where(starts_at_zero[:, None, None, None], 0.0, rec)
  # Slot of each token's resulting state; out of range (dropped) for the earlier tokens of a chunk.
  slot = (num_slots - 1) - (last_pos[ri] - pos)
  slot = jnp.where((req >= 0) & (slot >= 0), slot, num_slots)
  if chunk is not None:
    # Chunkwise tokens have no state of their own: only a request's last token names a slot.
    limit = inputs.num_prompt_tokens // chunk * chunk
    chunked = (req >= 0) & (pos < limit[ri])
    slot = jnp.where(chunked & (slot != num_slots - 1), num_slots, slot)
  written = jnp.zeros((num_reqs, num_slots), bool).at[seen, slot].set(True, mode="drop")

  mixed = attn.project(x)  # 3 x [T, C]
  g, beta = attn.gates(x)  # [T, H, K], [T, H]
  # Each token's conv window, oldest first: its request's kw-1 previous inputs come from this
  # step's tokens (a request's tokens are contiguous) or, before the chunk, from the conv state.
  t = x.shape[0]
  rank = jnp.where(req >= 0, pos - first_pos[ri], 0)[:, None]  # [T, 1]
  tap = jnp.arange(kw, dtype=jnp.int32)[None, :]
  lag = (kw - 1) - tap
  src = jnp.where(rank >= lag, jnp.arange(t, dtype=jnp.int32)[:, None] - lag, t + ri[:, None] * (kw - 1) + tap + rank)
  raws = [jnp.concatenate([m, conv[:, i].reshape(-1, c)]) for i, m in enumerate(mixed)]  # 3 x [T + R * (kw-1), C]
  q, kk, v = attn.conv_qkv([r[src] for r in raws], x.dtype)  # windows 3 x [T, kw, C]
  # The conv state after a token is its window's last kw-1 inputs, gathered for the token of each
  # slot only (a slot no token names is not written): a scatter of every token's window, most of
  # them dropped, read all T windows (0.7 ms a layer in an 8,192-token step on an H100).
  slot_token = jnp.full((num_reqs, num_slots), t - 1, jnp.int32).at[seen, slot].set(jnp.arange(t), mode="drop")
  conv_slots = jnp.stack([r[src[slot_token, 1:]] for r in raws], axis=2)  # [R, S, 3, kw-1, C]
  if chunk is not None:
    # Heads on axis 1 of the token arrays and the state, 2 of the prefix's.
    chunk_fn = functools.partial(_chunk_kda_flat, implementation=layout.implementation("chunk_kda", implementation))
    args = (q, kk, v, g, beta, rec, *prefix, jnp.where(chunked, req, -1), pos)
    o_c, rec, *prefix = _per_device(attn, chunk_fn, args, (1,) * 6 + (2,) * 4 + (None, None), (1, 1) + (2,) * 4)
    req_recurrent = jnp.where(chunked, -1, req)
  else:
    req_recurrent = req
  kda = functools.partial(
    fused_recurrent_kda, implementation=kernel_implementation("fused_recurrent_kda", implementation)
  )
  if in_place:
    start, start_axis = (rec, 1) if read_states else (jnp.where(starts_at_zero, -1, rows), None)
    args = (q, kk, v, g, beta, start, arr, table, req_recurrent, slot)
    o, arr = on_pages(functools.partial(page.recurrence, kda), args, (1,) * 5 + (start_axis, 1) + (None,) * 3, (1, 1))
  else:

    def to_slots(q, k, v, g, beta, state, req_indices, slot):
      words = jnp.zeros((num_reqs * num_slots, state[0].size), jnp.uint32)
      dest = jnp.arange(num_reqs * num_slots, dtype=jnp.int32).reshape(num_reqs, num_slots)
      o, words = kda(q, k, v, g, beta, state, words, dest, req_indices, slot)
      return o, jax.lax.bitcast_convert_type(words, jnp.float32).reshape(num_reqs, num_slots, *state.shape[1:])

    args = (q, kk, v, g, beta, rec, req_recurrent, slot)
    o, rec_slots = _per_device(attn, to_slots, args, in_axes=(1,) * 6 + (None, None), out_axes=(1, 2))
  if chunk is not None:
    o = jnp.where(chunked[:, None, None], o_c, o)
    # A request whose last token is chunkwise: its last slot gets the state at that chunk's start
    # (the recurrence left it empty) and the chunk's rows.
    ends_chunked = fresh & (last_pos < limit)
  y = attn.output(o, x)
  # Write back the slots this step produced; chunk rows only where a step ends inside a chunk
  # (every other page's rows are never read again).
  dest = jnp.where(written, table, arr.shape[0]).reshape(-1)
  if in_place:
    arr = on_pages(page.write, (arr, dest, conv_slots.astype(sdt)), (1, None, 4), (1,))
    if chunk is not None:
      last = jnp.where(ends_chunked, table[:, -1], arr.shape[0])
      arr = on_pages(page.write_state, (arr, last, rec), (1, None, 1), (1,))
  else:
    if chunk is not None:
      rec_slots = rec_slots.at[:, -1].set(jnp.where(ends_chunked[:, None, None, None], rec, rec_slots[:, -1]))
    arr = on_pages(page.write, (arr, dest, conv_slots.astype(sdt), rec_slots), (1, None, 4, 2), (1,))
  if chunk is not None:
    dest = jnp.where(ends_chunked, table[:, -1], arr.shape[0])
    arr = on_pages(page.write_prefix, (arr, dest, *prefix), (1, None) + (2,) * len(prefix), (1,))
  return y, {**caches, view.tensor: arr}


def _chunk_kda_flat(q, k, v, g, beta, state, pk, pg, pv, pb, req_indices, positions, *, implementation):
  """``chunk_kda`` with the prefix as four arrays (each split by head on a mesh) and returned so."""
  o, state, prefix = chunk_kda(
    q, k, v, g, beta, state, ChunkPrefix(pk, pg, pv, pb), req_indices, positions, implementation=implementation
  )
  return (o, state, *prefix)


@dataclasses.dataclass(frozen=True)
class _StatePage:
  """One device's KDA page: the q, k, v conv windows ``[3, kw-1, C]`` (state dtype), then the
  delta-rule state ``[H, K, K]`` (float32), for that device's ``H`` heads (``C = H * K``); with
  chunked prefill (``chunk`` rows) then the unfinished chunk's ``k, g, v [chunk, H, K]`` and
  ``beta [chunk, H]`` (float32, ``ChunkPrefix``). Pages are read and written as whole contiguous
  rows of 32-bit words, one slice per request."""

  view: KernelView
  heads: int
  head_dim: int
  conv_rows: int
  state_dtype: jnp.dtype
  chunk: int | None = None

  @property
  def _conv_words(self) -> int:
    return self.conv_rows * 3 * self.heads * self.head_dim * self.state_dtype.itemsize // 4

  @property
  def state_word(self) -> int:
    """The state's first 32-bit word in a page row (after the conv windows)."""
    return self.view.offset_bytes // 4 + self._conv_words

  @property
  def _prefix_shapes(self) -> tuple[tuple[int, ...], ...]:
    if self.chunk is None:
      return ()
    h, d = self.heads, self.head_dim
    return ((self.chunk, h, d),) * 3 + ((self.chunk, h),)

  def read(self, arr, rows, states=True):
    """Conv windows ``[R, 3, kw-1, C]`` of blocks ``rows``, then (``states``) their states
    ``[R, H, K, K]`` and (chunked) the prefix's four arrays ``[R, chunk, H, ...]``."""
    n_conv, c = self._conv_words, self.heads * self.head_dim
    shapes = ((self.heads, self.head_dim, self.head_dim),) + self._prefix_shapes if states else ()
    sizes = [math.prod(s) for s in shapes]
    raw = read_rows(arr, rows, self.view.offset_bytes // 4, n_conv + sum(sizes))
    conv = _from_words(raw[:, :n_conv], self.state_dtype).reshape(-1, 3, self.conv_rows, c)
    out, at = [conv], n_conv
    for shape, n in zip(shapes, sizes):
      out.append(jax.lax.bitcast_convert_type(raw[:, at : at + n], jnp.float32).reshape(-1, *shape))
      at += n
    return tuple(out)

  def write(self, arr, dest, conv_slots, rec_slots=None):
    """``arr`` with slots ``[R, S, 3, kw-1, C]`` / ``[R, S, H, K, K]`` written to blocks ``dest [R * S]``
    (out of range: not written); without ``rec_slots``, the conv windows only."""
    num_reqs, num_slots = conv_slots.shape[:2]
    parts = [conv_slots] + ([] if rec_slots is None else [rec_slots])
    new = jnp.concatenate([_to_words(p).reshape(num_reqs, num_slots, -1) for p in parts], axis=2)
    return write_rows(arr, dest, self.view.offset_bytes // 4, new.reshape(num_reqs * num_slots, -1))

  def write_state(self, arr, dest, state):
    """``arr`` with the states ``[R, H, K, K]`` written to blocks ``dest [R]`` (out of range: not
    written)."""
    return write_rows(arr, dest, self.state_word, _to_words(state).reshape(state.shape[0], -1))

  def write_prefix(self, arr, dest, *prefix):
    """``arr`` with the prefix's four arrays ``[R, chunk, H, ...]`` written after the state of
    blocks ``dest [R]`` (out of range: not written)."""
    new = jnp.concatenate([_to_words(p).reshape(p.shape[0], -1) for p in prefix], axis=1)
    return write_rows(arr, dest, self.state_word + self.heads * self.head_dim**2, new)

  def recurrence(self, kda, q, k, v, g, beta, start, arr, dest, req_indices, slot):
    """``fused_recurrent_kda`` writing the saved states straight into their pages of ``arr``:
    ``(o, arr)``. ``start``: the states to start from (float32 ``[R, H, K, K]``) or the blocks
    holding them (int32 ``[R]``, -1: zeros), which the kernel reads itself."""
    state, src = (None, start) if start.dtype == jnp.int32 else (start, None)
    return kda(q, k, v, g, beta, state, arr, dest, req_indices, slot, src=src, offset=self.state_word)


def _from_words(w, dtype):
  """uint32 words ``[..., W]`` as ``dtype`` values ``[..., W * 4 / itemsize]`` (little-endian order)."""
  return jax.lax.bitcast_convert_type(w, dtype).reshape(*w.shape[:-1], -1)


def _to_words(x):
  """Values ``[..., n]`` (n * itemsize a multiple of 4) as uint32 words, the inverse of ``_from_words``."""
  per = 4 // x.dtype.itemsize
  return jax.lax.bitcast_convert_type(x.reshape(*x.shape[:-1], -1, per) if per > 1 else x, jnp.uint32)


def _dsa_step(
  attn,
  x,
  caches,
  layout: PagedLayout,
  name: str,
  inputs: StepInputs,
  prev_indices,
  implementation,
  *,
  share_indices: bool = False,
):
  """Sparse MLA over the paged latent cache with the pooled indexer; returns ``(y, caches, indices)``.

  ``prev_indices`` are attended with instead of running the indexer in layers without one, and
  everywhere when ``share_indices`` (no scoring, no indexer-cache write).
  """
  t = x.shape[0]
  mla, idx, tail = (layout.view(f"{name}.{s}") for s in ("mla", "indexer", "indexer_tail"))
  req, pos = inputs.req_indices, inputs.positions
  table = inputs.block_tables[mla.kv_cache_group_id]
  q_resid, c_kv = attn.latent(x[None])
  q_resid, c_kv = q_resid[0], c_kv[0]
  meta = inputs.metadata
  slots = meta.slot_mappings[mla.kv_cache_group_id]
  caches = dict(caches)
  caches[mla.tensor] = write_to_paged_cache(
    caches[mla.tensor], encode_entries(c_kv, mla.cache_dtype), slots, view=mla, implementation=implementation
  )
  if attn.indexer is not None and not share_indices:
    ind = attn.indexer
    q, key, gate, w = ind.project(x[None], q_resid[None])
    q, key, gate, w = q[0], key[0], gate[0], w[0]
    kt = meta.kernel_block_tables[idx.attention_group_id]
    kt = table if kt is None else kt
    cslots = meta.compressed_slot_mappings[idx.attention_group_id]
    tail_slots = meta.slot_mappings[tail.kv_cache_group_id]
    shared = idx.tensor == tail.tensor
    cache, tail_arr = kpool_compress_and_write(
      caches[idx.tensor],
      None if shared else caches[tail.tensor],
      key,
      gate,
      ind.index_kpool_compress_ape[...].astype(jnp.float32),
      pos,
      req,
      tail_slots,
      cslots,
      view=idx,
      tail_view=tail,
      kpool=ind.kpool,
      implementation=implementation,
    )
    caches[idx.tensor] = cache
    if not shared:
      caches[tail.tensor] = tail_arr
    rows = jnp.maximum(req, 0)
    q_in = q.astype(jnp.float32) if idx.cache_dtype == "float32" else q
    # relu(c * s) = c * relu(s) for c > 0: the 1/sqrt(K) score scale folds into the head weights.
    # Rows are independent and summed over all heads: on a mesh each device scores its share of the
    # step's tokens (the head sum stays whole, so each row's arithmetic is the single-device one).
    mqa = functools.partial(
      paged_mqa_logits,
      view=idx,
      implementation=layout.implementation("paged_mqa_logits", implementation),
    )
    select = functools.partial(
      select_topk_tokens,
      kpool=ind.kpool,
      index_topk=ind.topk,
      implementation=kernel_implementation("select_topk_tokens", implementation),
    )

    def score_and_select(q, cache, w, pools, table, seq_lens):
      return select(mqa(q, cache, w, pools, table), seq_lens)

    args = (q_in[:, None], caches[idx.tensor], w * ind.k**-0.5, ((pos + 1) // ind.kpool)[:, None], kt[rows], pos + 1)
    indices = _per_device(attn, score_and_select, args, in_axes=(0, None, 0, 0, 0, 0), out_axes=(0,))
    indices = jnp.where((req >= 0)[:, None], indices, -1)
  else:
    indices = prev_indices
  # Absorbed MLA: q~ = W_UK^T q per head, attention over the latent rows, then W_UV.
  w_kvb = attn.kv_b_proj.weight[...].reshape(attn.h, attn.dk + attn.dv, -1)
  q = attn.q_b_proj(q_resid).reshape(t, attn.h, attn.dk)
  q_lat = jnp.einsum("thk,hkl->thl", q, w_kvb[:, : attn.dk].astype(q.dtype), precision=_HP)
  decode = functools.partial(
    sparse_mla_decode,
    view=mla,
    sm_scale=attn.dk**-0.5,
    implementation=layout.implementation("sparse_mla_decode", implementation),
  )
  # q_lat in its own dtype: both paths widen it exactly (the kernel's products take bf16 queries for
  # bf16 and fp8 latents); a float32 copy (1 GiB at an 8,192-token step) was written, then read
  # in place of the bf16 one.
  args = (q_lat, caches[mla.tensor], indices, req, table)
  o_lat = _per_device(attn, decode, args, in_axes=(1, None, None, None, None), out_axes=(1,))
  o = jnp.einsum("thl,hvl->thv", o_lat.astype(x.dtype), w_kvb[:, attn.dk :].astype(x.dtype), precision=_HP)
  return attn.o_proj(o.reshape(t, -1)), caches, indices


def paged_hidden_states(
  model: Glm5NextForCausalLM,
  caches: dict[str, jax.Array],
  inputs: StepInputs,
  layout: PagedLayout,
  *,
  implementation: str = "xla",
):
  """One step of the trunk: post-final-norm hidden states ``[T, D]`` and the updated caches.

  Args:
    model: the Flax model.
    caches: the plan's backing arrays (``KVCacheConfig.allocate``), updated functionally (donate
      them to the jitted step to update in place).
    inputs: the step's tokens, block tables and kernel-block tables.
    layout: ``PagedLayout.from_plan(plan)``.
    implementation: the kernels' switch, ``"pallas"`` or ``"xla"``.
  """

  def attend(i, attn, x, prev_indices, caches):  # x: [1, T, D], the step's tokens as one sequence
    name = f"layers.{i}.self_attn"
    if isinstance(attn, KimiDeltaAttention):
      view = layout.view(f"{name}.kda")
      y, caches = _kda_step(attn, x[0], caches, view, inputs, layout, implementation)
      return y[None], None, caches
    y, caches, indices = _dsa_step(attn, x[0], caches, layout, name, inputs, prev_indices, implementation)
    return y[None], indices, caches

  mix = functools.partial(mhc_mix, implementation=kernel_implementation("mhc_mix", implementation))
  hidden, caches = model.hidden_states(inputs.input_ids[None], attend=attend, carry=caches, mix=mix)
  return hidden[0], caches


def paged_forward(
  model: Glm5NextForCausalLM,
  caches: dict[str, jax.Array],
  inputs: StepInputs,
  layout: PagedLayout,
  *,
  implementation: str = "xla",
  logits_indices: Int[Array, " S"] | None = None,
):
  """One step: logits ``[T, V]`` of every token (or ``[S, V]`` of ``logits_indices``) and the caches.

  ``logits_indices``: the tokens whose logits are needed (each sampling request's last token); the
  head then runs on those rows only. Other arguments as ``paged_hidden_states``.
  """
  hidden, caches = paged_hidden_states(model, caches, inputs, layout, implementation=implementation)
  if logits_indices is not None:
    hidden = hidden[jnp.maximum(logits_indices, 0)]
  return model.logits(hidden), caches


def paged_mtp_forward(
  model: Glm5NextForCausalLM,
  caches: dict[str, jax.Array],
  hidden: Float[Array, "T D"],
  next_ids: Int[Array, " T"],
  inputs: StepInputs,
  layout: PagedLayout,
  *,
  implementation: str = "xla",
  shared_indices: Int[Array, "T W"] | None = None,
):
  """The MTP layer over a step's tokens: draft hidden ``h' [T, D]``, the caches and the index rows.

  Token ``t`` at position ``p`` combines the trunk's hidden ``h_p`` with the embedding of the token
  at ``p + 1`` (``next_ids``; zeroed at position 0) and writes the MTP layer's own latent, pooled-key
  and tail-ring caches (layer index ``num_hidden_layers``) at ``p``; ``model.logits(h')`` drafts
  the token at ``p + 2``.

  Args:
    shared_indices: index rows ``[T, W]`` to attend with instead of running the indexer (draft
      steps >= 1 under ``index_share_for_mtp_iteration``: no scoring, no indexer-cache write).
  """
  name = f"layers.{model.config.num_hidden_layers}.self_attn"

  def attend(attn, x, _, caches):
    y, caches, indices = _dsa_step(
      attn, x[0], caches, layout, name, inputs, shared_indices, implementation, share_indices=shared_indices is not None
    )
    return y[None], indices, caches

  h, indices, caches = model.mtp(
    hidden[None], model.embed_tokens[...][next_ids][None], inputs.positions[None], attend=attend, carry=caches
  )
  return h[0], caches, indices
