"""How GLM-5.3-Flash's weights split over a ``("data", "tensor")`` device mesh, as ``PartitionSpec``s.

vLLM's split, by parameter: heads and MLP intermediates over the tensor axis (column-parallel
inputs, row-parallel outputs), the vocabulary of the embedding and the head over the tensor axis,
and the routed experts either split over the tensor axis along their intermediate dim or, with
expert parallelism, one share of the experts per device over all data x tensor devices. What all
heads share (the low-rank down projections of MLA and KDA, the indexer's single key head, norms,
the router, mHC, the MTP's ``eh_proj``) is replicated. ``per_device_weight_bytes`` counts what one
device holds, in bf16 or in fp8 (e4m3 matrices with one float32 scale per 128 x 128 block, the
layout of the released fp8 checkpoints; norms, router, mHC, embedding and head stay bf16).
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv.placement import host_to_device


__all__ = [
  "DATA",
  "TENSOR",
  "ExpertSharding",
  "HeadSharding",
  "ModelSharding",
  "check_divisible",
  "partition_spec",
  "per_device_weight_bytes",
]

DATA, TENSOR = "data", "tensor"
_EXPERTS = (DATA, TENSOR)

# (pattern on the parameter path, spec without expert parallelism, spec with it).
_RULES = [
  (r"^(embed_tokens|lm_head)$", P(TENSOR, None), None),
  (r"mlp\.experts_(gate|up)$", P(None, None, TENSOR), P(_EXPERTS, None, None)),
  (r"mlp\.experts_down$", P(None, TENSOR, None), P(_EXPERTS, None, None)),
  (r"\.(gate_proj|up_proj)\.weight$", P(TENSOR, None), None),  # dense and shared-expert MLPs
  (r"\.down_proj\.weight$", P(None, TENSOR), None),
  (r"self_attn\.(q_b_proj|kv_b_proj)\.weight$", P(TENSOR, None), None),  # MLA heads
  (r"self_attn\.o_proj\.weight$", P(None, TENSOR), None),  # MLA and KDA outputs
  (r"indexer\.(wq_b|weights_proj)\.weight$", P(TENSOR, None), None),  # indexer heads
  (r"self_attn\.(q_proj|k_proj|v_proj|f_b_proj|g_b_proj|b_proj)\.weight$", P(TENSOR, None), None),  # KDA heads
  (r"self_attn\.[qkv]_conv1d$", P(TENSOR, None, None), None),
  (r"self_attn\.(A_log|dt_bias)$", P(TENSOR), None),
]
_FP8_EXCLUDED = re.compile(r"^(embed_tokens|lm_head)$|_hc\.|mlp\.gate_weight$")
_FP8_BLOCK = 128


def partition_spec(name: str, shape: tuple[int, ...], *, expert_parallel: bool = False) -> P:
  """The ``PartitionSpec`` of parameter ``name`` (a path such as ``layers.3.self_attn.q_proj.weight``)."""
  for pattern, spec, ep_spec in _RULES:
    if re.search(pattern, name):
      spec = ep_spec if expert_parallel and ep_spec is not None else spec
      if len(spec) != len(shape):
        raise ValueError(f"sharding rule {pattern!r} is for {len(spec)}-d parameters; {name} is {list(shape)}.")
      return spec
  return P(*([None] * len(shape)))


def _shards(spec: P, axis_sizes: dict[str, int]) -> list[int]:
  out = []
  for entry in spec:
    names = entry if isinstance(entry, tuple) else (entry,) if entry else ()
    out.append(math.prod(axis_sizes[n] for n in names))
  return out


def per_device_weight_bytes(
  named_shapes,
  *,
  tensor_parallel_size: int = 1,
  data_parallel_size: int = 1,
  expert_parallel: bool = False,
  weight_format: str = "bf16",
) -> int:
  """Bytes of weights one device holds.

  Args:
    named_shapes: ``(name, shape, itemsize)`` of every parameter (``Glm5NextForCausalLM`` in bf16
      under ``nnx.eval_shape``: nothing is allocated; a few small ones stay float32).
    weight_format: ``"bf16"`` (each parameter at its own itemsize) or ``"fp8"``.

  Raises:
    ValueError: a split dimension does not divide by its shards (naming the parameter, the
      dimension and the sizes).
  """
  if weight_format not in ("bf16", "fp8"):
    raise ValueError(f"weight_format must be 'bf16' or 'fp8', got {weight_format!r}.")
  axes = {TENSOR: tensor_parallel_size, DATA: data_parallel_size}
  total = 0
  for name, shape, itemsize in named_shapes:
    spec = partition_spec(name, shape, expert_parallel=expert_parallel)
    local = []
    for dim, (size, shards) in enumerate(zip(shape, _shards(spec, axes))):
      if size % shards:
        raise ValueError(
          f"{name} {list(shape)}: dimension {dim} ({size}) does not split over {shards} devices "
          f"(tensor parallel {tensor_parallel_size}, data parallel {data_parallel_size}, expert "
          f"parallel {'on' if expert_parallel else 'off'}); choose sizes that divide it."
        )
      local.append(size // shards)
    n = math.prod(local)
    if weight_format == "fp8" and len(local) >= 2 and not _FP8_EXCLUDED.search(name):
      *lead, rows, cols = local
      total += n + math.prod(lead) * math.ceil(rows / _FP8_BLOCK) * math.ceil(cols / _FP8_BLOCK) * 4
    else:
      total += itemsize * n
  return total


def check_divisible(config, *, tensor_parallel_size: int, data_parallel_size: int, expert_parallel: bool) -> None:
  """Raises ``ValueError`` naming the counts when a mesh does not split the model's heads or experts."""
  tp, dp = tensor_parallel_size, data_parallel_size
  if tp < 1 or dp < 1:
    raise ValueError(f"tensor_parallel_size {tp} and data_parallel_size {dp} must be >= 1.")
  heads = {
    "num_attention_heads": config.num_attention_heads,
    "index_n_heads": config.index_n_heads,
    "linear_num_heads": config.linear_num_heads,
  }
  bad = {k: v for k, v in heads.items() if v % tp}
  if bad:
    raise ValueError(f"tensor_parallel_size {tp} must divide every head count; it does not divide {bad}.")
  if expert_parallel and config.n_routed_experts % (tp * dp):
    raise ValueError(
      f"expert parallelism deals {config.n_routed_experts} experts over {tp * dp} devices "
      f"(tensor {tp} x data {dp}), which does not divide them."
    )
  if not expert_parallel and config.moe_intermediate_size % tp:
    raise ValueError(
      f"tensor_parallel_size {tp} must divide the experts' width moe_intermediate_size "
      f"{config.moe_intermediate_size} (or use expert parallelism)."
    )


@dataclasses.dataclass(frozen=True)
class ExpertSharding:
  """How ``MoE`` runs its routed experts on a mesh (a static attribute of the module).

  Each device runs the tokens' chosen experts that it holds, on every token (the activations
  between sublayers are replicated), and the partial sums meet in one float32 ``psum``: with
  expert parallelism each device holds ``E / (data x tensor)`` whole experts and a token's copies
  for the others' experts contribute nothing here; without it every expert's width is split over
  ``tensor`` and the down projection's partial products are summed. The rest of the model is left
  to XLA's SPMD partitioner, from the weights' shardings.
  """

  mesh: Mesh
  expert_parallel: bool

  @property
  def axes(self) -> tuple[str, ...]:
    return (DATA, TENSOR) if self.expert_parallel else (TENSOR,)

  def routed(self, routed_fn, flat, idx, w, w_gate, w_up, w_down):
    """``routed_fn`` (``MoE._routed``) on each device's experts, summed over the mesh: float32 ``[M, D]``."""
    axes, ep = self.axes, self.expert_parallel
    specs = [
      partition_spec(f"mlp.experts_{n}", x.shape, expert_parallel=ep)
      for n, x in (("gate", w_gate), ("up", w_up), ("down", w_down))
    ]

    def local(flat, idx, w, w_gate, w_up, w_down):
      first = jax.lax.axis_index(axes) * w_gate.shape[0] if ep else None
      return jax.lax.psum(routed_fn(flat, idx, w, w_gate, w_up, w_down, first), axes)

    return jax.shard_map(local, mesh=self.mesh, in_specs=(P(), P(), P(), *specs), out_specs=P(), check_vma=False)(
      flat, idx, w, w_gate, w_up, w_down
    )


@dataclasses.dataclass(frozen=True)
class HeadSharding:
  """Runs a Pallas kernel on each device's share of its heads or rows (a static attribute of the
  KDA and MLA modules on a mesh).

  XLA's partitioner cannot split a custom call: a Pallas kernel (the KDA recurrence, sparse MLA
  decode, paged MQA logits) inside the partitioned step would run on gathered, replicated inputs
  on every device. Under ``shard_map`` each device runs it on its heads (those its column-parallel
  weights produced) or, for a kernel whose rows are independent, on its rows; either way each
  head's or row's arithmetic is the single-device one.
  """

  mesh: Mesh

  @property
  def size(self) -> int:
    """Devices an axis is split over (the tensor axis)."""
    return self.mesh.shape[TENSOR]

  def map(self, fn, args, in_axes: tuple[int | None, ...], out_axes: tuple[int | None, ...]):
    """``fn(*args)`` per device: ``in_axes[i]`` / ``out_axes[j]`` is the axis of each argument /
    output split over ``tensor``, None for one the device sees whole."""
    spec = lambda axis: P() if axis is None else P(*([None] * axis), TENSOR)
    out_specs = tuple(spec(a) for a in out_axes)
    return jax.shard_map(
      fn,
      mesh=self.mesh,
      in_specs=tuple(spec(a) for a in in_axes),
      out_specs=out_specs if len(out_specs) > 1 else out_specs[0],
      check_vma=False,
    )(*args)


@dataclasses.dataclass(frozen=True)
class ModelSharding:
  """The model's place on a ``("data", "tensor")`` mesh, given when it is built
  (``Glm5NextForCausalLM(config, ..., sharding=)``): each MoE runs its routed experts per device
  (``experts``), each KDA and MLA module its kernels per device on its heads (``heads``), and
  ``place`` puts the weights where ``partition_spec`` says.
  """

  mesh: Mesh
  expert_parallel: bool = False

  @property
  def experts(self) -> ExpertSharding:
    return ExpertSharding(self.mesh, self.expert_parallel)

  @property
  def heads(self) -> HeadSharding:
    return HeadSharding(self.mesh)

  def check(self, config) -> None:
    """ValueError naming the sizes when the mesh does not divide the heads or the experts."""
    check_divisible(
      config,
      tensor_parallel_size=self.mesh.shape[TENSOR],
      data_parallel_size=self.mesh.shape[DATA],
      expert_parallel=self.expert_parallel,
    )

  def place(self, params):
    """A copy of the ``nnx.State`` ``params`` with every parameter on the mesh by its
    ``partition_spec`` (the given state is left as it is)."""
    placed = []
    for path, var in nnx.to_flat_state(params):
      name = ".".join(map(str, path))
      value = var.get_value()
      target = NamedSharding(self.mesh, partition_spec(name, value.shape, expert_parallel=self.expert_parallel))
      if not (isinstance(value, jax.Array) and value.sharding.is_equivalent_to(target, value.ndim)):
        # From host memory, each process placing its own devices' slices (no cross-process check
        # of the whole tensor). Arrays loaded by shard (``load_checkpoint(..., mesh=)``) are
        # already in place.
        value = host_to_device(np.asarray(value), target)
      placed.append((path, var.replace(value=value)))
    return nnx.from_flat_state(placed)
