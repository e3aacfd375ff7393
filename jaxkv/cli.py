"""The ``jaxkv`` command line (also ``python -m jaxkv``)."""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["main", "build_parser"]


def _gib(n: int) -> str:
  return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n} B"


def _runs(rows: list[dict], keys: tuple[str, ...]):
  """Consecutive rows equal in ``keys`` folded into one, labelled ``first-last``."""
  start = 0
  for i in range(1, len(rows) + 1):
    if i == len(rows) or any(rows[i][k] != rows[start][k] for k in keys):
      yield (str(start) if i - 1 == start else f"{start}-{i - 1}"), rows[start]
      start = i


def _add_model_args(p: argparse.ArgumentParser) -> None:
  src = p.add_mutually_exclusive_group()
  src.add_argument("--config", default=None, help="built-in config name (default: glm-5.3-flash)")
  src.add_argument("--model-path", default=None, help="HF checkpoint directory with a glm5_next config.json")


def _load_model_config(args):
  from models.glm5_next import get_config, load_config

  if args.model_path:
    return load_config(args.model_path)
  return get_config(args.config or "glm-5.3-flash")


def plan_from_args(args):
  from jaxkv.kv_cache_config import plan_kv_cache
  from models.glm5_next import get_kv_cache_layers

  config = _load_model_config(args)
  layers = get_kv_cache_layers(
      config,
      block_size=args.block_size,
      kv_cache_dtype=args.kv_cache_dtype,
      indexer_cache_dtype=args.indexer_cache_dtype,
      num_speculative_tokens=args.num_spec,
  )
  max_len = args.max_model_len or config.max_position_embeddings
  return config, plan_kv_cache(
      layers,
      block_size=args.block_size,
      memory_bytes=int(args.memory_gib * 2**30),
      max_model_len=max_len,
      layout=args.layout,
      kernel_block_size=args.kernel_block_size,
  )


def _print_plan(config, plan, out) -> None:
  d = plan.describe()
  w = out.write
  w(f"KV-cache plan: {config.num_hidden_layers} layers ({len(config.dsa_layers)} MLA + indexer, "
    f"{len(config.kda_layers)} KDA state), layout {plan.layout}\n")
  scaled = "" if plan.block_size == plan.requested_block_size else f" (scaled up from {plan.requested_block_size})"
  w(f"  manager block size   {plan.block_size} tokens{scaled}\n")
  w(f"  bytes per block      {plan.bytes_per_block:,} ({_gib(plan.bytes_per_block)}), stride alignment "
    f"{plan.stride_alignment_bytes:,} B\n")
  w(f"  blocks               {plan.num_blocks:,} (block 0 is the null block), {_gib(d['total_bytes'])} in all\n")
  w(f"  token capacity       {plan.token_capacity:,} tokens; a {plan.max_model_len:,}-token request needs "
    f"{d['blocks_per_full_length_request']:,} blocks ({d['max_num_full_length_requests']} fit)\n\n")
  w(f"  {'groups':>7}  {'kind':<26}{'block':>7}{'layers':>8}{'page bytes':>14}{'table width':>13}\n")
  for ids, g in _runs(d["kv_cache_groups"], ("kind", "manager_block_size", "num_layers", "page_size_bytes", "block_table_width")):
    w(f"  {ids:>7}  {g['kind']:<26}{g['manager_block_size']:>7}{g['num_layers']:>8}"
      f"{g['page_size_bytes']:>14,}{g['block_table_width']:>13,}\n")
  w(f"\n  {'attn grp':>8}  {'backend':<34}{'layers':>7}{'page B':>12}{'align B':>9}{'kernel':>8}{'bpk':>5}"
    f"{'stride':>8}{'kpage B':>10}\n")
  rows = [{**ag, "n": len(ag["layers"]), "page": ag["kv_cache_spec"]["page_size_bytes"],
           "align": ag["kv_cache_spec"]["resolved_block_stride_alignment"]} for ag in d["attention_groups"]]
  for ids, ag in _runs(rows, ("backend", "n", "page", "align", "kernel_block_size", "kernel_block_stride")):
    w(f"  {ids:>8}  {ag['backend']:<34}{ag['n']:>7}{ag['page']:>12,}{ag['align']:>9,}"
      f"{str(ag['kernel_block_size'] or '-'):>8}{ag['blocks_per_kernel_block']:>5}{ag['kernel_block_stride']:>8,}"
      f"{ag['kernel_page_bytes']:>10,}\n")
  w("\n  tensors: " + ", ".join(f"{t['name']} uint8{t['shape']}" for t in d["tensors"][:4])
    + (f", ... ({len(d['tensors'])} in all)" if len(d["tensors"]) > 4 else "") + "\n")


def cmd_inspect(args) -> int:
  config, plan = plan_from_args(args)
  if args.json:
    json.dump({"model": {"num_hidden_layers": config.num_hidden_layers, "dsa_layers": list(config.dsa_layers),
                         "kda_layers": list(config.kda_layers), "index_kpool": config.index_kpool},
               "plan": plan.describe()}, sys.stdout, indent=1)
    sys.stdout.write("\n")
  else:
    _print_plan(config, plan, sys.stdout)
  return 0


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="jaxkv", description="Paged KV-cache management for JAX/Pallas LLM inference.")
  sub = parser.add_subparsers(dest="command", required=True)
  p = sub.add_parser("inspect", help="print the KV-cache plan of a model",
                     description="Plan the KV cache of a glm5_next model: groups, specs, page bytes, manager and "
                                 "kernel block sizes, strides, alignments, bytes per block, number of blocks.")
  _add_model_args(p)
  p.add_argument("--block-size", type=int, default=1024, help="manager block size in tokens (default 1024)")
  p.add_argument("--kernel-block-size", type=int, default=None, help="split token caches into kernel blocks of this size")
  p.add_argument("--memory-gib", type=float, default=80.0, help="KV-cache memory budget in GiB (default 80)")
  p.add_argument("--max-model-len", type=int, default=None, help="longest request (default: the model's maximum)")
  p.add_argument("--layout", choices=("dense", "packed"), default="packed", help="cache layout (default packed)")
  p.add_argument("--kv-cache-dtype", choices=("bfloat16", "float32", "fp8"), default="bfloat16")
  p.add_argument("--indexer-cache-dtype", choices=("fp8", "bfloat16", "float32"), default="fp8")
  p.add_argument("--num-spec", type=int, default=0, help="speculative tokens per step (widens the tail ring)")
  p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
  p.set_defaults(func=cmd_inspect)
  return parser


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  try:
    return args.func(args)
  except ValueError as e:
    print(f"jaxkv {args.command}: error: {e}", file=sys.stderr)
    return 2
  except BrokenPipeError:  # `jaxkv inspect | head`: the reader left; not an error of ours
    sys.stderr.close()
    return 0


if __name__ == "__main__":
  sys.exit(main())
