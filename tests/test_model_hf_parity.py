"""The Flax model loads HF checkpoints (tests/fixtures/hf, made by make_hf_fixtures.py with HF
transformers 5.24) and reproduces HF's logits, greedy tokens and top-5 log-probabilities."""

import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import hypothesis
import hypothesis.strategies as st
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
  config, model = load_checkpoint(path, dtype=jnp.float32, check_weights=True)
  expected = json.loads((path / "expected.json").read_text())
  length = max(len(p) + len(g) for p, g in zip(expected["prompts"], expected["greedy"]))
  jitted = jax.jit(lambda ids: model(ids)[0])
  forward = lambda seq: np.asarray(jitted(jnp.asarray([list(seq) + [1] * (length - len(seq))])))[: len(seq)]
  return config, forward, expected


def test_fixtures_present():
  assert {"tiny", "tiny-shared", "flat-kda", "lac-only", "both"} <= set(NAMES)


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
    "unknown": (
      {**tensors, "model.language_model.layers.0.self_attn.bogus.weight": np.zeros(3, np.float32)},
      "unknown tensors: \\['layers.0.self_attn.bogus.weight'\\]",
    ),
    "missing": (
      {k: v for k, v in tensors.items() if not k.endswith("layers.2.self_attn.kv_b_proj.weight")},
      "missing tensors: \\['layers.2.self_attn.kv_b_proj.weight'\\]",
    ),
    "misshaped": (
      {**tensors, "model.language_model.norm.weight": np.zeros(65, np.float32)},
      "mis-shaped tensors: \\['norm.weight: checkpoint \\[65\\], model \\[64\\]'\\]",
    ),
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
    json.dumps({"weight_map": {k: f for f, ks in halves.items() for k in ks}})
  )
  shutil.copy(src / "config.json", tmp_path / "config.json")
  _, sharded = load_checkpoint(tmp_path)
  _, single = load_checkpoint(src)
  ids = jnp.asarray([[5, 9, 200, 3, 3, 17, 8, 1, 2]])
  np.testing.assert_array_equal(sharded(ids), single(ids))
  assert sharded.layers[1].mlp.gate_weight[...].dtype == jnp.float32


def _checkpoint_dir(tmp_path, name, tensors=None, config=None):
  from safetensors.numpy import load_file, save_file

  d = tmp_path / name
  d.mkdir()
  src = FIXTURES / "tiny"
  (d / "config.json").write_text(json.dumps(config) if config is not None else (src / "config.json").read_text())
  save_file(load_file(src / "model.safetensors") if tensors is None else tensors, str(d / "model.safetensors"))
  return d


def test_loader_refuses_what_it_cannot_load_safely(tmp_path):
  from safetensors.numpy import load_file

  # A shard outside the checkpoint directory is never opened.
  outside = _checkpoint_dir(tmp_path, "base")
  d = _checkpoint_dir(tmp_path, "evil")
  (d / "model.safetensors").unlink()
  (d / "model.safetensors.index.json").write_text(
    json.dumps({"weight_map": {"lm_head.weight": "../base/model.safetensors"}})
  )
  with pytest.raises(ValueError, match="shard '../base/model.safetensors' is outside the checkpoint directory"):
    load_checkpoint(d)
  assert (outside / "model.safetensors").is_file()
  # Corrupted files: a ValueError naming the file, not the library's own error.
  for name, data in {
    "empty": b"",
    "truncated": (outside / "model.safetensors").read_bytes()[:100],
    "random": np.random.default_rng(0).bytes(4096),
  }.items():
    bad = _checkpoint_dir(tmp_path, name)
    (bad / "model.safetensors").write_bytes(data)
    with pytest.raises(ValueError, match=r"model\.safetensors is not a readable safetensors file"):
      load_checkpoint(bad)
  # Integer weights are not silently loaded as numbers.
  tensors = load_file(FIXTURES / "tiny" / "model.safetensors")
  tensors["model.language_model.norm.weight"] = np.ones(64, np.int32)
  with pytest.raises(ValueError, match=r"not floating point: \['norm.weight: int32'\]"):
    load_checkpoint(_checkpoint_dir(tmp_path, "ints", tensors))
  # NaN weights: refused with check_weights (jaxkv generate --check-weights).
  tensors["model.language_model.norm.weight"] = np.full(64, np.nan, np.float32)
  nan_dir = _checkpoint_dir(tmp_path, "nan", tensors)
  with pytest.raises(ValueError, match=r"NaN or infinite values: \['norm.weight'\]"):
    load_checkpoint(nan_dir, check_weights=True)
  with pytest.warns(RuntimeWarning, match="norm.weight"):
    load_checkpoint(nan_dir)  # unchecked, it loads as stored, said once


@pytest.mark.parametrize(
  "change, message",
  [
    ({"num_hidden_layers": None}, "num_hidden_layers must be an integer in \\[1, 1024\\], got None"),
    ({"num_hidden_layers": 10**4}, "num_hidden_layers must be an integer in \\[1, 1024\\], got 10000"),
    ({"index_kpool": 0}, "index_kpool must be an integer in \\[1, "),
    ({"hidden_size": -4}, "hidden_size must be an integer"),
    ({"n_routed_experts": 0}, "n_routed_experts must be an integer in \\[1, "),
    ({"n_routed_experts": 10**7}, "n_routed_experts must be an integer in \\[1, 65536\\]"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok 9 exceeds n_routed_experts 8"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok must be an integer"),
    ({"index_topk": 0}, "index_topk must be an integer"),
    ({"rms_norm_eps": -1}, "rms_norm_eps must be > 0"),
    ({"rms_norm_eps": "1e-6"}, "rms_norm_eps must be a number, got '1e-6'"),
    ({"norm_topk_prob": "false"}, "norm_topk_prob must be true or false, got 'false'"),
  ],
)
def test_config_values_are_checked_before_anything_is_built(change, message):
  from models.glm5_next.config import Glm5NextConfig

  cfg = json.loads((FIXTURES / "tiny" / "config.json").read_text())
  text = cfg.get("text_config", cfg)
  text.update(change)
  with pytest.raises(ValueError, match=message):
    Glm5NextConfig.from_hf_dict(cfg)


@pytest.mark.parametrize("raw", [[], None, {"text_config": None}, {"text_config": []}, "glm5_next"])
def test_config_that_is_not_an_object_is_refused(raw):
  from models.glm5_next.config import Glm5NextConfig

  with pytest.raises(ValueError, match="must be a JSON object"):
    Glm5NextConfig.from_hf_dict(raw)


_ANY_JSON = st.recursive(
  st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats() | st.text(max_size=5),
  lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
  max_leaves=5,
)


@hypothesis.settings(max_examples=200, deadline=2000)
@hypothesis.given(
  changes=st.dictionaries(
    st.sampled_from(sorted(json.loads((FIXTURES / "tiny" / "config.json").read_text())["text_config"])),
    _ANY_JSON,
    min_size=1,
    max_size=4,
  )
)
def test_config_parser_fuzz_ends_in_a_config_or_a_value_error(changes):
  from models.glm5_next.config import Glm5NextConfig

  cfg = json.loads((FIXTURES / "tiny" / "config.json").read_text())
  cfg["text_config"].update(changes)
  try:
    Glm5NextConfig.from_hf_dict(cfg)
  except ValueError:
    pass


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(flips=st.lists(st.tuples(st.integers(0, 10**9), st.integers(0, 255)), min_size=1, max_size=8))
def test_corrupted_checkpoint_bytes_load_or_raise_a_value_error(tmp_path_factory, flips):
  d = tmp_path_factory.mktemp("corrupt")
  shutil.copy(FIXTURES / "tiny" / "config.json", d / "config.json")
  data = bytearray((FIXTURES / "tiny" / "model.safetensors").read_bytes())
  for at, byte in flips:
    data[at % min(len(data), 4096)] = byte  # the header and the first tensors
  (d / "model.safetensors").write_bytes(bytes(data))
  try:
    load_checkpoint(d)
  except ValueError:
    pass


def test_config_forms_resolve_as_hf():
  """Every config form HF's Glm5NextTextConfig accepts, resolved as HF resolved it
  (fixtures/hf/config_cases.json, written by make_hf_fixtures.py with HF itself)."""
  from models.glm5_next.config import Glm5NextConfig

  cases = json.loads((FIXTURES / "config_cases.json").read_text())
  assert len(cases) >= 20
  for case in cases:
    ours, hf = Glm5NextConfig.from_hf_dict(case["config"]), case["hf"]
    eos = hf["eos_token_id"]
    got = {
      "n_routed_experts": ours.n_routed_experts,
      "indexer_types": list(ours.indexer_types),
      "layer_types": list(ours.layer_types),
      "mlp_layer_types": list(ours.mlp_layer_types),
      "linear_num_heads": ours.linear_num_heads,
      "linear_head_dim": ours.linear_head_dim,
      "linear_conv_kernel_dim": ours.linear_conv_kernel_dim,
      "linear_lower_bound": ours.linear_gate_lower_bound,
      "pad_token_id": ours.pad_token_id,
      "eos_token_id": list(ours.eos_token_id) if isinstance(eos, list) else (ours.eos_token_id or (None,))[0],
    }
    assert got == hf, case["config"]


def test_form_fixtures_are_in_their_forms():
  """The checkpoints' config.json files really are in the forms the parity tests load."""
  text = {
    n: json.loads((FIXTURES / n / "config.json").read_text())["text_config"] for n in ("flat-kda", "lac-only", "both")
  }
  assert text["flat-kda"].get("linear_attn_config") is None and text["flat-kda"]["index_topk_pattern"] == "FFSF"
  assert "linear_num_heads" not in text["lac-only"] and text["lac-only"]["linear_attn_config"]["safe_gate"] is False
  assert "full_attention" in text["lac-only"]["layer_types"] and "num_local_experts" in text["lac-only"]
  assert text["both"]["linear_num_heads"] != text["both"]["linear_attn_config"]["num_heads"]
  assert all(t.get("indexer_types") is None for t in text.values())


def test_non_finite_weights_are_said_at_load(tmp_path):
  """Weight checking off (the default): a NaN lm_head loads, with one warning naming it."""
  from safetensors.numpy import load_file

  tensors = load_file(FIXTURES / "tiny" / "model.safetensors")
  tensors["lm_head.weight"] = np.full_like(tensors["lm_head.weight"], np.nan)
  d = _checkpoint_dir(tmp_path, "nan", tensors=tensors)
  with pytest.warns(RuntimeWarning, match=r"NaN or infinite values in 1 tensors \(\['lm_head.weight'\]\)"):
    load_checkpoint(d)
  with pytest.raises(ValueError, match="NaN or infinite"):
    load_checkpoint(d, check_weights=True)
