"""What ``jaxkv.LLM`` returns, shaped as vLLM's ``vllm.outputs``: one ``RequestOutput`` per prompt,
with a ``CompletionOutput`` per sampled sequence (``SamplingParams.n``)."""

from __future__ import annotations

import dataclasses

__all__ = ["Logprob", "CompletionOutput", "RequestOutput"]


@dataclasses.dataclass(frozen=True)
class Logprob:
  """One candidate's log-probability at a position, its rank (1: most probable) and its text."""

  logprob: float
  rank: int
  decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
  """One generated sequence.

  Attributes:
    index: its index among the prompt's ``n`` sequences.
    text: the detokenized output (a stop string and what follows it are cut).
    token_ids: the generated ids (through the token that completed a stop string).
    logprobs: per generated token, the top ``SamplingParams.logprobs`` candidates as
      ``{token_id: Logprob}`` (None when not asked for).
    finish_reason: ``"stop"`` (a stop string, a stop id or end of sequence), ``"length"``
      (``max_tokens``), ``"abort"`` or ``"error"``; None while running.
    stop_reason: the stop string or stop id that ended it (None: end of sequence, or not stopped).
  """

  index: int
  text: str
  token_ids: list[int]
  logprobs: list[dict[int, Logprob]] | None = None
  finish_reason: str | None = None
  stop_reason: int | str | None = None

  def finished(self) -> bool:
    return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
  """A prompt and its outputs.

  Attributes:
    request_id, prompt (None when given as token ids), prompt_token_ids.
    outputs: one ``CompletionOutput`` per sequence.
    finished: every sequence has finished.
    num_cached_tokens: prompt tokens found in the prefix cache (of the first sequence).
    prompt_logprobs: with ``SamplingParams.prompt_logprobs``: None for the first prompt token,
      then per prompt token ``{token_id: Logprob}``, the prompt token first (with its rank among
      the vocabulary), then the top candidates (None when not asked for).
  """

  request_id: str
  prompt: str | None
  prompt_token_ids: list[int]
  outputs: list[CompletionOutput]
  finished: bool = False
  num_cached_tokens: int = 0
  prompt_logprobs: list[dict[int, Logprob] | None] | None = None
