"""The engine's step lowered for a GPU on this CPU machine (``gpu_target``, ``lower_step``): every
Pallas kernel lowers to Triton, sized by the target, and builds with Triton's own compiler within the
target's shared memory (``jaxkv.kernel_build``)."""

import json
import re
import sys

import pytest

from jaxkv import CacheConfig
from jaxkv.cli import main
from jaxkv.engine import lower_step, plan_for
from jaxkv.kernel_build import build_kernels, triton_kernels
from models.glm5_next import get_config
from models.glm5_next.runner import FAMILY
from jaxkv import GPU_TARGETS, gpu_target
from pallas_kernels import device_shared_memory_bytes, resolve_implementation
from pallas_kernels._common import default_interpret, device_multiprocessors

# The benchmark's model and cache (docs/performance.md), with a short max_model_len.
BENCH = dict(
  block_size=1024,
  layout="packed",
  kv_cache_dtype="bfloat16",
  indexer_cache_dtype="fp8",
  memory_bytes=8 << 30,
  max_model_len=4096,
)
KERNELS = {
  "step_metadata",
  "fused_recurrent_kda",
  "cache_write",
  "kpool_compress",
  "paged_mqa_logits",
  "sparse_mla_decode",
  "top_k",  # the sampler's top log-probs
  "mhc_mix",  # the mHC weights, two a layer
  "select_topk",  # the indexer's top pools: the rows here (1,280 entries) are longer than k = 512
  "grouped_matmul",  # the MoE in decode buckets (and, without tokamax, as here, in every bucket)
}


def lower(num_tokens, target="NVIDIA H200", chunks=False, greedy_only=False, **cache):
  with gpu_target(target):
    runner = FAMILY.from_shapes(get_config("glm-5.3-flash-slice4"), dtype="bfloat16")
    plan = plan_for(runner, CacheConfig(**{**BENCH, **cache}))
    lowered = lower_step(
      runner,
      plan,
      max_num_reqs=32,
      num_tokens=num_tokens,
      linear_chunks=chunks,
      greedy_only=greedy_only,
      platform="cuda",
    )
    return triton_kernels(lowered)


def by_name(kernels, name):
  return [k for k in kernels if k.name == name]


@pytest.mark.parametrize("num_tokens", [32, 2048])
def test_the_benchmark_step_lowers_every_kernel_to_triton(num_tokens):
  kernels = lower(num_tokens)
  assert {k.name for k in kernels} == KERNELS
  (sparse,) = by_name(kernels, "sparse_mla_decode")
  assert sparse.grid[:2] == (num_tokens, 1) and sparse.num_warps == 8  # 64 heads in one 64-row tile
  assert all(k.ttir.startswith("module") and "tt.func" in k.ttir for k in kernels)


def test_the_greedy_variant_lowers_no_sampler_kernel():
  """The decode step of an all-greedy batch without log-probs (``greedy_only``): every kernel of the
  model, and not the top-k of the sampler's log-probs."""
  assert {k.name for k in lower(32, greedy_only=True)} == KERNELS - {"top_k"}


def test_chunked_prefill_lowers_chunk_kda_in_its_variant_only():
  assert {k.name for k in lower(2048, chunks=True, linear_prefill="chunked")} == KERNELS | {
    "chunk_kda_scores",
    "chunk_kda_prepare",
    "chunk_kda",
  }
  assert "chunk_kda" not in {k.name for k in lower(32, linear_prefill="chunked")}


def test_the_target_decides_interpretation_implementation_and_sizes():
  assert default_interpret(None) and resolve_implementation("auto") == "xla"
  assert device_shared_memory_bytes() is None and device_multiprocessors() is None
  with gpu_target("NVIDIA A100"):
    assert not default_interpret(None) and resolve_implementation("auto") == "pallas"
    assert device_shared_memory_bytes() == 166_912 and device_multiprocessors() == 108
  assert default_interpret(None)  # the context ends with the block
  with pytest.raises(ValueError, match=r"unknown GPU 'NVIDIA V100'; targets: .*'NVIDIA H200'"):
    gpu_target("NVIDIA V100")


def test_tiles_follow_the_target_and_fit_its_shared_memory_as_built():
  """float32 latents: 64 heads in one tile on the H200, two tiles of 32 on an L4, whose 99 KiB the
  tile rule's estimate fills exactly; Triton's build asks for no more than that (the estimate holds
  where it is tightest)."""
  for target, head_tiles in (("NVIDIA H200", 1), ("NVIDIA L4", 2)):
    (sparse,) = by_name(lower(32, target, kv_cache_dtype="float32"), "sparse_mla_decode")
    assert sparse.grid[1] == head_tiles
  (built,) = build_kernels([sparse], GPU_TARGETS["NVIDIA L4"].compute_capability)
  assert 0 < built.shared_memory_bytes <= GPU_TARGETS["NVIDIA L4"].shared_memory_bytes, built


def test_every_kernel_of_the_prefill_step_builds_for_sm_90():
  """Within the H200's shared memory and 4 KiB of spills a thread (the one-kernel chunkwise KDA of
  2026-12-04 spilled 100 KB; docs/kernels.md)."""
  kernels = lower(2048, chunks=True, linear_prefill="chunked")
  distinct = list({(k.name, k.ttir): k for k in kernels}.values())
  for built in build_kernels(distinct, 90):
    assert built.shared_memory_bytes <= GPU_TARGETS["NVIDIA H200"].shared_memory_bytes, built
    assert 0 < built.registers <= 255 and built.spill_stores_bytes <= 4096, built
  assert "triton" not in sys.modules  # built in a child: Triton's LLVM stays out of this process


def test_cli_lower_json_and_files(tmp_path, capsys):
  args = ["lower", "--config", "glm-5.3-flash-slice4", "--memory-gib", "8", "--max-model-len", "4096"]
  assert main(args + ["--buckets", "32", "--build", "--json", "--out", str(tmp_path)]) == 0
  out = json.loads(capsys.readouterr().out)
  assert out["target"] == "NVIDIA H200" and [s["step"] for s in out["steps"]] == ["step-32"]
  # The top-k: two launches (blocks, then their candidates); the mHC's 2 x 4 calls: one jitted
  # function, so one custom call in the module's text; the indexer's selection: two launches
  # (rows of 1,280 entries: two segments of 1,024, then their candidates); the MoE's grouped
  # matmul: one jitted function per weight shape (gate and up, then down); the KDA recurrence: one
  # function, and one more for the first layer, whose pages are the step's argument (traced from
  # shapes, its abstract mesh names no device: another aval, another trace of the same function).
  assert out["steps"][0]["triton_kernels"] == 16
  assert {b["kernel"] for b in out["kernels"]} == KERNELS and all(b["sm"] == 90 for b in out["kernels"])
  assert (tmp_path / "step-32.mlir").read_text().count("xla.gpu.triton") == 16
  assert len(list(tmp_path.glob("*.ttir"))) == len(out["kernels"])
  with pytest.raises(SystemExit):  # argparse's choices name the targets
    main(args + ["--target", "NVIDIA V100"])
  assert "invalid choice: 'NVIDIA V100' (choose from 'NVIDIA A100'" in capsys.readouterr().err


def test_lower_step_is_the_program_the_engine_runs():
  """``lower_step`` from shapes alone gives the engine's own step, line for line (on this CPU; only
  the entry's signature differs: the engine's arrays carry their device placement)."""
  from test_engine_equivalence import cfg, runner

  from jaxkv.engine import LLMEngine
  from jaxkv.engine.step_executor import _device_step

  engine = LLMEngine(runner(), cfg())
  ex = engine.executor
  packing = ex.packing(64)
  args = (ex.param_leaves, ex.caches, ex.kernel_tables, packing.template, ex._prev_out)
  real = _device_step.trace(ex.statics, packing, *args).lower().as_text()
  ours = lower_step(runner(), engine.plan, max_num_reqs=engine.config.max_num_reqs, num_tokens=64).as_text()
  body = lambda text: [
    re.sub(r"loc\([^)]*\)", "", line)
    for line in text.splitlines()
    if not line.lstrip().startswith(("#loc", "sdy.mesh", "func.func public @main("))
  ]
  assert len(body(real)) > 1000 and body(real) == body(ours)


def test_a_mesh_over_this_machine_s_own_gpus_is_no_target(monkeypatch):
  """Inside a ``shard_map`` body on real GPUs the abstract mesh names their kind ("NVIDIA H100 80GB
  HBM3", not a ``GPU_TARGETS`` key): that mirrors the devices, whose driver answers, not a target."""
  import types

  import jax

  from jaxkv.gpu_target import target_gpu

  kind = "NVIDIA H100 80GB HBM3"
  gpu = types.SimpleNamespace(platform="gpu", device_kind=kind, local_hardware_id=0)
  monkeypatch.setattr(jax, "local_devices", lambda *a, **k: [gpu])
  own = jax.sharding.AbstractMesh((), (), abstract_device=jax.sharding.AbstractDevice(kind, 132, "gpu"))
  with jax.sharding.use_abstract_mesh(own):
    assert target_gpu() is None and device_shared_memory_bytes() is not None  # the driver's (or 48 KiB)
  with gpu_target("NVIDIA A100"):  # a deliberate other GPU still is one
    assert target_gpu().device_kind == "NVIDIA A100" and device_shared_memory_bytes() == 166_912
