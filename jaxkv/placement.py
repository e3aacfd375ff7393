"""Arrays from the host onto devices: one device, or a sharding that may span processes.

Below the engine and the models (both place host data: the step's inputs, a model's parameters).
"""

from __future__ import annotations

import jax

__all__ = ["one_device", "host_to_device"]


def one_device(device: jax.Device) -> jax.sharding.Sharding:
  """The whole array on ``device``, committed to it."""
  # jax 0.12 deprecates constructing SingleDeviceSharding for this factory, which 0.11 may lack.
  make = getattr(jax.sharding, "make_single_device_sharding", None)
  return make(device) if make else jax.sharding.SingleDeviceSharding(device)


def host_to_device(x, sharding: jax.sharding.Sharding):
  """Host arrays (a pytree of NumPy arrays, the same on every process) placed as ``sharding``.

  On a mesh spanning processes each process fills its own devices from its copy. ``jax.device_put``
  would first check that every process passed equal data (``multihost_utils.assert_equal``: an
  all-gather program and a wait for its result on the host), which for the step's inputs meant a
  collective and a sync on every step."""
  if sharding.is_fully_addressable:
    return jax.device_put(x, sharding)
  return jax.tree.map(lambda a: jax.make_array_from_callback(a.shape, sharding, lambda index: a[index]), x)
