"""Tunes tokamax's ragged dot at the MoE's prefill steps and writes the GPU's tuning table.

    python benchmarks/tune_moe.py --tokens 8192,4096,2048,1024 --out results/tune   # on the GPU

Steps of more than ``PALLAS_MAX_ROWS`` rows (32 tokens x 8 experts) run the MoE's routed GEMMs on
tokamax's Mosaic GPU ragged dot. tokamax has no autotuning entry for this MoE's shapes (288
experts), so it runs its heuristics' tiles (64 x 64 x 128), and its own search space keeps the
output tile 64 columns wide; the sweep (``benchmarks/kernels.py --sweep --only grouped_matmul``)
found 128 x 128 x 64 tiles 1.7-1.8x faster at 8,192 tokens on an H100 (docs/performance.md).

For each step of T tokens (T x 8 rows, routed uniformly) and each projection (gate and up:
``[288, 4096, 2048]``; down: ``[288, 2048, 4096]``) tokamax's autotuner
(``BoundArguments.autotune``, its own benchmark) times its heuristics' config beside the sweep's
best tilings. The fastest goes to the GPU's tuning table,
``pallas_kernels/tuning/tokamax_ragged_dot_<device kind>.json`` (merged with its other shapes),
which ``grouped_matmul`` reads: that shape then runs it, never a config slower than tokamax's own
choice (timed beside it); shapes without an entry run tokamax's heuristics.

Then, through the serving path (``grouped_matmul``, no tiling): each tuned shape's output bitwise
against the heuristics config's, and both timed by ``benchmarks/kernels.py``'s loop. ``--out``:
``tune.json`` with those rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import kernels  # noqa: E402  (benchmarks/kernels.py: the MoE's dimensions and its timing loop)

# The sweep's fastest tilings at 2,048 and 8,192 tokens on an H100 (docs/performance.md), and the
# shape of tokamax's own H100 winners for DeepSeek-sized ragged dots.
CANDIDATES = [
  dict(block_m=128, block_n=128, block_k=64, num_stages=3, persistent=False, grid_minor_dim=0),
  dict(block_m=128, block_n=128, block_k=64, num_stages=4, persistent=False, grid_minor_dim=0),
  dict(block_m=128, block_n=128, block_k=128, num_stages=3, persistent=False, grid_minor_dim=0),
  dict(block_m=64, block_n=128, block_k=64, num_stages=4, persistent=False, grid_minor_dim=0),
  dict(block_m=128, block_n=64, block_k=128, num_stages=4, persistent=True, grid_minor_dim=1, grid_tile_width=8),
]


def bound_arguments(x, w, sizes):
  """tokamax's bound arguments of the serving call, read from its lowering as ``tokamax.autotune``
  reads a function's."""
  import jax
  from tokamax._src.autotuning.api import get_bound_args

  from pallas_kernels.grouped_matmul import grouped_matmul

  (ba,) = get_bound_args(jax.jit(lambda a, b, c: grouped_matmul(a, b, c, implementation="tokamax")), x, w, sizes)
  return ba


def table_row(ba, config, ms: float, heuristic, heuristic_ms: float | None) -> dict:
  """One shape of the tuning table (``grouped_matmul.tokamax_tilings`` reads it)."""
  lhs, rhs = ba.args[:2]
  return {
    "groups": rhs.shape[0],
    "rows": lhs.shape[0],
    "k": lhs.shape[1],
    "n": rhs.shape[2],
    "config": tiling_of(config),
    "ms": ms,
    "heuristic": tiling_of(heuristic),
    "heuristic_ms": heuristic_ms,
  }


def tiling_of(config) -> dict:
  """A tokamax ``Config``'s fields as JSON values (its enums as ints), the unset ones left out."""
  fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
  return {k: int(v) if isinstance(v, enum.Enum) else v for k, v in fields.items() if v is not None}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--tokens", default="8192,4096,2048,1024", help="comma-separated step sizes in tokens (> 32)")
  p.add_argument("--out", help="directory for tune.json")
  p.add_argument("--iters", type=int, default=20, help="calls a timed loop (the serving-path check)")
  p.add_argument("--repeats", type=int, default=5)
  args = p.parse_args(argv)
  import jax
  import tokamax
  from tokamax._src.ops.ragged_dot.pallas_mosaic_gpu import Config

  from pallas_kernels.grouped_matmul import PALLAS_MAX_ROWS, grouped_matmul, tokamax_tilings, tuning_path

  device_kind = jax.devices()[0].device_kind
  tokens = [int(t) for t in args.tokens.split(",")]
  if small := [t for t in tokens if t * kernels.K_MOE <= PALLAS_MAX_ROWS]:
    raise SystemExit(f"--tokens {small}: steps of <= {PALLAS_MAX_ROWS} rows run the Pallas kernel, not tokamax.")
  path = tuning_path(device_kind)
  key = lambda s: (s["groups"], s["rows"], s["k"], s["n"])
  shapes = {key(s): s for s in (json.loads(path.read_text())["shapes"] if path.exists() else [])}
  rows = []
  for t in tokens:
    for proj in ("gate_up", "down"):
      x, w, sizes = kernels.moe_inputs(t, proj)
      ba = bound_arguments(x, w, sizes)
      heuristic = ba.heuristics_config
      data = ba.autotune({heuristic} | {Config(split_k=1, **c) for c in CANDIDATES})
      times = {c: d.median_evaluation_time_ms for c, d in data.items() if not isinstance(d, Exception)}
      best = min(times, key=times.get)
      row = table_row(ba, best, times[best], heuristic, times.get(heuristic))
      shapes[key(row)] = row
      table = {
        "device_kind": device_kind,
        "tokamax_version": tokamax.__version__,
        "shapes": sorted(shapes.values(), key=key),
      }
      path.write_text(json.dumps(table, indent=1) + "\n")  # after every shape: a cut run keeps what it timed
      errors = {str(c): repr(d)[:200] for c, d in data.items() if isinstance(d, Exception)}
      rows.append({"tokens": t, "proj": proj, **row, "errors": errors})
      print(
        f"{t} tokens {proj}: heuristics {row['heuristic_ms']} ms, best {row['ms']:.3f} ms {row['config']}", flush=True
      )
  # The serving path, with the table just written: bits and time against the heuristics' config.
  tokamax_tilings.cache_clear()
  for row in rows:
    x, w, sizes = kernels.moe_inputs(row["tokens"], row["proj"])
    row["serving_tiling"] = tokamax_tilings(device_kind).get(key(row))
    served = grouped_matmul(x, w, sizes, implementation="tokamax")
    heuristic = grouped_matmul(x, w, sizes, implementation="tokamax", tiling=row["heuristic"])
    row["bitwise_equal_to_heuristic"] = bool(np.array_equal(np.asarray(served), np.asarray(heuristic)))
    for name, tiling in (("serving", {}), ("heuristic", row["heuristic"])):
      t, _ = kernels.bench_grouped_matmul(row["tokens"], row["proj"], "tokamax", args.iters, args.repeats, **tiling)
      row[f"{name}_loop_us"] = t * 1e6
    print(
      f"{row['tokens']} tokens {row['proj']}: serving runs {row['serving_tiling']}, bitwise the heuristics': "
      f"{row['bitwise_equal_to_heuristic']}, {row['serving_loop_us']:.1f} us against {row['heuristic_loop_us']:.1f} us",
      flush=True,
    )
  if args.out:
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tune.json").write_text(json.dumps({"device": device_kind, "file": str(path), "rows": rows}, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
