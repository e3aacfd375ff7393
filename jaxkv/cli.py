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
  mtp = any(b.layer_name.startswith(f"layers.{config.num_hidden_layers}.") for b in plan.bindings)
  w(f"KV-cache plan: {config.num_hidden_layers} layers ({len(config.dsa_layers)} MLA + indexer, "
    f"{len(config.kda_layers)} KDA state){' + the MTP layer (MLA + indexer)' if mtp else ''}, "
    f"layout {plan.layout}\n")
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


def _load_model(args):
  """(config, model): a checkpoint, or a built-in config with seeded random weights."""
  import jax.numpy as jnp
  from flax import nnx

  from models.glm5_next import Glm5NextForCausalLM, get_config, load_checkpoint

  if args.model_path:
    return load_checkpoint(args.model_path, dtype=jnp.float32 if args.dtype == "float32" else jnp.bfloat16)
  config = get_config(args.config or "glm-5.3-flash-tiny")
  dtype = jnp.float32 if args.dtype == "float32" else jnp.bfloat16
  return config, Glm5NextForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(args.seed))


def _engine_config(args, max_len):
  from jaxkv.engine import EngineConfig

  return EngineConfig(
      block_size=args.block_size, kernel_block_size=args.kernel_block_size, layout=args.layout,
      memory_bytes=int(args.memory_gib * 2**30), max_model_len=max_len, max_num_reqs=args.max_num_reqs,
      max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_dtype=args.kv_cache_dtype,
      indexer_cache_dtype=args.indexer_cache_dtype, state_dtype=args.dtype, implementation=args.implementation,
      num_speculative_tokens=args.num_spec, buckets=args.buckets)


def _prompts(args, config) -> list[list[int]]:
  import pathlib

  if args.prompt is not None:
    tok = pathlib.Path(args.model_path or "") / "tokenizer.json"
    if not args.model_path or not tok.is_file():
      raise ValueError("--prompt needs a --model-path with a tokenizer.json; pass --prompt-ids 1,2,3 instead.")
    try:
      from tokenizers import Tokenizer  # parses tokenizer.json; executes nothing
    except ImportError as e:
      raise ValueError("--prompt needs the tokenizers package (pip install tokenizers), or pass --prompt-ids.") from e
    prompts = [Tokenizer.from_file(str(tok)).encode(args.prompt).ids]
  elif args.batch_file:
    data = json.loads(pathlib.Path(args.batch_file).read_text())
    if not isinstance(data, list) or not all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in data):
      raise ValueError(f"{args.batch_file} must be a JSON list of token-id lists, e.g. [[1, 2, 3], [4, 5]].")
    prompts = data
  else:
    ids = args.prompt_ids or "1,2,3,4,5,6,7,8,9,10,11,12,13"
    try:
      prompts = [[int(t) for t in ids.split(",") if t.strip()]]
    except ValueError as e:
      raise ValueError(f"--prompt-ids must be comma-separated integers, got {ids!r}.") from e
  if not args.batch_file:
    prompts = prompts * args.batch
  return prompts


def cmd_generate(args) -> int:
  from jaxkv.engine import LLMEngine, SamplingParams

  config, model = _load_model(args)
  prompts = _prompts(args, config)
  max_len = args.max_model_len or min(config.max_position_embeddings,
                                      max(len(p) for p in prompts) + args.max_new_tokens)
  engine = LLMEngine(model, _engine_config(args, max_len))
  sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed, logprobs=args.logprobs,
                            stop_token_ids=tuple(config.eos_token_id) if args.stop_at_eos else ())
  total = len(prompts) * args.max_new_tokens
  done = [0]

  def progress(eng, outs):
    done[0] += sum(len(o.new_token_ids) for o in outs)
    sys.stderr.write(f"\rstep {eng.num_steps}: {done[0]}/{total} tokens, {eng.num_compilations} compiled shapes")
    sys.stderr.flush()

  reqs = engine.generate(prompts, sampling, progress=progress)
  sys.stderr.write("\n")
  if args.json:
    json.dump({"requests": [{"prompt_token_ids": r.prompt_token_ids, "output_token_ids": r.output_token_ids,
                             "finish_reason": r.finish_reason,
                             "logprobs": [[[i, v] for i, v in step] for step in r.output_logprobs]} for r in reqs],
               "steps": engine.num_steps, "compilations": engine.num_compilations,
               "preemptions": engine.scheduler.num_preemptions, "num_spec": args.num_spec,
               "draft_tokens": engine.num_draft_tokens, "accepted_tokens": engine.num_accepted_tokens}, sys.stdout)
    sys.stdout.write("\n")
  else:
    for i, r in enumerate(reqs):
      print(f"[{i}] prompt {len(r.prompt_token_ids)} tokens -> {r.output_token_ids} ({r.finish_reason})")
      for step, lps in zip(r.output_token_ids, r.output_logprobs):
        if lps:
          print(f"     {step}: " + ", ".join(f"{t}:{v:.4f}" for t, v in lps))
    if args.num_spec:
      print(f"drafts: {engine.num_accepted_tokens}/{engine.num_draft_tokens} accepted in {engine.num_steps} steps")
  return 0


def cmd_bench(args) -> int:
  import time

  import numpy as np

  from jaxkv.engine import LLMEngine, SamplingParams

  config, model = _load_model(args)
  rng = np.random.default_rng(args.seed)
  prompts = [list(rng.integers(1, config.vocab_size, args.context)) for _ in range(args.batch)]
  # Requests prefilled early decode while later ones prefill: leave them room for that, so every
  # request is still decoding during all `steps` timed steps.
  prefill_steps = -(-args.batch * args.context // args.max_num_batched_tokens) + 1
  new_tokens = (prefill_steps + args.steps) * (1 + args.num_spec) + 1
  engine = LLMEngine(model, _engine_config(args, args.context + new_tokens))
  t0 = time.perf_counter()
  compiled_warm = engine.warmup()  # every token bucket, as vLLM captures its graphs
  warmup_s = time.perf_counter() - t0
  reqs = [engine.add_request(f"bench-{i}", p, SamplingParams(max_new_tokens=new_tokens))
          for i, p in enumerate(prompts)]
  t0 = time.perf_counter()
  while not all(r.output_token_ids for r in reqs):
    engine.step()
  prefill_s = time.perf_counter() - t0
  lat, tokens = [], 0
  drafted, accepted = engine.num_draft_tokens, engine.num_accepted_tokens
  for _ in range(args.steps):
    t = time.perf_counter()
    outs = engine.step()
    lat.append(time.perf_counter() - t)
    tokens += sum(len(o.new_token_ids) for o in outs)
  finished_early = sum(r.finish_reason is not None for r in reqs)
  for r in reqs:
    engine.abort(r.request_id)
  lat_ms = np.asarray(lat) * 1e3
  drafted, accepted = engine.num_draft_tokens - drafted, engine.num_accepted_tokens - accepted
  result = {"config": args.config or ("checkpoint" if args.model_path else "glm-5.3-flash-tiny"),
            "batch": args.batch, "context": args.context, "decode_steps": len(lat), "decode_tokens": tokens,
            "finished_before_the_end": finished_early,
            "prefill_s": prefill_s, "decode_tokens_per_s": tokens / max(sum(lat), 1e-9),
            "num_spec": args.num_spec, "acceptance_rate": accepted / drafted if drafted else None,
            "step_ms_p50": float(np.percentile(lat_ms, 50)), "step_ms_p90": float(np.percentile(lat_ms, 90)),
            "step_ms_p99": float(np.percentile(lat_ms, 99)), "warmup_s": warmup_s,
            "compilations_after_warmup": compiled_warm, "compilations_at_end": engine.num_compilations,
            "implementation": args.implementation, "layout": args.layout, "block_size": args.block_size}
  print(json.dumps(result) if args.json else "\n".join(f"{k:28s} {v}" for k, v in result.items()))
  return 0


def _int_list(text: str) -> tuple[int, ...]:
  try:
    return tuple(int(x) for x in text.split(",") if x.strip())
  except ValueError as e:
    raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e


def _add_engine_args(p):
  _add_model_args(p)
  p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="weights and state dtype")
  p.add_argument("--seed", type=int, default=0, help="random weights and sampling seed")
  p.add_argument("--block-size", type=int, default=256)
  p.add_argument("--kernel-block-size", type=int, default=None, help="split token caches into kernel blocks (dense)")
  p.add_argument("--layout", choices=("dense", "packed"), default="packed")
  p.add_argument("--memory-gib", type=float, default=0.0625, help="KV-cache budget in GiB (default 64 MiB)")
  p.add_argument("--max-model-len", type=int, default=None)
  p.add_argument("--max-num-reqs", type=int, default=8)
  p.add_argument("--max-num-batched-tokens", type=int, default=64, help="token budget per step")
  p.add_argument("--kv-cache-dtype", choices=("float32", "bfloat16", "fp8"), default="float32")
  p.add_argument("--indexer-cache-dtype", choices=("float32", "bfloat16", "fp8"), default="float32")
  p.add_argument("--implementation", choices=("xla", "pallas"), default="xla", help="kernels")
  p.add_argument("--num-spec", type=int, default=0,
                 help="MTP speculative tokens per step (0: off; the model needs its MTP layer)")
  p.add_argument("--buckets", type=_int_list, default=None,
                 help="step token counts to compile, e.g. 32,512 (default: powers of two up to the budget)")


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
  p.add_argument("--num-spec", type=int, default=0, help="MTP speculative tokens per step: adds the MTP layer's caches, widens the tail ring, "
                 "gives each KDA state one slot per draft")
  p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
  p.set_defaults(func=cmd_inspect)

  g = sub.add_parser("generate", help="generate tokens (default: the embedded tiny random model)",
                     description="Serve prompts with the engine: continuous batching, chunked prefill, paged caches.")
  _add_engine_args(g)
  src = g.add_mutually_exclusive_group()
  src.add_argument("--prompt-ids", help="comma-separated token ids (default 1..13)")
  src.add_argument("--prompt", help="text, encoded with the checkpoint's tokenizer.json")
  src.add_argument("--batch-file", help="JSON list of token-id lists, one request each")
  g.add_argument("--batch", type=int, default=1, help="copies of the prompt")
  g.add_argument("--max-new-tokens", type=int, default=8)
  g.add_argument("--temperature", type=float, default=0.0)
  g.add_argument("--top-p", type=float, default=1.0)
  g.add_argument("--logprobs", type=int, default=0, help="top-k log-probabilities per token (up to 20)")
  g.add_argument("--stop-at-eos", action="store_true", help="stop at the config's eos ids")
  g.add_argument("--json", action="store_true", help="tokens and logprobs per request as one JSON object")
  g.set_defaults(func=cmd_generate)

  b = sub.add_parser("bench", help="decode throughput, step latency percentiles and compile count",
                     description="Prefill a batch of random prompts, then time every decode step.")
  _add_engine_args(b)
  b.add_argument("--batch", type=int, default=4)
  b.add_argument("--context", type=int, default=64, help="prompt tokens per request")
  b.add_argument("--steps", type=int, default=32, help="decode steps to time, every request decoding")
  b.add_argument("--json", action="store_true")
  b.set_defaults(func=cmd_bench)
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
