"""KV connectors and offload tiers in manager blocks: the device prefix cache's second level in host
memory or on disk, and swap on preemption."""

from jaxkv.kv_offload.connector import KVConnectorBase, OffloadingConnector, offload_fingerprint
from jaxkv.kv_offload.disk_tier import DiskTier
from jaxkv.kv_offload.host_tier import HostTier
from jaxkv.kv_offload.swap import SwapSpace
from jaxkv.kv_offload.tier import OffloadKey, OffloadTier

__all__ = [
  "KVConnectorBase",
  "OffloadingConnector",
  "offload_fingerprint",
  "DiskTier",
  "HostTier",
  "SwapSpace",
  "OffloadKey",
  "OffloadTier",
]
