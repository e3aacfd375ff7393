"""The weights' PartitionSpecs and one device's share (``jaxkv inspect --tensor-parallel-size``): the
counts against hand arithmetic and against the unsharded count, and the specs applied to a real
8-device CPU mesh (a subprocess: the device count is fixed when JAX starts)."""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest
from jax.sharding import PartitionSpec as P

from jaxkv import CacheConfig
from jaxkv.cache.kv_cache_config import plan_kv_cache
from jaxkv.cli import main
from models.glm5_next import get_config, get_kv_cache_layers
from models.glm5_next.runner import FAMILY
from models.glm5_next.sharding import DATA, TENSOR, partition_spec, per_device_weight_bytes

CFG = get_config("glm-5.3-flash")
CACHE = CacheConfig(
  block_size=1024,
  kv_cache_dtype="bfloat16",
  indexer_cache_dtype="fp8",
  state_dtype="bfloat16",
  memory_bytes=40 << 30,
  max_model_len=131072,
)


def run_on_cpu_devices(code: str, num_devices: int) -> list[str]:
  """Runs ``code`` in a fresh process with ``num_devices`` CPU devices (the count is fixed at JAX's
  start); returns its printed words, failing with its stderr when it fails."""
  env = {
    **os.environ,
    "XLA_FLAGS": f"--xla_force_host_platform_device_count={num_devices}",
    "JAX_PLATFORMS": "cpu",
  }
  out = subprocess.run(
    [sys.executable, "-c", code],
    capture_output=True,
    text=True,
    env=env,
    timeout=600,
    cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
  )
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout.split()


def test_rules_split_heads_vocab_and_experts():
  assert partition_spec("layers.3.self_attn.q_b_proj.weight", (16384, 1536)) == P(TENSOR, None)
  assert partition_spec("layers.3.self_attn.o_proj.weight", (4096, 16384)) == P(None, TENSOR)
  assert partition_spec("layers.3.self_attn.q_a_proj.weight", (1536, 4096)) == P(None, None)  # shared by heads
  assert partition_spec("layers.0.self_attn.k_conv1d", (8192, 1, 4)) == P(TENSOR, None, None)
  assert partition_spec("lm_head", (154880, 4096)) == P(TENSOR, None)
  assert partition_spec("layers.1.mlp.experts_down", (288, 2048, 4096)) == P(None, TENSOR, None)
  assert partition_spec("layers.1.mlp.experts_down", (288, 2048, 4096), expert_parallel=True) == P(
    (DATA, TENSOR), None, None
  )
  assert partition_spec("layers.1.mlp.gate_weight", (288, 4096)) == P(None, None)  # the router: replicated


def test_one_device_of_the_released_model():
  one = FAMILY.per_device(CFG, CACHE)
  assert one["weight_bytes_bf16"] == FAMILY.weight_bytes(CFG, "bfloat16")  # nothing split, nothing lost
  tp8 = FAMILY.per_device(CFG, CACHE, tensor_parallel_size=8, expert_parallel=True)
  dp_ep = FAMILY.per_device(CFG, CACHE, tensor_parallel_size=4, data_parallel_size=2, expert_parallel=True)
  experts = 3 * CFG.n_routed_experts * CFG.hidden_size * CFG.moe_intermediate_size * 2  # one layer, bf16
  moe_layers = sum(t == "sparse" for t in CFG.mlp_layer_types) + CFG.num_nextn_predict_layers
  # Experts are the bulk: 1/8 of them per device in both meshes, so the two differ only by the rest
  # (split over 4 instead of 8).
  assert tp8["weight_bytes_bf16"] < one["weight_bytes_bf16"] / 7
  assert moe_layers * experts / 8 < tp8["weight_bytes_bf16"] < dp_ep["weight_bytes_bf16"]
  rest_one = one["weight_bytes_bf16"] - moe_layers * experts
  assert dp_ep["weight_bytes_bf16"] - tp8["weight_bytes_bf16"] < rest_one / 4 - rest_one / 8 + 1
  # fp8: about half, plus one float32 scale per 128 x 128 block.
  assert 0.48 < tp8["weight_bytes_fp8"] / tp8["weight_bytes_bf16"] < 0.53

  # Packed: one arena row holds every group's pages, so every cache is one copy per device.
  def pages(plan, kind):
    return {g.kv_cache_spec.page_size_bytes for g in plan.kv_cache_groups if type(g.kv_cache_spec).__name__ == kind}

  for kind in ("LinearAttentionStateSpec", "MLAAttentionSpec"):
    assert pages(tp8["plan"], kind) == pages(one["plan"], kind)
  assert {t.shards for t in tp8["plan"].tensors} == {1}
  # Dense: each KDA layer's state tensor is split by head, 8 devices holding an eighth of its row
  # each; the latents and pooled keys keep their pages, one copy per device.
  dense = dataclasses.replace(CACHE, layout="dense")
  one_d = FAMILY.per_device(CFG, dense)["plan"]
  tp8_d = FAMILY.per_device(CFG, dense, tensor_parallel_size=8, expert_parallel=True)["plan"]
  (kda_one,), (kda_tp8,) = pages(one_d, "LinearAttentionStateSpec"), pages(tp8_d, "LinearAttentionStateSpec")
  assert kda_tp8 * 8 == kda_one
  assert pages(tp8_d, "MLAAttentionSpec") == pages(one_d, "MLAAttentionSpec")
  split = {t.name: t for t in tp8_d.tensors if t.shards > 1}
  assert set(split) == {f"layers.{i}.self_attn.kda" for i in CFG.kda_layers}
  assert all(t.row_bytes == kda_tp8 and t.shape_dtype().shape[1] == kda_one for t in split.values())
  assert tp8_d.num_blocks > one_d.num_blocks  # the same per-device budget holds more blocks
  with pytest.raises(ValueError, match="needs the dense layout"):
    plan_kv_cache(
      [dataclasses.replace(l, shards=8) if l.spec.is_state else l for l in get_kv_cache_layers(CFG, CACHE)], CACHE
    )


def test_sizes_that_do_not_divide_are_refused_with_the_sizes():
  with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide every head count"):
    FAMILY.per_device(CFG, CACHE, tensor_parallel_size=3)
  with pytest.raises(ValueError, match="288 experts over 80 devices"):
    FAMILY.per_device(CFG, CACHE, tensor_parallel_size=16, data_parallel_size=5, expert_parallel=True)
  with pytest.raises(ValueError, match=r"embed_tokens \[10, 4\]: dimension 0 \(10\) does not split over 4"):
    per_device_weight_bytes([("embed_tokens", (10, 4), 2)], tensor_parallel_size=4)


def test_inspect_prints_one_device(capsys):
  args = [
    "inspect",
    "--memory-gib",
    "40",
    "--max-model-len",
    "131072",
    "--tensor-parallel-size",
    "8",
    "--enable-expert-parallel",
  ]
  assert main(args + ["--json"]) == 0
  d = json.loads(capsys.readouterr().out)["per_device"]
  assert d["devices"] == 8 and d["weight_bytes_fp8"] < d["weight_bytes_bf16"] < 100 << 30
  assert d["total_bytes_bf16"] == d["weight_bytes_bf16"] + d["kv_cache_bytes"]
  assert main(args) == 0
  text = capsys.readouterr().out
  assert "Per device, 8 devices (tensor 8 x data 1, expert parallel on)" in text
  assert "every cache whole on each device" in text and "split 8 ways" not in text
  assert main(args + ["--layout", "dense"]) == 0
  text = capsys.readouterr().out
  assert "layers.0.self_attn.kda uint8[1413, 542720] per device (split 8 ways by head)" in text
  assert "KDA states split by head, latents and pooled keys whole" in text
  assert main(["inspect", "--tensor-parallel-size", "3"]) == 2
  assert "--tensor-parallel-size 3 must divide" in capsys.readouterr().err


def test_specs_shard_the_tiny_model_on_an_eight_device_cpu_mesh():
  """Every parameter placed with its spec on a 2 x 4 mesh: each device's shard has the local shape the
  byte count assumed."""
  code = textwrap.dedent("""
      import jax, numpy as np
      from flax import nnx
      from jax.sharding import Mesh, NamedSharding
      from models.glm5_next import Glm5NextForCausalLM, get_config
      from models.glm5_next.sharding import partition_spec, per_device_weight_bytes
      cfg = get_config("glm-5.3-flash-tiny")
      model = Glm5NextForCausalLM(cfg, rngs=nnx.Rngs(0))
      mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "tensor"))
      named = []
      for ep in (False, True):
        total = 0
        for k, v in nnx.to_flat_state(nnx.state(model)):
          name, x = ".".join(map(str, k)), v.get_value()
          placed = jax.device_put(x, NamedSharding(mesh, partition_spec(name, x.shape, expert_parallel=ep)))
          shard = placed.addressable_shards[0].data
          assert np.array_equal(np.asarray(placed), np.asarray(x)), name
          total += shard.size * x.dtype.itemsize
          if not ep:
            named.append((name, x.shape, x.dtype.itemsize))
        want = per_device_weight_bytes(named, tensor_parallel_size=4, data_parallel_size=2, expert_parallel=ep)
        assert total == want, (ep, total, want)
      print("ok", len(jax.devices()))
  """)
  assert run_on_cpu_devices(code, 8) == ["ok", "8"]


def test_paged_mqa_logits_split_by_rows_is_bitwise_the_whole_call():
  """On a mesh the indexer's logits run per device on its share of the step's rows
  (``HeadSharding.map`` over axis 0): each row keeps the single-device arithmetic, bitwise."""
  code = textwrap.dedent("""
      import jax, jax.numpy as jnp, numpy as np
      from jax.sharding import Mesh
      from jaxkv import KernelView
      from models.glm5_next.sharding import HeadSharding
      from pallas_kernels._common import quantize_fp8_pow2, value_bytes
      from pallas_kernels.paged_mqa_logits import paged_mqa_logits
      rng = np.random.default_rng(0)
      t, p, d, h, pages = 8, 32, 32, 16, 40
      q8, sc = quantize_fp8_pow2(jnp.asarray(rng.standard_normal((pages, p, d)), jnp.float32))
      cache = jnp.concatenate([value_bytes(q8).reshape(pages, -1), value_bytes(sc).reshape(pages, -1)], 1)
      view = KernelView.for_rows(cache.shape[1], entries_per_page=p, cache_dtype="fp8")
      q = jnp.asarray(rng.standard_normal((t, 1, h, d)), jnp.float32).astype(jnp.float8_e4m3fn)
      w = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
      ctx = jnp.asarray(rng.integers(1, 5 * p, (t, 1)), jnp.int32)
      table = jnp.asarray(np.stack([rng.permutation(pages)[:5] for _ in range(t)]), jnp.int32)
      fn = lambda *a: paged_mqa_logits(*a, view=view, implementation="pallas")
      whole = np.asarray(fn(q, cache, w, ctx, table))
      mesh = Mesh(np.array(jax.devices()).reshape(1, 2), ("data", "tensor"))
      split = HeadSharding(mesh).map(fn, (q, cache, w, ctx, table), (0, None, 0, 0, 0), (0,))
      assert [s.data.shape for s in split.addressable_shards] == [(t // 2, 5 * p)] * 2
      assert np.isfinite(whole).sum() == int(ctx.sum())  # -inf exactly past each row's entries
      np.testing.assert_array_equal(np.asarray(split), whole)
      print("ok")
  """)
  assert run_on_cpu_devices(code, 2) == ["ok"]


def test_shard_builds_the_model_on_the_mesh_and_leaves_the_runner_alone():
  """``runner.shard(mesh)`` is a new runner whose model was built with its ``ModelSharding`` (every
  MoE's experts and every attention module's kernels per device) over a placed copy of the weights;
  the runner it came from keeps its single-device graph and weights."""
  code = textwrap.dedent("""
      import jax, numpy as np
      from flax import nnx
      from jax.sharding import Mesh
      from models.glm5_next import Glm5NextForCausalLM, get_config
      from models.glm5_next.model import KimiDeltaAttention, MoE, SparseMLAttention
      from models.glm5_next.runner import Glm5NextRunner
      model = Glm5NextForCausalLM(get_config("glm-5.3-flash-tiny"), rngs=nnx.Rngs(0))
      runner = Glm5NextRunner.from_model(model, implementation="xla")
      mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "tensor"))
      sharded = runner.shard(mesh, expert_parallel=True)
      def kinds(r):
        out = []
        for _, m in nnx.iter_graph(r._model(r.params)):
          if isinstance(m, MoE):
            out.append(("moe", m.parallel and (m.parallel.mesh.shape["tensor"], m.parallel.expert_parallel)))
          if isinstance(m, (KimiDeltaAttention, SparseMLAttention)):
            out.append(("attn", m.head_sharding and m.head_sharding.size))
        return out
      assert kinds(runner) and all(v is None for _, v in kinds(runner)), kinds(runner)
      assert all(v == ((2, True) if k == "moe" else 2) for k, v in kinds(sharded)), kinds(sharded)
      flat = lambda r: [(k, v.get_value()) for k, v in nnx.to_flat_state(r.params)]
      for (k, a), (_, b) in zip(flat(runner), flat(sharded)):
        assert len(a.sharding.device_set) == 1 and len(b.sharding.device_set) == 4, k
        assert np.array_equal(np.asarray(a), np.asarray(b)), k
      try:
        runner.shard(Mesh(np.array(jax.devices()).reshape(1, 4)[:, :3], ("data", "tensor")))
      except ValueError as e:
        assert "must divide" in str(e), e
      else:
        raise AssertionError("a 3-way tensor axis was accepted")
      print("ok")
  """)
  assert run_on_cpu_devices(code, 4) == ["ok"]
