"""The planner on GLM-5.3-Flash (real and tiny) and its errors."""

import json

import jax.numpy as jnp
import pytest

from jaxkv import (
  AttentionBackend,
  CacheConfig,
  CircularBufferSpec,
  FullAttentionSpec,
  KVCacheLayer,
  plan_kv_cache,
)
from models.glm5_next import get_config, get_kv_cache_layers, load_config, tail_ring_size
from models.glm5_next.config import BUILTIN_CONFIGS

GIB = 2**30


def glm_plan(block_size=1024, layout="packed", memory=80 * GIB, max_len=1 << 20, **kw):
  kw = {"kv_cache_dtype": "bfloat16", "indexer_cache_dtype": "fp8", **kw}
  cfg = get_config("glm-5.3-flash")
  cache = CacheConfig(
    block_size=block_size,
    layout=layout,
    memory_bytes=memory,
    max_model_len=max_len,
    state_dtype="bfloat16",
    **kw,
  )
  return plan_kv_cache(get_kv_cache_layers(cfg, cache), cache)


def test_glm_packed_plan_at_1024():
  plan = glm_plan()
  groups = plan.kv_cache_groups
  assert len(groups[0].layer_names) == 22  # 11 MLA latents + 11 pooled-key caches share a table
  assert sum(len(g.layer_names) for g in groups if g.kv_cache_spec.is_state and "kda" in g.layer_names[0]) == 34
  tail = [g for g in groups if isinstance(g.kv_cache_spec, CircularBufferSpec)]
  assert len(tail) == 1 and len(tail[0].layer_names) == 11 and tail[0].kv_cache_spec.block_size == 4
  idx = [ag for ag in plan.attention_groups if ag.backend.name == "glm5_indexer"][0]
  assert idx.kernel_block_size == 256 and idx.blocks_per_kernel_block == 4
  assert idx.kv_cache_spec.get_block_stride_alignment() == 64 * 132
  assert plan.bytes_per_block % (64 * 132) == 0
  assert idx.stride == plan.bytes_per_block // (64 * 132)
  mla_page = 1024 * 512 * 2
  assert plan.bytes_per_block >= 11 * (mla_page + 256 * 132)
  assert plan.num_blocks == 80 * GIB // plan.bytes_per_block
  # Every indexer page starts on a kernel-page boundary of the arena.
  for v in plan.views:
    if v.layer_name.endswith(".indexer"):
      assert v.tensor_offset_bytes % (64 * 132) == 0 and v.stride == idx.stride
      assert (v.row_bytes, v.base_row, v.offset_bytes) == (64 * 132, v.tensor_offset_bytes // (64 * 132), 0)
  # Groups alias from byte 0, and no group's layers overlap inside a block.
  for g in groups:
    spans = sorted((plan.view(n).tensor_offset_bytes, plan.view(n).page_bytes) for n in g.layer_names)
    for (o1, s1), (o2, _) in zip(spans, spans[1:]):
      assert o1 + s1 <= o2
    assert spans[-1][0] + spans[-1][1] <= plan.bytes_per_block
  json.dumps(plan.describe())


def test_glm_dense_plan_splits_at_allocation():
  plan = glm_plan(layout="dense", memory=200 * GIB, max_len=131072)
  v = plan.view("layers.3.self_attn.indexer")
  assert v.kernel_block_size == 256 and v.stride == 4 and v.tensor_offset_bytes == 0 and v.row_bytes == 64 * 132
  t = [t for t in plan.tensors if t.name == v.tensor][0]
  assert (t.num_rows, t.row_bytes) == (plan.num_blocks * 4, 64 * 132)
  assert plan.bytes_per_block == sum(vv.page_bytes for vv in plan.views)


def test_dense_kernel_split_of_token_cache():
  plan = glm_plan(layout="dense", memory=200 * GIB, max_len=131072, kernel_block_size=256)
  mla = plan.view("layers.3.self_attn.mla")
  assert mla.kernel_block_size == 256 and mla.stride == 4 and mla.kernel_page_bytes == 256 * 1024
  assert mla.tokens_per_row == 256 and mla.row_bytes == 256 * 1024


@pytest.mark.parametrize("block_size, page_entries", [(384, 32), (640, 32), (1152, 32), (4608, 64), (2048, 64)])
def test_indexer_page_and_alignment_follow_block_size(block_size, page_entries):
  plan = glm_plan(block_size=block_size, memory=200 * GIB)
  idx = [ag for ag in plan.attention_groups if ag.backend.name == "glm5_indexer"][0]
  assert idx.states_per_kernel_page == page_entries
  assert plan.bytes_per_block % (page_entries * 132) == 0


def test_indexer_unsplit_at_256():
  plan = glm_plan(block_size=256, layout="dense", memory=200 * GIB, max_len=8192)
  idx = [ag for ag in plan.attention_groups if ag.backend.name == "glm5_indexer"][0]
  assert idx.kernel_block_size is None and idx.kv_cache_spec.get_block_stride_alignment() == 1


def test_hybrid_state_pages_scale_the_block_size():
  plan = glm_plan(block_size=128)
  assert plan.requested_block_size == 128 and plan.block_size % 128 == 0 and plan.block_size > 128
  token_bytes = sum(s.page_size_bytes for s in plan.kv_cache_groups[0].layer_specs)
  kda_page = max(s.page_size_bytes for g in plan.kv_cache_groups for s in g.layer_specs if "State" in type(s).__name__)
  assert token_bytes >= kda_page


def test_chunked_linear_prefill_adds_the_unfinished_chunk_to_each_kda_page():
  cfg = get_config("glm-5.3-flash")
  pages = {}
  for mode in ("recurrent", "chunked"):
    cache = CacheConfig(block_size=1024, state_dtype="bfloat16", linear_prefill=mode)
    (kda, *_) = [x.spec for x in get_kv_cache_layers(cfg, cache) if x.name.endswith(".kda")]
    pages[mode] = kda.page_size_bytes
  h, d = cfg.linear_num_heads, cfg.linear_head_dim
  # k, g, v rows [64, H, K] and beta [64, H], float32.
  assert pages["chunked"] - pages["recurrent"] == 64 * h * (3 * d + 1) * 4
  with pytest.raises(ValueError, match="linear_prefill must be one of .*'chunkwise'"):
    CacheConfig(linear_prefill="chunkwise")


def test_errors_name_the_values():
  with pytest.raises(ValueError, match=r"No common block size for 64 \(glm5_indexer: 128, 256\)"):
    glm_plan(block_size=64, layout="dense", memory=1000 * GIB, max_len=4096)
  with pytest.raises(ValueError, match="Kernel block size 96 does not divide the KV cache block size 1024"):
    glm_plan(kernel_block_size=96)
  with pytest.raises(
    ValueError, match="glm5_sparse_mla needs 256-token kernel blocks, which packed 1024-token .* cannot be split into"
  ):
    glm_plan(kernel_block_size=256)
  with pytest.raises(
    ValueError,
    match=r"memory_bytes 1,073,741,824 \(1.00 GiB\) holds 90 blocks .* Raise memory_bytes "
    r"to at least 12,423,882,240 \(11.57 GiB\)",
  ):
    glm_plan(memory=1 * GIB)
  with pytest.raises(ValueError, match=r"Raise memory_bytes to at least 238,233,600 \(227.20 MiB\)"):
    glm_plan(memory=1 << 20, max_len=1024)  # small sizes are not rounded to "0.000 GiB"
  with pytest.raises(ValueError, match="layout must be one of"):
    glm_plan(layout="blhnc")


def test_ring_must_divide_block_size():
  ring = CircularBufferSpec(block_size=12, num_kv_heads=2, head_size=16, head_size_v=0, dtype="bfloat16")
  full = FullAttentionSpec(block_size=64, num_kv_heads=1, head_size=16, dtype="bfloat16")
  layers = [KVCacheLayer("a", full, AttentionBackend("a")), KVCacheLayer("t", ring, AttentionBackend("t"))]
  with pytest.raises(ValueError, match="block size 64 must be a multiple of its ring of 12"):
    plan_kv_cache(layers, CacheConfig(block_size=64, memory_bytes=GIB, max_model_len=1024))


def test_padded_pages_cannot_be_split():
  spec = FullAttentionSpec(block_size=64, num_kv_heads=1, head_size=16, dtype="bfloat16", page_size_padded=8192)
  layers = [KVCacheLayer("a", spec, AttentionBackend("k", (16,)))]
  with pytest.raises(ValueError, match="Padded KV pages do not support kernel block splitting"):
    plan_kv_cache(
      layers, CacheConfig(block_size=64, memory_bytes=GIB, max_model_len=1024, layout="dense", kernel_block_size=16)
    )


def test_tail_ring_size():
  # vLLM 0.33.0: kpool * next_pow2(cdiv(kpool + num_spec, kpool)).
  assert [tail_ring_size(4, s) for s in (0, 1, 4, 5, 7, 12, 13)] == [4, 8, 8, 16, 16, 16, 32]
  assert [tail_ring_size(16, s) for s in (0, 3, 17)] == [16, 32, 64]


@pytest.mark.parametrize("block_size", [640, 1024])
@pytest.mark.parametrize("num_spec", [5, 7])
def test_glm_plans_with_five_to_seven_drafts(block_size, num_spec):
  """A ring of 16 divides 640 and 1024 (a ring of 12 did not, and the planner refused them)."""
  plan = glm_plan(block_size=block_size, num_speculative_tokens=num_spec)
  tail = [g for g in plan.kv_cache_groups if isinstance(g.kv_cache_spec, CircularBufferSpec)]
  assert tail[0].kv_cache_spec.block_size == 16


def test_tiny_plan_allocates_and_binds_real_arrays():
  cfg = get_config("glm-5.3-flash-tiny")
  for layout in ("dense", "packed"):
    cache = CacheConfig(
      block_size=256, memory_bytes=64 << 20, max_model_len=256, layout=layout, num_speculative_tokens=3
    )
    plan = plan_kv_cache(get_kv_cache_layers(cfg, cache), cache)
    assert plan.max_model_len == 259  # drafts write up to k positions past a request's end
    arrays = plan.allocate()
    assert sum(a.nbytes for a in arrays.values()) == sum(t.size_bytes for t in plan.tensors)
    for v in plan.views:
      ag = plan.attention_groups[v.attention_group_id]
      arr = arrays[v.tensor]
      # Binding the real array gives the planned view, and the group's stride is the view's.
      assert (
        ag.map_kv_cache_to_kernel_blocks(
          v.layer_name,
          v.tensor,
          arr.shape,
          page_offset_bytes=v.tensor_offset_bytes,
          block_stride_bytes=v.block_stride_bytes,
          attention_group_id=v.attention_group_id,
        )
        == v
      )
      assert ag.stride == v.stride and arr.size % v.row_bytes == 0 and arr.dtype == jnp.uint8


def test_hf_config_json_flat_and_nested(tmp_path):
  text = BUILTIN_CONFIGS["glm-5.3-flash-tiny"]()
  (tmp_path / "flat").mkdir()
  (tmp_path / "flat" / "config.json").write_text(json.dumps(text))
  (tmp_path / "nested").mkdir()
  (tmp_path / "nested" / "config.json").write_text(
    json.dumps({"model_type": "glm5_next", "text_config": text, "vision_config": {"depth": 1}})
  )
  assert load_config(tmp_path / "flat") == load_config(tmp_path / "nested") == get_config("glm-5.3-flash-tiny")
  (tmp_path / "bad").mkdir()
  (tmp_path / "bad" / "config.json").write_text(json.dumps({"model_type": "llama"}))
  with pytest.raises(ValueError, match="'llama' is not a glm5_next config"):
    load_config(tmp_path / "bad")
  with pytest.raises(ValueError, match="no config.json"):
    load_config(tmp_path)


@pytest.mark.parametrize("layout", ["packed", "dense"])
@pytest.mark.parametrize("kv, idx", [("bfloat16", "fp8"), ("fp8", "float32")])
def test_views_carry_each_caches_entry_encoding(layout, kv, idx):
  """The kernels read how an entry is encoded from the view: the planner takes it from the spec."""
  plan = glm_plan(
    block_size=256, layout=layout, memory=16 * GIB, max_len=1 << 14, kv_cache_dtype=kv, indexer_cache_dtype=idx
  )
  by_kind = {}
  for v in plan.views:
    by_kind.setdefault(v.layer_name.rsplit(".", 1)[-1], set()).add(v.cache_dtype)
  assert by_kind["mla"] == {kv} and by_kind["indexer"] == {idx}
  assert all(d == {None} for k, d in by_kind.items() if k not in ("mla", "indexer"))  # rings and states


def test_spec_refuses_an_unknown_entry_encoding():
  with pytest.raises(ValueError, match=r"cache_dtype must be one of \('bfloat16', 'float32', 'fp8'\), got 'int4'"):
    FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype="uint8", cache_dtype="int4")
