"""jaxkv: paged KV-cache management for LLM inference in JAX and Pallas.

Block tables and slot mappings are in KV-cache-manager blocks; each attention group maps its table
to the kernel blocks its backend reads (kernel block ``j`` of block ``b`` is ``b * stride + j``).
"""

import importlib.util as _importlib_util
import os as _os


def _check_sibling_packages() -> None:
  # jaxkv ships three top-level packages (the repository's layout). Another distribution's
  # ``models`` or ``pallas_kernels`` earlier on sys.path would otherwise be imported in their place
  # and fail far from here, or worse, not fail.
  root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
  for name in ("models", "pallas_kernels"):
    spec = _importlib_util.find_spec(name)
    where = None if spec is None or spec.origin is None else _os.path.dirname(_os.path.dirname(spec.origin))
    if where is None or _os.path.realpath(where) != _os.path.realpath(root):
      found = "nothing" if spec is None else (spec.origin or "a namespace package")
      raise ImportError(
        f"jaxkv needs its own top-level package {name!r} next to it in {root}, but importing {name!r} finds "
        f"{found}: another package of that name shadows it. Install jaxkv in its own environment (as "
        f"`sh .ci/venv.sh` does) or remove the other {name!r} from sys.path."
      )


_check_sibling_packages()

# The three static-to-traced layers' public names, as each package lists them (its __all__).
from jaxkv import cache as _cache, host as _host, step as _step
from jaxkv.cache import *  # noqa: F403
from jaxkv.host import *  # noqa: F403
from jaxkv.step import *  # noqa: F403
from jaxkv.gpu_target import GPU_TARGETS, GpuTarget, gpu_target
from jaxkv.utils import cdiv, round_up

__version__ = "0.1.0"

# vLLM's front door, imported on first use (it brings the engine and the model).
_LAZY = {
  "LLM": "jaxkv.entrypoints.llm",
  "SamplingParams": "jaxkv.engine.request",
  "RequestOutput": "jaxkv.outputs",
  "CompletionOutput": "jaxkv.outputs",
  "Logprob": "jaxkv.outputs",
}


def __getattr__(name: str):
  if name in _LAZY:
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)
  raise AttributeError(f"module 'jaxkv' has no attribute {name!r}")


__all__ = [
  *_LAZY,
  *_cache.__all__,
  *_host.__all__,
  *_step.__all__,
  "cdiv",
  "round_up",
  # Lowering for a GPU without one (jaxkv lower).
  "gpu_target",
  "GPU_TARGETS",
  "GpuTarget",
]
