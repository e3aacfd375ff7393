"""What the engine needs of a model: the ``ModelRunner`` protocol, and the registry of model families.

The engine sits above the models: it never imports one. A model package implements
``ModelRunner`` (its caches as ``KVCacheLayer`` specs, its paged forward, its logits, its drafts)
and is found by architecture name through ``MODEL_REGISTRY`` (``"module:Class"`` strings, imported
on first use, as vLLM's model registry does).

A runner is static configuration: it is hashed and compared as a ``jax.jit`` static argument, so
two runners of equal structure (same graph, same implementation) share compiled steps; its
``params`` pytree is passed to the step as an ordinary argument and takes no part in equality (the
step's static key is ``with_params(None)``: jit's cache then holds no weights).
"""

from __future__ import annotations

import importlib
from collections.abc import Hashable, Sequence
from typing import Any, Protocol, runtime_checkable

import jax

from jaxkv.cache.kv_cache_config import CacheConfig, KVCacheConfig, KVCacheLayer, plan_kv_cache
from jaxkv.step.step_inputs import StepInputs
from jaxkv.step.step_metadata import StepMetadata, StepMetadataSpec

__all__ = ["ModelRunner", "ModelFamily", "MODEL_REGISTRY", "get_model_family", "plan_for"]


@runtime_checkable
class ModelRunner(Protocol):
  """A model as the engine drives it (all array methods are pure and traced inside the step).

  Attributes:
    params: the weights (a pytree; the step's first argument).
    vocab_size: token ids are in ``[0, vocab_size)``.
    max_model_len: the longest sequence the model supports.
    dtype: the weights' dtype name (``"bfloat16"`` or ``"float32"``): ``"auto"`` cache dtypes
      resolve to it.
  """

  params: Any
  vocab_size: int
  max_model_len: int
  dtype: str

  def with_params(self, params) -> ModelRunner:
    """The same model with other weights (``None``: none, the static part alone)."""

  def get_kv_cache_layers(self, cache_config: CacheConfig, *, tensor_parallel_size: int = 1) -> Sequence[KVCacheLayer]:
    """Every cache the model keeps (and its draft head when ``num_speculative_tokens`` > 0), as one
    device of a tensor split of ``tensor_parallel_size`` holds them (``KVCacheLayer.shards``)."""

  def shard(self, mesh: jax.sharding.Mesh, *, expert_parallel: bool = False) -> ModelRunner:
    """The same model with its weights placed on ``mesh`` (axes ``("data", "tensor")``)."""

  def paged_layout(self, plan: KVCacheConfig) -> Hashable:
    """The static, hashable facts of the plan the forward needs (each cache's ``KernelView``)."""

  def kernel_implementation(self, kernel: str, requested: str = "auto") -> str:
    """The path (``"pallas"``, ``"xla"``, ...) ``kernel`` runs in this runner's step: ``requested``
    when it names one, else the runner's choice for this device (``"auto"``, one meaning for every
    kernel: ``pallas_kernels.resolve_implementation``)."""

  def compute_step_metadata(
    self,
    block_tables: Sequence[jax.Array],
    num_blocks: Sequence[jax.Array],
    req_indices: jax.Array,
    positions: jax.Array,
    kernel_block_tables: Sequence[jax.Array | None] | None = None,
    *,
    spec: StepMetadataSpec,
  ) -> StepMetadata:
    """The step's slot mappings and kernel-block tables (``jaxkv.step.step_metadata``) as the
    model's kernels compute them; ``spec.implementation`` ``"auto"`` resolved by the model."""

  def forward(self, params, caches: dict[str, jax.Array], inputs: StepInputs, layout) -> tuple[jax.Array, dict]:
    """Hidden states ``[T, D]`` of the step's tokens and the updated caches."""

  def compute_logits(self, params, hidden: jax.Array) -> jax.Array:
    """float32 logits ``[..., V]`` of hidden states ``[..., D]``."""

  def top_k(self, x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k(x, k)`` (values and int32 ids ``[..., k]`` of float ``x [..., N]``) as the
    runner's kernels compute it: the sampler's top log-probs over the vocabulary."""

  def propose_drafts(
    self, params, caches, hidden, next_ids, inputs: StepInputs, last: jax.Array, layout, *, num_drafts: int
  ) -> tuple[jax.Array, dict]:
    """Drafts ``[R, num_drafts]`` continuing each row's token ``last[r]`` (-1: none), and the caches.

    ``next_ids [T]``: the token after each step token (known or just sampled).
    """


class ModelFamily(Protocol):
  """How the command line builds a runner of one architecture without importing it."""

  def load_config(self, model_path: str): ...

  builtin_config_names: tuple[str, ...]

  def builtin_config(self, name: str): ...
  def from_pretrained(
    self,
    model_path: str,
    *,
    dtype: str,
    implementation: str,
    check_weights: bool = False,
    mesh: jax.sharding.Mesh | None = None,
    expert_parallel: bool = False,
  ) -> ModelRunner: ...
  def from_random(self, config, *, dtype: str, seed: int, implementation: str) -> ModelRunner: ...
  def from_shapes(self, config, *, dtype: str, implementation: str) -> ModelRunner: ...
  def get_kv_cache_layers(
    self, config, cache_config: CacheConfig, *, tensor_parallel_size: int = 1
  ) -> Sequence[KVCacheLayer]: ...
  def weight_bytes(self, config, dtype: str) -> int: ...
  def check_parallel(
    self, config, *, tensor_parallel_size: int, data_parallel_size: int, expert_parallel: bool
  ) -> None: ...
  def describe(self, config, cache_config: CacheConfig) -> str: ...


# Architecture name -> "module:object". Imported on first use.
MODEL_REGISTRY: dict[str, str] = {
  "glm5_next": "models.glm5_next.runner:FAMILY",
}


def get_model_family(architecture: str = "glm5_next") -> ModelFamily:
  if architecture not in MODEL_REGISTRY:
    raise ValueError(f"unknown architecture {architecture!r}; registered: {sorted(MODEL_REGISTRY)}.")
  module, name = MODEL_REGISTRY[architecture].split(":")
  return getattr(importlib.import_module(module), name)


def plan_for(runner: ModelRunner, cache_config: CacheConfig, *, tensor_parallel_size: int = 1) -> KVCacheConfig:
  """The one way a model's KV cache is planned: its layers and the options, nothing else (a model
  without a draft head refuses ``num_speculative_tokens`` in ``get_kv_cache_layers``). On a tensor
  split the plan is one device's: ``memory_bytes`` is each device's budget. ``"auto"`` cache dtypes
  are the runner's weights' dtype."""
  cache_config = cache_config.resolve_dtypes(runner.dtype)  # "auto": the weights' dtype
  layers = runner.get_kv_cache_layers(cache_config, tensor_parallel_size=tensor_parallel_size)
  return plan_kv_cache(layers, cache_config)
