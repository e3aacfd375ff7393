"""mHC mixing weights: each token's ``(2 + n) * n`` mixing logits to its pre, post and comb weights.

For each token (``n`` streams; ``mixed`` is its mHC projection, ``scale [3]`` and ``base`` the
learned affine):

    pre  = sigmoid(mixed[:n] * scale[0] + base[:n]) + eps                 [n]
    post = 2 * sigmoid(mixed[n:2n] * scale[1] + base[n:2n])               [n]
    comb = softmax over each row of (mixed[2n:] * scale[2] + base[2n:]) + eps, then its
           columns normalized, then ``iters - 1`` Sinkhorn rounds (rows, then columns)  [n, n]

Why a kernel: the weights are a few dozen numbers a token, but the Sinkhorn rounds are 2 x 19
dependent reductions over axes of 4, which XLA's GPU fusions cut into many small kernels: on the
H200 the mHC was 262 kernels and 2.19 ms of a 2,048-token prefill step and 71 kernels of a batch-1
decode step (docs/performance.md, "Where a step goes"). Here a program keeps a block of tokens'
weights in registers through every round: one launch a call. No sum runs across tokens, so a
token's weights are bitwise the same in any batch and any block.

``"xla"`` is the CPU path and the reference (the model's ``HyperConnection`` calls it).
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float

from jaxkv.gpu_target import target_backend
from pallas_kernels._common import default_interpret, resolve_implementation

__all__ = ["mhc_mix", "mhc_mix_reference"]


def _normalize_rows(comb, eps):
  """``comb [n][n]`` (lists of per-token vectors): each row over its sum + eps."""
  return [[x / (functools.reduce(operator.add, row) + eps) for x in row] for row in comb]


def _normalize_columns(comb, eps):
  sums = [functools.reduce(operator.add, column) + eps for column in zip(*comb)]
  return [[x / s for x, s in zip(row, sums)] for row in comb]


def _mhc_mix_kernel(mixed_ref, scale_ref, base_ref, pre_ref, post_ref, comb_ref, *, n, eps, iters, block):
  # mixed_ref: [T, (2 + n) * n]; scale_ref: [3]; base_ref: [(2 + n) * n]; pre_ref / post_ref:
  # [T, n]; comb_ref: [T, n * n]. Each weight is a [block] vector over this program's tokens.
  at = pl.ds(pl.program_id(0) * block, block)
  inside = pl.program_id(0) * block + jnp.arange(block, dtype=jnp.int32) < mixed_ref.shape[0]

  def logits(c):  # column c of the affine logits; scale[0] / [1] / [2]: pre / post / comb columns
    # A column index as an array: a Python int is not an indexer interpret mode discharges.
    x = pltriton.load(mixed_ref.at[at, jnp.int32(c)], mask=inside, other=0.0)
    return x * scale_ref[min(c // n, 2)] + base_ref[c]

  def put(ref, c, x):
    pltriton.store(ref.at[at, jnp.int32(c)], x, mask=inside)

  for i in range(n):
    put(pre_ref, i, jax.nn.sigmoid(logits(i)) + eps)
    put(post_ref, i, 2.0 * jax.nn.sigmoid(logits(n + i)))
  comb = []
  for i in range(n):  # softmax of row i, as jax.nn.softmax: exp(x - max) / sum
    row = [logits(2 * n + i * n + j) for j in range(n)]
    top = functools.reduce(jnp.maximum, row)
    e = [jnp.exp(x - top) for x in row]
    total = functools.reduce(operator.add, e)
    comb.append([x / total + eps for x in e])
  comb = _normalize_columns(comb, eps)

  def sinkhorn_round(_, flat):  # a loop, not unrolled: one round's code (interpret mode compiles it once)
    rows = [list(flat[i * n : (i + 1) * n]) for i in range(n)]
    return tuple(x for row in _normalize_columns(_normalize_rows(rows, eps), eps) for x in row)

  flat = jax.lax.fori_loop(0, iters - 1, sinkhorn_round, tuple(x for row in comb for x in row))
  comb = [flat[i * n : (i + 1) * n] for i in range(n)]
  for i in range(n):
    for j in range(n):
      put(comb_ref, i * n + j, comb[i][j])


def _validate(mixed, scale, base, n, iters, block):
  if n < 1 or iters < 0:
    raise ValueError(f"n must be >= 1 and iters >= 0, got n={n}, iters={iters}.")
  width = (2 + n) * n
  if mixed.ndim < 1 or mixed.shape[-1] != width:
    raise ValueError(f"mixed must be [..., (2 + n) * n = {width}] for n = {n}, got shape {list(mixed.shape)}.")
  if scale.shape != (3,) or base.shape != (width,):
    raise ValueError(f"scale must be [3] and base [{width}], got {list(scale.shape)} and {list(base.shape)}.")
  if block < 1 or block & (block - 1):
    raise ValueError(f"block must be a power of two (Triton's vectors), got {block}.")


@functools.partial(jax.jit, static_argnames=("n", "eps", "iters", "block", "num_warps", "implementation", "interpret"))
def mhc_mix(
  mixed: Float[Array, "... C"],
  scale: Float[Array, " 3"],
  base: Float[Array, " C"],
  *,
  n: int,
  eps: float,
  iters: int,
  block: int = 128,
  num_warps: int = 4,
  implementation: str = "auto",
  interpret: bool | None = None,
) -> tuple[Float[Array, "... N"], Float[Array, "... N"], Float[Array, "... N N"]]:
  """The mHC's ``(pre [..., n], post [..., n], comb [..., n, n])`` weights, float32.

  Args:
    mixed: ``[..., C]`` with ``C = (2 + n) * n``: each token's mHC projection (float32).
    scale: ``[3]``, the pre, post and comb logits' scales; base: ``[C]``, their offsets.
    n: streams. eps: the mHC's epsilon (``hc_eps``). iters: Sinkhorn iterations
      (``hc_sinkhorn_iters``; the first is the column normalization after the softmax).
    block: tokens a program (a power of two); num_warps: Triton's warps a program.
    implementation: ``"pallas"``, ``"xla"`` (``mhc_mix_reference``) or ``"auto"``.

  Example:
    >>> pre, post, comb = mhc_mix(mixed, hc.scale, hc.base, n=4, eps=1e-6, iters=20)
  """
  _validate(mixed, scale, base, n, iters, block)
  mixed, scale, base = (x.astype(jnp.float32) for x in (mixed, scale, base))
  if resolve_implementation(implementation) == "xla" or mixed.size == 0:  # no tokens: nothing to launch
    return mhc_mix_reference(mixed, scale, base, n=n, eps=eps, iters=iters)
  lead = mixed.shape[:-1]
  flat = mixed.reshape(-1, mixed.shape[-1])
  t = flat.shape[0]
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  pre, post, comb = pl.pallas_call(
    functools.partial(_mhc_mix_kernel, n=n, eps=eps, iters=iters, block=block),
    out_shape=(
      jax.ShapeDtypeStruct((t, n), jnp.float32),
      jax.ShapeDtypeStruct((t, n), jnp.float32),
      jax.ShapeDtypeStruct((t, n * n), jnp.float32),
    ),
    grid=(pl.cdiv(t, block),),
    in_specs=[any_spec] * 3,
    out_specs=(any_spec,) * 3,
    compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
    interpret=default_interpret(interpret),
    name="mhc_mix",
  )(flat, scale, base)
  return pre.reshape(*lead, n), post.reshape(*lead, n), comb.reshape(*lead, n, n)


def mhc_mix_reference(
  mixed: Float[Array, "... C"], scale: Float[Array, " 3"], base: Float[Array, " C"], *, n: int, eps: float, iters: int
) -> tuple[Float[Array, "... N"], Float[Array, "... N"], Float[Array, "... N N"]]:
  """Plain jnp, same arguments (the whole-sequence model's mHC: HF's ``Glm5NextHyperConnection``)."""
  pre = jax.nn.sigmoid(mixed[..., :n] * scale[0] + base[:n]) + eps
  post = 2.0 * jax.nn.sigmoid(mixed[..., n : 2 * n] * scale[1] + base[n : 2 * n])
  comb = mixed[..., 2 * n :].reshape(*mixed.shape[:-1], n, n) * scale[2] + base[2 * n :].reshape(n, n)
  comb = jax.nn.softmax(comb, axis=-1) + eps
  comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + eps)
  if target_backend() == "cpu":
    # XLA:CPU compiles each unrolled iteration into fusions of its own: a loop makes a step
    # compile about a quarter faster (the suite and notebooks run here). Same operations.
    comb = jax.lax.fori_loop(0, iters - 1, lambda _, c: _sinkhorn_step(c, eps), comb)
  else:
    for _ in range(iters - 1):
      comb = _sinkhorn_step(comb, eps)
  return pre, post, comb


def _sinkhorn_step(comb, eps):
  """One Sinkhorn iteration: rows, then columns, normalized to sum to one."""
  comb = comb / (jnp.sum(comb, axis=-1, keepdims=True) + eps)
  return comb / (jnp.sum(comb, axis=-2, keepdims=True) + eps)
