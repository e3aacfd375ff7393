"""The fused recurrent KDA kernel against its reference and a NumPy oracle, on random ragged steps."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda_recurrence import fused_recurrent_kda

H, K, V = 2, 16, 32


def random_step(rng, lengths, num_tokens, num_slots):
  """Requests (in a random order of rows) with ``lengths`` tokens each, contiguous, then padding;
  each request saves the states of its last ``num_slots`` tokens to slots ``0 .. S-1``."""
  rows = rng.permutation(len(lengths) + 1)  # one row has no tokens this step
  req, slot = [], []
  for row, n in zip(rows, lengths):
    req += [int(row)] * n
    slot += [num_slots - (n - i) if n - i <= num_slots else -1 for i in range(n)]
  pad = num_tokens - len(req)
  req, slot = np.array(req + [-1] * pad, np.int32), np.array(slot + [7] * pad, np.int32)
  t, r = num_tokens, len(lengths) + 1
  f = lambda *s: rng.standard_normal(s).astype(np.float32)
  unit = lambda a: a / np.linalg.norm(a, axis=-1, keepdims=True)
  args = dict(
    q=unit(f(t, H, K)) * K**-0.5,
    k=unit(f(t, H, K)),
    v=f(t, H, V),
    g=-np.abs(f(t, H, K)) * 0.5,
    beta=1 / (1 + np.exp(-f(t, H))),
    state=f(r, H, K, V) * 0.3,
  )
  return args, req, slot, r


def oracle(q, k, v, g, beta, state, req, slot, num_slots):
  """NumPy, token by token."""
  s = state.astype(np.float64).copy()
  o = np.zeros(v.shape)
  saved = {}
  for t, r in enumerate(req):
    if r < 0:
      continue
    st = s[r] * np.exp(g[t])[..., None]
    u = beta[t][:, None] * (v[t] - np.einsum("hkv,hk->hv", st, k[t]))
    st = st + k[t][..., None] * u[:, None, :]
    o[t], s[r] = np.einsum("hkv,hk->hv", st, q[t]), st
    if 0 <= slot[t] < num_slots:
      saved[(int(r), int(slot[t]))] = st.copy()
  return o, saved


@pytest.mark.parametrize("lengths,num_slots", [((5, 1, 9, 3), 1), ((1, 1, 1), 1), ((6, 2, 4), 3), ((17,), 2)])
def test_kernel_matches_reference_and_oracle(lengths, num_slots):
  rng = np.random.default_rng(sum(lengths) * 31 + num_slots)
  args, req, slot, r = random_step(rng, lengths, 24, num_slots)
  poison = np.full((r, num_slots, H, K, V), np.nan, np.float32)
  call = lambda impl, **kw: fused_recurrent_kda(
    **{k: jnp.asarray(a) for k, a in args.items()},
    states=jnp.asarray(poison),
    req_indices=jnp.asarray(req),
    slot=jnp.asarray(slot),
    implementation=impl,
    **kw,
  )
  o_k, st_k = (np.asarray(a) for a in call("pallas", block_v=16))
  o_r, st_r = (np.asarray(a) for a in call("xla"))
  o_n, saved = oracle(**args, req=req, slot=slot, num_slots=num_slots)
  np.testing.assert_allclose(o_k, o_n, atol=2e-5)
  np.testing.assert_allclose(o_r, o_n, atol=2e-5)
  assert not o_k[req < 0].any()  # padding rows are zero, not left unwritten
  for row in range(r):
    for s in range(num_slots):
      if (row, s) in saved:
        np.testing.assert_allclose(st_k[row, s], saved[(row, s)], atol=2e-5)
        np.testing.assert_allclose(st_r[row, s], saved[(row, s)], atol=2e-5)
      else:  # never named: the poison is still there
        assert np.isnan(st_k[row, s]).all() and np.isnan(st_r[row, s]).all()


def test_kernel_is_batch_invariant():
  """A request's outputs and states are bitwise the same alone or in a batch, at any offset."""
  rng = np.random.default_rng(3)
  args, req, slot, r = random_step(rng, (4, 7, 2), 16, 1)
  states = jnp.zeros((r, 1, H, K, V), jnp.float32)
  full_o, full_s = fused_recurrent_kda(
    **{k: jnp.asarray(a) for k, a in args.items()},
    states=states,
    req_indices=jnp.asarray(req),
    slot=jnp.asarray(slot),
    implementation="pallas",
  )
  row = int(req[4])  # the second request: tokens 4 .. 10
  sel = np.where(req == row)[0]
  alone = {k: (a[sel] if k != "state" else a) for k, a in args.items()}
  pad = lambda a: np.concatenate([np.zeros((3,) + a.shape[1:], a.dtype), a])  # at another offset
  alone = {k: (pad(a) if k != "state" else a) for k, a in alone.items()}
  req_a = np.array([-1] * 3 + [row] * len(sel), np.int32)
  slot_a = np.array([-1] * 3 + list(slot[sel]), np.int32)
  o, s = fused_recurrent_kda(
    **{k: jnp.asarray(a) for k, a in alone.items()},
    states=jnp.zeros_like(states),
    req_indices=jnp.asarray(req_a),
    slot=jnp.asarray(slot_a),
    implementation="pallas",
  )
  np.testing.assert_array_equal(np.asarray(o)[3:], np.asarray(full_o)[sel])
  np.testing.assert_array_equal(np.asarray(s)[row], np.asarray(full_s)[row])


def test_bad_arguments_name_the_shapes():
  rng = np.random.default_rng(0)
  args, req, slot, r = random_step(rng, (3,), 8, 1)
  args = {k: jnp.asarray(a) for k, a in args.items()}
  states = jnp.zeros((r, 1, H, K, V), jnp.float32)
  with pytest.raises(ValueError, match=r"v \[T, H, V\]"):
    fused_recurrent_kda(
      **{**args, "v": args["v"][:, :, :8].reshape(8, H * 2, 4)},
      states=states,
      req_indices=jnp.asarray(req),
      slot=jnp.asarray(slot),
    )
  with pytest.raises(ValueError, match="slot must be int32"):
    fused_recurrent_kda(**args, states=states, req_indices=jnp.asarray(req), slot=jnp.asarray(slot[:4]))
  with pytest.raises(ValueError, match="float32"):
    fused_recurrent_kda(
      **{**args, "q": args["q"].astype(jnp.bfloat16)},
      states=states,
      req_indices=jnp.asarray(req),
      slot=jnp.asarray(slot),
    )
  with pytest.raises(ValueError, match="block_v must be a power of two"):
    fused_recurrent_kda(
      **args, states=states, req_indices=jnp.asarray(req), slot=jnp.asarray(slot), implementation="pallas", block_v=12
    )
