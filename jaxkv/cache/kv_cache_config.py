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

One options object, ``CacheConfig``, is the whole input besides the layers: ``jaxkv inspect``, the
engine and the Python API plan from it alike. The planner runs in named stages
(``_resolve_block_size``, ``_group_layers``, ``_make_attention_groups``, ``_place_pages``,
``_count_blocks``, ``_bind``) and returns a frozen ``KVCacheConfig`` holding one resolved
``KernelView`` per layer.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp

from jaxkv.cache.attention_backend import AttentionBackend, customize_attention_spec
from jaxkv.cache.attention_group import AttentionGroup
from jaxkv.cache.cache_dtype import CACHE_DTYPES, MODEL_DTYPES, check_cache_dtype
from jaxkv.cache.kernel_view import KernelView, find_view
from jaxkv.cache.kv_cache_spec import AttentionSpec, CircularBufferSpec, KVCacheSpec, SlidingWindowSpec
from jaxkv.utils import round_up

__all__ = [
  "CacheConfig",
  "LINEAR_PREFILL_CHUNK",
  "KVCacheLayer",
  "KVCacheTensor",
  "KVCacheGroupSpec",
  "KVCacheConfig",
  "plan_kv_cache",
  "LAYOUTS",
]

LAYOUTS = ("dense", "packed")
LINEAR_PREFILLS = ("recurrent", "chunked")
# The grid chunked linear-attention prefill cuts every request's positions on (fla's chunk size).
LINEAR_PREFILL_CHUNK = 64
_DTYPE_FIELDS = ("kv_cache_dtype", "indexer_cache_dtype", "state_dtype")
_INT32_MAX = 2**31 - 1
# Packed rows and layer offsets are multiples of this, so every layer's typed view (fp8, bf16,
# fp32 rows of up to 128 channels) starts on a whole element row of the arena.
_PACKED_ROW_ALIGNMENT = 512


@dataclasses.dataclass(frozen=True)
class CacheConfig:
  """Everything a KV-cache plan depends on besides the model (vLLM's ``CacheConfig``).

  Attributes:
    block_size: manager block size in tokens (packed plans may scale it up).
    kernel_block_size: dense split of token caches into kernel blocks (None: no split).
    layout: ``"dense"`` or ``"packed"``.
    kv_cache_dtype: attention KV entries (MLA latents): ``"bfloat16"``, ``"float32"``, ``"fp8"`` or
      ``"auto"``.
    indexer_cache_dtype: the keys of a sparse-attention indexer (DSA, as DeepSeek-V3.2 and GLM-5.x
      have; GLM-5.3-Flash's pooled keys): ``"fp8"``, ``"bfloat16"``, ``"float32"`` or ``"auto"``.
      A cache kind, as vLLM's ``CacheConfig`` names its kinds (``cache_dtype``,
      ``mamba_cache_dtype``); a model without an indexer ignores it.
    state_dtype: tail rings and linear-attention conv windows, ``"bfloat16"``, ``"float32"`` or
      ``"auto"``. ``"auto"`` (every dtype's default, vLLM's ``--kv-cache-dtype auto``) is the model's
      dtype, resolved by ``resolve_dtypes``: the engine resolves it with its weights' dtype, a
      model's ``get_kv_cache_layers`` with its config's.
    num_speculative_tokens: drafts per step; the plan then covers ``max_model_len + k`` tokens.
    linear_prefill: how a linear-attention layer (KDA) computes prompt tokens: ``"recurrent"``
      (token by token, as decode) or ``"chunked"`` (the positions below a prompt's last multiple
      of ``LINEAR_PREFILL_CHUNK`` in chunks of that grid; each state page then also holds the
      rows of its unfinished chunk, and prefix caching reuses states only below that bound).
    memory_bytes: budget for all caches.
    max_model_len: longest request the plan must hold.
  """

  block_size: int = 256
  kernel_block_size: int | None = None
  layout: str = "packed"
  kv_cache_dtype: str = "auto"
  indexer_cache_dtype: str = "auto"
  state_dtype: str = "auto"
  num_speculative_tokens: int = 0
  linear_prefill: str = "recurrent"
  memory_bytes: int = 64 << 20
  max_model_len: int = 512

  def __post_init__(self):
    if self.layout not in LAYOUTS:
      raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}.")
    if self.linear_prefill not in LINEAR_PREFILLS:
      raise ValueError(f"linear_prefill must be one of {LINEAR_PREFILLS}, got {self.linear_prefill!r}.")
    for name in ("kv_cache_dtype", "indexer_cache_dtype"):
      check_cache_dtype(getattr(self, name), name=name, allowed=CACHE_DTYPES + ("auto",))
    check_cache_dtype(self.state_dtype, name="state_dtype", allowed=MODEL_DTYPES + ("auto",))
    for name in ("block_size", "memory_bytes", "max_model_len"):
      if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
        raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}.")
    if self.num_speculative_tokens < 0:
      raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}.")

  def resolve_dtypes(self, model_dtype: str) -> CacheConfig:
    """This config with every ``"auto"`` dtype replaced by ``model_dtype`` (the weights' dtype)."""
    check_cache_dtype(model_dtype, name="model dtype", allowed=MODEL_DTYPES)
    return dataclasses.replace(self, **{f: model_dtype for f in _DTYPE_FIELDS if getattr(self, f) == "auto"})

  @property
  def dtypes_resolved(self) -> bool:
    return all(getattr(self, f) != "auto" for f in _DTYPE_FIELDS)

  @property
  def linear_prefill_chunk(self) -> int | None:
    """The chunk grid of linear-attention prefill (None: recurrent prefill)."""
    return LINEAR_PREFILL_CHUNK if self.linear_prefill == "chunked" else None

  @property
  def planned_model_len(self) -> int:
    """Tokens a request's blocks must cover: draft steps write up to k positions past its end."""
    return self.max_model_len + self.num_speculative_tokens


@dataclasses.dataclass(frozen=True)
class KVCacheLayer:
  """One cache a model layer keeps (a DSA layer keeps three: latent, pooled keys, tail ring).

  ``shards``: devices the cache is split over along its bytes (a state split by head over the
  mesh's tensor axis); ``spec`` is then one device's share. Dense layout only: a packed block
  holds every group's pages, and the others are one copy per device.
  """

  name: str
  spec: KVCacheSpec
  backend: AttentionBackend
  shards: int = 1


@dataclasses.dataclass(frozen=True)
class KVCacheTensor:
  """One backing allocation: ``uint8[num_rows, row_bytes]`` per device.

  A tensor of ``shards > 1`` is one array ``uint8[num_rows, shards * row_bytes]`` split along its
  rows' bytes over the mesh's tensor axis; each device holds (and the plan's views address) its
  ``row_bytes``.
  """

  name: str
  num_rows: int
  row_bytes: int
  layer_names: tuple[str, ...]
  shards: int = 1

  @property
  def size_bytes(self) -> int:
    """Bytes on one device."""
    return self.num_rows * self.row_bytes

  def shape_dtype(self) -> jax.ShapeDtypeStruct:
    """The whole array (all shards)."""
    return jax.ShapeDtypeStruct((self.num_rows, self.shards * self.row_bytes), jnp.uint8)


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
  """A resolved plan: groups, attention groups (strides resolved), tensors and one view per layer.

  ``max_model_len`` is the length the block tables cover (``CacheConfig.planned_model_len``).
  """

  cache_config: CacheConfig
  block_size: int
  num_blocks: int
  bytes_per_block: int
  max_model_len: int
  kv_cache_groups: tuple[KVCacheGroupSpec, ...]
  attention_groups: tuple[AttentionGroup, ...]
  tensors: tuple[KVCacheTensor, ...]
  views: tuple[KernelView, ...]
  stride_alignment_bytes: int

  @property
  def layout(self) -> str:
    return self.cache_config.layout

  @property
  def requested_block_size(self) -> int:
    """The block size asked for (``block_size`` is the planned one: packed plans may scale it up)."""
    return self.cache_config.block_size

  def view(self, layer_name: str) -> KernelView:
    return find_view(self.views, layer_name)

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

  def allocate(self, shardings: Mapping[str, jax.sharding.Sharding] | None = None) -> dict[str, jax.Array]:
    """Zeroed backing arrays, keyed by tensor name; ``shardings`` (by name) places each one,
    zeroed on each device in place (a split tensor is never whole on one device)."""
    shapes = {t.name: t.shape_dtype().shape for t in self.tensors}
    zeros = jax.jit(
      lambda: {name: jnp.zeros(shape, jnp.uint8) for name, shape in shapes.items()},
      out_shardings=None if shardings is None else dict(shardings),
    )
    return zeros()  # one compilation for every tensor

  def init_kernel_block_tables(self, max_num_reqs: int) -> tuple[jax.Array | None, ...]:
    """Each attention group's persistent kernel-block table (None where the group has no split)."""
    widths = self.block_table_widths()
    return tuple(ag.init_kernel_block_table(max_num_reqs, widths[ag.kv_cache_group_id]) for ag in self.attention_groups)

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
      "cache_config": dataclasses.asdict(self.cache_config),
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
        {
          "name": t.name,
          "shape": [t.num_rows, t.row_bytes],
          "dtype": "uint8",
          "layers": len(t.layer_names),
          "shards": t.shards,
        }
        for t in self.tensors
      ],
      "views": [dataclasses.asdict(v) for v in self.views],
    }


def _group_key(spec: KVCacheSpec):
  if spec.is_state:
    return ("state", spec)  # identical state specs share a group
  window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
  return ("tokens", spec.block_size, window)


def _scale_token_specs(layers: Sequence[KVCacheLayer], block_size: int) -> list[KVCacheLayer]:
  # A ring's block size is its capacity; every other spec follows the manager block size.
  return [
    l
    if isinstance(l.spec, CircularBufferSpec)
    else dataclasses.replace(l, spec=l.spec.copy_with_new_block_size(block_size))
    for l in layers
  ]


def _token_group_bytes(layers: Sequence[KVCacheLayer]) -> int:
  per_group: dict = {}
  for l in layers:
    if not l.spec.is_state:
      per_group[_group_key(l.spec)] = per_group.get(_group_key(l.spec), 0) + l.spec.page_size_bytes
  return max(per_group.values(), default=0)


def _size(n: float) -> str:
  for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= scale:
      return f"{n / scale:.2f} {unit}"
  return f"{int(n)} B"


def _check_layers(layers: Sequence[KVCacheLayer]) -> None:
  if not layers:
    raise ValueError("a KV-cache plan needs at least one layer.")
  names = [l.name for l in layers]
  if len(set(names)) != len(names):
    raise ValueError(f"duplicate layer names: {sorted({n for n in names if names.count(n) > 1})}.")
  bad = [l.name for l in layers if l.shards < 1]
  if bad:
    raise ValueError(f"shards must be >= 1, got {[l.shards for l in layers if l.shards < 1]} for {bad}.")


def _check_shards(layers: Sequence[KVCacheLayer], layout: str, groups) -> None:
  split = [l.name for l in layers if l.shards > 1]
  if split and layout != "dense":
    raise ValueError(
      f"{split[0]} (and {len(split) - 1} more) is split over devices (shards "
      f"{max(l.shards for l in layers)}), which needs the dense layout: a packed block holds every "
      "group's pages in one row, the replicated caches' too. Use layout='dense' or shards=1."
    )
  for members in groups:  # one tensor per layer in the dense layout; a group shares one block table only
    if len({l.shards for l in members}) > 1:
      raise ValueError(
        f"the layers of one group must be split alike, got shards {[l.shards for l in members]} "
        f"for {[l.name for l in members]}."
      )


def _resolve_block_size(layers: Sequence[KVCacheLayer], cc: CacheConfig) -> tuple[list[KVCacheLayer], int]:
  """Backend-customized specs at the final block size (packed: scaled up until a state page fits)."""
  layers = [dataclasses.replace(l, spec=customize_attention_spec(l.backend, l.spec)) for l in layers]
  block_size = cc.block_size
  if cc.layout == "packed":
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
        f"{l.spec.block_size} slots (ring and token blocks share packed blocks). Use a block_size "
        f"that is a multiple of {l.spec.block_size}."
      )
  return layers, block_size


def _group_layers(layers: Sequence[KVCacheLayer], layout: str) -> list[list[KVCacheLayer]]:
  """KV-cache groups: token caches by block size and window; state layers split to fit a block."""
  buckets: dict = {}
  for l in layers:
    buckets.setdefault(_group_key(l.spec), []).append(l)
  groups = [b for k, b in buckets.items() if k[0] == "tokens"]
  anchor = _token_group_bytes(layers)
  for bucket in (b for k, b in buckets.items() if k[0] == "state"):
    page = bucket[0].spec.page_size_bytes
    per_group = len(bucket) if layout == "dense" or not anchor else max(1, anchor // page)
    groups += [bucket[i : i + per_group] for i in range(0, len(bucket), per_group)]
  return groups


def _make_attention_groups(groups, kernel_block_size: int | None) -> tuple[list[AttentionGroup], dict[str, int]]:
  """Same spec and backend within a KV-cache group; kernel sizes resolved (strides not yet)."""
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
      ag = AttentionGroup.create(backend, tuple(lnames), spec, g, kernel_block_size=split)
      if ag.kernel_block_size and isinstance(spec, AttentionSpec) and spec.page_size_padded:
        raise ValueError(
          f"Padded KV pages do not support kernel block splitting: {lnames[0]} pads its "
          f"{spec.block_size}-token page to {spec.page_size_padded} bytes but {backend.name} reads "
          f"{ag.kernel_block_size}-token kernel blocks. Use block_size {ag.kernel_block_size}."
        )
      attn_groups.append(ag)
  return attn_groups, layer_ag


def _place_pages(layers, groups, layout: str) -> tuple[dict[str, int], int, int]:
  """Each layer's page offset in a block, the bytes per block and the stride alignment."""
  stride_alignment = math.lcm(*(l.spec.get_block_stride_alignment() for l in layers))
  offsets: dict[str, int] = {}
  if layout == "dense":
    return {l.name: 0 for l in layers}, sum(l.spec.page_size_bytes for l in layers), stride_alignment
  used = 0
  for members in groups:
    # Aligned layers first, each at a multiple of its alignment, so a re-strided compressed
    # cache starts on a kernel-page boundary of the arena.
    off = 0
    for l in sorted(members, key=lambda l: -l.spec.get_block_stride_alignment()):
      off = round_up(off, math.lcm(l.spec.get_block_stride_alignment(), _PACKED_ROW_ALIGNMENT))
      offsets[l.name] = off
      off += l.spec.page_size_bytes
    used = max(used, off)
  return offsets, round_up(used, math.lcm(stride_alignment, _PACKED_ROW_ALIGNMENT)), stride_alignment


def _count_blocks(groups, bytes_per_block: int, cc: CacheConfig) -> int:
  num_blocks = cc.memory_bytes // bytes_per_block
  per_request = sum(m[0].spec.max_num_blocks_per_req(cc.planned_model_len) for m in groups)
  if num_blocks - 1 < per_request:
    need = (per_request + 1) * bytes_per_block
    raise ValueError(
      f"memory_bytes {cc.memory_bytes:,} ({_size(cc.memory_bytes)}) holds {num_blocks} blocks of "
      f"{bytes_per_block:,} bytes (block 0 is the null block), but one {cc.planned_model_len}-token request "
      f"needs {per_request}. Raise memory_bytes to at least {need:,} ({_size(need)}) or lower max_model_len."
    )
  return num_blocks


def _bind(layers, groups, attn_groups, layer_ag, offsets, bytes_per_block: int, num_blocks: int, layout: str):
  """Backing tensors, one resolved view per layer, and the attention groups with their strides."""
  tensors: list[KVCacheTensor] = []
  views: list[KernelView] = []
  if layout == "packed":
    tensors.append(KVCacheTensor("kv_arena", num_blocks, bytes_per_block, tuple(l.name for l in layers)))
  for l in layers:
    ag_id = layer_ag[l.name]
    ag = attn_groups[ag_id]
    if layout == "packed":
      tensor, block_stride = tensors[0], bytes_per_block
    else:
      tensor = KVCacheTensor(l.name, num_blocks * ag.blocks_per_kernel_block, ag.kernel_page_bytes, (l.name,), l.shards)
      tensors.append(tensor)
      block_stride = l.spec.page_size_bytes
    views.append(
      ag.map_kv_cache_to_kernel_blocks(
        l.name,
        tensor.name,
        (tensor.num_rows, tensor.row_bytes),
        page_offset_bytes=offsets[l.name],
        block_stride_bytes=block_stride,
        attention_group_id=ag_id,
      )
    )
  resolved = []
  for i, ag in enumerate(attn_groups):
    strides = {v.stride for v in views if v.attention_group_id == i}
    if len(strides) != 1:
      raise ValueError(
        f"the layers of attention group {i} ({ag.layer_names[0]}...) resolved different strides "
        f"{sorted(strides)}; they must share one kernel-block table."
      )
    resolved.append(ag.resolve(strides.pop()))
  return tensors, views, resolved


def plan_kv_cache(layers: Sequence[KVCacheLayer], cache_config: CacheConfig) -> KVCacheConfig:
  """Plans the KV cache of a model.

  Args:
    layers: every cache of the model (``ModelRunner.get_kv_cache_layers(cache_config)``).
    cache_config: block and kernel sizes, layout, dtypes, speculative tokens, memory, max length.

  Raises:
    ValueError: naming the values and parameters, for a kernel size that does not divide the block
      size, no common kernel block size, splitting padded pages or packed token caches, a ring
      that does not divide the block, or a budget too small for one request.
  """
  cc = cache_config
  _check_layers(layers)
  layers, block_size = _resolve_block_size(layers, cc)
  groups = _group_layers(layers, cc.layout)
  _check_shards(layers, cc.layout, groups)
  try:
    attn_groups, layer_ag = _make_attention_groups(groups, cc.kernel_block_size)
  except ValueError as e:
    if block_size == cc.block_size:
      raise
    # Name the size the user asked for, and why it grew, before the backend's complaint.
    raise ValueError(
      f"block_size {cc.block_size} is planned as {block_size} tokens (every group's pages must "
      f"fill whole blocks), and then: {e}"
    ) from None
  offsets, bytes_per_block, stride_alignment = _place_pages(layers, groups, cc.layout)
  num_blocks = _count_blocks(groups, bytes_per_block, cc)
  tensors, views, attn_groups = _bind(
    layers, groups, attn_groups, layer_ag, offsets, bytes_per_block, num_blocks, cc.layout
  )
  max_index = max(
    [num_blocks * max(m[0].spec.block_size, 1) for m in groups] + [num_blocks * ag.stride for ag in attn_groups]
  )
  if max_index > _INT32_MAX:
    raise ValueError(
      f"{num_blocks} blocks of {block_size} tokens give slot indices up to {max_index}, past int32. "
      "Lower memory_bytes or block_size."
    )
  return KVCacheConfig(
    cache_config=cc,
    block_size=block_size,
    num_blocks=num_blocks,
    bytes_per_block=bytes_per_block,
    max_model_len=cc.planned_model_len,
    kv_cache_groups=tuple(
      KVCacheGroupSpec(tuple(l.name for l in m), m[0].spec, tuple(l.spec for l in m)) for m in groups
    ),
    attention_groups=tuple(attn_groups),
    tensors=tuple(tensors),
    views=tuple(views),
    stride_alignment_bytes=stride_alignment,
  )
