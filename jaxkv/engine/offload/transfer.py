"""The worker side of moving cache blocks between the device and elsewhere (vLLM's connector
worker API), shared by the offload connector and swap.

Before each step is dispatched the engine calls every transfer's ``start_store_kv`` (blocks that
must leave before their new owners write them: a preempted request's, swapped out), then every
transfer's ``start_load_kv`` (blocks that must arrive before the step reads them: offloaded prefix
hits, swapped-in requests). What to move is decided on the scheduler side, which differs: the
connector finds blocks by content hash, swap keeps a preempted request's blocks by request id.
"""

from __future__ import annotations

import abc

import jax

__all__ = ["KVTransfer", "pinned_host_put", "to_device"]


class KVTransfer(abc.ABC):
  """Copies of manager blocks between the device caches and another place, dispatched per step."""

  def start_store_kv(self, caches: dict[str, jax.Array]) -> None:
    """Dispatches the copies out of the device decided since the last call (default: none)."""

  @abc.abstractmethod
  def start_load_kv(self, caches: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Dispatches the copies into the device decided since the last call (caches donated)."""

  def wait_for_save(self) -> None:
    """Blocks until every copy out is stored (default: nothing is pending)."""


def pinned_host_put(x: jax.Array):
  """An asynchronous device-to-host copy into page-locked memory where the device has the
  ``pinned_host`` memory kind; the array itself otherwise (read back later). A replicated array
  (the caches on a mesh) is copied once, from this process's first device."""
  if x.is_fully_replicated:
    x = x.addressable_shards[0].data
  device = next(iter(x.devices()))
  if any(m.kind == "pinned_host" for m in device.addressable_memories()):
    return jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))
  return x


def to_device(rows, caches: dict[str, jax.Array]) -> jax.Array:
  """Host rows (pinned or NumPy) back in device memory, one copy on each device the caches are on
  (asynchronous; ``scatter_blocks`` then writes each device's share of split caches)."""
  sharding = next(iter(caches.values())).sharding
  if isinstance(sharding, jax.sharding.NamedSharding):
    sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
  elif not sharding.is_fully_replicated:
    raise ValueError(f"host rows go back to caches on one device or a mesh, got caches placed as {sharding}.")
  return jax.device_put(rows, sharding.with_memory_kind("device"))
