"""The disk tier: one file per manager block under a directory, keyed by block hash; survives a
restart.

Layout: ``DIR/<fingerprint>/manifest.json`` names the format and what the blocks belong to (the
fingerprint covers the plan's block layout and a sample of the weights, so another model, dtype or
layout never reads these blocks), and ``DIR/<fingerprint>/<hash hex>-g<group>.blk`` holds one
block: a 48-byte header (magic, payload length, SHA-256 of the payload) and the payload. Files
are written to a temporary name and renamed, by one background thread, so the serving loop never
waits for the disk. A read checks the header and checksum: a missing, truncated or corrupt file
is a miss (and is deleted), never wrong bytes. Capacity is kept by evicting the least recently
used files (file modification times order them after a restart).
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import json
import os
import pathlib
import struct
import threading

import numpy as np

from jaxkv.kv_offload.tier import OffloadKey, OffloadTier

__all__ = ["DiskTier"]

_MAGIC = b"JAXKVBLK"
_HEADER = struct.Struct("<8sQ32s")  # magic, payload bytes, sha256(payload)
_FORMAT = 1


class DiskTier(OffloadTier):
  """Args: directory: where blocks live (created); capacity_bytes: the most payload bytes kept;
  fingerprint: what the blocks belong to (``offload_fingerprint``), a subdirectory of its own."""

  name = "disk"

  def __init__(self, directory: str | os.PathLike, capacity_bytes: int, fingerprint: str):
    if capacity_bytes <= 0:
      raise ValueError(f"the disk tier's capacity must be positive, got {capacity_bytes} bytes.")
    if not fingerprint or not all(c in "0123456789abcdef" for c in fingerprint):
      raise ValueError(f"fingerprint must be a lowercase hex string, got {fingerprint!r}.")
    self.capacity_bytes = capacity_bytes
    self.root = pathlib.Path(directory) / fingerprint
    try:
      self.root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
      raise ValueError(f"cannot use {directory!r} as the KV offload directory: {err}.") from None
    manifest = self.root / "manifest.json"
    want = {"format": _FORMAT, "fingerprint": fingerprint, "files": "<block hash hex>-g<group id>.blk",
            "header": "8s magic JAXKVBLK, u64 payload bytes, 32-byte sha256 of the payload (little-endian)"}
    if not manifest.exists():
      tmp = manifest.with_suffix(".tmp")
      tmp.write_text(json.dumps(want, indent=1))
      os.replace(tmp, manifest)
    self._lock = threading.Lock()
    self._entries: collections.OrderedDict[OffloadKey, int] = collections.OrderedDict()
    self.used_bytes = 0
    files = sorted(self.root.glob("*.blk"), key=lambda p: p.stat().st_mtime_ns)
    for path in files:
      key = self._key(path)
      if key is not None:
        self._entries[key] = path.stat().st_size - _HEADER.size
        self.used_bytes += self._entries[key]
    self._evict()
    self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxkv-disk-tier")
    self._pending: list[concurrent.futures.Future] = []

  def __len__(self) -> int:
    return len(self._entries)

  def _path(self, key: OffloadKey) -> pathlib.Path:
    return self.root / f"{key[0].hex()}-g{key[1]}.blk"

  @staticmethod
  def _key(path: pathlib.Path) -> OffloadKey | None:
    digest, _, group = path.stem.rpartition("-g")
    try:
      return bytes.fromhex(digest), int(group)
    except ValueError:
      return None

  def contains(self, key: OffloadKey) -> bool:
    return key in self._entries

  def _forget(self, key: OffloadKey) -> None:
    with self._lock:
      n = self._entries.pop(key, None)
      if n is not None:
        self.used_bytes -= n
    self._path(key).unlink(missing_ok=True)

  def get(self, key: OffloadKey) -> np.ndarray | None:
    if key not in self._entries:
      return None
    path = self._path(key)
    try:
      raw = path.read_bytes()
    except OSError:
      self._forget(key)
      return None
    if len(raw) < _HEADER.size:
      self._forget(key)
      return None
    magic, size, digest = _HEADER.unpack_from(raw)
    payload = raw[_HEADER.size:]
    if magic != _MAGIC or size != len(payload) or hashlib.sha256(payload).digest() != digest:
      self._forget(key)
      return None
    with self._lock:
      if key in self._entries:
        self._entries.move_to_end(key)
    os.utime(path)  # the LRU order survives a restart
    return np.frombuffer(payload, np.uint8)

  def put(self, keys, rows) -> None:
    self._pending = [f for f in self._pending if not f.done()]
    self._pending.append(self._writer.submit(self._write, list(keys), rows))

  def _write(self, keys, rows) -> None:
    host = np.asarray(rows)  # waits for the device-to-host copy, off the serving thread
    for key, row in zip(keys, host):
      if key in self._entries or row.nbytes > self.capacity_bytes:
        continue
      payload = np.ascontiguousarray(row).tobytes()
      path = self._path(key)
      tmp = path.with_suffix(".tmp")
      with open(tmp, "wb") as f:
        f.write(_HEADER.pack(_MAGIC, len(payload), hashlib.sha256(payload).digest()))
        f.write(payload)
      os.replace(tmp, path)
      with self._lock:
        self._entries[key] = len(payload)
        self.used_bytes += len(payload)
      self._evict()

  def _evict(self) -> None:
    while True:
      with self._lock:
        if self.used_bytes <= self.capacity_bytes or not self._entries:
          return
        key, n = self._entries.popitem(last=False)
        self.used_bytes -= n
      self._path(key).unlink(missing_ok=True)

  def flush(self) -> None:
    for f in self._pending:
      f.result()  # re-raises a failed write (disk full, permissions)
    self._pending = []
