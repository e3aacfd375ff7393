"""The sampler's top-p search by batch, for each width (``jaxkv.engine.sampler.nucleus_floor``).

``jaxkv.engine.sampler.sample`` runs on every step (one executable for greedy and sampling rows);
its top-p floor is a search over float32 bit patterns whose passes are dependent launches on a
GPU. This times that search alone (GLM-5.3-Flash's vocabulary, one position per row, temperature
0.8, top-p 0.9) for ``--ways`` 2 (a bisection: 30 passes of 1 masked sum), 4, 8, 32 (6 passes of
31): median of ``--iters`` calls, after warm-up. ``sampler.nucleus_ways`` picks the width by the
rows of a step. (A Pallas kernel running each row's passes in one program was 6-16x slower on
the H100, docs/kernels.md, and is gone.)

With ``--top-logprobs``, it also times the top ``MAX_LOGPROBS`` log-probs of each row: one
``jax.lax.top_k`` (k = 20: a segmented sort of the rows on a GPU) against
``sampler.top_k_by_kernel`` (passes of XLA's top-k kernel, k <= 16) and against the Pallas
``pallas_kernels.top_k`` at each ``--top-k-blocks`` x ``--top-k-warps`` setting (the sampler's on a
GPU), and checks that all give the same values and ids on random rows and on rows with ties.

    python benchmarks/sampler.py --out docs/results/sampler-h200.json
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def time_nucleus_search(batch: int, vocab: int, ways: int, iters: int, top_p: float = 0.9) -> float:
  """Median microseconds of the jitted ``ways``-way top-p floor on ``[batch, 1, vocab]`` probabilities."""
  import jax
  import jax.numpy as jnp

  from jaxkv.engine.sampler import nucleus_floor

  probs = jax.nn.softmax(jax.random.normal(jax.random.key(batch), (batch, 1, vocab), jnp.float32) * 3.0 / 0.8)
  limit = jnp.full((batch, 1, 1), top_p, jnp.float32)
  return _median_us(jax.jit(functools.partial(nucleus_floor, ways=ways)), probs, limit, iters=iters)


def _median_us(f, *args, iters: int) -> float:
  import jax
  import numpy as np

  jax.block_until_ready(f(*args))
  times = []
  for _ in range(iters):
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    times.append(time.perf_counter() - t)
  return float(np.median(times)) * 1e6


def time_top_logprobs(batch: int, vocab: int, iters: int, settings=()) -> dict:
  """Median microseconds of the top ``MAX_LOGPROBS`` of ``[batch, vocab]`` log-probs by a sort
  (``jax.lax.top_k``), by ``top_k_by_kernel`` and by the Pallas ``top_k`` at each ``(block,
  num_warps)`` of ``settings``, and whether they all agree (random and tied rows)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jaxkv.engine.request import MAX_LOGPROBS
  from jaxkv.engine.sampler import top_k_by_kernel
  from pallas_kernels import top_k

  x = jax.nn.log_softmax(jax.random.normal(jax.random.key(batch), (batch, vocab), jnp.float32) * 3.0)
  tied = jnp.round(x) + 0.0  # + 0.0: no -0.0 (XLA's sort and the kernels may place it apart)
  by_sort = jax.jit(functools.partial(jax.lax.top_k, k=MAX_LOGPROBS))
  paths = {"kernel": jax.jit(functools.partial(top_k_by_kernel, k=MAX_LOGPROBS))}
  for block, warps in settings:
    paths[f"pallas_b{block}_w{warps}"] = functools.partial(
      top_k, k=MAX_LOGPROBS, block=block, num_warps=warps, implementation="pallas"
    )
  same = all(np.array_equal(a, b) for f in paths.values() for rows in (x, tied) for a, b in zip(by_sort(rows), f(rows)))
  out = {"batch": batch, "k": MAX_LOGPROBS, "sort_us": _median_us(by_sort, x, iters=iters)}
  out.update({f"{name}_us": _median_us(f, x, iters=iters) for name, f in paths.items()})
  return {**out, "same_values_and_ids": same}


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--batches", default="1,8,32,128")
  p.add_argument("--ways", default="2,4,8,32")
  p.add_argument("--vocab", type=int, default=154880, help="GLM-5.3-Flash's vocabulary")
  p.add_argument("--iters", type=int, default=100)
  p.add_argument("--out", default=None, help="JSON file")
  p.add_argument("--top-logprobs", action="store_true", help="also time the top-20 log-probs, sort against kernels")
  p.add_argument("--top-k-blocks", default="1024,2048,4096", help="the Pallas top-k's blocks (--top-logprobs)")
  p.add_argument("--top-k-warps", default="4,8", help="the Pallas top-k's warps (--top-logprobs)")
  p.add_argument("--no-nucleus", action="store_true", help="skip the top-p search's widths")
  args = p.parse_args()
  settings = [(int(b), int(w)) for b in args.top_k_blocks.split(",") for w in args.top_k_warps.split(",")]
  import jax

  top = []
  if args.top_logprobs:
    for b in map(int, args.batches.split(",")):
      top.append(time_top_logprobs(b, args.vocab, args.iters, settings))
      print(json.dumps(top[-1]), flush=True)
  rows = []
  for b in map(int, args.batches.split(",")) if not args.no_nucleus else ():
    for w in map(int, args.ways.split(",")):
      rows.append({"batch": b, "ways": w, "us": time_nucleus_search(b, args.vocab, w, args.iters)})
      print(json.dumps(rows[-1]), flush=True)
  print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}, vocabulary {args.vocab}\n")
  ways = sorted({r["ways"] for r in rows})
  if rows:
    print("| batch | " + " | ".join(f"{w}-way us" for w in ways) + " |")
    print("|---|" + "---|" * len(ways))
    for b in sorted({r["batch"] for r in rows}):
      us = {r["ways"]: r["us"] for r in rows if r["batch"] == b}
      print(f"| {b} | " + " | ".join(f"{us[w]:.1f}" if w in us else "-" for w in ways) + " |")
  if top:
    cols = [c for c in top[0] if c.endswith("_us")]
    print("\n| batch | " + " | ".join(c[:-3] + " us" for c in cols) + " | same values and ids |")
    print("|---|" + "---|" * len(cols) + "---|")
    for r in top:
      print(f"| {r['batch']} | " + " | ".join(f"{r[c]:.1f}" for c in cols) + f" | {r['same_values_and_ids']} |")
  if args.out:
    pathlib.Path(args.out).write_text(
      json.dumps(
        {
          "device": jax.devices()[0].device_kind,
          "jax": jax.__version__,
          "vocab": args.vocab,
          "rows": rows,
          "top_logprobs": top,
        },
        indent=1,
      )
    )
  return 0


if __name__ == "__main__":
  sys.exit(main())
