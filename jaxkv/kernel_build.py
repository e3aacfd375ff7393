"""The Pallas kernels of a lowered program, read back as Triton IR and built by Triton's compiler.

``jaxkv.engine.lower_step`` inside ``jaxkv.gpu_target`` gives the step a GPU would
compile, on any machine; its Pallas kernels are custom calls carrying Triton IR. ``triton_kernels``
reads them back (name, grid, warps, stages, the IR as text) and ``build_kernels`` compiles them with
the ``triton`` package's own compiler (in a child process) down to a cubin for the target's compute capability, then
asks ``ptxas`` (shipped with ``triton``) for its registers and spills: whether every kernel builds
for the H200, and at what register pressure, without an H200.

What it stands for: XLA compiles the same IR with the Triton it links (its own pass pipeline and
Triton revision), so a kernel that builds here can still fail there, and the figures are Triton's
upstream ones. A kernel that fails here names the pass and the IR; it is what to look at first.
Needs ``pip install triton`` (the ``aot`` extra); reading the IR back uses two private JAX names
(the Triton dialect's registration), as JAX has no public reader of a custom call's IR.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import tempfile
import time

import jax

__all__ = ["TritonKernel", "KernelBuild", "triton_kernels", "build_kernels"]

_TRITON_CALL = "__gpu$xla.gpu.triton"


@dataclasses.dataclass(frozen=True)
class TritonKernel:
  """One Pallas kernel of a lowered program, as XLA would compile it."""

  name: str
  grid: tuple[int, int, int]
  num_warps: int
  num_stages: int
  ttir: str  # Triton IR (MLIR text)


@dataclasses.dataclass(frozen=True)
class KernelBuild:
  """What Triton's compiler and ``ptxas`` made of one kernel."""

  kernel: TritonKernel
  compute_capability: int
  shared_memory_bytes: int
  registers: int
  spill_stores_bytes: int
  spill_loads_bytes: int
  seconds: float

  def describe(self) -> dict:
    k = self.kernel
    return {
      "kernel": k.name,
      "grid": list(k.grid),
      "num_warps": k.num_warps,
      "num_stages": k.num_stages,
      "sm": self.compute_capability,
      "shared_memory_bytes": self.shared_memory_bytes,
      "registers": self.registers,
      "spill_stores_bytes": self.spill_stores_bytes,
      "spill_loads_bytes": self.spill_loads_bytes,
      "seconds": round(self.seconds, 1),
    }


def triton_kernels(lowered: jax.stages.Lowered) -> list[TritonKernel]:
  """Every Triton custom call of ``lowered`` (lowered for a GPU), in program order."""
  from jax._src.lib.mlir import ir
  from jax._src.pallas.triton.lowering import _new_ir_context

  calls = []

  def walk(op):
    for region in op.regions:
      for block in region.blocks:
        for child in block.operations:
          child = child.operation
          if (
            child.name == "stablehlo.custom_call"
            and ir.StringAttr(child.attributes["call_target_name"]).value == _TRITON_CALL
          ):
            calls.append(ir.DictAttr(child.attributes["mhlo.backend_config"]))
          walk(child)

  walk(lowered.compiler_ir("stablehlo").operation)
  kernels = []
  with _new_ir_context():
    for cfg in calls:
      integer = lambda key: ir.IntegerAttr(cfg[key]).value
      module = ir.Module.parse(ir.StringAttr(cfg["ir"]).value_bytes)
      kernels.append(
        TritonKernel(
          name=ir.StringAttr(cfg["name"]).value,
          grid=(integer("grid_x"), integer("grid_y"), integer("grid_z")),
          num_warps=integer("num_warps"),
          num_stages=integer("num_stages"),
          ttir=module.operation.get_asm(enable_debug_info=False),
        )
      )
  return kernels


def _ptxas_usage(ptxas: str, ptx: str, arch: str) -> tuple[int, int, int]:
  """(registers, spill store bytes, spill load bytes) of the one kernel in ``ptx``."""
  with tempfile.NamedTemporaryFile("w", suffix=".ptx") as src:
    src.write(ptx)
    src.flush()
    out = subprocess.run(
      [ptxas, "-v", f"--gpu-name={arch}", src.name, "-o", "/dev/null"], capture_output=True, text=True, check=True
    )
  log = out.stdout + out.stderr
  regs = re.search(r"Used (\d+) registers", log)
  spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
  if regs is None or spill is None:
    raise RuntimeError(f"ptxas -v printed no register or spill line for {arch}:\n{log}")
  return int(regs.group(1)), int(spill.group(1)), int(spill.group(2))


def build_kernels(kernels: list[TritonKernel], compute_capability: int) -> list[KernelBuild]:
  """Compiles each kernel with Triton for ``sm_<compute_capability>`` (no GPU needed), in a child
  process: Triton links its own LLVM, and loaded beside jaxlib's it can abort a later XLA
  compilation of this process (seen once in CI after kernels were built in a test worker).

  Raises:
    RuntimeError: ``triton`` is not installed, or a kernel does not build (the message names the
      kernel and Triton's error).
  """
  request = {"cc": compute_capability, "kernels": [dataclasses.asdict(k) for k in kernels]}
  child = subprocess.run(
    [sys.executable, "-m", "jaxkv.kernel_build"], input=json.dumps(request), capture_output=True, text=True
  )
  try:
    answer = json.loads(child.stdout.splitlines()[-1])
  except (IndexError, json.JSONDecodeError):
    raise RuntimeError(f"the Triton build process failed (exit {child.returncode}):\n{child.stderr[-3000:]}") from None
  if "error" in answer:
    raise RuntimeError(answer["error"])
  return [KernelBuild(k, compute_capability, **r) for k, r in zip(kernels, answer["builds"])]


def _build_here(kernel: TritonKernel, compute_capability: int) -> dict:
  """The child's work for one kernel: Triton's compile, then ``ptxas -v``."""
  import triton
  from triton.backends.compiler import GPUTarget
  from triton.backends.nvidia.compiler import get_ptxas

  start = time.perf_counter()
  with tempfile.NamedTemporaryFile("w", suffix=".ttir") as src:
    src.write(kernel.ttir)
    src.flush()
    try:
      built = triton.compile(
        src.name,
        target=GPUTarget("cuda", compute_capability, 32),
        options={"num_warps": kernel.num_warps, "num_stages": kernel.num_stages},
      )
    except Exception as e:  # Triton raises its own types per pass; name the kernel whatever failed
      raise RuntimeError(f"Triton could not build {kernel.name} for sm_{compute_capability}: {e}") from e
  seconds = time.perf_counter() - start
  ptx = built.asm["ptx"]
  arch = re.search(r"^\.target\s+(\S+)", ptx, re.M).group(1)
  regs, stores, loads = _ptxas_usage(get_ptxas(compute_capability).path, ptx, arch)
  return dict(
    shared_memory_bytes=built.metadata.shared,
    registers=regs,
    spill_stores_bytes=stores,
    spill_loads_bytes=loads,
    seconds=seconds,
  )


def _main() -> None:
  """The child of ``build_kernels``: a JSON request on stdin, one JSON line of answers on stdout."""
  request = json.load(sys.stdin)
  try:
    import triton  # noqa: F401
  except ImportError as e:
    answer = {"error": f"building kernels needs the triton package ({e}); pip install triton (the 'aot' extra)."}
  else:
    try:
      kernels = [TritonKernel(**{**k, "grid": tuple(k["grid"])}) for k in request["kernels"]]
      answer = {"builds": [_build_here(k, request["cc"]) for k in kernels]}
    except RuntimeError as e:
      answer = {"error": str(e)}
  print(json.dumps(answer))


if __name__ == "__main__":
  _main()
