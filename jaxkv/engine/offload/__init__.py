"""KV connectors and offload tiers in manager blocks: the device prefix cache's second level in host
memory or on disk, and swap on preemption."""

from jaxkv.engine.offload.connector import KVConnectorBase, OffloadingConnector, offload_fingerprint
from jaxkv.engine.offload.disk_tier import DiskTier
from jaxkv.engine.offload.host_tier import HostTier
from jaxkv.engine.offload.swap import SwapSpace
from jaxkv.engine.offload.tier import OffloadKey, OffloadTier
from jaxkv.engine.offload.transfer import KVTransfer

__all__ = [
  "KVConnectorBase",
  "KVTransfer",
  "OffloadingConnector",
  "offload_fingerprint",
  "DiskTier",
  "HostTier",
  "SwapSpace",
  "OffloadKey",
  "OffloadTier",
]
