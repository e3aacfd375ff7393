"""Exact top-k of long rows: the sampler's top log-probs over the vocabulary, in a few launches.

``jax.lax.top_k``'s answer (values decreasing, equal values in increasing index) by blocks: each
program takes ``block`` entries of a row and takes its top ``k`` out one at a time (``k`` rounds of
a max over the block's sort keys, then the least index holding it); the row's blocks' ``k`` each
are candidates for the next launch, until one block holds them all. Exact because an entry that
is not among its block's top ``k`` has ``k`` entries of the row above it.

Why not XLA: ``jax.lax.top_k`` with ``k > 16`` is a segmented radix sort of every row, and XLA's
top-k kernel (``k <= 16``) walks a whole row in one thread block; on the H200 the top 20 of
GLM-5.3-Flash's 154,880 log-probs took 0.39 ms of a batch-32 decode step that way (10% of it;
docs/performance.md). Here every block of every row is a program of its own.

Order: float32's total order on the bits (``-0.0`` below ``+0.0``, NaN above ``+inf``), the
order of the int32 sort key ``bits ^ ((bits >> 31) & 0x7FFFFFFF)``, which the kernel compares and
turns back into the exact input bits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float, Int

from pallas_kernels._common import default_interpret, resolve_implementation, without_ref

__all__ = ["top_k", "top_k_reference"]

# Below every key but one (the negative NaN of all-ones bits, which ties with it and then wins by
# its index): what a taken entry and a padding column become.
_KEY_MIN = -(2**31)
_ID_NONE = 2**31 - 1
MAX_K = 128


def sort_keys(x: Float[Array, "..."]) -> Int[Array, "..."]:
  """int32 keys whose signed order is float32's total order (an involution on the bits)."""
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
  return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def from_sort_keys(keys: Int[Array, "..."]) -> Float[Array, "..."]:
  return jax.lax.bitcast_convert_type(keys ^ ((keys >> 31) & 0x7FFFFFFF), jnp.float32)


def _take_top(keys, ids, k: int, width: int):
  """The top ``k`` (key, id) pairs of ``keys, ids [B]``, in order, padded to ``width``."""
  slot = jnp.arange(width, dtype=jnp.int32)

  def round_(i, carry):
    keys, ids, top_keys, top_ids = carry
    best = jnp.max(keys)
    at = jnp.min(jnp.where(keys == best, ids, _ID_NONE))
    taken = ids == at
    return (
      jnp.where(taken, _KEY_MIN, keys),
      jnp.where(taken, _ID_NONE, ids),
      jnp.where(slot == i, best, top_keys),
      jnp.where(slot == i, at, top_ids),
    )

  init = (keys, ids, jnp.full((width,), _KEY_MIN, jnp.int32), jnp.full((width,), _ID_NONE, jnp.int32))
  return jax.lax.fori_loop(0, k, round_, init)[2:]


def _block_top_k_kernel(x_ref, ids_ref, keys_out_ref, ids_out_ref, *, n: int, block: int, k: int, width: int):
  # x_ref: [R, n] float (the first launch) or int32 sort keys (later ones, with ids_ref [R, n]:
  # their row indices); keys_out_ref / ids_out_ref: [R, blocks * width], block j's top k at
  # columns j * width ...
  r, j = pl.program_id(0), pl.program_id(1)
  cols = j * block + jnp.arange(block, dtype=jnp.int32)
  inside = cols < n
  if ids_ref is None:
    x = pltriton.load(x_ref.at[r, pl.ds(j * block, block)], mask=inside, other=0)
    keys = jnp.where(inside, sort_keys(x), _KEY_MIN)
    ids = jnp.where(inside, cols, _ID_NONE)
  else:
    keys = pltriton.load(x_ref.at[r, pl.ds(j * block, block)], mask=inside, other=_KEY_MIN)
    ids = pltriton.load(ids_ref.at[r, pl.ds(j * block, block)], mask=inside, other=_ID_NONE)
  top_keys, top_ids = _take_top(keys, ids, k, width)
  keys_out_ref[r, pl.ds(j * width, width)] = top_keys
  ids_out_ref[r, pl.ds(j * width, width)] = top_ids


def _validate(x, k: int, block: int):
  if x.ndim < 1 or x.shape[-1] < 1:
    raise ValueError(f"x must be [..., N] with N >= 1, got shape {list(x.shape)}.")
  if x.dtype not in (jnp.float32, jnp.bfloat16):
    raise ValueError(f"x must be float32 or bfloat16 (compared exactly as float32), got {x.dtype}.")
  if not 1 <= k <= min(MAX_K, x.shape[-1]):
    raise ValueError(f"k must be in [1, min({MAX_K}, N={x.shape[-1]})], got {k}; for a larger k use jax.lax.top_k.")
  width = pl.next_power_of_2(k)
  if block & (block - 1) or block < 2 * width:
    raise ValueError(
      f"block must be a power of two of at least 2 * next_power_of_2(k) = {2 * width} (each block "
      f"must hand on fewer candidates than it reads), got {block}."
    )


@functools.partial(jax.jit, static_argnames=("k", "block", "last_block", "num_warps", "implementation", "interpret"))
def top_k(
  x: Float[Array, "... N"],
  k: int,
  *,
  block: int = 2048,
  last_block: int = 4096,
  num_warps: int = 4,
  implementation: str = "auto",
  interpret: bool | None = None,
) -> tuple[Float[Array, "... k"], Int[Array, "... k"]]:
  """``jax.lax.top_k(x, k)``: the ``k`` largest entries of each row, decreasing, equal values in
  increasing index (float32's total order on the bits; see the module docstring), and their int32
  indices.

  Args:
    x: float32 or bfloat16 ``[..., N]``.
    k: ``1 <= k <= min(MAX_K, N)``.
    block: entries per program of the launches that reduce a row to candidates (a power of two of
      at least ``2 * next_power_of_2(k)``).
    last_block: a row of at most this many entries (or candidates) is done by one program.
    num_warps: Triton's warps per program.
    implementation: ``"pallas"``, ``"xla"`` (``top_k_reference``) or ``"auto"`` (the kernel on a
      GPU, the reference elsewhere).

  Example:
    >>> values, ids = top_k(jax.nn.log_softmax(logits), 20)  # [R, 20] each
  """
  _validate(x, k, block)
  if resolve_implementation(implementation) == "xla" or x.size == 0:  # no rows: no program to launch
    return top_k_reference(x, k)
  lead, n = x.shape[:-1], x.shape[-1]
  keys = x.reshape(-1, n)
  ids = None
  width = pl.next_power_of_2(k)
  while True:
    rows, n = keys.shape
    b = pl.next_power_of_2(n) if n <= last_block else block
    b = max(b, 2 * width)
    blocks = pl.cdiv(n, b)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    kernel = functools.partial(_block_top_k_kernel, n=n, block=b, k=k, width=width)
    keys, ids = pl.pallas_call(
      kernel if ids is not None else without_ref(kernel, 1),
      out_shape=(jax.ShapeDtypeStruct((rows, blocks * width), jnp.int32),) * 2,
      grid=(rows, blocks),
      in_specs=[any_spec] * (1 if ids is None else 2),
      out_specs=(any_spec, any_spec),
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=default_interpret(interpret),
      name="top_k",
    )(*((keys,) if ids is None else (keys, ids)))
    if blocks == 1:
      break
  values = from_sort_keys(keys[:, :k]).astype(x.dtype)
  return values.reshape(*lead, k), ids[:, :k].reshape(*lead, k)


def top_k_reference(x: Float[Array, "... N"], k: int) -> tuple[Float[Array, "... k"], Int[Array, "... k"]]:
  """Plain jnp, same arguments: ``jax.lax.top_k``."""
  values, ids = jax.lax.top_k(x, k)
  return values, ids.astype(jnp.int32)
