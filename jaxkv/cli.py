"""The ``jaxkv`` command line (also ``python -m jaxkv``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
import time

from jaxkv.engine.model_runner import get_model_family
from jaxkv.cache.cache_dtype import CACHE_DTYPES, MODEL_DTYPES
from jaxkv.cache.kv_cache_config import LAYOUTS, LINEAR_PREFILLS, CacheConfig, plan_kv_cache
from jaxkv.cache.kv_cache_report import render_plan
from jaxkv.gpu_target import GPU_TARGETS as _GPU_TARGETS

__all__ = ["main", "build_parser"]


# Library parameter names -> the flags that set them, for error messages.
_FLAGS = {
  "memory_bytes": "--memory-gib",
  "max_model_len": "--max-model-len",
  "kernel_block_size": "--kernel-block-size",
  "block_size": "--block-size",
  "layout='dense'": "--layout dense",
  "layout": "--layout",
  "linear_prefill": "--linear-prefill",
  "num_speculative_tokens": "--num-spec",
  "max_num_batched_tokens": "--max-num-batched-tokens",
  "long_prefill_token_threshold": "--long-prefill-token-threshold",
  "max_num_reqs": "--max-num-reqs",
  "kv_cache_dtype": "--kv-cache-dtype",
  "indexer_cache_dtype": "--indexer-cache-dtype",
  "tensor_parallel_size": "--tensor-parallel-size",
  "data_parallel_size": "--data-parallel-size",
  "enable_expert_parallel": "--enable-expert-parallel",
  "enable_prefix_caching": "--enable-prefix-caching",
  "kv_offload_dir": "--kv-offload-dir",
  "kv_offload": "--kv-offload",
  "preemption_mode": "--preemption-mode",
  "enable_prefix_caching=True": "--enable-prefix-caching",
  "kv_offload='host'": "--kv-offload host",
  "kv_offload='disk'": "--kv-offload disk",
  "max_tokens": "--max-tokens",
  "temperature": "--temperature",
  "top_p": "--top-p",
  "top_k": "--top-k",
  "logprobs": "--logprobs",
  "seed": "--seed",
}
# "memory_bytes N (…)" in a library message: the flag's own unit, rounded up so that it suffices.
_MEMORY_RE = re.compile(r"\bmemory_bytes( to at least)? ([\d,]+) \([^)]*\)")
_FLAG_RE = re.compile(r"\b(" + "|".join(re.escape(k) for k in sorted(_FLAGS, key=len, reverse=True)) + r")(?![\w'])")


def _with_flags(message: str) -> str:
  """A library error, its parameter names replaced by the command line's flags (and byte counts
  of the memory budget by --memory-gib values)."""

  def gib(m):
    n = int(m.group(2).replace(",", "")) / 2**30
    return f"--memory-gib{m.group(1) or ''} {math.ceil(n * 1e4) / 1e4:g}"

  return _FLAG_RE.sub(lambda m: _FLAGS[m.group(1)], _MEMORY_RE.sub(gib, message))


def _add_model_args(p: argparse.ArgumentParser, default: str) -> None:
  src = p.add_mutually_exclusive_group()
  names = ", ".join(get_model_family().builtin_config_names)
  src.add_argument("--config", default=default, help=f"built-in config: {names} (default {default})")
  src.add_argument("--model-path", default=None, help="HF checkpoint directory with a glm5_next config.json")


def _model_config(args):
  """The model's family and config; ``args.dtype`` resolved from ``"auto"`` (said on stderr)."""
  family = get_model_family()
  config = family.load_config(args.model_path) if args.model_path else family.builtin_config(args.config)
  if args.dtype == "auto":
    args.dtype = _auto_dtype(args, config)
  return family, config


def _auto_dtype(args, config) -> str:
  """vLLM's ``--dtype auto``: a checkpoint's own dtype; random weights bf16 on an accelerator and
  float32 on the CPU (bf16 matmuls there are slow and not the reference's precision). ``inspect``
  plans without weights: the config's dtype."""
  if args.model_path or args.command in ("inspect", "lower"):
    dtype, why = config.dtype, "the checkpoint's dtype" if args.model_path else "the config's dtype"
  else:
    from jaxkv.entrypoints.llm import resolve_dtype  # one rule for LLM and the command line

    dtype = resolve_dtype("auto", config, from_checkpoint=False)
    why = "random weights on the CPU" if dtype == "float32" else "random weights on a GPU"
  if args.command not in ("inspect", "lower"):
    print(f"jaxkv {args.command}: --dtype auto: {dtype} ({why})", file=sys.stderr)
  return dtype


def cache_config_from_args(args, config) -> CacheConfig:
  """The one options object of ``inspect``, ``generate`` and ``bench``."""
  return CacheConfig(
    block_size=args.block_size,
    kernel_block_size=args.kernel_block_size,
    layout=args.layout,
    kv_cache_dtype=args.kv_cache_dtype,
    indexer_cache_dtype=args.indexer_cache_dtype,
    state_dtype=args.dtype,
    num_speculative_tokens=args.num_spec,
    linear_prefill=args.linear_prefill,
    memory_bytes=int(args.memory_gib * 2**30),
    max_model_len=args.max_model_len or config.max_position_embeddings,
  )


def plan_from_args(args):
  family, config = _model_config(args)
  cache = cache_config_from_args(args, config)
  # One device's plan: with --tensor-parallel-size the dense layout splits the KDA states by head.
  layers = family.get_kv_cache_layers(config, cache, tensor_parallel_size=getattr(args, "tensor_parallel_size", 1))
  return family, config, cache, plan_kv_cache(layers, cache)


def _per_device(args, family, config, cache) -> dict | None:
  """One device's share under --tensor-parallel-size / --data-parallel-size / --enable-expert-parallel."""
  tp, dp, ep = args.tensor_parallel_size, args.data_parallel_size, args.enable_expert_parallel
  if tp == dp == 1 and not ep:
    return None
  r = family.per_device(config, cache, tensor_parallel_size=tp, data_parallel_size=dp, expert_parallel=ep)
  p = r["plan"]
  cache_bytes = sum(t.size_bytes for t in p.tensors)
  caches = (
    "KDA states split by head, latents and pooled keys whole"
    if any(t.shards > 1 for t in p.tensors)
    else "every cache whole on each device"
  )
  return {
    "tensor_parallel_size": tp,
    "data_parallel_size": dp,
    "expert_parallel": ep,
    "devices": tp * dp,
    "caches": caches,
    "weight_bytes_bf16": r["weight_bytes_bf16"],
    "weight_bytes_fp8": r["weight_bytes_fp8"],
    "kv_cache_bytes": cache_bytes,
    "bytes_per_block": p.bytes_per_block,
    "token_capacity_per_replica": p.token_capacity,
    "max_num_full_length_requests_per_replica": p.max_num_full_length_requests,
    "total_bytes_bf16": r["weight_bytes_bf16"] + cache_bytes,
    "total_bytes_fp8": r["weight_bytes_fp8"] + cache_bytes,
  }


def _render_per_device(d: dict) -> str:
  gib = lambda n: f"{n / 2**30:,.2f} GiB"
  ep = "on" if d["expert_parallel"] else "off"
  return (
    f"\nPer device, {d['devices']} devices (tensor {d['tensor_parallel_size']} x data "
    f"{d['data_parallel_size']}, expert parallel {ep}):\n"
    f"  weights              {gib(d['weight_bytes_bf16'])} bf16, {gib(d['weight_bytes_fp8'])} fp8\n"
    f"  KV cache             {gib(d['kv_cache_bytes'])} ({d['bytes_per_block']:,} B per block; {d['caches']})\n"
    f"  token capacity       {d['token_capacity_per_replica']:,} tokens per data-parallel replica "
    f"({d['max_num_full_length_requests_per_replica']} full-length requests)\n"
    f"  needs                {gib(d['total_bytes_bf16'])} per device with bf16 weights, "
    f"{gib(d['total_bytes_fp8'])} with fp8\n"
  )


def cmd_inspect(args) -> int:
  if args.plot:
    import pathlib

    parent = pathlib.Path(args.plot).resolve().parent
    if not parent.is_dir():
      raise ValueError(f"--plot {args.plot}: the directory {parent} does not exist.")
  family, config, cache, plan = plan_from_args(args)
  per_device = _per_device(args, family, config, cache)
  if args.json:
    json.dump(
      {
        "model": {
          "num_hidden_layers": config.num_hidden_layers,
          "dsa_layers": list(config.dsa_layers),
          "kda_layers": list(config.kda_layers),
          "index_kpool": config.index_kpool,
        },
        "plan": plan.describe(),
        **({"per_device": per_device} if per_device else {}),
      },
      sys.stdout,
      indent=1,
    )
    sys.stdout.write("\n")
  else:
    sys.stdout.write(render_plan(plan, family.describe(config, cache)))
    if per_device:
      sys.stdout.write(_render_per_device(per_device))
  if args.plot:
    from jaxkv.cache.kv_cache_plot import plot_block

    try:
      plot_block(plan, args.plot)
    except RuntimeError as e:  # matplotlib missing
      print(f"jaxkv inspect: error: {e}", file=sys.stderr)
      return 2
    print(f"wrote {args.plot}", file=sys.stderr)
  return 0


def _check_engine_flags(args, config) -> None:
  """Flags that would be ignored, or values past the model, refused before anything is built."""
  if args.swap_space is not None and args.preemption_mode != "swap":
    raise ValueError(
      f"--swap-space {args.swap_space:g} applies to --preemption-mode swap; add it, or drop --swap-space."
    )
  if args.kv_offload_dir is not None and args.kv_offload != "disk":
    raise ValueError(f"--kv-offload-dir {args.kv_offload_dir} is the disk tier's directory: add --kv-offload disk.")
  if args.kv_offload_gib is not None and args.kv_offload is None:
    raise ValueError(f"--kv-offload-gib {args.kv_offload_gib:g} sizes an offload tier: add --kv-offload host or disk.")
  positions = config.max_position_embeddings
  if args.max_model_len is not None and args.max_model_len > positions:
    raise ValueError(f"--max-model-len {args.max_model_len} exceeds the model's {positions} positions.")


def _engine(args, family, config, max_len: int):
  """The engine over a checkpoint, or a built-in config with seeded random weights."""
  from jaxkv.engine import EngineConfig, LLMEngine

  _check_engine_flags(args, config)
  cache = dataclasses.replace(cache_config_from_args(args, config), max_model_len=max_len)
  # Checked before anything is built: a bad combination of flags fails in milliseconds.
  engine_config = EngineConfig(
    cache=cache,
    max_num_reqs=args.max_num_reqs,
    max_num_batched_tokens=args.max_num_batched_tokens,
    long_prefill_token_threshold=args.long_prefill_token_threshold,
    buckets=args.buckets,
    enable_prefix_caching=args.enable_prefix_caching,
    kv_offload=args.kv_offload,
    kv_offload_bytes=int((args.kv_offload_gib or 4.0) * 2**30),
    kv_offload_dir=args.kv_offload_dir,
    preemption_mode=args.preemption_mode,
    swap_space_bytes=int((4.0 if args.swap_space is None else args.swap_space) * 2**30),
    tensor_parallel_size=args.tensor_parallel_size,
    data_parallel_size=args.data_parallel_size,
    enable_expert_parallel=args.enable_expert_parallel,
    greedy_step=args.greedy_step,
  )
  mesh = None
  if engine_config.num_devices > 1:
    from jaxkv.engine import make_mesh

    mesh = make_mesh(args.tensor_parallel_size, args.data_parallel_size)  # the engine's mesh: enough devices?
    family.check_parallel(
      config,
      tensor_parallel_size=args.tensor_parallel_size,
      data_parallel_size=args.data_parallel_size,
      expert_parallel=args.enable_expert_parallel,
    )
  _check_fits(args, family, config)
  if args.model_path:
    runner = family.from_pretrained(
      args.model_path,
      dtype=args.dtype,
      implementation=args.implementation,
      check_weights=args.check_weights,
      mesh=mesh,
      expert_parallel=args.enable_expert_parallel,
    )  # by shard on a mesh
  else:
    runner = family.from_random(config, dtype=args.dtype, seed=args.weights_seed, implementation=args.implementation)
  engine = LLMEngine(runner, engine_config)
  if getattr(args, "print_plan", False):
    sys.stderr.write(engine.render_plan(family.describe(config, cache)))
  return engine


def _device_memory_bytes() -> tuple[int, str]:
  """Memory of the first device: the allocator's limit on an accelerator, physical RAM on the CPU."""
  import os

  import jax

  dev = jax.local_devices()[0]
  stats = dev.memory_stats() if dev.platform != "cpu" else None
  if stats and "bytes_limit" in stats:
    return int(stats["bytes_limit"]), f"{dev.device_kind} memory"
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host memory"


def _check_fits(args, family, config) -> None:
  """Refuses, before anything is built, a model whose weights and KV cache exceed the device."""
  weights = family.weight_bytes(config, args.dtype)
  need = weights + int(args.memory_gib * 2**30)
  have, where = _device_memory_bytes()
  if need > have and not args.force:
    raise ValueError(
      f"the model needs {weights / 2**30:.1f} GiB of {args.dtype} weights + {args.memory_gib:g} GiB of "
      f"KV cache = {need / 2**30:.1f} GiB, more than the {have / 2**30:.1f} GiB of {where}. Use a "
      f"smaller config (--config glm-5.3-flash-tiny or -slice4), --dtype bfloat16, a smaller "
      f"--memory-gib, or --force to try anyway."
    )


def _tokenizer(args):
  """The checkpoint's tokenizer, or the one shipped with a built-in config (None: neither has one)."""
  from jaxkv.tokenizer import Tokenizer, builtin_tokenizer_dir

  import pathlib

  where = pathlib.Path(args.model_path) if args.model_path else builtin_tokenizer_dir(args.config)
  return Tokenizer(where) if where is not None and (where / "tokenizer.json").is_file() else None


def _prompts(args, config, tokenizer) -> list[list[int]]:
  import pathlib

  if args.prompt is not None:
    if tokenizer is None:
      what = args.model_path or f"--config {args.config}"
      raise ValueError(f"--prompt needs a tokenizer.json and {what} has none; pass --prompt-ids 1,2,3 instead.")
    prompts = [tokenizer.encode(args.prompt)]
  elif args.batch_file:
    path = pathlib.Path(args.batch_file)
    if not path.is_file():
      raise ValueError(f"--batch-file {args.batch_file}: no such file.")
    if args.batch is not None:
      raise ValueError("--batch copies a single prompt; a --batch-file already lists every request.")
    try:
      data = json.loads(path.read_text())
    except ValueError:
      data = None
    if (
      not isinstance(data, list)
      or not data
      or not all(
        isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in data
      )
    ):
      raise ValueError(
        f"--batch-file {args.batch_file} must be a non-empty JSON list of non-empty token-id lists, "
        f"e.g. [[1, 2, 3], [4, 5]]."
      )
    prompts = data
  else:
    ids = "1,2,3,4,5,6,7,8,9,10,11,12,13" if args.prompt_ids is None else args.prompt_ids
    try:
      prompts = [[int(t) for t in ids.split(",") if t.strip()]]
    except ValueError as e:
      raise ValueError(f"--prompt-ids must be comma-separated integers, got {ids!r}.") from e
    if not prompts[0]:
      raise ValueError(f"--prompt-ids must name at least one token id, got {ids!r}.")
  if not args.batch_file:
    prompts = prompts * (args.batch or 1)
  return prompts


def cmd_generate(args) -> int:
  from jaxkv.engine import SamplingParams

  family, config = _model_config(args)
  tokenizer = _tokenizer(args)
  prompts = _prompts(args, config, tokenizer)
  eos = tuple(dict.fromkeys(tuple(config.eos_token_id) + (tokenizer.eos_token_ids if tokenizer else ())))
  if args.stop_at_eos and not eos:
    raise ValueError("--stop-at-eos: the model's config and tokenizer name no end-of-sequence id; drop the flag.")
  sampling = SamplingParams(
    max_tokens=args.max_tokens,
    temperature=args.temperature,
    top_p=args.top_p,
    top_k=args.top_k,
    seed=args.seed,
    logprobs=args.logprobs,
    stop_token_ids=eos if args.stop_at_eos else (),
  )
  max_len = args.max_model_len or min(config.max_position_embeddings, max(len(p) for p in prompts) + args.max_tokens)
  engine = _engine(args, family, config, max_len)
  import jax

  plan = engine.plan
  print(
    f"jaxkv generate: {args.model_path or args.config} ({args.dtype}) on {jax.devices()[0].device_kind}; "
    f"{plan.layout} cache, {plan.num_blocks} blocks of {plan.block_size} tokens "
    f"({plan.num_blocks * plan.bytes_per_block / 2**20:,.1f} MiB), {len(prompts)} requests",
    file=sys.stderr,
  )
  print(
    "jaxkv generate: the step compiles on first use of each token bucket (a GPU takes a minute per bucket at "
    "the released dimensions)...",
    file=sys.stderr,
    flush=True,
  )
  progress = _progress(len(prompts) * args.max_tokens)
  reqs = engine.generate(prompts, sampling, progress=progress)
  generated = sum(len(r.output_token_ids) for r in reqs)
  serving = progress.seconds - progress.compile_seconds
  print(
    f"jaxkv generate: compiled {engine.num_compilations} step shapes in {progress.compile_seconds:.1f} s; "
    f"{generated} tokens in {engine.num_steps} steps, {serving:.2f} s without compiling: "
    f"{generated / max(serving, 1e-9):,.1f} tokens/s",
    file=sys.stderr,
  )
  if args.json:
    text = (lambda ids: tokenizer.decode(ids)) if tokenizer is not None else (lambda ids: None)
    json.dump(
      {
        "requests": [
          {
            "prompt_token_ids": r.prompt_token_ids,
            "output_token_ids": r.output_token_ids,
            "text": text(r.output_token_ids),
            "finish_reason": r.finish_reason,
            "num_cached_tokens": r.num_cached_tokens,
            "logprobs": [[[i, v] for i, v in step] for step in r.output_logprobs],
          }
          for r in reqs
        ],
        "steps": engine.num_steps,
        "compilations": engine.num_compilations,
        "preemptions": engine.scheduler.num_preemptions,
        "num_spec": args.num_spec,
        "draft_tokens": engine.num_draft_tokens,
        "accepted_tokens": engine.num_accepted_tokens,
        **({"acceptance_note": _RANDOM_DRAFTS} if args.num_spec and not args.model_path else {}),
      },
      sys.stdout,
    )
    sys.stdout.write("\n")
  else:
    for i, r in enumerate(reqs):
      cached = f", {r.num_cached_tokens} cached" if args.enable_prefix_caching else ""
      print(f"[{i}] prompt {len(r.prompt_token_ids)} tokens{cached} -> {r.output_token_ids} ({r.finish_reason})")
      if tokenizer is not None:
        print(f"     text: {tokenizer.decode(r.output_token_ids)!r}")
      for step, lps in zip(r.output_token_ids, r.output_logprobs):
        if lps:
          print(f"     {step}: " + ", ".join(f"{t}:{v:.4f}" for t, v in lps))
    if args.num_spec:
      print(
        f"drafts: {engine.num_accepted_tokens}/{engine.num_draft_tokens} accepted in {engine.num_steps} steps"
        + ("" if args.model_path else f" ({_RANDOM_DRAFTS})")
      )
  return 0


class _progress:
  """``LLMEngine.generate``'s progress callback: a bar on a terminal (tqdm), else a plain line every
  5 seconds (logs get no carriage returns); it also times the steps that compiled."""

  def __init__(self, total: int):
    self.total, self.done = total, 0
    self.start = self.last = self.line = time.perf_counter()
    self.compile_seconds, self.compilations = 0.0, None
    self.bar = None
    if sys.stderr.isatty():
      from tqdm.auto import tqdm

      self.bar = tqdm(total=total, unit="tok", desc="generating", file=sys.stderr, leave=False)

  def __call__(self, engine, outs) -> None:
    now, compiled = time.perf_counter(), engine.num_compilations
    if compiled > (self.compilations or 0):  # this step compiled a shape
      self.compile_seconds += now - self.last
    self.compilations, self.last = compiled, now
    new = sum(len(o.new_token_ids) for o in outs)
    self.done += new
    if self.bar is not None:
      self.bar.update(new)
    elif now - self.line > 5:
      self.line = now
      print(f"jaxkv generate: step {engine.num_steps}, {self.done}/{self.total} tokens", file=sys.stderr, flush=True)

  @property
  def seconds(self) -> float:
    if self.bar is not None:
      self.bar.close()
    return self.last - self.start


_RANDOM_DRAFTS = (
  "random weights: the MTP layer's drafts are unrelated to the model's tokens, so almost none are "
  "accepted; acceptance means something with --model-path and a trained checkpoint"
)


def cmd_lower(args) -> int:
  """The engine's step lowered for a GPU without one; with --build its Pallas kernels built by Triton."""
  import pathlib

  from jaxkv.engine.model_runner import plan_for
  from jaxkv.engine.step_executor import lower_step
  from jaxkv.kernel_build import build_kernels, triton_kernels
  from jaxkv.gpu_target import GPU_TARGETS, gpu_target

  out = pathlib.Path(args.out) if args.out else None
  if out is not None:
    out.mkdir(parents=True, exist_ok=True)
  family, config = _model_config(args)
  cache = cache_config_from_args(args, config)
  buckets = sorted(set(args.buckets or (args.max_num_reqs, args.max_num_batched_tokens)))
  variants = [(b, False) for b in buckets] + [(b, True) for b in buckets if cache.linear_prefill == "chunked"]
  steps, kernels = [], {}
  try:
    target = gpu_target(args.target)
  except RuntimeError as e:  # a JAX without abstract devices
    print(f"jaxkv lower: error: {e}", file=sys.stderr)
    return 1
  with target:
    runner = family.from_shapes(config, dtype=args.dtype, implementation=args.implementation)
    plan = plan_for(runner, cache)
    for bucket, chunks in variants:
      start = time.perf_counter()
      lowered = lower_step(
        runner,
        plan,
        max_num_reqs=args.max_num_reqs,
        num_tokens=bucket,
        num_speculative_tokens=cache.num_speculative_tokens,
        linear_chunks=chunks,
        platform="cuda",
      )
      found = triton_kernels(lowered)
      name = f"step-{bucket}{'-chunked' if chunks else ''}"
      if out is not None:
        (out / f"{name}.mlir").write_text(lowered.as_text())
      for k in found:
        kernels.setdefault((k.name, k.ttir), k)
      steps.append(
        {"step": name, "tokens": bucket, "triton_kernels": len(found), "seconds": round(time.perf_counter() - start, 1)}
      )
      print(f"jaxkv lower: {name}: {len(found)} Triton kernels ({steps[-1]['seconds']} s)", file=sys.stderr)
  builds = []
  if args.build:
    cc = GPU_TARGETS[args.target].compute_capability
    print(f"jaxkv lower: building {len(kernels)} kernels for sm_{cc}", file=sys.stderr)
    try:
      builds = [b.describe() for b in build_kernels(list(kernels.values()), cc)]
    except RuntimeError as e:
      print(f"jaxkv lower: error: {e}", file=sys.stderr)
      return 1
    if out is not None:
      for i, k in enumerate(kernels.values()):
        (out / f"{k.name}-{i}.ttir").write_text(k.ttir)
  if args.json:
    json.dump({"target": args.target, "steps": steps, "kernels": builds}, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0
  for st in steps:
    print(f"{st['step']:>20}  {st['triton_kernels']:>3} Triton kernels  lowered in {st['seconds']} s")
  if builds:
    print(f"\n{'kernel':<20} {'grid':>16} {'warps':>5} {'stages':>6} {'smem KiB':>9} {'regs':>5} {'spill st/ld B':>14}")
    for b in builds:
      grid = "x".join(map(str, b["grid"]))
      spill = f"{b['spill_stores_bytes']}/{b['spill_loads_bytes']}"
      print(
        f"{b['kernel']:<20} {grid:>16} {b['num_warps']:>5} {b['num_stages']:>6} "
        f"{b['shared_memory_bytes'] / 1024:>9.1f} {b['registers']:>5} {spill:>14}"
      )
  return 0


def cmd_bench(args) -> int:
  import numpy as np

  from jaxkv.engine.benchmark import benchmark_decode, decode_new_tokens
  from jaxkv.profiling import hlo_dump_beside

  hlo_dir = hlo_dump_beside(args.profile)  # before anything starts JAX's backend
  family, config = _model_config(args)
  if args.batch > args.max_num_reqs:
    raise ValueError(
      f"--batch {args.batch} requests cannot decode together on --max-num-reqs {args.max_num_reqs} "
      f"rows: raise --max-num-reqs to {args.batch} or lower --batch."
    )
  if args.context + args.steps > config.max_position_embeddings:
    raise ValueError(
      f"--context {args.context} + --steps {args.steps} tokens exceed the model's "
      f"{config.max_position_embeddings} positions."
    )
  rng = np.random.default_rng(args.weights_seed)
  prompts = [list(rng.integers(1, config.vocab_size, args.context)) for _ in range(args.batch)]
  profile_steps = 8 if args.profile else 0
  new_tokens = decode_new_tokens(
    args.batch,
    args.context,
    args.max_num_batched_tokens,
    args.steps,
    profile_steps,
    args.num_spec,
    args.long_prefill_token_threshold,
  )
  engine = _engine(args, family, config, args.context + new_tokens)
  print(
    f"jaxkv bench: compiling, prefilling {args.batch} x {args.context} tokens, then timing {args.steps} decode "
    f"steps...",
    file=sys.stderr,
    flush=True,
  )
  result = {
    "config": "checkpoint" if args.model_path else args.config,
    **benchmark_decode(
      engine,
      prompts,
      steps=args.steps,
      new_tokens=new_tokens,
      profile_dir=args.profile,
      profile_steps=profile_steps,
      hlo_dir=hlo_dir,
    ),
    "implementation": engine.runner.implementation,
    "layout": args.layout,
    "block_size": args.block_size,
    "dtype": args.dtype,
    "tensor_parallel_size": args.tensor_parallel_size,
    "data_parallel_size": args.data_parallel_size,
    "enable_expert_parallel": args.enable_expert_parallel,
    "greedy_step": args.greedy_step,
  }
  if args.num_spec and not args.model_path:
    result["acceptance_note"] = _RANDOM_DRAFTS
  if args.json:
    print(json.dumps(result))
    return 0
  profile = result.pop("profile", None)
  print("\n".join(f"{k:28s} {v}" for k, v in result.items()))
  for what, p in (("decode", profile), ("prefill", profile and profile.pop("prefill"))):
    if p:
      print(
        f"\n{what} profile ({p['device']}, {p['steps']} steps): {p['busy_ms_per_step']:.3f} ms busy of "
        f"{p['span_ms_per_step']:.3f} ms per step ({p['idle_fraction']:.0%} idle), "
        f"{p['kernels_per_step']:.0f} kernels per step; heaviest:"
      )
      for k in p["top"]:
        made = "  ".join(filter(None, (k.get("op"), k.get("result") and f"-> {k['result']}")))
        print(
          f"  {k['ms_per_step']:9.3f} ms {k['share']:6.1%} x{k['calls_per_step']:<5.0f} {k['name']}  {made}".rstrip()
        )
      print("  by model part (jax.named_scope):")
      for k in p["by_scope"]:
        print(f"  {k['ms_per_step']:9.3f} ms {k['share']:6.1%} {k['kernels_per_step']:6.1f} kernels  {k['scope']}")
      print("  the device waited (per step) between:")
      for g in p["idle_gaps"][:5]:
        print(f"  {g['ms_per_step']:9.3f} ms x{g['gaps_per_step']:<5.1f} {g['after']} -> {g['before']}")
  return 0


def cmd_serve(args) -> int:
  from jaxkv.entrypoints.api_server import serve
  from jaxkv.entrypoints.llm import LLM

  family, config = _model_config(args)
  tokenizer = _tokenizer(args)
  engine = _engine(args, family, config, args.max_model_len or config.max_position_embeddings)
  name = args.served_model_name or args.model_path or args.config
  llm = LLM.from_engine(engine, tokenizer=tokenizer, model=name)
  print(
    f"jaxkv serve: {name} ({args.dtype}) on http://{args.host}:{args.port}/v1 "
    f"(text: {'yes' if tokenizer else 'no tokenizer.json, token ids only'}); compiling...",
    file=sys.stderr,
  )
  t0 = time.perf_counter()
  engine.warmup()
  print(
    f"jaxkv serve: compiled {engine.num_compilations} step shapes in {time.perf_counter() - t0:.1f} s", file=sys.stderr
  )
  serve(llm, host=args.host, port=args.port, max_pending=args.max_pending, model_name=name)
  return 0


def _positive(text: str) -> int:
  """An integer >= 1, checked when the arguments are parsed (before any model is built)."""
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
  if value < 1:
    raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
  return value


def _positive_float(text: str) -> float:
  try:
    value = _non_negative_float(text)
  except argparse.ArgumentTypeError:
    value = -1.0
  if value <= 0:
    raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
  return value


def _non_negative_float(text: str) -> float:
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
  if not value >= 0 or value == float("inf"):
    raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
  return value


def _int_list(text: str) -> tuple[int, ...]:
  try:
    return tuple(int(x) for x in text.split(",") if x.strip())
  except ValueError as e:
    raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e


# The cache options of every command, from one place. inspect plans the released model (its
# defaults are a GPU's); generate and bench run the embedded tiny model on any machine.
_CACHE_DEFAULTS = {
  "inspect": dict(
    block_size=1024, memory_gib=80.0, dtype="bfloat16", kv_cache_dtype="bfloat16", indexer_cache_dtype="fp8"
  ),
  "engine": dict(block_size=256, memory_gib=0.0625, dtype="auto", kv_cache_dtype="auto", indexer_cache_dtype="auto"),
}
_CACHE_DTYPES = ("auto",) + CACHE_DTYPES


def _add_cache_args(p: argparse.ArgumentParser, kind: str) -> None:
  d = _CACHE_DEFAULTS[kind]
  p.add_argument(
    "--block-size",
    type=_positive,
    default=d["block_size"],
    help="KV-cache manager block size in tokens (rounded up to what every group needs)",
  )
  p.add_argument(
    "--kernel-block-size",
    type=_positive,
    default=None,
    help="split token caches into kernel blocks of this many tokens (dense layout; default: no split)",
  )
  p.add_argument(
    "--layout",
    choices=LAYOUTS,
    default="packed",
    help="packed: one arena row per block holds every layer's pages; dense: one array per layer",
  )
  p.add_argument("--memory-gib", type=float, default=d["memory_gib"], help="KV-cache memory budget in GiB")
  p.add_argument("--max-model-len", type=_positive, default=None, help="longest request (default: the model's maximum)")
  p.add_argument(
    "--dtype",
    choices=("auto",) + MODEL_DTYPES,
    default=d["dtype"],
    help="model dtype: weights, tail rings and KDA conv windows; auto: the checkpoint's dtype (float16 "
    "served as bfloat16), for built-in random weights bfloat16 on a GPU and float32 on the CPU",
  )
  p.add_argument(
    "--kv-cache-dtype",
    choices=_CACHE_DTYPES,
    default=d["kv_cache_dtype"],
    help="MLA latent cache; auto: the model dtype",
  )
  p.add_argument(
    "--indexer-cache-dtype",
    choices=_CACHE_DTYPES,
    default=d["indexer_cache_dtype"],
    help="pooled indexer key cache; auto: the model dtype",
  )
  p.add_argument(
    "--linear-prefill",
    choices=LINEAR_PREFILLS,
    default="recurrent",
    help="KDA prompt tokens: recurrent (token by token, as decode) or chunked (chunks of a 64-position "
    "grid; larger KDA pages, states reused by prefix caching only below each prompt's last grid line)",
  )
  p.add_argument(
    "--num-spec",
    type=int,
    default=0,
    help="MTP speculative tokens per step (0: off): adds the MTP layer's caches, widens the tail "
    "ring, gives each KDA state one slot per draft",
  )


def _add_parallel_args(p: argparse.ArgumentParser, kind: str) -> None:
  tp_help = {
    "inspect": "also show one device's weights, cache and capacity with heads split over this many devices",
    "engine": "run the step on this many devices, heads, MLP widths and vocabulary split over them (docs/sharding.md)",
  }[kind]
  p.add_argument("--tensor-parallel-size", type=_positive, default=1, help=tp_help)
  p.add_argument(
    "--data-parallel-size",
    type=_positive,
    default=1,
    help="data-parallel replicas; with --enable-expert-parallel the experts split over all data x "
    "tensor devices" + (" (the engine needs --enable-expert-parallel with it)" if kind == "engine" else ""),
  )
  p.add_argument(
    "--enable-expert-parallel",
    action="store_true",
    help="split the routed experts over all data x tensor devices instead of each over the tensor axis",
  )


def _add_engine_args(p):
  _add_model_args(p, "glm-5.3-flash-tiny")
  _add_cache_args(p, "engine")
  _add_parallel_args(p, "engine")
  p.add_argument("--weights-seed", type=int, default=0, help="seed of a built-in config's random weights")
  p.add_argument(
    "--force", action="store_true", help="build the model even when its weights and KV cache exceed the device's memory"
  )
  p.add_argument("--max-num-reqs", type=_positive, default=8, help="request rows per step")
  p.add_argument("--max-num-batched-tokens", type=_positive, default=64, help="token budget per step")
  p.add_argument(
    "--long-prefill-token-threshold",
    type=int,
    default=0,
    help="each request's share of a step before the next gets one (vLLM's; 0: off); the budget the shares "
    "leave goes back to them: long prompts prefill side by side, which keeps more of the KDA "
    "recurrence's programs busy (docs/engine.md)",
  )
  p.add_argument(
    "--implementation",
    choices=("auto", "xla", "pallas"),
    default="auto",
    help="attention kernels: the Pallas kernels (interpret mode on a CPU), the XLA reference path, or "
    "auto: Pallas on a GPU, XLA on the CPU",
  )
  p.add_argument(
    "--check-weights",
    action="store_true",
    help="refuse a checkpoint whose tensors hold NaN or infinite values (one pass over the weights)",
  )
  p.add_argument(
    "--no-greedy-step",
    dest="greedy_step",
    action="store_false",
    help="compile one step per token bucket: no greedy variant of the decode buckets (a faster warm-up; "
    "steps of greedy requests without log-probs then run the whole sampler; tokens are the same)",
  )
  p.add_argument(
    "--enable-prefix-caching",
    action="store_true",
    help="reuse cached blocks of earlier prompts with the same prefix (KDA states checkpointed at block "
    "boundaries; outputs bitwise those of a cold run; docs/engine.md)",
  )
  p.add_argument(
    "--kv-offload",
    choices=("host", "disk"),
    default=None,
    help="keep prefix-cache blocks evicted from the device in host memory or on disk (needs "
    "--enable-prefix-caching; disk needs --kv-offload-dir)",
  )
  p.add_argument(
    "--kv-offload-gib", type=_positive_float, default=None, help="capacity of the offload tier in GiB (default 4)"
  )
  p.add_argument(
    "--kv-offload-dir", default=None, help="directory of the disk tier (blocks survive restarts; created if missing)"
  )
  p.add_argument(
    "--preemption-mode",
    choices=("recompute", "swap"),
    default="recompute",
    help="a preempted request's blocks are recomputed, or swapped to host memory and back",
  )
  p.add_argument(
    "--swap-space",
    type=_non_negative_float,
    default=None,
    help="host memory in GiB for swapped blocks (--preemption-mode swap; recompute past it; default 4)",
  )
  p.add_argument(
    "--buckets",
    type=_int_list,
    default=None,
    help="step token counts to compile, e.g. 32,512 (default: powers of two up to the budget)",
  )


class _HelpFormatter(argparse.HelpFormatter):
  """Shows each flag's default, unless it has none (None, False) or its help already says it."""

  def _get_help_string(self, action):
    text = action.help or ""
    none = action.default is None or action.default is False or action.default is argparse.SUPPRESS
    if not none and "default" not in text and action.option_strings:
      text += " (default: %(default)s)"
    return text


def build_parser() -> argparse.ArgumentParser:
  from jaxkv import __version__

  parser = argparse.ArgumentParser(prog="jaxkv", description="Paged KV-cache management for JAX/Pallas LLM inference.")
  parser.add_argument("--version", action="version", version=f"jaxkv {__version__}")
  sub = parser.add_subparsers(dest="command", required=True)
  p = sub.add_parser(
    "inspect",
    formatter_class=_HelpFormatter,
    help="print the KV-cache plan of a model",
    description="Plan the KV cache of a glm5_next model: groups, specs, page bytes, manager and "
    "kernel block sizes, strides, alignments, bytes per block, number of blocks.",
  )
  _add_model_args(p, "glm-5.3-flash")
  _add_cache_args(p, "inspect")
  p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
  _add_parallel_args(p, "inspect")
  p.add_argument(
    "--plot",
    metavar="FILE",
    default=None,
    help="also draw one block (layers' pages, kernel pages, alignment padding) into FILE (.png, .svg; "
    "needs matplotlib: the 'plot' extra)",
  )
  p.set_defaults(func=cmd_inspect)

  g = sub.add_parser(
    "generate",
    formatter_class=_HelpFormatter,
    help="generate tokens (default: the embedded tiny random model)",
    description="Serve prompts with the engine: continuous batching, chunked prefill, paged caches.",
  )
  _add_engine_args(g)
  src = g.add_mutually_exclusive_group()
  src.add_argument("--prompt-ids", help="comma-separated token ids (default 1..13)")
  src.add_argument(
    "--prompt", help="text, encoded with the checkpoint's tokenizer.json (the embedded tiny model ships one)"
  )
  src.add_argument("--batch-file", help="JSON list of token-id lists, one request each")
  g.add_argument("--batch", type=_positive, default=None, help="copies of the prompt (default 1)")
  g.add_argument("--max-tokens", type=_positive, default=8, help="tokens to generate per request")
  g.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else sampling with --top-p")
  g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (with --temperature > 0)")
  g.add_argument("--top-k", type=int, default=0, help="sample among the k most probable tokens (0: off)")
  g.add_argument(
    "--seed",
    type=int,
    default=None,
    help="sampling seed (default: fresh entropy per request; built-in weights use --weights-seed)",
  )
  g.add_argument("--logprobs", type=int, default=0, help="top-k log-probabilities per token (up to 20)")
  g.add_argument("--stop-at-eos", action="store_true", help="stop at the config's and the tokenizer's eos ids")
  g.add_argument("--json", action="store_true", help="tokens and logprobs per request as one JSON object")
  g.add_argument("--print-plan", action="store_true", help="print the engine's KV-cache plan (as inspect) on stderr")
  g.set_defaults(func=cmd_generate)

  b = sub.add_parser(
    "bench",
    formatter_class=_HelpFormatter,
    help="decode throughput, step latency percentiles and compile count",
    description="Prefill a batch of random prompts, then time every decode step.",
  )
  _add_engine_args(b)
  b.add_argument("--batch", type=_positive, default=4, help="requests decoding together")
  b.add_argument("--context", type=_positive, default=64, help="prompt tokens per request")
  b.add_argument("--steps", type=_positive, default=32, help="decode steps to time, every request decoding")
  b.add_argument("--json", action="store_true", help="the results as one JSON object")
  b.add_argument(
    "--profile",
    metavar="DIR",
    default=None,
    help="after the timed steps, trace 8 more with jax.profiler into DIR and print the heaviest kernels "
    "and each model part's kernels (the step's optimized HLO is dumped into DIR/hlo)",
  )
  b.set_defaults(func=cmd_bench)

  lo = sub.add_parser(
    "lower",
    formatter_class=_HelpFormatter,
    help="lower the engine's step for a GPU without one; --build compiles its Pallas kernels with Triton",
    description="Trace the engine's jitted step from shapes alone (no weights, no caches allocated) and "
    "lower it for --target, its Pallas kernels to Triton as on that GPU. --build compiles each kernel "
    "with Triton's own compiler to a cubin and reports its shared memory, registers and spills "
    "(needs the triton package: the 'aot' extra). XLA compiles with the Triton it links, so this "
    "is a strong hint, not a guarantee (docs/kernels.md).",
  )
  _add_model_args(lo, "glm-5.3-flash")
  _add_cache_args(lo, "inspect")
  lo.add_argument(
    "--target", choices=sorted(_GPU_TARGETS), default="NVIDIA H200", help="the GPU to lower and build for"
  )
  lo.add_argument("--max-num-reqs", type=_positive, default=32, help="request rows per step")
  lo.add_argument(
    "--max-num-batched-tokens", type=_positive, default=2048, help="token budget per step (the largest bucket)"
  )
  lo.add_argument(
    "--buckets",
    type=_int_list,
    default=None,
    help="step token counts to lower (default: --max-num-reqs and the budget)",
  )
  lo.add_argument(
    "--implementation",
    choices=("auto", "xla", "pallas"),
    default="auto",
    help="attention kernels (auto and pallas: the Pallas kernels; xla: the reference path)",
  )
  lo.add_argument(
    "--build", action="store_true", help="compile each distinct kernel with Triton and report its resources"
  )
  lo.add_argument(
    "--out",
    metavar="DIR",
    default=None,
    help="write each step's StableHLO (and with --build each kernel's Triton IR) here",
  )
  lo.add_argument("--json", action="store_true", help="the results as one JSON object")
  lo.set_defaults(func=cmd_lower)

  v = sub.add_parser(
    "serve",
    formatter_class=_HelpFormatter,
    help="an OpenAI-compatible HTTP server",
    description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics "
    "(FastAPI on uvicorn); talk to it with OpenAI's client.",
  )
  _add_engine_args(v)
  v.add_argument("--host", default="127.0.0.1", help="address to listen on")
  v.add_argument("--port", type=_positive, default=8000, help="port to listen on")
  v.add_argument(
    "--max-pending", type=_positive, default=256, help="unfinished requests the server holds; more are answered 503"
  )
  v.add_argument("--served-model-name", default=None, help="the model's name in the API (default: its path or config)")
  v.set_defaults(func=cmd_serve)
  return parser


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  try:
    return args.func(args)
  except ValueError as e:
    print(f"jaxkv {args.command}: error: {_with_flags(str(e))}", file=sys.stderr)
    return 2
  except BrokenPipeError:  # `jaxkv inspect | head`: the reader left; not an error of ours
    sys.stderr.close()
    return 0


if __name__ == "__main__":
  sys.exit(main())
