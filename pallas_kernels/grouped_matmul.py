"""Grouped (ragged) matmul of the MoE: rows sorted by expert, each times its expert's weights.

``out[m] = lhs[m] @ rhs[g(m)]`` where rows are consecutive per group and ``group_sizes[g]`` counts
group ``g``'s rows (rows past ``sum(group_sizes)`` are zero). Weights are in the matmul's layout,
``[groups, K, N]`` (converted once at checkpoint load; HF's ``[out, in]`` lives only at the
checkpoint boundary), so no step transposes them.

Implementations (chosen by measurement, ``docs/performance.md``):

* ``"tokamax"``: ``tokamax.ragged_dot``'s Pallas Mosaic GPU kernel for Hopper. It reads each routed
  expert's weights once (tiles of experts without rows do nothing) and materializes nothing
  beyond its output, at every token count.
* ``"xla"``: ``jax.lax.ragged_dot``. The CPU path and the tests' reference. On a GPU, XLA lowers it
  to a dense dot with the group axis folded into the contraction: it reads every expert's weights
  and at 16k rows of the released model tried to allocate 36 GiB (platform.md), so it is not a
  serving path there.
* ``"auto"``: ``"tokamax"`` for bf16 / fp16 rows on a GPU where tokamax is installed
  (``pip install '.[cuda13]'``), else ``"xla"`` (float32 runs stay exact).
"""

from __future__ import annotations

import functools
import importlib.util
import warnings

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels._common import resolve_implementation
from jaxkv.gpu_target import target_backend

__all__ = [
  "grouped_matmul",
  "grouped_matmul_reference",
  "grouped_matmul_implementation",
  "prepare_grouped_matmul",
]


@functools.cache
def _tokamax_available() -> bool:
  return importlib.util.find_spec("tokamax") is not None


@functools.cache  # once per process
def _warn_no_tokamax() -> None:
  warnings.warn(
    "the MoE's grouped matmul runs as XLA's ragged_dot on this GPU because tokamax is not "
    "installed; ragged_dot reads every expert's weights each step (4.5x slower decode at batch 1 "
    "on the H200, docs/performance.md). Install the '.[cuda13]' or '.[cuda12]' extra.",
    RuntimeWarning,
    stacklevel=3,
  )


def grouped_matmul_implementation(implementation: str, dtype=jnp.bfloat16) -> str:
  """The path ``implementation`` runs as, by ``resolve_implementation``: tokamax's kernel runs here
  for bf16 / fp16 on a GPU with tokamax installed (float32 stays on the exact XLA path)."""
  if implementation == "tokamax" and not _tokamax_available():
    raise ValueError(
      "implementation='tokamax' needs the tokamax package (pip install tokamax, or the '.[cuda13]' extra); use 'xla'."
    )
  half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
  kernel_fits = half and target_backend() in ("gpu", "cuda")
  if implementation == "auto" and kernel_fits and not _tokamax_available():
    _warn_no_tokamax()
  return resolve_implementation(implementation, kernel="tokamax", runs_here=kernel_fits and _tokamax_available())


def prepare_grouped_matmul(implementation: str = "auto", dtype=jnp.bfloat16) -> str:
  """Resolves the implementation and imports tokamax when it will run. Call it before the first
  jitted step is traced: tokamax defines JAX config options on import, which changes jit's tracing
  context, so an executable compiled before the import is never found again (measured: the first
  step shape compiled twice, once inside serving)."""
  impl = grouped_matmul_implementation(implementation, dtype)
  if impl == "tokamax":
    import tokamax  # noqa: F401

  return impl


def grouped_matmul(
  lhs: Float[Array, "M K"],
  rhs: Float[Array, "G K N"],
  group_sizes: Int[Array, " G"],
  *,
  precision=None,
  implementation: str = "auto",
  tiling: dict | None = None,
) -> Float[Array, "M N"]:
  """``lhs`` rows grouped by ``group_sizes`` times their group's ``rhs`` matrix, in ``lhs.dtype``.

  Args:
    lhs: ``[M, K]`` rows sorted by group.
    rhs: ``[G, K, N]`` one matrix per group.
    group_sizes: int32 ``[G]`` rows per group (``sum <= M``).
    precision: the dot precision (the XLA path; the CPU reference runs HIGHEST).
    implementation: ``"auto"``, ``"tokamax"`` or ``"xla"``.
    tiling: fields of tokamax's ``PallasMosaicRaggedDotConfig`` for its kernel (tuning:
      ``benchmarks/kernels.py --sweep --only grouped_matmul``; None: tokamax's choice).
  """
  if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
    raise ValueError(f"lhs [M, K] and rhs [G, K, N] must agree in K, got {list(lhs.shape)} and {list(rhs.shape)}.")
  if group_sizes.shape != rhs.shape[:1] or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise ValueError(f"group_sizes must be int[{rhs.shape[0]}], got {group_sizes.dtype}{list(group_sizes.shape)}.")
  impl = grouped_matmul_implementation(implementation, lhs.dtype)
  if tiling is not None and impl != "tokamax":
    raise ValueError(
      f"tiling {tiling} is for tokamax's kernel, but this call runs {impl!r} (implementation="
      f"{implementation!r}, {lhs.dtype} rows, {target_backend()}): drop tiling, or run bf16 rows "
      "on a GPU with tokamax."
    )
  rhs = rhs.astype(lhs.dtype)
  if impl == "tokamax":
    import tokamax

    kernel = "mosaic"
    if tiling is not None:  # tuning only: serving never reaches tokamax's private module
      # tokamax.ops.gpu re-exports these, but imports its Triton kernels (and jax_triton) with them.
      from tokamax._src.ops.ragged_dot.pallas_mosaic_gpu import Config, PallasMosaicGpuRaggedDot

      kernel = PallasMosaicGpuRaggedDot(config=Config(**tiling))
    return tokamax.ragged_dot(
      lhs, rhs, group_sizes.astype(jnp.int32), preferred_element_type=lhs.dtype, implementation=(kernel,)
    )
  return jax.lax.ragged_dot(lhs, rhs, group_sizes, precision=precision)


def grouped_matmul_reference(lhs, rhs, group_sizes):
  """The definition, row by row: each row times its group's matrix (float32; tests only)."""
  ends = jnp.cumsum(group_sizes)
  group = jnp.searchsorted(ends, jnp.arange(lhs.shape[0]), side="right")  # G for rows past the end
  w = jnp.take(rhs, jnp.minimum(group, rhs.shape[0] - 1), axis=0).astype(jnp.float32)
  out = jnp.einsum("mk,mkn->mn", lhs.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
  return jnp.where((group < rhs.shape[0])[:, None], out, 0.0)
