"""The Flax model loads HF checkpoints (tests/fixtures/hf, made by make_hf_fixtures.py with HF
transformers 5.24) and reproduces HF's logits, greedy tokens and top-5 log-probabilities."""

import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.glm5_next.checkpoint import load_checkpoint

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
NAMES = sorted(p.name for p in FIXTURES.iterdir() if (p / "expected.json").is_file())


@pytest.fixture(scope="module", params=NAMES)
def loaded(request):
  """Config, a jitted ``forward(ids [1, L]) -> logits [L, V]`` at one fixed length, expectations.

  Every layer is causal, so one fixed-length buffer (one compile) serves every prompt and step:
  the logits at position n - 1 never see the filler after it.
  """
  path = FIXTURES / request.param
  config, model = load_checkpoint(path, dtype=jnp.float32)
  expected = json.loads((path / "expected.json").read_text())
  length = max(len(p) + len(g) for p, g in zip(expected["prompts"], expected["greedy"]))
  jitted = jax.jit(lambda ids: model(ids)[0])
  forward = lambda seq: np.asarray(jitted(jnp.asarray([list(seq) + [1] * (length - len(seq))])))[: len(seq)]
  return config, forward, expected


def test_fixtures_present():
  assert {"tiny", "tiny-shared"} <= set(NAMES)


def test_logits_match_hf(loaded):
  config, forward, expected = loaded
  for prompt, want in zip(expected["prompts"], expected["logits"]):
    got = forward(prompt)
    want = np.asarray(want, np.float32)
    # float32 on both sides; HF runs mHC/KDA/indexer in float32 too. Observed max |diff| 2.1e-6.
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-4)


def test_greedy_tokens_and_top5_logprobs_match_hf(loaded):
  config, forward, expected = loaded
  for prompt, steps in zip(expected["prompts"], expected["greedy"]):
    seq = list(prompt)
    for step in steps:
      logp = np.asarray(jax.nn.log_softmax(jnp.asarray(forward(seq)[-1])))
      top = np.argsort(-logp, kind="stable")[:5]
      assert int(top[0]) == step["token"]
      np.testing.assert_array_equal(top, step["top5_ids"])
      np.testing.assert_allclose(logp[top], step["top5_logprobs"], atol=2e-4)
      seq.append(step["token"])


def test_loader_rejects_unknown_missing_and_misshaped(tmp_path):
  from safetensors.numpy import load_file, save_file

  src = FIXTURES / "tiny"
  tensors = load_file(src / "model.safetensors")
  cases = {
      "unknown": ({**tensors, "model.language_model.layers.0.self_attn.bogus.weight": np.zeros(3, np.float32)},
                  "unknown tensors: \\['layers.0.self_attn.bogus.weight'\\]"),
      "missing": ({k: v for k, v in tensors.items() if not k.endswith("layers.2.self_attn.kv_b_proj.weight")},
                  "missing tensors: \\['layers.2.self_attn.kv_b_proj.weight'\\]"),
      "misshaped": ({**tensors, "model.language_model.norm.weight": np.zeros(65, np.float32)},
                    "mis-shaped tensors: \\['norm.weight: checkpoint \\[65\\], model \\[64\\]'\\]"),
  }
  for name, (ts, msg) in cases.items():
    d = tmp_path / name
    d.mkdir()
    shutil.copy(src / "config.json", d / "config.json")
    save_file(ts, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=msg):
      load_checkpoint(d)


def test_loader_reads_sharded_checkpoints_and_keeps_stored_dtype(tmp_path):
  from safetensors.numpy import load_file, save_file

  src = FIXTURES / "tiny"
  tensors = load_file(src / "model.safetensors")
  keys = sorted(tensors)
  halves = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
  for fname, ks in halves.items():
    save_file({k: tensors[k] for k in ks}, str(tmp_path / fname))
  (tmp_path / "model.safetensors.index.json").write_text(
      json.dumps({"weight_map": {k: f for f, ks in halves.items() for k in ks}}))
  shutil.copy(src / "config.json", tmp_path / "config.json")
  _, sharded = load_checkpoint(tmp_path)
  _, single = load_checkpoint(src)
  ids = jnp.asarray([[5, 9, 200, 3, 3, 17, 8, 1, 2]])
  np.testing.assert_array_equal(sharded(ids), single(ids))
  assert sharded.layers[1].mlp.gate_weight[...].dtype == jnp.float32
