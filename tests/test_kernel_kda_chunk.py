"""The chunkwise KDA kernel against a NumPy token-by-token oracle, and bitwise across step splits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda_chunk import ChunkPrefix, chunk_kda

H, K, V, C = 2, 16, 32, 32
IMPLS = ("xla", "pallas")


def history(rng, n, gate):
  """``n`` tokens of one request: normed q, k, random v, beta in (0, 1), and log-decays from the
  safe gate (-5 sigmoid, as GLM-5.3-Flash) or a steep one (down to -40 a token, HF's unbounded
  softplus gate: decays across a chunk underflow and later-minus-earlier exponents overflow)."""
  f = lambda *s: rng.standard_normal(s).astype(np.float32)
  unit = lambda a: a / np.linalg.norm(a, axis=-1, keepdims=True)
  if gate == "safe":
    g = -5.0 / (1.0 + np.exp(-f(n, H, K)))
  else:
    g = -np.minimum(np.exp(2.0 * f(n, H, K)), 40.0).astype(np.float32)
  return dict(q=unit(f(n, H, K)) * K**-0.5, k=unit(f(n, H, K)), v=f(n, H, V), g=g, beta=1 / (1 + np.exp(-f(n, H))))


def oracle(tok, s0):
  """Float64, token by token: outputs and the state after every token."""
  s, outs, states = s0.astype(np.float64), [], []
  for t in range(len(tok["q"])):
    s = s * np.exp(tok["g"][t].astype(np.float64))[..., None]
    u = tok["beta"][t][:, None] * (tok["v"][t] - np.einsum("hkv,hk->hv", s, tok["k"][t]))
    s = s + tok["k"][t][..., None] * u[:, None, :]
    outs.append(np.einsum("hkv,hk->hv", s, tok["q"][t]))
    states.append(s)
  return np.array(outs), states


def call(steps, state, prefix, impl, num_tokens, precision="float32"):
  """One ``chunk_kda`` call: ``steps`` maps request -> (tokens dict, first position); rows in the
  dict's key order, then padding to ``num_tokens``."""
  cols = {name: [] for name in ("q", "k", "v", "g", "beta")}
  req, pos = [], []
  for r, (tok, p0) in steps.items():
    n = len(tok["q"])
    for name in cols:
      cols[name].append(tok[name])
    req += [r] * n
    pos += range(p0, p0 + n)
  pad = num_tokens - len(req)
  rng = np.random.default_rng(pad)
  for name, shape in (("q", (H, K)), ("k", (H, K)), ("v", (H, V)), ("g", (H, K)), ("beta", (H,))):
    cols[name].append(rng.standard_normal((pad, *shape)).astype(np.float32))  # padding: garbage
  args = {name: jnp.asarray(np.concatenate(x)) for name, x in cols.items()}
  req = jnp.asarray(np.array(req + [-1] * pad, np.int32))
  pos = jnp.asarray(np.array(pos + [3] * pad, np.int32))
  o, state, prefix = chunk_kda(
    **args,
    state=state,
    prefix=prefix,
    req_indices=req,
    positions=pos,
    block_v=16,
    implementation=impl,
    precision=precision,
  )
  return np.asarray(o), state, prefix


def split(tok, start, stop):
  return {name: x[start:stop] for name, x in tok.items()}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("gate", ["safe", "steep"])
@pytest.mark.parametrize("chunk", [16, 64])
def test_matches_oracle_from_any_position(impl, gate, chunk):
  """Requests in a shuffled order, starting at position 0 or inside a chunk (the state at the
  chunk's start and its earlier rows given), ending inside or at the end of one, on grids of one
  sub-block (16) and of the model's 64."""
  rng = np.random.default_rng(chunk + (gate == "safe"))
  starts, lengths = (0, 21, 5, 37, 0), (80, 11, 27, 3, 64)  # request 5 has no tokens this call
  num_reqs = len(starts) + 1
  s_init = rng.standard_normal((num_reqs, H, K, V)).astype(np.float32) * 0.3
  state = np.asarray(rng.standard_normal((num_reqs, H, K, V)), np.float32)  # rows overwritten below
  prefix = [np.asarray(rng.standard_normal(x.shape), np.float32) for x in ChunkPrefix.zeros(num_reqs, H, K, V, chunk)]
  steps, want = {}, {}
  for r in rng.permutation(len(starts)):
    p0, n = starts[r], lengths[r]
    tok = history(rng, p0 + n, gate)
    outs, states = oracle(tok, s_init[r])
    c0 = p0 - p0 % chunk
    state[r] = s_init[r] if c0 == 0 else states[c0 - 1]
    for pre, name in zip(prefix, ("k", "g", "v", "beta")):
      pre[r] = 0.0
      pre[r, : p0 - c0] = tok[name][c0:p0]
    steps[int(r)] = (split(tok, p0, p0 + n), p0)
    end = p0 + n
    b = end - end % chunk
    want[int(r)] = (outs[p0:], s_init[r] if b == 0 else states[b - 1], split(tok, b, end))
  keep = [x[len(starts)].copy() for x in prefix]
  keep_state = state[len(starts)].copy()
  o, new_state, new_prefix = call(steps, jnp.asarray(state), ChunkPrefix(*map(jnp.asarray, prefix)), impl, 200)
  row = 0
  for r, (tok, _) in steps.items():
    n = len(tok["q"])
    w_o, w_state, w_rows = want[r]
    np.testing.assert_allclose(o[row : row + n], w_o, rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(np.asarray(new_state)[r], w_state, rtol=2e-4, atol=2e-5)
    for pre, name in zip(new_prefix, ("k", "g", "v", "beta")):
      got = np.asarray(pre)[r]
      m = len(w_rows[name])
      np.testing.assert_array_equal(got[:m], w_rows[name])
      assert not np.any(got[m:]), "rows after the prefix must be zero"
    row += n
  assert not np.any(o[row:]), "skipped tokens' outputs must be zero"
  np.testing.assert_array_equal(np.asarray(new_state)[len(starts)], keep_state)
  for pre, kept in zip(new_prefix, keep):
    np.testing.assert_array_equal(np.asarray(pre)[len(starts)], kept)


@pytest.mark.parametrize(
  "impl, cuts",
  [(impl, cuts) for impl in IMPLS for cuts in [(7,), (13,), (1, 2, 30), (16,), (5, 43)]],
)
def test_bitwise_across_step_splits(impl, cuts):
  """One prompt in one call or cut into steps of the given sizes (repeated), beside another
  request's tokens: every output, the final state and the prefix are bitwise the same."""
  rng = np.random.default_rng(sum(cuts))
  n = 75
  tok, other = history(rng, n, "safe"), history(rng, 9, "steep")
  s0 = jnp.asarray(rng.standard_normal((2, H, K, V)).astype(np.float32) * 0.3)
  fresh = lambda: (jnp.array(s0), ChunkPrefix.zeros(2, H, K, V, C))

  state, prefix = fresh()
  whole, w_state, w_prefix = call({1: (tok, 0), 0: (other, 0)}, state, prefix, impl, 96)
  whole = whole[:n]

  state, prefix = fresh()
  parts, start, i = [], 0, 0
  while start < n:
    stop = min(n, start + cuts[i % len(cuts)])
    steps = {1: (split(tok, start, stop), start)}
    if i == 0:
      steps[0] = (other, 0)
    o, state, prefix = call(steps, state, prefix, impl, 96)
    parts.append(o[: stop - start])
    start, i = stop, i + 1
  np.testing.assert_array_equal(np.concatenate(parts), whole)
  np.testing.assert_array_equal(np.asarray(state)[1], np.asarray(w_state)[1])
  for a, b in zip(prefix, w_prefix):
    np.testing.assert_array_equal(np.asarray(a)[1], np.asarray(b)[1])


@pytest.mark.parametrize("precision", ["float32", "tf32x3"])
def test_pallas_close_to_xla_on_long_steps(precision):
  """Several chunks per request in one call (the state carried across chunks in the kernel), with
  either precision of the kernel's products (interpreted, both run float32; compiled on a GPU,
  tf32x3 runs three TF32 products and must stay as close)."""
  rng = np.random.default_rng(3)
  tok_a, tok_b = history(rng, 70, "safe"), history(rng, 33, "steep")
  s0 = rng.standard_normal((2, H, K, V)).astype(np.float32) * 0.3
  outs = {}
  for impl in IMPLS:
    o, state, prefix = call(
      {0: (tok_a, 0), 1: (tok_b, 0)}, jnp.asarray(s0), ChunkPrefix.zeros(2, H, K, V, C), impl, 112, precision
    )
    outs[impl] = (o, np.asarray(state), [np.asarray(x) for x in prefix])
  np.testing.assert_allclose(outs["pallas"][0], outs["xla"][0], rtol=1e-5, atol=1e-6)
  # Compiled, the kernel and XLA sum the products in other orders; the state carries that across
  # both requests' chunks: 8.0e-6 apart at most on an H100 (2026-12-07), both precisions alike.
  state_atol = 1e-6 if jax.default_backend() == "cpu" else 3e-5
  np.testing.assert_allclose(outs["pallas"][1], outs["xla"][1], rtol=1e-5, atol=state_atol)
  for a, b in zip(outs["pallas"][2], outs["xla"][2]):
    np.testing.assert_array_equal(a, b)


def test_rejects_bad_arguments():
  z = lambda *s: jnp.zeros(s, jnp.float32)
  args = dict(q=z(4, H, K), k=z(4, H, K), v=z(4, H, V), g=z(4, H, K), beta=z(4, H), state=z(2, H, K, V))
  ids = dict(req_indices=jnp.zeros(4, jnp.int32), positions=jnp.zeros(4, jnp.int32))
  with pytest.raises(ValueError, match=r"C a power of two >= 16.*\[2, 12, 2, 16\]"):
    chunk_kda(**args, prefix=ChunkPrefix.zeros(2, H, K, V, 12), **ids)
  with pytest.raises(ValueError, match=r"v \[T, H, V\].*v \[4, 2, 16\]"):
    chunk_kda(**{**args, "v": z(4, H, K)}, prefix=ChunkPrefix.zeros(2, H, K, V, C), **ids)
  with pytest.raises(ValueError, match=r"positions must be int32\[4\], got int32\[5\]"):
    chunk_kda(
      **args, prefix=ChunkPrefix.zeros(2, H, K, V, C), req_indices=ids["req_indices"], positions=jnp.zeros(5, jnp.int32)
    )
  with pytest.raises(ValueError, match=r"precision must be one of \('float32', 'tf32x3'\), got 'tf32'"):
    chunk_kda(**args, prefix=ChunkPrefix.zeros(2, H, K, V, C), **ids, precision="tf32", implementation="pallas")
  with pytest.raises(ValueError, match=r"block_v must be a power of two >= 16 dividing V = 32, got 8"):
    chunk_kda(**args, prefix=ChunkPrefix.zeros(2, H, K, V, C), **ids, block_v=8, implementation="pallas")


@pytest.mark.parametrize("impl", IMPLS)
def test_repeated_keys_stay_accurate(impl):
  """A repeated token (one key throughout, decays near 0, beta near 1): ``I + A`` is close to the
  all-ones lower triangle, whose inverse's power series has binomial terms (~1e17 at 64 rows); the
  solve must not go through them."""
  rng = np.random.default_rng(11)
  n = 64
  tok = history(rng, n, "safe")
  tok["k"] = np.broadcast_to(tok["k"][:1], tok["k"].shape).copy()
  tok["g"] = np.full_like(tok["g"], -1e-3)
  tok["beta"] = np.full_like(tok["beta"], 0.99)
  s0 = rng.standard_normal((1, H, K, V)).astype(np.float32) * 0.3
  want, states = oracle(tok, s0[0])
  o, state, _ = call({0: (tok, 0)}, jnp.asarray(s0), ChunkPrefix.zeros(1, H, K, V, 64), impl, n)
  np.testing.assert_allclose(o, want, rtol=1e-3, atol=1e-4)
  np.testing.assert_allclose(np.asarray(state)[0], states[-1], rtol=1e-3, atol=1e-4)
