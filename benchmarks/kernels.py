"""Kernel benchmark: Pallas vs the XLA reference vs the measured HBM bandwidth, in one run.

    python benchmarks/kernels.py --out results/          # on the GPU: table, JSON
    python benchmarks/kernels.py --plot results/kernels.json   # anywhere: the plot

Each case times ``--iters`` back-to-back calls inside one jitted ``fori_loop`` (no host dispatch
between them; each call depends on the previous one so XLA cannot hoist it), after a warm-up call,
and reports the median over ``--repeats`` such loops; ``--clock device`` reports instead the
kernels' busy time per call from a profiler trace of the ``--repeats`` loops (for kernels of a
few microseconds, whose short loops' wall time is mostly dispatch: ``--iters 2 --clock device``
compiles a 2-call loop and still times only the device's work). Bytes are the fewest a kernel must move
(inputs read once, outputs written once); "of BW" divides bytes/time by the bandwidth of a large
bf16 elementwise pass measured in the same run. Inputs are random (never zeros); block tables are
random permutations.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import statistics
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from jaxkv.gpu_target import GPU_TARGETS  # noqa: E402

KPOOL, D_IDX, H_IDX, P = 4, 128, 32, 64
CLOCK = "wall"  # --clock: "wall" (host timer around each loop) or "device" (the trace's kernel time)
# Under --clock device: the last timed loop's kernels, us per call each (a case of several kernels,
# as chunk_kda's three, says which of them costs).
LAST_KERNELS: dict[str, float] = {}
H_MLA, L_MLA, TOPK = 64, 512, 2048
E_MOE, D_MOE, F_MOE, K_MOE = 288, 4096, 2048, 8  # routed experts, hidden, expert width, experts per token
H_KDA, D_KDA = 64, 128  # KDA heads, head dim (K = V)


def _moe_tilings(smem_bytes=GPU_TARGETS["NVIDIA H200"].shared_memory_bytes):
  """tokamax's own choice (no tiling: its Hopper heuristics, 64 x 64 x 128 tiles in 2 stages, M
  tiles fastest), then two families of explicit tilings:

  * the shape of tokamax's own H100 autotuning winners for DeepSeek-sized ragged dots (its
    ``data/autotuning/nvidia_h100_80gb_hbm3/pallas_mosaic_gpu_ragged_dot.json``: 128 x 64 x 128
    tiles, mostly persistent with N fastest in bands of 4-8 row tiles, ``grid_tile_width``), which
    have no entry for this MoE's shapes;
  * wider output tiles in the M-fastest order (``grid_minor_dim=0``): its kernel runs one
    warpgroup of wgmma, so a wider tile reads each row tile fewer times. Kept: an accumulator of
    at most 128 float32 registers a thread (``block_m * block_n <= 16384``) and the stages' bf16
    operand tiles and the output tile within the shared memory a block may opt into (``GPU_TARGETS``:
    227 KiB on the H100 and H200).

  The third session of 2026-12-04 swept 64-column tiles with N fastest in bands of one row tile,
  and tokamax's choice won prefill by 1.3-1.5x (docs/performance.md, "The MoE's tiling")."""
  tile = dict(path="tokamax", block_m=128, block_n=64, block_k=128, split_k=1)
  winners = [
    dict(tile, num_stages=s, persistent=p, grid_minor_dim=d, grid_tile_width=w)
    for s, p, d, w in (
      (4, True, 1, 8),
      (4, True, 1, 4),
      (4, False, 1, 4),
      (2, False, 0, 1),
      (4, False, 0, 2),
      (4, True, 0, 1),
    )
  ]
  wide = [
    dict(path="tokamax", block_m=m, block_n=n, block_k=k, num_stages=s, split_k=1, persistent=False, grid_minor_dim=0)
    for m in (64, 128)
    for n in (128, 256)
    for k in (64, 128)
    for s in (3, 4)
    if m * n <= 16384 and 2 * (s * (m * k + k * n) + m * n) <= smem_bytes
  ]
  return [dict(path="tokamax")] + winners + wide


# Swept at the goal sizes (``--sweep``); every setting is timed at each size and written down, and
# the kernels' defaults are set from these runs (docs/kernels.md).
SWEEP = [
  (
    "paged_mqa_logits",
    [dict(batch=1, ctx=131072), dict(batch=64, ctx=32768)],
    [dict(pages_per_program=p, num_warps=w) for p in (1, 2, 4, 8) for w in (2, 4)],
  ),
  # A 32k prompt's prefill step: 8,192 queries of one request, 2,048 rows each, mostly from L2 (the
  # prompt's latents are 38 MB), at 178 TFLOP/s on an H100 (docs/performance.md, "Open", 2). Built
  # for sm_90, the default holds its [64, 512] float32 accumulator in 255 registers and spills 584
  # bytes a thread; 32 or 16 heads a program build without spills (174-180 registers) and read each
  # row once a head tile.
  (
    "sparse_mla_decode",
    [dict(batch=1, queries=8192, ctx=32768), dict(batch=64, ctx=32768)],
    [{}]
    + [dict(block_h=h, num_warps=w) for h, w in ((32, 4), (32, 8), (16, 4))]
    + [dict(block_h=32, block_k=32, num_warps=4), dict(num_stages=1), dict(block_k=32), dict(latent_block=256)],
  ),
  # fp8 latents: the default beside the column slices, which spill least with fp8 (256 columns x 32
  # rows: 64 / 64 bytes against 840 / 724 whole) but were no faster on an H100 (docs/kernels.md).
  (
    "sparse_mla_decode",
    [dict(batch=64, ctx=32768, cache_dtype="fp8")],
    [{}, dict(block_k=32)]
    + [dict(latent_block=b, block_k=k) for b in (128, 256) for k in (32, 64)]
    + [dict(latent_block=b, block_k=32, num_warps=4) for b in (128, 256)],
  ),
  (
    "sparse_mla_decode",
    [dict(batch=64, ctx=32768), dict(batch=1, ctx=32768)],
    # The default and the column slices (never timed) first, so a call cut short has them.
    [{}]
    + [dict(latent_block=b, block_k=k) for b in (128, 256) for k in (32, 64)]
    + [dict(block_k=k, block_h=h, num_warps=w) for k in (32, 64) for h in (16, 32, 64) for w in (4, 8)],
  ),
  # The KDA recurrence: prefill steps (one 2048-token request: a 32k prompt; two of 1024: the
  # 32 x 1024 benchmark; 32 of 64: the same with long_prefill_token_threshold=64) and decode steps.
  # The tile of V sets the programs per (request, head).
  (
    "kda_recurrence",
    [
      dict(reqs=1, tokens=2048),
      dict(reqs=2, tokens=1024),
      dict(reqs=32, tokens=64),
      dict(reqs=32, tokens=1),
      dict(reqs=1, tokens=1),
    ],
    # 64 columns on one warp is left out: it alone spills when built for sm_90 (docs/kernels.md).
    [dict(block_v=b, num_warps=w) for b in (8, 16, 32, 64) for w in (1, 2, 4, 8) if (b, w) != (64, 1)],
  ),
  # Chunked KDA prefill at the same prefill steps: the state kernel's tile of V and warps, the
  # per-chunk kernels' tile of K and warps (`jaxkv lower --build` counts each setting's registers
  # and spills without a GPU; docs/kernels.md). IEEE float32 products are out: 5.7x slower than
  # 3xTF32 on the H200.
  (
    "kda_chunk",
    # 32 x 256: an 8,192-token step of 32 prompts at the engine's long-prefill cap of 256.
    [dict(reqs=32, tokens=256), dict(reqs=1, tokens=2048), dict(reqs=2, tokens=1024)],
    # The per-chunk kernels first: the one they replaced was the cost on the H200 (docs/kernels.md).
    [dict(scores_warps=s, prepare_warps=w) for s in (2, 4) for w in (4, 8)]
    + [dict(prepare_block_k=64, scores_warps=s) for s in (2, 4)]
    + [dict(block_v=b, num_warps=w) for b in (16, 32, 64) for w in (4, 8)],
  ),
  # The MoE's grouped matmul: tokamax's tilings at prefill steps of 8,192 and 2,048 tokens first
  # (not yet timed; a call cut short keeps them), then at decode steps (a few rows per expert) the
  # Pallas kernel's tilings beside tokamax's own (timed in the seventh session of 2026-12-06).
  (
    "grouped_matmul",
    [dict(tokens=t, proj=p) for t in (8192, 2048) for p in ("gate_up", "down")],
    _moe_tilings(),
  ),
  (
    "grouped_matmul",
    [dict(tokens=t, proj=p) for t in (1, 8, 32) for p in ("gate_up", "down")],
    [dict(path="tokamax"), {}]
    + [
      dict(block_n=n, block_k=k, num_stages=s)
      for n, k, s in ((64, 128, 4), (256, 128, 4), (128, 64, 4), (128, 128, 3), (128, 256, 3))
    ]
    + [dict(block_n=128, block_k=128, num_warps=8), dict(block_n=256, block_k=64, num_stages=5)],
  ),
  # The indexer's selection: entries a program (more programs a row where rows are few and long),
  # entries read at a time, warps.
  (
    "topk_selection",
    [dict(rows=1, entries=32768, ctx=131072), dict(rows=32, entries=32768, ctx=131072)],
    [dict(seg=g, block=b, num_warps=w) for g in (1024, 4096) for b in (256, 1024) for w in (4, 8)],
  ),
]
# The defaults before issue 11 ("pallas_previous" in the table: the old kernels, same run).
PREVIOUS = {"paged_mqa_logits": dict(pages_per_program=8, num_warps=2, num_stages=3)}


def _timeit(step, state, consts, iters, repeats):
  """Median seconds per call of ``state = step(state, consts)`` over ``iters`` calls in one jitted loop.

  Large inputs travel as ``consts`` arguments (never closed over: jit would embed them).
  """
  import jax

  # Unrolled: a device-side while loop syncs its predicate with the host every iteration (~20 us),
  # which would swamp small kernels.
  # The state is donated: an in-place cache update must not start with a copy of the caller's buffer.
  @functools.partial(jax.jit, donate_argnums=0)
  def loop(s, c):
    return jax.lax.fori_loop(0, iters, lambda i, x: step(x, c), s, unroll=True)

  state = jax.block_until_ready(loop(state, consts))  # compile + warm up
  if CLOCK == "device":
    return _device_seconds(loop, state, consts, iters, repeats)
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    state = jax.block_until_ready(loop(state, consts))
    times.append((time.perf_counter() - t0) / iters)
  return statistics.median(times)


def _device_seconds(loop, state, consts, iters, repeats):
  """Device seconds per call: the union of the kernels' intervals in a trace of ``repeats`` runs
  of ``loop`` (``jaxkv.profiling.summarize_trace``), without the host's dispatch or the gaps."""
  import tempfile

  import jax

  from jaxkv.profiling import summarize_trace

  with tempfile.TemporaryDirectory() as trace_dir:
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    for _ in range(repeats):
      state = jax.block_until_ready(loop(state, consts))
    jax.profiler.stop_trace()
    summary = summarize_trace(trace_dir, repeats * iters, top=6)
  LAST_KERNELS.clear()
  LAST_KERNELS.update({k["name"][:60]: round(k["ms_per_step"] * 1e3, 2) for k in summary["top"]})
  return summary["busy_ms_per_step"] / 1e3


def _dep(x):
  """A zero that XLA cannot fold, derived from ``x`` (chains the loop's calls)."""
  import jax.numpy as jnp

  v = x.reshape(-1)[0].astype(jnp.float32)
  return jnp.where(jnp.isnan(v), 1.0, 0.0)


def measure_bandwidth(iters, repeats):
  import jax
  import jax.numpy as jnp

  # One 2 GiB read + 2 GiB write per call, donated so no allocation is timed; single calls.
  x = jax.random.normal(jax.random.key(0), (1 << 30,), jnp.bfloat16)
  nbytes = 2 * x.nbytes
  f = jax.jit(lambda a: a * jnp.bfloat16(1.0001) + jnp.bfloat16(0.5), donate_argnums=0)
  x = jax.block_until_ready(f(x))
  times = []
  for _ in range(max(repeats, 10)):
    t0 = time.perf_counter()
    x = jax.block_until_ready(f(x))
    times.append(time.perf_counter() - t0)
  return nbytes / statistics.median(times)


def bench_mqa_logits(batch, ctx, impl, iters, repeats, **tune):
  import jax
  from jaxkv import KernelView
  import jax.numpy as jnp
  from pallas_kernels._common import quantize_fp8_pow2, value_bytes
  from pallas_kernels.paged_mqa_logits import paged_mqa_logits

  entries = ctx // KPOOL
  pages_per_req = entries // P
  num_pages = batch * pages_per_req + 1
  k = jax.random.normal(jax.random.key(1), (num_pages, P, D_IDX), jnp.float32)
  q8, sc = quantize_fp8_pow2(k)
  pages = jnp.concatenate([value_bytes(q8).reshape(num_pages, -1), value_bytes(sc).reshape(num_pages, -1)], 1)
  table = jnp.asarray(
    np.random.default_rng(0).permutation(np.arange(1, num_pages)).reshape(batch, pages_per_req).astype(np.int32)
  )
  q = jax.random.normal(jax.random.key(2), (batch, 1, H_IDX, D_IDX), jnp.float32)
  w = jax.random.normal(jax.random.key(3), (batch, H_IDX), jnp.float32)
  ctx_lens = jnp.full((batch, 1), entries, jnp.int32)
  view = KernelView.for_rows(pages.shape[1], entries_per_page=P, cache_dtype="fp8")

  # The chain enters through q, the operand of the expensive part, so XLA cannot hoist or CSE it.
  def step(q_, c):
    out = paged_mqa_logits(q_.astype(jnp.float8_e4m3fn), c[0], c[1], c[2], c[3], view=view, implementation=impl, **tune)
    return q_ + _dep(out)

  t = _timeit(step, q, (pages, w, ctx_lens, table), iters, repeats)
  nbytes = batch * entries * (D_IDX + 4) + batch * entries * 4 + q.nbytes + w.nbytes
  return t, nbytes


def bench_sparse_mla(batch, ctx, impl, iters, repeats, cache_dtype="bfloat16", queries=1, **tune):
  """Sparse MLA over ``batch`` requests of ``ctx`` tokens, ``queries`` query tokens each (1:
  decode; a prefill step's 8,192 tokens of one 32k prompt: ``batch=1, queries=8192``), each query
  with its own 2,051 random rows. Bytes: the rows each query reads, the queries and outputs."""
  import jax
  from jaxkv import KernelView
  import jax.numpy as jnp
  from pallas_kernels.cache_write import encode_entries, entry_bytes
  from pallas_kernels.sparse_mla_decode import sparse_mla_decode

  bs = 1024
  blocks = batch * (ctx // bs) + 1
  e = entry_bytes(L_MLA, cache_dtype)
  # Whole blocks of random latents, encoded as the cache writer stores them (fp8: values + scales).
  latents = jax.random.normal(jax.random.key(4), (blocks * bs, L_MLA), jnp.bfloat16)
  cache = jax.jit(encode_entries, static_argnums=1)(latents, cache_dtype).reshape(blocks, bs * e)
  rng = np.random.default_rng(1)
  table = jnp.asarray(rng.permutation(np.arange(1, blocks)).reshape(batch, ctx // bs).astype(np.int32))
  k = TOPK + KPOOL - 1
  nq = batch * queries
  idx = np.stack([rng.choice(ctx, size=min(k, ctx), replace=False) for _ in range(nq)]).astype(np.int32)
  idx = jnp.asarray(np.pad(idx, ((0, 0), (0, k - idx.shape[1])), constant_values=-1))
  q = jax.random.normal(jax.random.key(5), (nq, H_MLA, L_MLA), jnp.bfloat16)
  reqs = jnp.asarray(np.repeat(np.arange(batch), queries).astype(np.int32))

  def step(q_, c):
    out = sparse_mla_decode(
      q_,
      *c,
      view=KernelView.for_rows(bs * e, tokens_per_row=bs, cache_dtype=cache_dtype),
      sm_scale=L_MLA**-0.5,
      implementation=impl,
      **tune,
    )
    return q_ + _dep(out).astype(q_.dtype)

  t = _timeit(step, q, (cache, idx, reqs, table), iters, repeats)
  nbytes = nq * min(k, ctx) * e + q.nbytes + nq * H_MLA * L_MLA * 4
  return t, nbytes


def moe_inputs(tokens: int, proj: str):
  """One routed-expert projection's arguments at a step of ``tokens`` tokens: ``tokens`` x 8 rows
  (each token's 8 experts drawn uniformly, rows sorted by expert), ``[288, K, N]`` bf16 weights
  (``proj`` ``"gate_up"``: K 4096, N 2048; ``"down"``: 2048 -> 4096) and the experts' row counts."""
  import jax
  import jax.numpy as jnp

  rng = np.random.default_rng(7)
  chosen = np.argsort(rng.random((tokens, E_MOE)), axis=1)[:, :K_MOE]
  sizes = np.bincount(chosen.ravel(), minlength=E_MOE).astype(np.int32)
  k, n = (D_MOE, F_MOE) if proj == "gate_up" else (F_MOE, D_MOE)
  w = jax.random.normal(jax.random.key(8), (E_MOE, k, n), jnp.bfloat16)
  x = jax.random.normal(jax.random.key(9), (tokens * K_MOE, k), jnp.bfloat16)
  return x, w, jnp.asarray(sizes)


def bench_grouped_matmul(tokens, proj, impl, iters, repeats, path=None, **tune):
  """One routed-expert projection of the released MoE: ``tokens`` x 8 rows (each token's 8 experts
  drawn uniformly, rows sorted by expert) times ``[288, K, N]`` bf16 weights; ``proj`` ``"gate_up"``
  (K 4096, N 2048: gate and up each run one) or ``"down"`` (2048 -> 4096). ``impl``: ``"pallas"``
  (``path="tokamax"``: tokamax's kernel), ``"tokamax"`` or ``"xla"``; ``tune`` the kernel's
  tiling. Bytes: the weights of the experts that have rows, the rows in and out (prefill sizes are
  bound by the matmul rate instead: ``2 M K N`` FLOPs)."""
  from pallas_kernels.grouped_matmul import grouped_matmul

  x, w, sizes = moe_inputs(tokens, proj)
  implementation = path or impl

  def step(x_, c):
    out = grouped_matmul(x_, c[0], c[1], implementation=implementation, tiling=tune or None)
    return x_ + _dep(out).astype(x_.dtype)

  t = _timeit(step, x, (w, sizes), iters, repeats)
  k, n = w.shape[1:]
  return t, int(np.count_nonzero(np.asarray(sizes))) * k * n * 2 + x.nbytes + tokens * K_MOE * n * 2


def _kda_inputs(reqs, tokens):
  """The KDA inputs at the released dimensions (64 heads, K = V = 128): ``reqs`` requests of
  ``tokens`` tokens each, in permuted rows; q, k, v, g, beta, the states and each token's request."""
  import jax
  import jax.numpy as jnp

  t = reqs * tokens
  keys = jax.random.split(jax.random.key(10), 6)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # q and k are L2-normed in the model
  q = unit(jax.random.normal(keys[0], (t, H_KDA, D_KDA), jnp.float32))
  k = unit(jax.random.normal(keys[1], (t, H_KDA, D_KDA), jnp.float32))
  v = jax.random.normal(keys[2], (t, H_KDA, D_KDA), jnp.float32)
  g = -0.1 * jax.nn.softplus(jax.random.normal(keys[3], (t, H_KDA, D_KDA), jnp.float32))  # log-decay
  beta = jax.nn.sigmoid(jax.random.normal(keys[4], (t, H_KDA), jnp.float32))
  state = jax.random.normal(keys[5], (reqs, H_KDA, D_KDA, D_KDA), jnp.float32)
  req = jnp.asarray(np.repeat(np.random.default_rng(5).permutation(reqs), tokens).astype(np.int32))
  return q, k, v, g, beta, state, req


def bench_kda(reqs, tokens, impl, iters, repeats, **tune):
  """The fused KDA recurrence: ``reqs`` requests of ``tokens`` tokens each in one step, each saving
  its last token's state (prefill and decode without drafts). Bytes: each request's float32 state
  read and its new state written, the token inputs read and outputs written."""
  import jax.numpy as jnp
  from pallas_kernels.kda_recurrence import fused_recurrent_kda

  q, k, v, g, beta, state, req = _kda_inputs(reqs, tokens)
  pages = jnp.zeros((reqs, H_KDA * D_KDA * D_KDA), jnp.uint32)  # one state page per request
  dest = jnp.arange(reqs, dtype=jnp.int32)[:, None]
  slot = jnp.asarray(np.tile(np.r_[np.full(tokens - 1, -1), 0], reqs).astype(np.int32))  # the last token's: 0

  def step(carry, c):
    q_, pages_ = carry
    o, pages_ = fused_recurrent_kda(q_, *c[:5], pages_, *c[5:], implementation=impl, **tune)
    return q_ + _dep(o), pages_

  sec = _timeit(step, (q, pages), (k, v, g, beta, state, dest, req, slot), iters, repeats)
  out_nbytes = v.nbytes  # o: [T, H, V] float32
  return sec, 2 * state.nbytes + q.nbytes + k.nbytes + v.nbytes + g.nbytes + beta.nbytes + out_nbytes


def bench_mhc_mix(tokens, impl, iters, repeats, **tune):
  """The mHC weights of ``tokens`` tokens at the released config (4 streams, 20 Sinkhorn
  iterations): the kernel against the XLA fusions it replaces in the step. Bytes: the mixing logits
  read, the pre, post and comb weights written."""
  import jax
  import jax.numpy as jnp
  from models.glm5_next import get_config
  from pallas_kernels.mhc_mix import mhc_mix

  config = get_config("glm-5.3-flash-slice4")
  n, width = config.hc_mult, (2 + config.hc_mult) * config.hc_mult
  mixed = jax.random.normal(jax.random.key(0), (tokens, width), jnp.float32) * 3
  scale = jax.random.uniform(jax.random.key(1), (3,), jnp.float32, 0.5, 1.5)
  base = jax.random.normal(jax.random.key(2), (width,), jnp.float32) * 0.5
  kw = dict(n=n, eps=config.hc_eps, iters=config.hc_sinkhorn_iters, implementation=impl, **tune)

  def step(m, c):
    return m + _dep(mhc_mix(m, *c, **kw)[2])

  sec = _timeit(step, mixed, (scale, base), iters, repeats)
  return sec, mixed.nbytes + tokens * (2 * n + n * n) * 4


def bench_topk_selection(rows, entries, ctx, impl, iters, repeats, **tune):
  """The DSA indexer's selection of 512 pools (index_topk 2048, kpool 4) from ``rows`` rows of
  ``entries`` scores (the block table's width: ``max_model_len / 4``), each query seeing its
  ``ctx / 4`` first (a prefill step's ``rows`` queries the last positions of a ``ctx`` prompt).
  Bytes: the visible scores read once, the token indices written."""
  import jax
  import jax.numpy as jnp
  from pallas_kernels.topk_selection import select_topk_tokens

  logits = jax.nn.relu(jax.random.normal(jax.random.key(0), (rows, entries), jnp.float32))
  seq_lens = ctx - rows + 1 + jnp.arange(rows, dtype=jnp.int32)
  kw = dict(kpool=4, index_topk=2048, implementation=impl, **tune)

  def step(n, c):  # the lengths carry the chain: a [rows] add, not a pass over the scores
    return n + _dep(select_topk_tokens(c, n, **kw)).astype(jnp.int32)

  nbytes = int(jnp.sum(jnp.minimum(seq_lens // 4, entries))) * 4 + rows * 2051 * 4
  return _timeit(step, seq_lens, logits, iters, repeats), nbytes  # seq_lens donated


def bench_kda_chunk(reqs, tokens, impl, iters, repeats, **tune):
  """Chunked KDA prefill (``chunk_kda``) on the inputs of ``bench_kda``, every request from position
  0; ``impl="recurrent"`` times the fused recurrence (its default tile) on the same tokens, the
  baseline the chunked form must beat. Bytes as ``bench_kda``'s, plus the prefix rows written."""
  import jax.numpy as jnp
  from pallas_kernels.kda_chunk import ChunkPrefix, chunk_kda

  if impl == "recurrent":
    return bench_kda(reqs, tokens, "pallas", iters, repeats)
  q, k, v, g, beta, state, req = _kda_inputs(reqs, tokens)
  pos = jnp.asarray(np.tile(np.arange(tokens), reqs).astype(np.int32))
  prefix = ChunkPrefix.zeros(reqs, H_KDA, D_KDA, D_KDA)

  def step(carry, c):
    q_, state_, prefix_ = carry
    o, state_, prefix_ = chunk_kda(q_, *c[:4], state_, prefix_, *c[4:], implementation=impl, **tune)
    return q_ + _dep(o), state_, prefix_

  sec = _timeit(step, (q, state, prefix), (k, v, g, beta, req, pos), iters, repeats)
  nbytes = 2 * state.nbytes + q.nbytes + k.nbytes + v.nbytes + g.nbytes + beta.nbytes + v.nbytes
  return sec, nbytes + sum(x.nbytes for x in prefix)


def bench_bare_copy(nbytes, iters, repeats):
  """An elementwise pass reading and writing ``nbytes / 2`` bytes each, chained and donated like
  the kernels: the time the same bytes take without any addressing (the cache-write and kpool goal's
  baseline)."""
  import jax
  import jax.numpy as jnp

  x = jax.random.bits(jax.random.key(15), (max(1, nbytes // 8),), jnp.uint32)
  return _timeit(lambda s, c: s ^ jnp.uint32(1), x, (), iters, repeats)


def bench_cache_write(tokens, impl, iters, repeats, **tune):
  import jax
  from jaxkv import KernelView
  import jax.numpy as jnp
  from pallas_kernels.cache_write import write_to_paged_cache

  bs, e = 1024, L_MLA * 2  # bf16 latents into rows of the GLM-5.3-Flash packed block geometry
  row_bytes, offset, blocks = 11_911_680, 371_712, 400
  cache = jax.random.bits(jax.random.key(6), (blocks, row_bytes), jnp.uint8)
  slots = jnp.asarray(
    np.random.default_rng(2).choice(np.arange(bs, blocks * bs), tokens, replace=False).astype(np.int32)
  )
  entries = jax.random.bits(jax.random.key(7), (tokens, e), jnp.uint8)

  def step(c, k):
    return write_to_paged_cache(
      c, k[0], k[1], view=KernelView.for_rows(row_bytes, tokens_per_row=bs, offset_bytes=offset), implementation=impl
    )

  t = _timeit(step, cache, (entries, slots), iters, repeats)
  return t, 2 * tokens * e


def bench_kpool(tokens, impl, iters, repeats, **tune):
  """``impl="scatter"``: a bare XLA scatter of the same pooled-entry and ring bytes (the goal's baseline)."""
  import jax
  from jaxkv import KernelView, cdiv
  import jax.numpy as jnp
  from pallas_kernels.cache_write import write_to_paged_cache
  from pallas_kernels.kpool import kpool_compress_and_write

  ring, blocks, pages_per_block = 4, 512, 8
  page_bytes = P * (D_IDX + 4)
  reqs_n = max(1, tokens // 256)
  per = tokens // reqs_n
  cache = jax.random.bits(jax.random.key(8), (blocks * pages_per_block, page_bytes), jnp.uint8)
  tail = jax.random.bits(jax.random.key(9), (blocks, 2 * ring * D_IDX * 2), jnp.uint8)
  keys = jax.random.normal(jax.random.key(10), (tokens, D_IDX), jnp.bfloat16)
  gates = jax.random.normal(jax.random.key(11), (tokens, D_IDX), jnp.bfloat16)
  ape = jax.random.normal(jax.random.key(12), (KPOOL, D_IDX), jnp.float32)
  rng = np.random.default_rng(3)
  req = np.repeat(np.arange(reqs_n), per).astype(np.int32)
  pos = np.tile(np.arange(per), reqs_n).astype(np.int32)
  blk = rng.permutation(np.arange(1, blocks))[:reqs_n]
  tail_slots = (blk[req] * ring + pos % ring).astype(np.int32)
  pool = pos // KPOOL
  page = rng.permutation(np.arange(1, blocks * pages_per_block))[: reqs_n * cdiv(per, KPOOL * P)]
  page = page.reshape(reqs_n, -1)
  cslots = np.where((pos + 1) % KPOOL == 0, page[req, pool // P] * P + pool % P, -1).astype(np.int32)
  args = [jnp.asarray(a) for a in (pos, req, tail_slots, cslots)]
  nbytes = tokens * D_IDX * 2 * 2 + tokens // KPOOL * (D_IDX + 4) + 2 * reqs_n * ring * D_IDX * 2
  if impl == "scatter":
    n_pool = tokens // KPOOL
    entries = jax.random.bits(jax.random.key(13), (n_pool, D_IDX + 4), jnp.uint8)
    ring_entries = jax.random.bits(jax.random.key(14), (reqs_n * ring, 2 * D_IDX * 2), jnp.uint8)
    pool_slots = jnp.asarray(cslots[cslots >= 0])
    ring_slots = jnp.asarray((blk[:, None] * ring + np.arange(ring)).reshape(-1).astype(np.int32))

    def scatter(state, k):
      c, tl = state
      c = write_to_paged_cache(
        c, k[0], k[1], view=KernelView.for_rows(page_bytes, tokens_per_row=P), implementation="xla"
      )
      return c, write_to_paged_cache(
        tl, k[2], k[3], view=KernelView.for_rows(tail.shape[1], tokens_per_row=ring), implementation="xla"
      )

    return _timeit(scatter, (cache, tail), (entries, pool_slots, ring_entries, ring_slots), iters, repeats), nbytes

  def step(state, k):
    c, tl = state
    return kpool_compress_and_write(
      c,
      tl,
      *k,
      view=KernelView.for_rows(page_bytes, entries_per_page=P, cache_dtype="fp8"),
      tail_view=KernelView.for_rows(tail.shape[1], tokens_per_row=ring),
      kpool=KPOOL,
      implementation=impl,
    )

  return _timeit(step, (cache, tail), (keys, gates, ape, *args), iters, repeats), nbytes


def step_metadata_spec():
  """Eight KV-cache groups (token groups of four block sizes, two rings, two recurrent states) and
  their attention groups: dense and packed splits, compressed caches with and without a split."""
  from jaxkv import KernelTableGroup, SlotGroup, StepMetadataSpec

  return StepMetadataSpec(
    (
      SlotGroup("tokens", 16),
      SlotGroup("tokens", 64),
      SlotGroup("tokens", 256),
      SlotGroup("ring", 8),
      SlotGroup("ring", 128),
      SlotGroup("none", 64),
      SlotGroup("none", 64),
      SlotGroup("tokens", 1024),
    ),
    (
      KernelTableGroup(0),
      KernelTableGroup(2, 4, 4, mapped=True),
      KernelTableGroup(2, 2, 7, mapped=True, states_per_page=32, compress_ratio=4),
      KernelTableGroup(1, states_per_page=16, compress_ratio=4),
      KernelTableGroup(3),
      KernelTableGroup(4),
      KernelTableGroup(5),
      KernelTableGroup(6),
      KernelTableGroup(7, 16, 16, mapped=True),
    ),
  )


def bench_step_metadata(tokens, impl, iters, repeats, reqs=256, max_model_len=32768, **tune):
  """A step's slots and kernel tables for ``reqs`` request rows of up to ``max_model_len`` tokens:
  ``tokens`` = ``reqs`` is a decode step (one token each), more a prefill step (equal chunks).

  Each call's slots feed the next call's positions through a reduction over every slot row (so
  XLA keeps all of them); the kernel tables are the donated loop state."""
  import jax.numpy as jnp
  from pallas_kernels.step_metadata import compute_step_metadata

  spec = step_metadata_spec()
  rng = np.random.default_rng(4)
  tables, counts = [], []
  for sg in spec.slot_groups:
    width = max_model_len // sg.block_size if sg.kind == "tokens" else 1
    tables.append(jnp.asarray(rng.integers(1, 1 << 20, (reqs, width)).astype(np.int32)))
    counts.append(jnp.asarray(rng.integers(1, width + 1, reqs).astype(np.int32)))
  per = tokens // reqs if tokens >= reqs else 1
  n = min(tokens, reqs)
  req = np.repeat(rng.permutation(reqs)[:n], per).astype(np.int32)
  lens = np.asarray(counts[0])[req] * 16
  pos = (rng.integers(0, 1 << 30, tokens) % np.maximum(lens - per, 1) + np.tile(np.arange(per), n)).astype(np.int32)
  bufs = tuple(
    jnp.zeros((reqs, tables[ag.kv_cache_group_id].shape[1] * ag.blocks_per_kernel_block), jnp.int32)
    if ag.mapped
    else None
    for ag in spec.attention_groups
  )

  def step(state, c):
    kts, p = state
    meta = compute_step_metadata(c[0], c[1], c[2], p, kts, spec=spec, implementation=impl)
    rows = [s for s in meta.slot_mappings + meta.compressed_slot_mappings if s is not None]
    dep = sum(jnp.where(jnp.max(r) == -12345, 1, 0) for r in rows).astype(jnp.int32)
    return meta.kernel_block_tables, p + dep

  t = _timeit(step, (bufs, jnp.asarray(pos)), (tuple(tables), tuple(counts), jnp.asarray(req)), iters, repeats)
  mapped = [b for b in bufs if b is not None]
  nrows = sum(1 for sg in spec.slot_groups if sg.kind != "none") + sum(ag.compressed for ag in spec.attention_groups)
  # Written once: every slot row and kernel table; read once: the mapped manager tables, tokens.
  nbytes = 4 * (
    nrows * tokens
    + sum(b.size for b in mapped)
    + 2 * tokens
    + sum(tables[ag.kv_cache_group_id].size for ag in spec.attention_groups if ag.mapped)
  )
  return t, nbytes


def run(args):
  import jax

  rows = []
  bw = measure_bandwidth(args.iters, args.repeats)
  dev = jax.devices()[0]
  print(f"device {dev.device_kind}, jax {jax.__version__}, measured bandwidth {bw / 1e12:.2f} TB/s", flush=True)
  decode_batches = [1, 8, 32, 64, 128]
  cases = []
  for b in decode_batches:
    cases.append(("paged_mqa_logits", dict(batch=b, ctx=32768)))
  for c in (4096, 131072):
    cases.append(("paged_mqa_logits", dict(batch=64, ctx=c)))
  for b in decode_batches:
    cases.append(("sparse_mla_decode", dict(batch=b, ctx=32768)))
  for c in (4096, 131072):
    cases.append(("sparse_mla_decode", dict(batch=64, ctx=c)))
  cases.append(("paged_mqa_logits", dict(batch=1, ctx=131072)))
  cases.append(("sparse_mla_decode", dict(batch=1, ctx=131072)))
  for b in (8, 32):  # 1024-token contexts: half of the K selected columns are -1 (tiles skipped)
    cases.append(("sparse_mla_decode", dict(batch=b, ctx=1024)))
  for b in (1, 64):  # the fp8 latent: 528-byte entries instead of 1024
    cases.append(("sparse_mla_decode", dict(batch=b, ctx=32768, cache_dtype="fp8")))
  for t in (8, 128, 1024, 8192):
    cases.append(("cache_write", dict(tokens=t)))
  for t in (128, 1024, 8192):
    cases.append(("kpool_compress", dict(tokens=t)))
  for t in (256, 8192):
    cases.append(("step_metadata", dict(tokens=t)))
  for t in (1, 8, 32, 64, 2048):  # the MoE: decode batches and a prefill step
    for proj in ("gate_up", "down"):
      cases.append(("grouped_matmul", dict(tokens=t, proj=proj)))
  for reqs, t in ((1, 2048), (2, 1024), (16, 128), (32, 256)):
    cases.append(("kda_chunk", dict(reqs=reqs, tokens=t)))
  for t in (1, 32, 2048):  # decode batches and a prefill step's tokens
    cases.append(("mhc_mix", dict(tokens=t)))
  # The indexer's top 512 pools: decode rows of a 128k server (32,768 entries) at short and full
  # context, and a 2,048-token prefill step of a 32k prompt.
  for r, e, c in ((1, 32768, 1024), (32, 32768, 1024), (1, 32768, 131072), (32, 32768, 131072)):
    cases.append(("topk_selection", dict(rows=r, entries=e, ctx=c)))
  cases.append(("topk_selection", dict(rows=2048, entries=8192, ctx=32768)))
  if args.quick:
    cases = [
      c
      for c in cases
      if c[1].get("batch", 64) == 64 and c[1].get("ctx", 32768) == 32768 and c[1].get("tokens", 1024) == 1024
    ]
  fns = {
    "paged_mqa_logits": bench_mqa_logits,
    "sparse_mla_decode": bench_sparse_mla,
    "cache_write": bench_cache_write,
    "kpool_compress": bench_kpool,
    "step_metadata": bench_step_metadata,
    "grouped_matmul": bench_grouped_matmul,
    "kda_recurrence": bench_kda,
    "kda_chunk": bench_kda_chunk,
    "mhc_mix": bench_mhc_mix,
    "topk_selection": bench_topk_selection,
  }
  only = args.only.split(",") if args.only else list(fns)
  tokens = {int(t) for t in args.tokens.split(",")} if args.tokens else None
  # sizes without "tokens" (batch, rows) are kept: --tokens narrows the kernels that take it
  sized = lambda kw: tokens is None or "tokens" not in kw or kw["tokens"] in tokens
  cases = [c for c in cases if c[0] in only and sized(c[1])]
  result = {
    "device": dev.device_kind,
    "jax": jax.__version__,
    "clock": args.clock,
    "bandwidth_Bps": bw,
    "sweep": [],
    "rows": rows,
  }

  def save():  # after every measurement, so a run cut short keeps what it measured
    if args.out:
      out = pathlib.Path(args.out)
      out.mkdir(parents=True, exist_ok=True)
      (out / "kernels.json").write_text(json.dumps(result, indent=1))

  for name, sizes, grid in SWEEP if args.sweep else ():
    if name not in only:
      continue
    for kw in filter(sized, sizes):
      for tune in grid:
        try:
          t, nbytes = fns[name](**kw, impl="pallas", iters=args.iters, repeats=args.repeats, **tune)
        except Exception as e:
          print(f"sweep {name} {kw} {tune}: {type(e).__name__}: {str(e)[:200]}", flush=True)
          continue
        entry = {"kernel": name, **kw, **tune, "us": t * 1e6, "frac_bw": nbytes / t / bw}
        if CLOCK == "device":
          entry["kernels_us"] = dict(LAST_KERNELS)
        if name == "grouped_matmul":  # prefill sizes are bound by the matmul rate, not the bytes
          entry["tflops"] = 2 * kw["tokens"] * K_MOE * D_MOE * F_MOE / t / 1e12
        if name == "sparse_mla_decode" and kw.get("queries", 1) > 1:  # so is a prefill step's attention
          rows_ = min(TOPK + KPOOL - 1, kw["ctx"])  # two products (scores, values) of [H, L] x [L, rows]
          entry["tflops"] = 4 * kw["batch"] * kw["queries"] * H_MLA * rows_ * L_MLA / t / 1e12
        result["sweep"].append(entry)
        rate = f", {entry['tflops']:.0f} TFLOP/s" if "tflops" in entry else ""
        split = f" {entry['kernels_us']}" if "kernels_us" in entry else ""
        print(
          f"sweep {name} {kw} {tune}: {t * 1e6:.1f} us, {100 * nbytes / t / bw:.0f}% of BW{rate}{split}", flush=True
        )
        save()
  if args.sweep_only:
    return
  for name, kw in cases:
    row = {"kernel": name, **kw}
    impls = [("pallas", {}), ("xla", {})]
    if name in PREVIOUS:
      impls.insert(1, ("pallas_previous", PREVIOUS[name]))
    if name == "kpool_compress":
      impls.append(("scatter", {}))
    if name == "kda_chunk":
      impls.append(("recurrent", {}))
    if name == "grouped_matmul":  # XLA's ragged dot reads every expert on a GPU: tokamax is the peer
      impls = [("pallas", {}), ("tokamax", {})]
    for impl, tune in impls:
      try:
        t, nbytes = fns[name](**kw, impl=impl.removesuffix("_previous"), iters=args.iters, repeats=args.repeats, **tune)
        row[f"{impl}_us"] = t * 1e6
        if CLOCK == "device":
          row[f"{impl}_kernels_us"] = dict(LAST_KERNELS)
        row["bytes"] = nbytes
        row[f"{impl}_frac_bw"] = nbytes / t / bw
      except Exception as e:  # keep measuring the other cases; the error goes in the table
        row[f"{impl}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        traceback.print_exc()
    if "pallas_us" in row and "xla_us" in row:
      row["speedup_vs_xla"] = row["xla_us"] / row["pallas_us"]
    if "pallas_us" in row and "pallas_previous_us" in row:
      row["speedup_vs_previous"] = row["pallas_previous_us"] / row["pallas_us"]
    if "pallas_us" in row and "tokamax_us" in row:
      row["speedup_vs_tokamax"] = row["tokamax_us"] / row["pallas_us"]
    if "pallas_us" in row and "recurrent_us" in row:
      row["speedup_vs_recurrent"] = row["recurrent_us"] / row["pallas_us"]
    if "pallas_us" in row and "scatter_us" in row:
      row["pallas_over_bare_scatter"] = row["pallas_us"] / row["scatter_us"]
    if name in ("cache_write", "kpool_compress") and "pallas_us" in row:
      row["copy_us"] = bench_bare_copy(row["bytes"], args.iters, args.repeats) * 1e6
      row["pallas_over_bare_copy"] = row["pallas_us"] / row["copy_us"]
    rows.append(row)
    print(_fmt(row), flush=True)
    save()
  print("\n" + table(result))


_SIZE_KEYS = ("batch", "reqs", "rows", "entries", "ctx", "tokens", "proj", "cache_dtype")


def _fmt(r):
  size = " ".join(f"{k}={r[k]}" for k in _SIZE_KEYS if k in r)
  cells = []
  for impl in ("pallas", "pallas_previous", "xla", "recurrent", "tokamax"):
    if f"{impl}_us" in r:
      cells.append(f"{impl} {r[f'{impl}_us']:8.1f} us {100 * r[f'{impl}_frac_bw']:5.1f}%")
    elif f"{impl}_error" in r:
      cells.append(f"{impl} failed")
  return f"{r['kernel']:<18} {size:<34} " + "  ".join(cells)


def table(result):
  bw = result["bandwidth_Bps"]
  lines = [
    f"{result['device']}, jax {result['jax']}, measured bandwidth {bw / 1e12:.2f} TB/s",
    "| kernel | size | MB moved | Pallas us | Pallas frac BW | previous Pallas us | speed-up vs previous "
    "| XLA us | XLA frac BW | Pallas speed-up vs XLA | Pallas time / bare XLA scatter | Pallas time / bare copy "
    "| recurrent KDA us | speed-up vs recurrent | tokamax us | speed-up vs tokamax |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in result["rows"]:
    size = ", ".join(f"{k} {r[k]}" for k in _SIZE_KEYS if k in r)
    cell = lambda k, f: (f % r[k]) if k in r else ("error" if k.replace("_us", "_error") in r else "-")
    lines.append(
      f"| {r['kernel']} | {size} | {r.get('bytes', 0) / 1e6:.2f} | {cell('pallas_us', '%.1f')} | "
      f"{cell('pallas_frac_bw', '%.2f')} | {cell('pallas_previous_us', '%.1f')} | "
      f"{cell('speedup_vs_previous', '%.2fx')} | {cell('xla_us', '%.1f')} | {cell('xla_frac_bw', '%.2f')} | "
      f"{cell('speedup_vs_xla', '%.2fx')} | {cell('pallas_over_bare_scatter', '%.2f')} | "
      f"{cell('pallas_over_bare_copy', '%.2f')} | {cell('recurrent_us', '%.1f')} | "
      f"{cell('speedup_vs_recurrent', '%.2fx')} | {cell('tokamax_us', '%.1f')} | {cell('speedup_vs_tokamax', '%.2fx')} |"
    )
  return "\n".join(lines)


def plot(path):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  result = json.loads(pathlib.Path(path).read_text())
  kernels = sorted({r["kernel"] for r in result["rows"]})
  fig, axes = plt.subplots(1, len(kernels), figsize=(4.5 * len(kernels), 3.8), squeeze=False)
  for ax, k in zip(axes[0], kernels):
    rows = [r for r in result["rows"] if r["kernel"] == k]
    labels = [",".join(str(r[x]) for x in _SIZE_KEYS if x in r) for r in rows]
    xs = np.arange(len(rows))
    for off, impl in ((-0.2, "pallas"), (0.2, "xla")):
      ax.bar(xs + off, [100 * r.get(f"{impl}_frac_bw", 0) for r in rows], 0.4, label=impl)
    ax.set_xticks(xs, labels, rotation=45, ha="right", fontsize=7)
    ax.set_title(k)
    ax.set_ylabel("% of measured HBM bandwidth")
    ax.set_ylim(0, 100)
  axes[0][0].legend()
  fig.suptitle(f"{result['device']}: {result['bandwidth_Bps'] / 1e12:.2f} TB/s measured")
  fig.tight_layout()
  out = pathlib.Path(path).with_suffix(".png")
  fig.savefig(out, dpi=120)
  print(out)


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", help="directory for kernels.json")
  p.add_argument("--iters", type=int, default=50)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--quick", action="store_true", help="one size per kernel")
  p.add_argument("--sweep", action="store_true", help="first time every tuning setting of SWEEP at its sizes")
  p.add_argument("--sweep-only", action="store_true", help="with --sweep: stop after the sweep")
  p.add_argument("--plot", metavar="JSON", help="plot a results file and exit")
  p.add_argument("--only", metavar="KERNELS", help="comma-separated kernels to run (default: all)")
  p.add_argument(
    "--tokens", metavar="T,...", help="sweep and time only these sizes of the kernels that take tokens (default: all)"
  )
  p.add_argument(
    "--clock",
    choices=("wall", "device"),
    default="wall",
    help="wall: the host's timer around each loop; device: the kernels' busy time in a profiler trace",
  )
  args = p.parse_args()
  global CLOCK
  CLOCK = args.clock
  if args.plot:
    plot(args.plot)
  else:
    run(args)


if __name__ == "__main__":
  main()
