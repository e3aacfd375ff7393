import gc
import getpass
import os
import pathlib
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA's compiled programs kept on disk, shared by pytest's workers, the subprocesses tests start
# and the next run: many tests build engines of the same shapes, whose steps compile to the same
# programs. A warm cache runs a file again in a third of the time (test_prefix_caching.py: 94 ->
# 36 s); a cold one gains little (2-core suite: 16:35 and 17:04, against 16:04-18:45 without). CI's
# machine keeps it between runs. Processes under jax.distributed turn it off (sharded_engine_worker.py:
# gloo programs read back from it time out waiting for their peer).
# jit's own cache (what the engine's compile counts read) is per process and unaffected. No
# JAX_COMPILATION_CACHE_MAX_SIZE: its eviction lists the whole folder at every write, which slowed
# the suite past the uncached one; the folder is emptied at a run's start instead, once it is large.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
os.environ.setdefault(
  "JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"jaxkv-tests-xla-{getpass.getuser()}")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
_CACHE_LIMIT_BYTES = 2 << 30

import hypothesis  # noqa: E402 (after the environment JAX reads at import)
import jax  # noqa: E402
import pytest  # noqa: E402

if os.environ["JAX_PLATFORMS"].split(",")[0] in ("cuda", "gpu", "rocm"):
  # On a GPU each worker compiles its own programs. XLA's autotuner times GEMM algorithms at each
  # compile, so a program another process compiled may round differently from one compiled here:
  # a test that compares the two (the equivalence suite's baseline against a layout) sees bits no
  # engine produces. With the cache shared by 4 workers, 9 of 82 equivalence tests failed on an
  # H100; 3 of them, run in one process, passed (2026-12-07, docs/conformance.md).
  jax.config.update("jax_enable_compilation_cache", False)

hypothesis.settings.register_profile("ci", deadline=None, max_examples=60, print_blob=True)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _memory_mappings() -> tuple[int, int] | None:
  """This process's memory mappings and the kernel's limit on them (Linux; None elsewhere)."""
  try:
    with open("/proc/self/maps") as maps, open("/proc/sys/vm/max_map_count") as limit:
      return sum(1 for _ in maps), int(limit.read())
  except OSError:
    return None


def pytest_sessionstart(session):
  """Empties the suite's own compilation cache (not one the caller named) above 2 GiB, in the run's
  first process only (pytest-xdist's workers start after it)."""
  cache = pathlib.Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
  if _OWN_CACHE and not hasattr(session.config, "workerinput") and cache.is_dir():
    if sum(f.stat().st_size for f in cache.iterdir() if f.is_file()) > _CACHE_LIMIT_BYTES:
      shutil.rmtree(cache, ignore_errors=True)


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
