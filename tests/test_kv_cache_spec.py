import pytest

from jaxkv import (
  AttentionBackend,
  CircularBufferSpec,
  FullAttentionSpec,
  LinearAttentionStateSpec,
  MLAAttentionSpec,
  MultipleOf,
  customize_attention_spec,
  select_common_block_size,
)


def kpool_spec(block_size, alignment=None):
  return MLAAttentionSpec(
    block_size=block_size,
    num_kv_heads=1,
    head_size=128,
    dtype="uint8",
    state_content_bytes=132,
    compress_ratio=4,
    block_stride_alignment=alignment,
  )


@pytest.mark.parametrize("block_size, expected", [(1024, 64 * 132), (384, 32 * 132), (256, 1)])
def test_multiple_of_resolves_against_final_block_size(block_size, expected):
  spec = kpool_spec(block_size, MultipleOf(256))
  assert spec.get_block_stride_alignment() == expected
  assert [8448, 4224, 1] == [kpool_spec(b, MultipleOf(256)).get_block_stride_alignment() for b in (1024, 384, 256)]


def test_customize_gives_fixed_size_backends_multiple_of_max():
  spec = customize_attention_spec(AttentionBackend("idx", (128, 256)), kpool_spec(1024))
  assert spec.block_stride_alignment == MultipleOf(256)
  # MultipleOf backends and explicit alignments are left alone.
  assert (
    customize_attention_spec(AttentionBackend("mla", (MultipleOf(64),)), kpool_spec(1024)).block_stride_alignment
    is None
  )
  assert customize_attention_spec(AttentionBackend("idx", (128,)), kpool_spec(1024, 7)).block_stride_alignment == 7


def test_int_and_none_alignments():
  assert kpool_spec(1024).get_block_stride_alignment() == 1
  assert kpool_spec(1024, 640).get_block_stride_alignment() == 640
  with pytest.raises(ValueError, match="block_stride_alignment must be positive"):
    kpool_spec(1024, 0)


def test_page_sizes():
  assert kpool_spec(1024).page_size_bytes == 256 * 132
  assert kpool_spec(1024).num_states == 256
  mla = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=512, dtype="bfloat16")
  assert mla.page_size_bytes == 64 * 512 * 2
  full = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="float32")
  assert full.page_size_bytes == 16 * 8 * 256 * 4
  assert full.max_memory_usage_bytes(33) == 3 * full.page_size_bytes
  padded = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=2, dtype="float32", page_size_padded=384)
  assert padded.page_size_bytes == 384 and padded.unpadded_page_size_bytes == 256
  with pytest.raises(ValueError, match="smaller than the page"):
    FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=2, dtype="float32", page_size_padded=100)


def test_compressed_block_must_hold_whole_states():
  with pytest.raises(ValueError, match="multiple of the compression ratio 4"):
    kpool_spec(1026)


def test_circular_buffer_spec():
  tail = CircularBufferSpec(block_size=8, num_kv_heads=2, head_size=128, head_size_v=0, dtype="bfloat16")
  assert tail.page_size_bytes == 2 * 8 * 128 * 2
  assert not tail.uses_slot_mapping and not tail.prefix_cacheable and tail.is_state
  assert tail.max_num_blocks_per_req(1 << 20) == 1
  assert tail.max_memory_usage_bytes(1 << 20) == tail.page_size_bytes


def test_linear_attention_state_spec():
  spec = LinearAttentionStateSpec(
    block_size=64, shapes=((3, 8192),) * 3 + ((64, 128, 128),), dtypes=("bfloat16",) * 3 + ("float32",)
  )
  assert spec.page_size_bytes == 3 * 3 * 8192 * 2 + 64 * 128 * 128 * 4
  assert spec.max_num_blocks_per_req(10**6) == 1 and not spec.uses_slot_mapping
  assert spec.copy_with_new_block_size(1024).page_size_bytes == spec.page_size_bytes
  with pytest.raises(ValueError, match="2 state shapes but 1 dtypes"):
    LinearAttentionStateSpec(block_size=64, shapes=((1,), (2,)), dtypes=("float32",))


def test_select_common_block_size():
  idx = AttentionBackend("glm5_indexer", (128, 256))
  mla = AttentionBackend("mla", (MultipleOf(64),))
  assert select_common_block_size(1024, [idx]) == 256
  assert select_common_block_size(384, [idx]) == 128
  assert select_common_block_size(256, [idx]) == 256
  assert select_common_block_size(1024, [mla]) == 1024
  assert select_common_block_size(640, [mla, idx]) == 128
  with pytest.raises(ValueError, match=r"No common block size for 64 \(glm5_indexer: 128, 256\)"):
    select_common_block_size(64, [idx])
