"""``summarize_trace`` on a hand-made Perfetto trace: busy time, idle time and where the device waited."""

import gzip
import json

import pytest

from jaxkv.profiling import summarize_trace


def _write(tmp_path, kernels):
  events = [
    {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}},
    {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
    {"ph": "X", "pid": 1, "tid": 1, "name": "host work", "ts": 0.0, "dur": 500.0},
  ]
  events += [{"ph": "X", "pid": 7, "tid": 2, "name": n, "ts": ts, "dur": dur} for n, ts, dur in kernels]
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
