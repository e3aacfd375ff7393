import gc
import getpass
import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA's compiled programs kept on disk, shared by pytest's workers, the subprocesses tests start
# and the next run: many tests build engines of the same shapes, whose steps compile to the same
# programs. A cold cache took the 2-core suite from 18:45 to 16:35 (one file run again: 94 -> 36 s).
# jit's own cache (what the engine's compile counts read) is per process and unaffected.
os.environ.setdefault(
  "JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"jaxkv-tests-xla-{getpass.getuser()}")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(2 * 2**30))  # least recently used go

import hypothesis
import jax
import pytest

hypothesis.settings.register_profile("ci", deadline=None, max_examples=60, print_blob=True)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _memory_mappings() -> tuple[int, int] | None:
  """This process's memory mappings and the kernel's limit on them (Linux; None elsewhere)."""
  try:
    with open("/proc/self/maps") as maps, open("/proc/sys/vm/max_map_count") as limit:
      return sum(1 for _ in maps), int(limit.read())
  except OSError:
    return None


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drops jit's compiled programs after a test module once the worker holds a third of the
  memory mappings the kernel allows (one module added up to ~21,000). Each XLA CPU executable keeps
  several mappings of its code; a worker that kept every program of the suite neared the limit
  (65,530 here: ~60,000 by the end of the run) and XLA aborted while compiling when the next
  mapping failed. Clearing after every module cost 2.5 minutes of recompiling programs that later
  modules share; at a third of the limit it runs a few times a run."""
  yield
  mappings = _memory_mappings()
  if mappings is not None and mappings[0] > mappings[1] // 3:
    jax.clear_caches()
    gc.collect()
