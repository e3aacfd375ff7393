"""The fused recurrent KDA kernel against its reference and a NumPy oracle, on random ragged steps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _common, read_rows, write_rows
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


def random_pages(rng, r, req, num_slots, offset=5, spare=3):
  """Random (poison) page words ``[N, W]`` with room for ``N > R * S`` states at ``offset`` and
  ``spare`` words after, and a random, permuted ``dest [R, S]``; the last slot (its last token
  saves there) of the first token's request is -1, of the last token's ``N``: no page, not saved."""
  n = r * num_slots + 4
  pages = rng.integers(0, 2**32, (n, offset + H * K * V + spare), dtype=np.uint32)
  dest = rng.permutation(n)[: r * num_slots].reshape(r, num_slots).astype(np.int32)
  dest[req[0], num_slots - 1] = -1
  dest[req[req >= 0][-1], num_slots - 1] = n
  return pages, dest


def saved_states(pages, dest, offset):
  """The float32 states ``[R, S, H, K, V]`` at ``dest`` (NaN where the row is out of range)."""
  r, num_slots = dest.shape
  out = np.full((r, num_slots, H, K, V), np.nan, np.float32)
  for i in range(r):
    for s in range(num_slots):
      if 0 <= dest[i, s] < pages.shape[0]:
        out[i, s] = pages[dest[i, s], offset : offset + H * K * V].view(np.float32).reshape(H, K, V)
  return out


def states_in_pages(rng, args, pages, dest, offset=5):
  """``args`` and ``pages`` with the starting states moved into the pages, and their rows ``src
  [R]``: a request's own first slot (read and written by the same call), a free row, -1 and ``N``
  (those two start from zeros, which ``args["state"]`` then holds)."""
  r, n = dest.shape[0], pages.shape[0]
  free = np.setdiff1d(np.arange(n), dest)
  src = np.where(rng.random(r) < 0.5, dest[:, 0], rng.choice(free, r, replace=False)).astype(np.int32)
  src[rng.permutation(r)[:2]] = (-1, n) if r > 2 else (-1, -1)[:r]
  state, pages = args["state"].copy(), pages.copy()
  for i, row in enumerate(src):
    if 0 <= row < n:
      pages[row, offset : offset + H * K * V] = state[i].reshape(-1).view(np.uint32)
    else:
      state[i] = 0.0
  return {**args, "state": state}, pages, src


def call(args, pages, dest, req, slot, impl, offset=5, page_dtype=None, **kw):
  """The kernel on ``pages`` (viewed as ``page_dtype``: their bytes, say); the pages returned as
  words."""
  pages = pages if page_dtype is None else pages.view(page_dtype)
  o, new = fused_recurrent_kda(
    **{k: a if a is None else jnp.asarray(a) for k, a in args.items()},
    pages=jnp.asarray(pages),
    dest=jnp.asarray(dest),
    req_indices=jnp.asarray(req),
    slot=jnp.asarray(slot),
    offset=offset,
    implementation=impl,
    **kw,
  )
  assert new.dtype == pages.dtype and new.shape == pages.shape
  return np.asarray(o), np.asarray(new).view(np.uint32)


@pytest.mark.parametrize("page_dtype", [np.uint32, np.uint8])
@pytest.mark.parametrize("from_pages", [False, True])
@pytest.mark.parametrize("lengths,num_slots", [((5, 1, 9, 3), 1), ((1, 1, 1), 1), ((6, 2, 4), 3), ((17,), 2)])
def test_kernel_matches_reference_and_oracle(lengths, num_slots, from_pages, page_dtype):
  rng = np.random.default_rng(sum(lengths) * 31 + num_slots)
  args, req, slot, r = random_step(rng, lengths, 24, num_slots)
  pages, dest = random_pages(rng, r, req, num_slots)
  start = {}
  if from_pages:  # the kernel reads the states from the pages: args["state"] is the oracle's
    args, pages, src = states_in_pages(rng, args, pages, dest)
    start = dict(state=None, src=jnp.asarray(src))
  o_k, pages_k = call({**args, **start}, pages, dest, req, slot, "pallas", page_dtype=page_dtype, block_v=16)
  o_r, pages_r = call({**args, **start}, pages, dest, req, slot, "xla", page_dtype=page_dtype)
  o_n, saved = oracle(**args, req=req, slot=slot, num_slots=num_slots)
  np.testing.assert_allclose(o_k, o_n, atol=2e-5)
  np.testing.assert_allclose(o_r, o_n, atol=2e-5)
  assert not o_k[req < 0].any()  # padding rows are zero, not left unwritten
  # Only the saved states' words change: every other word (other rows, the words before and after
  # a state, slots no token names, the slot without a page) keeps its poison.
  kept = np.ones(pages.shape, bool)
  for row, s in saved:
    if 0 <= dest[row, s] < pages.shape[0]:
      kept[dest[row, s], 5 : 5 + H * K * V] = False
  assert (~kept).any()
  for got in (pages_k, pages_r):
    np.testing.assert_array_equal(got[kept], pages[kept])
    states = saved_states(got, dest, 5)
    for (row, s), want in saved.items():
      if 0 <= dest[row, s] < pages.shape[0]:
        np.testing.assert_allclose(states[row, s], want, atol=2e-5)


def test_kernel_is_batch_invariant():
  """A request's outputs and states are bitwise the same alone or in a batch, at any offset."""
  rng = np.random.default_rng(3)
  args, req, slot, r = random_step(rng, (4, 7, 2), 16, 1)
  pages, dest = random_pages(rng, r, req, 1)
  full_o, full_p = call(args, pages, dest, req, slot, "pallas")
  row = int(req[4])  # the second request: tokens 4 .. 10
  sel = np.where(req == row)[0]
  alone = {k: (a[sel] if k != "state" else a) for k, a in args.items()}
  pad = lambda a: np.concatenate([np.zeros((3,) + a.shape[1:], a.dtype), a])  # at another offset
  alone = {k: (pad(a) if k != "state" else a) for k, a in alone.items()}
  req_a = np.array([-1] * 3 + [row] * len(sel), np.int32)
  slot_a = np.array([-1] * 3 + list(slot[sel]), np.int32)
  o, p = call(alone, pages, dest, req_a, slot_a, "pallas")
  np.testing.assert_array_equal(o[3:], full_o[sel])
  np.testing.assert_array_equal(p[dest[row, 0]], full_p[dest[row, 0]])


def test_bad_arguments_name_the_shapes():
  rng = np.random.default_rng(0)
  args, req, slot, r = random_step(rng, (3,), 8, 1)
  pages, dest = random_pages(rng, r, req, 1)
  with pytest.raises(ValueError, match=r"v \[T, H, V\]"):
    call({**args, "v": args["v"][:, :, :8].reshape(8, H * 2, 4)}, pages, dest, req, slot, "xla")
  with pytest.raises(ValueError, match="slot must be int32"):
    call(args, pages, dest, req, slot[:4], "xla")
  with pytest.raises(ValueError, match="float32"):
    call({**args, "q": args["q"].astype(jnp.bfloat16)}, pages, dest, req, slot, "xla")
  with pytest.raises(ValueError, match="block_v must be a power of two"):
    call(args, pages, dest, req, slot, "pallas", block_v=12)
  with pytest.raises(ValueError, match="pages must be uint32"):
    call(args, pages.view(np.float32), dest, req, slot, "xla")
  with pytest.raises(ValueError, match=r"or their bytes uint8 \[N, 4W\], got uint8\[6, 4127\]"):
    call(args, pages.view(np.uint8)[:, :-1], dest, req, slot, "xla")
  with pytest.raises(ValueError, match=r"dest must be int32 \[R, S\] with R = 2"):
    call(args, pages, dest[:1], req, slot, "xla")
  with pytest.raises(ValueError, match="offset must place a state of H \\* K \\* V = 1024 words inside a page of W"):
    call(args, pages, dest, req, slot, "xla", offset=9)
  with pytest.raises(ValueError, match="either as state"):
    call({**args, "src": np.zeros(r, np.int32)}, pages, dest, req, slot, "xla")
  with pytest.raises(ValueError, match=r"src must be int32 \[R\]"):
    call({**args, "state": None, "src": np.zeros((r, 1), np.int32)}, pages, dest, req, slot, "xla")


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_page_rows_read_and_write_the_same_words_from_bytes(monkeypatch, backend):
  """``read_rows`` / ``write_rows`` on a page arena given as bytes: on the CPU they slice the bytes
  (a whole-arena bitcast is a copy there: no word array of the arena's size is compiled), elsewhere
  they go through the word view; both match the words' own path and a NumPy oracle, and a row out
  of range writes nothing."""
  monkeypatch.setattr(_common, "target_backend", lambda: backend)
  rng = np.random.default_rng(11)
  words = rng.integers(0, 2**32, (9, 40), dtype=np.uint32)
  rows, new = np.array([7, 2, 9, 4], np.int32), rng.integers(0, 2**32, (4, 13), dtype=np.uint32)
  want = words.copy()
  for r, w in zip(rows, new):
    if r < len(words):
      want[r, 6:19] = w
  # Fresh functions: jit's cache would otherwise serve one backend's trace to the other.
  read, write = jax.jit(lambda p, r: read_rows(p, r, 6, 13)), jax.jit(lambda p, r, v: write_rows(p, r, 6, v))
  for pages in (words, words.view(np.uint8)):
    got = read(jnp.asarray(pages), jnp.asarray(rows[[0, 1, 3]]))
    np.testing.assert_array_equal(got, words[rows[[0, 1, 3]], 6:19])
    out = write(jnp.asarray(pages), jnp.asarray(rows), jnp.asarray(new))
    assert out.dtype == pages.dtype and out.shape == pages.shape
    np.testing.assert_array_equal(np.asarray(out).view(np.uint32), want)
  hlo = write.lower(jnp.asarray(words.view(np.uint8)), jnp.asarray(rows), jnp.asarray(new)).compile().as_text()
  assert ("u32[9,40]" in hlo) == (backend == "gpu")
  # Words read as bf16 pairs (the conv windows): the CPU's simplifier once merged a bytes -> words
  # -> bf16 bitcast chain into one it rejected.
  as_bf16 = jax.jit(lambda p, r: jax.lax.bitcast_convert_type(read_rows(p, r, 6, 13), jnp.bfloat16))
  got = as_bf16(jnp.asarray(words.view(np.uint8)), jnp.asarray(rows[[0, 1, 3]]))
  np.testing.assert_array_equal(np.asarray(got).view(np.uint16), words[rows[[0, 1, 3]], 6:19, None].view(np.uint16))
