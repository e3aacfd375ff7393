"""``jaxkv.LLM``: vLLM's offline API over the engine, text in and text out.

    from jaxkv import LLM, SamplingParams
    llm = LLM()                          # the embedded tiny model and its tokenizer; or LLM(model=DIR)
    outs = llm.generate(["Hello world!"], SamplingParams(max_tokens=8, temperature=0.8, n=2))
    print(outs[0].outputs[1].text)

The token-level ``LLMEngine`` stays underneath (``llm.engine``).
"""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Sequence

from jaxkv.engine.engine import EngineConfig, LLMEngine
from jaxkv.engine.model_runner import get_model_family
from jaxkv.engine.request import SamplingParams, is_int
from jaxkv.entrypoints.output_processor import SequenceState, engine_params, prompt_logprob_dicts
from jaxkv.cache.kv_cache_config import CacheConfig
from jaxkv.outputs import RequestOutput
from jaxkv.tokenizer import Tokenizer, builtin_tokenizer_dir

__all__ = ["LLM", "resolve_dtype"]


def resolve_dtype(dtype: str, config, from_checkpoint: bool) -> str:
  """vLLM's ``dtype="auto"``: a checkpoint's own dtype; random weights bf16 on an accelerator and
  float32 on the CPU (bf16 matmuls there are slow and not the reference's precision)."""
  if dtype != "auto":
    return dtype
  if from_checkpoint:
    return config.dtype
  import jax

  return "float32" if jax.default_backend() == "cpu" else "bfloat16"


class LLM:
  """A model, its tokenizer and an engine, for offline generation.

  Args:
    model: a built-in config name (random weights, seeded ``seed``; the embedded tiny model ships
      a tokenizer) or an HF ``glm5_next`` checkpoint directory.
    tokenizer: a directory with ``tokenizer.json`` (default: the model's; None if it has none:
      then prompts are token ids and outputs have no text).
    dtype: ``"auto"`` (the checkpoint's dtype; random weights bf16 on a GPU, float32 on the CPU),
      ``"bfloat16"`` or ``"float32"``.
    max_model_len: longest request (default and cap: the model's positions).
    max_num_seqs, max_num_batched_tokens, long_prefill_token_threshold, enable_prefix_caching: the
      engine's rows, token budget per step, tokens per request and step, and prefix cache (vLLM's
      names; ``EngineConfig``).
    kv_cache_memory_bytes: the KV cache's size (vLLM's name); block_size, kv_cache_dtype,
      num_speculative_tokens and the rest of ``CacheConfig`` through ``cache_options``.
    implementation: the attention kernels (``"auto"``, ``"pallas"``, ``"xla"``).
  """

  def __init__(
    self,
    model: str = "glm-5.3-flash-tiny",
    *,
    tokenizer: str | None = None,
    dtype: str = "auto",
    seed: int = 0,
    max_model_len: int | None = None,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 256,
    long_prefill_token_threshold: int = 0,
    enable_prefix_caching: bool = False,
    kv_cache_memory_bytes: int = 64 << 20,
    implementation: str = "auto",
    **cache_options,
  ):
    family = get_model_family()
    from_checkpoint = os.path.isdir(model)
    if not from_checkpoint and model not in family.builtin_config_names:
      raise ValueError(
        f"model {model!r} is neither a checkpoint directory nor a built-in config "
        f"({', '.join(family.builtin_config_names)})."
      )
    config = family.load_config(model) if from_checkpoint else family.builtin_config(model)
    if dtype not in ("auto", "bfloat16", "float32"):
      raise ValueError(f"dtype must be 'auto', 'bfloat16' or 'float32', got {dtype!r}.")
    self.dtype = resolve_dtype(dtype, config, from_checkpoint)
    positions = config.max_position_embeddings
    if max_model_len is not None and not (is_int(max_model_len) and 1 <= max_model_len <= positions):
      raise ValueError(
        f"max_model_len must be an integer in [1, {positions}] (the model's positions), got {max_model_len!r}."
      )
    self.model, self.model_config = model, config
    tok_dir = tokenizer or (model if from_checkpoint else builtin_tokenizer_dir(model))
    has_tok = tok_dir is not None and os.path.isfile(os.path.join(tok_dir, "tokenizer.json"))
    if tokenizer is not None and not has_tok:
      raise ValueError(f"tokenizer {tokenizer!r} has no tokenizer.json.")
    self.tokenizer = Tokenizer(tok_dir) if has_tok else None
    if self.tokenizer is not None and self.tokenizer.vocab_size > config.vocab_size:
      raise ValueError(
        f"the tokenizer's {self.tokenizer.vocab_size} entries exceed the model's vocabulary of {config.vocab_size}."
      )
    cache = CacheConfig(memory_bytes=kv_cache_memory_bytes, max_model_len=max_model_len or positions, **cache_options)
    engine_config = EngineConfig(
      cache=cache,
      max_num_reqs=max_num_seqs,
      max_num_batched_tokens=max_num_batched_tokens,
      long_prefill_token_threshold=long_prefill_token_threshold,
      enable_prefix_caching=enable_prefix_caching,
    )
    if from_checkpoint:
      runner = family.from_pretrained(model, dtype=self.dtype, implementation=implementation)
    else:
      runner = family.from_random(config, dtype=self.dtype, seed=seed, implementation=implementation)
    self.engine = LLMEngine(runner, engine_config)
    self.eos_token_ids = tuple(
      dict.fromkeys(tuple(config.eos_token_id) + (self.tokenizer.eos_token_ids if self.tokenizer else ()))
    )
    self._ids = itertools.count()

  @classmethod
  def from_engine(cls, engine: LLMEngine, *, tokenizer: Tokenizer | None = None, model: str = "engine") -> LLM:
    """An ``LLM`` over an engine built elsewhere (``jaxkv serve`` builds it from the command line)."""
    llm = cls.__new__(cls)
    llm.model, llm.model_config, llm.tokenizer, llm.engine = model, None, tokenizer, engine
    llm.dtype = engine.runner.dtype
    config_eos = getattr(getattr(engine.runner, "config", None), "eos_token_id", ())
    llm.eos_token_ids = tuple(dict.fromkeys(tuple(config_eos) + (tokenizer.eos_token_ids if tokenizer else ())))
    llm._ids = itertools.count()
    return llm

  # -- prompts ---------------------------------------------------------------------------------

  def _prompt(self, prompt) -> tuple[str | None, list[int]]:
    """(text, token ids) of one prompt: a string, a list of token ids, or ``{"prompt_token_ids":
    [...]}`` / ``{"prompt": "..."}`` (vLLM's TokensPrompt / TextPrompt)."""
    if isinstance(prompt, dict):
      if "prompt_token_ids" in prompt:
        return None, list(prompt["prompt_token_ids"])
      prompt = prompt.get("prompt")
    if isinstance(prompt, str):
      if self.tokenizer is None:
        raise ValueError(
          f"text prompts need a tokenizer; {self.model} has no tokenizer.json: pass token ids, or LLM(tokenizer=DIR)."
        )
      return prompt, self.tokenizer.encode(prompt)
    if isinstance(prompt, Sequence) and all(is_int(t) for t in prompt):
      return None, [int(t) for t in prompt]
    raise ValueError(
      f"a prompt is a string, a list of token ids or a dict with 'prompt' or 'prompt_token_ids', "
      f"got {type(prompt).__name__} {prompt!r:.80}."
    )

  def _prompts(self, prompts) -> list[tuple[str | None, list[int]]]:
    single = isinstance(prompts, (str, dict)) or (
      isinstance(prompts, Sequence) and prompts and all(is_int(t) for t in prompts)
    )
    return [self._prompt(p) for p in ([prompts] if single else list(prompts))]

  # -- generation ------------------------------------------------------------------------------

  def add_request(self, prompt, sampling: SamplingParams, request_id: str | None = None):
    """Queues one prompt (``n`` engine requests); returns its ``RequestOutput`` (filled by
    ``step_outputs``) and the sequences' states, keyed by engine request id."""
    text, ids = self._prompt(prompt)
    request_id = request_id or f"cmpl-{next(self._ids)}"
    states = {f"{request_id}-{i}": SequenceState(i, sampling, self.tokenizer) for i in range(sampling.n)}
    params = [engine_params(sampling, i, self.eos_token_ids) for i in range(sampling.n)]
    for (rid, _), p in zip(states.items(), params):  # all checked before any is admitted
      self.engine._check_request(rid, ids, p)
    for (rid, _), p in zip(states.items(), params):
      self.engine.add_request(rid, ids, p)
    output = RequestOutput(request_id, text, ids, [s.output for s in states.values()])
    return output, states

  def generate(
    self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *, use_tqdm: bool = False
  ) -> list[RequestOutput]:
    """Runs prompts to completion; one ``RequestOutput`` per prompt, in order."""
    parsed = self._prompts(prompts)
    sampling_params = SamplingParams() if sampling_params is None else sampling_params
    params = list(sampling_params) if isinstance(sampling_params, Sequence) else [sampling_params] * len(parsed)
    if len(params) != len(parsed):
      raise ValueError(f"{len(params)} SamplingParams for {len(parsed)} prompts.")
    outputs, states = [], {}
    for (text, ids), sp in zip(parsed, params):
      out, seq = self.add_request({"prompt_token_ids": ids}, sp)
      out.prompt = text
      outputs.append(out)
      states.update({rid: (out, s) for rid, s in seq.items()})
    bar = None
    if use_tqdm:
      from tqdm.auto import tqdm

      bar = tqdm(total=len(states), desc="generating", unit="seq", file=sys.stderr)
    while self.engine.has_unfinished():
      for step in self.engine.step():
        out, state = states.get(step.request_id, (None, None))
        if state is None or state.finished:
          continue
        state.add(step)
        if step.prompt_logprobs is not None and state.output.index == 0:
          out.prompt_logprobs = prompt_logprob_dicts(step.prompt_logprobs, self.tokenizer)
        if step.num_cached_tokens and state.output.index == 0:
          out.num_cached_tokens = step.num_cached_tokens
        if state.finished:
          if not step.finished:
            self.engine.abort(step.request_id)  # a stop string: the engine need not go on
          if bar is not None:
            bar.update(1)
    if bar is not None:
      bar.close()
    self.engine.wait_for_save()
    for out in outputs:
      out.finished = all(o.finish_reason is not None for o in out.outputs)
    return outputs

  def chat(self, messages: Sequence[dict], sampling_params: SamplingParams | None = None) -> RequestOutput:
    """One conversation, rendered with the tokenizer's chat template, answered."""
    if self.tokenizer is None:
      raise ValueError(f"chat needs a tokenizer with a chat template; {self.model} has none.")
    return self.generate(self.tokenizer.apply_chat_template(messages), sampling_params)[0]
