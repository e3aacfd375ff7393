"""The decode engine: a jitted step over bucketed fixed shapes, with the caches donated.

Host bookkeeping (scheduler, block pool, block tables, sampling metadata) is NumPy and Python; each
step sends one tuple of arrays to the device and brings one tuple back. The device step runs the
model's paged forward over the step's tokens and samples every request row. Its shapes are fixed
per token bucket (``token_buckets``; the request dimension is always ``max_num_reqs``), so after
one compilation per bucket nothing compiles: ``num_compilations`` counts them. jit's cache of
compiled executables plays the role of vLLM's CUDA graphs.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.block_table import MultiGroupBlockTable
from jaxkv.engine.request import Request, RequestOutput, RequestStatus, SamplingParams
from jaxkv.engine.sampler import sample
from jaxkv.engine.scheduler import Scheduler
from jaxkv.kv_cache_config import plan_kv_cache
from jaxkv.kv_cache_manager import KVCacheManager

__all__ = ["EngineConfig", "LLMEngine"]


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Static engine settings.

  Attributes:
    block_size: manager block size; kernel_block_size: dense split of token caches.
    layout: ``"dense"`` or ``"packed"``.
    memory_bytes: KV-cache budget; max_model_len: longest request.
    max_num_reqs: request rows per step; max_num_batched_tokens: token budget per step.
    kv_cache_dtype, indexer_cache_dtype, state_dtype: cache precisions.
    implementation: kernels, ``"pallas"`` or ``"xla"``.
    buckets: step token counts compiled for (default: powers of two up to the budget).
    num_speculative_tokens: MTP drafts per request and step (0: no speculation); the model needs
      its MTP layer (``num_nextn_predict_layers`` > 0).
  """

  block_size: int = 256
  kernel_block_size: int | None = None
  layout: str = "packed"
  memory_bytes: int = 64 << 20
  max_model_len: int = 512
  max_num_reqs: int = 8
  max_num_batched_tokens: int = 64
  kv_cache_dtype: str = "float32"
  indexer_cache_dtype: str = "float32"
  state_dtype: str = "float32"
  implementation: str = "xla"
  buckets: tuple[int, ...] | None = None
  num_speculative_tokens: int = 0

  @property
  def token_buckets(self) -> tuple[int, ...]:
    """``buckets``, or powers of two from 8 up to the token budget (always the last bucket)."""
    if self.buckets is not None:
      if max(self.buckets) < self.max_num_batched_tokens:
        raise ValueError(f"token buckets {self.buckets} must reach max_num_batched_tokens "
                         f"{self.max_num_batched_tokens}.")
      return tuple(sorted(self.buckets))
    b = [x for x in (2**i for i in range(3, 20)) if x < self.max_num_batched_tokens]
    return tuple(b) + (self.max_num_batched_tokens,)


class LLMEngine:
  """Serves many requests of one model over the paged caches of ``jaxkv``.

  ``add_request`` / ``abort`` / ``step`` (returns streamed ``RequestOutput``s) / ``generate``.
  """

  def __init__(self, model, config: EngineConfig = EngineConfig()):
    from models.glm5_next.kv_cache import get_kv_cache_layers
    from models.glm5_next.paged import PagedLayout

    self.config = config
    self.model_config = model.config
    k = config.num_speculative_tokens
    if 1 + k > config.max_num_batched_tokens:
      raise ValueError(f"max_num_batched_tokens {config.max_num_batched_tokens} cannot hold a verify step of "
                       f"1 + {k} tokens.")
    layers = get_kv_cache_layers(model.config, block_size=config.block_size, kv_cache_dtype=config.kv_cache_dtype,
                                 indexer_cache_dtype=config.indexer_cache_dtype, state_dtype=config.state_dtype,
                                 num_speculative_tokens=k)
    # Draft steps write up to k positions past a request's last token.
    self.plan = plan_kv_cache(layers, block_size=config.block_size, memory_bytes=config.memory_bytes,
                              max_model_len=config.max_model_len + k, layout=config.layout,
                              kernel_block_size=config.kernel_block_size)
    self.layout = PagedLayout.build(self.plan, kv_cache_dtype=config.kv_cache_dtype,
                                    indexer_cache_dtype=config.indexer_cache_dtype, state_dtype=config.state_dtype)
    groups = self.plan.kv_cache_groups
    self.kv = KVCacheManager([g.kv_cache_spec for g in groups], self.plan.num_blocks, enable_caching=False)
    self.tables = MultiGroupBlockTable([g.kv_cache_spec.block_size for g in groups], config.max_num_reqs,
                                       self.plan.block_table_widths())
    self.scheduler = Scheduler(self.kv, self.tables, max_num_reqs=config.max_num_reqs,
                               max_num_batched_tokens=config.max_num_batched_tokens,
                               num_lookahead_tokens=max(k - 1, 0))
    self.caches = self.plan.allocate()
    self._graphdef, self._params = nnx.split(model)
    self._step = jax.jit(self._device_step, donate_argnums=1)
    self._requests: dict[str, Request] = {}
    self._arrivals = itertools.count()
    self.num_steps = 0
    self.num_draft_tokens = 0  # drafts verified
    self.num_accepted_tokens = 0  # of which accepted

  # -- device ------------------------------------------------------------------------------

  def _device_step(self, params, caches, inputs, sample_indices, next_ids, draft_ids, num_drafts, temperature, top_p,
                   seeds, steps):
    """The trunk over the step's tokens, verification and sampling of each sampling row, then the
    MTP drafts for the next step.

    ``sample_indices [R, S]``: flat indices of a row's tokens whose logits are sampled (its last
    token and its drafts; -1: none). ``next_ids [T]``: the token after each step token when the host
    knows it (-1: the token sampled here). Returns ``(tokens [R, S], num_accepted [R], top-k
    log-probabilities and ids [R, S, K], drafts [R, k])`` and the caches.
    """
    from models.glm5_next.paged import StepInputs, paged_hidden_states, paged_mtp_forward

    model = nnx.merge(self._graphdef, params)
    impl = self.config.implementation
    hidden, caches = paged_hidden_states(model, caches, inputs, self.layout, implementation=impl)
    logits = model.logits(hidden[jnp.maximum(sample_indices, 0)])  # [R, S, V]
    tokens, num_accepted, top_lp, top_ids = sample(logits, temperature, top_p, seeds, steps, draft_ids, num_drafts)
    k = self.config.num_speculative_tokens
    if not k:
      return (tokens, num_accepted, top_lp, top_ids, draft_ids), caches
    # MTP pass over every step token (it fills the MTP layer's caches, prompts included): the token
    # after each is known on the host, or was just sampled (accepted drafts and the new token).
    t = next_ids.shape[0]
    sampled = jnp.zeros((t,), jnp.int32).at[jnp.where(sample_indices >= 0, sample_indices, t)].set(tokens, mode="drop")
    next_ids = jnp.where(next_ids >= 0, next_ids, sampled)
    h, caches, index_rows = paged_mtp_forward(model, caches, hidden, next_ids, inputs, self.layout,
                                              implementation=impl)
    # Draft chain from each row's last accepted token: draft j is the MTP layer's token at position
    # p + j + 1, its hidden and the draft recycled for the next.
    last = jnp.take_along_axis(sample_indices, num_accepted[:, None], axis=1)[:, 0]  # [R]
    rows = jnp.where(last >= 0, jnp.arange(last.shape[0], dtype=jnp.int32), -1)
    last = jnp.maximum(last, 0)
    h, pos = h[last], inputs.positions[last]
    shared = index_rows[last] if self.model_config.index_share_for_mtp_iteration else None
    drafts = [jnp.argmax(model.logits(h), axis=-1).astype(jnp.int32)]
    for j in range(1, k):
      step = StepInputs(drafts[-1], pos + j, rows, inputs.block_tables, inputs.num_blocks, inputs.state_slots)
      h, caches, _ = paged_mtp_forward(model, caches, h, drafts[-1], step, self.layout, implementation=impl,
                                       shared_indices=shared)
      drafts.append(jnp.argmax(model.logits(h), axis=-1).astype(jnp.int32))
    return (tokens, num_accepted, top_lp, top_ids, jnp.stack(drafts, axis=1)), caches

  @property
  def num_compilations(self) -> int:
    """Compiled shapes of the step (one per token bucket used; steady state adds none)."""
    return self._step._cache_size()

  # -- requests ------------------------------------------------------------------------------

  def add_request(self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams = SamplingParams()):
    if request_id in self._requests:
      raise ValueError(f"request id {request_id!r} is already in use.")
    ids = [int(t) for t in prompt_token_ids]
    vocab = self.model_config.vocab_size
    if not ids or min(ids) < 0 or max(ids) >= vocab:
      raise ValueError(f"request {request_id!r}: prompt token ids must be non-empty and in [0, {vocab}).")
    if len(ids) + sampling.max_new_tokens > self.config.max_model_len:
      raise ValueError(f"request {request_id!r}: {len(ids)} prompt + {sampling.max_new_tokens} new tokens exceed "
                       f"max_model_len {self.config.max_model_len}.")
    request = Request(request_id, ids, sampling, next(self._arrivals), state_slot=self.config.num_speculative_tokens)
    self._requests[request_id] = request
    self.scheduler.add(request)
    return request

  def abort(self, request_id: str) -> None:
    request = self._requests.pop(request_id, None)
    if request is not None and request.status in (RequestStatus.WAITING, RequestStatus.RUNNING):
      self.scheduler.finish(request, RequestStatus.ABORTED, "abort")

  def has_unfinished(self) -> bool:
    return self.scheduler.has_work()

  # -- step ------------------------------------------------------------------------------------

  def warmup(self) -> int:
    """Compiles the step for every token bucket before serving (vLLM captures its CUDA graphs at
    start-up): one step of padding tokens per bucket, which writes nothing. Returns
    ``num_compilations``."""
    for bucket in self.config.token_buckets:
      self._run([], bucket)
    return self.num_compilations

  def step(self) -> list[RequestOutput]:
    chunks = self.scheduler.schedule()
    if not chunks:
      return []
    n = sum(c.num_tokens for c in chunks)
    out = self._run(chunks, next(b for b in self.config.token_buckets if b >= n))
    self.num_steps += 1
    return self._update(chunks, *out)

  def _run(self, chunks, bucket: int):
    """Lays the chunks out in ``bucket`` tokens, runs the jitted step; one transfer each way."""
    cfg = self.config
    k = cfg.num_speculative_tokens
    r = cfg.max_num_reqs
    input_ids = np.zeros(bucket, np.int32)
    positions = np.zeros(bucket, np.int32)
    req_indices = np.full(bucket, -1, np.int32)
    next_ids = np.full(bucket, -1, np.int32)
    sample_indices = np.full((r, 1 + k), -1, np.int32)
    draft_ids = np.zeros((r, k), np.int32)
    num_drafts = np.zeros(r, np.int32)
    state_slots = np.zeros(r, np.int32)
    temperature = np.zeros(r, np.float32)
    top_p = np.ones(r, np.float32)
    seeds = np.zeros(r, np.int32)
    steps = np.zeros(r, np.int32)
    at = 0
    for c in chunks:
      req = c.request
      ids = req.all_token_ids + req.spec_token_ids
      end = c.start + c.num_tokens
      input_ids[at:at + c.num_tokens] = ids[c.start:end]
      positions[at:at + c.num_tokens] = np.arange(c.start, end)
      req_indices[at:at + c.num_tokens] = req.row
      known = min(end, req.num_tokens - 1) - c.start  # tokens whose successor is committed
      next_ids[at:at + known] = req.all_token_ids[c.start + 1:c.start + 1 + known]
      state_slots[req.row] = req.state_slot
      at += c.num_tokens
      if c.samples:
        d = c.num_drafts
        sample_indices[req.row, :d + 1] = np.arange(at - d - 1, at)
        draft_ids[req.row, :d] = req.spec_token_ids[:d]
        num_drafts[req.row] = d
        temperature[req.row] = req.sampling.temperature
        top_p[req.row] = req.sampling.top_p
        seeds[req.row] = req.sampling.seed
        steps[req.row] = len(req.output_token_ids)
    from models.glm5_next.paged import StepInputs

    tables = tuple(bt.block_table for bt in self.tables.block_tables)
    counts = tuple(bt.num_blocks_per_row for bt in self.tables.block_tables)
    # One host-to-device transfer for the whole step.
    (ids_d, pos_d, req_d, tables_d, counts_d, slots_d, *rest) = jax.device_put(
        (input_ids, positions, req_indices, tuple(t.copy() for t in tables), tuple(c.copy() for c in counts),
         state_slots, sample_indices, next_ids, draft_ids, num_drafts, temperature, top_p, seeds, steps))
    inputs = StepInputs(ids_d, pos_d, req_d, tables_d, counts_d, slots_d)
    out, self.caches = self._step(self._params, self.caches, inputs, *rest)
    return jax.device_get(out)  # one transfer back

  def _next_drafts(self, request: Request, drafts: list[int]) -> list[int]:
    """The drafts to verify next step (the MTP layer's); a seam for tests that force drafts."""
    return drafts

  def _update(self, chunks, tokens, num_accepted, top_lp, top_ids, drafts) -> list[RequestOutput]:
    k = self.config.num_speculative_tokens
    outputs = []
    for c in chunks:
      req = c.request
      # Rollback: positions of rejected drafts count as not computed (later steps overwrite their
      # latents, pooled keys and ring slots), and KDA continues from the last accepted token's slot.
      a = int(num_accepted[req.row]) if c.samples else 0
      rejected = c.num_drafts - a
      req.num_computed_tokens -= rejected
      req.state_slot = k - rejected
      req.spec_token_ids = []
      if not c.samples:
        continue
      self.num_draft_tokens += c.num_drafts
      self.num_accepted_tokens += a
      row = req.row
      new_ids, new_lps, reason = [], [], None
      for j in range(a + 1):
        token = int(tokens[row, j])
        lps = [(int(i), float(v)) for i, v in zip(top_ids[row, j, : req.sampling.logprobs],
                                                  top_lp[row, j, : req.sampling.logprobs])]
        req.output_token_ids.append(token)
        req.output_logprobs.append(lps)
        new_ids.append(token)
        new_lps.append(lps)
        if token in req.sampling.stop_token_ids:
          reason = "stop"
        elif len(req.output_token_ids) >= req.sampling.max_new_tokens:
          reason = "length"
        if reason:
          break
      if reason:
        self.scheduler.finish(req, RequestStatus.FINISHED, reason)
      elif k:
        # No draft past the last token the request may emit (its verify step emits drafts + 1).
        room = req.sampling.max_new_tokens - len(req.output_token_ids) - 1
        req.spec_token_ids = self._next_drafts(req, [int(x) for x in drafts[row, :min(k, room)]])
      outputs.append(RequestOutput(req.request_id, new_ids, new_lps if req.sampling.logprobs else [],
                                   reason is not None, reason))
    return outputs

  def generate(self, prompts: Iterable[Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
               *, progress=None) -> list[Request]:
    """Runs prompts to completion; returns the finished requests in prompt order."""
    prompts = list(prompts)
    params = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
    base = next(self._arrivals)
    reqs = [self.add_request(f"gen-{base}-{i}", p, s) for i, (p, s) in enumerate(zip(prompts, params))]
    while self.has_unfinished():
      outs = self.step()
      if progress is not None:
        progress(self, outs)
    for r in reqs:
      self._requests.pop(r.request_id, None)
    return reqs

