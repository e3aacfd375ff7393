"""One manager block of a plan, drawn: each group's layer pages, their kernel pages, alignment padding.

A block id names the same bytes in every layer of the group that holds it. In the packed layout
those bytes are one row of the arena, and every group lays its layers' pages out in that row at
stride-aligned offsets (the gaps are the alignment padding); in the dense layout each layer has its
own array and the block is one row of each. A split layer's page is cut into kernel pages
(``b * stride + j``). ``jaxkv inspect --plot FILE`` draws it; matplotlib is the ``plot`` extra.
"""

from __future__ import annotations

import collections

from jaxkv.cache.kv_cache_config import KVCacheConfig

__all__ = ["block_segments", "plot_block"]

_COLORS = {"mla": "#4c72b0", "indexer": "#dd8452", "indexer_tail": "#c44e52", "kda": "#55a868"}


def block_segments(plan: KVCacheConfig) -> dict[int, list[dict]]:
  """Per KV-cache group, the byte segments of one of its blocks, in drawing order.

  Each segment: ``{"layer", "kind", "tensor", "start", "bytes", "kernel_page_bytes" (None
  unsplit), "row_bytes"}``; ``start`` is the offset in the block's storage (the arena row when
  packed; the layers' rows laid end to end when dense).
  """
  out: dict[int, list[dict]] = collections.defaultdict(list)
  rows = {t.name: t.row_bytes for t in plan.tensors}
  for v in plan.views:
    out[v.kv_cache_group_id].append(
      {
        "layer": v.layer_name,
        "kind": v.layer_name.rsplit(".", 1)[-1],
        "tensor": v.tensor,
        "start": v.tensor_offset_bytes,
        "bytes": v.page_bytes,
        "kernel_page_bytes": v.kernel_page_bytes if v.kernel_block_size else None,
        "row_bytes": v.block_stride_bytes if plan.layout == "packed" else rows[v.tensor],
      }
    )
  for segs in out.values():
    segs.sort(key=lambda s: (s["start"], s["layer"]))
    if plan.layout != "packed":  # one array per layer: lay the rows end to end
      at = 0
      for s in segs:
        s["start"] = at
        at += s["row_bytes"]
  return dict(sorted(out.items()))


def plot_block(plan: KVCacheConfig, path: str | None = None, *, ax=None):
  """Draws ``block_segments(plan)``: one bar per KV-cache group. Writes ``path`` (PNG, SVG...) when
  given; returns the matplotlib figure."""
  try:
    import matplotlib

    if path is not None and ax is None:
      matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
  except ImportError as e:
    raise RuntimeError("plotting needs matplotlib: pip install 'jaxkv[plot]' (or pip install matplotlib).") from e
  # Groups whose blocks look alike (the KDA layers' state groups) share one bar.
  rows: dict[tuple, list[int]] = {}
  first: dict[tuple, list[dict]] = {}
  for g, segs in block_segments(plan).items():
    key = (
      type(plan.kv_cache_groups[g].kv_cache_spec).__name__,
      tuple((s["kind"], s["start"], s["bytes"], s["kernel_page_bytes"]) for s in segs),
    )
    rows.setdefault(key, []).append(g)
    first.setdefault(key, segs)
  if ax is None:
    fig, ax = plt.subplots(figsize=(12, 1.6 + 0.6 * len(rows)))
  else:
    fig = ax.figure
  labels = []
  for y, (key, gs) in enumerate(rows.items()):
    ids = (
      f"group {gs[0]}"
      if len(gs) == 1
      else f"groups {gs[0]}-{gs[-1]}"
      if gs == list(range(gs[0], gs[-1] + 1))
      else f"groups {','.join(map(str, gs))}"
    )
    labels.append(f"{ids}: {key[0]}")
    segs = first[key]
    end = max(s["start"] + s["row_bytes"] for s in segs) if plan.layout != "packed" else plan.bytes_per_block
    ax.barh(y, end, left=0, height=0.6, color="#eeeeee", hatch="//", edgecolor="#bbbbbb", lw=0)  # padding
    for s in segs:
      ax.barh(
        y, s["bytes"], left=s["start"], height=0.6, color=_COLORS.get(s["kind"], "#8172b2"), edgecolor="white", lw=0.5
      )
      if s["kernel_page_bytes"]:
        for x in range(s["start"] + s["kernel_page_bytes"], s["start"] + s["bytes"], s["kernel_page_bytes"]):
          ax.plot([x, x], [y - 0.3, y + 0.3], color="black", lw=0.4)
      if plan.layout != "packed":
        ax.plot([s["start"], s["start"]], [y - 0.4, y + 0.4], color="black", lw=1.0)
  ax.set_yticks(range(len(labels)), labels)
  ax.invert_yaxis()
  ax.set_xlabel(
    "bytes of one block"
    + (" (the arena row)" if plan.layout == "packed" else " (each layer's own array, rows end to end)")
  )
  ax.set_title(
    f"one {plan.block_size}-token block ({plan.layout}): {plan.bytes_per_block:,} B, stride alignment "
    f"{plan.stride_alignment_bytes:,} B; ticks: kernel pages",
    fontsize=10,
  )
  handles = [Patch(color=c, label=k) for k, c in _COLORS.items()]
  handles.append(Patch(facecolor="#eeeeee", hatch="//", edgecolor="#bbbbbb", label="alignment padding / unused"))
  ax.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 1.08), ncol=5, fontsize=8, frameon=False)
  fig.tight_layout()
  if path is not None:
    fig.savefig(path, dpi=120)
  return fig
