import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import BlockTable, MultiGroupBlockTable, get_block_table_width


def test_row_operations():
  bt = BlockTable(16, max_num_reqs=3, max_num_blocks_per_req=4)
  bt.add_row([5, 2], 0)
  bt.append_row([9], 0)
  bt.add_row([7], 1)
  np.testing.assert_array_equal(bt.block_table[0], [5, 2, 9, 0])
  np.testing.assert_array_equal(bt.num_blocks_per_row, [3, 1, 0])
  bt.swap_row(0, 1)
  np.testing.assert_array_equal(bt.block_table[:2], [[7, 0, 0, 0], [5, 2, 9, 0]])
  np.testing.assert_array_equal(bt.num_blocks_per_row, [1, 3, 0])
  bt.move_row(1, 2)
  np.testing.assert_array_equal(bt.block_table[1], [0, 0, 0, 0])  # vacated row zeroed
  np.testing.assert_array_equal(bt.block_table[2], [5, 2, 9, 0])
  np.testing.assert_array_equal(bt.num_blocks_per_row, [1, 0, 3])
  bt.add_row([3], 2)
  np.testing.assert_array_equal(bt.block_table[2, :1], [3])
  assert bt.num_blocks_per_row[2] == 1
  bt.clear_row(0)
  assert bt.num_blocks_per_row[0] == 0 and not bt.block_table[0].any()
  bt.clear()
  assert not bt.block_table.any() and not bt.num_blocks_per_row.any()


def test_capacity_errors_name_request_group_and_capacity():
  bt = BlockTable(16, 2, 3, group_id=4)
  bt.append_row([1, 2], 1)
  with pytest.raises(RuntimeError, match=r"request 1, group 4 exceeds row capacity \(4 > 3\)"):
    bt.append_row([3, 4], 1)
  np.testing.assert_array_equal(bt.block_table[1], [1, 2, 0])  # nothing written
  with pytest.raises(RuntimeError, match="row 2 of group 4 is outside"):
    bt.append_row([1], 2)


def test_multi_group_writes_are_all_or_nothing():
  mg = MultiGroupBlockTable([16, 32, 8], max_num_reqs=2, max_num_blocks=[3, 3, 2])
  mg.add_row(([1, 2], [10, 11], []), 0)
  mg.add_row(([3], [12], [5, 6]), 1)
  np.testing.assert_array_equal(mg[0].num_blocks_per_row, [2, 1])
  np.testing.assert_array_equal(mg[1].num_blocks_per_row, [2, 1])
  np.testing.assert_array_equal(mg[2].num_blocks_per_row, [0, 2])
  mg.append_row(([7], [13], [8]), 0)
  np.testing.assert_array_equal(mg[0].block_table[0], [1, 2, 7])
  np.testing.assert_array_equal(mg[1].block_table[0], [10, 11, 13])
  np.testing.assert_array_equal(mg[2].block_table[0], [8, 0])
  with pytest.raises(RuntimeError, match=r"request 1, group 2 exceeds row capacity \(3 > 2\)"):
    mg.append_row(([4], [14], [9]), 1)
  np.testing.assert_array_equal(mg[0].block_table[1], [3, 0, 0])  # group 0 untouched too


def test_commit_is_fixed_shape_and_detached_from_host():
  mg = MultiGroupBlockTable([16, 4], max_num_reqs=4, max_num_blocks=[8, 1])
  mg.add_row(([1, 2], [3]), 2)
  (t0, n0), (t1, n1) = mg.commit()
  assert t0.shape == (4, 8) and t1.shape == (4, 1) and t0.dtype == jnp.int32
  mg.clear()
  np.testing.assert_array_equal(t0[2, :2], [1, 2])
  np.testing.assert_array_equal(n0, [0, 0, 2, 0])


def test_block_table_width_alignment():
  assert get_block_table_width(5, 16) == 5
  assert get_block_table_width(5, 16, token_alignment=128) == 8
  assert get_block_table_width(3, 256, token_alignment=128) == 3
