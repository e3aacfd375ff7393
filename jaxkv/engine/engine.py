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
import functools
import itertools
import math
import secrets
import threading
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxkv.block_copy import BlockRegions, copy_blocks, pad_block_ids
from jaxkv.block_table import MultiGroupBlockTable
from jaxkv.engine.model_runner import ModelRunner, plan_for
from jaxkv.engine.parallel import cache_shardings, make_mesh, replicated
from jaxkv.engine.request import MAX_LOGPROBS, PromptLogprob, Request, RequestStatus, SamplingParams, StepOutput, is_int
from jaxkv.engine.sampler import logprob_stats, sample
from jaxkv.engine.scheduler import Scheduler
from jaxkv.kv_cache_config import CacheConfig
from jaxkv.kv_cache_manager import KVCacheManager
from jaxkv.kv_cache_spec import LinearAttentionStateSpec
from jaxkv.kv_offload import DiskTier, HostTier, OffloadingConnector, SwapSpace, offload_fingerprint
from jaxkv.kv_cache_report import render_plan
from jaxkv.step_inputs import StepInputs
from jaxkv.step_metadata import StepMetadataSpec
from pallas_kernels import gpu_kernel_implementation
from pallas_kernels.step_metadata import compute_step_metadata

__all__ = ["EngineConfig", "LLMEngine"]


def _agreed_entropy() -> int:
  """Fresh entropy for the requests that give no seed, the same on every process of a
  multi-process run (each process builds the same step inputs: process 0's is broadcast)."""
  value = secrets.randbits(31)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    value = int(multihost_utils.broadcast_one_to_all(np.int32(value)))
  return value


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Static engine settings.

  Attributes:
    cache: the KV-cache options (block and kernel sizes, layout, dtypes, speculative tokens,
      memory, max length): the one object every plan is made from.
    max_num_reqs: request rows per step; max_num_batched_tokens: token budget per step.
    buckets: step token counts compiled for (default: powers of two up to the budget).
    async_scheduling: dispatch step n+1 before reading back step n (vLLM's async scheduling):
      the tokens sampled in step n flow into step n+1 on the device, and ``step()`` returns the
      outputs of the step before. Tokens and log-probabilities are identical to synchronous
      steps. Applies without speculative tokens (a verify step needs the accepted count).
    step_metadata_implementation: how each step's slot mappings and kernel-block tables are
      computed (``compute_step_metadata``): ``"auto"`` (the Pallas kernel on a GPU, and on the
      CPU when the runner's kernels are ``"pallas"``; else the jnp functions), ``"pallas"`` or
      ``"xla"``. Identical integers either way.
    enable_prefix_caching: reuse the cached blocks of earlier prompts with the same prefix, KDA
      states included (checkpointed at block boundaries; ``jaxkv.kv_cache_manager``). Outputs are
      bitwise those of a cold run; ``Request.num_cached_tokens`` says what was reused.
    kv_offload: a second level for the prefix cache (``jaxkv.kv_offload``): ``"host"`` (host
      memory) or ``"disk"`` (``kv_offload_dir``, survives a restart); None: off. Needs prefix
      caching. ``kv_offload_bytes``: the tier's capacity (least recently used blocks evicted).
    preemption_mode: ``"recompute"`` (a preempted request's blocks are freed and recomputed) or
      ``"swap"`` (moved to host memory and back, up to ``swap_space_bytes``; recompute past that).
    tensor_parallel_size, data_parallel_size, enable_expert_parallel: vLLM's parallel sizes; above
      one device the step runs on a ``data x tensor`` mesh (``jaxkv.engine.parallel``, the model's
      ``shard``): heads, MLP widths and the vocabulary split over ``tensor``; the routed experts
      split by width over ``tensor``, or with expert parallelism whole experts over all devices.
      ``data_parallel_size`` > 1 widens the expert split and needs ``enable_expert_parallel``.
  """

  cache: CacheConfig = CacheConfig()
  max_num_reqs: int = 8
  max_num_batched_tokens: int = 64
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


# Per-token fields of the packed step input, with their padding values.
_TOKEN_FIELDS = {"input_ids": 0, "prev_token_index": -1, "positions": 0, "req_indices": -1, "next_ids": -1}


@dataclasses.dataclass(frozen=True)
class _PackedInputs:
  """Where each per-step input lives in the one int32 buffer sent to the device each step.

  The host fills NumPy views of one buffer (float fields as their float32 bits) and makes one
  transfer; the step slices it back by these static offsets. Host dispatch cost per step is then
  one ``device_put`` instead of one per array.
  """

  num_tokens: int
  num_reqs: int
  widths: tuple[int, ...]
  num_drafts: int
  prompt_logprobs: bool = False  # the step also returns every token's next-token log-probs

  @functools.cached_property
  def fields(self) -> dict[str, tuple[int, tuple[int, ...], int]]:
    """name -> (offset, shape, default); float fields are named ``*_f32``."""
    t, r, k = self.num_tokens, self.num_reqs, self.num_drafts
    spec = [(name, (t,), default) for name, default in _TOKEN_FIELDS.items()]
    spec += [(f"table{g}", (r, w), 0) for g, w in enumerate(self.widths)]
    spec += [(f"count{g}", (r,), 0) for g in range(len(self.widths))]
    spec += [
      ("state_slots", (r,), 0),
      ("sample_indices", (r, 1 + k), -1),
      ("draft_ids", (r, k), 0),
      ("num_drafts", (r,), 0),
      ("temperature_f32", (r,), 0.0),
      ("top_p_f32", (r,), 1.0),
      ("top_k", (r,), 0),
      ("seeds", (r,), 0),
      ("steps", (r,), 0),
    ]
    out, at = {}, 0
    for name, shape, default in spec:
      out[name] = (at, shape, default)
      at += math.prod(shape)
    return out

  @functools.cached_property
  def template(self) -> np.ndarray:
    buf = np.zeros(sum(math.prod(s) for _, s, _ in self.fields.values()), np.int32)
    for name, view in self.host_views(buf).items():
      view[...] = self.fields[name][2]
    return buf

  def host_views(self, buf: np.ndarray) -> dict[str, np.ndarray]:
    views = {}
    for name, (at, shape, _) in self.fields.items():
      v = buf[at : at + math.prod(shape)].reshape(shape)
      views[name] = v.view(np.float32) if name.endswith("_f32") else v
    return views

  def device_views(self, arr: jax.Array) -> dict[str, jax.Array]:
    views = {}
    for name, (at, shape, _) in self.fields.items():
      v = arr[at : at + math.prod(shape)].reshape(shape)
      views[name] = jax.lax.bitcast_convert_type(v, jnp.float32) if name.endswith("_f32") else v
    return views


def _pack_outputs(*arrays) -> jax.Array:
  """One int32 vector of the step's outputs (float32 as bits): one transfer back."""
  return jnp.concatenate(
    [(jax.lax.bitcast_convert_type(a, jnp.int32) if a.dtype == jnp.float32 else a).ravel() for a in arrays]
  )


def _unpack_outputs(flat: np.ndarray, shapes) -> list[np.ndarray]:
  out, at = [], 0
  for shape, dtype in shapes:
    n = math.prod(shape)
    out.append(flat[at : at + n].view(dtype).reshape(shape))
    at += n
  return out


class _StepStatics:
  """The step's static argument: the runner, the plan's layout and step-metadata spec, the drafts.

  Hashed once (a Flax graph takes milliseconds to hash) and interned, so every step of every
  engine with equal settings finds its compiled executable by identity.
  """

  _interned: dict = {}

  def __init__(
    self,
    runner: ModelRunner,
    layout,
    metadata_spec: StepMetadataSpec,
    num_speculative_tokens: int,
    params_treedef,
    replicated: NamedSharding | None = None,
    cache_shardings: dict[str, NamedSharding] | None = None,
  ):
    self.runner, self.layout, self.metadata_spec = runner, layout, metadata_spec
    self.num_speculative_tokens = num_speculative_tokens
    self.params_treedef = params_treedef
    self.replicated = replicated  # on a mesh: the tables' and outputs' one copy per device
    self.cache_shardings = cache_shardings  # on a mesh: each cache's placement
    shardings_key = None if cache_shardings is None else tuple(sorted(cache_shardings.items()))
    self._key = (runner, layout, metadata_spec, num_speculative_tokens, params_treedef, replicated, shardings_key)
    self._hash = hash(self._key)

  @classmethod
  def intern(cls, *args) -> _StepStatics:
    statics = cls(*args)
    return cls._interned.setdefault(statics, statics)

  def __hash__(self):
    return self._hash

  def __eq__(self, other):
    return self is other or (isinstance(other, _StepStatics) and self._hash == other._hash and self._key == other._key)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3, 4))
def _device_step(statics: _StepStatics, packing: _PackedInputs, param_leaves, caches, kernel_tables, packed, prev_out):
  """Unpacks the step's one input buffer; returns the packed outputs, the caches, the kernel tables.

  ``prev_out``: the previous step's packed outputs, still on the device. A token whose id the host
  does not know yet (sampled by the step in flight) names its place there in ``prev_token_index``.
  """
  v = packing.device_views(packed)
  groups = range(len(packing.widths))
  src = v["prev_token_index"]
  input_ids = jnp.where(src >= 0, prev_out[jnp.maximum(src, 0)], v["input_ids"])
  inputs = StepInputs(
    input_ids,
    v["positions"],
    v["req_indices"],
    tuple(v[f"table{g}"] for g in groups),
    tuple(v[f"count{g}"] for g in groups),
    None,
    v["state_slots"],
  )  # metadata: _step's first act
  params = jax.tree.unflatten(statics.params_treedef, param_leaves)
  out, plp, caches, kernel_tables = _step(
    statics,
    params,
    caches,
    kernel_tables,
    inputs,
    v["sample_indices"],
    v["next_ids"],
    v["draft_ids"],
    v["num_drafts"],
    v["temperature_f32"],
    v["top_p_f32"],
    v["top_k"],
    v["seeds"],
    v["steps"],
    prompt_logprobs=packing.prompt_logprobs,
  )
  out, plp = _pack_outputs(*out), None if plp is None else _pack_outputs(*plp)
  if statics.replicated is not None:
    # Whatever XLA's partitioner chose inside, the step's state leaves as it came: the next step
    # then finds the same input shardings (no recompilation) and its donated buffers fit.
    out, plp, kernel_tables = jax.lax.with_sharding_constraint((out, plp, kernel_tables), statics.replicated)
    caches = {name: jax.lax.with_sharding_constraint(c, statics.cache_shardings[name]) for name, c in caches.items()}
  return out, plp, caches, kernel_tables


def _step(
  statics: _StepStatics,
  params,
  caches,
  kernel_tables,
  inputs: StepInputs,
  sample_indices,
  next_ids,
  draft_ids,
  num_drafts,
  temperature,
  top_p,
  top_k,
  seeds,
  steps,
  *,
  prompt_logprobs: bool = False,
):
  """The step's metadata, the trunk over the step's tokens, verification and sampling of each
  sampling row, then the drafts for the next step.

  ``kernel_tables``: each attention group's persistent kernel-block table (None without a split),
  donated and rewritten with the slot mappings by ``compute_step_metadata`` from this step's
  manager tables: one mapping for every step (normal, padding-only warm-up, verification and
  drafting).
  ``sample_indices [R, S]``: flat indices of a row's tokens whose logits are sampled (its last
  token and its drafts; -1: none). ``next_ids [T]``: the token after each step token when the host
  knows it (-1: the token sampled here). Returns ``(tokens [R, S], num_accepted [R], top-k
  log-probabilities and ids [R, S, K], drafts [R, k], the tokens' log-probabilities and ranks
  [R, S])``, with ``prompt_logprobs`` every token's
  next-token log-probs (``_next_token_logprobs``; else None), the caches and the kernel tables.
  """
  runner, layout = statics.runner, statics.layout
  meta = compute_step_metadata(
    inputs.block_tables,
    inputs.num_blocks,
    inputs.req_indices,
    inputs.positions,
    kernel_tables,
    spec=statics.metadata_spec,
  )
  kernel_tables = meta.kernel_block_tables
  inputs = dataclasses.replace(inputs, metadata=meta)
  hidden, caches = runner.forward(params, caches, inputs, layout)
  plp = _next_token_logprobs(runner, params, hidden, next_ids) if prompt_logprobs else None
  logits = runner.compute_logits(params, hidden[jnp.maximum(sample_indices, 0)])  # [R, S, V]
  tokens, num_accepted, top_lp, top_ids, token_lp, token_rank = sample(
    logits, temperature, top_p, top_k, seeds, steps, draft_ids, num_drafts
  )
  k = statics.num_speculative_tokens
  if k:
    # The token after each step token is known on the host, or was just sampled (accepted drafts
    # and the new token); drafts continue from each row's last accepted token.
    t = next_ids.shape[0]
    sampled = jnp.zeros((t,), jnp.int32).at[jnp.where(sample_indices >= 0, sample_indices, t)].set(tokens, mode="drop")
    next_ids = jnp.where(next_ids >= 0, next_ids, sampled)
    last = jnp.take_along_axis(sample_indices, num_accepted[:, None], axis=1)[:, 0]  # [R]
    draft_ids, caches = runner.propose_drafts(params, caches, hidden, next_ids, inputs, last, layout, num_drafts=k)
  return (tokens, num_accepted, top_lp, top_ids, draft_ids, token_lp, token_rank), plp, caches, kernel_tables


# Tokens whose LM head runs at once in ``_next_token_logprobs``: bounds its [rows, vocabulary]
# float32 logits (a 2,048-token step of a 154k vocabulary would take 1.3 GB at once).
_LOGPROB_ROWS = 128


def _next_token_logprobs(runner, params, hidden, next_ids):
  """For each step token ``t``: the log-prob of the token after it (``next_ids [T]``, where the
  host knows it) and its rank among the vocabulary (1: most probable; ties count for the token),
  and the top ``MAX_LOGPROBS`` log-probs ``[T, K]`` with their ids (the sampler's ``logprob_stats``)."""

  def one(h, target):
    top_lp, top_ids, target_lp, rank = logprob_stats(runner.compute_logits(params, h[None])[0], jnp.maximum(target, 0))
    return target_lp, rank, top_lp, top_ids

  return jax.lax.map(lambda x: one(*x), (hidden, next_ids), batch_size=min(_LOGPROB_ROWS, hidden.shape[0]))


class LLMEngine:
  """Serves many requests of one model over the paged caches of ``jaxkv``.

  ``add_request`` / ``abort`` / ``step`` (returns streamed ``StepOutput``s) / ``generate``.

  Args:
    runner: the model (``ModelRunner``), e.g. ``Glm5NextRunner.from_model(model)``.
    config: engine settings; ``config.cache`` is planned with ``plan_for(runner, config.cache)``,
      exactly as ``jaxkv inspect`` plans it.
  """

  def __init__(self, runner: ModelRunner, config: EngineConfig = EngineConfig()):
    self.config = config
    # On a mesh: the weights placed by the model's sharding rules; everything else replicated.
    self.mesh = make_mesh(config.tensor_parallel_size, config.data_parallel_size) if config.num_devices > 1 else None
    if self.mesh is not None:
      runner = runner.shard(self.mesh, expert_parallel=config.enable_expert_parallel)
    self._replicated = replicated(self.mesh)
    self.runner = runner
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
    )
    self.tables = MultiGroupBlockTable(
      [g.kv_cache_spec.block_size for g in groups], config.max_num_reqs, self.plan.block_table_widths()
    )
    self.connector = self._make_connector(runner, config)
    self.swap = SwapSpace(self.plan, config.swap_space_bytes) if config.preemption_mode == "swap" else None
    self.scheduler = Scheduler(
      self.kv,
      self.tables,
      max_num_reqs=config.max_num_reqs,
      max_num_batched_tokens=config.max_num_batched_tokens,
      num_lookahead_tokens=max(k - 1, 0),
      connector=self.connector,
      swap=self.swap,
    )
    self._cache_shardings = cache_shardings(self.plan, self.mesh)
    # The state the step carries (caches, kernel tables) is committed to its device from the start,
    # on one device too: a swap-in's or a load's device_put commits the caches, and a step whose
    # arguments change from uncommitted to committed compiles again (another signature).
    one_device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    self._placement = self._replicated or one_device  # the step's inputs and outputs
    self.caches = self.plan.allocate(self._cache_shardings or {t.name: one_device for t in self.plan.tensors})
    self.kernel_tables = jax.device_put(self.plan.init_kernel_block_tables(config.max_num_reqs), self._placement)
    # Prefix caching's state checkpoints and restores: whole state blocks copied on the device, at
    # most one per request row and state group per call (one compiled shape).
    state_groups = [g for g, grp in enumerate(groups) if isinstance(grp.kv_cache_spec, LinearAttentionStateSpec)]
    self._state_regions = BlockRegions.from_plan(self.plan, state_groups) if state_groups else None
    self._max_block_copies = config.max_num_reqs * len(state_groups)
    # The weights as a flat tuple of arrays: jit flattens it in C++ each step (a Flax State takes
    # Python calls per variable).
    self._param_leaves, treedef = jax.tree.flatten(runner.params)
    self._param_leaves = tuple(self._param_leaves)
    meta_impl = config.step_metadata_implementation
    if meta_impl == "auto":  # the runner's kernel switch: the kernel on a GPU, or when it asks for Pallas
      meta_impl = gpu_kernel_implementation(getattr(runner, "implementation", "xla"))
    meta_spec = StepMetadataSpec.from_plan(self.plan, implementation=meta_impl)
    self._statics = _StepStatics.intern(
      runner, runner.paged_layout(self.plan), meta_spec, k, treedef, self._replicated, self._cache_shardings
    )
    self._packings: dict[int, _PackedInputs] = {}  # by token bucket
    s, top = 1 + k, min(MAX_LOGPROBS, runner.vocab_size)
    r = config.max_num_reqs
    # The tokens first: the next step reads a token in flight at its place here (prev_token_index).
    self._out_shapes = [
      ((r, s), np.int32),
      ((r,), np.int32),
      ((r, s, top), np.float32),
      ((r, s, top), np.int32),
      ((r, k), np.int32),
      ((r, s), np.float32),
      ((r, s), np.int32),
    ]
    self._async = config.async_scheduling and k == 0
    # The step in flight (async scheduling): its chunks and its packed outputs, not yet read back.
    self._in_flight: tuple[list, jax.Array] | None = None
    self._prev_out = jax.device_put(
      jnp.zeros(sum(math.prod(shape) for shape, _ in self._out_shapes), jnp.int32), self._placement
    )
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
    if self.connector is not None:
      self.connector.wait_for_save()

  def render_plan(self, title: str = "") -> str:
    """The plan this engine serves from, as ``jaxkv inspect`` prints it."""
    return render_plan(self.plan, title)

  @property
  def num_compilations(self) -> int:
    """Compiled shapes of the step in this process (one per settings and token bucket used; engines
    with equal settings share them; steady state adds none)."""
    return _device_step._cache_size()

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
    for bucket in self.config.token_buckets:
      for plp in (False, True)[: 1 + prompt_logprobs]:
        self._read_back(self._launch([], bucket, prompt_logprobs=plp)[0])
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
      # Before the step, in this order: preempted blocks out (before their new owners write them),
      # offloaded prefix blocks and swapped blocks in, then hits' KDA states into their slots.
      if self.swap is not None:
        self.swap.start_swap_out(self.caches)
      if self.connector is not None:
        self.caches = self.connector.start_load_kv(self.caches)
      if self.swap is not None:
        self.caches = self.swap.start_swap_in(self.caches)
      self._copy_blocks(self.kv.take_block_copies())
      out, failed = None, []
      if chunks:
        n = sum(c.num_tokens for c in chunks)
        out, chunks, failed = self._launch(chunks, next(b for b in self.config.token_buckets if b >= n))
        self.num_steps += out is not None
        self._cache_blocks(chunks)
      errors = [self._fail(req, err) for req, err in failed]
      if not self._async:
        return errors + (self._update(chunks, *self._read_back(out)) if chunks else [])
      previous, self._in_flight = self._in_flight, (chunks, out) if chunks else None
      return errors + (self._update(previous[0], *self._read_back(previous[1])) if previous else [])

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
        copies += self.kv.checkpoint_states(req.request_id, req.all_token_ids, c.start + c.num_tokens)
    self._copy_blocks(copies)
    newly_cached = self.kv.take_newly_cached()
    if self.connector is not None:  # after the checkpoint copies: they are among the blocks saved
      self.connector.save_kv(self.caches, newly_cached)

  def _copy_blocks(self, pairs: list[tuple[int, int]], *, warmup: bool = False) -> None:
    """Dispatches KDA state block copies (``warmup``: an all-padding call, to compile it)."""
    if self._state_regions is None or not self.kv.enable_caching or not (pairs or warmup):
      return
    src, dst = pad_block_ids(pairs, self._max_block_copies)
    self.caches = copy_blocks(self.caches, src, dst, regions=self._state_regions)

  def _fail(self, request: Request, error: Exception) -> StepOutput:
    request.error = f"{type(error).__name__}: {error}"
    self.scheduler.finish(request, RequestStatus.FINISHED, "error")
    self._requests.pop(request.request_id, None)
    return StepOutput(request.request_id, [], [], True, "error", request.num_cached_tokens)

  def _launch(self, chunks, bucket: int, *, prompt_logprobs: bool = False):
    """Lays the chunks out in ``bucket`` tokens and dispatches the jitted step (one transfer in).
    Returns the packed outputs and prompt log-probs (None unless a chunk computes prompt tokens of
    a request that asks for them, or ``prompt_logprobs``) without waiting for them (None when no
    chunk could be laid out), the chunks laid out, and ``(request, error)`` for the others, whose
    tokens stay padding."""
    cfg = self.config
    k = cfg.num_speculative_tokens
    r = cfg.max_num_reqs
    prompt_logprobs = prompt_logprobs or any(
      c.request.sampling.prompt_logprobs is not None and c.start < len(c.request.prompt_token_ids) - 1 for c in chunks
    )
    packing = self._packings.get((bucket, prompt_logprobs))
    if packing is None:
      packing = self._packings[bucket, prompt_logprobs] = _PackedInputs(
        bucket, r, tuple(bt.width for bt in self.tables.block_tables), k, prompt_logprobs
      )
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
    packed = jax.device_put(buf, self._placement)  # one host-to-device transfer for the whole step
    out, plp, self.caches, self.kernel_tables = _device_step(
      self._statics, packing, self._param_leaves, self.caches, self.kernel_tables, packed, self._prev_out
    )
    self._prev_out = out
    for a in (out, plp) if plp is not None else (out,):
      a.copy_to_host_async()  # the read-back then waits only for the step, not for a transfer after it
    if self._async:
      for c in laid_out:
        if c.samples:
          c.request.num_in_flight += 1
          c.request.in_flight_row = c.request.row
    return (out, plp), laid_out, failed

  @staticmethod
  def _clear(packing: _PackedInputs, v, c) -> None:
    """Back to padding: the chunk's tokens and its request's row fields."""
    for name, (_, _, default) in packing.fields.items():
      if name in _TOKEN_FIELDS:
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

  def _read_back(self, out: tuple[jax.Array, jax.Array | None]) -> list:
    """The step's outputs (one transfer back), then its prompt log-probs (``_next_token_logprobs``'s
    four arrays, or None)."""
    flat, plp = jax.device_get(out)
    if plp is not None:
      top = min(MAX_LOGPROBS, self.runner.vocab_size)
      t = plp.size // (2 + 2 * top)
      plp = _unpack_outputs(
        np.asarray(plp), [((t,), np.float32), ((t,), np.int32), ((t, top), np.float32), ((t, top), np.int32)]
      )
    return _unpack_outputs(np.asarray(flat), self._out_shapes) + [plp]

  def _next_drafts(self, request: Request, drafts: list[int]) -> list[int]:
    """The drafts to verify next step (the MTP layer's); a seam for tests that force drafts."""
    return drafts

  def _update(
    self, chunks, tokens, num_accepted, top_lp, top_ids, drafts, token_lp, token_rank, plp
  ) -> list[StepOutput]:
    k = self.config.num_speculative_tokens
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
      a = int(num_accepted[c.row]) if c.samples else 0
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
        token = int(tokens[row, j])
        lps = [
          (int(i), float(v))
          for i, v in zip(top_ids[row, j, : req.sampling.logprobs], top_lp[row, j, : req.sampling.logprobs])
        ]
        req.output_token_ids.append(token)
        req.output_logprobs.append(lps)
        new_ids.append(token)
        new_lps.append(lps)
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
        req.spec_token_ids = self._next_drafts(req, [int(x) for x in drafts[row, : min(k, room)]])
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
          own if req.sampling.logprobs else [],
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
