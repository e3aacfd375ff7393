"""GPU conformance matrix: every configuration a user can ask for starts, compiles only at warm-up,
and agrees with the float32 XLA path.

The configuration space (``SPACE``): model dtype x latent dtype x indexer dtype x layout x block
size x kernel split x MTP drafts x prefix caching x implementation, covered pairwise (every pair of
two settings' values is in some cell; ``pairwise_cells``), on two models: ``tiny`` (the embedded
config) and ``slice`` (``glm-5.3-flash-slice4``, the released dimensions in 4 layers, with 16
routed experts so that a cell builds and compiles in seconds). Random weights, one seed per model
and dtype, shared by every cell.

Each cell serves two prompts one after the other on one engine (the second shares a prefix of
the first, so prefix caching hits), 8 greedy tokens each with top-5 log-probabilities, after
``warmup()``, and checks:

- it starts (plans, builds, compiles) and serves without an error;
- nothing compiles after warm-up;
- float32 weights and caches: greedy tokens equal the float32 XLA path's (packed, block 256, no
  drafts, no caching), except past a step where the reference's top two log-probs are within
  1e-4 (a tie: reported, not failed);
- bf16 / fp8: token agreement with the float32 XLA path and the largest top-1 log-prob
  difference before the first divergence are reported;
- bitwise: cells of one model, dtypes, implementation and number of drafts (``SWEEP`` adds such
  cells: the same settings over layouts, block sizes, kernel splits and caching) give identical
  tokens and log-probs; with and without drafts, identical tokens. Only cells of one code version
  (``code_version``: a hash of the package sources) and one device kind, both in each row, are
  held to each other's bits: a call that resumes an earlier call's files (``--out`` with its
  cells) on changed code or another GPU compares each version's cells among themselves.

One JSON line per cell goes to ``--out`` (written as it runs: a call stopped at its limit keeps
what ran); ``--markdown`` prints the table of docs/conformance.md from such a file.

    for i in 0 1 2 3 4 5; do  # six processes share the GPU; each appends to its own file
      python benchmarks/conformance.py --shard $i/6 --out conformance-$i.jsonl &
    done; wait
    python benchmarks/conformance.py --markdown conformance-*.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import itertools
import json
import os
import pathlib
import sys
import time
import traceback
import warnings

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SPACE = {
  "dtype": ("float32", "bfloat16"),
  "kv_cache_dtype": ("float32", "bfloat16", "fp8"),
  "indexer_cache_dtype": ("float32", "bfloat16", "fp8"),
  "layout": ("packed", "dense"),
  "block_size": (128, 256, 1024),
  "kernel_block_size": (None, 128),
  "num_spec": (0, 2),
  "prefix_caching": (False, True),
  "implementation": ("pallas", "xla"),
  "linear_prefill": ("recurrent", "chunked"),
}
REFERENCE = {
  "dtype": "float32",
  "kv_cache_dtype": "float32",
  "indexer_cache_dtype": "float32",
  "layout": "packed",
  "block_size": 256,
  "kernel_block_size": None,
  "num_spec": 0,
  "prefix_caching": False,
  "implementation": "xla",
  "linear_prefill": "recurrent",
}
# Settings that must not change a bit of the output (for one model, dtypes, implementation and
# number of drafts; drafts change the head's matmul shape, so across them only tokens must agree).
LAYOUT_KEYS = ("layout", "block_size", "kernel_block_size", "prefix_caching")
# Extra cells for the bitwise check: the serving configuration and all-float32 over LAYOUT_KEYS.
SWEEP = [
  {"layout": "packed", "block_size": 128, "kernel_block_size": None, "num_spec": 0, "prefix_caching": True},
  {"layout": "packed", "block_size": 1024, "kernel_block_size": None, "num_spec": 2, "prefix_caching": False},
  {"layout": "dense", "block_size": 256, "kernel_block_size": 128, "num_spec": 0, "prefix_caching": False},
  {"layout": "dense", "block_size": 1024, "kernel_block_size": 128, "num_spec": 2, "prefix_caching": True},
]
SWEEP_DTYPES = [
  ("bfloat16", "bfloat16", "fp8", "pallas", "recurrent"),
  ("float32", "float32", "float32", "pallas", "recurrent"),
  ("bfloat16", "bfloat16", "fp8", "pallas", "chunked"),
]

MODELS = {
  # name: (built-in config, overrides, prompt length, shared prefix, KV budget, max model len, budget, buckets)
  # One bucket each: a GPU compile of the step takes a minute or two, so a cell compiles once.
  "tiny": ("glm-5.3-flash-tiny", {}, 180, 140, 64 << 20, 256, 64, (64,)),
  # The released per-layer dimensions (attention, latent, indexer, KDA, MLP widths); 16 routed
  # experts, a 32k vocabulary and the MTP layer keep building and compiling a cell short.
  # Its prompts share 8,448 tokens: packed plans scale the block up to 7,424 tokens, and a hit
  # needs a whole block (two with drafts, which hold the last one back).
  "slice": (
    "glm-5.3-flash-slice4",
    {"n_routed_experts": 16, "vocab_size": 32768, "num_nextn_predict_layers": 1},
    8704,
    8448,
    int(1.75 * 2**30),
    8704 + 64,
    512,
    (512,),
  ),
}
NEW_TOKENS = 8
TIE = 1e-4


def code_version(root: pathlib.Path = ROOT) -> str:
  """A short hash of the sources a cell runs (``jaxkv/``, ``pallas_kernels/``, ``models/``; paths
  and contents): equal for equal code, whether or not the tree is a git checkout."""
  h = hashlib.sha256()
  for path in sorted(p for d in ("jaxkv", "pallas_kernels", "models") for p in (root / d).rglob("*.py")):
    h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
  return h.hexdigest()[:12]


def valid(cell: dict) -> bool:
  """A kernel split needs the dense layout and a block larger than the kernel block."""
  split = cell.get("kernel_block_size")
  return split is None or (cell.get("layout") == "dense" and cell.get("block_size", split + 1) > split)


def pairwise_cells(space: dict = SPACE) -> list[dict]:
  """Cells covering every valid pair of two settings' values (greedy, deterministic)."""
  keys = list(space)
  pairs = {
    (a, va, b, vb)
    for a, b in itertools.combinations(keys, 2)
    for va in space[a]
    for vb in space[b]
    if valid({a: va, b: vb})
  }
  cells = []
  while pairs:
    cell = {}
    for key in keys:

      def gain(v):
        trial = {**cell, key: v}
        if not valid(trial):
          return -1
        return sum((a, trial[a], b, trial[b]) in pairs for a, b in itertools.combinations(trial, 2) if key in (a, b))

      cell[key] = max(space[key], key=gain)
    covered = {(a, cell[a], b, cell[b]) for a, b in itertools.combinations(keys, 2)}
    if not covered & pairs:  # the greedy choice covered nothing new: take one uncovered pair as is
      a, va, b, vb = sorted(pairs, key=str)[0]
      cell = {**REFERENCE, a: va, b: vb}
      covered = {(x, cell[x], y, cell[y]) for x, y in itertools.combinations(keys, 2)}
    pairs -= covered
    cells.append(cell)
  return cells


def all_cells() -> list[dict]:
  cells = [dict(REFERENCE)] + pairwise_cells()
  for d, kv, ind, impl, prefill in SWEEP_DTYPES:
    for s in SWEEP:
      dtypes = {"dtype": d, "kv_cache_dtype": kv, "indexer_cache_dtype": ind}
      cells.append({**dtypes, "implementation": impl, "linear_prefill": prefill, **s})
  out, seen = [], set()
  # The reference first, then the kernels' cells (the XLA ones are baselines): what a call stopped
  # at its limit leaves out matters least.
  for c in cells[:1] + sorted(cells[1:], key=lambda c: c["implementation"] != "pallas"):
    key = tuple(sorted(c.items(), key=str))
    if key not in seen:
      seen.add(key)
      out.append(c)
  return out


def prompts(model: str) -> list[list[int]]:
  import numpy as np

  _, _, length, shared, *_ = MODELS[model]
  rng = np.random.default_rng(7)
  a = [int(t) for t in rng.integers(1, 250, length)]
  return [a, a[:shared] + [int(t) for t in rng.integers(1, 250, length - shared)]]


_RUNNERS: dict = {}


def runner_for(model: str, dtype: str, implementation: str):
  from models.glm5_next import get_config
  from models.glm5_next.runner import FAMILY

  if (model, dtype) not in _RUNNERS:
    _RUNNERS.clear()  # one set of weights at a time: processes share the GPU's memory
    name, overrides, *_ = MODELS[model]
    config = dataclasses.replace(get_config(name), **overrides)
    _RUNNERS[model, dtype] = FAMILY.from_random(config, dtype=dtype, seed=0, implementation="xla")
  return dataclasses.replace(_RUNNERS[model, dtype], implementation=implementation)


def run_cell(model: str, cell: dict, code: str, device: str) -> dict:
  from jaxkv.engine import EngineConfig, LLMEngine, SamplingParams
  from jaxkv.cache.kv_cache_config import CacheConfig

  _, _, _, _, memory, max_len, budget, buckets = MODELS[model]
  row = {"model": model, **cell, "code": code, "device": device}
  t0 = time.perf_counter()
  try:
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      cache = CacheConfig(
        block_size=cell["block_size"],
        kernel_block_size=cell["kernel_block_size"],
        layout=cell["layout"],
        kv_cache_dtype=cell["kv_cache_dtype"],
        indexer_cache_dtype=cell["indexer_cache_dtype"],
        num_speculative_tokens=cell["num_spec"],
        linear_prefill=_setting(cell, "linear_prefill"),
        memory_bytes=memory,
        max_model_len=max_len,
      )
      engine = LLMEngine(
        runner_for(model, cell["dtype"], cell["implementation"]),
        EngineConfig(
          cache=cache,
          max_num_reqs=2,
          max_num_batched_tokens=budget,
          buckets=buckets,
          enable_prefix_caching=cell["prefix_caching"],
        ),
      )
      row["manager_block_size"] = engine.plan.block_size  # packed plans may scale the block up
      warm = engine.warmup()
      row["warmup_s"] = round(time.perf_counter() - t0, 2)
      sampling = SamplingParams(max_tokens=NEW_TOKENS, logprobs=5)
      outs = [engine.generate([p], sampling)[0] for p in prompts(model)]
      row["compiled_after_warmup"] = engine.num_compilations - warm
      row["tokens"] = [r.output_token_ids for r in outs]
      row["logprobs"] = [[[[int(i), float(v)] for i, v in step] for step in r.output_logprobs] for r in outs]
      row["cached_tokens"] = [r.num_cached_tokens for r in outs]
      row["xla_kernels"] = list(engine.executor.statics.layout.xla_kernels)
      row["warnings"] = sorted({str(w.message)[:200] for w in caught if issubclass(w.category, RuntimeWarning)})
  except Exception as e:  # a cell that cannot start or serve is a failing cell, with its error
    row["error"] = f"{type(e).__name__}: {str(e)[:600]}"
    row["traceback"] = traceback.format_exc()[-1500:]
  row["seconds"] = round(time.perf_counter() - t0, 2)
  return row


def compare(rows: list[dict]) -> list[dict]:
  """Adds each row's verdict: against the float32 XLA reference (of the row's code version and
  device where one ran), and bitwise within its group (one code version and device)."""
  refs = [r for r in rows if all(_setting(r, k) == v for k, v in REFERENCE.items()) and "tokens" in r]
  groups: dict = {}
  for r in rows:
    if "tokens" in r:
      groups.setdefault(_group(r) + (r["num_spec"],), []).append(r)
  for r in rows:
    problems = []
    if "error" in r:
      problems.append("error")
    elif r["compiled_after_warmup"]:
      problems.append(f"compiled {r['compiled_after_warmup']} after warm-up")
    # The model's reference of the row's code version and device, else its first of any.
    ref = min(
      (x for x in refs if x["model"] == r["model"]),
      key=lambda x: (_setting(x, "code"), _setting(x, "device")) != (_setting(r, "code"), _setting(r, "device")),
      default=None,
    )
    if "tokens" in r and ref is not None:
      agree, total, dmax, tie = 0, 0, 0.0, False
      for got, want, got_lp, want_lp in zip(r["tokens"], ref["tokens"], r["logprobs"], ref["logprobs"]):
        for i, (g, w) in enumerate(zip(got, want)):
          total += 1
          if g != w:
            tie = tie or (want_lp[i][0][1] - want_lp[i][1][1] < TIE)
            break
          agree += 1
          dmax = max(dmax, abs(got_lp[i][0][1] - want_lp[i][0][1]))
      r["token_agreement"] = f"{agree}/{2 * NEW_TOKENS}"
      r["max_top1_logprob_diff"] = dmax
      exact = r["dtype"] == r["kv_cache_dtype"] == r["indexer_cache_dtype"] == "float32"
      if exact and agree < 2 * NEW_TOKENS and not tie:
        problems.append(f"float32 tokens differ from the XLA path ({r['token_agreement']})")
    if "tokens" in r:
      group = groups[_group(r) + (r["num_spec"],)]
      first = group[0]
      r["bitwise_group_size"] = len(group)
      if (r["tokens"], r["logprobs"]) != (first["tokens"], first["logprobs"]):
        problems.append(
          "not bitwise the group's first cell (" + ", ".join(f"{k}={first[k]}" for k in LAYOUT_KEYS) + ")"
        )
      others = [g[0] for k, g in groups.items() if k[:-1] == _group(r) and k[-1] != r["num_spec"]]
      if any(o["tokens"] != r["tokens"] for o in others):
        problems.append("tokens differ with another number of drafts")
    r["problems"] = problems
    r["pass"] = not problems
  return rows


def _setting(r: dict, key: str):
  """A row's setting; rows written before ``linear_prefill`` existed ran recurrent prefill, and
  rows without ``code`` or ``device`` (written before they were recorded) count as one unknown
  version."""
  return r.get(key, "recurrent" if key == "linear_prefill" else None)


def _group(r: dict) -> tuple:
  # Chunked and recurrent prefill sum in other orders: bitwise only within one of them.
  return tuple(
    _setting(r, k)
    for k in (
      "model",
      "dtype",
      "kv_cache_dtype",
      "indexer_cache_dtype",
      "implementation",
      "linear_prefill",
      "code",
      "device",
    )
  )


def markdown(rows: list[dict]) -> str:
  cols = [
    "model",
    "dtype",
    "kv_cache_dtype",
    "indexer_cache_dtype",
    "layout",
    "block_size",
    "kernel_block_size",
    "num_spec",
    "prefix_caching",
    "implementation",
    "linear_prefill",
  ]
  head = [
    "model",
    "weights",
    "latents",
    "indexer",
    "layout",
    "block",
    "split",
    "drafts",
    "prefix",
    "impl",
    "KDA prefill",
    "agree",
    "max dlogp",
    "hits",
    "bitwise grp",
    "s",
    "result",
  ]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in rows:
    vals = [str(_setting(r, c)) if _setting(r, c) is not None else "-" for c in cols]
    hits = "/".join(map(str, r.get("cached_tokens", []))) or "-"
    d = r.get("max_top1_logprob_diff")
    vals += [
      r.get("token_agreement", "-"),
      "-" if d is None else f"{d:.1e}",
      hits,
      str(r.get("bitwise_group_size", "-")),
      str(r["seconds"]),
      "pass" if r["pass"] else "**FAIL**: " + "; ".join(r["problems"]),
    ]
    lines.append("| " + " | ".join(vals) + " |")
  ok = sum(r["pass"] for r in rows)
  versions = sorted({f"{_setting(r, 'code')} on {_setting(r, 'device')}" for r in rows})
  mixed = (
    f" The cells ran {len(versions)} code versions or devices ({'; '.join(versions)}; None: not recorded);"
    " bits are compared within each."
    if len(versions) > 1
    else ""
  )
  return "\n".join(lines) + f"\n\n{ok} of {len(rows)} cells pass.{mixed}\n"


def read_rows(paths) -> list[dict]:
  return [json.loads(line) for path in paths for line in pathlib.Path(path).read_text().splitlines() if line.strip()]


def finished_cells(paths) -> set[str]:
  """The cells of ``paths`` that ran to a result; one that ended in an error (out of memory beside
  other shards) is not finished, so a resumed matrix runs it again."""
  return {_row_key(r) for r in read_rows(paths) if "model" in r and "error" not in r}


def _key(model: str, cell: dict) -> str:
  return json.dumps({"model": model, **cell}, sort_keys=True)


def _row_key(row: dict) -> str:
  """The key of the cell a result row ran."""
  return _key(row["model"], {k: _setting(row, k) for k in SPACE})


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument(
    "--out",
    default="conformance.jsonl",
    help="JSON lines, one per cell, appended as they finish; cells already in it are skipped (those "
    "that ended in an error run again)",
  )
  p.add_argument("--models", default="tiny,slice", help="comma-separated: tiny, slice")
  p.add_argument(
    "--time-budget",
    type=float,
    default=540.0,
    help="seconds: no cell starts after this (the device call's limit is 600)",
  )
  p.add_argument(
    "--shard",
    default="0/1",
    metavar="I/N",
    help="run every N-th cell from the I-th (N processes share one GPU; compiles dominate a cell)",
  )
  p.add_argument(
    "--autotune",
    action="store_true",
    help="let XLA autotune GEMMs (its choice is timed, so it may differ between processes); "
    "by default --xla_gpu_deterministic_ops makes every process compute the same bits",
  )
  p.add_argument("--list", action="store_true", help="print the cells and exit")
  p.add_argument("--markdown", metavar="JSONL", nargs="+", help="print the table of finished runs and exit")
  args = p.parse_args(argv)
  if args.markdown:
    rows = {}
    for r in read_rows(args.markdown):  # a cell's later row wins, but an error never hides a result
      key = _row_key(r) if "model" in r else None
      if key is not None and (key not in rows or "error" in rows[key] or "error" not in r):
        rows[key] = r
    order = {_key(m, c): i for i, (m, c) in enumerate((m, c) for m in MODELS for c in all_cells())}
    print(markdown(compare(sorted(rows.values(), key=lambda r: order.get(_row_key(r), -1)))))
    return 0
  cells = all_cells()
  if args.list:
    for c in cells:
      print(json.dumps(c))
    print(f"{len(cells)} cells per model", file=sys.stderr)
    return 0
  shard, num_shards = (int(x) for x in args.shard.split("/"))
  if not 0 <= shard < num_shards:
    raise SystemExit(f"--shard {args.shard}: want I/N with 0 <= I < N")
  if not args.autotune:  # read when the backend starts, so before the first jax call
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_deterministic_ops=true").strip()
  import jax

  out = pathlib.Path(args.out)
  done = finished_cells([out]) if out.exists() else set()
  todo = [(m, c) for m in args.models.split(",") for c in cells][shard::num_shards]
  # Grouped by weights, so that each process builds each model's weights once per dtype.
  todo = sorted(((m, c) for m, c in todo if _key(m, c) not in done), key=lambda mc: (mc[0], mc[1]["dtype"]))
  start = time.perf_counter()
  code, device = code_version(), str(jax.devices()[0].device_kind)
  rows = []
  with open(out, "a") as f:
    f.write(
      json.dumps(
        {
          "device": device,
          "jax": jax.__version__,
          "xla_flags": os.environ.get("XLA_FLAGS", ""),
          "code": code,
        }
      )
      + "\n"
    )
    for i, (model, cell) in enumerate(todo):
      if time.perf_counter() - start > args.time_budget:
        print(f"time budget reached: {len(todo) - i} cells of shard {args.shard} not started", file=sys.stderr)
        break
      row = run_cell(model, cell, code, device)
      gc.collect()  # the cell's engine, its caches and executables go before the next one is built
      jax.clear_caches()
      rows.append(row)
      f.write(
        json.dumps({k: v for k, v in row.items() if k != "traceback"} | {"traceback": row.get("traceback")}) + "\n"
      )
      f.flush()
      print(
        f"[{time.perf_counter() - start:6.1f}s] {model} {cell} -> {row.get('error') or 'ok'} ({row['seconds']} s)",
        file=sys.stderr,
        flush=True,
      )
  print(markdown(compare(rows)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
