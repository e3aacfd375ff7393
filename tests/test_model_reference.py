"""The reference model without HF: KDA forms agree, selection matches a brute-force definition,
sparse equals dense at short contexts, random init moves every mechanism, MTP drafting shapes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.glm5_next import Glm5NextForCausalLM, get_config
from models.glm5_next.model import kda_chunked, kda_recurrent

CFG = get_config("glm-5.3-flash-tiny")


@pytest.fixture(scope="module")
def model():
  return Glm5NextForCausalLM(CFG, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("t, chunk", [(1, 4), (37, 8), (64, 64), (70, 16)])
def test_kda_chunked_equals_recurrent(t, chunk):
  rng = np.random.default_rng(t)
  b, h, d = 2, 3, 8
  q, k, v = (jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32) for _ in range(3))
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
  g = -5 * jax.nn.sigmoid(jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32))
  beta = jax.nn.sigmoid(jnp.asarray(rng.standard_normal((b, t, h)), jnp.float32))
  s0 = jnp.asarray(rng.standard_normal((b, h, d, d)), jnp.float32)
  o1, s1 = kda_recurrent(q, k, v, g, beta, s0)
  o2, s2 = kda_chunked(q, k, v, g, beta, s0, chunk)
  np.testing.assert_allclose(o2, o1, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(s2, s1, atol=1e-5, rtol=1e-5)


def test_kda_layer_continuation_equals_one_pass(model):
  kda = model.layers[0].self_attn
  x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 23, CFG.hidden_size)), jnp.float32)
  y, (conv, state) = kda(x, chunk_size=8)
  y1, (c1, s1) = kda(x[:, :10], chunk_size=8)  # split mid-chunk
  y2, (c2, s2) = kda(x[:, 10:], c1, s1, chunked=False)  # continue token by token
  np.testing.assert_allclose(jnp.concatenate([y1, y2], 1), y, atol=1e-5)
  np.testing.assert_allclose(s2, state, atol=1e-5)
  np.testing.assert_array_equal(c2, conv)


def brute_force_indices(scores, t_len, kpool, topk):
  """Section 4.3 of the architecture doc, per query, in NumPy (ties: lower pool index first; the
  chosen pools listed in increasing index, the order jaxkv's selection gives them)."""
  out = np.full((t_len, topk + kpool - 1), -1)
  for t in range(t_len):
    n_vis = (t + 1) // kpool
    pools = sorted(sorted(range(n_vis), key=lambda p: (-scores[t, p], p))[: topk // kpool])
    toks = [p * kpool + i for p in pools for i in range(kpool)]
    out[t, : len(toks)] = toks
    tail = list(range(n_vis * kpool, t + 1))
    out[t, topk : topk + len(tail)] = tail
  return out


def test_indexer_selection_matches_brute_force(model):
  attn = model.layers[CFG.dsa_layers[0]].self_attn
  rng = np.random.default_rng(1)
  for t in (22, 27, 30):
    x = jnp.asarray(rng.standard_normal((1, t, CFG.hidden_size)), jnp.float32)
    q_resid, _ = attn.latent(x)
    got = np.asarray(attn.indexer(x, q_resid))[0]
    q, key, gate, w = attn.indexer.project(x, q_resid)
    scores = np.asarray(attn.indexer.scores(q, w, attn.indexer.pool(key, gate)))[0]
    want = brute_force_indices(scores, t, CFG.index_kpool, CFG.index_topk)
    np.testing.assert_array_equal(got, want)
    assert (got[t - 1] >= 0).sum() <= CFG.index_topk + CFG.index_kpool - 1
    assert ((got < np.arange(t)[:, None] + 1) | (got == -1)).all()  # causal


def test_sparse_equals_dense_within_the_budget(model):
  dense = Glm5NextForCausalLM(dataclasses.replace(CFG, index_topk=256), rngs=nnx.Rngs(0))
  ids = jnp.asarray(np.random.default_rng(2).integers(1, 256, (2, CFG.index_topk + CFG.index_kpool - 1)))
  np.testing.assert_allclose(model(ids), dense(ids), atol=1e-6)
  longer = jnp.asarray(np.random.default_rng(3).integers(1, 256, (1, 28)))
  assert not np.allclose(model(longer)[0, -1], dense(longer)[0, -1], atol=1e-4)  # selection is sparse now


def test_random_init_moves_every_mechanism(model):
  x = jnp.asarray(np.random.default_rng(4).standard_normal((1, 16, CFG.hidden_size)), jnp.float32)
  moe = model.layers[1].mlp
  w = np.asarray(moe.routing(x))[0]
  assert ((w > 0).sum(-1) == CFG.num_experts_per_tok).all() and len({tuple(np.flatnonzero(r)) for r in w}) > 1
  streams = jnp.broadcast_to(x[:, :, None], (1, 16, CFG.hc_mult, CFG.hidden_size))
  post, comb, _ = model.layers[0].attn_hc(streams)
  np.testing.assert_allclose(np.asarray(comb).sum(-2), 1.0, atol=1e-4)  # doubly stochastic columns
  assert np.asarray(comb).std() > 0.02 and np.asarray(post).std() > 0.02  # not uniform
  clamped = Glm5NextForCausalLM(dataclasses.replace(CFG, swiglu_limit=0.5), rngs=nnx.Rngs(0))
  ids = jnp.asarray([[3, 1, 4, 1, 5, 9, 2, 6]])
  assert not np.allclose(clamped(ids), model(ids), atol=1e-3)  # the clamp is active


def test_mtp_draft_step(model):
  ids = jnp.asarray(np.random.default_rng(5).integers(1, 256, (2, 12)))
  h = model.hidden_states(ids)[0]
  next_e = model.embed_tokens[...][jnp.roll(ids, -1, axis=1)]
  pos = jnp.broadcast_to(jnp.arange(12), (2, 12))
  draft = model.mtp(h, next_e, pos)[0]
  assert draft.shape == h.shape and bool(jnp.isfinite(model.logits(draft)).all())
  # Position 0 sees no embedding: changing the next token there changes nothing at position 0.
  other = model.mtp(h, next_e.at[:, 0].set(7.0), pos)[0]
  np.testing.assert_allclose(other[:, 0], draft[:, 0], atol=1e-6)


def test_grouped_moe_equals_every_expert_weighted(model):
  """The grouped (top-k only) MoE against the definition: every expert on every token, weighted."""
  moe = model.layers[1].mlp
  x = jnp.asarray(np.random.default_rng(6).standard_normal((2, 9, CFG.hidden_size)), jnp.float32)
  w = moe.routing(x)
  hp = jax.lax.Precision.HIGHEST
  g = jnp.einsum("btd,edi->btei", x, moe.experts_gate[...], precision=hp)
  u = jnp.einsum("btd,edi->btei", x, moe.experts_up[...], precision=hp)
  h = jax.nn.silu(jnp.minimum(g, moe.limit)) * jnp.clip(u, -moe.limit, moe.limit) * w[..., None]
  want = jnp.einsum("btei,eid->btd", h, moe.experts_down[...], precision=hp) + moe.shared_experts(x)
  np.testing.assert_allclose(moe(x), want, atol=1e-5, rtol=1e-5)


def test_moe_combines_without_a_float_scatter_add(model):
  """Duplicate-index float scatter-adds sum in atomic order on a GPU (different every run): the MoE
  unsorts by a gather and sums each token's experts in slot order instead."""
  moe = model.layers[1].mlp
  x = jnp.ones((1, 5, CFG.hidden_size), jnp.float32)
  eqns = [str(e) for e in jax.make_jaxpr(moe)(x).eqns]
  assert any("scatter" in e for e in eqns)  # the unsort is an integer scatter
  assert not [e for e in eqns if "scatter-add" in e and "f32[" in e.split("=")[0]]


def test_random_weights_need_an_explicit_rngs():
  cfg = get_config("glm-5.3-flash-tiny")
  with pytest.raises(TypeError, match="rngs"):
    Glm5NextForCausalLM(cfg)  # zeros only when asked for (rngs=None), never by default
  zeros = Glm5NextForCausalLM(cfg, rngs=None)
  assert not np.asarray(zeros.lm_head[...]).any()
