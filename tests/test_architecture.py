"""The shape of the house: imports read top to bottom, the step maps kernel blocks through the
attention groups, one plan from one options object, equal engines share compiled steps."""

import ast
import dataclasses
import gc
import pathlib
import weakref

import jax
import numpy as np
import pytest
from flax import nnx

import pallas_kernels.step_metadata
from jaxkv import StepMetadataSpec
from jaxkv.cli import main
from jaxkv.engine import SamplingParams
from jaxkv.step.kernel_blocks import map_to_kernel_blocks_reference
from models.glm5_next import Glm5NextForCausalLM
from models.glm5_next.runner import Glm5NextRunner
from test_engine_equivalence import CFG, LLMEngine, cfg, prompts, runner

ROOT = pathlib.Path(__file__).resolve().parent.parent


def imports_of(package: str) -> dict[str, set[str]]:
  out = {}
  for path in (ROOT / package).rglob("*.py"):
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        names |= {a.name for a in node.names}
      elif isinstance(node, ast.ImportFrom) and node.module:
        names.add(node.module)
    out[str(path.relative_to(ROOT))] = names
  return out


def test_imports_read_top_to_bottom():
  """The folders are layers: cache (static records) <- host (bookkeeping) and step (jitted
  functions) <- engine <- entry points and CLI; models and kernels sit beside the engine, which
  reaches them only through the runner protocol and the registry. Nothing imports back up."""

  def offenders(package, forbidden):
    return {
      f: sorted(n for n in names if any(n == p or n.startswith(p + ".") for p in forbidden))
      for f, names in imports_of(package).items()
      if any(n == p or n.startswith(p + ".") for n in names for p in forbidden)
    }

  above_core = ["jaxkv.engine", "jaxkv.entrypoints", "jaxkv.cli", "pallas_kernels", "models"]
  assert offenders("jaxkv/cache", ["jaxkv.host", "jaxkv.step", *above_core]) == {}
  assert offenders("jaxkv/host", ["jaxkv.step", *above_core]) == {}
  assert offenders("jaxkv/step", ["jaxkv.host", *above_core]) == {}
  # The engine finds models through the registry and their kernels through the runner.
  assert offenders("jaxkv/engine", ["jaxkv.entrypoints", "jaxkv.cli", "pallas_kernels", "models"]) == {}
  assert offenders("jaxkv", ["models", "pallas_kernels"]) == {}
  assert offenders("models", ["jaxkv.engine", "jaxkv.entrypoints", "jaxkv.cli"]) == {}
  assert offenders("pallas_kernels", ["models", "jaxkv.engine", "jaxkv.host", "jaxkv.entrypoints", "jaxkv.cli"]) == {}


def test_no_package_imports_another_packages_private_module():
  """jaxkv, models and pallas_kernels reach each other through public names only (a package's
  ``__init__`` exports them): no ``pkg._private`` module and no ``_private`` name of another package."""

  def private(module: str, names: tuple[str, ...] = ()) -> bool:
    return any(part.startswith("_") and part != "__future__" for part in module.split(".")) or any(
      n.startswith("_") for n in names
    )

  offenders = []
  for package in ("jaxkv", "models", "pallas_kernels"):
    for path in (ROOT / package).rglob("*.py"):
      for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
          found = [(a.name, ()) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
          found = [(node.module, tuple(a.name for a in node.names))]
        else:
          continue
        for module, names in found:
          if module.split(".")[0] in ("jaxkv", "models", "pallas_kernels") and module.split(".")[0] != package:
            if private(module, names):
              offenders.append(f"{path.relative_to(ROOT)}: {module} {names}")
  assert offenders == []


def test_step_maps_kernel_blocks_through_the_attention_groups(monkeypatch):
  """One metadata computation per step, its spec taken from the plan's attention groups (on the
  CPU through the jnp reference, whose table mapping is counted here)."""
  calls = []
  real = pallas_kernels.step_metadata.map_to_kernel_blocks

  def counting(*args, **kw):
    calls.append(args[1:3])
    return real(*args, **kw)

  monkeypatch.setattr(pallas_kernels.step_metadata, "map_to_kernel_blocks", counting)
  # A bucket no other test compiles, so the step is traced here.
  engine = LLMEngine(runner(), cfg(layout="dense", kernel_block_size=64, buckets=(40,), max_num_batched_tokens=40))
  split = [(i, ag) for i, ag in enumerate(engine.plan.attention_groups) if ag.kernel_block_size]
  assert split and all(t is None for i, t in enumerate(engine.executor.kernel_tables) if i not in dict(split))
  spec = engine.executor.statics.metadata_spec
  # The executor asks the runner once, at construction, which path "auto" is.
  want = engine.executor.statics.runner.kernel_implementation("compute_step_metadata")
  assert spec == StepMetadataSpec.from_plan(engine.plan, implementation=want)
  assert [a for a, _ in split] == list(spec.mapped_groups)
  for i, p in enumerate(prompts()):
    engine.add_request(str(i), p, SamplingParams(max_tokens=8))
  engine.step()
  # Once per group with a split or a compressed cache (the pooled keys' slots read its table).
  mapped = [(ag.blocks_per_kernel_block, ag.stride) for ag in spec.attention_groups if ag.mapped or ag.compressed]
  assert sorted(calls) == sorted(mapped)
  for _ in range(3):
    before = engine.executor.kernel_tables
    engine.step()
    for i, ag in split:
      assert before[i].is_deleted()  # the persistent buffer was donated and rewritten
      want = map_to_kernel_blocks_reference(
        engine.tables[ag.kv_cache_group_id].block_table, ag.blocks_per_kernel_block, ag.stride
      )
      np.testing.assert_array_equal(np.asarray(engine.executor.kernel_tables[i]), want)
  assert len(calls) == len(mapped)  # steady steps reuse the one trace


def test_inspect_and_the_engine_print_the_same_plan(capsys):
  opts = [
    "--config",
    "glm-5.3-flash-tiny",
    "--block-size",
    "256",
    "--memory-gib",
    "0.0625",
    "--max-model-len",
    "64",
    "--num-spec",
    "2",
    "--dtype",
    "float32",
    "--kv-cache-dtype",
    "float32",
    "--indexer-cache-dtype",
    "float32",
  ]
  assert main(["inspect", *opts]) == 0
  inspected = capsys.readouterr().out
  assert "+ the MTP layer" in inspected and "request needs" in inspected
  assert main(["generate", *opts, "--max-tokens", "1", "--print-plan"]) == 0
  assert inspected in capsys.readouterr().err
  assert main(["inspect", *opts, "--memory-gib", "0.0001"]) == 2
  err = capsys.readouterr().err
  assert "Raise --memory-gib to at least" in err and "--max-model-len" in err and "memory_bytes" not in err


def test_equal_engines_share_compiled_steps_and_count_their_own():
  other = Glm5NextRunner.from_model(Glm5NextForCausalLM(CFG, rngs=nnx.Rngs(1)))  # other weights, same graph
  assert other == runner() and hash(other) == hash(runner())
  config = cfg(buckets=(48,), max_num_batched_tokens=48)  # a bucket no other test compiles
  a, b = LLMEngine(runner(), config), LLMEngine(other, config)
  assert a.executor.statics is b.executor.statics
  a.generate([prompts()[0]], SamplingParams(max_tokens=2))
  assert a.num_compilations == 1  # its one bucket, whatever other tests compiled before
  out = b.generate([prompts()[0]], SamplingParams(max_tokens=2))
  assert b.num_compilations == 0 and len(out[0].output_token_ids) == 2  # a's executable
  assert a.generate([prompts()[1]], SamplingParams(max_tokens=2)) and a.num_compilations == 1


def test_dropping_an_engine_frees_its_weights_and_caches():
  """Nothing process-wide holds an engine's arrays: jit's cache keys the step by the runner without
  its weights (``ModelRunner.with_params(None)``)."""
  gc.collect()
  live_before = sum(a.nbytes for a in jax.live_arrays())
  engine = LLMEngine(Glm5NextRunner.from_model(Glm5NextForCausalLM(CFG, rngs=nnx.Rngs(2))), cfg())
  engine.generate([prompts()[0]], SamplingParams(max_tokens=2))
  weight = weakref.ref(jax.tree.leaves(engine.runner.params)[0])
  cache = weakref.ref(next(iter(engine.executor.caches.values())))
  held = sum(a.nbytes for a in jax.live_arrays()) - live_before
  assert held > sum(x.nbytes for x in engine.executor.param_leaves)
  del engine
  gc.collect()
  assert weight() is None and cache() is None
  assert sum(a.nbytes for a in jax.live_arrays()) <= live_before


@pytest.mark.parametrize(
  "bad, match",
  [
    ({"layout": "sparse"}, "layout must be one of"),
    ({"kv_cache_dtype": "int4"}, "kv_cache_dtype must be one of"),
    ({"block_size": 0}, "block_size must be a positive integer"),
    ({"num_speculative_tokens": -1}, "num_speculative_tokens must be >= 0"),
  ],
)
def test_cache_config_names_the_parameter(bad, match):
  from jaxkv import CacheConfig

  with pytest.raises(ValueError, match=match):
    CacheConfig(**bad)


def test_one_resolver_and_the_runner_decides_each_kernels_path():
  """``"auto"`` means one thing for every kernel (the compiled kernel where it runs, else XLA), and
  the runner, through the protocol, decides each kernel's path under its switch."""
  from pallas_kernels import resolve_implementation

  assert resolve_implementation("auto", runs_here=True) == "pallas"
  assert resolve_implementation("auto", kernel="tokamax", runs_here=False) == "xla"
  assert resolve_implementation("auto") == ("xla" if jax.default_backend() == "cpu" else "pallas")
  with pytest.raises(ValueError, match=r"one of \('tokamax', 'xla', 'auto'\), got 'pallas'"):
    resolve_implementation("pallas", kernel="tokamax")
  on_cpu = jax.default_backend() == "cpu"
  for switch in ("xla", "pallas"):
    r = dataclasses.replace(runner(), implementation=switch)
    assert r.kernel_implementation("sparse_mla_decode") == switch  # attention kernels follow the switch
    # The KDA recurrence and the step metadata run compiled on any GPU; on the CPU as the switch says.
    for kernel in ("fused_recurrent_kda", "compute_step_metadata"):
      assert r.kernel_implementation(kernel) == (switch if on_cpu else "pallas")
    assert r.kernel_implementation("compute_step_metadata", "xla") == "xla"  # a named path as asked
  engine = LLMEngine(runner(), cfg())
  want = runner().kernel_implementation("compute_step_metadata")
  assert engine.executor.statics.metadata_spec.implementation == want  # resolved once, at construction
