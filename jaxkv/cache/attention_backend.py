"""Attention backends as the allocator sees them: the kernel block sizes they can read.

Mirrors vLLM's ``AttentionBackend.get_supported_kernel_block_sizes``, ``customize_attention_spec``
and ``select_common_block_size`` (``vllm/v1/worker/utils.py``, ``vllm/v1/attention/backend.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxkv.cache.kv_cache_spec import AttentionSpec, KVCacheSpec, MultipleOf

__all__ = [
  "AttentionBackend",
  "customize_attention_spec",
  "select_common_block_size",
  "is_block_size_supported",
]


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
  """A kernel family that reads one kind of cache.

  Attributes:
    name: shown in plans and errors.
    supported_kernel_block_sizes: token counts of the pages the kernel reads: exact ints, or
      ``MultipleOf(base)``. Empty: the cache is not paged (per-request state).
  """

  name: str
  supported_kernel_block_sizes: tuple[int | MultipleOf, ...] = (MultipleOf(1),)

  def __str__(self) -> str:
    sizes = ", ".join(str(s) for s in self.supported_kernel_block_sizes)
    return f"{self.name} [{sizes}]"


def is_block_size_supported(block_size: int, backend: AttentionBackend) -> bool:
  for s in backend.supported_kernel_block_sizes:
    if isinstance(s, MultipleOf):
      if block_size % s.base == 0:
        return True
    elif s == block_size:
      return True
  return False


def customize_attention_spec(backend: AttentionBackend, spec: KVCacheSpec) -> KVCacheSpec:
  """Gives specs of fixed-size backends ``MultipleOf(max size)`` block-stride alignment.

  A backend that reads only fixed page sizes can read a packed block only if the block stride
  is a whole number of its largest pages; the alignment is resolved later against the final
  block size (``KVCacheSpec.get_block_stride_alignment``).
  """
  sizes = backend.supported_kernel_block_sizes
  if (
    isinstance(spec, AttentionSpec)
    and spec.block_stride_alignment is None
    and sizes
    and all(isinstance(s, int) for s in sizes)
  ):
    return dataclasses.replace(spec, block_stride_alignment=MultipleOf(max(sizes)))
  return spec


def select_common_block_size(block_size: int, backends: Sequence[AttentionBackend]) -> int:
  """The kernel block size every backend reads for a ``block_size``-token manager block.

  ``block_size`` itself if all backends support it, else the largest int size of any backend
  that divides it and that all support.

  Raises:
    ValueError: naming the block size and every backend's sizes when there is none.
  """
  if all(is_block_size_supported(block_size, b) for b in backends):
    return block_size
  candidates = sorted(
    {s for b in backends for s in b.supported_kernel_block_sizes if isinstance(s, int) and block_size % s == 0},
    reverse=True,
  )
  for k in candidates:
    if all(is_block_size_supported(k, b) for b in backends):
      return k
  listed = "; ".join(f"{b.name}: {', '.join(str(s) for s in b.supported_kernel_block_sizes)}" for b in backends)
  raise ValueError(
    f"No common block size for {block_size} ({listed}). Choose a --block-size that every "
    "backend supports or that is a multiple of one of their sizes."
  )
