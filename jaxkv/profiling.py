"""Where a step's time goes: a ``jax.profiler`` trace and its heaviest kernels per step.

``summarize_trace`` reads the Perfetto trace that ``jax.profiler.start_trace(dir,
create_perfetto_trace=True)`` writes (``dir/**/*.trace.json.gz``): complete events (``"ph": "X"``)
of the device process (``/device:GPU:0``; on the CPU, the XLA executor threads) are the kernels,
with durations in microseconds; the span they cover minus their union is the time the device
waited for the host; ``idle_gaps`` says between which kernels it waited (at a step's boundary,
or inside a step where the host launches kernels slower than the device runs them).
"""

from __future__ import annotations

import collections
import gzip
import json
import pathlib

__all__ = ["summarize_trace"]


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


def summarize_trace(trace_dir: str | pathlib.Path, num_steps: int, *, top: int = 12) -> dict:
  """Per-step kernel time of the newest trace under ``trace_dir``.

  Returns ``{"device": "gpu" | "cpu", "kernels_per_step", "busy_ms_per_step", "span_ms_per_step",
  "idle_fraction", "top": [{"name", "ms_per_step", "calls_per_step", "share"}], "idle_gaps": [{"after",
  "before", "ms_per_step", "gaps_per_step"}]}`` (the device's waits, summed by the kernels around them).
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
      }
      for name, d in ranked
    ],
    "idle_gaps": [
      {"after": a, "before": b, "ms_per_step": sum(d) / 1e3 / num_steps, "gaps_per_step": len(d) / num_steps}
      for (a, b), d in sorted(gaps.items(), key=lambda kv: -sum(kv[1]))[:top]
    ],
  }


def _is_gpu(trace: dict) -> bool:
  return any(
    e.get("ph") == "M" and e.get("name") == "process_name" and e["args"]["name"].startswith("/device:GPU")
    for e in trace.get("traceEvents", [])
  )
