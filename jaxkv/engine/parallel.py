"""The device mesh of a sharded engine: ``("data", "tensor")``, vLLM's parallel sizes.

The engine stays one program (JAX's SPMD): the model places its weights on the mesh
(``ModelRunner.shard``), the block tables and step inputs are one replicated copy in manager
blocks, each cache is one copy per device or split by head (``cache_shardings``), and XLA
partitions the step from those shardings. Several processes (one
per host) run the same program after ``jax.distributed.initialize()``; ``jax.devices()`` is then
every process's devices.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["make_mesh", "replicated", "cache_shardings"]


def make_mesh(tensor_parallel_size: int = 1, data_parallel_size: int = 1, devices=None) -> Mesh:
  """A ``data x tensor`` mesh of the first ``data_parallel_size * tensor_parallel_size`` devices.

  Raises:
    ValueError: a size below 1, or more devices asked for than there are (naming both).
  """
  tp, dp = tensor_parallel_size, data_parallel_size
  if tp < 1 or dp < 1:
    raise ValueError(f"tensor_parallel_size {tp} and data_parallel_size {dp} must be >= 1.")
  devices = list(jax.devices() if devices is None else devices)
  if tp * dp > len(devices):
    raise ValueError(
      f"tensor_parallel_size {tp} x data_parallel_size {dp} needs {tp * dp} devices; "
      f"{len(devices)} are visible ({devices[0].platform}). On a CPU, "
      f"XLA_FLAGS=--xla_force_host_platform_device_count={tp * dp} (set before JAX starts) makes more."
    )
  return Mesh(np.asarray(devices[: tp * dp], dtype=object).reshape(dp, tp), ("data", "tensor"))


def replicated(mesh: Mesh | None) -> NamedSharding | None:
  """One full copy on every device of ``mesh`` (None: no mesh)."""
  return None if mesh is None else NamedSharding(mesh, P())


def cache_shardings(plan, mesh: Mesh | None) -> dict[str, NamedSharding] | None:
  """Each backing tensor's placement (None: no mesh): split along its rows' bytes over ``tensor``
  when the plan splits it (``KVCacheTensor.shards``: KDA states by head), else one copy per device."""
  if mesh is None:
    return None
  for t in plan.tensors:
    if t.shards > 1 and t.shards != mesh.shape["tensor"]:
      raise ValueError(
        f"{t.name} is planned in {t.shards} shards, but the mesh's tensor axis has "
        f"{mesh.shape['tensor']} devices; plan with tensor_parallel_size={mesh.shape['tensor']}."
      )
  return {t.name: NamedSharding(mesh, P(None, "tensor") if t.shards > 1 else P()) for t in plan.tensors}
