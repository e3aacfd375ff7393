"""The engine on a device mesh, as a script: prints one JSON object of every configuration's outputs.

``tests/test_sharded_engine.py`` runs it in subprocesses: the CPU device count
(``--xla_force_host_platform_device_count``) is fixed when JAX starts, and under
``jax.distributed`` each process is its own program. A configuration is ``DPxTP`` with suffixes:
``e`` expert parallelism, ``-dense`` the dense layout split into 64-token kernel blocks (block 256).
``1x1`` is the single-device baseline.
"""

import argparse
import json
import os
import pathlib
import sys

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "hf" / "tiny"


def parse(name: str) -> dict:
  sizes, *flags = name.split("-")
  dp, tp = sizes.rstrip("e").split("x")
  return {"data_parallel_size": int(dp), "tensor_parallel_size": int(tp), "enable_expert_parallel": sizes.endswith("e"),
          "dense": "dense" in flags}


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--configs", default="1x1,1x2")
  p.add_argument("--coordinator", default=None, help="host:port of process 0 (jax.distributed)")
  p.add_argument("--num-processes", type=int, default=1)
  p.add_argument("--process-id", type=int, default=0)
  args = p.parse_args()
  import jax

  if args.coordinator:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
  import jax.numpy as jnp

  from jaxkv import CacheConfig
  from jaxkv.engine import EngineConfig, LLMEngine, SamplingParams
  from models.glm5_next.checkpoint import load_checkpoint
  from models.glm5_next.runner import Glm5NextRunner

  _, model = load_checkpoint(FIXTURE, dtype=jnp.float32)
  expected = json.loads((FIXTURE / "expected.json").read_text())
  prompts = expected["prompts"]
  sampling = SamplingParams(max_new_tokens=len(expected["greedy"][0]), logprobs=5)
  runner = Glm5NextRunner.from_model(model)
  out = {"process_count": jax.process_count(), "device_count": jax.device_count(), "hf_greedy":
         [[s["token"] for s in steps] for steps in expected["greedy"]], "runs": {}}
  for name in args.configs.split(","):
    c = parse(name)
    cache = CacheConfig(block_size=256, layout="dense", kernel_block_size=64) if c["dense"] else CacheConfig(block_size=128)
    engine = LLMEngine(runner, EngineConfig(
        cache=cache, max_num_reqs=4, max_num_batched_tokens=64, buckets=(64,),
        tensor_parallel_size=c["tensor_parallel_size"], data_parallel_size=c["data_parallel_size"],
        enable_expert_parallel=c["enable_expert_parallel"]))
    warm = engine.warmup()
    reqs = engine.generate(prompts, sampling)
    out["runs"][name] = {"tokens": [r.output_token_ids for r in reqs],
                         "top5": [[[[i, lp] for i, lp in s] for s in r.output_logprobs] for r in reqs],
                         "compiled_in_warmup": warm, "compiled_at_end": engine.num_compilations}
  if jax.process_index() == 0:
    print(json.dumps(out), flush=True)
  return 0


if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.exit(main())
