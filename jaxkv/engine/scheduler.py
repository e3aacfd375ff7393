"""Continuous batching with chunked prefill and preemption by recompute (host side, NumPy-free).

Each step spends a token budget: running requests first (decode tokens, or the next chunk of a
prefill), then waiting requests in arrival order while budget, table rows and blocks last; with
``long_prefill_token_threshold``, each request takes at most that many tokens of a step first, and
the budget left after all of them goes to them again in order. When
the pool cannot supply a running request's blocks, the most recently arrived running request is
preempted: its blocks (every group: latents, pooled keys, tail ring, KDA slots) go back to the pool
and it re-enters the queue to recompute its prompt and outputs so far. Nothing accepted is lost.

With prefix caching, a request enters at its longest cached prefix (``num_cached_tokens``; a
preempted one too), and a chunk that would run past a block boundary before the request's last
known token ends there instead (vLLM's ``align`` mode), so the state after every block boundary
of a prompt can be checkpointed for later hits.
"""

from __future__ import annotations

import collections
import dataclasses

from jaxkv.host.block_table import MultiGroupBlockTable
from jaxkv.engine.request import Request, RequestStatus
from jaxkv.host.kv_cache_manager import KVCacheManager

__all__ = ["Scheduler", "ScheduledChunk"]


@dataclasses.dataclass(slots=True)  # not frozen: 1 us less to make, a request a step
class ScheduledChunk:
  """``num_tokens`` tokens of ``request`` from position ``start``; ``samples``: the chunk reaches
  the request's last token, whose logits pick the next one (fixed when scheduled);
  ``num_drafts``: speculative tokens after it, verified in the same step; ``row``: the request's
  block-table row in this step (where its outputs are, even if it is preempted before they are
  read back); ``offset``: where its tokens start in the step."""

  request: Request
  start: int
  num_tokens: int
  samples: bool
  num_drafts: int = 0
  row: int = -1
  offset: int = 0


class Scheduler:
  def __init__(
    self,
    kv_manager: KVCacheManager,
    block_tables: MultiGroupBlockTable,
    *,
    max_num_reqs: int,
    max_num_batched_tokens: int,
    long_prefill_token_threshold: int = 0,
    num_lookahead_tokens: int = 0,
    connector=None,
    swap=None,
  ):
    """``long_prefill_token_threshold``: when positive, each request's share of a step before the
    others have theirs (vLLM's setting; unlike vLLM, a budget the shares leave goes to them again,
    ``_extend``): long prompts' chunks share the step instead of one taking the budget alone.
    ``num_lookahead_tokens``: slots past the scheduled tokens that a sampling chunk also needs
    (the MTP draft steps write the draft positions). ``connector``: a ``KVConnectorBase`` asked for
    external prefix hits at admission; ``swap``: a ``SwapSpace`` for preemption by swapping."""
    self.kv = kv_manager
    self.tables = block_tables
    self.max_num_reqs = max_num_reqs
    self.budget = max_num_batched_tokens
    self.long_prefill_token_threshold = long_prefill_token_threshold
    self.lookahead = num_lookahead_tokens
    self.waiting: collections.deque[Request] = collections.deque()
    self.running: list[Request] = []
    self.free_rows = list(range(max_num_reqs - 1, -1, -1))
    self.num_preemptions = 0
    self.connector = connector
    self.swap = swap
    self._preempted_now: set[int] = set()  # requests preempted during the current schedule()

  def add(self, request: Request) -> None:
    self.waiting.append(request)

  def has_work(self) -> bool:
    return bool(self.waiting or self.running)

  def finish(self, request: Request, status: RequestStatus, reason: str | None = None) -> None:
    """Ends a running or waiting request and releases its blocks and row."""
    if request in self.running:
      self.running.remove(request)
    elif request in self.waiting:
      self.waiting.remove(request)
    self._release(request)
    if self.swap is not None:
      self.swap.discard(request.request_id)
    request.status = status
    request.finish_reason = reason

  def _release(self, request: Request) -> None:
    self.kv.free(request.request_id)
    if request.row >= 0:
      self.tables.clear_row(request.row)
      self.free_rows.append(request.row)
      request.row = -1

  def _preempt(self, request: Request) -> None:
    """Back to the queue's front: its blocks swapped to host (``swap``, when they fit) or freed to
    be recomputed."""
    self.running.remove(request)
    if not (self.swap is not None and self.swap.swap_out(request.request_id, self.kv.block_ids(request.request_id))):
      request.num_computed_tokens = 0
    self._release(request)
    request.spec_token_ids = []
    request.status = RequestStatus.WAITING
    request.num_preemptions += 1
    self.num_preemptions += 1
    self._preempted_now.add(id(request))
    self.waiting.appendleft(request)

  def _allocate(self, request: Request, n: int, hits=None) -> bool:
    end = request.num_computed_tokens + n
    if end >= request.num_tokens:
      end += self.lookahead
    new = self.kv.allocate_slots(
      request.request_id, end, num_computed_tokens=request.num_computed_tokens, new_computed_blocks=hits
    )
    if new is None:
      return False
    if any(new):
      self.tables.append_row(new, request.row)
    return True

  def _chunk_size(self, request: Request, budget: int, capped: bool = True) -> int:
    """Tokens to schedule: the pending ones within budget (and ``long_prefill_token_threshold``
    when ``capped``), ending at the next block boundary when one comes before the request's last
    known token (prefix caching checkpoints states there)."""
    n = min(self._pending(request), budget)
    if capped and self.long_prefill_token_threshold > 0:
      n = min(n, self.long_prefill_token_threshold)
    if self.kv.enable_caching:
      bs = self.kv.hash_block_size
      boundary = (request.num_computed_tokens // bs + 1) * bs
      if boundary < min(request.num_computed_tokens + n, len(request.all_token_ids)):
        n = boundary - request.num_computed_tokens
    return n

  @staticmethod
  def _pending(request: Request) -> int:
    """Tokens not yet computed: the rest of the prompt and outputs, then the drafts to verify."""
    return request.num_tokens + len(request.spec_token_ids) - request.num_computed_tokens

  @staticmethod
  def _chunk(request: Request, n: int, offset: int) -> ScheduledChunk:
    start = request.num_computed_tokens
    end = start + n
    return ScheduledChunk(
      request, start, n, end >= request.num_tokens, max(0, end - request.num_tokens), request.row, offset
    )

  def schedule(self) -> list[ScheduledChunk]:
    budget = self.budget
    self._preempted_now.clear()
    chunks: list[ScheduledChunk] = []
    for request in list(self.running):
      if budget == 0:
        break
      if id(request) in self._preempted_now or request.awaits_last_token:  # preempted below; or done
        continue
      n = self._chunk_size(request, budget)
      while not self._allocate(request, n):
        # The latest arrival not already scheduled this step gives its blocks back.
        scheduled = {id(c.request) for c in chunks}
        victim = max((r for r in self.running if id(r) not in scheduled), key=lambda r: r.arrival)
        self._preempt(victim)
        if victim is request:
          break
      else:
        chunks.append(self._chunk(request, n, self.budget - budget))
        budget -= n
    while self.waiting and budget > 0 and self.free_rows:
      request = self.waiting[0]
      swapped = self.swap is not None and self.swap.is_swapped(request.request_id)
      if swapped and id(request) in self._preempted_now:
        break  # swapped out during this schedule: its blocks are gathered when this step is dispatched
      hits = None
      if not swapped and request.sampling.prompt_logprobs is not None:
        request.num_computed_tokens = 0  # every prompt token's logits are wanted: no hit (vLLM too)
      elif not swapped:
        ids = self.kv.reusable_tokens(request.all_token_ids, len(request.prompt_token_ids))
        if self.connector is not None:
          self.connector.get_num_new_matched_tokens(self.kv, request.request_id, ids)
        hits, request.num_computed_tokens = self.kv.get_computed_blocks(request.request_id, ids)
      n = self._chunk_size(request, budget)
      request.row = self.free_rows.pop()
      if not self._allocate(request, n, hits):
        self.free_rows.append(request.row)
        request.row = -1
        if not swapped:
          request.num_computed_tokens = 0
        if not self.running and not chunks:
          raise RuntimeError(
            f"request {request.request_id} needs more KV-cache blocks than the pool has "
            f"({self.kv.num_free_blocks} free); raise the memory budget or lower max_model_len."
          )
        break
      self.waiting.popleft()
      if swapped:
        self.swap.swap_in(request.request_id, self.kv.block_ids(request.request_id))
      else:
        request.num_cached_tokens = request.num_computed_tokens
      request.status = RequestStatus.RUNNING
      self.running.append(request)
      chunks.append(self._chunk(request, n, self.budget - budget))
      budget -= n
    if self.long_prefill_token_threshold > 0:
      chunks = self._extend(chunks, budget)
    for c in chunks:
      c.request.num_computed_tokens += c.num_tokens
    return chunks

  def _extend(self, chunks: list[ScheduledChunk], budget: int) -> list[ScheduledChunk]:
    """The budget that capped chunks left unspent goes to them again, in order, uncapped (as far
    as blocks last; nobody is preempted for it), so a cap never makes a step smaller: with fewer
    prompts than ``budget / long_prefill_token_threshold`` vLLM's cap leaves the rest of the step
    empty, and 8 prompts of 1,024 tokens took three times as long to prefill at a cap of 64
    (docs/engine.md)."""
    out, offset = [], 0
    for c in chunks:
      total = self._chunk_size(c.request, c.num_tokens + budget, capped=False) if budget else c.num_tokens
      if total > c.num_tokens and self._allocate(c.request, total):
        budget -= total - c.num_tokens
        c = self._chunk(c.request, total, offset)
      out.append(c if c.offset == offset else dataclasses.replace(c, offset=offset))
      offset += c.num_tokens
    return out
