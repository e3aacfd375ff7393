"""Helpers shared by the kernels and their references (pure jnp, usable inside kernel bodies)."""

from __future__ import annotations

import ctypes
import functools

import jax
import jax.numpy as jnp

# Registers Pallas's fuser config in JAX's tracing context now: imported lazily by the first
# interpreted kernel, it would change that context after the engine's warm-up and retrace the step.
from jax.experimental.pallas import fuser  # noqa: F401

from jaxkv.gpu_target import GPU_TARGETS, target_backend, target_gpu

IMPLEMENTATIONS = ("pallas", "xla")
FP8_MAX = 448.0
FP8_DTYPE = jnp.float8_e4m3fn
# Smallest amax a scale is derived from: keeps an all-zero vector's scale finite.
FP8_AMAX_FLOOR = 1e-4
# Values sharing one fp32 scale in fp8 latent entries.
FP8_GROUP = 128
# Triton's smallest dot tile: head counts are zero-padded up to it.
MIN_DOT_ROWS = 16


def check_implementation(implementation: str) -> None:
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}.")


def resolve_implementation(implementation: str, *, kernel: str = "pallas", runs_here: bool | None = None) -> str:
  """The path a kernel runs as: the one resolver, with one meaning of ``"auto"`` for every kernel.

  ``"auto"``: the compiled kernel (``kernel``: ``"pallas"``, or ``"tokamax"`` for the grouped
  matmul) where it runs (``runs_here``; None: on a GPU, as interpret mode on the CPU is slow), else
  the XLA path. ``kernel`` or ``"xla"`` are taken as asked (``"pallas"`` on the CPU: interpreted).
  """
  if implementation == "auto":
    here = target_backend() != "cpu" if runs_here is None else runs_here
    return kernel if here else "xla"
  if implementation not in (kernel, "xla"):
    raise ValueError(f"implementation must be one of {(kernel, 'xla', 'auto')}, got {implementation!r}.")
  return implementation


def default_interpret(interpret: bool | None) -> bool:
  """Pallas GPU kernels run in interpret mode on the CPU (CI), compiled on a GPU or for a
  ``gpu_target``."""
  return target_backend() == "cpu" if interpret is None else interpret


# Shared memory every CUDA device gives one block without opting in: the budget when the driver
# cannot be asked.
_DEFAULT_SHARED_MEMORY = 48 * 1024
# cuDeviceGetAttribute's CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: what Triton sizes
# kernels against (232,448 bytes on an H100/H200, 166,912 on an A100, 101,376 on sm_86/89/120).
_CU_ATTR_SMEM_PER_BLOCK_OPTIN = 97
# CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT (132 on an H100/H200 SXM).
_CU_ATTR_MULTIPROCESSOR_COUNT = 16


@functools.cache
def _cuda_attribute(ordinal: int, attribute: int) -> int | None:
  try:
    cuda = ctypes.CDLL("libcuda.so.1")
    dev, value = ctypes.c_int(), ctypes.c_int()
    if (
      cuda.cuInit(0)
      or cuda.cuDeviceGet(ctypes.byref(dev), ordinal)
      or cuda.cuDeviceGetAttribute(ctypes.byref(value), attribute, dev)
    ):
      return None
    return value.value
  except (OSError, AttributeError):
    return None


def device_shared_memory_bytes(device: jax.Device | None = None) -> int | None:
  """Shared memory one program of a compiled Pallas (Triton) kernel may use on ``device`` (default:
  the first local device), asked of the CUDA driver; None off a GPU (interpret mode has no limit).
  48 KiB, which every CUDA device gives, when the driver cannot be asked. Inside ``gpu_target``
  (no device given): the target's (``GPU_TARGETS``)."""
  if device is None and (target := target_gpu()) is not None:
    return GPU_TARGETS[target.device_kind].shared_memory_bytes
  device = device or jax.local_devices()[0]
  if device.platform != "gpu":
    return None
  return _cuda_attribute(device.local_hardware_id or 0, _CU_ATTR_SMEM_PER_BLOCK_OPTIN) or _DEFAULT_SHARED_MEMORY


def device_multiprocessors(device: jax.Device | None = None) -> int | None:
  """Streaming multiprocessors of ``device`` (default: the first local device), asked of the CUDA
  driver; None off a GPU or when the driver cannot be asked. Inside ``gpu_target`` (no device
  given): the target's."""
  if device is None and (target := target_gpu()) is not None:
    return target.num_cores
  device = device or jax.local_devices()[0]
  if device.platform != "gpu":
    return None
  return _cuda_attribute(device.local_hardware_id or 0, _CU_ATTR_MULTIPROCESSOR_COUNT)


def check_byte_addressable(array: jax.Array, name: str, interpret: bool) -> None:
  """Raises ``ValueError`` when a compiled kernel would address 1-byte elements of ``array`` that
  its offsets cannot reach.

  Pallas's Triton lowering computes element offsets in signed 32-bit integers unless the array is
  larger than 2^32 bytes: in a uint8 or fp8 view of an array of 2-4 GiB, the bytes past 2 GiB
  would be addressed with negative offsets (before the array). Interpret mode has no such limit.
  """
  nbytes = array.size * array.dtype.itemsize
  if not interpret and 2**31 < nbytes <= 2**32:
    raise ValueError(
      f"{name} is {nbytes} bytes ({nbytes / 2**30:.2f} GiB): Pallas's Triton kernels address byte "
      "arrays of 2-4 GiB with 32-bit offsets, which do not reach past 2 GiB (64-bit offsets start "
      "above 4 GiB). Size each cache array at most 2 GiB or above 4 GiB (the KV-cache budget, "
      "--memory-gib)."
    )


def pow2_scale_exponent(amax: jax.Array) -> jax.Array:
  """``ceil(log2(max(amax, floor) / 448))`` exactly, by integer ops on the float32 bits.

  Integer arithmetic keeps the kernel and the reference bit-identical (no ``log2`` rounding).
  """
  r = jnp.maximum(amax.astype(jnp.float32), FP8_AMAX_FLOOR) / FP8_MAX
  bits = jax.lax.bitcast_convert_type(r, jnp.int32)
  exponent = ((bits >> 23) & 0xFF) - 127
  return exponent + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)


def exp2_int(e: jax.Array) -> jax.Array:
  """``2.0 ** e`` for int32 ``e`` in the normal float32 range, built from its bits."""
  return jax.lax.bitcast_convert_type((e + 127) << 23, jnp.float32)


def round_to_model_dtype(x: jax.Array, dtype) -> jax.Array:
  """float32 ``x`` rounded to ``dtype`` (bfloat16: by integer ops, ties to even; float32: as is),
  kept in float32.

  ``x.astype(bfloat16).astype(float32)`` is not kept on a GPU: XLA's excess-precision rewrite
  (``xla_allow_excess_precision``, on by default) drops the pair of converts, Triton does not, so
  the XLA path and a kernel would store different values.
  """
  x = x.astype(jnp.float32)
  if jnp.dtype(dtype) == jnp.float32:
    return x
  if jnp.dtype(dtype) != jnp.bfloat16:
    raise ValueError(f"model dtype must be bfloat16 or float32, got {jnp.dtype(dtype).name}.")
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & jnp.uint32(0xFFFF0000)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def round_to_e4m3(x: jax.Array) -> jax.Array:
  """float32 ``x`` (``|x| <= 448``) rounded to the nearest e4m3 value, ties to even, by integer ops.

  The conversion to fp8 after it is exact, so the stored byte does not depend on each backend's
  own float32-to-fp8 routine (XLA's and Triton's are separate code).
  """
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  mag = bits & 0x7FFFFFFF
  # Normal e4m3 (>= 2^-6): keep 3 of float32's 23 mantissa bits, ties to even.
  normal = (mag + 0x7FFFF + ((mag >> 20) & 1)) & jnp.uint32(0xFFF00000)
  # Subnormal e4m3 (< 2^-6): multiples of 2^-9, which a float32 sum at 2^14 rounds to.
  sub = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(mag, jnp.float32) + 16384.0, jnp.uint32)
  sub = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(sub, jnp.float32) - 16384.0, jnp.uint32)
  rounded = jnp.where(mag < 0x3C800000, sub, normal) | (bits & jnp.uint32(0x80000000))
  return jax.lax.bitcast_convert_type(rounded, jnp.float32)


def quantize_fp8_pow2(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Per-row fp8 e4m3 with one power-of-two fp32 scale: ``x ~= q * scale``.

  Args:
    x: float ``[..., D]``.
  Returns:
    ``q`` float8_e4m3fn ``[..., D]`` and ``scale`` float32 ``[..., 1]``.
  """
  x = x.astype(jnp.float32)
  e = pow2_scale_exponent(jnp.max(jnp.abs(x), axis=-1, keepdims=True))
  q = round_to_e4m3(jnp.clip(x * exp2_int(-e), -FP8_MAX, FP8_MAX)).astype(FP8_DTYPE)
  return q, exp2_int(e)


_UINT_OF_WIDTH = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def value_bytes(x: jax.Array) -> jax.Array:
  """Little-endian bytes of ``x[..., D]`` as uint8 ``[..., D * itemsize]``.

  Only same-width bitcasts and shifts: Pallas GPU kernels cannot bitcast across widths.
  """
  width = x.dtype.itemsize
  if width == 1:
    return jax.lax.bitcast_convert_type(x, jnp.uint8)
  bits = jax.lax.bitcast_convert_type(x, _UINT_OF_WIDTH[width]).astype(jnp.uint32)
  shifts = jnp.arange(width, dtype=jnp.uint32) * 8
  out = ((bits[..., None] >> shifts) & 0xFF).astype(jnp.uint8)
  return out.reshape(*x.shape[:-1], x.shape[-1] * width)


def f32_bytes(x: jax.Array) -> jax.Array:
  """Little-endian bytes of float32 ``x[...]`` as uint8 ``[..., 4]``."""
  return value_bytes(x.astype(jnp.float32)[..., None])


def without_ref(kernel, position: int):
  """``kernel`` taking one ref fewer: passes None at ``position`` (an optional operand left out)."""

  def wrapped(*refs):
    return kernel(*refs[:position], None, *refs[position:])

  return wrapped


def pow2_chunks(n: int) -> list[tuple[int, int]]:
  """``[(start, size)]`` covering ``[0, n)`` with power-of-two sizes (Triton block shapes)."""
  out, start = [], 0
  for bit in reversed(range(n.bit_length())):
    size = 1 << bit
    if n & size:
      out.append((start, size))
      start += size
  return out


def as_words(pages: jax.Array) -> jax.Array:
  """Pages ``[N, W]`` of 32-bit words as uint32: their uint8 bytes ``[N, 4W]`` bitcast (free on a
  GPU; XLA's CPU backend copies the whole array), or the words themselves."""
  if pages.dtype == jnp.uint32:
    return pages
  return jax.lax.bitcast_convert_type(pages.reshape(pages.shape[0], -1, 4), jnp.uint32)


def as_bytes(words: jax.Array, like: jax.Array) -> jax.Array:
  """``as_words``' inverse: the uint32 ``words`` in the dtype and shape of the pages ``like``."""
  if like.dtype == jnp.uint32:
    return words
  return jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(like.shape)


def _bytewise(pages: jax.Array) -> bool:
  # A whole arena's bitcast between widths is a copy on the CPU (82% of the tiny model's decode
  # step): there the rows are sliced as bytes and only the slices converted. On a GPU the bitcast
  # is free and the word view keeps each row's accesses 32 bits wide.
  return pages.dtype == jnp.uint8 and target_backend() == "cpu"


def _bytes_to_words(b: jax.Array) -> jax.Array:
  """uint8 ``[..., 4]`` -> uint32 ``[...]``, little-endian (``value_bytes``' inverse for words), by
  shifts, not a bitcast: XLA's CPU simplifier folds u8 -> u32 -> bf16 bitcasts into one
  ``u8[..., 4] -> bf16`` bitcast, which its verifier then rejects."""
  w = b.astype(jnp.uint32)
  return functools.reduce(jnp.bitwise_or, [w[..., i] << (8 * i) for i in range(4)])


def _gather_rows(a: jax.Array, rows: jax.Array, offset: int, n: int) -> jax.Array:
  """``a[rows[i], offset:offset + n]`` for ``a [N, W, ...]``: one contiguous slice per row."""
  corner = lambda r: (r, offset) + (0,) * (a.ndim - 2)
  return jax.vmap(lambda r: jax.lax.dynamic_slice(a, corner(r), (1, n, *a.shape[2:]))[0])(rows)


def _scatter_rows(a: jax.Array, rows: jax.Array, offset: int, values: jax.Array) -> jax.Array:
  """``a [N, W, ...]`` with ``a[rows[i], offset:offset + n] = values[i]``; a row out of range
  writes nothing (one windowed scatter: no index per element)."""
  idx = jnp.stack([rows, jnp.full_like(rows, offset)], axis=1)
  dnums = jax.lax.ScatterDimensionNumbers(
    update_window_dims=tuple(range(1, a.ndim)), inserted_window_dims=(0,), scatter_dims_to_operand_dims=(0, 1)
  )
  return jax.lax.scatter(a, idx, values, dnums, mode=jax.lax.GatherScatterMode.FILL_OR_DROP)


def read_rows(pages: jax.Array, rows: jax.Array, offset: int, n: int) -> jax.Array:
  """Words ``[offset, offset + n)`` of page rows ``rows`` (in range), uint32 ``[len(rows), n]``.
  ``pages``: uint32 ``[N, W]``, or the same words' bytes, uint8 ``[N, 4W]``."""
  if _bytewise(pages):
    return _bytes_to_words(_gather_rows(pages.reshape(pages.shape[0], -1, 4), rows, offset, n))
  return _gather_rows(as_words(pages), rows, offset, n)


def write_rows(pages: jax.Array, rows: jax.Array, offset: int, values: jax.Array) -> jax.Array:
  """``pages`` (as ``read_rows`` takes them) with words ``[offset, offset + n)`` of page row
  ``rows[i]`` set to ``values[i]`` (uint32 ``[len(rows), n]``); a row out of range writes nothing."""
  if _bytewise(pages):
    new = value_bytes(values).reshape(*values.shape, 4)
    return _scatter_rows(pages.reshape(pages.shape[0], -1, 4), rows, offset, new).reshape(pages.shape)
  return as_bytes(_scatter_rows(as_words(pages), rows, offset, values), pages)
