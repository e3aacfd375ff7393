"""The least probability top-p and top-k sampling keep: the sampler's nucleus without a sort.

Token ``i`` of a row is kept iff ``probs[i] >= floor``: the tokens strictly more probable than it
hold less than ``top_p`` of the mass and (``top_k > 0``) number fewer than ``top_k``. Both limits
are monotone in the threshold, so a ``ways``-way search over the float32 bit patterns of ``[0, 2)``
(monotone for non-negative floats) finds the larger of their floors in ``30 / log2(ways)``
dependent passes of ``ways - 1`` masked sums (and counts) over the row.

Why a kernel: in XLA each pass is a launch over every row, and every row pays it, greedy rows too
(one executable for every batch, no host sync in the step): 10-15 dependent launches, 0.09-0.31 ms
of a decode step on the H200 with the rest of the sampler (docs/performance.md, "Where a step
goes"). Here one program takes a row through every pass (its row stays in L2 between passes), and
a row whose limits cannot bind (``top_p >= 1`` and no ``top_k`` below the vocabulary: the sampler
gives greedy rows these) writes its floor, 0, without reading the row: the search's own answer
there. A row's sums run in one order whatever the batch, so its floor does not depend on it.

``"xla"`` is the CPU path and the reference (``top_p_floor_reference``, the passes as fusions).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float, Int

from jaxkv.nucleus import check_ways, nucleus_floor
from pallas_kernels._common import default_interpret, resolve_implementation

__all__ = ["top_p_floor", "top_p_floor_reference"]


def _top_p_floor_kernel(probs_ref, top_p_ref, top_k_ref, floor_ref, *, ways: int, block: int):
  # probs_ref: [R, V] float32; top_p_ref: [R] float32; top_k_ref: [R] int32; floor_ref: [R].
  r, v = pl.program_id(0), probs_ref.shape[1]
  bits = ways.bit_length() - 1
  p_limit = jnp.where(top_p_ref[r] >= 1.0, jnp.inf, top_p_ref[r])
  k_limit = jnp.where(top_k_ref[r] > 0, top_k_ref[r], v + 1)
  binds = (p_limit < jnp.inf) | (k_limit <= v)  # a count of tokens above a threshold is at most V

  @pl.when(jnp.logical_not(binds))
  def _():
    floor_ref[r] = jnp.float32(0.0)

  @pl.when(binds)
  def _():
    # Lane j > 0 is the candidate lo + j * 2**shift (as the reference); lane 0 is lo itself, whose
    # side of the limits is known, and is left out.
    lane = jnp.arange(ways, dtype=jnp.int32)
    lo = jnp.int32(-1)
    for shift in range(30 - bits, -1, -bits):
      x = jax.lax.bitcast_convert_type(lo + (lane << shift), jnp.float32)

      def block_sums(j, acc, x=x):
        cols = j * block + jnp.arange(block, dtype=jnp.int32)
        p = pltriton.load(probs_ref.at[r, pl.ds(j * block, block)], mask=cols < v, other=0.0)
        above = p[None, :] > x[:, None]  # [ways, block]; padding (0) is above no candidate (>= 0)
        mass, count = acc
        return mass + jnp.sum(jnp.where(above, p[None, :], 0.0), axis=1), count + jnp.sum(
          above.astype(jnp.int32), axis=1
        )

      init = (jnp.zeros((ways,), jnp.float32), jnp.zeros((ways,), jnp.int32))
      mass, count = jax.lax.fori_loop(0, pl.cdiv(v, block), block_sums, init)
      reached = ((mass >= p_limit) | (count >= k_limit)) & (lane > 0)
      lo = lo + (jnp.sum(reached.astype(jnp.int32)) << shift)
    floor_ref[r] = jax.lax.bitcast_convert_type(lo + 1, jnp.float32)


def _validate(probs, top_p, top_k, ways, block):
  check_ways(ways)
  lead = probs.shape[:-1]
  if probs.ndim < 1 or probs.dtype != jnp.float32:
    raise ValueError(f"probs must be float32 [..., V], got {probs.dtype} {list(probs.shape)}.")
  for name, x in (("top_p", top_p), ("top_k", top_k)):
    if x is not None and x.shape != (*lead, 1):
      raise ValueError(f"{name} must be [..., 1] = {[*lead, 1]} for probs {list(probs.shape)}, got {list(x.shape)}.")
  if block < 1 or block & (block - 1):
    raise ValueError(f"block must be a power of two (Triton's vectors), got {block}.")


@functools.partial(jax.jit, static_argnames=("ways", "block", "num_warps", "implementation", "interpret"))
def top_p_floor(
  probs: Float[Array, "... V"],
  top_p: Float[Array, "... 1"],
  ways: int,
  top_k: Int[Array, "... 1"] | None = None,
  *,
  block: int = 1024,
  num_warps: int = 8,
  implementation: str = "auto",
  interpret: bool | None = None,
) -> Float[Array, "... 1"]:
  """The least kept probability of each row (``[..., 1]``): token ``i`` is kept iff
  ``probs[..., i] >= floor``.

  Args:
    probs: float32 ``[..., V]``, a distribution per row (non-negative).
    top_p: ``[..., 1]``; ``>= 1`` keeps every token. top_k: int ``[..., 1]``; ``<= 0`` (or None):
      off.
    ways: the search's width (2, 4, 8, 32 or 1024): ``30 / log2(ways)`` passes of ``ways - 1``
      candidates each; the same answer at every width.
    block: entries of a row a program sums at a time (a power of two); num_warps: Triton's.
    implementation: ``"pallas"``, ``"xla"`` (``top_p_floor_reference``) or ``"auto"``.
  """
  _validate(probs, top_p, top_k, ways, block)
  if resolve_implementation(implementation) == "xla" or probs.size == 0:
    return top_p_floor_reference(probs, top_p, ways, top_k)
  lead, v = probs.shape[:-1], probs.shape[-1]
  rows = probs.reshape(-1, v)
  r = rows.shape[0]
  k = jnp.zeros((r,), jnp.int32) if top_k is None else top_k.reshape(r).astype(jnp.int32)
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  floor = pl.pallas_call(
    functools.partial(_top_p_floor_kernel, ways=ways, block=block),
    out_shape=jax.ShapeDtypeStruct((r,), jnp.float32),
    grid=(r,),
    in_specs=[any_spec] * 3,
    out_specs=any_spec,
    compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
    interpret=default_interpret(interpret),
    name="top_p_floor",
  )(rows, top_p.reshape(r).astype(jnp.float32), k)
  return floor.reshape(*lead, 1)


def top_p_floor_reference(
  probs: Float[Array, "... V"], top_p: Float[Array, "... 1"], ways: int, top_k: Int[Array, "... 1"] | None = None
) -> Float[Array, "... 1"]:
  """Plain jnp, same arguments: ``jaxkv.nucleus.nucleus_floor``, the search's passes as XLA fusions
  over every row at once (the engine's path where the kernel does not run)."""
  return nucleus_floor(probs, top_p, ways, top_k)
