"""Text in and out: a checkpoint's ``tokenizer.json`` read by HF's ``tokenizers`` library, its chat
template rendered with jinja2 as HF transformers renders it, and incremental detokenization for
streams (``tokenizers``' ``DecodeStream``, which vLLM's fast detokenizer uses too).

Files are parsed, never executed: ``tokenizer.json`` and ``tokenizer_config.json`` are JSON, and the
chat template runs in jinja2's immutable sandbox.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence

__all__ = ["Tokenizer", "IncrementalDetokenizer", "builtin_tokenizer_dir"]

_DATA = pathlib.Path(__file__).resolve().parent / "data"


def builtin_tokenizer_dir(config_name: str) -> pathlib.Path | None:
  """The directory of the tokenizer shipped with a built-in config (None: none is shipped)."""
  path = _DATA / config_name
  return path if (path / "tokenizer.json").is_file() else None


class Tokenizer:
  """A checkpoint's tokenizer: ``encode``, ``decode``, the special tokens and the chat template.

  Attributes:
    eos_token_ids: ids that end generation (the ``eos_token`` of ``tokenizer_config.json``).
    vocab_size: the tokenizer's vocabulary, special tokens included.
  """

  def __init__(self, path: str | pathlib.Path):
    try:
      from tokenizers import Tokenizer as HFTokenizer
    except ImportError as e:  # a dependency of jaxkv: only a broken install lacks it
      raise RuntimeError("jaxkv's text needs the tokenizers package: pip install tokenizers") from e
    self.path = pathlib.Path(path)
    file = self.path / "tokenizer.json"
    if not file.is_file():
      raise ValueError(f"{self.path} has no tokenizer.json: pass token ids, or a checkpoint directory with one.")
    try:
      self._tok = HFTokenizer.from_file(str(file))
    except Exception as e:  # the library's parse errors are plain Exceptions
      raise ValueError(f"{file} is not a tokenizer.json the tokenizers library can read: {e}") from e
    config_file = self.path / "tokenizer_config.json"
    try:
      config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    except ValueError as e:
      raise ValueError(f"{config_file} is not valid JSON: {e}") from e
    self.chat_template: str | None = config.get("chat_template")
    self.bos_token = _token_text(config.get("bos_token"))
    self.eos_token = _token_text(config.get("eos_token"))
    eos_id = None if self.eos_token is None else self._tok.token_to_id(self.eos_token)
    self.eos_token_ids: tuple[int, ...] = () if eos_id is None else (eos_id,)
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
    if not isinstance(text, str):
      raise ValueError(f"a prompt must be a string here, got {type(text).__name__} {text!r}.")
    return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
    return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

  def id_to_token(self, token_id: int) -> str | None:
    return self._tok.id_to_token(int(token_id))

  def apply_chat_template(self, messages: Sequence[dict], *, add_generation_prompt: bool = True) -> str:
    """The prompt text of a conversation, as HF transformers' ``apply_chat_template`` renders it:
    jinja2's immutable sandbox, ``trim_blocks`` and ``lstrip_blocks``, ``raise_exception`` and
    ``tojson``."""
    if not self.chat_template:
      raise ValueError(f"{self.path}/tokenizer_config.json has no chat_template: send a completion prompt instead.")
    for i, m in enumerate(messages):
      if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
        raise ValueError(f"message {i} must be an object with string 'role' and 'content', got {m!r}.")
    return _compiled(self.chat_template).render(
      messages=list(messages),
      add_generation_prompt=add_generation_prompt,
      bos_token=self.bos_token or "",
      eos_token=self.eos_token or "",
    )

  def detokenizer(self, *, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)


def _token_text(value) -> str | None:
  """A special token of tokenizer_config.json: a string, or HF's AddedToken form ``{"content": ...}``."""
  if isinstance(value, dict):
    value = value.get("content")
  return value if isinstance(value, str) else None


_TEMPLATES: dict[str, object] = {}


def _compiled(source: str):
  if source not in _TEMPLATES:
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
      raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    _TEMPLATES[source] = env.from_string(source)
  return _TEMPLATES[source]


class IncrementalDetokenizer:
  """Text of a token stream, piece by piece: ``step(id)`` returns the text the id completes (""
  while a multi-token character is incomplete). The pieces joined are ``decode(ids)``."""

  def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True):
    from tokenizers.decoders import DecodeStream

    self._tok = tokenizer._tok
    self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
    self.text = ""

  def step(self, token_id: int) -> str:
    piece = self._stream.step(self._tok, int(token_id)) or ""
    self.text += piece
    return piece
