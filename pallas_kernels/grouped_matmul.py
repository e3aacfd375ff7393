"""Grouped (ragged) matmul of the MoE: rows sorted by expert, each times its expert's weights.

``out[m] = lhs[m] @ rhs[g(m)]`` where rows are consecutive per group and ``group_sizes[g]`` counts
group ``g``'s rows (rows past ``sum(group_sizes)`` are zero). Weights are in the matmul's layout,
``[groups, K, N]`` (converted once at checkpoint load; HF's ``[out, in]`` lives only at the
checkpoint boundary), so no step transposes them.

Implementations (chosen by measurement, ``docs/performance.md`` and ``docs/kernels.md``):

* ``"pallas"``: the kernel below, for decode steps, a few rows per expert (vLLM's ``fused_moe``
  Triton kernel is the model): each group's rows in blocks of ``block_m`` (16), one program per
  (row block, ``block_n`` output columns) streaming that block's expert tile ``[K, block_n]``
  through a pipelined loop. Row blocks are listed in XLA from ``group_sizes`` (a static upper
  bound of them, the unused ones doing nothing), so only the routed experts' weights are read.
  A row's arithmetic is its own (one MMA row; the K loop in a fixed order), so a token's output
  does not depend on the other rows of its step.
* ``"tokamax"``: ``tokamax.ragged_dot``'s Pallas Mosaic GPU kernel for Hopper, for prefill-sized
  steps. It reads each routed expert's weights once (tiles of experts without rows do nothing)
  and materializes nothing beyond its output. Its tiles are 64 rows: at decode sizes it reads an
  expert's 1-8 rows as a 64-row tile and runs 64 x 64 output tiles through a 2-stage pipeline,
  about two thirds of the copy bandwidth (docs/performance.md). Shapes in the GPU's tuning table
  (``TUNING_DIR``, written by ``benchmarks/tune_moe.py``) run the tiling tokamax's autotuner timed
  fastest there instead of its heuristics' (1.7-1.8x faster at 8,192-token steps on an H100, and
  bitwise the same output).
* ``"xla"``: ``jax.lax.ragged_dot``. The CPU path and the tests' reference. On a GPU, XLA lowers it
  to a dense dot with the group axis folded into the contraction: it reads every expert's weights
  and at 16k rows of the released model tried to allocate 36 GiB (platform.md), so it is not a
  serving path there.
* ``"auto"``: on a GPU for bf16 / fp16 rows, ``"pallas"`` up to ``PALLAS_MAX_ROWS`` rows (decode
  buckets) and ``"tokamax"`` above where tokamax is installed (``pip install '.[cuda13]'``),
  else ``"pallas"``; ``"xla"`` elsewhere (float32 runs stay exact). The choice depends only on the
  call's static shape, so each token bucket runs one path and the bitwise claims, made within a
  bucket, hold.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import pathlib
import re

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float, Int

from jaxkv.gpu_target import target_backend
from pallas_kernels._common import MIN_DOT_ROWS, default_interpret, resolve_implementation

__all__ = [
  "PALLAS_MAX_ROWS",
  "grouped_matmul",
  "grouped_matmul_reference",
  "grouped_matmul_implementation",
  "prepare_grouped_matmul",
  "tokamax_tilings",
  "tuning_path",
]

IMPLEMENTATIONS = ("auto", "pallas", "tokamax", "xla")
# "auto" runs the Pallas kernel up to this many rows (tokens x experts per token: 256 is a decode
# step of 32 tokens with 8 experts each) and tokamax above (docs/kernels.md, "The MoE's grouped
# matmul").
PALLAS_MAX_ROWS = 256
# The Pallas kernel's tiling: rows of one expert per block (Triton's smallest dot tile), output
# columns and contraction per loop step, warps and pipeline stages (docs/kernels.md).
TILING = dict(block_m=MIN_DOT_ROWS, block_n=128, block_k=128, num_warps=4, num_stages=4)


def _grouped_matmul_kernel(
  group_ref, start_ref, rows_ref, lhs_ref, rhs_ref, out_ref, *, block_m, block_n, block_k, precision
):
  # group_ref / start_ref / rows_ref: [B] each row block's group (-1: rows past the groups, written
  # as zeros), first row and row count (0: an unused block); lhs_ref: [M, K]; rhs_ref: [G, K, N];
  # out_ref: [M, N]. Program (b, j): block b's rows times its group's columns j * block_n + [0, block_n).
  b, j = pl.program_id(0), pl.program_id(1)
  m, k = lhs_ref.shape
  n = out_ref.shape[1]
  g = group_ref[b]
  rows = start_ref[b] + jnp.arange(block_m, dtype=jnp.int32)
  live = jnp.arange(block_m, dtype=jnp.int32) < rows_ref[b]
  cols = j * block_n + jnp.arange(block_n, dtype=jnp.int32)
  col_in = cols < n
  ge = jnp.maximum(g, 0)

  def step(i, acc):
    ks = i * block_k + jnp.arange(block_k, dtype=jnp.int32)
    k_in = ks < k
    # Dead rows read row m - 1 (masked): every address stays inside.
    x = pltriton.load(
      lhs_ref.at[jnp.minimum(rows, m - 1)[:, None], ks[None, :]], mask=live[:, None] & k_in[None, :], other=0
    )
    w = pltriton.load(rhs_ref.at[ge, ks[:, None], cols[None, :]], mask=k_in[:, None] & col_in[None, :], other=0)
    return acc + jnp.dot(x, w, precision=precision, preferred_element_type=jnp.float32)

  # No branch around the loop (it would keep Triton from pipelining it): blocks of no group loop
  # zero times and store zeros, unused blocks store nothing.
  steps = jnp.where(g >= 0, jnp.int32(pl.cdiv(k, block_k)), jnp.int32(0))
  acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((block_m, block_n), jnp.float32))
  pltriton.store(
    out_ref.at[rows[:, None], cols[None, :]], acc.astype(out_ref.dtype), mask=live[:, None] & col_in[None, :]
  )


def _inclusive_sum(x: Int[Array, " G"]) -> Int[Array, " G"]:
  """``cumsum(x)`` of a short integer vector as one masked row sum over ``[G, G]``, a plain
  reduction. jax 0.11.2 lowers ``jnp.cumsum`` on the GPU to a blocked scan of ``reduce_window``s
  (288 groups: ``[18, 16]``, ``[2, 16]``, ``[3, 1]``); with two chained here they made a 35.7 us
  kernel once per MoE layer, 0.071 ms of a batch-1 step's 1.745 on an H100 (docs/kernels.md).
  Integer sums: exact in any order."""
  g = x.shape[0]
  upto = jnp.arange(g, dtype=jnp.int32)[:, None] >= jnp.arange(g, dtype=jnp.int32)[None, :]
  return jnp.sum(jnp.where(upto, x[None, :], 0), axis=1, dtype=x.dtype)


def _row_blocks(group_sizes: Int[Array, " G"], m: int, block_m: int):
  """Each row block's ``(group, first row, rows)``, ``[B]`` int32 each: every group's rows in blocks
  of ``block_m``, then the rows past the groups (group -1), then unused blocks (0 rows). ``B = min(G,
  m) + m // block_m + cdiv(m, block_m)`` bounds the count for any sizes summing to at most ``m``:
  a group of ``s > 0`` rows takes ``ceil(s / block_m) <= s // block_m + 1`` blocks."""
  g = group_sizes.shape[0]
  num_blocks = min(g, m) + m // block_m + pl.cdiv(m, block_m)
  sizes = jnp.clip(group_sizes.astype(jnp.int32), 0, m)  # rows past m belong to no output
  group_end = jnp.minimum(_inclusive_sum(sizes), m)
  sizes = group_end - jnp.concatenate([jnp.zeros(1, jnp.int32), group_end[:-1]])
  group_first = group_end - sizes
  blocks = (sizes + block_m - 1) // block_m
  blocks_end = _inclusive_sum(blocks)
  b = jnp.arange(num_blocks, dtype=jnp.int32)
  # g for blocks past the groups. All comparisons at once (G x B, one fusion): the default binary
  # search is a loop of small kernels, six calls a decode step.
  grp = jnp.searchsorted(blocks_end, b, side="right", method="compare_all").astype(jnp.int32)
  in_groups = grp < g
  gc = jnp.minimum(grp, g - 1)
  local = b - (blocks_end[gc] - blocks[gc])  # the block's index within its group
  start = group_first[gc] + local * block_m
  rows = jnp.clip(sizes[gc] - local * block_m, 0, block_m)
  # Past the groups: the rest of the m rows, zeros.
  tail = b - blocks_end[-1]
  tail_start = group_end[-1] + tail * block_m
  tail_rows = jnp.clip(m - tail_start, 0, block_m)
  return (
    jnp.where(in_groups, grp, -1),
    jnp.where(in_groups, start, tail_start),
    jnp.where(in_groups, rows, tail_rows),
  )


def _check_tiling(tiling: dict) -> dict:
  unknown = set(tiling) - set(TILING)
  if unknown:
    raise ValueError(f"tiling keys {sorted(unknown)} are not the Pallas kernel's; it takes {sorted(TILING)}.")
  t = {**TILING, **tiling}
  for key in ("block_m", "block_n", "block_k"):
    v = t[key]
    if v < MIN_DOT_ROWS or v & (v - 1):
      raise ValueError(f"tiling {key}={v} must be a power of two >= {MIN_DOT_ROWS} (Triton's dot tiles).")
  return t


# Jitted: the MoE's calls of one shape are one function in the step's program.
@functools.partial(jax.jit, static_argnames=("tiling", "interpret"))
def _grouped_matmul_pallas(lhs, rhs, group_sizes, tiling: tuple, interpret):
  m, k = lhs.shape
  n = rhs.shape[2]
  t = _check_tiling(dict(tiling))
  # Tiles no larger than the matrices need (powers of two, at least Triton's 16).
  bn = min(t["block_n"], max(MIN_DOT_ROWS, pl.next_power_of_2(n)))
  bk = min(t["block_k"], max(MIN_DOT_ROWS, pl.next_power_of_2(k)))
  group, start, rows = _row_blocks(group_sizes, m, t["block_m"])
  exact = lhs.dtype == jnp.float32
  return pl.pallas_call(
    functools.partial(
      _grouped_matmul_kernel,
      block_m=t["block_m"],
      block_n=bn,
      block_k=bk,
      precision=jax.lax.Precision.HIGHEST if exact else None,
    ),
    out_shape=jax.ShapeDtypeStruct((m, n), lhs.dtype),
    grid=(group.shape[0], pl.cdiv(n, bn)),
    in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * 5,
    out_specs=pl.BlockSpec(memory_space=pl.ANY),
    compiler_params=pltriton.CompilerParams(num_warps=t["num_warps"], num_stages=t["num_stages"]),
    interpret=default_interpret(interpret),
    name="grouped_matmul",
  )(group, start, rows, lhs, rhs)


# The tiling tokamax's autotuner timed fastest for each of this MoE's shapes, one file per GPU kind
# (benchmarks/tune_moe.py), as vLLM ships its fused_moe configs.
TUNING_DIR = pathlib.Path(__file__).parent / "tuning"


@functools.cache
def _tokamax_available() -> bool:
  return importlib.util.find_spec("tokamax") is not None


def tuning_path(device_kind: str) -> pathlib.Path:
  """The tuning table of ``device_kind``: ``tokamax_ragged_dot_nvidia_h100_80gb_hbm3.json``."""
  return TUNING_DIR / f"tokamax_ragged_dot_{re.sub(r'[^a-z0-9]+', '_', device_kind.lower()).strip('_')}.json"


@functools.cache
def tokamax_tilings(device_kind: str) -> dict[tuple[int, int, int, int], dict]:
  """``(groups, rows, K, N)`` -> the fields of tokamax's ragged-dot ``Config`` timed fastest at that
  shape on ``device_kind`` (JSON, parsed, never executed); empty where the GPU has no table."""
  path = tuning_path(device_kind)
  if not path.exists():
    return {}
  try:
    table = json.loads(path.read_text())
    if table["device_kind"] != device_kind:
      raise ValueError(f"its device_kind is {table['device_kind']!r}")
    return {(int(s["groups"]), int(s["rows"]), int(s["k"]), int(s["n"])): dict(s["config"]) for s in table["shapes"]}
  except (ValueError, KeyError, TypeError) as e:
    raise RuntimeError(
      f"{path} is not a tuning table for {device_kind!r} ({type(e).__name__}: {e}): rerun "
      "benchmarks/tune_moe.py on that GPU, or delete the file to run tokamax's heuristics."
    ) from e


def grouped_matmul_implementation(implementation: str, dtype=jnp.bfloat16, rows: int | None = None) -> str:
  """The path a call of ``rows`` rows (None: any size, as a prefill step's) runs as for
  ``implementation`` (the module docstring: ``"auto"`` picks by dtype, backend and rows)."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}.")
  if implementation == "tokamax" and not _tokamax_available():
    raise ValueError(
      "implementation='tokamax' needs the tokamax package (pip install tokamax, or the '.[cuda13]' extra); "
      "use 'pallas' or 'xla'."
    )
  if implementation in ("pallas", "tokamax"):
    kernel = implementation
  else:  # auto's kernel, by the call's rows
    small = rows is not None and rows <= PALLAS_MAX_ROWS
    kernel = "pallas" if small or not _tokamax_available() else "tokamax"
  half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
  return resolve_implementation(implementation, kernel=kernel, runs_here=half and target_backend() in ("gpu", "cuda"))


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
  interpret: bool | None = None,
) -> Float[Array, "M N"]:
  """``lhs`` rows grouped by ``group_sizes`` times their group's ``rhs`` matrix, in ``lhs.dtype``.

  Args:
    lhs: ``[M, K]`` rows sorted by group.
    rhs: ``[G, K, N]`` one matrix per group.
    group_sizes: int32 ``[G]`` rows per group (``sum <= M``; rows past the groups are zeros).
    precision: the dot precision (the XLA path; the CPU reference runs HIGHEST).
    implementation: ``"auto"``, ``"pallas"``, ``"tokamax"`` or ``"xla"`` (the module docstring).
    tiling: the kernel's tiling, for tuning (``benchmarks/kernels.py --sweep --only
      grouped_matmul``; None: the defaults, or for ``"tokamax"`` the GPU's tuning table's tiling
      of this shape): for ``"pallas"`` keys of ``TILING``, for ``"tokamax"`` fields of its
      ``PallasMosaicRaggedDotConfig``.
    interpret: the Pallas kernel in interpret mode (None: on the CPU).

  Example:
    >>> gate = grouped_matmul(rows_by_expert, w_gate, tokens_per_expert)  # [M, 4096] x [288, 4096, 2048]
  """
  if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
    raise ValueError(f"lhs [M, K] and rhs [G, K, N] must agree in K, got {list(lhs.shape)} and {list(rhs.shape)}.")
  if group_sizes.shape != rhs.shape[:1] or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise ValueError(f"group_sizes must be int[{rhs.shape[0]}], got {group_sizes.dtype}{list(group_sizes.shape)}.")
  if rhs.shape[0] == 0:
    raise ValueError(f"rhs {list(rhs.shape)} holds no group: the MoE needs at least one expert.")
  impl = grouped_matmul_implementation(implementation, lhs.dtype, rows=lhs.shape[0])
  if tiling is not None and impl == "xla":
    raise ValueError(
      f"tiling {tiling} is for a kernel, but this call runs 'xla' (implementation={implementation!r}, "
      f"{lhs.dtype} rows, {target_backend()}): drop tiling, or ask for 'pallas' or 'tokamax'."
    )
  rhs = rhs.astype(lhs.dtype)
  if lhs.shape[0] == 0:  # no rows: nothing to launch
    return jnp.zeros((0, rhs.shape[2]), lhs.dtype)
  if impl == "pallas":
    return _grouped_matmul_pallas(lhs, rhs, group_sizes, tuple(sorted((tiling or {}).items())), interpret)
  if impl == "tokamax":
    import tokamax

    kernel = "mosaic"
    if tiling is None:  # this GPU's timed tiling for the shape, if any (else tokamax's heuristics)
      tiling = tokamax_tilings(jax.devices()[0].device_kind).get((rhs.shape[0], *lhs.shape, rhs.shape[2]))
    if tiling is not None:
      # tokamax.ops.gpu re-exports these, but imports its Triton kernels with them (the triton and
      # jax-triton packages). Its public overlay of the autotuning cache (tokamax.AutotuningResult as
      # a context) never matches this op in tokamax 0.0.17: each instance gets a fresh vjp lambda, so
      # no two compare equal, and the engine missed every entry on an H100 (docs/kernels.md).
      from tokamax._src.ops.ragged_dot.pallas_mosaic_gpu import Config, PallasMosaicGpuRaggedDot

      kernel = PallasMosaicGpuRaggedDot(config=Config(**tiling))
    # tokamax's Mosaic GPU kernel takes rows in multiples of 8 (67 rows raised "dimension 0 must
    # have size smaller or a multiple of its tiling 8" on an H100): the pad rows fall past the
    # groups and are cut off, and no other row's arithmetic changes. The model's rows (tokens x 8
    # experts) need none, so its step has no pad or slice.
    m = lhs.shape[0]
    pad = -m % 8
    out = tokamax.ragged_dot(
      jnp.pad(lhs, ((0, pad), (0, 0))) if pad else lhs,
      rhs,
      group_sizes.astype(jnp.int32),
      preferred_element_type=lhs.dtype,
      implementation=(kernel,),
    )
    return out[:m] if pad else out
  return jax.lax.ragged_dot(lhs, rhs, group_sizes, precision=precision)


def grouped_matmul_reference(lhs, rhs, group_sizes):
  """The definition, row by row: each row times its group's matrix (float32; tests only)."""
  ends = jnp.cumsum(group_sizes)
  group = jnp.searchsorted(ends, jnp.arange(lhs.shape[0]), side="right")  # G for rows past the end
  w = jnp.take(rhs, jnp.minimum(group, rhs.shape[0] - 1), axis=0).astype(jnp.float32)
  out = jnp.einsum("mk,mkn->mn", lhs.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
  return jnp.where((group < rhs.shape[0])[:, None], out, 0.0)
