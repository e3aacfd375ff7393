"""The paged path (jaxkv caches, slot mappings, kernel tables, kernels) against the reference
forward: whole prefill = chunked prefill split mid-pool = token-by-token decode, several requests
per step, dense and packed layouts, XLA and Pallas (interpret) kernels."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv import StepInputs, StepMetadataSpec
from pallas_kernels import compute_step_metadata
from kernel_utils import random_tables, tiny_plan
from models.glm5_next import Glm5NextForCausalLM, get_config
from models.glm5_next.paged import PagedLayout, kernel_fallbacks, paged_forward, paged_hidden_states, paged_mtp_forward

CFG = get_config("glm-5.3-flash-tiny")
NUM_TOKENS = 32  # one bucket for every step


@pytest.fixture(scope="module")
def model():
  return Glm5NextForCausalLM(CFG, rngs=nnx.Rngs(0))


@functools.lru_cache(maxsize=None)
def setup(layout, kv_dtype="float32", idx_dtype="float32", block_size=512, num_spec=0):
  _, plan = tiny_plan(
    layout=layout,
    kv_cache_dtype=kv_dtype,
    indexer_cache_dtype=idx_dtype,
    block_size=block_size,
    num_spec=num_spec,
    memory_bytes=64 << 20,
    max_model_len=1024,
  )
  return plan, PagedLayout.from_plan(plan)


def step_inputs(plan, tables, tok, pos, req, state_slots):
  bt = tuple(jnp.asarray(t.block_table) for t in tables.block_tables)
  nb = tuple(jnp.asarray(t.num_blocks_per_row) for t in tables.block_tables)
  pos, req = jnp.asarray(pos, jnp.int32), jnp.asarray(req, jnp.int32)
  meta = compute_step_metadata(
    bt, nb, req, pos, plan.init_kernel_block_tables(bt[0].shape[0]), spec=StepMetadataSpec.from_plan(plan)
  )
  return StepInputs(jnp.asarray(tok, jnp.int32), pos, req, bt, nb, meta, state_slots)


@functools.lru_cache(maxsize=None)
def step_function(model, layout, implementation):
  """One jitted step per (model, layout, kernels): every test reusing it compiles it once per shape."""
  return jax.jit(lambda c, i: paged_forward(model, c, i, layout, implementation=implementation))


class Runner:
  """Feeds steps of ``(row, start, length)`` chunks; returns each request's logits by position."""

  def __init__(self, model, layout_name, lengths, seed=0, implementation="xla", **kw):
    self.plan, self.layout = setup(layout_name, **kw)
    rng = np.random.default_rng(seed)
    self.tables = random_tables(self.plan, len(lengths), lengths, rng)
    # Poisoned caches: nothing may read bytes the step did not write.
    self.caches = {
      t.name: jnp.asarray(rng.integers(0, 256, (t.num_rows, t.row_bytes), dtype=np.uint8)) for t in self.plan.tensors
    }
    self.step_fn = step_function(model, self.layout, implementation)

  def run(self, ids, steps):
    out = {r: {} for r in range(len(ids))}
    for chunks in steps:
      tok, pos, req = [], [], []
      for r, start, n in chunks:
        tok += list(ids[r][start : start + n])
        pos += list(range(start, start + n))
        req += [r] * n
      pad = NUM_TOKENS - len(tok)
      inp = step_inputs(
        self.plan, self.tables, tok + [0] * pad, pos + [0] * pad, req + [-1] * pad, jnp.zeros(len(ids), jnp.int32)
      )
      logits, self.caches = self.step_fn(self.caches, inp)
      logits = np.asarray(logits)
      for i, (r, p) in enumerate(zip(req, pos)):
        out[r][p] = logits[i]
    return {r: np.stack([v[p] for p in sorted(v)]) for r, v in out.items()}


def reference(model, ids):
  return np.asarray(model(jnp.asarray([ids]))[0])


@pytest.mark.parametrize("layout", ["packed", "dense"])
def test_whole_chunked_and_token_by_token_agree_with_reference(model, layout):
  rng = np.random.default_rng(1)
  ids = [list(rng.integers(1, 256, 30))]
  want = reference(model, ids[0])
  whole = Runner(model, layout, [30])
  got_whole = whole.run(ids, [[(0, 0, 30)]])[0]
  chunked = Runner(model, layout, [30])
  got_chunked = chunked.run(ids, [[(0, 0, 10)], [(0, 10, 13)], [(0, 23, 7)]])[0]  # 10 and 23: mid-pool
  decode = Runner(model, layout, [30])
  got_decode = decode.run(ids, [[(0, 0, 5)]] + [[(0, p, 1)] for p in range(5, 30)])[0]
  for got in (got_whole, got_chunked, got_decode):
    np.testing.assert_allclose(got, want, atol=5e-5, rtol=0)
  # The caches end up the same (KDA states, latents, pooled keys, tail ring), poison included.
  for name in whole.caches:
    a, b, c = (np.asarray(r.caches[name]).view(np.float32) for r in (whole, chunked, decode))
    np.testing.assert_allclose(b, a, atol=5e-5, equal_nan=True)
    np.testing.assert_allclose(c, a, atol=5e-5, equal_nan=True)


def test_requests_of_different_lengths_share_steps(model):
  rng = np.random.default_rng(2)
  lengths = [27, 9, 19]
  ids = [list(rng.integers(1, 256, n)) for n in lengths]
  runner = Runner(model, "packed", lengths, seed=3)
  steps = [
    [(0, 0, 14), (1, 0, 5), (2, 0, 11)],  # three prefill chunks
    [(0, 14, 13), (1, 5, 4), (2, 11, 1)],  # prefill continues, request 2 decodes
    [(2, 12, 7)],  # request 2 finishes; requests 0 and 1 are done
  ]
  got = runner.run(ids, steps)
  for r, n in enumerate(lengths):
    np.testing.assert_allclose(got[r], reference(model, ids[r]), atol=5e-5, rtol=0)


def test_pallas_kernels_agree_with_reference(model):
  rng = np.random.default_rng(4)
  ids = [list(rng.integers(1, 256, 26))]
  runner = Runner(model, "packed", [26], implementation="pallas")
  got = runner.run(ids, [[(0, 0, 17)], [(0, 17, 9)]])[0]
  np.testing.assert_allclose(got, reference(model, ids[0]), atol=5e-5, rtol=0)


def test_fp8_indexer_and_bf16_latent_serving_precision(model):
  """fp8 pooled keys change only the selection; within the budget (<= 11 tokens) all are selected."""
  rng = np.random.default_rng(5)
  ids = [list(rng.integers(1, 256, 11))]
  runner = Runner(model, "packed", [11], kv_dtype="bfloat16", idx_dtype="fp8")
  got = runner.run(ids, [[(0, 0, 6)], [(0, 6, 5)]])[0]
  want = reference(model, ids[0])
  # bf16 latents: ~3 significant digits in the attended values.
  np.testing.assert_allclose(got, want, atol=0.05 * np.abs(want).max(), rtol=0)
  assert np.array_equal(got.argmax(-1), want.argmax(-1))


def test_mtp_layer_paged_equals_reference(model):
  """The MTP pass over a prefill split mid-pool (its own latent, pooled-key and ring caches) equals
  the reference MTP layer on the reference hidden states, embedding zeroed at position 0."""
  rng = np.random.default_rng(6)
  ids = list(rng.integers(1, 256, 23))
  plan, layout = setup("packed", num_spec=2)
  tables = random_tables(plan, 1, [25], rng)
  caches = {t.name: jnp.asarray(rng.integers(0, 256, (t.num_rows, t.row_bytes), dtype=np.uint8)) for t in plan.tensors}
  slots = jnp.full((1,), 2, jnp.int32)

  @jax.jit
  def step(caches, inputs, next_ids):
    hidden, caches = paged_hidden_states(model, caches, inputs, layout)
    return paged_mtp_forward(model, caches, hidden, next_ids, inputs, layout)

  got = []
  for start, n in ((0, 10), (10, 12)):  # 10: mid-pool; the MTP needs the token after each
    pad = NUM_TOKENS - n
    inp = step_inputs(
      plan,
      tables,
      ids[start : start + n] + [0] * pad,
      list(range(start, start + n)) + [0] * pad,
      [0] * n + [-1] * pad,
      slots,
    )
    h, caches, _ = step(caches, inp, jnp.asarray(ids[start + 1 : start + n + 1] + [0] * pad, jnp.int32))
    got.append(np.asarray(h[:n]))
  hidden = model.hidden_states(jnp.asarray([ids]))[0][:, :22]
  want = model.mtp(hidden, model.embed_tokens[...][jnp.asarray([ids[1:]])], jnp.arange(22)[None])[0][0]
  np.testing.assert_allclose(np.concatenate(got), np.asarray(want), atol=5e-5, rtol=0)


def test_kernels_without_tiles_run_their_xla_path():
  """A kernel with no tiles that fit the device's shared memory runs its XLA path (said at start-up)."""
  cfg, plan = tiny_plan(layout="packed", kv_cache_dtype="float32", block_size=256)
  layout = PagedLayout.from_plan(plan)
  assert kernel_fallbacks(cfg, layout, None) == {} and kernel_fallbacks(cfg, layout, 232_448) == {}
  small = kernel_fallbacks(cfg, layout, 4_096)  # tiny dims: 16 x 16 float32 tiles of 32 latents need 5,120 B
  assert sorted(small) == ["paged_mqa_logits", "sparse_mla_decode"]
  assert "--implementation xla" in small["sparse_mla_decode"]
  fallback = dataclasses.replace(layout, xla_kernels=tuple(small))
  assert fallback.implementation("sparse_mla_decode", "pallas") == "xla"
  assert layout.implementation("sparse_mla_decode", "pallas") == "pallas"
