"""Per-group block managers and the KV-cache manager that coordinates them (host side).

Mirrors vLLM's ``single_type_kv_cache_manager.py`` and ``kv_cache_coordinator.py``. Every group
draws from one ``BlockPool``; a request owns, per group, a list of blocks whose ids go into that
group's block-table row. Full-attention groups grow with the request, sliding-window groups
release blocks that fall out of the window, ring (``CircularBufferSpec``) and linear-attention
state groups hold exactly one block for the request's life.

Prefix caching of hybrid models (vLLM's ``align`` mode for recurrent states): token groups share
full blocks by chained block hash. A recurrent state cannot be rebuilt from a prefix, so the state
after each block boundary a prefill reaches is *checkpointed*: copied into a pool block indexed
by the hash of the block that ends there. A hit of ``n`` blocks needs such a checkpoint at block
``n``; the request copies it into its own state slot before its first step (the copy is the
engine's: ``take_block_copies``). The kpool tail ring needs no restore: its capacity divides the
block size, so at a block boundary the unfinished pool is empty and nothing before the boundary is
read from the ring again.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence

import numpy as np

from jaxkv.host.block_pool import BlockHash, BlockPool, KVCacheBlock
from jaxkv.cache.kv_cache_spec import (
  CircularBufferSpec,
  KVCacheSpec,
  LinearAttentionStateSpec,
  SlidingWindowSpec,
  cdiv,
)

# Whether another level of the cache (an offload tier) holds the block of ``(block hash, group id)``.
Lookup = Callable[[BlockHash, int], bool]

__all__ = [
  "SingleTypeKVCacheManager",
  "FullAttentionManager",
  "SlidingWindowManager",
  "CircularBufferManager",
  "LinearAttentionStateManager",
  "KVCacheManager",
  "hash_block_tokens",
  "get_manager_for_spec",
]


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
  """Chained block hash: SHA-256 of the parent hash and the block's token ids (stable across runs)."""
  h = hashlib.sha256(parent or b"")
  h.update(np.asarray(token_ids, np.int64).tobytes())
  return h.digest()


class SingleTypeKVCacheManager:
  """Blocks of one KV-cache group, per request."""

  def __init__(self, spec: KVCacheSpec, block_pool: BlockPool, group_id: int):
    self.spec = spec
    self.block_size = spec.block_size
    self.block_pool = block_pool
    self.group_id = group_id
    self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
    self.num_cached_block: dict[str, int] = {}

  def num_blocks_needed(self, num_tokens: int) -> int:
    return cdiv(num_tokens, self.block_size)

  def get_num_blocks_to_allocate(
    self, request_id: str, num_tokens: int, new_computed: Sequence[KVCacheBlock] = ()
  ) -> int:
    owned = len(self.req_to_blocks.get(request_id, ())) + len(new_computed)
    # Touching free cached blocks also takes them out of the free queue.
    evictable = sum(1 for b in new_computed if b.ref_cnt == 0 and not b.is_null)
    return max(0, self.num_blocks_needed(num_tokens) - owned) + evictable

  def num_tokens_covered(self, request_id: str) -> float:
    """The most tokens the request's blocks hold: up to this many, it needs no new block."""
    return len(self.req_to_blocks.get(request_id, ())) * self.block_size

  def add_computed_blocks(self, request_id: str, blocks: Sequence[KVCacheBlock]) -> None:
    if not blocks:
      return
    self.block_pool.touch(blocks)
    self.req_to_blocks.setdefault(request_id, []).extend(blocks)
    self.num_cached_block[request_id] = len(self.req_to_blocks[request_id])

  def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
    blocks = self.req_to_blocks.setdefault(request_id, [])
    n = self.num_blocks_needed(num_tokens) - len(blocks)
    if n <= 0:
      return []
    new = self.block_pool.get_new_blocks(n)
    blocks.extend(new)
    return new

  def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> list[int]:
    """Frees blocks no future token attends to; returns the table columns now null."""
    return []

  def cache_blocks(self, request_id: str, block_hashes: Sequence[BlockHash], num_tokens: int) -> list[KVCacheBlock]:
    """Indexes the request's full blocks; returns those newly indexed."""
    if not self.spec.prefix_cacheable:
      return []
    blocks = self.req_to_blocks.get(request_id, [])
    start = self.num_cached_block.get(request_id, 0)
    end = min(num_tokens // self.block_size, len(block_hashes), len(blocks))
    new = []
    for i in range(start, end):
      if self.block_pool.cache_full_block(blocks[i], block_hashes[i], self.group_id):
        new.append(blocks[i])
    self.num_cached_block[request_id] = max(start, end)
    return new

  def find_longest_cache_hit(
    self, block_hashes: Sequence[BlockHash], max_blocks: int, elsewhere: Lookup | None = None
  ) -> list[KVCacheBlock | None]:
    """The cached blocks of the longest hit, up to ``max_blocks``; None where only ``elsewhere``
    (another level of the cache) holds the block."""
    hits = []
    for h in block_hashes[:max_blocks]:
      block = self.block_pool.get_cached_block(h, self.group_id)
      if block is None and not (elsewhere is not None and elsewhere(h, self.group_id)):
        break
      hits.append(block)
    return hits

  def free(self, request_id: str) -> None:
    blocks = self.req_to_blocks.pop(request_id, [])
    # Reverse order: the request's tail blocks are evicted first, its prefix stays cached longest.
    self.block_pool.free_blocks(reversed(blocks))
    self.num_cached_block.pop(request_id, None)


class FullAttentionManager(SingleTypeKVCacheManager):
  pass


class SlidingWindowManager(SingleTypeKVCacheManager):
  """Blocks wholly below ``num_computed - window + 1`` are replaced by the null block and freed."""

  spec: SlidingWindowSpec

  def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> list[int]:
    blocks = self.req_to_blocks.get(request_id, [])
    first_needed = max(0, num_computed_tokens - self.spec.sliding_window + 1)
    freed_cols = []
    for i in range(min(first_needed // self.block_size, len(blocks)) - 1, -1, -1):
      if blocks[i].is_null:
        break  # everything before was nulled earlier
      self.block_pool.free_blocks([blocks[i]])
      blocks[i] = self.block_pool.null_block
      freed_cols.append(i)
    return sorted(freed_cols)

  def find_longest_cache_hit(self, block_hashes, max_blocks, elsewhere=None):
    # Only the last cdiv(window - 1, bs) blocks before the hit point must be cached.
    need = cdiv(self.spec.sliding_window - 1, self.block_size)
    hits = [self.block_pool.null_block] * max_blocks
    run = 0
    for i in range(max_blocks - 1, -1, -1):
      h = block_hashes[i] if i < len(block_hashes) else None
      block = self.block_pool.get_cached_block(h, self.group_id) if h is not None else None
      if block is None and not (h is not None and elsewhere is not None and elsewhere(h, self.group_id)):
        run = 0
        continue
      hits[i] = block
      run += 1
      if run >= need:
        return hits[: i + need]
    # No full window found: a run starting at block 0 still counts (nothing precedes it).
    return hits[:run]


class _OneBlockPerRequestManager(SingleTypeKVCacheManager):
  """A fixed number of blocks per request for its life (the spec's), whatever its length."""

  def num_blocks_needed(self, num_tokens: int) -> int:
    return self.spec.max_num_blocks_per_req(num_tokens)

  def num_tokens_covered(self, request_id: str) -> float:
    return math.inf if len(self.req_to_blocks.get(request_id, ())) >= self.num_blocks_needed(0) else 0

  def find_longest_cache_hit(self, block_hashes, max_blocks, elsewhere=None):
    return []


class CircularBufferManager(_OneBlockPerRequestManager):
  """The kpool tail ring: a ``ring``-token circular buffer in one block per request.

  Never restored on a prefix hit: hits end at block boundaries, the ring's capacity divides the
  block size (``check_prefix_caching``), so the first pool after the hit starts empty and only
  ring slots written after the hit are read.
  """

  def check_prefix_caching(self, hash_block_size: int) -> None:
    if hash_block_size % self.spec.block_size:
      raise ValueError(
        f"prefix caching resumes at block boundaries of {hash_block_size} tokens, which must be a multiple of "
        f"the tail ring's {self.spec.block_size} slots (group {self.group_id}) so the ring is empty there; "
        f"use a block size that is a multiple of {self.spec.block_size}."
      )


class LinearAttentionStateManager(_OneBlockPerRequestManager):
  """Linear-attention state slots (KDA conv windows + recurrent state): one per request, plus one
  per speculative token; and the prefix cache's state checkpoints.

  A checkpoint is a pool block holding the state after a block boundary, indexed by the hash of
  the block ending there (so it is found, and evicted, like a cached token block). A request
  continues from its slot ``num_speculative_blocks`` (the slot of a step's last token): that is
  where a checkpoint is taken from and restored to.
  """

  spec: LinearAttentionStateSpec

  def __init__(self, spec, block_pool, group_id):
    super().__init__(spec, block_pool, group_id)
    self._restores: dict[str, KVCacheBlock] = {}  # request -> checkpoint to copy into its slot

  @property
  def state_column(self) -> int:
    return self.spec.num_speculative_blocks

  def get_checkpoint(self, block_hash: BlockHash) -> KVCacheBlock | None:
    return self.block_pool.get_cached_block(block_hash, self.group_id)

  def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed=()):
    # The checkpoint to restore is referenced until its copy is dispatched.
    evictable = sum(1 for b in new_computed if b.ref_cnt == 0)
    return max(0, self.num_blocks_needed(num_tokens) - len(self.req_to_blocks.get(request_id, ()))) + evictable

  def add_computed_blocks(self, request_id, blocks):
    for ckpt in blocks:  # at most one: the state at the hit's end
      self.block_pool.touch([ckpt])
      self._restores[request_id] = ckpt

  def take_restores(self) -> list[tuple[int, int]]:
    """``(checkpoint, slot block)`` copies for requests admitted on a hit; the references end here
    (the caller dispatches the copies before anything can reuse the checkpoints)."""
    out = []
    for request_id, ckpt in self._restores.items():
      out.append((ckpt.block_id, self.req_to_blocks[request_id][self.state_column].block_id))
      self.block_pool.free_blocks([ckpt])
    self._restores.clear()
    return out

  def checkpoint(self, request_id: str, block_hash: BlockHash) -> tuple[int, int] | None:
    """Indexes a copy of the request's current state under ``block_hash``: returns ``(slot block,
    checkpoint block)`` to copy, or None (already checkpointed, or no free block to spare)."""
    if self.get_checkpoint(block_hash) is not None or not self.block_pool.get_num_free_blocks():
      return None
    block = self.block_pool.cache_free_block(block_hash, self.group_id)
    return self.req_to_blocks[request_id][self.state_column].block_id, block.block_id

  def cache_blocks(self, request_id, block_hashes, num_tokens):
    return []  # states are indexed as checkpoints only

  def free(self, request_id: str) -> None:
    ckpt = self._restores.pop(request_id, None)
    if ckpt is not None:
      self.block_pool.free_blocks([ckpt])
    super().free(request_id)


def get_manager_for_spec(spec: KVCacheSpec, block_pool: BlockPool, group_id: int) -> SingleTypeKVCacheManager:
  for spec_type, manager in (
    (CircularBufferSpec, CircularBufferManager),
    (LinearAttentionStateSpec, LinearAttentionStateManager),
    (SlidingWindowSpec, SlidingWindowManager),
  ):
    if isinstance(spec, spec_type):
      return manager(spec, block_pool, group_id)
  return FullAttentionManager(spec, block_pool, group_id)


class KVCacheManager:
  """Allocates and frees a request's blocks in every group of one pool.

  Args:
    group_specs: the spec of each KV-cache group (its layers' common block size and kind).
    num_blocks: blocks in the pool, the null block included.
    enable_caching: prefix caching: token groups by block hash, recurrent states by checkpoints at
      block boundaries (module docstring); off when no group holds tokens.
    use_eagle: a draft layer (MTP) reads each position's successor token, so the last block of a
      hit is recomputed (vLLM's ``use_eagle``): its last draft-layer entry depends on the token
      after it, which the hit's hashes do not cover.
    linear_prefill_chunk: the grid of chunked linear-attention prefill (``CacheConfig``; None:
      recurrent). A state there depends on how the positions before it were computed, chunkwise
      below a prompt's last multiple of the grid and recurrently after it, so states are
      checkpointed and reused only below that bound of the request's own prompt
      (``reusable_tokens``, ``checkpoint_states``): a hit then stays bitwise a cold run.
  """

  def __init__(
    self,
    group_specs: Sequence[KVCacheSpec],
    num_blocks: int,
    *,
    enable_caching: bool = True,
    use_eagle: bool = False,
    linear_prefill_chunk: int | None = None,
  ):
    token_sizes = {s.block_size for s in group_specs if not s.is_state}
    self.hash_block_size = min(token_sizes) if token_sizes else None
    self.enable_caching = enable_caching and self.hash_block_size is not None
    self.use_eagle = use_eagle
    self.linear_prefill_chunk = linear_prefill_chunk
    self.block_pool = BlockPool(num_blocks, enable_caching=self.enable_caching)
    self.managers = [get_manager_for_spec(s, self.block_pool, g) for g, s in enumerate(group_specs)]
    self._token_managers = [m for m in self.managers if not m.spec.is_state]
    self._state_managers = [m for m in self.managers if isinstance(m, LinearAttentionStateManager)]
    if self.enable_caching:
      for m in self.managers:
        if isinstance(m, CircularBufferManager):
          m.check_prefix_caching(self.hash_block_size)
    # The managers whose remove_skipped_blocks frees anything.
    self._windowed = [m for m in self.managers if isinstance(m, SlidingWindowManager)]
    # Per request: the tokens its blocks hold in every group (allocate_slots' fast path).
    self._covered: dict[str, float] = {}
    self._block_hashes: dict[str, list[BlockHash]] = {}
    self._newly_cached: list[tuple[BlockHash, int, int]] = []

  @property
  def num_free_blocks(self) -> int:
    return self.block_pool.get_num_free_blocks()

  def block_ids(self, request_id: str) -> tuple[list[int], ...]:
    return tuple([b.block_id for b in m.req_to_blocks.get(request_id, [])] for m in self.managers)

  def block_hashes(self, request_id: str, token_ids: Sequence[int]) -> list[BlockHash]:
    """The chained hashes of the full blocks of ``token_ids`` (kept per request, extended as it grows)."""
    hashes = self._block_hashes.setdefault(request_id, [])
    bs = self.hash_block_size
    for i in range(len(hashes), len(token_ids) // bs):
      hashes.append(hash_block_tokens(hashes[-1] if hashes else None, token_ids[i * bs : (i + 1) * bs]))
    return hashes

  def _state_bound(self, num_prompt_tokens: int) -> int | None:
    """The last position a checkpointed state may sit at (None: any)."""
    if self.linear_prefill_chunk is None or not self._state_managers:
      return None
    return num_prompt_tokens // self.linear_prefill_chunk * self.linear_prefill_chunk

  def reusable_tokens(self, token_ids: Sequence[int], num_prompt_tokens: int) -> Sequence[int]:
    """The tokens a prefix hit of this request may cover, plus the one always computed: all of
    ``token_ids``, or up to the state bound (``linear_prefill_chunk``). What the scheduler looks up."""
    bound = self._state_bound(num_prompt_tokens)
    return token_ids if bound is None else token_ids[: bound + 1]

  def find_prefix_hit(self, request_id: str, token_ids: Sequence[int], *, elsewhere: Lookup | None = None) -> int:
    """The one prefix-hit search: the hit's length in blocks.

    At least one token is always left to compute (its logits are needed). The hit ends at a block
    boundary where every token group has its blocks and every state group a checkpoint; with a
    draft layer, one block before the longest such run (``use_eagle``). A block counts when the
    device indexes it or ``elsewhere(block_hash, group_id)`` says another level of the cache holds
    it (``OffloadingConnector``'s tier).
    """
    if not self.enable_caching or len(token_ids) < 2:
      return 0
    hashes = self.block_hashes(request_id, token_ids)
    n = (len(token_ids) - 1) // self.hash_block_size
    # Shrink the token groups to their common length (a group's hit must end at a cached block).
    while n > 0:
      lengths = [len(m.find_longest_cache_hit(hashes, n, elsewhere)) for m in self._token_managers]
      if min(lengths) >= n:
        break
      n = min(lengths)
    if self.use_eagle:
      n = max(n - 1, 0)

    def has_checkpoint(m: LinearAttentionStateManager) -> bool:
      h = hashes[n - 1]
      return m.get_checkpoint(h) is not None or (elsewhere is not None and elsewhere(h, m.group_id))

    while n > 0 and not all(has_checkpoint(m) for m in self._state_managers):
      n -= 1
    return n

  def cache_external_blocks(
    self, request_id: str, token_ids: Sequence[int], num_blocks: int, elsewhere: Lookup
  ) -> list[tuple[BlockHash, int, int]] | None:
    """Makes a hit of ``num_blocks`` blocks (``find_prefix_hit`` with ``elsewhere``) a device hit:
    the blocks only ``elsewhere`` holds are indexed in free device blocks, left free (the admission
    that follows takes them like any cached block). The hit's device blocks are kept from eviction
    while the free ones are taken. Returns ``(block hash, group, block id)`` for the caller to
    write, or None when they do not fit in the free blocks (nothing changes: a miss, never an error).
    """
    hashes = self.block_hashes(request_id, token_ids)
    # With a draft layer the admission drops the last block of its hit again: one more must be there.
    span = num_blocks + 1 if self.use_eagle else num_blocks
    keys, on_device = [], []
    for m in self._token_managers:
      for h, block in zip(hashes, m.find_longest_cache_hit(hashes, span, elsewhere)):
        if block is None:
          keys.append((h, m.group_id))
        elif not block.is_null:
          on_device.append(block)
    for m in self._state_managers:
      ckpt = m.get_checkpoint(hashes[num_blocks - 1])
      if ckpt is None:
        keys.append((hashes[num_blocks - 1], m.group_id))
      else:
        on_device.append(ckpt)
    # Touching the hit's free device blocks takes them out of the free list: the new ones must fit
    # in what is free after that.
    touched_free = len({b.block_id for b in on_device if b.ref_cnt == 0})
    if len(keys) > self.block_pool.get_num_free_blocks() - touched_free:
      return None
    self.block_pool.touch(on_device)
    placed = [(h, g, self.block_pool.cache_free_block(h, g).block_id) for h, g in keys]
    self.block_pool.free_blocks(on_device)
    return placed

  def get_computed_blocks(
    self, request_id: str, token_ids: Sequence[int]
  ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
    """Longest cached prefix of the prompt (``find_prefix_hit``), per group, and its length in
    tokens. Per group: the cached blocks (token groups), the checkpoint to restore (state groups),
    nothing (rings).
    """
    n = self.find_prefix_hit(request_id, token_ids)
    if n == 0:
      return tuple([] for _ in self.managers), 0
    hashes = self.block_hashes(request_id, token_ids)
    out = []
    for m in self.managers:
      if isinstance(m, LinearAttentionStateManager):
        out.append([m.get_checkpoint(hashes[n - 1])])
      elif m.spec.is_state:
        out.append([])
      else:
        out.append(m.find_longest_cache_hit(hashes, n)[:n])
    return tuple(out), n * self.hash_block_size

  def allocate_slots(
    self,
    request_id: str,
    num_tokens: int,
    *,
    num_computed_tokens: int = 0,
    new_computed_blocks: Sequence[Sequence[KVCacheBlock]] | None = None,
  ) -> tuple[list[int], ...] | None:
    """Makes the request own blocks for its first ``num_tokens`` tokens, in every group.

    Args:
      num_tokens: tokens that need a slot after this step (computed + scheduled + lookahead).
      num_computed_tokens: tokens already computed; sliding-window groups free what left the window.
      new_computed_blocks: prefix-cache hits from ``get_computed_blocks`` (first call only).

    Returns:
      The newly allocated block ids per group (cached hits first), to append to the block-table
      rows; or None when the pool cannot supply them (nothing is changed: preempt and retry).
    """
    for m in self._windowed:
      m.remove_skipped_blocks(request_id, num_computed_tokens)
    if not new_computed_blocks and num_tokens <= self._covered.get(request_id, -1):
      # Every running request passes here every step and a decode step rarely needs a block: that
      # case goes no further (the host's work a step is on the critical path at batch 32).
      return tuple([] for _ in self.managers)
    hits = new_computed_blocks or [()] * len(self.managers)
    need = [m.get_num_blocks_to_allocate(request_id, num_tokens, h) for m, h in zip(self.managers, hits)]
    if sum(need) > self.num_free_blocks:
      return None
    # Every group's hits are referenced before any group allocates (which may evict free cached blocks).
    for m, h in zip(self.managers, hits):
      m.add_computed_blocks(request_id, h)
    out = []
    for m, h in zip(self.managers, hits):
      shared = [] if m.spec.is_state else [b.block_id for b in h]  # a checkpoint is copied, not shared
      out.append(shared + [b.block_id for b in m.allocate_new_blocks(request_id, num_tokens)])
    self._covered[request_id] = min(m.num_tokens_covered(request_id) for m in self.managers)
    return tuple(out)

  def cache_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
    """Indexes the request's full, computed blocks for prefix hits by later requests.

    ``token_ids``: the request's known tokens; blocks past them (drafts, a token in flight) wait.
    """
    if not self.enable_caching:
      return
    num_computed_tokens = min(num_computed_tokens, len(token_ids))
    hashes = self.block_hashes(request_id, token_ids[:num_computed_tokens])
    for m in self._token_managers:
      self._newly_cached += [
        (b.block_hash[0], m.group_id, b.block_id) for b in m.cache_blocks(request_id, hashes, num_computed_tokens)
      ]

  def checkpoint_states(
    self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int, num_prompt_tokens: int
  ) -> list[tuple[int, int]]:
    """After a step whose last token of this request ends a block (and is no draft): checkpoints
    the request's recurrent states there. Returns ``(source, destination)`` block copies for the
    engine to dispatch right after that step; none when caching is off, the step did not end on a
    boundary, the boundary's tokens are not all known yet, it lies past the state bound of the
    request's ``num_prompt_tokens`` (``linear_prefill_chunk``), or it is checkpointed already."""
    bs = self.hash_block_size
    bound = self._state_bound(num_prompt_tokens)
    if (
      not self.enable_caching
      or not num_computed_tokens
      or num_computed_tokens % bs
      or num_computed_tokens > len(token_ids)
      or (bound is not None and num_computed_tokens > bound)
    ):
      return []
    block_hash = self.block_hashes(request_id, token_ids[:num_computed_tokens])[num_computed_tokens // bs - 1]
    copies = []
    for m in self._state_managers:
      copy = m.checkpoint(request_id, block_hash)
      if copy is not None:
        copies.append(copy)
        self._newly_cached.append((block_hash, m.group_id, copy[1]))
    return copies

  def take_newly_cached(self) -> list[tuple[BlockHash, int, int]]:
    """``(block hash, group id, block id)`` of every block indexed since the last call (token
    blocks and state checkpoints): what an offloading connector saves."""
    out, self._newly_cached = self._newly_cached, []
    return out

  def take_block_copies(self) -> list[tuple[int, int]]:
    """``(checkpoint, state slot)`` restores of requests admitted on a prefix hit since the last
    call: the engine copies them before the step that reads the slots."""
    return [c for m in self._state_managers for c in m.take_restores()]

  def reset_prefix_cache(self) -> None:
    """Forgets every cached block and checkpoint (blocks in use stay with their requests)."""
    self.block_pool.reset_prefix_cache()

  def free(self, request_id: str) -> None:
    """Releases every block of a finished, aborted or preempted request."""
    for m in self.managers:
      m.free(request_id)
    self._covered.pop(request_id, None)
    self._block_hashes.pop(request_id, None)
