"""Lowering for a GPU without one (ahead of time): which GPU a trace is for, and what it gives.

Inside ``gpu_target("NVIDIA H200")`` the kernels' ``interpret=None`` means compiled (Triton), and
their tiles and splits are sized by the target's shared memory and multiprocessors, exactly as on
that GPU; ``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`` then gives the program the
GPU would compile, on any machine (``jaxkv.engine.lower_step``, ``jaxkv lower``). Compiling it
needs the GPU, or for the Pallas kernels alone, Triton's own compiler (``jaxkv.kernel_build``).
"""

from __future__ import annotations

import dataclasses

import jax

__all__ = ["GpuTarget", "GPU_TARGETS", "gpu_target", "target_gpu", "target_backend"]


@dataclasses.dataclass(frozen=True)
class GpuTarget:
  """What a kernel is sized and compiled against on one GPU.

  Attributes:
    shared_memory_bytes: shared memory one block may opt into (the CUDA driver's
      ``MAX_SHARED_MEMORY_PER_BLOCK_OPTIN``; Triton sizes kernels against it).
    multiprocessors: streaming multiprocessors (SXM parts).
    compute_capability: e.g. 90 for sm_90.
  """

  shared_memory_bytes: int
  multiprocessors: int
  compute_capability: int


GPU_TARGETS = {
  "NVIDIA H100": GpuTarget(232_448, 132, 90),
  "NVIDIA H200": GpuTarget(232_448, 132, 90),
  "NVIDIA GH200": GpuTarget(232_448, 132, 90),
  "NVIDIA B200": GpuTarget(232_448, 148, 100),
  "NVIDIA A100": GpuTarget(166_912, 108, 80),
  "NVIDIA L4": GpuTarget(101_376, 58, 89),
}


def target_gpu():
  """The ``jax.sharding.AbstractDevice`` of the enclosing ``gpu_target``, or None.

  An abstract mesh over this machine's own GPUs (a ``shard_map`` body on a device mesh) names
  their kind too; it mirrors them and is no target (the driver answers for them), as Pallas's
  own ``gpu_info`` reads it.
  """
  get = getattr(jax.sharding, "get_abstract_mesh", None)  # JAX versions before it have no target
  device = getattr(get(), "abstract_device", None) if get is not None else None
  if device is None or device.platform != "gpu":
    return None
  local = jax.local_devices()[0]
  return None if local.platform == "gpu" and local.device_kind == device.device_kind else device


def target_backend() -> str:
  """The backend traced for: ``"gpu"`` inside ``gpu_target``, else ``jax.default_backend()``."""
  return "gpu" if target_gpu() is not None else jax.default_backend()


def gpu_target(device_kind: str = "NVIDIA H200"):
  """A context in which jitted functions trace and lower for ``device_kind`` (a key of
  ``GPU_TARGETS``) without one.

  Raises:
    ValueError: ``device_kind`` is not one of ``GPU_TARGETS``.
    RuntimeError: this JAX has no abstract devices (``jax.sharding.AbstractDevice``, JAX >= 0.12).
  """
  if device_kind not in GPU_TARGETS:
    raise ValueError(f"unknown GPU {device_kind!r}; targets: {sorted(GPU_TARGETS)}.")
  if not all(hasattr(jax.sharding, n) for n in ("AbstractDevice", "AbstractMesh", "use_abstract_mesh")):
    raise RuntimeError(
      f"lowering for a GPU without one needs jax.sharding.AbstractDevice (JAX >= 0.12), got JAX {jax.__version__}."
    )
  device = jax.sharding.AbstractDevice(device_kind, GPU_TARGETS[device_kind].multiprocessors, "gpu")
  return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device))
