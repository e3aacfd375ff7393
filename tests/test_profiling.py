"""``summarize_trace`` on a hand-made Perfetto trace: busy time, idle time and where the device
waited; each model part's kernels from a real optimized HLO module with named scopes."""

import gzip
import json

import jax
import jax.numpy as jnp
import pytest

from jaxkv.profiling import enable_hlo_dump, hlo_dump_beside, kernel_ops, kernel_scopes, kernel_types, summarize_trace


def _write(tmp_path, kernels, hlo_ops=None):
  events = [
    {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}},
    {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
    {"ph": "X", "pid": 1, "tid": 1, "name": "host work", "ts": 0.0, "dur": 500.0},
  ]
  events += [
    {"ph": "X", "pid": 7, "tid": 2, "name": n, "ts": ts, "dur": dur, "args": {"hlo_op": (hlo_ops or {}).get(n, "")}}
    for n, ts, dur in kernels
  ]
  path = tmp_path / "run" / "host.trace.json.gz"
  path.parent.mkdir()
  with gzip.open(path, "wt") as f:
    json.dump({"traceEvents": events}, f)


def test_busy_idle_and_gaps_per_step(tmp_path):
  # Two steps: matmul [0, 10), overlapping norm [5, 12) on a second stream, sampler [20, 22); again from 30.
  step = [("matmul", 0.0, 10.0), ("norm", 5.0, 7.0), ("sampler", 20.0, 2.0)]
  _write(tmp_path, step + [(n, ts + 30.0, d) for n, ts, d in step])
  p = summarize_trace(tmp_path, num_steps=2)
  assert p["device"] == "gpu" and p["kernels_per_step"] == 3
  assert p["busy_ms_per_step"] == pytest.approx(14e-3)  # union: 12 + 2 us per step
  assert p["span_ms_per_step"] == pytest.approx(26e-3)  # 0 .. 52 us over two steps
  assert p["idle_fraction"] == pytest.approx(1 - 28 / 52)
  assert [t["name"] for t in p["top"]] == ["matmul", "norm", "sampler"]
  gaps = {(g["after"], g["before"]): g for g in p["idle_gaps"]}
  assert gaps[("norm", "sampler")]["ms_per_step"] == pytest.approx(8e-3)  # 12 -> 20, twice, over 2 steps
  assert gaps[("sampler", "matmul")]["gaps_per_step"] == 0.5  # 22 -> 30: once, between the steps
  assert sum(g["ms_per_step"] for g in p["idle_gaps"]) == pytest.approx(p["span_ms_per_step"] - p["busy_ms_per_step"])


def test_no_trace_is_a_clear_error(tmp_path):
  with pytest.raises(RuntimeError, match="no \\*.trace.json.gz"):
    summarize_trace(tmp_path, num_steps=1)


def _scoped(x, w):
  with jax.named_scope("mhc"):
    c = jax.nn.softmax(x[:, :16].reshape(-1, 4, 4), axis=-1)
    for _ in range(3):  # Sinkhorn-like; the barriers keep each step a kernel of its own on any backend
      c = jax.lax.optimization_barrier(c / c.sum(-1, keepdims=True))
      c = jax.lax.optimization_barrier(c / c.sum(-2, keepdims=True))
  with jax.named_scope("moe"):
    with jax.named_scope("experts"):
      y = jnp.tanh(jnp.einsum("td,ed->te", x, w)).sum(0)
  return y, c


def _optimized_hlo():
  x = jax.random.normal(jax.random.key(0), (64, 64))
  return jax.jit(_scoped).lower(x, x).compile().as_text()


def test_kernel_scopes_of_a_compiled_module():
  scopes = kernel_scopes(_optimized_hlo())
  fusions = {k: v for k, v in scopes.items() if "fusion" in k}
  assert set(fusions.values()) <= {"mhc", "moe/experts"} and len(set(fusions.values())) == 2, fusions
  assert sum(v == "mhc" for v in fusions.values()) >= 3  # several kernels of one scope
  assert all("." not in k and "-" not in k for k in scopes)  # kernel names: XLA's, "_" for "." and "-"


_HLO = """HloModule jit__device_step

%fused_computation.3 (param_0: f32[4]) -> f32[4] {
  %param_0 = f32[4]{0} parameter(0)
  ROOT %exponential.1 = f32[4]{0} exponential(%param_0), metadata={op_name="jit(_device_step)/jit(main)/sampler/exp"}
}

ENTRY %main.9 (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0), metadata={op_name="x"}
  %gemm-fusion.2 = f32[4]{0} fusion(%x), kind=kCustom, calls=%fused_computation.3, metadata={op_name="jit(_device_step)/jit(main)/while/body/vmap(layer)/kda/...i,oi->...o/dot_general"}
  %loop_exponential_fusion = f32[4]{0} fusion(%gemm-fusion.2), kind=kLoop, calls=%fused_computation.3
  ROOT %add.1 = f32[4]{0} add(%loop_exponential_fusion, %x), metadata={op_name="jit(_device_step)/jit(main)/add"}
}
"""


def test_scopes_skip_transformations_and_einsum_specs():
  scopes = kernel_scopes(_HLO)
  assert scopes["gemm_fusion_2"] == "kda"  # "while", "body", "vmap(...)", the einsum spec and the primitive dropped
  assert scopes["loop_exponential_fusion"] == "sampler"  # no metadata: its fused computation's root's
  assert scopes["add_1"] == "(no scope)" and scopes["x"] == "(no scope)"
  ops = kernel_ops(_HLO)
  assert ops["gemm_fusion_2"] == "jit(main)/while/body/vmap(layer)/kda/...i,oi->...o/dot_general"
  assert ops["loop_exponential_fusion"] == "jit(main)/sampler/exp"


def test_kernel_types_name_each_kernels_shapes_without_layouts():
  hlo = """HloModule jit__device_step

ENTRY %main.4 (x: bf16[64,4,128], i: s32[64]) -> f32[64,128] {
  %x = bf16[64,4,128]{2,1,0:T(8,128)(2,1)} parameter(0)
  %i = s32[64]{0} parameter(1)
  %kda.2 = (f32[64,128]{1,0}, u32[9,16]{1,0}) custom-call(%x, %i), custom_call_target="triton", backend_config={"a":{"b":[1,2]}}
  ROOT %loop_convert_fusion.4 = f32[64,128]{1,0} fusion(%x, %i, %kda.2), kind=kLoop, calls=%fused_computation
}
"""
  types = kernel_types(hlo)
  assert types["loop_convert_fusion_4"] == {
    "result": "f32[64,128]",
    "operands": ["bf16[64,4,128]", "s32[64]", "(f32[64,128], u32[9,16])"],
  }
  assert types["kda_2"] == {"result": "(f32[64,128], u32[9,16])", "operands": ["bf16[64,4,128]", "s32[64]"]}
  assert types["x"] == {"result": "bf16[64,4,128]", "operands": []}


def test_kernels_per_scope_from_the_best_matching_module(tmp_path):
  hlo = _optimized_hlo()
  scopes = kernel_scopes(hlo)
  (tmp_path / "hlo" / "other").mkdir(parents=True)
  (tmp_path / "hlo" / "module_1.jit__device_step.cpu_after_optimizations.txt").write_text(hlo)
  # A second bucket's module with other names: it names none of the trace's kernels.
  (tmp_path / "hlo" / "other" / "module_2.jit__device_step.cpu_after_optimizations.txt").write_text(
    "ENTRY %main (x: f32[2]) -> f32[2] {\n  ROOT %x = f32[2]{0} parameter(0), metadata={op_name=\"jit(f)/lm_head/x\"}\n}\n"
  )
  mhc = next(k for k, v in scopes.items() if v == "mhc")
  moe = next(k for k, v in scopes.items() if v == "moe/experts")
  # Two steps: two mhc kernels, one moe kernel matched by the trace's hlo_op (a library kernel's
  # name is not the instruction's), one kernel of no instruction.
  step = [(mhc, 0.0, 2.0), (mhc, 3.0, 2.0), ("nvjet_gemm", 6.0, 8.0), ("memcpy", 15.0, 1.0)]
  _write(tmp_path, step + [(n, ts + 20.0, d) for n, ts, d in step], hlo_ops={"nvjet_gemm": moe.replace("_", ".", 1)})
  p = summarize_trace(tmp_path, num_steps=2, hlo_dir=tmp_path / "hlo")
  rows = {r["scope"]: r for r in p["by_scope"]}
  assert rows["mhc"]["kernels_per_step"] == 2 and rows["mhc"]["ms_per_step"] == pytest.approx(4e-3)
  assert rows["moe/experts"]["kernels_per_step"] == 1 and rows["moe/experts"]["share"] == pytest.approx(8 / 13)
  assert rows["(unattributed)"]["kernels_per_step"] == 1
  assert [r["scope"] for r in p["by_scope"]][0] == "moe/experts"  # heaviest first
  # Each top kernel names the op that made it (its scope and primitive), matched as for its scope.
  ops = {t["name"]: t.get("op") for t in p["top"]}
  assert ops["nvjet_gemm"] == kernel_ops(hlo)[moe] and ops["nvjet_gemm"].startswith("moe/experts/"), ops
  assert ops[mhc].startswith("mhc/") and ops["memcpy"] is None
  # And the shapes it reads and writes, from the same module.
  top = {t["name"]: t for t in p["top"]}
  assert {k: top[mhc][k] for k in ("result", "operands")} == kernel_types(hlo)[mhc]
  # Plain types, layouts stripped (which fusion comes first differs by backend: f32[64,...] on the CPU,
  # scalars on an H100).
  types = [top[mhc]["result"], *top[mhc]["operands"]]
  assert top[mhc]["operands"] and all("[" in t and "{" not in t for t in types), types
  assert "result" not in top["memcpy"]  # no instruction of its name
  plain = summarize_trace(tmp_path, num_steps=2)
  assert "by_scope" not in plain and all("op" not in t and "result" not in t for t in plain["top"])


def test_missing_hlo_and_late_dump_are_clear_errors(tmp_path):
  _write(tmp_path, [("k", 0.0, 1.0)])
  with pytest.raises(RuntimeError, match="no \\*after_optimizations.txt under .*enable_hlo_dump"):
    summarize_trace(tmp_path, num_steps=1, hlo_dir=tmp_path / "hlo")
  jnp.zeros(1).block_until_ready()  # a backend is up: XLA has read its flags
  with pytest.raises(RuntimeError, match="must run before JAX starts a backend"):
    enable_hlo_dump(tmp_path / "hlo")
  assert hlo_dump_beside(None) is None  # no profile: no dump, and no error
  with pytest.raises(RuntimeError, match=rf"enable_hlo_dump\('{tmp_path}/prof/hlo'\) must run before"):
    hlo_dump_beside(tmp_path / "prof")
