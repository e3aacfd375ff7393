"""The engine's host side: requests, scheduling, block bookkeeping and outputs.

``LLMEngine`` plays vLLM's ``EngineCore``: the scheduler, the KV-cache manager, the block tables,
the offload connector and swap space are NumPy and Python on the host; each step it lays the
scheduled chunks out in one int32 buffer and hands it to its ``StepExecutor``
(``jaxkv.engine.step_executor``: the caches, the weights and the jitted step on the device), which
makes one transfer each way.
"""

from __future__ import annotations

import dataclasses
import itertools
import secrets
import threading
import warnings
from collections.abc import Iterable, Sequence

import jax
import numpy as np

from jaxkv.cache.kv_cache_config import CacheConfig
from jaxkv.cache.kv_cache_report import render_plan
from jaxkv.engine.draft_proposer import DraftProposer, ModelDraftProposer
from jaxkv.engine.model_runner import ModelRunner, plan_for
from jaxkv.engine.offload import DiskTier, HostTier, KVTransfer, OffloadingConnector, SwapSpace, offload_fingerprint
from jaxkv.engine.parallel import make_mesh
from jaxkv.engine.request import PromptLogprob, Request, RequestStatus, SamplingParams, StepOutput, is_int
from jaxkv.engine.scheduler import Scheduler
from jaxkv.engine.step_executor import TOKEN_FIELDS, PackedInputs, StepExecutor
from jaxkv.host.block_table import MultiGroupBlockTable
from jaxkv.host.kv_cache_manager import KVCacheManager
from jaxkv.step.block_copy import BlockRegions

__all__ = ["EngineConfig", "LLMEngine"]


def _agreed_entropy() -> int:
  """Fresh entropy for the requests that give no seed, the same on every process of a
  multi-process run (each process builds the same step inputs: process 0's is broadcast)."""
  value = secrets.randbits(31)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    if (
      jax.default_backend() == "cpu"
      and jax.config.jax_enable_compilation_cache
      and jax.config.jax_compilation_cache_dir
    ):
      # Seen with jax 0.12.1: gloo programs that every process reads back from the persistent cache
      # wait on each other until the collective timeout (docs/sharding.md).
      warnings.warn(
        f"{jax.process_count()} CPU processes with the persistent compilation cache on "
        f"({jax.config.jax_compilation_cache_dir!r}): gloo collectives of programs read back from it can "
        "time out waiting for each other; unset JAX_COMPILATION_CACHE_DIR or set "
        'jax.config.update("jax_enable_compilation_cache", False) in every process',
        RuntimeWarning,
        stacklevel=3,
      )

    value = int(multihost_utils.broadcast_one_to_all(np.int32(value)))
  return value


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Static engine settings.

  Attributes:
    cache: the KV-cache options (block and kernel sizes, layout, dtypes, speculative tokens,
      memory, max length): the one object every plan is made from.
    max_num_reqs: request rows per step; max_num_batched_tokens: token budget per step.
    long_prefill_token_threshold: when positive, each request's share of a step before the next
      request gets one (vLLM's ``--long-prefill-token-threshold``): long prompts' chunks then share
      each step instead of one taking the budget alone. Unlike vLLM, the budget the shares leave
      goes to the same chunks again, in order, so the cap never makes a step smaller. The KDA
      recurrence runs each request's tokens in order, and 32 prompts of 1,024 tokens prefilled
      8-10% faster at 64 than two at a time (docs/engine.md). The first requests' first tokens
      come later, the last ones' sooner. Tokens are identical either way (chunking is among the
      equivalence suite's schedules). 0: off.
    buckets: step token counts compiled for (default: powers of two up to the budget).
    async_scheduling: dispatch step n+1 before reading back step n (vLLM's async scheduling):
      the tokens sampled in step n flow into step n+1 on the device, and ``step()`` returns the
      outputs of the step before. Tokens and log-probabilities are identical to synchronous
      steps. Applies without speculative tokens (a verify step needs the accepted count).
    step_metadata_implementation: how each step's slot mappings and kernel-block tables are
      computed (the runner's ``compute_step_metadata``): ``"auto"`` (as the runner resolves it:
      GLM's runner takes the Pallas kernel on a GPU, and on the CPU when its kernels are
      ``"pallas"``), ``"pallas"`` or ``"xla"``. Identical integers either way.
    enable_prefix_caching: reuse the cached blocks of earlier prompts with the same prefix, KDA
      states included (checkpointed at block boundaries; ``jaxkv.host.kv_cache_manager``). Outputs are
      bitwise those of a cold run; ``Request.num_cached_tokens`` says what was reused.
    kv_offload: a second level for the prefix cache (``jaxkv.engine.offload``): ``"host"`` (host
      memory) or ``"disk"`` (``kv_offload_dir``, survives a restart); None: off. Needs prefix
      caching. ``kv_offload_bytes``: the tier's capacity (least recently used blocks evicted).
    preemption_mode: ``"recompute"`` (a preempted request's blocks are freed and recomputed) or
      ``"swap"`` (moved to host memory and back, up to ``swap_space_bytes``; recompute past that).
    tensor_parallel_size, data_parallel_size, enable_expert_parallel: vLLM's parallel sizes; above
      one device the step runs on a ``data x tensor`` mesh (``jaxkv.engine.parallel``, the model's
      ``shard``): heads, MLP widths and the vocabulary split over ``tensor``; the routed experts
      split by width over ``tensor``, or with expert parallelism whole experts over all devices.
      ``data_parallel_size`` > 1 widens the expert split and needs ``enable_expert_parallel``.
    greedy_step: also compile each decode bucket's step (``greedy_buckets``) without the
      sampler's distribution, taken by the steps whose sampling rows are all greedy and ask for no
      log-probs (vLLM's sampler skips that work the same way, on ``all_greedy``): no softmax,
      nucleus search, draw or top log-probs. Tokens are identical either way (the argmax of the
      same logits); ``warmup()`` compiles one more variant per decode bucket. False: one variant.
  """

  cache: CacheConfig = CacheConfig()
  max_num_reqs: int = 8
  max_num_batched_tokens: int = 64
  long_prefill_token_threshold: int = 0
  buckets: tuple[int, ...] | None = None
  async_scheduling: bool = True
  step_metadata_implementation: str = "auto"
  enable_prefix_caching: bool = False
  kv_offload: str | None = None
  kv_offload_bytes: int = 4 << 30
  kv_offload_dir: str | None = None
  preemption_mode: str = "recompute"
  swap_space_bytes: int = 4 << 30
  tensor_parallel_size: int = 1
  data_parallel_size: int = 1
  enable_expert_parallel: bool = False
  greedy_step: bool = True

  def __post_init__(self):
    if self.tensor_parallel_size < 1 or self.data_parallel_size < 1:
      raise ValueError(
        f"tensor_parallel_size {self.tensor_parallel_size} and data_parallel_size "
        f"{self.data_parallel_size} must be >= 1."
      )
    if self.data_parallel_size > 1 and not self.enable_expert_parallel:
      raise ValueError(
        f"data_parallel_size {self.data_parallel_size} without enable_expert_parallel: in one "
        "engine the data axis only widens the expert split. For independent replicas run one "
        "engine per replica, or enable expert parallelism (enable_expert_parallel)."
      )
    if self.long_prefill_token_threshold < 0 or 0 < self.long_prefill_token_threshold <= self.num_speculative_tokens:
      raise ValueError(
        f"long_prefill_token_threshold {self.long_prefill_token_threshold} must be 0 (off) or at least "
        f"1 + num_speculative_tokens = {1 + self.num_speculative_tokens} (a verify step's tokens)."
      )
    if self.kv_offload not in (None, "host", "disk"):
      raise ValueError(f"kv_offload must be None, 'host' or 'disk', got {self.kv_offload!r}.")
    if self.kv_offload and not self.enable_prefix_caching:
      raise ValueError(
        f"kv_offload={self.kv_offload!r} is a second level of the prefix cache: set enable_prefix_caching=True too."
      )
    if self.kv_offload == "disk" and not self.kv_offload_dir:
      raise ValueError("kv_offload='disk' needs kv_offload_dir, the directory where blocks are kept.")
    if self.kv_offload and self.kv_offload_bytes <= 0:
      raise ValueError(f"kv_offload_bytes must be positive, got {self.kv_offload_bytes}.")
    if self.preemption_mode not in ("recompute", "swap"):
      raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}.")
    if self.swap_space_bytes < 0:
      raise ValueError(f"swap_space_bytes must be >= 0, got {self.swap_space_bytes}.")

  @property
  def num_speculative_tokens(self) -> int:
    return self.cache.num_speculative_tokens

  @property
  def num_devices(self) -> int:
    return self.tensor_parallel_size * self.data_parallel_size

  @property
  def max_model_len(self) -> int:
    return self.cache.max_model_len

  @property
  def token_buckets(self) -> tuple[int, ...]:
    """``buckets``, or powers of two from 8 up to the token budget (always the last bucket)."""
    if self.buckets is not None:
      if max(self.buckets) < self.max_num_batched_tokens:
        raise ValueError(
          f"token buckets {self.buckets} must reach max_num_batched_tokens {self.max_num_batched_tokens}."
        )
      return tuple(sorted(self.buckets))
    b = [x for x in (2**i for i in range(3, 20)) if x < self.max_num_batched_tokens]
    return tuple(b) + (self.max_num_batched_tokens,)

  @property
  def greedy_buckets(self) -> tuple[int, ...]:
    """The buckets with a greedy variant (``greedy_step``): those up to the one that holds a decode
    step of every request row (``max_num_reqs x (1 + drafts)`` tokens). Larger steps are prefill,
    where the sampler's share is small."""
    if not self.greedy_step:
      return ()
    buckets = self.token_buckets
    decode = self.max_num_reqs * (1 + self.num_speculative_tokens)
    return tuple(b for b in buckets if b <= next((x for x in buckets if x >= decode), buckets[-1]))


class LLMEngine:
  """Serves many requests of one model over the paged caches of ``jaxkv``.

  ``add_request`` / ``abort`` / ``step`` (returns streamed ``StepOutput``s) / ``generate``.

  Args:
    runner: the model (``ModelRunner``), e.g. ``Glm5NextRunner.from_model(model)``.
    config: engine settings; ``config.cache`` is planned with ``plan_for(runner, config.cache)``,
      exactly as ``jaxkv inspect`` plans it.
  """

  def __init__(
    self,
    runner: ModelRunner,
    config: EngineConfig = EngineConfig(),
    *,
    draft_proposer: DraftProposer = ModelDraftProposer(),
  ):
    self.config = config
    # On a mesh: the weights placed by the model's sharding rules; everything else replicated.
    self.mesh = make_mesh(config.tensor_parallel_size, config.data_parallel_size) if config.num_devices > 1 else None
    if self.mesh is not None:
      runner = runner.shard(self.mesh, expert_parallel=config.enable_expert_parallel)
    self.runner = runner
    self.draft_proposer = draft_proposer
    k = config.num_speculative_tokens
    if config.max_model_len > runner.max_model_len:
      raise ValueError(
        f"max_model_len {config.max_model_len} exceeds the model's {runner.max_model_len} positions: "
        f"lower it (CacheConfig.max_model_len)."
      )
    if 1 + k > config.max_num_batched_tokens:
      raise ValueError(
        f"max_num_batched_tokens {config.max_num_batched_tokens} cannot hold a verify step of 1 + {k} tokens."
      )
    self.plan = plan_for(runner, config.cache, tensor_parallel_size=config.tensor_parallel_size)
    groups = self.plan.kv_cache_groups
    self.kv = KVCacheManager(
      [g.kv_cache_spec for g in groups],
      self.plan.num_blocks,
      enable_caching=config.enable_prefix_caching,
      use_eagle=k > 0,
      linear_prefill_chunk=config.cache.linear_prefill_chunk,
    )
    self.tables = MultiGroupBlockTable(
      [g.kv_cache_spec.block_size for g in groups], config.max_num_reqs, self.plan.block_table_widths()
    )
    self.connector = self._make_connector(runner, config)
    self.swap = SwapSpace(self.plan, config.swap_space_bytes) if config.preemption_mode == "swap" else None
    self.transfers: list[KVTransfer] = [t for t in (self.connector, self.swap) if t is not None]
    self.scheduler = Scheduler(
      self.kv,
      self.tables,
      max_num_reqs=config.max_num_reqs,
      max_num_batched_tokens=config.max_num_batched_tokens,
      long_prefill_token_threshold=config.long_prefill_token_threshold,
      num_lookahead_tokens=max(k - 1, 0),
      connector=self.connector,
      swap=self.swap,
    )
    self.executor = StepExecutor(
      runner,
      self.plan,
      max_num_reqs=config.max_num_reqs,
      num_speculative_tokens=k,
      step_metadata_implementation=config.step_metadata_implementation,
      mesh=self.mesh,
    )
    self._async = config.async_scheduling and k == 0
    self._greedy_buckets = frozenset(config.greedy_buckets)  # read by every step's launch
    # The step in flight (async scheduling): its chunks and its packed outputs, not yet read back.
    self._in_flight: tuple[list, jax.Array] | None = None
    self._requests: dict[str, Request] = {}
    self._lock = threading.RLock()  # one step at a time; add_request and abort wait for it
    self._arrivals = itertools.count()
    self.num_steps = 0
    self._entropy = _agreed_entropy()
    self.num_draft_tokens = 0  # drafts verified
    self.num_accepted_tokens = 0  # of which accepted

  def _make_connector(self, runner, config: EngineConfig) -> OffloadingConnector | None:
    if config.kv_offload == "host":
      return OffloadingConnector(self.plan, HostTier(config.kv_offload_bytes))
    if config.kv_offload == "disk":
      payload = {
        g: BlockRegions.from_plan(self.plan, [g]).bytes_per_block for g in range(len(self.plan.kv_cache_groups))
      }
      tier = DiskTier(
        config.kv_offload_dir,
        config.kv_offload_bytes,
        offload_fingerprint(self.plan, runner.params),
        payload_bytes=payload,
      )
      return OffloadingConnector(self.plan, tier)
    return None

  def wait_for_save(self) -> None:
    """Waits until every block offloaded so far is stored in its tier (``generate`` ends with it)."""
    for transfer in self.transfers:
      transfer.wait_for_save()

  def render_plan(self, title: str = "") -> str:
    """The plan this engine serves from, as ``jaxkv inspect`` prints it."""
    return render_plan(self.plan, title)

  @property
  def num_compilations(self) -> int:
    """Step shapes this engine compiled (one per token bucket used; none for a bucket an engine with
    equal settings compiled before: they share it; steady state adds none)."""
    return self.executor.num_compilations

  # -- requests ------------------------------------------------------------------------------

  def _check_request(self, request_id: str, prompt_token_ids, sampling) -> list[int]:
    """The prompt as a list of ints, or a ValueError naming the request, the field and the value."""
    if isinstance(prompt_token_ids, (str, bytes)) or not isinstance(prompt_token_ids, (Sequence, np.ndarray)):
      raise ValueError(
        f"request {request_id!r}: prompt_token_ids must be a sequence of token ids, got "
        f"{type(prompt_token_ids).__name__} {prompt_token_ids!r}."
      )
    if not isinstance(sampling, SamplingParams):
      raise ValueError(f"request {request_id!r}: sampling must be SamplingParams, got {type(sampling).__name__}.")
    ids = list(prompt_token_ids)
    vocab = self.runner.vocab_size
    if not ids:
      raise ValueError(f"request {request_id!r}: the prompt is empty.")
    for i, t in enumerate(ids):
      if not is_int(t) or not 0 <= t < vocab:
        raise ValueError(f"request {request_id!r}: prompt token {i} is {t!r}; token ids are integers in [0, {vocab}).")
    if sampling.n != 1 or sampling.stop:
      raise ValueError(
        f"request {request_id!r}: n={sampling.n} and stop={list(sampling.stop)} need the text "
        f"layer: use jaxkv.LLM (the engine serves one token sequence per request)."
      )
    if len(ids) + sampling.max_tokens > self.config.max_model_len:
      raise ValueError(
        f"request {request_id!r}: {len(ids)} prompt + {sampling.max_tokens} new tokens exceed "
        f"max_model_len {self.config.max_model_len}."
      )
    return [int(t) for t in ids]

  def add_request(self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams = SamplingParams()):
    """Queues a request (checked first: nothing is admitted on a ValueError). Its id is free again
    once its last output has been returned."""
    with self._lock:
      if request_id in self._requests:
        raise ValueError(f"request id {request_id!r} is already in use.")
      ids = self._check_request(request_id, prompt_token_ids, sampling)
      arrival = next(self._arrivals)
      seed = sampling.seed
      if seed is None:  # fresh entropy: the engine's, mixed with the arrival (equal on every process)
        seed = int(np.random.SeedSequence((self._entropy, arrival)).generate_state(1)[0]) % 2**31
      request = Request(request_id, ids, sampling, arrival, seed=seed, state_slot=self.config.num_speculative_tokens)
      self._requests[request_id] = request
      self.scheduler.add(request)
      return request

  def abort(self, request_id: str) -> None:
    """Ends a request; safe from any thread (it waits for a step in progress)."""
    with self._lock:
      request = self._requests.pop(request_id, None)
      if request is not None and request.status in (RequestStatus.WAITING, RequestStatus.RUNNING):
        self.scheduler.finish(request, RequestStatus.ABORTED, "abort")

  def has_unfinished(self) -> bool:
    return self.scheduler.has_work() or self._in_flight is not None

  # -- step ------------------------------------------------------------------------------------

  def warmup(self, *, prompt_logprobs: bool = False) -> int:
    """Compiles the step for every token bucket before serving (vLLM captures its CUDA graphs at
    start-up): one step of padding tokens per bucket, which writes nothing. ``prompt_logprobs``:
    also the steps that serve requests asking for them (else compiled at their first use).
    Returns ``num_compilations``."""
    chunked = self.config.cache.linear_prefill_chunk is not None
    variants = itertools.product(
      self.config.token_buckets, (False, True)[: 1 + prompt_logprobs], (False, True)[: 1 + chunked], (False, True)
    )
    for bucket, plp, lc, go in variants:
      if go and (bucket not in self._greedy_buckets or plp):  # steps _launch never makes greedy
        continue
      self.executor.read_back(self._launch([], bucket, prompt_logprobs=plp, linear_chunks=lc, greedy_only=go)[0])
    self._copy_blocks([], warmup=True)
    return self.num_compilations

  def step(self) -> list[StepOutput]:
    """Schedules and runs one step. Synchronously, returns its outputs; with async scheduling,
    dispatches it first and then returns the outputs of the step before (which the scheduler
    already counted on: each sampling request's next token is in flight). A request whose step
    input cannot be prepared ends with finish reason ``"error"`` (``Request.error`` says why);
    the others run on."""
    with self._lock:
      chunks = self.scheduler.schedule()
      # Before the step, in this order: every transfer's blocks out (preempted blocks, before their
      # new owners write them), then in (offloaded prefix blocks, swapped blocks), then hits' KDA
      # states into their slots.
      ex = self.executor
      for transfer in self.transfers:
        transfer.start_store_kv(ex.caches)
      for transfer in self.transfers:
        ex.caches = transfer.start_load_kv(ex.caches)
      self._copy_blocks(self.kv.take_block_copies())
      out, failed = None, []
      if chunks:
        n = sum(c.num_tokens for c in chunks)
        out, chunks, failed = self._launch(chunks, next(b for b in self.config.token_buckets if b >= n))
        self.num_steps += out is not None
        self._cache_blocks(chunks)
      errors = [self._fail(req, err) for req, err in failed]
      if not self._async:
        return errors + (self._update(chunks, *ex.read_back(out)) if chunks else [])
      previous, self._in_flight = self._in_flight, (chunks, out) if chunks else None
      return errors + (self._update(previous[0], *ex.read_back(previous[1])) if previous else [])

  def _cache_blocks(self, chunks) -> None:
    """Indexes the blocks the step just computed and checkpoints KDA states that end on a block
    boundary (dispatched now: before any later step rewrites the slots)."""
    if not self.kv.enable_caching:
      return
    copies = []
    for c in chunks:
      req = c.request
      self.kv.cache_blocks(req.request_id, req.all_token_ids, req.num_computed_tokens)
      if not c.num_drafts:  # the state after the chunk's last token is in the checkpointed slot
        copies += self.kv.checkpoint_states(
          req.request_id, req.all_token_ids, c.start + c.num_tokens, len(req.prompt_token_ids)
        )
    self._copy_blocks(copies)
    newly_cached = self.kv.take_newly_cached()
    if self.connector is not None:  # after the checkpoint copies: they are among the blocks saved
      self.connector.save_kv(self.executor.caches, newly_cached)

  def _copy_blocks(self, pairs: list[tuple[int, int]], *, warmup: bool = False) -> None:
    """Dispatches prefix caching's KDA state block copies (``warmup``: an all-padding call, to
    compile it)."""
    if self.kv.enable_caching:
      self.executor.copy_blocks(pairs, warmup=warmup)

  def _fail(self, request: Request, error: Exception) -> StepOutput:
    request.error = f"{type(error).__name__}: {error}"
    self.scheduler.finish(request, RequestStatus.FINISHED, "error")
    self._requests.pop(request.request_id, None)
    return StepOutput(request.request_id, [], [], True, "error", request.num_cached_tokens)

  def _launch(
    self,
    chunks,
    bucket: int,
    *,
    prompt_logprobs: bool = False,
    linear_chunks: bool = False,
    greedy_only: bool | None = None,
  ):
    """Lays the chunks out in ``bucket`` tokens and dispatches the jitted step (one transfer in).
    Returns the packed outputs and prompt log-probs (None unless a chunk computes prompt tokens of
    a request that asks for them, or ``prompt_logprobs``) without waiting for them (None when no
    chunk could be laid out), the chunks laid out, and ``(request, error)`` for the others, whose
    tokens stay padding. ``greedy_only``: the step variant (None: the greedy one where the bucket
    has it and no sampling chunk samples or asks for log-probs)."""
    k = self.config.num_speculative_tokens
    prompt_logprobs = prompt_logprobs or any(
      c.request.sampling.prompt_logprobs is not None and c.start < len(c.request.prompt_token_ids) - 1 for c in chunks
    )
    grid = self.config.cache.linear_prefill_chunk
    linear_chunks = linear_chunks or (
      grid is not None and any(c.start < len(c.request.prompt_token_ids) // grid * grid for c in chunks)
    )
    if greedy_only is None:
      greedy_only = (
        bucket in self._greedy_buckets
        and not prompt_logprobs
        and not any(c.request.sampling.temperature > 0 or c.request.sampling.logprobs for c in chunks if c.samples)
      )
    packing = self.executor.packing(bucket, prompt_logprobs, linear_chunks, greedy_only)
    buf = packing.template.copy()
    v = packing.host_views(buf)
    laid_out, failed = [], []
    for c in chunks:
      try:
        self._lay_out(v, c, k)
        laid_out.append(c)
      except (ValueError, TypeError, OverflowError) as err:
        self._clear(packing, v, c)
        failed.append((c.request, err))
    if chunks and not laid_out:
      return None, [], failed
    for g, bt in enumerate(self.tables.block_tables):
      v[f"table{g}"][...] = bt.block_table
      v[f"count{g}"][...] = bt.num_blocks_per_row
    out = self.executor.launch(packing, buf)
    if self._async:
      for c in laid_out:
        if c.samples:
          c.request.num_in_flight += 1
          c.request.in_flight_row = c.request.row
    return out, laid_out, failed

  @staticmethod
  def _clear(packing: PackedInputs, v, c) -> None:
    """Back to padding: the chunk's tokens and its request's row fields."""
    for name, (_, _, default) in packing.fields.items():
      if name in TOKEN_FIELDS:
        v[name][c.offset : c.offset + c.num_tokens] = default
      elif not name.startswith(("table", "count")):  # the block tables are the host's, whole
        v[name][c.request.row] = default

  @staticmethod
  def _lay_out(v, c, k: int) -> None:
    """One chunk's tokens from its offset and its request's row fields."""
    req = c.request
    at = c.offset
    end = c.start + c.num_tokens
    ids = req.token_ids(c.start, end)  # the chunk's known tokens and drafts
    known_ids = len(ids)
    v["input_ids"][at : at + known_ids] = ids
    if known_ids < c.num_tokens:  # the token in flight: read on the device from the step before
      v["prev_token_index"][at + known_ids] = req.in_flight_row * (1 + k)
    v["positions"][at : at + c.num_tokens] = np.arange(c.start, end)
    v["req_indices"][at : at + c.num_tokens] = req.row
    num_known = len(req.prompt_token_ids) + len(req.output_token_ids)
    known = max(min(end, num_known - 1) - c.start, 0)  # tokens whose successor is committed
    v["next_ids"][at : at + known] = req.token_ids(c.start + 1, c.start + 1 + known)
    v["state_slots"][req.row] = req.state_slot
    if "num_prompt_tokens" in v:
      v["num_prompt_tokens"][req.row] = len(req.prompt_token_ids)
    if c.samples:
      d, last = c.num_drafts, at + c.num_tokens
      v["sample_indices"][req.row, : d + 1] = np.arange(last - d - 1, last)
      v["draft_ids"][req.row, :d] = req.spec_token_ids[:d]
      v["num_drafts"][req.row] = d
      v["temperature_f32"][req.row] = req.sampling.temperature
      v["top_p_f32"][req.row] = req.sampling.top_p
      v["top_k"][req.row] = req.sampling.top_k
      v["seeds"][req.row] = req.seed
      v["steps"][req.row] = len(req.output_token_ids) + req.num_in_flight

  def _update(
    self, chunks, tokens, num_accepted, top_lp, top_ids, drafts, token_lp, token_rank, plp
  ) -> list[StepOutput]:
    k = self.config.num_speculative_tokens
    tokens, num_accepted = tokens.tolist(), num_accepted.tolist()  # one conversion, not a NumPy scalar a read
    outputs = []
    for c in chunks:
      req = c.request
      if req.status in (RequestStatus.FINISHED, RequestStatus.ABORTED):
        continue  # ended while this step was in flight (a stop token, an abort): nothing to emit
      if plp is not None and req.sampling.prompt_logprobs is not None:
        self._add_prompt_logprobs(req, c, plp)
      if c.samples and self._async:
        req.num_in_flight -= 1
      # Rollback: positions of rejected drafts count as not computed (later steps overwrite their
      # latents, pooled keys and ring slots), and KDA continues from the last accepted token's slot.
      a = num_accepted[c.row] if c.samples else 0
      rejected = c.num_drafts - a
      req.num_computed_tokens -= rejected
      req.state_slot = k - rejected
      req.spec_token_ids = []
      if not c.samples:
        continue
      self.num_draft_tokens += c.num_drafts
      self.num_accepted_tokens += a
      row = c.row
      first = not req.output_token_ids
      new_ids, new_lps, own, reason = [], [], [], None
      for j in range(a + 1):
        token = tokens[row][j]
        n = req.sampling.logprobs
        lps = list(zip(top_ids[row, j, :n].tolist(), top_lp[row, j, :n].tolist())) if n else []
        req.output_token_ids.append(token)
        req.output_logprobs.append(lps)
        new_ids.append(token)
        new_lps.append(lps)
        if req.sampling.logprobs:  # a greedy-only step computes none (zeros)
          own.append((float(token_lp[row, j]), int(token_rank[row, j])))
          req.output_token_logprobs.append(own[-1])
        if token in req.sampling.stop_token_ids:
          reason = "stop"
        elif len(req.output_token_ids) >= req.sampling.max_tokens:
          reason = "length"
        if reason:
          break
      if reason:
        self.scheduler.finish(req, RequestStatus.FINISHED, reason)
        self._requests.pop(req.request_id, None)  # its last output goes out now: the id is free
      elif k:
        # No draft past the last token the request may emit (its verify step emits drafts + 1).
        room = req.sampling.max_tokens - len(req.output_token_ids) - 1
        model_drafts = [int(x) for x in drafts[row, : min(k, room)]]
        req.spec_token_ids = self.draft_proposer.propose(req, model_drafts, step=self.num_steps)
      prompt_lps = list(req.prompt_logprobs) if first and req.sampling.prompt_logprobs is not None else None
      outputs.append(
        StepOutput(
          req.request_id,
          new_ids,
          new_lps if req.sampling.logprobs else [],
          reason is not None,
          reason,
          req.num_cached_tokens,
          prompt_lps,
          own,
        )
      )
    return outputs

  @staticmethod
  def _add_prompt_logprobs(req: Request, c, plp) -> None:
    """The entries of the prompt tokens after the chunk's tokens, in order; positions computed
    again (a preempted request recomputes its prompt) keep their first entry."""
    target_lp, rank, top_lp, top_ids = plp
    prompt, n, done = req.prompt_token_ids, req.sampling.prompt_logprobs, len(req.prompt_logprobs)
    if c.start > done:  # no prompt token is ever skipped (such requests take no prefix-cache hit)
      raise RuntimeError(
        f"request {req.request_id}: prompt log-probs of positions {done}..{c.start} were not computed."
      )
    for p in range(done, min(c.start + c.num_tokens, len(prompt) - 1)):
      i = c.offset + p - c.start
      req.prompt_logprobs.append(
        PromptLogprob(
          prompt[p + 1],
          float(target_lp[i]),
          int(rank[i]),
          [(int(t), float(v)) for t, v in zip(top_ids[i, :n], top_lp[i, :n])],
        )
      )

  def generate(
    self,
    prompts: Iterable[Sequence[int]],
    sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
    *,
    progress=None,
  ) -> list[Request]:
    """Runs prompts to completion; returns the finished requests in prompt order."""
    prompts = list(prompts)
    params = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
    if len(params) != len(prompts):
      raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts.")
    base = next(self._arrivals)
    names = [f"gen-{base}-{i}" for i in range(len(prompts))]
    for name, p, s in zip(names, prompts, params):  # every prompt checked before any is admitted
      self._check_request(name, p, s)
    reqs = [self.add_request(name, p, s) for name, p, s in zip(names, prompts, params)]
    while self.has_unfinished():
      outs = self.step()
      if progress is not None:
        progress(self, outs)
    self.wait_for_save()
    return reqs
