"""The KV-cache planner: layer specs + memory budget -> groups, layout, bytes per block, bindings.

Mirrors vLLM's ``kv_cache_planning.py`` / ``kv_cache_utils.py`` for the two layouts jaxkv
supports:

* ``"dense"`` (layer-compact): every layer has its own ``uint8[num_blocks * bpk, kernel_page]``
  array, split into its attention group's kernel blocks at allocation, so kernel block ``j`` of
  block ``b`` is ``b * bpk + j`` and token slots need no change. Groups do not alias: a block costs
  the pages of every layer.
* ``"packed"`` (block-outermost): one ``uint8[num_blocks, bytes_per_block]`` arena; a manager block
  id names a whole packed block; each group's layers sit back to back from byte 0 of it (groups
  alias, since a block belongs to one group at a time). Per-request state layers (the kpool tail
  ring, KDA states) are split into groups that fit the bytes the token groups already need,
  and the block size is scaled up when a state page would not fit. Bytes per block are rounded up
  to the lcm of every layer's resolved stride alignment (and of 512 bytes, so typed views of each
  layer start on whole element rows), so a compressed cache can be re-strided
  into whole kernel pages (``AttentionGroup.map_kv_cache_to_kernel_blocks``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxkv.attention_backend import AttentionBackend, customize_attention_spec
from jaxkv.attention_group import AttentionGroup
from jaxkv.kv_cache_spec import AttentionSpec, CircularBufferSpec, KVCacheSpec, SlidingWindowSpec

__all__ = [
    "KVCacheLayer",
    "LayerBinding",
    "KVCacheTensor",
    "KVCacheGroupSpec",
    "KVCacheConfig",
    "plan_kv_cache",
    "LAYOUTS",
]

LAYOUTS = ("dense", "packed")
_INT32_MAX = 2**31 - 1
# Packed rows and layer offsets are multiples of this, so every layer's typed view (fp8, bf16,
# fp32 rows of up to 128 channels) starts on a whole element row of the arena.
_PACKED_ROW_ALIGNMENT = 512


@dataclasses.dataclass(frozen=True)
class KVCacheLayer:
  """One cache a model layer keeps (a DSA layer keeps three: latent, pooled keys, tail ring)."""

  name: str
  spec: KVCacheSpec
  backend: AttentionBackend


@dataclasses.dataclass(frozen=True)
class LayerBinding:
  """Where a layer's pages live.

  Page of manager block ``b`` = ``tensor[b * block_stride_rows + ..., page_offset_bytes:...]``;
  in kernel units, kernel block ``k`` is row ``base_row + k`` of the tensor viewed as rows of
  ``kernel_page_bytes`` (dense: the tensor's own rows).
  """

  layer_name: str
  kv_cache_group_id: int
  attention_group_id: int
  tensor: str
  page_offset_bytes: int
  page_size_bytes: int
  block_stride_bytes: int
  kernel_block_size: int | None
  kernel_page_bytes: int
  kernel_block_stride: int


@dataclasses.dataclass(frozen=True)
class KVCacheTensor:
  """One backing allocation: ``uint8[num_rows, row_bytes]``."""

  name: str
  num_rows: int
  row_bytes: int
  layer_names: tuple[str, ...]

  @property
  def size_bytes(self) -> int:
    return self.num_rows * self.row_bytes

  def shape_dtype(self) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((self.num_rows, self.row_bytes), jnp.uint8)


@dataclasses.dataclass(frozen=True)
class KVCacheGroupSpec:
  """Layers sharing one block table (same block size and manager kind)."""

  layer_names: tuple[str, ...]
  kv_cache_spec: KVCacheSpec  # the first layer's; managers need block size and kind only
  layer_specs: tuple[KVCacheSpec, ...]

  @property
  def page_size_bytes(self) -> int:
    return sum(s.page_size_bytes for s in self.layer_specs)


@dataclasses.dataclass(frozen=True)
class KVCacheConfig:
  layout: str
  block_size: int
  requested_block_size: int
  num_blocks: int
  bytes_per_block: int
  max_model_len: int
  kv_cache_groups: tuple[KVCacheGroupSpec, ...]
  attention_groups: tuple[AttentionGroup, ...]
  tensors: tuple[KVCacheTensor, ...]
  bindings: tuple[LayerBinding, ...]
  stride_alignment_bytes: int

  def binding(self, layer_name: str) -> LayerBinding:
    for b in self.bindings:
      if b.layer_name == layer_name:
        return b
    raise KeyError(f"no layer {layer_name!r} in the plan")

  @property
  def token_capacity(self) -> int:
    """Tokens the pool holds if all non-null blocks serve the token groups."""
    return (self.num_blocks - 1) * self.block_size

  def blocks_per_request(self, num_tokens: int) -> int:
    return sum(g.kv_cache_spec.max_num_blocks_per_req(num_tokens) for g in self.kv_cache_groups)

  @property
  def max_num_full_length_requests(self) -> int:
    return (self.num_blocks - 1) // self.blocks_per_request(self.max_model_len)

  def block_table_widths(self) -> tuple[int, ...]:
    return tuple(g.kv_cache_spec.max_num_blocks_per_req(self.max_model_len) for g in self.kv_cache_groups)

  def allocate(self, device=None) -> dict[str, jax.Array]:
    """Zeroed backing arrays, keyed by tensor name."""
    return {
        t.name: jax.device_put(jnp.zeros((t.num_rows, t.row_bytes), jnp.uint8), device) for t in self.tensors
    }

  def describe(self) -> dict:
    return {
        "layout": self.layout,
        "block_size": self.block_size,
        "requested_block_size": self.requested_block_size,
        "num_blocks": self.num_blocks,
        "bytes_per_block": self.bytes_per_block,
        "stride_alignment_bytes": self.stride_alignment_bytes,
        "max_model_len": self.max_model_len,
        "token_capacity": self.token_capacity,
        "blocks_per_full_length_request": self.blocks_per_request(self.max_model_len),
        "max_num_full_length_requests": self.max_num_full_length_requests,
        "total_bytes": sum(t.size_bytes for t in self.tensors),
        "kv_cache_groups": [
            {
                "group_id": g,
                "manager_block_size": grp.kv_cache_spec.block_size,
                "kind": type(grp.kv_cache_spec).__name__,
                "num_layers": len(grp.layer_names),
                "layers": list(grp.layer_names),
                "page_size_bytes": grp.page_size_bytes,
                "block_table_width": w,
            }
            for g, (grp, w) in enumerate(zip(self.kv_cache_groups, self.block_table_widths()))
        ],
        "attention_groups": [
            {**ag.describe(), "kv_cache_spec": ag.kv_cache_spec.describe()} for ag in self.attention_groups
        ],
        "tensors": [
            {"name": t.name, "shape": [t.num_rows, t.row_bytes], "dtype": "uint8", "layers": len(t.layer_names)}
            for t in self.tensors
        ],
        "bindings": [dataclasses.asdict(b) for b in self.bindings],
    }


def _group_key(spec: KVCacheSpec):
  if spec.is_state:
    return ("state", spec)  # identical state specs share a group
  window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
  return ("tokens", spec.block_size, window)


def _scale_token_specs(layers: Sequence[KVCacheLayer], block_size: int) -> list[KVCacheLayer]:
  # A ring's block size is its capacity; every other spec follows the manager block size.
  return [
      l if isinstance(l.spec, CircularBufferSpec) else dataclasses.replace(l, spec=l.spec.copy_with_new_block_size(block_size))
      for l in layers
  ]


def _token_group_bytes(layers: Sequence[KVCacheLayer]) -> int:
  per_group: dict = {}
  for l in layers:
    if not l.spec.is_state:
      per_group[_group_key(l.spec)] = per_group.get(_group_key(l.spec), 0) + l.spec.page_size_bytes
  return max(per_group.values(), default=0)


def plan_kv_cache(
    layers: Sequence[KVCacheLayer],
    *,
    block_size: int,
    memory_bytes: int,
    max_model_len: int,
    layout: str = "packed",
    kernel_block_size: int | None = None,
) -> KVCacheConfig:
  """Plans the KV cache of a model.

  Args:
    layers: every cache of the model, token specs at ``block_size``.
    block_size: requested manager block size (tokens); packed plans scale it up by a whole
      factor when a per-request state page would not fit in one block.
    memory_bytes: budget for all caches.
    max_model_len: longest request; one request of that length must fit.
    layout: ``"dense"`` or ``"packed"``.
    kernel_block_size: requested kernel block size for token caches (dense splits); compressed
      caches always read their backend's own page size.

  Raises:
    ValueError: naming the values, for a kernel size that does not divide the block size, no
      common kernel block size, splitting padded pages or packed token caches, a ring that does
      not divide the block, or a budget too small for one request.
  """
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}.")
  if not layers:
    raise ValueError("a KV-cache plan needs at least one layer.")
  names = [l.name for l in layers]
  if len(set(names)) != len(names):
    raise ValueError(f"duplicate layer names: {sorted({n for n in names if names.count(n) > 1})}.")
  if max_model_len <= 0 or memory_bytes <= 0:
    raise ValueError(f"max_model_len ({max_model_len}) and memory_bytes ({memory_bytes}) must be positive.")

  layers = [dataclasses.replace(l, spec=customize_attention_spec(l.backend, l.spec)) for l in layers]
  requested = block_size
  if layout == "packed":
    anchor = _token_group_bytes(layers)
    state_page = max((l.spec.page_size_bytes for l in layers if l.spec.is_state), default=0)
    if anchor and state_page > anchor:
      # Scale the block so one block of the token groups can hold the largest state page.
      factor = 1
      while _token_group_bytes(_scale_token_specs(layers, block_size * factor)) < state_page:
        factor += 1
      block_size *= factor
  layers = _scale_token_specs(layers, block_size)
  for l in layers:
    if isinstance(l.spec, CircularBufferSpec) and block_size % l.spec.block_size:
      raise ValueError(
          f"{l.name}: the block size {block_size} must be a multiple of its ring of "
          f"{l.spec.block_size} slots (ring and token blocks share packed blocks). Use a block size "
          f"that is a multiple of {l.spec.block_size}."
      )

  # KV-cache groups.
  buckets: dict = {}
  for l in layers:
    buckets.setdefault(_group_key(l.spec), []).append(l)
  token_buckets = [b for k, b in buckets.items() if k[0] == "tokens"]
  state_buckets = [b for k, b in buckets.items() if k[0] == "state"]
  groups: list[list[KVCacheLayer]] = list(token_buckets)
  anchor = _token_group_bytes(layers)
  for bucket in state_buckets:
    page = bucket[0].spec.page_size_bytes
    per_group = len(bucket) if layout == "dense" or not anchor else max(1, anchor // page)
    groups += [bucket[i:i + per_group] for i in range(0, len(bucket), per_group)]

  # Attention groups: same spec and backend within a KV-cache group.
  attn_groups: list[AttentionGroup] = []
  layer_ag: dict[str, int] = {}
  for g, members in enumerate(groups):
    by_key: dict = {}
    for l in members:
      by_key.setdefault((l.backend, l.spec), []).append(l.name)
    for (backend, spec), lnames in by_key.items():
      layer_ag.update({n: len(attn_groups) for n in lnames})
      # The requested kernel size splits token caches; compressed caches keep their backend's pages.
      split = kernel_block_size if not spec.is_state and spec.tokens_per_state == 1 else None
      attn_groups.append(AttentionGroup.create(backend, tuple(lnames), spec, g, kernel_block_size=split))
  for ag in attn_groups:
    if ag.kernel_block_size and isinstance(ag.kv_cache_spec, AttentionSpec) and ag.kv_cache_spec.page_size_padded:
      raise ValueError(
          f"Padded KV pages do not support kernel block splitting: {ag.layer_names[0]} pads its "
          f"{ag.kv_cache_spec.block_size}-token page to {ag.kv_cache_spec.page_size_padded} bytes but "
          f"{ag.backend.name} reads {ag.kernel_block_size}-token kernel blocks. Use --block-size "
          f"{ag.kernel_block_size}."
      )

  spec_of = {l.name: l.spec for l in layers}
  alignments = [l.spec.get_block_stride_alignment() for l in layers]
  stride_alignment = math.lcm(*alignments)

  # Byte placement.
  offsets: dict[str, int] = {}
  if layout == "packed":
    used = 0
    for members in groups:
      # Aligned layers first, each at a multiple of its alignment, so a re-strided compressed
      # cache starts on a kernel-page boundary of the arena.
      ordered = sorted(members, key=lambda l: -l.spec.get_block_stride_alignment())
      off = 0
      for l in ordered:
        align = math.lcm(l.spec.get_block_stride_alignment(), _PACKED_ROW_ALIGNMENT)
        off = -(-off // align) * align
        offsets[l.name] = off
        off += l.spec.page_size_bytes
      used = max(used, off)
    row_align = math.lcm(stride_alignment, _PACKED_ROW_ALIGNMENT)
    bytes_per_block = -(-used // row_align) * row_align
  else:
    bytes_per_block = sum(l.spec.page_size_bytes for l in layers)

  num_blocks = memory_bytes // bytes_per_block
  group_specs = [members[0].spec for members in groups]
  per_request = sum(s.max_num_blocks_per_req(max_model_len) for s in group_specs)
  if num_blocks - 1 < per_request:
    raise ValueError(
        f"{memory_bytes / 2**30:.3f} GiB holds {num_blocks} blocks of {bytes_per_block} bytes "
        f"(block 0 is the null block), but one {max_model_len}-token request needs {per_request}. "
        f"Raise --memory-gib to at least {(per_request + 1) * bytes_per_block / 2**30:.3f} or lower "
        "--max-model-len."
    )

  # Tensors and bindings.
  tensors: list[KVCacheTensor] = []
  bindings: list[LayerBinding] = []
  group_of = {l.name: g for g, members in enumerate(groups) for l in members}
  if layout == "packed":
    tensors.append(KVCacheTensor("kv_arena", num_blocks, bytes_per_block, tuple(l.name for l in layers)))
  for l in layers:
    ag = attn_groups[layer_ag[l.name]]
    if layout == "packed":
      tensor, offset = tensors[0], offsets[l.name]
      block_stride = bytes_per_block
    else:
      tensor = KVCacheTensor(l.name, num_blocks * ag.blocks_per_kernel_block, ag.kernel_page_bytes, (l.name,))
      tensors.append(tensor)
      offset, block_stride = 0, spec_of[l.name].page_size_bytes
    # Bind the planned shape now: the same check that binding the real array makes later.
    view = ag.map_kv_cache_to_kernel_blocks(tensor.shape_dtype(), page_offset_bytes=offset)
    bindings.append(
        LayerBinding(
            layer_name=l.name,
            kv_cache_group_id=group_of[l.name],
            attention_group_id=layer_ag[l.name],
            tensor=tensor.name,
            page_offset_bytes=offset,
            page_size_bytes=l.spec.page_size_bytes,
            block_stride_bytes=block_stride,
            kernel_block_size=ag.kernel_block_size,
            kernel_page_bytes=view.page_bytes,
            kernel_block_stride=ag.stride,
        )
    )
  max_index = max(
      [num_blocks * max(s.block_size, 1) for s in group_specs] + [num_blocks * ag.stride for ag in attn_groups]
  )
  if max_index > _INT32_MAX:
    raise ValueError(
        f"{num_blocks} blocks of {block_size} tokens give slot indices up to {max_index}, past int32. "
        "Lower --memory-gib or the block size."
    )
  return KVCacheConfig(
      layout=layout,
      block_size=block_size,
      requested_block_size=requested,
      num_blocks=num_blocks,
      bytes_per_block=bytes_per_block,
      max_model_len=max_model_len,
      kv_cache_groups=tuple(
          KVCacheGroupSpec(tuple(l.name for l in m), m[0].spec, tuple(l.spec for l in m)) for m in groups
      ),
      attention_groups=tuple(attn_groups),
      tensors=tuple(tensors),
      bindings=tuple(bindings),
      stride_alignment_bytes=stride_alignment,
  )
