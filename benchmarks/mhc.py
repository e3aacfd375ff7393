"""The mHC's weights by the Pallas kernel against XLA's fusions, in a chain of mHC calls.

A decode or prefill step of GLM-5.3-Flash runs two mHC calls a layer (``HyperConnection``: the
streams' norm and mixing projection, the pre / post / comb weights with their Sinkhorn rounds, the
collapse; then ``expand``). This times ``--calls`` of them chained through the streams (each call's
sublayer replaced by its own input, so nothing but the mHC runs) at the released dimensions
(``glm-5.3-flash-slice4``: 4 streams of 4,096, 20 Sinkhorn iterations, bf16 weights and streams),
for each ``--tokens`` count, with the weights by ``mhc_mix_reference`` (XLA, the step's path before
the kernel) and by ``pallas_kernels.mhc_mix`` (the step's path on a GPU): median of ``--iters``
jitted calls after warm-up, the two interleaved, and the largest difference of their streams.

    python benchmarks/mhc.py --out docs/results/mhc-h200.jsonl
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


def chain(hc, streams, calls: int, mix):
  from models.glm5_next.model import HyperConnection

  for _ in range(calls):
    post, comb, u = hc(streams, mix)
    streams = HyperConnection.expand(post, comb, u, streams)
  return streams


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--tokens", default="1,8,32,2048", help="comma-separated token counts (a step's rows)")
  parser.add_argument("--calls", type=int, default=16, help="mHC calls chained (two a layer)")
  parser.add_argument("--iters", type=int, default=50, help="timed calls of each way (median)")
  parser.add_argument("--out", type=pathlib.Path, help="append one JSON line a token count")
  args = parser.parse_args(argv)

  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from models.glm5_next import get_config
  from models.glm5_next.model import HyperConnection
  from pallas_kernels import resolve_implementation
  from pallas_kernels.mhc_mix import mhc_mix

  config = get_config("glm-5.3-flash-slice4")
  hc = HyperConnection(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  kernel = functools.partial(mhc_mix, implementation="pallas")
  ways = {
    "xla": jax.jit(lambda s: chain(hc, s, args.calls, None)),
    "kernel": jax.jit(lambda s: chain(hc, s, args.calls, kernel)),
  }
  print(f"device: {jax.devices()[0].device_kind}; kernel path: {resolve_implementation('auto')}", file=sys.stderr)
  rows = []
  for t in (int(x) for x in args.tokens.split(",")):
    streams = jax.random.normal(jax.random.key(t), (1, t, config.hc_mult, config.hidden_size), jnp.bfloat16)
    outs = {name: jax.block_until_ready(f(streams)) for name, f in ways.items()}  # compile, warm up
    times = {name: [] for name in ways}
    for _ in range(args.iters):
      for name, f in ways.items():  # interleaved: the two see the same clocks
        start = time.perf_counter()
        jax.block_until_ready(f(streams))
        times[name].append(time.perf_counter() - start)
    us = {name: float(np.median(v)) * 1e6 for name, v in times.items()}
    diff = float(jnp.max(jnp.abs(outs["xla"].astype(jnp.float32) - outs["kernel"].astype(jnp.float32))))
    row = {
      "benchmark": "mhc_chain",
      "device": jax.devices()[0].device_kind,
      "tokens": t,
      "calls": args.calls,
      "xla_us": us["xla"],
      "kernel_us": us["kernel"],
      "saved_us_per_call": (us["xla"] - us["kernel"]) / args.calls,
      "max_abs_diff": diff,
    }
    rows.append(row)
    print(json.dumps(row))
    if args.out:
      with args.out.open("a") as f:
        f.write(json.dumps(row) + "\n")
  print("\n| tokens | XLA us | kernel us | saved a call, us | max difference |\n|---|---|---|---|---|")
  for r in rows:
    print(
      f"| {r['tokens']} | {r['xla_us']:.1f} | {r['kernel_us']:.1f} | {r['saved_us_per_call']:.2f} | {r['max_abs_diff']:.2e} |"
    )
  return 0


if __name__ == "__main__":
  sys.exit(main())
