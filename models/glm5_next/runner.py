"""GLM-5.3-Flash as the engine drives it: ``Glm5NextRunner`` implements ``jaxkv.engine.ModelRunner``.

The runner is static: the Flax graph (``nnx.split``), the config and the kernels' implementation;
equal runners hash equal, so engines over equal models share compiled steps. ``FAMILY`` is what
the engine's registry finds under ``"glm5_next"`` (configs, checkpoints, random weights, caches).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxkv.cache.kv_cache_config import CacheConfig, KVCacheConfig, plan_kv_cache
from jaxkv.step.step_inputs import StepInputs
from models.glm5_next.checkpoint import load_checkpoint
from models.glm5_next.config import BUILTIN_CONFIGS, Glm5NextConfig, get_config, load_config
from models.glm5_next.kv_cache import get_kv_cache_layers
from models.glm5_next.model import Glm5NextForCausalLM
from models.glm5_next.paged import (
  PagedLayout,
  kernel_fallbacks,
  kernel_implementation,
  paged_hidden_states,
  paged_mtp_forward,
)
from models.glm5_next.sharding import ModelSharding, check_divisible, per_device_weight_bytes
from jaxkv.step.step_metadata import StepMetadataSpec
from pallas_kernels import (
  compute_step_metadata,
  device_shared_memory_bytes,
  resolve_implementation,
  top_k,
)
from jaxkv.gpu_target import target_backend
from pallas_kernels.grouped_matmul import prepare_grouped_matmul

__all__ = ["Glm5NextRunner", "FAMILY"]

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class Glm5NextRunner:
  """The model split into its static graph and its weights.

  Attributes:
    graphdef: the Flax graph (static).
    config: the model config.
    implementation: the attention kernels, ``"pallas"`` or ``"xla"`` (``from_model`` resolves
      ``"auto"``: the Pallas kernels on a GPU, the XLA reference on the CPU).
    params: the weights; not part of equality or the hash.
  """

  graphdef: Any
  config: Glm5NextConfig
  implementation: str = "xla"
  params: Any = dataclasses.field(default=None, compare=False, repr=False)

  @classmethod
  def from_model(cls, model: Glm5NextForCausalLM, *, implementation: str = "auto") -> Glm5NextRunner:
    prepare_grouped_matmul("auto", model.embed_tokens.get_value().dtype)
    graphdef, params = nnx.split(model)
    return cls(graphdef, model.config, resolve_implementation(implementation), params)

  def with_params(self, params) -> Glm5NextRunner:
    return dataclasses.replace(self, params=params)

  @property
  def vocab_size(self) -> int:
    return self.config.vocab_size

  @property
  def dtype(self) -> str:
    return jnp.dtype(self.params["embed_tokens"].get_value().dtype).name

  @property
  def max_model_len(self) -> int:
    return self.config.max_position_embeddings

  def get_kv_cache_layers(self, cache_config: CacheConfig, *, tensor_parallel_size: int = 1):
    return get_kv_cache_layers(self.config, cache_config, tensor_parallel_size=tensor_parallel_size)

  def shard(self, mesh, *, expert_parallel: bool = False) -> Glm5NextRunner:
    """This model on ``mesh`` (axes ``("data", "tensor")``), built with its ``ModelSharding``: the
    MoE's routed experts and the attention kernels run per device, and a copy of the weights is
    placed by ``sharding.partition_spec`` (this runner keeps its own)."""
    sharding = ModelSharding(mesh, expert_parallel)
    # The graph of a model built on the mesh (shapes only, nothing allocated) over the placed weights.
    abstract = nnx.eval_shape(lambda: Glm5NextForCausalLM(self.config, rngs=None, sharding=sharding))
    graphdef, _ = nnx.split(abstract)
    return dataclasses.replace(self, graphdef=graphdef, params=sharding.place(self.params))

  def paged_layout(self, plan: KVCacheConfig) -> PagedLayout:
    """The plan's layout; an attention kernel whose tiles do not fit this GPU's shared memory runs its
    XLA path, said once here (at start-up), never a compile error in a step."""
    layout = PagedLayout.from_plan(plan)
    if self.implementation != "pallas" or target_backend() == "cpu":  # interpret mode has no limit
      return layout
    fallbacks = kernel_fallbacks(self.config, layout, device_shared_memory_bytes())
    for kernel, reason in fallbacks.items():
      warnings.warn(f"{kernel} runs its XLA path: {reason}", RuntimeWarning, stacklevel=2)
    return dataclasses.replace(layout, xla_kernels=tuple(sorted(fallbacks)))

  def _model(self, params) -> Glm5NextForCausalLM:
    return nnx.merge(self.graphdef, params)

  def kernel_implementation(self, kernel: str, requested: str = "auto") -> str:
    """The path ``kernel`` runs in this runner's step: ``requested`` when it names one, else
    ``paged.kernel_implementation`` under this runner's switch."""
    if requested != "auto":
      return resolve_implementation(requested)
    return kernel_implementation(kernel, self.implementation)

  def compute_step_metadata(
    self, block_tables, num_blocks, req_indices, positions, kernel_block_tables=None, *, spec: StepMetadataSpec
  ):
    """``pallas_kernels.compute_step_metadata`` on ``kernel_implementation``'s path."""
    impl = self.kernel_implementation("compute_step_metadata", spec.implementation)
    return compute_step_metadata(
      block_tables, num_blocks, req_indices, positions, kernel_block_tables, spec=spec, implementation=impl
    )

  def forward(self, params, caches, inputs: StepInputs, layout: PagedLayout):
    return paged_hidden_states(self._model(params), caches, inputs, layout, implementation=self.implementation)

  def compute_logits(self, params, hidden):
    return self._model(params).logits(hidden)

  def top_k(self, x, k):
    """``pallas_kernels.top_k`` on ``kernel_implementation``'s path."""
    return top_k(x, k, implementation=self.kernel_implementation("top_k"))

  def propose_drafts(
    self, params, caches, hidden, next_ids, inputs: StepInputs, last, layout: PagedLayout, *, num_drafts: int
  ):
    """The MTP pass over every step token (it fills the MTP layer's caches, prompts included), then
    a chain of drafts from each row's last accepted token: draft j is the MTP layer's token at
    position ``p + j + 1``, its hidden state and the draft recycled for the next."""
    model = self._model(params)
    impl = self.implementation
    h, caches, index_rows = paged_mtp_forward(model, caches, hidden, next_ids, inputs, layout, implementation=impl)
    rows = jnp.where(last >= 0, jnp.arange(last.shape[0], dtype=jnp.int32), -1)
    last = jnp.maximum(last, 0)
    h, pos = h[last], inputs.positions[last]
    shared = index_rows[last] if self.config.index_share_for_mtp_iteration else None
    drafts = [jnp.argmax(model.logits(h), axis=-1).astype(jnp.int32)]
    for j in range(1, num_drafts):
      # Same block tables, new tokens: new slots, the step's kernel tables.
      meta = self.compute_step_metadata(
        inputs.block_tables, inputs.num_blocks, rows, pos + j, spec=inputs.metadata.spec
      )
      meta = dataclasses.replace(meta, kernel_block_tables=inputs.metadata.kernel_block_tables)
      step = dataclasses.replace(inputs, input_ids=drafts[-1], positions=pos + j, req_indices=rows, metadata=meta)
      h, caches, _ = paged_mtp_forward(
        model, caches, h, drafts[-1], step, layout, implementation=impl, shared_indices=shared
      )
      drafts.append(jnp.argmax(model.logits(h), axis=-1).astype(jnp.int32))
    return jnp.stack(drafts, axis=1), caches


class _Family:
  """``glm5_next`` for the command line: configs, checkpoints, random weights and the cache plan."""

  load_config = staticmethod(load_config)
  builtin_config = staticmethod(get_config)
  builtin_config_names = tuple(BUILTIN_CONFIGS)
  get_kv_cache_layers = staticmethod(get_kv_cache_layers)
  check_parallel = staticmethod(check_divisible)

  @staticmethod
  def from_pretrained(
    model_path: str,
    *,
    dtype: str = "bfloat16",
    implementation: str = "auto",
    check_weights: bool = False,
    mesh=None,
    expert_parallel: bool = False,
  ) -> Glm5NextRunner:
    """``mesh``: load by shard, each process reading only its devices' slices (``load_checkpoint``)."""
    _, model = load_checkpoint(
      model_path, dtype=_DTYPES[dtype], check_weights=check_weights, mesh=mesh, expert_parallel=expert_parallel
    )
    return Glm5NextRunner.from_model(model, implementation=implementation)

  @staticmethod
  def from_random(
    config: Glm5NextConfig, *, dtype: str = "float32", seed: int = 0, implementation: str = "auto"
  ) -> Glm5NextRunner:
    model = Glm5NextForCausalLM(config, dtype=_DTYPES[dtype], rngs=nnx.Rngs(seed))
    return Glm5NextRunner.from_model(model, implementation=implementation)

  @staticmethod
  def from_shapes(config: Glm5NextConfig, *, dtype: str = "bfloat16", implementation: str = "auto") -> Glm5NextRunner:
    """A runner whose weights are shapes only (``jax.ShapeDtypeStruct``), nothing allocated: for
    tracing and lowering its step (``jaxkv.engine.lower_step``), not for running it."""
    model = nnx.eval_shape(lambda: Glm5NextForCausalLM(config, dtype=_DTYPES[dtype], rngs=nnx.Rngs(0)))
    return Glm5NextRunner.from_model(model, implementation=implementation)

  @staticmethod
  def weight_bytes(config: Glm5NextConfig, dtype: str) -> int:
    """Bytes of the model's weights in ``dtype``, from shapes alone (nothing is allocated)."""
    abstract = nnx.eval_shape(lambda: Glm5NextForCausalLM(config, dtype=_DTYPES[dtype], rngs=nnx.Rngs(0)))
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(abstract)))

  @staticmethod
  def per_device(
    config: Glm5NextConfig,
    cache_config: CacheConfig,
    *,
    tensor_parallel_size: int = 1,
    data_parallel_size: int = 1,
    expert_parallel: bool = False,
  ) -> dict:
    """What one device of a ``data x tensor`` mesh holds (``jaxkv inspect --tensor-parallel-size``).

    Weights split as ``models.glm5_next.sharding`` says; the caches as the engine places them
    (``get_kv_cache_layers``: KDA states split by head over the tensor axis in the dense layout,
    everything else one copy per device); ``cache_config.memory_bytes`` is each device's cache
    budget (each data-parallel replica serves its own requests).

    Returns ``{"weight_bytes_bf16", "weight_bytes_fp8", "plan"}``; the plan is one device's.
    """
    tp, dp = tensor_parallel_size, data_parallel_size
    check_divisible(config, tensor_parallel_size=tp, data_parallel_size=dp, expert_parallel=expert_parallel)
    abstract = nnx.eval_shape(lambda: Glm5NextForCausalLM(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    shapes = [
      (".".join(map(str, k)), tuple(v.get_value().shape), v.get_value().dtype.itemsize)
      for k, v in nnx.to_flat_state(nnx.state(abstract))
    ]
    kw = dict(tensor_parallel_size=tp, data_parallel_size=dp, expert_parallel=expert_parallel)
    return {
      "weight_bytes_bf16": per_device_weight_bytes(shapes, weight_format="bf16", **kw),
      "weight_bytes_fp8": per_device_weight_bytes(shapes, weight_format="fp8", **kw),
      "plan": plan_kv_cache(get_kv_cache_layers(config, cache_config, tensor_parallel_size=tp), cache_config),
    }

  @staticmethod
  def describe(config: Glm5NextConfig, cache_config: CacheConfig) -> str:
    mtp = " + the MTP layer (MLA + indexer)" if cache_config.num_speculative_tokens else ""
    return (
      f"{config.num_hidden_layers} layers ({len(config.dsa_layers)} MLA + indexer, "
      f"{len(config.kda_layers)} KDA state){mtp}"
    )


FAMILY = _Family()
