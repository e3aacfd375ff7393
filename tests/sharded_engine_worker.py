"""The engine on a device mesh, as a script: prints one JSON object of every configuration's outputs.

``tests/test_sharded_engine.py`` runs it in subprocesses: the CPU device count
(``--xla_force_host_platform_device_count``) is fixed when JAX starts, and under
``jax.distributed`` each process is its own program. A configuration is ``DPxTP`` with suffixes:
``e`` expert parallelism, ``-dense`` the dense layout split into 64-token kernel blocks (block 128; on a tensor split the
KDA states are split by head),
``-prefix`` prefix caching with a host offload tier (then two longer prompts are served three
more times: cold, warm from the device's prefix cache, and after the device forgot it, from the
host), ``-mtp`` MTP drafting (k = 2) on the random ``glm-5.3-flash-tiny`` model (the committed
fixture has no MTP layer) with random prompts, compared with ``1x1-mtp``; ``-pallas`` the Pallas
kernels (interpreted on the CPU; on a mesh, the KDA recurrence and sparse MLA decode run per device
on its heads under ``shard_map``), ``-swap`` preemption by swapping (three requests that each grow
into a third 128-token block, served with room for all, then on a second engine with room for one
to grow at a time), ``-chunked`` chunked KDA prefill with random prompts past its 64-position grid
(on a tensor split each device also holds its heads' share of the unfinished chunk's rows). ``1x1``
(any ``1x1-...``) runs on one device, unsharded; ``1x1`` is the baseline.
"""

import argparse
import dataclasses
import json
import os
import pathlib
import sys

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "hf" / "tiny"


def parse(name: str) -> dict:
  sizes, *flags = name.split("-")
  dp, tp = sizes.rstrip("e").split("x")
  return {
    "data_parallel_size": int(dp),
    "tensor_parallel_size": int(tp),
    "enable_expert_parallel": sizes.endswith("e"),
    "dense": "dense" in flags,
    "prefix": "prefix" in flags,
    "swap": "swap" in flags,
    "pallas": "pallas" in flags,
    "mtp": "mtp" in flags,
    "chunked": "chunked" in flags,
  }


def _top5(reqs) -> list:
  return [[[[i, lp] for i, lp in s] for s in r.output_logprobs] for r in reqs]


def _swap_run(engine, runner, c: dict, vocab: int) -> dict:
  """The same prompts with room for every request, and swapped out and in under memory pressure."""
  import numpy as np

  from jaxkv import CacheConfig
  from jaxkv.engine import EngineConfig, LLMEngine, SamplingParams

  rng = np.random.default_rng(8)
  prompts = [[int(t) for t in rng.integers(1, vocab, n)] for n in (128 - 4, 128 - 6, 128 - 3)]
  sampling = SamplingParams(max_tokens=8, logprobs=5)  # each crosses into its second block (of 256 positions)
  state_blocks = engine.plan.blocks_per_request(1) - 1  # KDA groups + tail ring
  tight = (1 + 3 * (state_blocks + 1) + 1) * engine.plan.bytes_per_block
  swapping = LLMEngine(
    runner,
    EngineConfig(
      cache=CacheConfig(
        block_size=128,
        max_model_len=256,
        layout=engine.plan.layout,
        kernel_block_size=engine.plan.cache_config.kernel_block_size,
        memory_bytes=tight,
      ),
      max_num_reqs=4,
      max_num_batched_tokens=128,
      buckets=(128,),
      tensor_parallel_size=c["tensor_parallel_size"],
      data_parallel_size=c["data_parallel_size"],
      enable_expert_parallel=c["enable_expert_parallel"],
      preemption_mode="swap",
    ),
  )
  runs = {
    key: [[r.output_token_ids, _top5([r])[0]] for r in e.generate(prompts, sampling)]
    for key, e in (("roomy", engine), ("swapped", swapping))
  }
  return {**runs, "swapped_out": swapping.swap.num_swapped_out, "swapped_in": swapping.swap.num_swapped_in}


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--configs", default="1x1,1x2")
  p.add_argument("--coordinator", default=None, help="host:port of process 0 (jax.distributed)")
  p.add_argument("--num-processes", type=int, default=1)
  p.add_argument("--process-id", type=int, default=0)
  args = p.parse_args()
  import jax

  checks = [0]  # jax.device_put's cross-process equality checks (an all-gather and a host sync each)
  if args.coordinator:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # No persistent compilation cache under jax.distributed on CPU: gloo collectives of programs
    # both processes read back from it time out waiting for each other (reproduced with jax 0.12.1:
    # the pair's second run on one cache folder fails, every time; docs/sharding.md).
    jax.config.update("jax_enable_compilation_cache", False)
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    from jax.experimental import multihost_utils

    assert_equal = multihost_utils.assert_equal

    def counted(*a, **k):
      checks[0] += 1
      return assert_equal(*a, **k)

    multihost_utils.assert_equal = counted
  import jax.numpy as jnp
  import numpy as np

  from jaxkv import CacheConfig
  from jaxkv.engine import EngineConfig, LLMEngine, SamplingParams, make_mesh
  from flax import nnx

  from models.glm5_next import Glm5NextForCausalLM, checkpoint, get_config
  from models.glm5_next.checkpoint import load_checkpoint
  from models.glm5_next.runner import Glm5NextRunner

  expected = json.loads((FIXTURE / "expected.json").read_text())
  prompts = expected["prompts"]
  sampling = SamplingParams(max_tokens=len(expected["greedy"][0]), logprobs=5)
  out = {
    "process_count": jax.process_count(),
    "device_count": jax.device_count(),
    "hf_greedy": [[s["token"] for s in steps] for steps in expected["greedy"]],
    "runs": {},
  }
  for name in args.configs.split(","):
    c = parse(name)
    # On a mesh the checkpoint is loaded by shard: each process reads its devices' slices.
    mesh = make_mesh(c["tensor_parallel_size"], c["data_parallel_size"]) if not name.startswith("1x1") else None
    read = [0]
    original = checkpoint._Tensors.read

    def counting(self, *a):
      value = original(self, *a)
      read[0] += value.size
      return value

    checkpoint._Tensors.read = counting
    try:
      if c["mtp"]:  # placed on the mesh by the engine (``ModelRunner.shard``)
        model = Glm5NextForCausalLM(get_config("glm-5.3-flash-tiny"), rngs=nnx.Rngs(0))
      else:
        _, model = load_checkpoint(FIXTURE, dtype=jnp.float32, mesh=mesh, expert_parallel=c["enable_expert_parallel"])
    finally:
      checkpoint._Tensors.read = original
    leaves = jax.tree.leaves(nnx.state(model))
    # Elements this process read, its devices' shards hold, and the whole model has.
    loaded = {
      "read": read[0],
      "held": sum(s.data.size for x in leaves for s in x.addressable_shards),
      "model": sum(x.size for x in leaves),
    }
    runner = Glm5NextRunner.from_model(model, implementation="pallas" if c["pallas"] else "auto")
    k = 2 if c["mtp"] else 0
    linear_prefill = "chunked" if c["chunked"] else "recurrent"
    cache = (
      CacheConfig(block_size=128, max_model_len=256, layout="dense", kernel_block_size=64, num_speculative_tokens=k)
      if c["dense"]
      else CacheConfig(block_size=128, max_model_len=256, num_speculative_tokens=k)
    )
    cache = dataclasses.replace(cache, linear_prefill=linear_prefill)
    engine = LLMEngine(
      runner,
      EngineConfig(
        cache=cache,
        max_num_reqs=4,
        max_num_batched_tokens=128,
        buckets=(128,),
        tensor_parallel_size=c["tensor_parallel_size"],
        data_parallel_size=c["data_parallel_size"],
        enable_expert_parallel=c["enable_expert_parallel"],
        enable_prefix_caching=c["prefix"],
        kv_offload="host" if c["prefix"] else None,
        greedy_step=False,  # every run asks for log-probs: a greedy variant would compile and never run
      ),
    )
    warm = engine.warmup()
    checks_before = checks[0]
    # Each cache array's row bytes: whole, and on one device (KDA states split by head: a share).
    cache_rows = {n: [a.shape[1], a.addressable_shards[0].data.shape[1]] for n, a in engine.executor.caches.items()}
    if c["mtp"] or c["chunked"]:
      rng = np.random.default_rng(0)
      lengths = (130, 9) if c["chunked"] else (13, 27, 5, 19)
      reqs = engine.generate(
        [[int(t) for t in rng.integers(1, 256, n)] for n in lengths], SamplingParams(max_tokens=8, logprobs=5)
      )
    else:
      reqs = engine.generate(prompts, sampling)
    run = out["runs"][name] = {
      "tokens": [r.output_token_ids for r in reqs],
      "top5": _top5(reqs),
      "compiled_in_warmup": warm,
      "loaded": loaded,
      "drafts": engine.num_draft_tokens,
      "cache_rows": cache_rows,
      "cross_process_checks": checks[0] - checks_before,  # in the steps after warm-up
    }
    if c["prefix"]:  # past a 128-token block: the second time, the first block comes from the cache
      long_prompts = [p * 6 for p in prompts]
      for key in ("cold", "warm", "offloaded"):
        if key == "offloaded":
          engine.kv.reset_prefix_cache()  # only the host tier has the blocks now
        again = engine.generate(long_prompts, sampling)
        run[key] = {
          "tokens": [r.output_token_ids for r in again],
          "top5": _top5(again),
          "cached": sum(r.num_cached_tokens for r in again),
        }
      run["loaded_from_host"] = engine.connector.num_loaded_blocks
    run["compiled_at_end"] = engine.num_compilations
    if c["swap"]:
      run["swap"] = _swap_run(engine, runner, c, model.config.vocab_size)
  if jax.process_index() == 0:
    print(json.dumps(out), flush=True)
  return 0


if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.exit(main())
