"""GLM-5.3-Flash text tower in Flax NNX: the reference forward over whole sequences (no caches).

This is the definition the paged path is checked against; it follows HF transformers 5.24's
no-cache forward (``transformers/models/glm5_next/modeling_glm5_next.py``; the layers, in this
repository: ``docs/model.md``). Parameter names mirror the checkpoint
(``model.language_model.layers.L.self_attn.q_proj.weight`` is ``layers[L].self_attn.q_proj.weight``),
matrices are stored ``[out, in]`` as in PyTorch, except the routed experts, stacked ``[E, in, out]``
for the grouped matmul (transposed once at load).

Einsum letters: B batch, T query tokens, S key tokens, D hidden, H heads, K head dim, L latent,
N mHC streams, E experts, I expert width, P pools, C pool slots.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from models.glm5_next.config import Glm5NextConfig
from models.glm5_next.sharding import ModelSharding
from pallas_kernels.grouped_matmul import grouped_matmul
from pallas_kernels.kda_chunk import chunk_delta_rule
from pallas_kernels.kda_recurrence import delta_rule_step
from pallas_kernels.kpool import combine_pool
from pallas_kernels.mhc_mix import mhc_mix_reference
from pallas_kernels.topk_selection import select_topk_tokens

__all__ = [
  "Glm5NextForCausalLM",
  "RMSNorm",
  "HyperConnection",
  "KimiDeltaAttention",
  "SparseMLAttention",
  "Indexer",
  "MoE",
  "MLP",
  "MTPLayer",
  "kda_recurrent",
  "kda_chunked",
  "select_indexer_tokens",
]

_HP = jax.lax.Precision.HIGHEST


def _param(rngs: nnx.Rngs | None, shape, dtype, std=0.1, mean=0.0):
  if rngs is None:
    return nnx.Param(jnp.zeros(shape, dtype))
  return nnx.Param((mean + std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype))


def _linear(x, w, out_dtype=None):
  """``x @ w.T`` for a PyTorch-layout ``[out, in]`` weight, at full precision (``out_dtype``: the
  products' and sums' dtype, default ``x``'s)."""
  return jnp.einsum("...i,oi->...o", x, w.astype(x.dtype), precision=_HP, preferred_element_type=out_dtype)


class Linear(nnx.Module):
  def __init__(self, d_in: int, d_out: int, *, dtype, rngs: nnx.Rngs | None, std: float = 0.1):
    self.weight = _param(rngs, (d_out, d_in), dtype, std)

  def __call__(self, x):
    return _linear(x, self.weight[...])


class RMSNorm(nnx.Module):
  """``w * (x / rms(x))``; statistics in float32, cast back before the weight (as HF does)."""

  def __init__(self, dim: int, eps: float, *, dtype, rngs: nnx.Rngs | None):
    self.weight = _param(rngs, (dim,), dtype, std=0.1, mean=1.0)
    self.eps = eps

  def __call__(self, x):
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    return self.weight[...].astype(x.dtype) * xf.astype(x.dtype)


class LayerNorm(nnx.Module):
  def __init__(self, dim: int, eps: float, *, dtype, rngs: nnx.Rngs | None):
    self.weight = _param(rngs, (dim,), dtype, std=0.1, mean=1.0)
    self.bias = _param(rngs, (dim,), dtype, std=0.1)
    self.eps = eps

  def __call__(self, x):
    xf = x.astype(jnp.float32)
    mu = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mu), axis=-1, keepdims=True)
    y = (xf - mu) * jax.lax.rsqrt(var + self.eps)
    return (y * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


class HyperConnection(nnx.Module):
  """mHC: collapse ``N`` streams into a sublayer input; the post and comb weights to expand it back."""

  def __init__(self, config: Glm5NextConfig, *, dtype, rngs: nnx.Rngs | None):
    n = config.hc_mult
    self.fn = _param(rngs, ((2 + n) * n, n * config.hidden_size), dtype, std=0.05)
    self.base = _param(rngs, ((2 + n) * n,), jnp.float32, std=0.5)
    self.scale = nnx.Param(
      jnp.ones((3,), jnp.float32) if rngs is None else jax.random.uniform(rngs.params(), (3,), jnp.float32, 0.5, 1.5)
    )
    self.n, self.eps, self.iters, self.norm_eps = n, config.hc_eps, config.hc_sinkhorn_iters, config.rms_norm_eps

  def __call__(self, streams: Float[Array, "B T N D"], mix=None):
    """``mix``: the pre / post / comb weights from the mixing logits, ``mhc_mix``'s signature
    (default: ``mhc_mix_reference``; the paged step passes the kernel)."""
    flat = streams.reshape(*streams.shape[:-2], -1)
    # rho applied after the projection (equal in exact arithmetic: the spec, 3.1): the GEMM reads
    # the streams once in their own dtype with float32 products and sums (a bf16 product is exact in
    # float32) instead of a normalized float32 copy of them, [T, N * D] written and read again.
    fn = self.fn[...]
    mixed = _linear(flat.astype(jnp.promote_types(flat.dtype, fn.dtype)), fn, jnp.float32)
    wide = flat.astype(jnp.float32)
    mixed = mixed * jax.lax.rsqrt(jnp.mean(wide * wide, axis=-1, keepdims=True) + self.norm_eps)
    pre, post, comb = (mix or mhc_mix_reference)(
      mixed, self.scale[...], self.base[...], n=self.n, eps=self.eps, iters=self.iters
    )
    collapsed = jnp.sum(pre[..., None] * streams.astype(jnp.float32), axis=-2).astype(streams.dtype)
    return post, comb, collapsed

  @staticmethod
  def expand(post, comb, y, residual):
    """``X'[j] = post[j] * y + sum_i comb[i, j] * X[i]`` in the activation dtype (the sum over the
    ``N`` streams in float32, rounded once).

    The sum is written out term by term, not as an einsum: with ``N = 4`` terms XLA made it a GEMM
    kernel of its own on a GPU, 0.5 ms a call at 8,192 tokens on an H100, where one elementwise
    pass over the streams moves the same bytes at the memory's rate."""
    dt = residual.dtype
    c, x = comb.astype(dt).astype(jnp.float32), residual.astype(jnp.float32)
    mixed = functools.reduce(jnp.add, [c[..., i, :, None] * x[..., i, None, :] for i in range(residual.shape[-2])])
    return post.astype(dt)[..., None] * y[..., None, :] + mixed.astype(dt)


def _swiglu_clamped(gate, up, limit):
  return jax.nn.silu(jnp.minimum(gate, limit)) * jnp.clip(up, -limit, limit)


class MLP(nnx.Module):
  def __init__(self, config: Glm5NextConfig, width: int, *, dtype, rngs: nnx.Rngs | None):
    d = config.hidden_size
    self.gate_proj = Linear(d, width, dtype=dtype, rngs=rngs)
    self.up_proj = Linear(d, width, dtype=dtype, rngs=rngs)
    self.down_proj = Linear(width, d, dtype=dtype, rngs=rngs)
    self.limit = config.swiglu_limit

  def __call__(self, x):
    return self.down_proj(_swiglu_clamped(self.gate_proj(x), self.up_proj(x), self.limit))


class MoE(nnx.Module):
  """Sigmoid router (bias for selection only), renormalized scaled top-k experts + shared expert."""

  def __init__(self, config: Glm5NextConfig, *, dtype, rngs: nnx.Rngs | None, sharding: ModelSharding | None = None):
    d, e, i = config.hidden_size, config.n_routed_experts, config.moe_intermediate_size
    self.gate_weight = _param(rngs, (e, d), jnp.float32)
    self.e_score_correction_bias = _param(rngs, (e,), jnp.float32)
    # Routed experts in the grouped matmul's layout ([E, in, out]); the checkpoint's [out, in]
    # matrices are transposed once at load.
    self.experts_gate = _param(rngs, (e, d, i), dtype)
    self.experts_up = _param(rngs, (e, d, i), dtype)
    self.experts_down = _param(rngs, (e, i, d), dtype)
    self.shared_experts = MLP(config, i * config.n_shared_experts, dtype=dtype, rngs=rngs)
    self.top_k, self.scale, self.norm = config.num_experts_per_tok, config.routed_scaling_factor, config.norm_topk_prob
    self.limit = config.swiglu_limit
    # How the routed experts split over a device mesh (``ExpertSharding``); None: one device.
    self.parallel = None if sharding is None else sharding.experts

  def route(self, x):
    """Top-k experts ``[..., k]`` and their weights (float32): selection by ``sigmoid + bias``,
    weights from the unbiased sigmoid, renormalized and scaled."""
    scores = jax.nn.sigmoid(_linear(x.astype(jnp.float32), self.gate_weight[...]))
    _, idx = jax.lax.top_k(scores + self.e_score_correction_bias[...], self.top_k)
    chosen = jnp.take_along_axis(scores, idx, axis=-1)
    if self.norm:
      chosen = chosen / (jnp.sum(chosen, axis=-1, keepdims=True) + 1e-20)
    return idx, chosen * self.scale

  def routing(self, x):
    """Per-token weights over all experts, zero outside the top-k: ``[..., E]`` float32."""
    idx, w = self.route(x)
    return jnp.put_along_axis(
      jnp.zeros(x.shape[:-1] + (self.gate_weight.shape[0],), jnp.float32), idx, w, axis=-1, inplace=False
    )

  def __call__(self, x):
    lead, d = x.shape[:-1], x.shape[-1]
    idx, w = self.route(x)
    flat, idx, w = x.reshape(-1, d), idx.reshape(-1, self.top_k), w.reshape(-1, self.top_k)
    experts = (self.experts_gate[...], self.experts_up[...], self.experts_down[...])
    if self.parallel is None:
      routed = self._routed(flat, idx, w, *experts)
    else:
      routed = self.parallel.routed(self._routed, flat, idx, w, *experts)
    return routed.astype(x.dtype).reshape(*lead, d) + self.shared_experts(x)

  def _routed(self, flat, idx, w, w_gate, w_up, w_down, first_expert=None):
    """float32 ``[M, D]``: each token's chosen experts among ``w_gate.shape[0]`` local ones (all of
    them, or from ``first_expert`` on under expert parallelism: the others contribute nothing here)."""
    # Only the chosen experts run: token copies sorted by expert, one grouped matmul per projection.
    expert = idx.reshape(-1)
    num_local = w_gate.shape[0]
    if first_expert is not None:  # other devices' experts sort last, past every group: zero rows
      expert = expert - first_expert
      expert = jnp.where((expert >= 0) & (expert < num_local), expert, num_local)
    order = jnp.argsort(expert, stable=True)
    token = order // self.top_k
    sizes = jnp.bincount(expert, length=num_local).astype(jnp.int32)
    xs = flat[token]
    gate = grouped_matmul(xs, w_gate, sizes, precision=_HP)
    up = grouped_matmul(xs, w_up, sizes, precision=_HP)
    h = _swiglu_clamped(gate, up, self.limit)
    out = grouped_matmul(h, w_down, sizes, precision=_HP)
    # Back to token order by a gather, then each token's k outputs summed in slot order: a
    # scatter-add of duplicate rows would sum in the GPU's atomic order, different every run.
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    out = out[rank].reshape(-1, self.top_k, flat.shape[-1]).astype(jnp.float32)
    return jnp.sum(out * w[..., None], axis=1)


# ---------------------------------------------------------------------------------------------
# KDA


def _l2norm(x, eps=1e-6):
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def kda_recurrent(q, k, v, g, beta, state):
  """Delta rule token by token. ``q, k, v, g: [B, T, H, K]``, ``beta: [B, T, H]``, ``state: [B, H, K, K]``.

  Per token: ``S <- diag(exp(g)) S``; ``u = beta (v - S^T k)``; ``S <- S + k u^T``; ``o = S^T q``.
  """

  def step(s, inp):
    return delta_rule_step(s, *inp)

  xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta))
  state, o = jax.lax.scan(step, state, xs)
  return jnp.moveaxis(o, 0, 1), state


def kda_chunked(q, k, v, g, beta, state, chunk_size: int = 64):
  """The same recurrence in chunked (prefill) form; equal to ``kda_recurrent`` up to rounding."""
  b, t, h, d = q.shape
  c = chunk_size
  pad = (-t) % c
  if pad:  # zero-padded tokens: g = 0 (no decay), beta = 0 (no write), outputs dropped
    q, k, v, g = (jnp.pad(a, ((0, 0), (0, pad), (0, 0), (0, 0))) for a in (q, k, v, g))
    beta = jnp.pad(beta, ((0, 0), (0, pad), (0, 0)))
  n = (t + pad) // c
  split = lambda a: jnp.moveaxis(a.reshape(b, n, c, *a.shape[2:]), 1, 0)  # [n, B, C, H, ...]
  qs, ks, vs, gs, bs = map(split, (q, k, v, g, beta))
  step = lambda s0, inp: jax.vmap(chunk_delta_rule)(s0, *inp)
  state, o = jax.lax.scan(step, state, (qs, ks, vs, gs, bs))
  o = jnp.moveaxis(o, 0, 1).reshape(b, n * c, h, d)
  return o[:, :t], state


class KimiDeltaAttention(nnx.Module):
  """KDA: q/k/v short convolutions, bounded forget gate, delta rule, gated RMSNorm output."""

  def __init__(self, config: Glm5NextConfig, *, dtype, rngs: nnx.Rngs | None, sharding: ModelSharding | None = None):
    d, h, k = config.hidden_size, config.linear_num_heads, config.linear_head_dim
    c, kw = h * k, config.linear_conv_kernel_dim
    for name in ("q_proj", "k_proj", "v_proj"):
      setattr(self, name, Linear(d, c, dtype=dtype, rngs=rngs))
    for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
      setattr(self, name, _param(rngs, (c, 1, kw), jnp.float32, std=0.3))
    self.f_a_proj = Linear(d, k, dtype=dtype, rngs=rngs)
    self.f_b_proj = Linear(k, c, dtype=dtype, rngs=rngs)
    self.g_a_proj = Linear(d, k, dtype=dtype, rngs=rngs)
    self.g_b_proj = Linear(k, c, dtype=dtype, rngs=rngs)
    self.b_proj = Linear(d, h, dtype=dtype, rngs=rngs)
    self.A_log = _param(rngs, (h,), jnp.float32, std=0.5)
    if rngs is None:
      self.dt_bias = nnx.Param(jnp.zeros((c,), jnp.float32))
    else:  # inverse softplus of a log-uniform dt in [1e-3, 0.1], as HF initializes it
      dt = jnp.exp(jax.random.uniform(rngs.params(), (c,), jnp.float32, math.log(1e-3), math.log(0.1)))
      self.dt_bias = nnx.Param(dt + jnp.log(-jnp.expm1(-dt)))
    self.o_norm = RMSNorm(k, config.rms_norm_eps, dtype=dtype, rngs=rngs)
    self.o_proj = Linear(c, d, dtype=dtype, rngs=rngs)
    self.h, self.k, self.kw = h, k, kw
    # On a device mesh: the recurrence per device, on its heads (``HeadSharding``).
    self.head_sharding = None if sharding is None else sharding.heads
    self.lower_bound, self.eps = config.linear_gate_lower_bound, config.rms_norm_eps

  def project(self, x):
    """Raw q, k, v projections, three ``[..., C]`` (what the conv windows hold). Kept apart: a
    stack of the three was a copy of ``3 x T x C`` (1 ms of an 8,192-token step on an H100), and
    on a mesh each is split by head where a concatenation's thirds would not be."""
    return self.q_proj(x), self.k_proj(x), self.v_proj(x)

  def conv_weights(self):
    """Depthwise taps, three ``[kw, C]`` for the q, k, v channels (tap ``kw-1``: current token)."""
    return tuple(w[...][:, 0, :].T for w in (self.q_conv1d, self.k_conv1d, self.v_conv1d))

  def gates(self, x):
    """Log-decay ``g [B, T, H, K]`` and write strength ``beta [B, T, H]`` (float32)."""
    f = self.f_b_proj(self.f_a_proj(x)).astype(jnp.float32) + self.dt_bias[...]
    f = f.reshape(*x.shape[:-1], self.h, self.k)
    decay = jnp.exp(self.A_log[...])[:, None]
    if self.lower_bound is not None:  # the safe gate: log-decay in (lower_bound, 0)
      g = self.lower_bound * jax.nn.sigmoid(decay * f)
    else:  # HF's softplus gate, linear past 20 as HF writes it
      g = -decay * jnp.where(f > 20.0, f, jnp.log(1.0 + jnp.exp(jnp.minimum(f, 20.0))))
    return g, jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32))

  def __call__(self, x, conv_state=None, recurrent_state=None, *, chunked: bool = True, chunk_size: int = 64):
    """``x [B, T, D]`` -> ``(y [B, T, D], (conv_state [B, kw-1, 3C], recurrent_state [B, H, K, K]))``."""
    b, t, _ = x.shape
    mixed = self.project(x)  # 3 x [B, T, C]
    if conv_state is None:
      conv_state = jnp.zeros((b, self.kw - 1, 3 * mixed[0].shape[-1]), x.dtype)
    states = conv_state.reshape(b, self.kw - 1, 3, -1).astype(x.dtype)
    rows = [jnp.concatenate([states[:, :, i], m], axis=1) for i, m in enumerate(mixed)]  # 3 x [B, kw-1+T, C]
    q, k, v = self.conv_qkv([jnp.stack([r[:, j : j + t] for j in range(self.kw)], axis=-2) for r in rows], x.dtype)
    new_conv_state = jnp.stack([r[:, -(self.kw - 1) :] for r in rows], axis=2).reshape(b, self.kw - 1, -1)
    g, beta = self.gates(x)
    if recurrent_state is None:
      recurrent_state = jnp.zeros((b, self.h, self.k, self.k), jnp.float32)
    if chunked:
      o, state = kda_chunked(q, k, v, g, beta, recurrent_state, chunk_size)
    else:
      o, state = kda_recurrent(q, k, v, g, beta, recurrent_state)
    return self.output(o, x), (new_conv_state, state)

  def conv_qkv(self, windows, dtype):
    """Conv windows, three ``[..., kw, C]`` (raw q, k, v projections, oldest first) -> normed
    ``q, k, v [..., H, K]`` (float32)."""
    q, k, v = (
      jax.nn.silu(jnp.sum(w.astype(jnp.float32) * taps, axis=-2)).astype(dtype).astype(jnp.float32)
      for w, taps in zip(windows, self.conv_weights(), strict=True)
    )
    q, k, v = (a.reshape(*a.shape[:-1], self.h, self.k) for a in (q, k, v))
    return _l2norm(q) * self.k**-0.5, _l2norm(k), v

  def output(self, o, x):
    """Gated RMSNorm (float32 through weight and gate, as HF's RMSNormGated) and ``o_proj``."""
    gate = self.g_b_proj(self.g_a_proj(x)).reshape(*x.shape[:-1], self.h, self.k).astype(jnp.float32)
    o = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + self.eps)
    o = o * self.o_norm.weight[...].astype(jnp.float32) * jax.nn.sigmoid(gate)
    return self.o_proj(o.astype(x.dtype).reshape(*x.shape[:-1], -1))


# ---------------------------------------------------------------------------------------------
# DSA: NoPE MLA + pooled lightning indexer


def select_indexer_tokens(scores, seq_lens, *, kpool: int, index_topk: int):
  """Whole-sequence selection: ``scores [B, T, P]`` pool scores -> token indices ``[B, T, topk+kpool-1]``.

  ``pallas_kernels.topk_selection.select_topk_tokens`` (the best pools, higher score first, then
  lower pool index; listed in increasing pool index), batched over ``B``.
  """
  b, t, p = scores.shape
  out = select_topk_tokens(scores.reshape(b * t, p), seq_lens.reshape(b * t), kpool=kpool, index_topk=index_topk)
  return out.reshape(b, t, -1)


class Indexer(nnx.Module):
  def __init__(self, config: Glm5NextConfig, *, dtype, rngs: nnx.Rngs | None):
    d, h, k = config.hidden_size, config.index_n_heads, config.index_head_dim
    self.wq_b = Linear(config.q_lora_rank, h * k, dtype=dtype, rngs=rngs)
    self.wk = Linear(d, k, dtype=dtype, rngs=rngs)
    self.k_norm = LayerNorm(k, 1e-6, dtype=dtype, rngs=rngs)
    self.weights_proj = Linear(d, h, dtype=dtype, rngs=rngs)
    self.index_kpool_compress_ape = _param(rngs, (config.index_kpool, k), dtype, std=0.5)
    self.index_kpool_compress_gate = _param(rngs, (k, d), dtype)
    self.h, self.k, self.kpool, self.topk = h, k, config.index_kpool, config.index_topk

  def project(self, x, q_resid):
    """Per token: queries ``[B, T, H, K]``, normed keys ``[B, T, K]``, gates ``[B, T, K]``, head weights ``[B, T, H]``."""
    q = self.wq_b(q_resid).reshape(*x.shape[:-1], self.h, self.k)
    key = self.k_norm(self.wk(x))
    gate = _linear(x, self.index_kpool_compress_gate[...])
    w = self.weights_proj(x).astype(jnp.float32) * self.h**-0.5
    return q, key, gate, w

  def pool(self, key, gate):
    """Complete pools of a whole sequence: ``[B, T // kpool, K]``, the kernels' ``combine_pool``
    rounded to the model dtype (what the indexer cache stores)."""
    b, t, k = key.shape
    p = t // self.kpool
    kk = key[:, : p * self.kpool].reshape(b, p, self.kpool, k)
    gg = gate[:, : p * self.kpool].reshape(b, p, self.kpool, k)
    return combine_pool(kk, gg, self.index_kpool_compress_ape[...]).astype(key.dtype)

  def scores(self, q, w, pooled):
    """``sum_h w_h relu(q_h . K_p / sqrt(K))`` in float32: ``[B, T, P]``."""
    s = jnp.einsum("bthk,bpk->bthp", q.astype(jnp.float32), pooled.astype(jnp.float32), precision=_HP)
    return jnp.einsum("bthp,bth->btp", jax.nn.relu(s * self.k**-0.5), w, precision=_HP)

  def __call__(self, x, q_resid):
    """Selected token indices ``[B, T, topk + kpool - 1]`` of each query (whole sequences from 0)."""
    q, key, gate, w = self.project(x, q_resid)
    pooled = self.pool(key, gate)
    t = x.shape[1]
    seq_lens = jnp.broadcast_to(jnp.arange(1, t + 1, dtype=jnp.int32), x.shape[:2])
    if pooled.shape[1] == 0:  # no complete pool yet: only tails
      pooled = jnp.zeros((x.shape[0], 1, self.k), key.dtype)
    return select_indexer_tokens(self.scores(q, w, pooled), seq_lens, kpool=self.kpool, index_topk=self.topk)


class SparseMLAttention(nnx.Module):
  """NoPE MLA over the selected tokens; the 512-wide ``c_kv`` is the only per-token cache entry."""

  def __init__(
    self,
    config: Glm5NextConfig,
    *,
    dtype,
    rngs: nnx.Rngs | None,
    with_indexer: bool = True,
    sharding: ModelSharding | None = None,
  ):
    d, h = config.hidden_size, config.num_attention_heads
    self.q_a_proj = Linear(d, config.q_lora_rank, dtype=dtype, rngs=rngs)
    self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps, dtype=dtype, rngs=rngs)
    self.q_b_proj = Linear(config.q_lora_rank, h * config.qk_nope_head_dim, dtype=dtype, rngs=rngs)
    self.kv_a_proj_with_mqa = Linear(d, config.kv_lora_rank, dtype=dtype, rngs=rngs)
    self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, config.rms_norm_eps, dtype=dtype, rngs=rngs)
    self.kv_b_proj = Linear(
      config.kv_lora_rank, h * (config.qk_nope_head_dim + config.v_head_dim), dtype=dtype, rngs=rngs
    )
    self.o_proj = Linear(h * config.v_head_dim, d, dtype=dtype, rngs=rngs)
    self.indexer = Indexer(config, dtype=dtype, rngs=rngs) if with_indexer else None
    self.h, self.dk, self.dv = h, config.qk_nope_head_dim, config.v_head_dim
    # On a device mesh: sparse MLA decode per device, on its heads (``HeadSharding``).
    self.head_sharding = None if sharding is None else sharding.heads

  def latent(self, x):
    """``(q_resid [B, T, R_q], c_kv [B, T, L])``."""
    return self.q_a_layernorm(self.q_a_proj(x)), self.kv_a_layernorm(self.kv_a_proj_with_mqa(x))

  def __call__(self, x, prev_indices=None):
    """``x [B, T, D]`` -> ``(y [B, T, D], indices [B, T, W])``; ``prev_indices`` for "shared" layers."""
    b, t, _ = x.shape
    q_resid, c_kv = self.latent(x)
    q = self.q_b_proj(q_resid).reshape(b, t, self.h, self.dk)
    kv = self.kv_b_proj(c_kv).reshape(b, t, self.h, self.dk + self.dv)
    k, v = kv[..., : self.dk], kv[..., self.dk :]
    if self.indexer is not None:
      indices = self.indexer(x, q_resid)
    elif prev_indices is None:
      raise ValueError("a 'shared' indexer layer needs the indices of the previous full DSA layer.")
    else:
      indices = prev_indices
    valid = indices >= 0
    mask = (
      jnp.zeros((b, t, t), bool)
      .at[jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None], jnp.where(valid, indices, 0)]
      .max(valid)
    )
    s = jnp.einsum("bthk,bshk->bhts", q, k, precision=_HP).astype(jnp.float32) * self.dk**-0.5
    s = jnp.where(mask[:, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(x.dtype)
    o = jnp.einsum("bhts,bshk->bthk", p, v, precision=_HP).reshape(b, t, -1)
    return self.o_proj(o), indices


# ---------------------------------------------------------------------------------------------
# Layers and model


def reference_attend(attn, x, prev_indices, carry=None):
  """Whole-sequence attention without caches: KDA from zero state, DSA with its own indexer; the
  carry passes through unchanged."""
  if isinstance(attn, KimiDeltaAttention):
    return attn(x)[0], None, carry
  return *attn(x, prev_indices), carry


class DecoderLayer(nnx.Module):
  def __init__(
    self, config: Glm5NextConfig, layer_idx: int, *, dtype, rngs: nnx.Rngs | None, sharding: ModelSharding | None = None
  ):
    self.kind = config.layer_types[layer_idx]
    if self.kind == "linear_attention":
      self.self_attn = KimiDeltaAttention(config, dtype=dtype, rngs=rngs, sharding=sharding)
    else:
      self.self_attn = SparseMLAttention(
        config, dtype=dtype, rngs=rngs, with_indexer=config.indexer_types[layer_idx] == "full", sharding=sharding
      )
    moe = config.mlp_layer_types[layer_idx] == "sparse"
    self.mlp = (
      MoE(config, dtype=dtype, rngs=rngs, sharding=sharding)
      if moe
      else MLP(config, config.intermediate_size, dtype=dtype, rngs=rngs)
    )
    self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, rngs=rngs)
    self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, rngs=rngs)
    self.attn_hc = HyperConnection(config, dtype=dtype, rngs=rngs)
    self.ffn_hc = HyperConnection(config, dtype=dtype, rngs=rngs)

  def __call__(self, streams, prev_indices=None, attend=None, carry=None, mix=None):
    """One layer -> ``(streams, indices or None, carry)``.

    ``attend(self_attn, x, prev_indices, carry) -> (y, indices or None, carry)`` is the attention
    strategy (default: the whole-sequence reference; the paged step injects its cached form, with
    the caches as the carry, threaded through the layers as ``lax.scan`` threads its carry);
    ``mix`` the mHC weights' (``HyperConnection``).
    """
    # Named scopes tag each op with the part it belongs to (the kernels' HLO metadata), so a
    # profile can say where a step's kernels come from (jaxkv.profiling); they change no arithmetic.
    attn_scope = "kda" if isinstance(self.self_attn, KimiDeltaAttention) else "dsa"
    mlp_scope = "moe" if isinstance(self.mlp, MoE) else "mlp"
    with jax.named_scope("mhc"):
      post, comb, u = self.attn_hc(streams, mix)
    with jax.named_scope(attn_scope):
      x = self.input_layernorm(u)
      y, indices, carry = (attend or reference_attend)(self.self_attn, x, prev_indices, carry)
    with jax.named_scope("mhc"):
      streams = HyperConnection.expand(post, comb, y, streams)
      post, comb, u = self.ffn_hc(streams, mix)
    with jax.named_scope(mlp_scope):
      z = self.mlp(self.post_attention_layernorm(u))
    with jax.named_scope("mhc"):
      return HyperConnection.expand(post, comb, z, streams), indices, carry


class MTPLayer(nnx.Module):
  """NextN drafting layer: plain pre-norm block (no mHC) with DSA attention and MoE."""

  def __init__(self, config: Glm5NextConfig, *, dtype, rngs: nnx.Rngs | None, sharding: ModelSharding | None = None):
    d, eps = config.hidden_size, config.rms_norm_eps
    self.enorm = RMSNorm(d, eps, dtype=dtype, rngs=rngs)
    self.hnorm = RMSNorm(d, eps, dtype=dtype, rngs=rngs)
    self.eh_proj = Linear(2 * d, d, dtype=dtype, rngs=rngs)
    self.input_layernorm = RMSNorm(d, eps, dtype=dtype, rngs=rngs)
    self.self_attn = SparseMLAttention(config, dtype=dtype, rngs=rngs, sharding=sharding)
    self.post_attention_layernorm = RMSNorm(d, eps, dtype=dtype, rngs=rngs)
    self.mlp = MoE(config, dtype=dtype, rngs=rngs, sharding=sharding)
    self.shared_head_norm = RMSNorm(d, eps, dtype=dtype, rngs=rngs)

  def fuse(self, hidden, next_embeds, positions):
    """``z = W_eh [enorm(e_{t+1}) | hnorm(h_t)]``, the embedding zeroed at position 0."""
    e = jnp.where((positions == 0)[..., None], 0.0, next_embeds).astype(hidden.dtype)
    return self.eh_proj(jnp.concatenate([self.enorm(e), self.hnorm(hidden)], axis=-1))

  def __call__(self, hidden, next_embeds, positions, attend=None, carry=None):
    """``hidden [B, T, D]`` (post final norm) and the next tokens' embeddings -> ``(h', indices,
    carry)``; ``attend`` and ``carry`` as in ``DecoderLayer``."""
    z = self.fuse(hidden, next_embeds, positions)
    y, indices, carry = (attend or reference_attend)(self.self_attn, self.input_layernorm(z), None, carry)
    z = z + y
    z = z + self.mlp(self.post_attention_layernorm(z))
    return self.shared_head_norm(z), indices, carry


class Glm5NextForCausalLM(nnx.Module):
  """The text tower (+ the MTP layer when ``num_nextn_predict_layers`` > 0).

  Args:
    rngs: required: ``nnx.Rngs(seed)`` draws random weights (normal, mostly std 0.1: scales that
      make routing, clamps, pooling and mHC move at test size, docs/model.md); ``None`` allocates
      zeros for a checkpoint to fill (``load_checkpoint``). No default: zeros are never a surprise.
    sharding: the model's place on a device mesh (``ModelSharding``): how its MoE and attention
      kernels run per device (checked against the config here); ``sharding.place(params)`` puts
      the weights there. None: one device.

  Example:
    >>> model = Glm5NextForCausalLM(get_config("glm-5.3-flash-tiny"), rngs=nnx.Rngs(0))
    >>> logits = model(jnp.asarray([[1, 2, 3]]))[0]  # [B, T, V]
  """

  def __init__(
    self, config: Glm5NextConfig, *, rngs: nnx.Rngs | None, dtype=jnp.float32, sharding: ModelSharding | None = None
  ):
    if sharding is not None:
      sharding.check(config)
    self.config = config
    d = config.hidden_size
    self.embed_tokens = _param(rngs, (config.vocab_size, d), dtype, std=1.0)
    self.layers = nnx.List(
      [DecoderLayer(config, i, dtype=dtype, rngs=rngs, sharding=sharding) for i in range(config.num_hidden_layers)]
    )
    self.norm = RMSNorm(d, config.rms_norm_eps, dtype=dtype, rngs=rngs)
    self.lm_head = _param(rngs, (config.vocab_size, d), dtype)
    self.mtp = MTPLayer(config, dtype=dtype, rngs=rngs, sharding=sharding) if config.num_nextn_predict_layers else None

  def hidden_states(self, input_ids: Int[Array, "B T"], attend=None, carry=None, mix=None):
    """Post-final-norm hidden states ``[B, T, D]`` (what the head and the MTP layer read) and the
    final carry.

    ``attend(layer_index, self_attn, x, prev_indices, carry) -> (y, indices, carry)`` replaces the
    reference attention (the paged step passes its cached form, its caches as ``carry``), ``mix``
    the mHC weights' (``HyperConnection``; the paged step passes the kernel); the layer loop is the
    same for both.
    """
    with jax.named_scope("embed"):
      e = self.embed_tokens[...][input_ids]
      streams = jnp.broadcast_to(e[:, :, None], (*e.shape[:2], self.config.hc_mult, e.shape[-1]))
    indices = None
    for i, layer in enumerate(self.layers):
      layer_attend = None if attend is None else functools.partial(attend, i)
      streams, out_indices, carry = layer(streams, indices, layer_attend, carry, mix)
      indices = out_indices if out_indices is not None else indices
    with jax.named_scope("final_norm"):
      return self.norm(jnp.mean(streams, axis=2)), carry

  def logits(self, hidden):
    with jax.named_scope("lm_head"):
      return _linear(hidden, self.lm_head[...]).astype(jnp.float32)

  def __call__(self, input_ids: Int[Array, "B T"]) -> Float[Array, "B T V"]:
    return self.logits(self.hidden_states(input_ids)[0])
