"""Step metadata in one launch: every group's slots and every attention group's kernel-block table.

From the step's manager-unit block tables, block counts, request indices and positions, one
Pallas (Triton-lowered) launch writes what ``jaxkv.step.step_metadata`` describes:

* the first ``(T / BT) * rows`` programs each take ``BT`` tokens and one slot row: manager-unit
  slots of a token group (padding and DCP as ``compute_slot_mapping``), ring slots of a circular
  buffer, or page-unit slots of a compressed cache. One row per program keeps each program's chain
  of dependent gathers short (counts, then table), which is what such a small launch waits on. A compressed cache's kernel page is computed
  from the manager table (``b * stride + j``), never read back from the kernel table this same
  launch is writing (its programs run in no fixed order);
* programs ``T/BT ..`` each take one block-table row and write it in kernel blocks into every
  mapped attention group's persistent buffer (aliased: donated and rewritten in place).

Every gather is bounded: a token's column ``p // block_size`` is read only when it is inside the
row and below the row's block count, and a padded or invalid token gets -1 (never a read past a
row). The formulas are ``jaxkv.step.slot_mapping``'s own (``token_slots``, ``circular_slots``,
``compressed_slots``), applied to refs. ``"xla"`` is the reference: the public jnp functions
(``compute_slot_mapping`` and friends, ``map_to_kernel_blocks``) one group at a time, which XLA
fuses into a few kernels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Int

from jaxkv.step.kernel_blocks import map_to_kernel_blocks
from jaxkv.step.slot_mapping import (
  circular_slots,
  compressed_slots,
  compute_circular_slot_mapping,
  compute_compressed_slot_mapping,
  compute_slot_mapping,
  split_block_lookup,
  token_slots,
)
from jaxkv.step.step_metadata import StepMetadata, StepMetadataSpec
from pallas_kernels._common import default_interpret, pow2_chunks, resolve_implementation

__all__ = ["compute_step_metadata", "compute_step_metadata_reference"]

# Tokens per program, and the widest vector a kernel-table program stores at once.
MAX_BLOCK_T = 64
MAX_ROW_CHUNK = 1024


def _slot_row(spec: StepMetadataSpec, output, tables, counts, req, pos):
  """One row of the stacked slot output for the tokens ``req, pos`` (arrays or refs as tables)."""
  kind, i = output
  if kind == "group":
    sg = spec.slot_groups[i]
    if sg.kind == "ring":
      return circular_slots(tables[i], req, pos, ring_size=sg.block_size)
    return token_slots(
      tables[i],
      counts[i],
      req,
      pos,
      block_size=sg.block_size,
      dcp_size=spec.dcp_size,
      dcp_rank=spec.dcp_rank,
      dcp_interleave=spec.dcp_interleave,
    )
  ag = spec.attention_groups[i]
  g = ag.kv_cache_group_id
  page_of = split_block_lookup(
    tables[g], counts[g], blocks_per_kernel_block=ag.blocks_per_kernel_block, stride=ag.stride
  )
  return compressed_slots(page_of, req, pos, states_per_page=ag.states_per_page, compress_ratio=ag.compress_ratio)


def _row_chunks(n: int) -> list[tuple[int, int]]:
  """``[(start, size)]`` covering ``[0, n)``: power-of-two sizes (Triton) of at most ``MAX_ROW_CHUNK``."""
  return [(s + a, size) for s in range(0, n, MAX_ROW_CHUNK) for a, size in pow2_chunks(min(MAX_ROW_CHUNK, n - s))]


def _step_metadata_kernel(
  *refs, spec: StepMetadataSpec, num_groups: int, num_mapped: int, block_t: int, num_token_programs: int
):
  # Program i < num_token_programs: token block i // rows, slot row i % rows; then one program
  # per block-table row.
  # refs: req [T], pos [T], tables[G] [R, W_g], counts[G] [R], kernel tables in[M] (aliased),
  # then slots [NS, T] and kernel tables out[M] [R, W_g * bpk].
  req_ref, pos_ref = refs[:2]
  tables = refs[2 : 2 + num_groups]
  counts = refs[2 + num_groups : 2 + 2 * num_groups]
  slots_ref = refs[2 + 2 * num_groups + num_mapped]
  kt_refs = refs[3 + 2 * num_groups + num_mapped :]
  i = pl.program_id(0)

  num_rows = len(spec.slot_outputs)
  for row, output in enumerate(spec.slot_outputs):

    @pl.when((i < num_token_programs) & (i % num_rows == row))
    def _tokens():
      sl = pl.ds((i // num_rows) * block_t, block_t)
      slots_ref[row, sl] = _slot_row(spec, output, tables, counts, req_ref[sl], pos_ref[sl])

  if num_mapped:

    @pl.when(i >= num_token_programs)
    def _kernel_tables():
      r = i - num_token_programs
      for kt_ref, a in zip(kt_refs, spec.mapped_groups):
        ag = spec.attention_groups[a]
        table, bpk = tables[ag.kv_cache_group_id], ag.blocks_per_kernel_block
        for start, size in _row_chunks(kt_ref.shape[1]):
          c = start + jnp.arange(size, dtype=jnp.int32)
          kt_ref[r, pl.ds(start, size)] = table[r, c // bpk] * ag.stride + c % bpk


def _validate(spec: StepMetadataSpec, block_tables, num_blocks, req_indices, positions, kernel_block_tables):
  g = len(spec.slot_groups)
  if len(block_tables) != g or len(num_blocks) != g:
    raise ValueError(
      f"the spec has {g} KV-cache groups; got {len(block_tables)} block tables and {len(num_blocks)} block counts."
    )
  if req_indices.ndim != 1 or req_indices.shape != positions.shape or req_indices.size == 0:
    raise ValueError(
      f"req_indices and positions must be int32[T] of one T >= 1, got {list(req_indices.shape)} "
      f"and {list(positions.shape)}."
    )
  for name, a in (("req_indices", req_indices), ("positions", positions)):
    if a.dtype != jnp.int32:
      raise ValueError(f"{name} must be int32, got {a.dtype}.")
  rows = block_tables[0].shape[0] if block_tables else 0
  for k, (t, n) in enumerate(zip(block_tables, num_blocks)):
    if t.ndim != 2 or t.dtype != jnp.int32 or t.shape[0] != rows or t.shape[1] < 1:
      raise ValueError(
        f"block table {k} must be int32[{rows}, width >= 1] (one row per request slot), got {t.dtype}{list(t.shape)}."
      )
    if n.shape != (rows,) or n.dtype != jnp.int32:
      raise ValueError(f"block counts {k} must be int32[{rows}], got {n.dtype}{list(n.shape)}.")
  if kernel_block_tables is None:
    return
  if len(kernel_block_tables) != len(spec.attention_groups):
    raise ValueError(
      f"the spec has {len(spec.attention_groups)} attention groups; got "
      f"{len(kernel_block_tables)} kernel-block table buffers."
    )
  for a, (ag, buf) in enumerate(zip(spec.attention_groups, kernel_block_tables)):
    if not ag.mapped:
      if buf is not None:
        raise ValueError(f"attention group {a} has no kernel split; its kernel-block table buffer must be None.")
      continue
    want = (rows, block_tables[ag.kv_cache_group_id].shape[1] * ag.blocks_per_kernel_block)
    if buf is None or buf.shape != want or buf.dtype != jnp.int32:
      got = "None" if buf is None else f"{buf.dtype}{list(buf.shape)}"
      raise ValueError(
        f"attention group {a}'s kernel-block table buffer must be int32{list(want)} "
        f"(KVCacheConfig.init_kernel_block_tables), got {got}."
      )


@functools.partial(
  jax.jit, static_argnames=("spec", "implementation", "interpret"), donate_argnames=("kernel_block_tables",)
)
def compute_step_metadata(
  block_tables: tuple[Int[Array, "R W"], ...],
  num_blocks: tuple[Int[Array, " R"], ...],
  req_indices: Int[Array, " T"],
  positions: Int[Array, " T"],
  kernel_block_tables: tuple[Int[Array, "R Wk"] | None, ...] | None = None,
  *,
  spec: StepMetadataSpec,
  implementation: str | None = None,
  interpret: bool | None = None,
) -> StepMetadata:
  """Every group's slots and every attention group's kernel-block table for one step.

  Args:
    block_tables: per KV-cache group, int32 ``[R, W_g]`` manager block ids.
    num_blocks: per KV-cache group, int32 ``[R]`` live blocks of each row.
    req_indices: int32 ``[T]`` block-table row of each token, -1 for padding.
    positions: int32 ``[T]`` absolute positions (any value in ``[0, 2**31)``).
    kernel_block_tables: per attention group, its persistent int32 ``[R, W_g * bpk]`` buffer
      (None where the group has no split), donated and rewritten; or None: no table is mapped
      (a draft step over the same block tables keeps the step's tables).
    spec: ``StepMetadataSpec.from_plan(plan)``.
    implementation: ``"pallas"`` (one launch), ``"xla"`` (the reference) or ``"auto"`` (the kernel
      on a GPU, the reference on the CPU); default: ``spec.implementation``.

  Returns:
    ``StepMetadata``; its kernel tables are all None when ``kernel_block_tables`` is None.

  Example:
    >>> spec = StepMetadataSpec.from_plan(plan)
    >>> meta = compute_step_metadata(tables, counts, req, pos, plan.init_kernel_block_tables(8), spec=spec)
  """
  _validate(spec, block_tables, num_blocks, req_indices, positions, kernel_block_tables)
  if resolve_implementation(implementation or spec.implementation) == "xla":
    return compute_step_metadata_reference(
      block_tables, num_blocks, req_indices, positions, kernel_block_tables, spec=spec
    )
  t = req_indices.shape[0]
  rows = block_tables[0].shape[0]
  mapped = spec.mapped_groups if kernel_block_tables is not None else ()
  block_t = min(MAX_BLOCK_T, t & -t)  # the largest power of two dividing T: no partial blocks
  num_token_programs = (t // block_t) * len(spec.slot_outputs)
  num_programs = num_token_programs + (rows if mapped else 0)
  ns = len(spec.slot_outputs)
  kt_in = [kernel_block_tables[a] for a in mapped]
  g = len(block_tables)
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  outs = [jax.ShapeDtypeStruct((max(ns, 1), t), jnp.int32)] + [jax.ShapeDtypeStruct(b.shape, b.dtype) for b in kt_in]
  results = ()
  if num_programs:
    results = pl.pallas_call(
      functools.partial(
        _step_metadata_kernel,
        spec=spec,
        num_groups=g,
        num_mapped=len(mapped),
        block_t=block_t,
        num_token_programs=num_token_programs,
      ),
      out_shape=tuple(outs),
      grid=(num_programs,),
      in_specs=[any_spec] * (2 + 2 * g + len(mapped)),
      out_specs=tuple([any_spec] * len(outs)),
      input_output_aliases={2 + 2 * g + m: 1 + m for m in range(len(mapped))},
      interpret=default_interpret(interpret),
      name="step_metadata",
    )(req_indices, positions, *block_tables, *num_blocks, *kt_in)
  rows_of = {out: results[0][k] for k, out in enumerate(spec.slot_outputs)}
  kts = dict(zip(mapped, results[1:]))
  return StepMetadata(
    tuple(rows_of.get(("group", i)) for i in range(g)),
    tuple(rows_of.get(("compressed", a)) for a in range(len(spec.attention_groups))),
    tuple(kts.get(a) for a in range(len(spec.attention_groups))),
    spec,
  )


def compute_step_metadata_reference(
  block_tables, num_blocks, req_indices, positions, kernel_block_tables=None, *, spec: StepMetadataSpec
) -> StepMetadata:
  """Plain jnp, same arguments: the public slot-mapping functions one group at a time, the compressed
  slots read from the mapped kernel table."""
  slots = []
  for g, sg in enumerate(spec.slot_groups):
    if sg.kind == "none":
      slots.append(None)
    elif sg.kind == "ring":
      slots.append(compute_circular_slot_mapping(block_tables[g], req_indices, positions, ring_size=sg.block_size))
    else:
      slots.append(
        compute_slot_mapping(
          block_tables[g],
          num_blocks[g],
          req_indices,
          positions,
          block_size=sg.block_size,
          dcp_size=spec.dcp_size,
          dcp_rank=spec.dcp_rank,
          dcp_interleave=spec.dcp_interleave,
        )
      )
  compressed, kts = [], []
  for a, ag in enumerate(spec.attention_groups):
    if not (ag.mapped or ag.compressed):
      compressed.append(None)
      kts.append(None)
      continue
    table, counts = block_tables[ag.kv_cache_group_id], num_blocks[ag.kv_cache_group_id]
    buf = kernel_block_tables[a] if kernel_block_tables is not None else None
    kt = map_to_kernel_blocks(table, ag.blocks_per_kernel_block, ag.stride, buf)
    compressed.append(
      compute_compressed_slot_mapping(
        kt,
        counts * ag.blocks_per_kernel_block,
        req_indices,
        positions,
        states_per_page=ag.states_per_page,
        compress_ratio=ag.compress_ratio,
      )
      if ag.compressed
      else None
    )
    kts.append(kt if ag.mapped and kernel_block_tables is not None else None)
  return StepMetadata(tuple(slots), tuple(compressed), tuple(kts), spec)
