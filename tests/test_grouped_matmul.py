"""The MoE's grouped matmul against its row-by-row definition, on random ragged groups.

CI runs the XLA path (the CPU reference); on a GPU with tokamax installed the Mosaic GPU kernel is
checked by the same tests (docs/performance.md says where it ran)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul import (
  _tokamax_available,
  grouped_matmul,
  grouped_matmul_reference,
  grouped_matmul_implementation,
)

ON_GPU_WITH_TOKAMAX = jax.default_backend() in ("gpu", "cuda") and _tokamax_available()
# (implementation, tiling): tokamax's kernel with its own tiling and with one the sweep tries.
TILE = dict(block_m=64, block_n=64, block_k=128, num_stages=4, split_k=1, persistent=False)
PATHS = [("xla", None)] + ([("tokamax", None), ("tokamax", TILE)] if ON_GPU_WITH_TOKAMAX else [])
DTYPE = jnp.bfloat16 if ON_GPU_WITH_TOKAMAX else jnp.float32


@pytest.mark.parametrize("implementation, tiling", PATHS)
@pytest.mark.parametrize("m, groups, k, n", [(8, 16, 128, 64), (67, 5, 256, 128), (512, 32, 128, 256)])
def test_grouped_matmul_matches_definition(implementation, tiling, m, groups, k, n):
  rng = np.random.default_rng(m + groups)
  # Ragged sizes with empty groups, summing to m (as the MoE's sorted token copies do).
  cuts = np.sort(rng.integers(0, m + 1, groups - 1))
  sizes = np.diff(np.concatenate([[0], cuts, [m]])).astype(np.int32)
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
  with pytest.raises(ValueError, match=r"group_sizes must be int\[2\]"):
    grouped_matmul(lhs, rhs, jnp.asarray([1, 2, 3], jnp.int32))
  with pytest.raises(ValueError, match="must be one of"):
    grouped_matmul(lhs, rhs, sizes, implementation="cuda")
  with pytest.raises(ValueError, match=r"tiling \{'block_m': 64\} is for tokamax's kernel, but this call runs 'xla'"):
    grouped_matmul(lhs, rhs, sizes, implementation="auto", tiling={"block_m": 64})
  assert grouped_matmul_implementation("auto", jnp.float32) == "xla"  # float32 runs stay exact everywhere


def test_auto_on_a_gpu_without_tokamax_warns_once(monkeypatch):
  import pallas_kernels.grouped_matmul as gm

  monkeypatch.setattr(gm.jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(gm, "_tokamax_available", lambda: False)
  gm._warn_no_tokamax.cache_clear()
  with pytest.warns(RuntimeWarning, match="tokamax is not installed"):
    assert grouped_matmul_implementation("auto", jnp.bfloat16) == "xla"
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # said once per process
    assert grouped_matmul_implementation("auto", jnp.bfloat16) == "xla"
    assert grouped_matmul_implementation("auto", jnp.float32) == "xla"  # float32 never asks for tokamax
