"""Where a step's time goes: a ``jax.profiler`` trace and its heaviest kernels per step.

``summarize_trace`` reads the Perfetto trace that ``jax.profiler.start_trace(dir,
create_perfetto_trace=True)`` writes (``dir/**/*.trace.json.gz``): complete events (``"ph": "X"``)
of the device process (``/device:GPU:0``; on the CPU, the XLA executor threads) are the kernels,
with durations in microseconds; the span they cover minus their union is the time the device
waited for the host; ``idle_gaps`` says between which kernels it waited (at a step's boundary,
or inside a step where the host launches kernels slower than the device runs them).

Where the kernels come from: ``enable_hlo_dump(dir)`` (before JAX starts its backends) has XLA
write the step's optimized HLO, whose ``op_name`` metadata carries the ``jax.named_scope`` of each
op (the model tags ``mhc``, ``kda``, ``dsa``, ``moe``, ``mlp``, ``lm_head``, ``sampler``,
``step_metadata``, ...); ``summarize_trace(..., hlo_dir=dir)`` then counts the kernels and time of
each scope (``by_scope``) and names the op behind each of the heaviest kernels (``top``'s
``op``: ``gemm_fusion_dot_6`` alone does not say it is the mHC's mix) with the shapes it reads and
writes (``operands``, ``result``: ``loop_convert_fusion_4`` alone does not say how large a convert
it is). A kernel is matched by its
name (XLA names a fusion's kernel after the fusion) or the trace's ``hlo_op``; library kernels
inside a command buffer (cuBLAS) match neither and count as ``(unattributed)``.
"""

from __future__ import annotations

import collections
import gzip
import json
import os
import pathlib
import re

__all__ = ["enable_hlo_dump", "hlo_dump_beside", "kernel_ops", "kernel_scopes", "kernel_types", "summarize_trace"]

# The jitted step's HLO module (``jit(_device_step)``): the only one dumped.
_STEP_MODULE_RE = ".*_device_step.*"
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+) = ")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_OPERAND = re.compile(r"%([\w.\-]+)")
_LAYOUT = re.compile(r"\{[^{}]*\}")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
# Name-stack parts that are not scopes: transformations (``jit(f)``, ``vmap(f)``, loop bodies) and
# the specs ``jnp.einsum`` names its ops with (``...i,oi->...o``).
_TRANSFORMS = re.compile(r"\(|->|^(while|body|cond|branch_\d+_fun|closed_call|checkpoint|remat|pjit|shard_map)$")


def enable_hlo_dump(directory: str | pathlib.Path) -> None:
  """Has XLA write the step's optimized HLO under ``directory`` (for ``summarize_trace``'s
  ``by_scope``). XLA reads its flags when JAX starts a backend, so call this before any JAX
  computation.

  Raises:
    RuntimeError: a backend has started already (the dump would silently not happen).
  """
  from jax._src import xla_bridge

  if xla_bridge.backends_are_initialized():
    raise RuntimeError(
      f"enable_hlo_dump({str(directory)!r}) must run before JAX starts a backend (XLA reads XLA_FLAGS "
      "then); call it first, or set XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text yourself."
    )
  flags = f"--xla_dump_to={directory} --xla_dump_hlo_as_text --xla_dump_hlo_module_re={_STEP_MODULE_RE}"
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()


def hlo_dump_beside(profile_dir: str | pathlib.Path | None) -> str | None:
  """``enable_hlo_dump`` into ``profile_dir/hlo`` and that folder (the ``hlo_dir`` of
  ``summarize_trace``), or None without a profile: how ``--profile DIR`` dumps the step's HLO."""
  if profile_dir is None:
    return None
  hlo_dir = f"{profile_dir}/hlo"
  enable_hlo_dump(hlo_dir)
  return hlo_dir


def _kernel_key(name: str) -> str:
  return re.sub(r"[.\-]", "_", name)


def _scope(op_name: str) -> str:
  parts = [p for p in op_name.split("/")[:-1] if p and not _TRANSFORMS.search(p)]  # the last: the primitive
  return "/".join(parts) or "(no scope)"


def kernel_ops(hlo_text: str) -> dict[str, str]:
  """``{kernel name: op_name}`` for every instruction of an HLO module's text that has one (names
  with ``.`` and ``-`` as ``_``, as XLA names kernels; the ``op_name`` of its metadata, the step's
  own ``jit(...)`` first part dropped). A fusion without metadata takes its fused computation's
  root's."""
  ops: dict[str, str | None] = {}
  calls: dict[str, str] = {}
  roots: dict[str, str] = {}
  computation = None
  for line in hlo_text.splitlines():
    head = _COMPUTATION.match(line)
    if head and " = " not in line:
      computation = head.group(1)
      continue
    m = _INSTRUCTION.match(line)
    if m is None:
      continue
    root, name = m.groups()
    op_name, called = _OP_NAME.search(line), _CALLS.search(line)
    ops[name] = op_name and op_name.group(1)
    if called:
      calls[name] = called.group(1)
    if root and computation is not None:
      roots[computation] = name
  named = {}
  for name, op_name in ops.items():
    if op_name is None and name in calls:
      op_name = ops.get(roots.get(calls[name], ""))
    if op_name is not None:
      named[_kernel_key(name)] = re.sub(r"^jit\([^/]*\)/", "", op_name)
  return named


def kernel_types(hlo_text: str) -> dict[str, dict]:
  """``{kernel name: {"result": type, "operands": [type, ...]}}`` for every instruction of an HLO
  module's text (names as ``kernel_ops``'; types as HLO prints them, layouts dropped: ``f32[8192,
  8192]``, a tuple ``(bf16[8,4], s32[8])``). An operand's type is that of the instruction of its
  name; a kernel may read only part of an operand (a gather, an aliased cache)."""
  types: dict[str, str] = {}
  operands: dict[str, list[str]] = {}
  for line in hlo_text.splitlines():
    m = _INSTRUCTION.match(line)
    if m is None:
      continue
    rest = line[m.end() :]
    split = _type_end(rest)
    types[m.group(2)] = _LAYOUT.sub("", rest[:split]).strip()
    call = rest[split:].lstrip()
    args = call[call.find("(") + 1 : _closing(call, call.find("("))] if "(" in call else ""
    operands[m.group(2)] = _OPERAND.findall(args)
  return {
    _kernel_key(name): {"result": t, "operands": [types[o] for o in operands[name] if o in types]}
    for name, t in types.items()
  }


def _closing(text: str, start: int) -> int:
  """The index of the parenthesis that closes ``text[start]``'s (the text's end if none)."""
  depth = 0
  for i in range(start, len(text)):
    depth += {"(": 1, ")": -1}.get(text[i], 0)
    if depth == 0:
      return i
  return len(text)


def _type_end(rest: str) -> int:
  """Where an instruction's type ends in ``rest`` (the text after ``name = ``): a tuple's closing
  parenthesis, else the first space outside a layout's braces."""
  if rest.startswith("("):
    return _closing(rest, 0) + 1
  depth = 0
  for i, ch in enumerate(rest):
    depth += {"{": 1, "}": -1}.get(ch, 0)
    if ch == " " and depth == 0:
      return i
  return len(rest)


def kernel_scopes(hlo_text: str) -> dict[str, str]:
  """``{kernel name: named scope}`` (``kernel_ops``' op names without transformations and the
  primitive)."""
  return {name: _scope(op) for name, op in kernel_ops(hlo_text).items()}


def _device_events(trace: dict) -> list[dict]:
  events = trace.get("traceEvents", [])
  procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
  gpu = {pid for pid, name in procs.items() if name.startswith("/device:GPU")}
  if gpu:
    return [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu]
  threads = {
    (e["pid"], e["tid"])
    for e in events
    if e.get("ph") == "M" and e.get("name") == "thread_name" and "XLA" in e["args"].get("name", "")
  }
  return [e for e in events if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in threads]


def summarize_trace(
  trace_dir: str | pathlib.Path, num_steps: int, *, top: int = 12, hlo_dir: str | pathlib.Path | None = None
) -> dict:
  """Per-step kernel time of the newest trace under ``trace_dir``.

  Returns ``{"device": "gpu" | "cpu", "kernels_per_step", "busy_ms_per_step", "span_ms_per_step",
  "idle_fraction", "top": [{"name", "ms_per_step", "calls_per_step", "share"}], "idle_gaps": [{"after",
  "before", "ms_per_step", "gaps_per_step"}]}`` (the device's waits, summed by the kernels around them).
  With ``hlo_dir`` (``enable_hlo_dump``'s), also ``"by_scope": [{"scope", "kernels_per_step",
  "ms_per_step", "share"}]``, from the dumped module that names the most of the trace's kernels,
  and each ``top`` kernel's ``"op"`` there (``kernel_ops``: its scope and primitive, e.g.
  ``mhc/btij,btid->btjd/dot_general`` for a ``gemm_fusion_dot_6``), where it has one, and its
  ``"result"`` and ``"operands"`` types (``kernel_types``) where the module has its instruction.
  """
  files = sorted(pathlib.Path(trace_dir).rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
  if not files:
    raise RuntimeError(f"no *.trace.json.gz under {trace_dir}: the profiler wrote no Perfetto trace.")
  with gzip.open(files[-1], "rt") as f:
    trace = json.load(f)
  events = _device_events(trace)
  if not events:
    raise RuntimeError(f"{files[-1]} holds no device events to summarize.")
  by_name: dict[str, list[float]] = collections.defaultdict(list)
  for e in events:
    by_name[e.get("name", "?")].append(float(e.get("dur", 0.0)))
  intervals = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e.get("name", "?")) for e in events)
  busy, end, last = 0.0, -float("inf"), None
  gaps: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
  for s, t, name in intervals:  # union of kernel intervals (concurrent streams count once)
    if last is not None and s > end:
      gaps[(last[:60], name[:60])].append(s - end)
    if t > end:
      busy += t - max(s, end)
      end, last = t, name
  span = intervals[-1][1] - intervals[0][0]
  total = sum(sum(d) for d in by_name.values())
  ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
  ops, types = (None, None) if hlo_dir is None else _step_module(events, hlo_dir)
  top_names = {name for name, _ in ranked}
  op_of, type_of = {}, {}  # a top kernel's op and shapes: what made it, where its name does not say
  for e in events if ops else ():
    name = e.get("name", "?")
    if name in top_names and name not in op_of:
      op_of[name] = _op(e, ops)
      type_of[name] = next((types[k] for k in _keys(e) if k in types), {})
  scoped = {} if ops is None else {"by_scope": _by_scope(events, ops, num_steps, total)}
  return {
    "device": "gpu" if _is_gpu(trace) else "cpu",
    "steps": num_steps,
    "kernels_per_step": len(events) / num_steps,
    "busy_ms_per_step": busy / 1e3 / num_steps,
    "span_ms_per_step": span / 1e3 / num_steps,
    "idle_fraction": 1.0 - busy / span if span > 0 else 0.0,
    "top": [
      {
        "name": name[:120],
        "ms_per_step": sum(d) / 1e3 / num_steps,
        "calls_per_step": len(d) / num_steps,
        "share": sum(d) / total if total else 0.0,
        **({"op": op_of[name]} if op_of.get(name) else {}),
        **type_of.get(name, {}),
      }
      for name, d in ranked
    ],
    "idle_gaps": [
      {"after": a, "before": b, "ms_per_step": sum(d) / 1e3 / num_steps, "gaps_per_step": len(d) / num_steps}
      for (a, b), d in sorted(gaps.items(), key=lambda kv: -sum(kv[1]))[:top]
    ],
    **scoped,
  }


def _keys(e: dict) -> list[str]:
  """The names an event may match an instruction by: its kernel's, or the trace's ``hlo_op``."""
  return [_kernel_key(e.get("name", "?")), _kernel_key(str(e.get("args", {}).get("hlo_op", "")))]


def _op(e: dict, ops: dict[str, str]) -> str | None:
  return next((ops[k] for k in _keys(e) if k in ops), None)


def _step_module(events: list[dict], hlo_dir: str | pathlib.Path) -> tuple[dict[str, str], dict[str, dict]]:
  """``kernel_ops`` and ``kernel_types`` of the dumped module that names the most of ``events``:
  each token bucket compiles a module of the same name, and the one that names the most kernels
  ran."""
  files = list(pathlib.Path(hlo_dir).rglob("*after_optimizations.txt"))
  if not files:
    raise RuntimeError(
      f"no *after_optimizations.txt under {hlo_dir}: was enable_hlo_dump({str(hlo_dir)!r}) called first?"
    )
  texts = {f: f.read_text() for f in files}
  named = {f: kernel_ops(t) for f, t in texts.items()}
  best = max(files, key=lambda f: sum(_op(e, named[f]) is not None for e in events))
  return named[best], kernel_types(texts[best])


def _by_scope(events: list[dict], ops: dict[str, str], num_steps: int, total: float) -> list[dict]:
  acc: dict[str, list[float]] = collections.defaultdict(list)
  for e in events:
    op = _op(e, ops)
    acc["(unattributed)" if op is None else _scope(op)].append(float(e.get("dur", 0.0)))
  return [
    {
      "scope": scope,
      "kernels_per_step": len(d) / num_steps,
      "ms_per_step": sum(d) / 1e3 / num_steps,
      "share": sum(d) / total if total else 0.0,
    }
    for scope, d in sorted(acc.items(), key=lambda kv: -sum(kv[1]))
  ]


def _is_gpu(trace: dict) -> bool:
  return any(
    e.get("ph") == "M" and e.get("name") == "process_name" and e["args"]["name"].startswith("/device:GPU")
    for e in trace.get("traceEvents", [])
  )
