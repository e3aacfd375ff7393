"""Load HF ``glm5_next`` checkpoints (safetensors + config.json; nothing executed) into the Flax model.

Name mapping (checkpoint -> model), after stripping ``model.language_model.`` (multimodal) or
``model.`` (text-only) prefixes:

| checkpoint | model |
|---|---|
| ``layers.L.hc_{attn,ffn}_{fn,base,scale}`` | ``layers[L].{attn,ffn}_hc.{fn,base,scale}`` |
| ``layers.L.mlp.gate.weight`` / ``.e_score_correction_bias`` | ``layers[L].mlp.gate_weight`` / ``.e_score_correction_bias`` |
| ``layers.L.mlp.experts.E.{gate,up,down}_proj.weight`` | ``layers[L].mlp.experts_{gate,up,down}[E]`` (stacked, transposed to ``[in, out]``) |
| ``layers.L.self_attn.{q,k,v}_conv1d.weight`` | ``layers[L].self_attn.{q,k,v}_conv1d`` |
| ``layers.N.*`` (N = num_hidden_layers: the MTP layer) | ``mtp.*`` (``shared_head.norm`` -> ``shared_head_norm``) |
| ``lm_head.weight``, ``embed_tokens.weight`` | ``lm_head``, ``embed_tokens`` |
| everything else | the same dotted path |

Vision tensors are ignored. Unknown, missing or mis-shaped tensors raise ``ValueError`` naming them.
HF drops the MTP layer at load and never saves it: a checkpoint without any ``layers.N.*`` tensor
loads without the MTP layer.
"""

from __future__ import annotations

import json
import pathlib
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.glm5_next.config import Glm5NextConfig, load_config
from models.glm5_next.model import Glm5NextForCausalLM

__all__ = ["load_checkpoint", "checkpoint_name", "save_checkpoint"]

_VISION = re.compile(r"(^|\.)(visual|vision_tower|vision_model|multi_modal_projector|mm_projector)\.")
_EXPERT = re.compile(r"^(layers\.\d+\.mlp)\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_PREFIXES = ("model.language_model.", "model.")


def checkpoint_name(path: tuple, num_layers: int) -> str:
  """The checkpoint tensor name of a model parameter path (stacked experts: a ``{e}`` template)."""
  parts = [str(p) for p in path]
  if parts[0] == "mtp":
    parts = ["layers", str(num_layers)] + parts[1:]
  name = ".".join(parts)
  name = re.sub(r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2", name)
  name = re.sub(r"\.mlp\.gate_weight$", ".mlp.gate.weight", name)
  name = re.sub(r"\.mlp\.e_score_correction_bias$", ".mlp.gate.e_score_correction_bias", name)
  name = re.sub(r"\.mlp\.experts_(gate|up|down)$", r".mlp.experts.{e}.\1_proj.weight", name)
  name = re.sub(r"\.shared_head_norm\.weight$", ".shared_head.norm.weight", name)
  name = re.sub(r"\.(q|k|v)_conv1d$", r".\1_conv1d.weight", name)
  if name in ("embed_tokens", "lm_head"):
    name += ".weight"
  return name


def _checkpoint_files(model_path: str | pathlib.Path) -> list[pathlib.Path]:
  """``model.safetensors``, or the shards listed in ``model.safetensors.index.json`` (inside the directory)."""
  root = pathlib.Path(model_path)
  index = root / "model.safetensors.index.json"
  if index.is_file():
    try:
      weight_map = json.loads(index.read_text())["weight_map"]
      files = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as err:
      raise ValueError(f"{index} is not a safetensors index (a JSON object with a 'weight_map'): {err}") from None
  elif (root / "model.safetensors").is_file():
    files = ["model.safetensors"]
  else:
    raise ValueError(f"no model.safetensors or model.safetensors.index.json in {root}.")
  base = root.resolve()
  paths = []
  for f in files:
    path = (root / str(f)).resolve()
    if not isinstance(f, str) or base not in path.parents:  # shards live in the checkpoint directory
      raise ValueError(f"{index}: shard {f!r} is outside the checkpoint directory {root}; refusing to read it.")
    paths.append(path)
  return paths


_SAFETENSORS_DTYPES = {
  "F64": "float64",
  "F32": "float32",
  "F16": "float16",
  "BF16": "bfloat16",
  "F8_E4M3": "float8_e4m3fn",
  "F8_E5M2": "float8_e5m2",
  "I64": "int64",
  "I32": "int32",
  "I16": "int16",
  "I8": "int8",
  "U8": "uint8",
  "BOOL": "bool",
}


class _Tensors:
  """A checkpoint's tensors by name, read lazily: shapes and dtypes from the headers, values or
  slices (``read(name, index)``, through ``safe_open(...).get_slice``) only when asked."""

  def __init__(self, model_path: str | pathlib.Path):
    from safetensors import SafetensorError, safe_open

    self._slices = {}
    for path in _checkpoint_files(model_path):
      try:
        fh = safe_open(path, framework="numpy")
        for k in fh.keys():
          self._slices[k] = fh.get_slice(k)
      except (SafetensorError, OSError) as err:
        raise ValueError(f"{path} is not a readable safetensors file: {err}") from None

  def names(self):
    return self._slices.keys()

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._slices[name].get_shape())

  def dtype(self, name: str) -> str:
    """NumPy's name of the stored dtype (``"float32"``, ``"bfloat16"``, ``"int32"``, ...)."""
    raw = self._slices[name].get_dtype()
    return _SAFETENSORS_DTYPES.get(raw, raw.lower())

  def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
    sl = self._slices[name]
    return sl[:] if index is None else sl[index]


def _strip(name: str) -> str | None:
  if _VISION.search(name):
    return None
  if name == "lm_head.weight":
    return name
  for p in _PREFIXES:
    if name.startswith(p):
      return name[len(p) :]
  return name


def _finite_here(values: list[jax.Array]) -> np.ndarray:
  """Whether each array is finite in the shards this process holds: ``[len(values)]`` bools.

  Each device checks its own blocks (``shard_map``), so loading runs no collective: a NaN on another
  process's devices is that process's warning, and loading waits on no other process."""
  check = lambda *xs: jnp.stack([jnp.isfinite(x).all() for x in xs])
  if not all(isinstance(v.sharding, jax.sharding.NamedSharding) for v in values):  # one device, unsharded
    return np.asarray(jax.jit(check)(*values))
  mesh = values[0].sharding.mesh
  local = jax.shard_map(
    lambda *xs: check(*xs)[None],
    mesh=mesh,
    in_specs=tuple(v.sharding.spec for v in values),
    out_specs=jax.sharding.PartitionSpec(mesh.axis_names),
    check_vma=False,
  )
  blocks = jax.jit(local)(*values)  # [devices, len(values)]: one row per device
  return np.all([np.asarray(s.data)[0] for s in blocks.addressable_shards], axis=0)


def load_checkpoint(
  model_path: str | pathlib.Path, *, dtype=None, check_weights: bool = False, mesh=None, expert_parallel: bool = False
) -> tuple[Glm5NextConfig, Glm5NextForCausalLM]:
  """Config and model of an HF checkpoint directory.

  Args:
    dtype: cast every tensor to it (e.g. ``jnp.float32``); None keeps the stored dtypes.
    check_weights: refuse tensors with NaN or infinite entries (one pass over the weights).
    mesh: load by shard onto this ``("data", "tensor")`` mesh: every parameter is placed by its
      ``sharding.partition_spec`` and each process reads only its own devices' slices of each
      tensor (``safe_open(...).get_slice``), never the whole model. None: whole tensors, one device.
    expert_parallel: the experts' split on ``mesh`` (``sharding.partition_spec``).

  Raises:
    ValueError: missing, unknown, mis-shaped or non-float tensors (naming them), or a mesh whose
      sizes do not divide the heads or experts.
  """
  from jax.sharding import NamedSharding

  from models.glm5_next.sharding import DATA, TENSOR, check_divisible, partition_spec

  config = load_config(model_path)
  source = _Tensors(model_path)
  where = {}  # stripped name -> the checkpoint's name
  for name in source.names():
    key = _strip(name)
    if key is not None:
      where[key] = name
  mtp_prefix = f"layers.{config.num_hidden_layers}."
  has_mtp = any(k.startswith(mtp_prefix) for k in where)
  if not has_mtp and config.num_nextn_predict_layers:
    import dataclasses

    config = dataclasses.replace(config, num_nextn_predict_layers=0)
  if mesh is not None:
    check_divisible(
      config,
      tensor_parallel_size=mesh.shape[TENSOR],
      data_parallel_size=mesh.shape[DATA],
      expert_parallel=expert_parallel,
    )
  abstract = nnx.eval_shape(lambda: Glm5NextForCausalLM(config, dtype=dtype or jnp.float32, rngs=None))
  graphdef, state = nnx.split(abstract)
  used: set[str] = set()
  missing, misshaped, not_float, not_finite = [], [], [], []
  leaves = []
  for path, var in nnx.to_flat_state(state):
    template = checkpoint_name(path, config.num_hidden_layers)
    want = tuple(var.get_value().shape)
    stacked = "{e}" in template  # experts: [E, in, out] from E checkpoint tensors [out, in]
    names = [template.format(e=e) for e in range(want[0])] if stacked else [template]
    absent = [n for n in names if n not in where]
    if absent:
      missing += absent
      leaves.append((path, var))
      continue
    used.update(names)
    shapes = {source.shape(where[n]) for n in names}
    shape = (len(names), *shapes.pop()[::-1]) if stacked else shapes.pop()
    if shapes or shape != want:  # experts of several shapes, or not the model's
      misshaped.append(f"{template}: checkpoint {list(shape)}, model {list(want)}")
      continue
    if not all(source.dtype(where[n]).startswith(("float", "bfloat")) for n in names):  # no quantization config
      not_float.append(f"{template}: {source.dtype(where[names[0]])}")
      continue

    # Called at once, for this parameter (whole, or once per device block on a mesh).
    def read(index, names=names, stacked=stacked, template=template, want=want):
      """The block ``index`` of the parameter (all of it: ``index`` of full slices), as the model stores it."""
      index = tuple(index) + (slice(None),) * (len(want) - len(index))
      if stacked:
        e, rows, cols = index
        value = np.stack([source.read(where[n], (cols, rows)).T for n in names[e]])
      else:
        value = source.read(where[template], index)
      if check_weights and not np.isfinite(value.astype(np.float32)).all() and template not in not_finite:
        not_finite.append(template)
      return value if dtype is None else value.astype(dtype)

    if mesh is None:
      value = jnp.asarray(read(()))
    else:
      name = ".".join(map(str, path))
      sharding = NamedSharding(mesh, partition_spec(name, want, expert_parallel=expert_parallel))
      value = jax.make_array_from_callback(want, sharding, read)
    leaves.append((path, var.replace(value)))
  unknown = sorted(set(where) - used)
  problems = []
  if missing:
    problems.append(f"missing tensors: {missing[:10]}{' ...' if len(missing) > 10 else ''} ({len(missing)})")
  if unknown:
    problems.append(f"unknown tensors: {unknown[:10]}{' ...' if len(unknown) > 10 else ''} ({len(unknown)})")
  if misshaped:
    problems.append(f"mis-shaped tensors: {misshaped[:10]}")
  if not_float:
    problems.append(f"tensors that are not floating point: {not_float[:10]}")
  if not_finite:
    problems.append(f"tensors with NaN or infinite values: {not_finite[:10]}")
  if problems:
    raise ValueError(f"checkpoint {model_path} does not match the glm5_next config: " + "; ".join(problems))
  model = nnx.merge(graphdef, nnx.from_flat_state(leaves))
  if not check_weights:  # one pass on the devices: say so once, rather than NaN log-probs later
    flat = nnx.to_flat_state(nnx.state(model))
    finite = _finite_here([v.get_value() for _, v in flat])
    bad = [checkpoint_name(path, config.num_hidden_layers) for (path, _), ok in zip(flat, finite) if not ok]
    if bad:
      warnings.warn(
        f"checkpoint {model_path} has NaN or infinite values in {len(bad)} tensors ({bad[:10]}): "
        "outputs will be NaN; --check-weights (check_weights=True) refuses such a checkpoint.",
        RuntimeWarning,
        stacklevel=2,
      )
  return config, model


def save_checkpoint(model: Glm5NextForCausalLM, model_path: str | pathlib.Path, config_dict: dict) -> None:
  """Writes ``config.json`` and ``model.safetensors`` with checkpoint names (random models, tests)."""
  from safetensors.numpy import save_file

  root = pathlib.Path(model_path)
  root.mkdir(parents=True, exist_ok=True)
  (root / "config.json").write_text(json.dumps(config_dict, indent=1))
  out = {}
  num_layers = model.config.num_hidden_layers
  for path, var in nnx.to_flat_state(nnx.state(model)):
    template = checkpoint_name(path, num_layers)
    value = np.asarray(jax.device_get(var.get_value()))
    names = (
      {template.format(e=e): value[e].T for e in range(value.shape[0])} if "{e}" in template else {template: value}
    )
    for n, v in names.items():
      out[n if n == "lm_head.weight" else "model.language_model." + n] = np.ascontiguousarray(v)
  save_file(out, str(root / "model.safetensors"))
