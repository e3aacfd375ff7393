"""The disk tier: one file per manager block under a directory, keyed by block hash; survives a
restart.

Layout: ``DIR/<fingerprint>/manifest.json`` names the format and what the blocks belong to (the
fingerprint covers the plan's block layout and a sample of the weights, so another model, dtype or
layout never reads these blocks), and ``DIR/<fingerprint>/<hash hex>-g<group>.blk`` holds one
block: a 48-byte header (magic, payload length, SHA-256 of the payload) and the payload. Files
are written to a temporary name unique to the writer (process and thread) and renamed, by one
background thread, so the serving loop never waits for the disk and two processes sharing the
directory never rename each other's files (the second writer of a block replaces it with the same
bytes). A read checks the header, the payload's size and the checksum: a missing, truncated or
corrupt file is a miss (and is deleted), never wrong bytes. Capacity is kept by evicting the least
recently used files (file modification times order them after a restart).

The disk never stops the engine: a failed read is a miss and a failed write (permissions, full
disk, a directory removed while serving) a skipped save, each logged once with the path and the
error. A directory that exists but is not writable is used read-only, and one with less free space
than the capacity is used as it is; both are said at start-up.
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import json
import logging
import os
import pathlib
import shutil
import struct
import threading

import numpy as np

from jaxkv.engine.offload.tier import OffloadKey, OffloadTier

__all__ = ["DiskTier"]

_MAGIC = b"JAXKVBLK"
_HEADER = struct.Struct("<8sQ32s")  # magic, payload bytes, sha256(payload)
_FORMAT = 1
_log = logging.getLogger("jaxkv.engine.offload")


class DiskTier(OffloadTier):
  """Args: directory: where blocks live (created); capacity_bytes: the most payload bytes kept;
  fingerprint: what the blocks belong to (``offload_fingerprint``), a subdirectory of its own;
  payload_bytes: each group's block bytes, when known: a file of another size is a miss."""

  name = "disk"

  def __init__(
    self,
    directory: str | os.PathLike,
    capacity_bytes: int,
    fingerprint: str,
    payload_bytes: dict[int, int] | None = None,
  ):
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
    want = {
      "format": _FORMAT,
      "fingerprint": fingerprint,
      "files": "<block hash hex>-g<group id>.blk",
      "header": "8s magic JAXKVBLK, u64 payload bytes, 32-byte sha256 of the payload (little-endian)",
    }
    self.payload_bytes = dict(payload_bytes or {})
    self.read_only = not os.access(self.root, os.W_OK | os.X_OK)
    if self.read_only:
      _log.warning("KV offload directory %s is not writable: its blocks are read, no block is saved", self.root)
    elif (free := shutil.disk_usage(self.root).free) < capacity_bytes:
      _log.warning(
        "KV offload directory %s has %.2f GiB free for a %.2f GiB tier: saves past it are skipped",
        self.root,
        free / 2**30,
        capacity_bytes / 2**30,
      )
    elif not manifest.exists():
      tmp = self._tmp_path(manifest)
      tmp.write_text(json.dumps(want, indent=1))
      os.replace(tmp, manifest)
    self._warned: set[str] = set()
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

  @staticmethod
  def _tmp_path(path: pathlib.Path) -> pathlib.Path:
    return path.with_name(f"{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")

  def _warn_once(self, what: str, path: pathlib.Path, err: OSError) -> None:
    if what not in self._warned:
      self._warned.add(what)
      _log.warning("KV offload disk tier: %s %s failed (%s); the engine goes on without it", what, path, err)

  def contains(self, key: OffloadKey) -> bool:
    return key in self._entries

  def _forget(self, key: OffloadKey) -> None:
    with self._lock:
      n = self._entries.pop(key, None)
      if n is not None:
        self.used_bytes -= n
    try:
      self._path(key).unlink(missing_ok=True)
    except OSError as err:
      self._warn_once("deleting", self._path(key), err)

  def get(self, key: OffloadKey) -> np.ndarray | None:
    if key not in self._entries:
      return None
    path = self._path(key)
    try:
      raw = path.read_bytes()
    except OSError as err:
      self._warn_once("reading", path, err)
      self._forget(key)
      return None
    if len(raw) < _HEADER.size:
      self._forget(key)
      return None
    magic, size, digest = _HEADER.unpack_from(raw)
    payload = raw[_HEADER.size :]
    want = self.payload_bytes.get(key[1], size)
    # The size against the layout before the checksum is trusted: a self-consistent file of
    # another layout's block is no block of this one.
    if magic != _MAGIC or size != len(payload) or size != want or hashlib.sha256(payload).digest() != digest:
      self._forget(key)
      return None
    with self._lock:
      if key in self._entries:
        self._entries.move_to_end(key)
    if not self.read_only:
      try:
        os.utime(path)  # the LRU order survives a restart
      except OSError as err:
        self._warn_once("touching", path, err)
    return np.frombuffer(payload, np.uint8)

  def put(self, keys, rows) -> None:
    self._pending = [f for f in self._pending if not f.done()]
    self._pending.append(self._writer.submit(self._write, list(keys), rows))

  def _write(self, keys, rows) -> None:
    if self.read_only:
      return
    host = np.asarray(rows)  # waits for the device-to-host copy, off the serving thread
    for key, row in zip(keys, host):
      if key in self._entries or row.nbytes > self.capacity_bytes:
        continue
      payload = np.ascontiguousarray(row).tobytes()
      path = self._path(key)
      tmp = self._tmp_path(path)
      try:
        with open(tmp, "wb") as f:
          f.write(_HEADER.pack(_MAGIC, len(payload), hashlib.sha256(payload).digest()))
          f.write(payload)
        os.replace(tmp, path)
      except OSError as err:  # a skipped save: the block is recomputed when needed
        self._warn_once("writing", path, err)
        try:
          tmp.unlink(missing_ok=True)
        except OSError:
          pass
        continue
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
      try:
        self._path(key).unlink(missing_ok=True)
      except OSError as err:
        self._warn_once("evicting", self._path(key), err)

  def flush(self) -> None:
    for f in self._pending:
      f.result()  # write errors are logged and skipped inside; anything else is a bug and raises
    self._pending = []
