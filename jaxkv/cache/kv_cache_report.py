"""A KV-cache plan as text: the one renderer that ``jaxkv inspect`` and the engine both print."""

from __future__ import annotations

from jaxkv.cache.kv_cache_config import KVCacheConfig, _size

__all__ = ["render_plan"]


def _runs(rows: list[dict], keys: tuple[str, ...]):
  """Consecutive rows equal in ``keys`` folded into one, labelled ``first-last``."""
  start = 0
  for i in range(1, len(rows) + 1):
    if i == len(rows) or any(rows[i][k] != rows[start][k] for k in keys):
      yield (str(start) if i - 1 == start else f"{start}-{i - 1}"), rows[start]
      start = i


def render_plan(plan: KVCacheConfig, title: str = "") -> str:
  """The plan as the table ``jaxkv inspect`` prints; ``title`` describes the model's layers."""
  d = plan.describe()
  out = [f"KV-cache plan: {title + ', ' if title else ''}layout {plan.layout}"]
  scaled = "" if plan.block_size == plan.requested_block_size else f" (scaled up from {plan.requested_block_size})"
  out.append(f"  manager block size   {plan.block_size} tokens{scaled}")
  out.append(
    f"  bytes per block      {plan.bytes_per_block:,} ({_size(plan.bytes_per_block)}), stride alignment "
    f"{plan.stride_alignment_bytes:,} B"
  )
  out.append(
    f"  blocks               {plan.num_blocks:,} (block 0 is the null block), {_size(d['total_bytes'])} in all"
  )
  out.append(
    f"  token capacity       {plan.token_capacity:,} tokens; a {plan.max_model_len:,}-token request needs "
    f"{d['blocks_per_full_length_request']:,} blocks ({d['max_num_full_length_requests']} fit)"
  )
  out.append("")
  out.append(f"  {'groups':>7}  {'kind':<26}{'block':>7}{'layers':>8}{'page bytes':>14}{'table width':>13}")
  keys = ("kind", "manager_block_size", "num_layers", "page_size_bytes", "block_table_width")
  for ids, g in _runs(d["kv_cache_groups"], keys):
    out.append(
      f"  {ids:>7}  {g['kind']:<26}{g['manager_block_size']:>7}{g['num_layers']:>8}"
      f"{g['page_size_bytes']:>14,}{g['block_table_width']:>13,}"
    )
  out.append("")
  out.append(
    f"  {'attn grp':>8}  {'backend':<34}{'layers':>7}{'page B':>12}{'align B':>9}{'kernel':>8}{'bpk':>5}"
    f"{'stride':>8}{'kpage B':>10}"
  )
  rows = [
    {
      **ag,
      "n": len(ag["layers"]),
      "page": ag["kv_cache_spec"]["page_size_bytes"],
      "align": ag["kv_cache_spec"]["resolved_block_stride_alignment"],
    }
    for ag in d["attention_groups"]
  ]
  for ids, ag in _runs(rows, ("backend", "n", "page", "align", "kernel_block_size", "kernel_block_stride")):
    out.append(
      f"  {ids:>8}  {ag['backend']:<34}{ag['n']:>7}{ag['page']:>12,}{ag['align']:>9,}"
      f"{str(ag['kernel_block_size'] or '-'):>8}{ag['blocks_per_kernel_block']:>5}"
      f"{ag['kernel_block_stride']:>8,}{ag['kernel_page_bytes']:>10,}"
    )
  out.append("")
  split = lambda t: f" per device (split {t['shards']} ways by head)" if t.get("shards", 1) > 1 else ""
  tensors = ", ".join(f"{t['name']} uint8{t['shape']}{split(t)}" for t in d["tensors"][:4])
  more = f", ... ({len(d['tensors'])} in all)" if len(d["tensors"]) > 4 else ""
  out.append(f"  tensors: {tensors}{more}")
  return "\n".join(out) + "\n"
