"""GLM-5.3-Flash (``glm5_next``) text configuration, parsed from HF ``config.json`` (JSON only).

Built-in configs: ``glm-5.3-flash`` (the released text tower), ``glm-5.3-flash-tiny`` (every
mechanism at CPU-test size, docs/model.md),
``glm-5.3-flash-mini`` (released indexer and latent shapes in 8 narrower layers) and
``glm-5.3-flash-slice4`` (the released dimensions in 4 layers: the HF peer benchmark's model).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import Any

__all__ = ["Glm5NextConfig", "BUILTIN_CONFIGS", "HF_DEFAULTS", "get_config", "load_config"]

_MODEL_TYPES = ("glm5_next", "glm5_next_text")
# A checkpoint's dtype -> the dtype jaxkv serves it in ("auto").
_CHECKPOINT_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "bfloat16"}
_ATTN_ALIASES = {"deepseek_sparse_attention": "indexed_attention", "full_attention": "indexed_attention"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Glm5NextConfig:
  vocab_size: int
  hidden_size: int
  num_hidden_layers: int
  layer_types: tuple[str, ...]  # "linear_attention" (KDA) | "indexed_attention" (DSA)
  mlp_layer_types: tuple[str, ...]  # "dense" | "sparse"
  indexer_types: tuple[str, ...]  # "full" | "shared"
  intermediate_size: int
  moe_intermediate_size: int
  n_routed_experts: int
  num_experts_per_tok: int
  n_shared_experts: int
  routed_scaling_factor: float
  norm_topk_prob: bool
  swiglu_limit: float
  num_attention_heads: int
  q_lora_rank: int
  kv_lora_rank: int
  qk_nope_head_dim: int
  v_head_dim: int
  index_n_heads: int
  index_head_dim: int
  index_topk: int
  index_kpool: int
  linear_num_heads: int
  linear_head_dim: int
  linear_conv_kernel_dim: int
  linear_gate_lower_bound: float | None  # None: no lower bound (HF's softplus gate)
  hc_mult: int
  hc_eps: float
  hc_sinkhorn_iters: int
  rms_norm_eps: float
  num_nextn_predict_layers: int
  max_position_embeddings: int
  # MTP draft steps >= 1 reuse step 0's index row (vLLM's proposer; a drafting approximation).
  index_share_for_mtp_iteration: bool
  pad_token_id: int | None
  eos_token_id: tuple[int, ...]
  tie_word_embeddings: bool
  # The checkpoint's dtype (config.json's "dtype" / "torch_dtype"; float16 is served as bfloat16):
  # what "auto" means for the weights and the caches. Absent: float32, HF's default.
  dtype: str = "float32"

  def __post_init__(self):
    self._check_values()
    n = self.num_hidden_layers
    for name in ("layer_types", "mlp_layer_types", "indexer_types"):
      if len(getattr(self, name)) != n:
        raise ValueError(f"{name} has {len(getattr(self, name))} entries for {n} layers.")
    for name, allowed in (
      ("layer_types", {"linear_attention", "indexed_attention"}),
      ("mlp_layer_types", {"dense", "sparse"}),
      ("indexer_types", {"full", "shared"}),
    ):
      bad = sorted(set(getattr(self, name)) - allowed)
      if bad:
        raise ValueError(f"unknown {name} {bad}; expected one of {sorted(allowed)}.")
    if self.index_topk % self.index_kpool:
      raise ValueError(f"index_topk {self.index_topk} must be a multiple of index_kpool {self.index_kpool}.")

  def _check_values(self):
    """Types and ranges of every field, before anything is sized from them (a ValueError naming the
    field and the value)."""
    counts = {"num_nextn_predict_layers": 0, "n_shared_experts": 0, "hc_sinkhorn_iters": 0}
    limits = {"num_hidden_layers": 1024, "n_routed_experts": 1 << 16, "num_experts_per_tok": 1 << 16}
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if f.type == "int":
        low = counts.get(f.name, 1)
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= limits.get(f.name, 1 << 24):
          raise ValueError(
            f"config {f.name} must be an integer in [{low}, {limits.get(f.name, 1 << 24)}], got {value!r}."
          )
      elif f.type == "float":
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
          raise ValueError(f"config {f.name} must be a finite number, got {value!r}.")
    if self.pad_token_id is not None and (
      not isinstance(self.pad_token_id, int) or isinstance(self.pad_token_id, bool) or self.pad_token_id < 0
    ):
      raise ValueError(f"config pad_token_id must be null or an integer >= 0, got {self.pad_token_id!r}.")
    bound = self.linear_gate_lower_bound
    if bound is not None and (
      not isinstance(bound, (int, float)) or isinstance(bound, bool) or not math.isfinite(bound)
    ):
      raise ValueError(f"config linear_lower_bound must be null or a finite number, got {bound!r}.")
    for name in ("rms_norm_eps", "hc_eps"):
      if getattr(self, name) <= 0:
        raise ValueError(f"config {name} must be > 0, got {getattr(self, name)}.")
    if self.num_experts_per_tok > self.n_routed_experts:
      raise ValueError(
        f"config num_experts_per_tok {self.num_experts_per_tok} exceeds n_routed_experts {self.n_routed_experts}."
      )
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size for t in self.eos_token_id):
      raise ValueError(f"config eos_token_id must be token ids in [0, {self.vocab_size}), got {self.eos_token_id!r}.")

  @property
  def dsa_layers(self) -> tuple[int, ...]:
    return tuple(i for i, t in enumerate(self.layer_types) if t == "indexed_attention")

  @property
  def kda_layers(self) -> tuple[int, ...]:
    return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

  @classmethod
  def from_hf_dict(cls, cfg: dict[str, Any]) -> Glm5NextConfig:
    """From an HF ``config.json`` dict, flat or with ``text_config``, read as HF's ``Glm5NextTextConfig``
    reads it: absent keys take HF's class defaults (``HF_DEFAULTS``, the one table of them);
    ``linear_attn_config`` wins over the flat ``linear_*`` keys where both are given (with
    ``safe_gate`` and a null lower bound meaning -5.0); ``indexer_types`` wins over
    ``index_topk_pattern`` ("FSSF..." or a list), which wins over ``index_topk_freq`` /
    ``index_skip_topk_offset``; ``full_attention`` means ``indexed_attention``; ``num_local_experts``
    sets ``n_routed_experts``."""
    outer = cfg if isinstance(cfg, dict) else {}
    if isinstance(cfg, dict) and "text_config" in cfg:
      cfg = cfg["text_config"]
    if not isinstance(cfg, dict):
      raise ValueError(f"a glm5_next config must be a JSON object (text_config included), got {type(cfg).__name__}.")
    dtype = next((d[k] for d in (cfg, outer) for k in ("dtype", "torch_dtype") if d.get(k) is not None), "float32")
    if not isinstance(dtype, str) or dtype not in _CHECKPOINT_DTYPES:
      raise ValueError(f"config dtype must be one of {sorted(_CHECKPOINT_DTYPES)}, got {dtype!r}.")
    model_type = cfg.get("model_type")
    if model_type not in _MODEL_TYPES:
      raise ValueError(f"model_type {model_type!r} is not a glm5_next config (expected one of {_MODEL_TYPES}).")
    n = cfg.get("num_hidden_layers")
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 1024:
      raise ValueError(f"config num_hidden_layers must be an integer in [1, 1024], got {n!r}.")
    get = lambda key: cfg[key] if cfg.get(key) is not None else HF_DEFAULTS[key]  # noqa: E731
    eos = cfg.get("eos_token_id")
    eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    ints = (
      "vocab_size",
      "hidden_size",
      "intermediate_size",
      "moe_intermediate_size",
      "n_routed_experts",
      "num_experts_per_tok",
      "n_shared_experts",
      "num_attention_heads",
      "q_lora_rank",
      "kv_lora_rank",
      "qk_nope_head_dim",
      "v_head_dim",
      "index_n_heads",
      "index_head_dim",
      "index_topk",
      "index_kpool",
      "hc_mult",
      "hc_sinkhorn_iters",
      "num_nextn_predict_layers",
      "max_position_embeddings",
    )
    floats = ("routed_scaling_factor", "swiglu_limit", "hc_eps", "rms_norm_eps")
    bools = ("norm_topk_prob", "index_share_for_mtp_iteration", "tie_word_embeddings")
    values = {k: get(k) for k in ints}
    if cfg.get("num_local_experts") is not None:  # HF's attribute_map: it sets n_routed_experts
      values["n_routed_experts"] = cfg["num_local_experts"]
    layer_types = _names(
      cfg, "layer_types", ["linear_attention" if i % 4 != 3 else "indexed_attention" for i in range(n)]
    )
    return cls(
      num_hidden_layers=n,
      layer_types=tuple(_ATTN_ALIASES.get(t, t) for t in layer_types),
      mlp_layer_types=tuple(_names(cfg, "mlp_layer_types", ["dense"] * min(3, n) + ["sparse"] * (n - 3))),
      indexer_types=tuple(_indexer_types(cfg, n)),
      **_linear_attention(cfg),
      eos_token_id=eos,
      dtype=_CHECKPOINT_DTYPES[dtype],
      pad_token_id=cfg.get("pad_token_id", HF_DEFAULTS["pad_token_id"]),
      **values,
      **{k: _number(k, get(k)) for k in floats},
      **{k: _flag(k, get(k)) for k in bools},
    )


def _linear_attention(cfg: dict) -> dict:
  """The KDA fields: the flat ``linear_*`` keys (HF's defaults where absent; a null lower bound is
  no lower bound), overridden key by key by ``linear_attn_config`` when it is given."""
  flat = {
    k: cfg.get(k, HF_DEFAULTS[k])
    for k in ("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim", "linear_lower_bound")
  }
  lin = cfg.get("linear_attn_config")
  if lin is not None:
    if not isinstance(lin, dict):
      raise ValueError(f"config linear_attn_config must be a JSON object, got {lin!r}.")
    for key, flat_key in (
      ("num_heads", "linear_num_heads"),
      ("head_dim", "linear_head_dim"),
      ("short_conv_kernel_size", "linear_conv_kernel_dim"),
      ("gate_lower_bound", "linear_lower_bound"),
    ):
      flat[flat_key] = lin.get(key, flat[flat_key])
    if lin.get("safe_gate", True) and flat["linear_lower_bound"] is None:
      flat["linear_lower_bound"] = -5.0
  bound = flat.pop("linear_lower_bound")
  return {**flat, "linear_gate_lower_bound": None if bound is None else _number("linear_lower_bound", bound)}


def _indexer_types(cfg: dict, n: int) -> list[str]:
  """``indexer_types``, else ``index_topk_pattern`` ("F"/"S" letters or a list), else the
  ``index_topk_freq`` / ``index_skip_topk_offset`` schedule (HF's defaults 1 and 2: every layer full)."""
  if cfg.get("indexer_types") is not None:
    return _names(cfg, "indexer_types", [])
  pattern = cfg.get("index_topk_pattern")
  if isinstance(pattern, str):
    letters = {"F": "full", "S": "shared"}
    if set(pattern) - set(letters):
      raise ValueError(f"config index_topk_pattern must be a string of F (full) and S (shared), got {pattern!r}.")
    return [letters[c] for c in pattern]
  if pattern is not None:
    return _names(cfg, "index_topk_pattern", [])
  freq, offset = cfg.get("index_topk_freq", 1), cfg.get("index_skip_topk_offset", 2)
  for key, value in (("index_topk_freq", freq), ("index_skip_topk_offset", offset)):
    if not isinstance(value, int) or isinstance(value, bool):
      raise ValueError(f"config {key} must be an integer, got {value!r}.")
  freq = max(freq, 1)
  return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]


def _names(cfg: dict, key: str, default: list[str]) -> list[str]:
  """A JSON list of strings (absent or null: ``default``)."""
  value = default if cfg.get(key) is None else cfg[key]
  if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
    raise ValueError(f"config {key} must be a list of strings, got {value!r}.")
  return value


def _number(key: str, value) -> float:
  """A JSON number as float (a string or a bool is not one)."""
  if not isinstance(value, (int, float)) or isinstance(value, bool):
    raise ValueError(f"config {key} must be a number, got {value!r}.")
  return float(value)


def _flag(key: str, value) -> bool:
  if not isinstance(value, bool):
    raise ValueError(f"config {key} must be true or false, got {value!r}.")
  return value


# HF ``Glm5NextConfig``'s class defaults: what an absent key means in a config.json.
HF_DEFAULTS: dict[str, Any] = {
  "vocab_size": 154880,
  "hidden_size": 4096,
  "intermediate_size": 12288,
  "moe_intermediate_size": 2048,
  "n_routed_experts": 288,
  "num_experts_per_tok": 8,
  "n_shared_experts": 1,
  "routed_scaling_factor": 2.5,
  "norm_topk_prob": True,
  "swiglu_limit": 10.0,
  "num_attention_heads": 64,
  "q_lora_rank": 1536,
  "kv_lora_rank": 512,
  "qk_nope_head_dim": 256,
  "v_head_dim": 256,
  "index_n_heads": 32,
  "index_head_dim": 128,
  "index_topk": 2048,
  "index_kpool": 16,  # HF's class default; the released model sets 4
  "linear_num_heads": 64,
  "linear_head_dim": 128,
  "linear_conv_kernel_dim": 4,
  "linear_lower_bound": -5.0,
  "hc_mult": 4,
  "hc_eps": 1e-6,
  "hc_sinkhorn_iters": 20,
  "rms_norm_eps": 1e-5,
  "num_nextn_predict_layers": 0,
  "index_share_for_mtp_iteration": True,
  "max_position_embeddings": 1048576,
  "pad_token_id": 154820,
  "tie_word_embeddings": False,
}


def _released() -> dict:
  """The released text tower: HF's defaults, with its kpool, MTP layer and eos ids."""
  n = 45
  return {
    **HF_DEFAULTS,
    "model_type": "glm5_next_text",
    "num_hidden_layers": n,
    "layer_types": ["linear_attention" if i % 4 != 3 else "indexed_attention" for i in range(n)],
    "mlp_layer_types": ["dense"] * 3 + ["sparse"] * (n - 3),
    "indexer_types": ["full"] * n,
    "num_key_value_heads": 64,
    "qk_rope_head_dim": 0,
    "n_group": 1,
    "topk_group": 1,
    "hidden_act": "silu",
    "index_kpool": 4,
    "num_nextn_predict_layers": 1,
    "eos_token_id": [154820, 154827, 154829],
    "dtype": "bfloat16",
  }


def _tiny() -> dict:
  return {
    "model_type": "glm5_next_text",
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 6,
    "pad_token_id": 0,
    "layer_types": [
      "linear_attention",
      "linear_attention",
      "indexed_attention",
      "linear_attention",
      "indexed_attention",
      "linear_attention",
    ],
    "mlp_layer_types": ["dense"] + ["sparse"] * 5,
    "indexer_types": ["full"] * 6,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "swiglu_limit": 10.0,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 0,
    "v_head_dim": 16,
    "index_n_heads": 4,
    "n_group": 1,
    "topk_group": 1,
    "hidden_act": "silu",
    "index_head_dim": 16,
    "index_topk": 8,
    "index_kpool": 4,
    "linear_attn_config": {"num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0},
    "hc_mult": 4,
    "hc_eps": 1e-6,
    "hc_sinkhorn_iters": 20,
    "rms_norm_eps": 1e-5,
    "num_nextn_predict_layers": 1,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
  }


def _mini() -> dict:
  """A mid-size random config for GPU benchmarks: the released per-layer shapes of the indexer and
  the MLA latent, fewer and narrower layers (8: KDA, KDA, KDA, DSA twice), 16 experts."""
  n = 8
  cfg = _released()
  cfg.update(
    {
      "vocab_size": 32000,
      "hidden_size": 1024,
      "num_hidden_layers": n,
      "layer_types": ["linear_attention" if i % 4 != 3 else "indexed_attention" for i in range(n)],
      "mlp_layer_types": ["dense"] + ["sparse"] * (n - 1),
      "indexer_types": ["full"] * n,
      "intermediate_size": 2048,
      "moe_intermediate_size": 512,
      "n_routed_experts": 16,
      "num_experts_per_tok": 4,
      "num_attention_heads": 16,
      "num_key_value_heads": 16,
      "q_lora_rank": 512,
      "qk_nope_head_dim": 128,
      "v_head_dim": 128,
      "linear_attn_config": {"num_heads": 8, "head_dim": 128, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0},
      "max_position_embeddings": 131072,
      "pad_token_id": 0,
      "eos_token_id": [1],
    }
  )
  return cfg


def _slice4() -> dict:
  """The HF peer benchmark's model (``shared/tools/hf_peer_bench.py``): HF's defaults at the released
  dimensions, 4 layers (KDA, KDA, KDA, DSA; MLPs dense, MoE, dense, MoE; 16.7 B parameters), kpool 4,
  no MTP layer. The same work for ``jaxkv bench`` and the peer."""
  return {
    **HF_DEFAULTS,
    "model_type": "glm5_next_text",
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["indexed_attention"],
    "mlp_layer_types": ["dense", "sparse", "dense", "sparse"],
    "indexer_types": ["full"] * 4,
    "index_kpool": 4,
    "pad_token_id": 0,
    "dtype": "bfloat16",
  }


BUILTIN_CONFIGS = {
  "glm-5.3-flash": _released,
  "glm-5.3-flash-tiny": _tiny,
  "glm-5.3-flash-mini": _mini,
  "glm-5.3-flash-slice4": _slice4,
}


def get_config(name: str) -> Glm5NextConfig:
  if name not in BUILTIN_CONFIGS:
    raise ValueError(f"unknown config {name!r}; built-in configs: {sorted(BUILTIN_CONFIGS)}.")
  return Glm5NextConfig.from_hf_dict(BUILTIN_CONFIGS[name]())


def load_config(model_path: str | pathlib.Path) -> Glm5NextConfig:
  """Parses ``<model_path>/config.json`` (JSON only; nothing from the directory is executed)."""
  path = pathlib.Path(model_path) / "config.json"
  if not path.is_file():
    raise ValueError(f"no config.json in {model_path}; pass --model-path a checkpoint directory.")
  try:
    data = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"{path} is not valid JSON: {e}") from e
  return Glm5NextConfig.from_hf_dict(data)
