"""The MoE's grouped matmul against its row-by-row definition, on random ragged groups.

CI runs the XLA path (the CPU reference) and the Pallas kernel interpreted (float32); on a GPU the
kernel runs compiled in bf16, and with tokamax installed its Mosaic GPU kernel is checked by the
same tests (docs/kernels.md says where they ran)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import json

import pallas_kernels.grouped_matmul as gm
from pallas_kernels.grouped_matmul import (
  PALLAS_MAX_ROWS,
  _tokamax_available,
  grouped_matmul,
  grouped_matmul_reference,
  grouped_matmul_implementation,
  tokamax_tilings,
  tuning_path,
)

ON_GPU = jax.default_backend() in ("gpu", "cuda")
ON_GPU_WITH_TOKAMAX = ON_GPU and _tokamax_available()
# (implementation, tiling): each kernel with its own tiling and with one its sweep tries.
TILE = dict(block_m=64, block_n=64, block_k=128, num_stages=4, split_k=1, persistent=False)
PATHS = [("xla", None), ("pallas", None), ("pallas", dict(block_n=64, block_k=64, num_stages=3))] + (
  [("tokamax", None), ("tokamax", TILE)] if ON_GPU_WITH_TOKAMAX else []
)
DTYPE = jnp.bfloat16 if ON_GPU else jnp.float32


def _ragged(rng, m, groups, end=None):
  """Random sizes with empty groups, summing to ``end`` (``m``: as the MoE's sorted token copies do)."""
  end = m if end is None else end
  cuts = np.sort(rng.integers(0, end + 1, groups - 1))
  return np.diff(np.concatenate([[0], cuts, [end]])).astype(np.int32)


@pytest.mark.parametrize("implementation, tiling", PATHS)
@pytest.mark.parametrize("m, groups, k, n", [(8, 16, 128, 64), (67, 5, 256, 128), (512, 32, 128, 256)])
def test_grouped_matmul_matches_definition(implementation, tiling, m, groups, k, n):
  rng = np.random.default_rng(m + groups)
  sizes = _ragged(rng, m, groups)
  assert (sizes == 0).any() or groups > m // 2
  lhs = jnp.asarray(rng.standard_normal((m, k)), DTYPE)
  rhs = jnp.asarray(rng.standard_normal((groups, k, n)) / np.sqrt(k), DTYPE)
  got = grouped_matmul(lhs, rhs, jnp.asarray(sizes), implementation=implementation, tiling=tiling)
  got = np.asarray(got, np.float32)
  want = np.asarray(grouped_matmul_reference(lhs, rhs, jnp.asarray(sizes)))
  tol = 2e-2 if DTYPE == jnp.bfloat16 else 1e-5
  np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
  # Independent oracle: each group's block of rows times its matrix, in float64.
  start = 0
  for g, s in enumerate(sizes):
    block = np.asarray(lhs[start : start + s], np.float64) @ np.asarray(rhs[g], np.float64)
    np.testing.assert_allclose(want[start : start + s], block, rtol=1e-4, atol=1e-4)
    start += s


def test_rows_past_the_groups_are_zero_and_errors_name_shapes():
  lhs = jnp.ones((6, 8), jnp.float32)
  rhs = jnp.ones((2, 8, 4), jnp.float32)
  sizes = jnp.asarray([2, 1], jnp.int32)
  assert not np.asarray(grouped_matmul_reference(lhs, rhs, sizes))[3:].any()
  assert not np.asarray(grouped_matmul(lhs, rhs, sizes, implementation="xla"))[3:].any()
  with pytest.raises(ValueError, match=r"must agree in K, got \[6, 8\] and \[2, 7, 4\]"):
    grouped_matmul(lhs, jnp.ones((2, 7, 4)), sizes)
  with pytest.raises(ValueError, match=r"rhs \[0, 8, 4\] holds no group"):
    grouped_matmul(lhs, jnp.ones((0, 8, 4)), jnp.zeros((0,), jnp.int32))
  with pytest.raises(ValueError, match=r"group_sizes must be int\[2\]"):
    grouped_matmul(lhs, rhs, jnp.asarray([1, 2, 3], jnp.int32))
  with pytest.raises(ValueError, match="must be one of"):
    grouped_matmul(lhs, rhs, sizes, implementation="cuda")
  with pytest.raises(ValueError, match=r"tiling \{'block_m': 64\} is for a kernel, but this call runs 'xla'"):
    grouped_matmul(lhs, rhs, sizes, implementation="auto", tiling={"block_m": 64})
  with pytest.raises(ValueError, match=r"tiling keys \['persistent'\] are not the Pallas kernel's"):
    grouped_matmul(lhs, rhs, sizes, implementation="pallas", tiling={"persistent": True})
  with pytest.raises(ValueError, match="tiling block_n=48 must be a power of two"):
    grouped_matmul(lhs, rhs, sizes, implementation="pallas", tiling={"block_n": 48})
  assert grouped_matmul_implementation("auto", jnp.float32) == "xla"  # float32 runs stay exact everywhere


@pytest.mark.parametrize("tokamax", [True, False])
def test_auto_runs_the_pallas_kernel_for_decode_steps(monkeypatch, tokamax):
  import pallas_kernels.grouped_matmul as gm

  monkeypatch.setattr(gm, "target_backend", lambda: "gpu")
  monkeypatch.setattr(gm, "_tokamax_available", lambda: tokamax)
  assert grouped_matmul_implementation("auto", jnp.bfloat16, rows=PALLAS_MAX_ROWS) == "pallas"
  # Prefill-sized steps (and prepare_grouped_matmul, which asks for any size): tokamax where it is.
  big = "tokamax" if tokamax else "pallas"
  assert grouped_matmul_implementation("auto", jnp.bfloat16, rows=PALLAS_MAX_ROWS + 1) == big
  assert grouped_matmul_implementation("auto", jnp.bfloat16) == big
  assert grouped_matmul_implementation("auto", jnp.float32, rows=8) == "xla"


@pytest.mark.parametrize("m, end", [(40, 40), (40, 23), (5, 0)])
def test_pallas_writes_every_row_and_zeros_past_the_groups(m, end):
  # Interpreted, a kernel's output starts as NaN: a row no block wrote would show.
  rng = np.random.default_rng(m + end)
  sizes = _ragged(rng, m, 12, end)
  lhs = jnp.asarray(rng.standard_normal((m, 48)), DTYPE)
  rhs = jnp.asarray(rng.standard_normal((12, 48, 40)) / 7, DTYPE)
  got = np.asarray(grouped_matmul(lhs, rhs, jnp.asarray(sizes), implementation="pallas"), np.float32)
  assert np.isfinite(got).all()
  assert not got[end:].any()
  want = np.asarray(grouped_matmul_reference(lhs, rhs, jnp.asarray(sizes)))
  tol = 2e-2 if DTYPE == jnp.bfloat16 else 1e-5
  np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("m, groups, total", [(256, 288, 256), (40, 12, 23), (40, 12, 61), (7, 300, 0)])
def test_row_blocks_list_each_groups_rows_then_the_rest(m, groups, total):
  """The kernel's row blocks against their definition, for sizes that fill the rows, stop short of
  them or overrun them (rows past ``m`` belong to no output)."""
  rng = np.random.default_rng(m + groups + total)
  sizes = np.bincount(rng.integers(0, groups, total), minlength=groups).astype(np.int32)
  bm = 16
  want, first = [], 0
  for g, s in enumerate(sizes):
    s = min(int(s), m - first)
    want += [(g, first + i, min(bm, s - i)) for i in range(0, s, bm)]
    first += s
  want += [(-1, r, min(bm, m - r)) for r in range(first, m, bm)]
  group, start, rows = (np.asarray(a) for a in gm._row_blocks(jnp.asarray(sizes), m, bm))
  used = rows > 0
  assert list(zip(group[used], start[used], rows[used], strict=True)) == want
  assert used[: len(want)].all() and not used[len(want) :].any()


def test_pallas_row_is_bitwise_the_same_in_any_group_layout():
  """What the engine's bitwise claims need from the kernel: a token's output does not depend on the
  other rows of its step, nor on where its row sits in its expert's blocks."""
  rng = np.random.default_rng(3)
  g, k, n = 6, 256, 128
  rhs = jnp.asarray(rng.standard_normal((g, k, n)) / 16, DTYPE)
  probe = rng.standard_normal((3, k))  # rows of groups 1, 1 and 4
  outs = []
  for before in (0, 5, 17):  # other rows of group 1 ahead of the probes: other blocks, other lanes
    sizes = np.array([3, before + 2, 0, 9, 1, 4], np.int32)
    lhs = rng.standard_normal((int(sizes.sum()), k))
    at = [3 + before, 4 + before, int(sizes[:4].sum())]
    lhs[at] = probe
    got = grouped_matmul(jnp.asarray(lhs, DTYPE), rhs, jnp.asarray(sizes), implementation="pallas")
    outs.append(np.asarray(got)[at])
  bits = lambda a: a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)
  for other in outs[1:]:
    np.testing.assert_array_equal(bits(other), bits(outs[0]))


# The tuning tables (benchmarks/tune_moe.py): one per GPU kind, read by the tokamax path.
TABLES = sorted(gm.TUNING_DIR.glob("*.json"))


def test_a_tuning_table_is_read_for_its_device_and_shapes_only(tmp_path, monkeypatch):
  monkeypatch.setattr(gm, "TUNING_DIR", tmp_path)
  tokamax_tilings.cache_clear()
  config = dict(block_m=128, block_n=128, block_k=64, num_stages=3)
  shape = dict(groups=288, rows=65536, k=4096, n=2048)
  table = dict(device_kind="NVIDIA H100 80GB HBM3", shapes=[dict(**shape, config=config, ms=2.3, heuristic_ms=4.7)])
  tuning_path("NVIDIA H100 80GB HBM3").write_text(json.dumps(table))
  try:
    assert tuning_path("NVIDIA H100 80GB HBM3").name == "tokamax_ragged_dot_nvidia_h100_80gb_hbm3.json"
    assert tokamax_tilings("NVIDIA H100 80GB HBM3") == {(288, 65536, 4096, 2048): config}
    assert tokamax_tilings("NVIDIA H200") == {}  # no table: tokamax's heuristics
    # A table under another GPU's name, or not JSON: an error naming the file and the fix.
    tuning_path("NVIDIA H200").write_text(json.dumps(table))
    tokamax_tilings.cache_clear()  # read once a process: its H200 entry was "no table"
    with pytest.raises(RuntimeError, match="tokamax_ragged_dot_nvidia_h200.json.*device_kind is 'NVIDIA H100"):
      tokamax_tilings("NVIDIA H200")
    tuning_path("NVIDIA B200").write_text("{not json")
    with pytest.raises(RuntimeError, match="rerun benchmarks/tune_moe.py"):
      tokamax_tilings("NVIDIA B200")
  finally:
    tokamax_tilings.cache_clear()


@pytest.mark.parametrize("path", TABLES, ids=lambda p: p.name)
def test_tuning_tables_are_well_formed_and_run_bitwise_on_their_gpu(path):
  """Each table's shapes and tilings; on its GPU kind (with tokamax), each shape's serving call."""
  table = json.loads(path.read_text())
  assert tuning_path(table["device_kind"]) == path
  tilings = tokamax_tilings(table["device_kind"])
  assert len(tilings) == len(table["shapes"]) > 0
  for s in table["shapes"]:
    assert s["rows"] > PALLAS_MAX_ROWS, f"{s}: steps of <= {PALLAS_MAX_ROWS} rows never run tokamax"
    assert tilings[s["groups"], s["rows"], s["k"], s["n"]] == s["config"]
    # Never slower than tokamax's own choice, timed beside it.
    assert 0 < s["ms"] <= s["heuristic_ms"], s
    for key in ("block_m", "block_n", "block_k"):
      assert s["config"][key] & (s["config"][key] - 1) == 0, f"{key} {s['config'][key]} is not a power of two"
    if ON_GPU_WITH_TOKAMAX and jax.devices()[0].device_kind == table["device_kind"]:
      for skew in (0.0, 3.0):
        _check_tuned_tiling((s["groups"], s["rows"], s["k"], s["n"]), s["config"], skew)


def _check_tuned_tiling(shape, tiling, skew):
  """The serving call runs the table's tiling (bitwise its output), which computes bitwise what
  tokamax's heuristics' tiling does, and matches the definition. ``skew``: 8 distinct experts a
  token drawn with weights ``1 / rank ** skew`` (0: uniform; 3: 160 of 288 experts at 65,536 rows,
  groups of up to a whole step, as a random model's router sends 8,192 tokens to about 60)."""
  groups, m, k, n = shape
  rng = np.random.default_rng(m + k)
  logits = -skew * np.log(rng.permutation(groups) + 1.0)
  chosen = np.argsort(-(logits + rng.gumbel(size=(m // 8, groups))), axis=1)[:, :8]  # Gumbel top-8
  sizes = jnp.asarray(np.bincount(chosen.ravel(), minlength=groups).astype(np.int32))
  lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  rhs = jax.random.normal(jax.random.key(m), (groups, k, n), jnp.bfloat16) / float(np.sqrt(k))
  served = np.asarray(grouped_matmul(lhs, rhs, sizes, implementation="tokamax"))
  tuned = np.asarray(grouped_matmul(lhs, rhs, sizes, implementation="tokamax", tiling=tiling))
  tokamax_tilings.cache_clear()
  try:
    with pytest.MonkeyPatch.context() as mp:
      mp.setattr(gm, "TUNING_DIR", gm.TUNING_DIR / "absent")
      heuristic = np.asarray(grouped_matmul(lhs, rhs, sizes, implementation="tokamax"))
  finally:
    tokamax_tilings.cache_clear()
  np.testing.assert_array_equal(served, tuned)
  np.testing.assert_array_equal(served, heuristic)
  # The definition on a sample of rows (the whole reference would gather [m, k, n] weights).
  ends = np.cumsum(np.asarray(sizes))
  rows = rng.choice(m, 64, replace=False)
  group = np.searchsorted(ends, rows, side="right")
  want = np.einsum("rk,rkn->rn", np.asarray(lhs[rows], np.float32), np.asarray(rhs[group], np.float32))
  np.testing.assert_allclose(served[rows].astype(np.float32), want, rtol=2e-2, atol=2e-2)
