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
    layers = get_kv_cache_layers(model.config, block_size=config.block_size, kv_cache_dtype=config.kv_cache_dtype,
                                 indexer_cache_dtype=config.indexer_cache_dtype, state_dtype=config.state_dtype)
    self.plan = plan_kv_cache(layers, block_size=config.block_size, memory_bytes=config.memory_bytes,
                              max_model_len=config.max_model_len, layout=config.layout,
                              kernel_block_size=config.kernel_block_size)
    self.layout = PagedLayout.build(self.plan, kv_cache_dtype=config.kv_cache_dtype,
                                    indexer_cache_dtype=config.indexer_cache_dtype, state_dtype=config.state_dtype)
    groups = self.plan.kv_cache_groups
    self.kv = KVCacheManager([g.kv_cache_spec for g in groups], self.plan.num_blocks, enable_caching=False)
    self.tables = MultiGroupBlockTable([g.kv_cache_spec.block_size for g in groups], config.max_num_reqs,
                                       self.plan.block_table_widths())
    self.scheduler = Scheduler(self.kv, self.tables, max_num_reqs=config.max_num_reqs,
                               max_num_batched_tokens=config.max_num_batched_tokens)
    self.caches = self.plan.allocate()
    self._graphdef, self._params = nnx.split(model)
    self._step = jax.jit(self._device_step, donate_argnums=1)
    self._requests: dict[str, Request] = {}
    self._arrivals = itertools.count()
    self.num_steps = 0

  # -- device ------------------------------------------------------------------------------

  def _device_step(self, params, caches, inputs, logits_indices, temperature, top_p, seeds, steps):
    from models.glm5_next.paged import paged_forward

    model = nnx.merge(self._graphdef, params)
    logits, caches = paged_forward(model, caches, inputs, self.layout, implementation=self.config.implementation,
                                   logits_indices=logits_indices)
    tokens, top_lp, top_ids = sample(logits, temperature, top_p, seeds, steps)
    return (tokens, top_lp, top_ids), caches

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
    request = Request(request_id, ids, sampling, next(self._arrivals))
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

  def step(self) -> list[RequestOutput]:
    chunks = self.scheduler.schedule()
    if not chunks:
      return []
    cfg = self.config
    n = sum(c.num_tokens for c in chunks)
    bucket = next(b for b in cfg.token_buckets if b >= n)
    r = cfg.max_num_reqs
    input_ids = np.zeros(bucket, np.int32)
    positions = np.zeros(bucket, np.int32)
    req_indices = np.full(bucket, -1, np.int32)
    logits_indices = np.full(r, -1, np.int32)
    temperature = np.zeros(r, np.float32)
    top_p = np.ones(r, np.float32)
    seeds = np.zeros(r, np.int32)
    steps = np.zeros(r, np.int32)
    at = 0
    for c in chunks:
      req = c.request
      tokens = req.all_token_ids[c.start:c.start + c.num_tokens]
      input_ids[at:at + c.num_tokens] = tokens
      positions[at:at + c.num_tokens] = np.arange(c.start, c.start + c.num_tokens)
      req_indices[at:at + c.num_tokens] = req.row
      at += c.num_tokens
      if c.samples:
        logits_indices[req.row] = at - 1
        temperature[req.row] = req.sampling.temperature
        top_p[req.row] = req.sampling.top_p
        seeds[req.row] = req.sampling.seed
        steps[req.row] = len(req.output_token_ids)
    from models.glm5_next.paged import StepInputs

    tables = tuple(bt.block_table for bt in self.tables.block_tables)
    counts = tuple(bt.num_blocks_per_row for bt in self.tables.block_tables)
    # One host-to-device transfer for the whole step.
    (ids_d, pos_d, req_d, tables_d, counts_d, li_d, temp_d, top_p_d, seeds_d, steps_d) = jax.device_put(
        (input_ids, positions, req_indices, tuple(t.copy() for t in tables), tuple(c.copy() for c in counts),
         logits_indices, temperature, top_p, seeds, steps))
    inputs = StepInputs(ids_d, pos_d, req_d, tables_d, counts_d)
    out, self.caches = self._step(self._params, self.caches, inputs, li_d, temp_d, top_p_d, seeds_d, steps_d)
    tokens, top_lp, top_ids = jax.device_get(out)  # one transfer back
    self.num_steps += 1
    return self._update(chunks, tokens, top_lp, top_ids)

  def _update(self, chunks, tokens, top_lp, top_ids) -> list[RequestOutput]:
    outputs = []
    for c in chunks:
      req = c.request
      if not c.samples:
        continue
      row = req.row
      token = int(tokens[row])
      lps = [(int(i), float(v)) for i, v in zip(top_ids[row, : req.sampling.logprobs], top_lp[row, : req.sampling.logprobs])]
      req.output_token_ids.append(token)
      req.output_logprobs.append(lps)
      reason = None
      if token in req.sampling.stop_token_ids:
        reason = "stop"
      elif len(req.output_token_ids) >= req.sampling.max_new_tokens:
        reason = "length"
      if reason:
        self.scheduler.finish(req, RequestStatus.FINISHED, reason)
      outputs.append(RequestOutput(req.request_id, [token], [lps] if req.sampling.logprobs else [], reason is not None,
                                   reason))
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

