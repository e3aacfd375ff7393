import gc
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import hypothesis
import jax
import pytest

hypothesis.settings.register_profile("ci", deadline=None, max_examples=60, print_blob=True)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drops jit's compiled programs after each test module. Each XLA CPU executable keeps several
  memory mappings of its code; a test worker that keeps every program of the suite reached ~60,000
  mappings, against the kernel's limit of 65,530 (vm.max_map_count), and XLA aborted while compiling
  when the next mapping failed."""
  yield
  jax.clear_caches()
  gc.collect()
