"""The device side of an engine: the caches, the kernel tables, the weights and the jitted step.

``StepExecutor`` owns what lives on the device and what one step sends and brings back: the host
(``LLMEngine``) lays a step's chunks out in the views of one int32 buffer (``PackedInputs``), the
executor makes one transfer in, runs ``_device_step`` (the caches and kernel tables donated) and
one transfer back. Shapes are fixed per token bucket (the request dimension is always
``max_num_reqs``), so after one compilation per bucket nothing compiles; ``num_compilations``
counts the executor's own. jit's cache of compiled executables plays the role of vLLM's CUDA graphs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxkv.cache.kv_cache_config import KVCacheConfig
from jaxkv.cache.kv_cache_spec import LinearAttentionStateSpec
from jaxkv.engine.model_runner import ModelRunner
from jaxkv.engine.parallel import cache_shardings, replicated
from jaxkv.engine.request import MAX_LOGPROBS
from jaxkv.engine.sampler import logprob_stats, sample
from jaxkv.placement import host_to_device, one_device
from jaxkv.step.block_copy import BlockRegions, copy_blocks, pad_block_ids
from jaxkv.step.step_inputs import StepInputs
from jaxkv.step.step_metadata import StepMetadataSpec

__all__ = ["StepExecutor", "PackedInputs", "TOKEN_FIELDS", "lower_step"]


# Per-token fields of the packed step input, with their padding values.
TOKEN_FIELDS = {"input_ids": 0, "prev_token_index": -1, "positions": 0, "req_indices": -1, "next_ids": -1}


@dataclasses.dataclass(frozen=True)
class PackedInputs:
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
  # Some token lies below its prompt's chunk bound (chunked linear-attention prefill): the step
  # carries the prompt lengths and runs the chunked path. Decode steps compile without it.
  linear_chunks: bool = False
  # Every sampling row is greedy and wants no log-probs: the step takes argmaxes and computes no
  # distribution (``sample``'s ``greedy_only``). The outputs keep their layout (log-probs zero).
  greedy_only: bool = False

  @functools.cached_property
  def fields(self) -> dict[str, tuple[int, tuple[int, ...], int]]:
    """name -> (offset, shape, default); float fields are named ``*_f32``."""
    t, r, k = self.num_tokens, self.num_reqs, self.num_drafts
    spec = [(name, (t,), default) for name, default in TOKEN_FIELDS.items()]
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
    spec += [("num_prompt_tokens", (r,), 0)] if self.linear_chunks else []
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
  """The step's static argument: the runner without its weights, the plan's layout and step-metadata
  spec, the drafts, the shardings.

  Hashed once (a Flax graph takes milliseconds to hash). Equal statics are one object
  (``_StepStatics.intern``), so every step of every engine with equal settings finds its compiled
  executable by identity, not by comparing graphs. jit's cache keeps it as a key: it holds no
  arrays, so dropping an engine frees its weights and caches.
  """

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

  @staticmethod
  def intern(runner: ModelRunner, *args) -> _StepStatics:
    """The statics of ``runner``'s model without its weights; an equal live one if there is one."""
    statics = _StepStatics(runner.with_params(None), *args)
    return _LIVE_STATICS.setdefault(statics, statics)

  def __hash__(self):
    return self._hash

  def __eq__(self, other):
    return self is other or (isinstance(other, _StepStatics) and self._hash == other._hash and self._key == other._key)


# Equal statics in use, weakly: an entry lives as long as an engine or jit's cache holds it.
_LIVE_STATICS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3, 4))
def _device_step(statics: _StepStatics, packing: PackedInputs, param_leaves, caches, kernel_tables, packed, prev_out):
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
    v.get("num_prompt_tokens"),
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
    greedy_only=packing.greedy_only,
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
  greedy_only: bool = False,
):
  """The step's metadata, the trunk over the step's tokens, verification and sampling of each
  sampling row, then the drafts for the next step.

  ``kernel_tables``: each attention group's persistent kernel-block table (None without a split),
  donated and rewritten with the slot mappings by the runner's ``compute_step_metadata`` from this step's
  manager tables: one mapping for every step (normal, padding-only warm-up, verification and
  drafting).
  ``sample_indices [R, S]``: flat indices of a row's tokens whose logits are sampled (its last
  token and its drafts; -1: none). ``next_ids [T]``: the token after each step token when the host
  knows it (-1: the token sampled here). Returns ``(tokens [R, S], num_accepted [R], top-k
  log-probabilities and ids [R, S, K], drafts [R, k], the tokens' log-probabilities and ranks
  [R, S])``, with ``prompt_logprobs`` every token's
  next-token log-probs (``_next_token_logprobs``; else None), the caches and the kernel tables.
  ``greedy_only``: every sampling row is greedy and wants no log-probs (``sample``).
  """
  runner, layout = statics.runner, statics.layout
  # The named scopes (and the model's) let a profile count each part's kernels (jaxkv.profiling).
  with jax.named_scope("step_metadata"):
    meta = runner.compute_step_metadata(
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
  with jax.named_scope("prompt_logprobs"):
    plp = _next_token_logprobs(runner, params, hidden, next_ids) if prompt_logprobs else None
  logits = runner.compute_logits(params, hidden[jnp.maximum(sample_indices, 0)])  # [R, S, V]
  # Materialized as they are, whatever reads them: a greedy row's argmax then reads the same bits in
  # either sampler variant, so its tokens do not depend on its batch-mates' sampling settings.
  logits = jax.lax.optimization_barrier(logits)
  with jax.named_scope("sampler"):
    tokens, num_accepted, top_lp, top_ids, token_lp, token_rank = sample(
      logits, temperature, top_p, top_k, seeds, steps, draft_ids, num_drafts, runner.top_k, greedy_only=greedy_only
    )
  k = statics.num_speculative_tokens
  if k:
    # The token after each step token is known on the host, or was just sampled (accepted drafts
    # and the new token); drafts continue from each row's last accepted token.
    t = next_ids.shape[0]
    sampled = jnp.zeros((t,), jnp.int32).at[jnp.where(sample_indices >= 0, sample_indices, t)].set(tokens, mode="drop")
    next_ids = jnp.where(next_ids >= 0, next_ids, sampled)
    last = jnp.take_along_axis(sample_indices, num_accepted[:, None], axis=1)[:, 0]  # [R]
    with jax.named_scope("mtp"):
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
    logits = runner.compute_logits(params, h[None])[0]
    top_lp, top_ids, target_lp, rank = logprob_stats(logits, jnp.maximum(target, 0), runner.top_k)
    return target_lp, rank, top_lp, top_ids

  return jax.lax.map(lambda x: one(*x), (hidden, next_ids), batch_size=min(_LOGPROB_ROWS, hidden.shape[0]))


def _step_statics(
  runner: ModelRunner,
  plan: KVCacheConfig,
  num_speculative_tokens: int,
  step_metadata_implementation: str,
  params_treedef,
  replicated_sharding=None,
  shardings=None,
) -> _StepStatics:
  meta_spec = StepMetadataSpec.from_plan(
    plan, implementation=runner.kernel_implementation("compute_step_metadata", step_metadata_implementation)
  )
  return _StepStatics.intern(
    runner,
    runner.paged_layout(plan),
    meta_spec,
    num_speculative_tokens,
    params_treedef,
    replicated_sharding,
    shardings,
  )


def _out_shapes(max_num_reqs: int, num_speculative_tokens: int, vocab_size: int) -> list:
  """The step's packed outputs (``_step``'s first tuple), tokens first: the next step reads a token
  in flight at its place there (``prev_token_index``)."""
  r, k = max_num_reqs, num_speculative_tokens
  s, top = 1 + k, min(MAX_LOGPROBS, vocab_size)
  return [
    ((r, s), np.int32),
    ((r,), np.int32),
    ((r, s, top), np.float32),
    ((r, s, top), np.int32),
    ((r, k), np.int32),
    ((r, s), np.float32),
    ((r, s), np.int32),
  ]


def _out_size(out_shapes) -> int:
  return sum(math.prod(shape) for shape, _ in out_shapes)


def lower_step(
  runner: ModelRunner,
  plan: KVCacheConfig,
  *,
  max_num_reqs: int,
  num_tokens: int,
  num_speculative_tokens: int = 0,
  prompt_logprobs: bool = False,
  linear_chunks: bool = False,
  greedy_only: bool = False,
  step_metadata_implementation: str = "auto",
  platform: str | None = None,
) -> jax.stages.Lowered:
  """The engine's jitted step for a bucket of ``num_tokens``, traced from shapes alone and lowered
  (not compiled): the program a ``StepExecutor`` of these settings runs, nothing allocated.

  ``runner.params`` may be abstract (``jax.ShapeDtypeStruct`` leaves: ``FAMILY.from_shapes``).
  ``platform``: lower for it (``"cuda"``) rather than this machine's backend; inside
  ``jaxkv.gpu_target(kind)`` the result is then what that GPU compiles, its Pallas
  kernels lowered to Triton (``jaxkv.kernel_build`` reads and builds them; ``jaxkv lower``).
  """
  leaves, treedef = jax.tree.flatten(runner.params)
  statics = _step_statics(runner, plan, num_speculative_tokens, step_metadata_implementation, treedef)
  packing = PackedInputs(
    num_tokens,
    max_num_reqs,
    tuple(plan.block_table_widths()),
    num_speculative_tokens,
    prompt_logprobs,
    linear_chunks,
    greedy_only,
  )
  spec = lambda a: None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype)
  caches = {t.name: t.shape_dtype() for t in plan.tensors}
  kernel_tables = jax.eval_shape(lambda: plan.init_kernel_block_tables(max_num_reqs))
  out_size = _out_size(_out_shapes(max_num_reqs, num_speculative_tokens, runner.vocab_size))
  args = (
    tuple(map(spec, leaves)),
    caches,
    kernel_tables,
    spec(packing.template),
    jax.ShapeDtypeStruct((out_size,), jnp.int32),
  )
  platforms = None if platform is None else (platform,)
  return _device_step.trace(statics, packing, *args).lower(lowering_platforms=platforms)


class StepExecutor:
  """The device state of one engine and its jitted step.

  Args:
    runner: the model; its weights are passed to every step as a flat tuple of arrays (jit
      flattens it in C++; a Flax State would take Python calls per variable).
    plan: the KV-cache plan the caches are allocated from.
    max_num_reqs: request rows per step; num_speculative_tokens: drafts verified per row.
    step_metadata_implementation: the runner's ``compute_step_metadata`` path, resolved here by
      ``runner.kernel_implementation`` (``"auto"``: the runner's choice).
    mesh: the ``data x tensor`` mesh the runner's weights are placed on, or None (one device).
  """

  def __init__(
    self,
    runner: ModelRunner,
    plan: KVCacheConfig,
    *,
    max_num_reqs: int,
    num_speculative_tokens: int = 0,
    step_metadata_implementation: str = "auto",
    mesh: jax.sharding.Mesh | None = None,
  ):
    self.plan = plan
    self.max_num_reqs, self.num_speculative_tokens = max_num_reqs, num_speculative_tokens
    self.vocab_size = runner.vocab_size
    self.widths = tuple(plan.block_table_widths())
    # On a mesh: the runner's weights placed by the model's sharding rules; everything else
    # replicated, or split as the plan says (cache_shardings).
    self._replicated = replicated(mesh)
    self._cache_shardings = cache_shardings(plan, mesh)
    # The state the step carries (caches, kernel tables) is committed to its device from the start,
    # on one device too: a swap-in's or a load's device_put commits the caches, and a step whose
    # arguments change from uncommitted to committed compiles again (another signature).
    device = one_device(jax.local_devices()[0])
    self._placement = self._replicated or device  # the step's inputs and outputs
    self.caches = plan.allocate(self._cache_shardings or {t.name: device for t in plan.tensors})
    self.kernel_tables = host_to_device(plan.init_kernel_block_tables(max_num_reqs), self._placement)
    # Prefix caching's state checkpoints and restores: whole state blocks copied on the device, at
    # most one per request row and state group per call (one compiled shape).
    groups = plan.kv_cache_groups
    state_groups = [g for g, grp in enumerate(groups) if isinstance(grp.kv_cache_spec, LinearAttentionStateSpec)]
    self._state_regions = BlockRegions.from_plan(plan, state_groups) if state_groups else None
    self._max_block_copies = max_num_reqs * len(state_groups)
    leaves, treedef = jax.tree.flatten(runner.params)
    self.param_leaves = tuple(leaves)
    self.statics = _step_statics(
      runner,
      plan,
      num_speculative_tokens,
      step_metadata_implementation,
      treedef,
      self._replicated,
      self._cache_shardings,
    )
    self._packings: dict[tuple[int, bool, bool, bool], PackedInputs] = {}
    self.out_shapes = _out_shapes(max_num_reqs, num_speculative_tokens, runner.vocab_size)
    self._prev_out = host_to_device(np.zeros(_out_size(self.out_shapes), np.int32), self._placement)
    self.num_compilations = 0

  def packing(
    self, bucket: int, prompt_logprobs: bool = False, linear_chunks: bool = False, greedy_only: bool = False
  ) -> PackedInputs:
    """The input layout of a step of ``bucket`` tokens (and the step variant it compiles)."""
    key = (bucket, prompt_logprobs, linear_chunks, greedy_only)
    if key not in self._packings:
      self._packings[key] = PackedInputs(bucket, self.max_num_reqs, self.widths, self.num_speculative_tokens, *key[1:])
    return self._packings[key]

  def launch(self, packing: PackedInputs, buf: np.ndarray) -> tuple[jax.Array, jax.Array | None]:
    """Dispatches the step on ``buf`` (``packing``'s layout; one host-to-device transfer) and returns
    its packed outputs and prompt log-probs (None unless ``packing.prompt_logprobs``) without
    waiting for them."""
    packed = host_to_device(buf, self._placement)
    compiled = _device_step._cache_size()
    out, plp, self.caches, self.kernel_tables = _device_step(
      self.statics, packing, self.param_leaves, self.caches, self.kernel_tables, packed, self._prev_out
    )
    self.num_compilations += _device_step._cache_size() - compiled
    self._prev_out = out
    for a in (out, plp) if plp is not None else (out,):
      a.copy_to_host_async()  # the read-back then waits only for the step, not for a transfer after it
    return out, plp

  def read_back(self, out: tuple[jax.Array, jax.Array | None]) -> list:
    """The step's outputs (``out_shapes``; one transfer back), then its prompt log-probs
    (``_next_token_logprobs``'s four arrays, or None)."""
    flat, plp = jax.device_get(out)
    if plp is not None:
      top = min(MAX_LOGPROBS, self.vocab_size)
      t = plp.size // (2 + 2 * top)
      plp = _unpack_outputs(
        np.asarray(plp), [((t,), np.float32), ((t,), np.int32), ((t, top), np.float32), ((t, top), np.int32)]
      )
    return _unpack_outputs(np.asarray(flat), self.out_shapes) + [plp]

  def copy_blocks(self, pairs: list[tuple[int, int]], *, warmup: bool = False) -> None:
    """Dispatches KDA state block copies ``(src, dst)`` (``warmup``: an all-padding call, to compile
    it); nothing for a plan without state groups."""
    if self._state_regions is None or not (pairs or warmup):
      return
    src, dst = pad_block_ids(pairs, self._max_block_copies)
    self.caches = copy_blocks(self.caches, src, dst, regions=self._state_regions)
