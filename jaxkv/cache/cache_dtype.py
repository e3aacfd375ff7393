"""How a cache stores one entry: the one list of cache dtypes (vLLM's ``--kv-cache-dtype``).

``CacheDType`` is a ``StrEnum``: its members are the strings themselves, so configs, flags, JSON
and jit static arguments may hold either.
"""

from __future__ import annotations

import enum

__all__ = ["CacheDType", "CACHE_DTYPES", "MODEL_DTYPES", "check_cache_dtype"]


class CacheDType(enum.StrEnum):
  """An entry encoding.

  ``FLOAT32`` and ``BFLOAT16`` store the values as they are. ``FP8`` stores e4m3 values followed by
  one float32 power-of-two scale per 128 of them, as ``uint8`` (``pallas_kernels.entry_bytes``: 528
  bytes for a 512-wide latent, 132 for a 128-wide indexer key).
  """

  BFLOAT16 = "bfloat16"
  FLOAT32 = "float32"
  FP8 = "fp8"


# Every encoding a cache may use, and those that are also model dtypes (states, rings, "auto").
CACHE_DTYPES: tuple[str, ...] = tuple(d.value for d in CacheDType)
MODEL_DTYPES: tuple[str, ...] = (CacheDType.BFLOAT16.value, CacheDType.FLOAT32.value)


def check_cache_dtype(value: str | None, *, name: str = "cache_dtype", allowed: tuple[str, ...] = CACHE_DTYPES) -> str:
  """``value`` if it is one of ``allowed``, else a ValueError naming it, the field and the choices."""
  if value not in allowed:
    raise ValueError(f"{name} must be one of {allowed}, got {value!r}.")
  return str(value)
