"""From the engine's token stream to text: one ``SequenceState`` per sequence detokenizes
incrementally, cuts at stop strings (withholding, while streaming, text that could still become
one) and builds the ``CompletionOutput`` (vLLM's ``OutputProcessor`` and ``Detokenizer``)."""

from __future__ import annotations

import dataclasses

from jaxkv.engine.request import PromptLogprob, SamplingParams, StepOutput
from jaxkv.outputs import CompletionOutput, Logprob
from jaxkv.tokenizer import Tokenizer

__all__ = ["SequenceState", "engine_params", "prompt_logprob_dicts"]


def engine_params(sampling: SamplingParams, index: int, eos_token_ids: tuple[int, ...]) -> SamplingParams:
  """The engine's parameters of sequence ``index`` of a request: one sequence, seeded ``seed +
  index`` (fresh entropy each when the seed is None), stopping at the end-of-sequence ids too;
  stop strings are this layer's; the prompt's log-probs are the first sequence's to compute."""
  seed = None if sampling.seed is None else (sampling.seed + index) % 2**31
  stops = sampling.stop_token_ids + tuple(t for t in eos_token_ids if t not in sampling.stop_token_ids)
  prompt_logprobs = sampling.prompt_logprobs if index == 0 else None
  return dataclasses.replace(sampling, n=1, stop=(), seed=seed, stop_token_ids=stops, prompt_logprobs=prompt_logprobs)


def prompt_logprob_dicts(entries: list[PromptLogprob], tokenizer: Tokenizer | None) -> list[dict[int, Logprob] | None]:
  """vLLM's ``RequestOutput.prompt_logprobs``: None for the first prompt token, then per token
  ``{token_id: Logprob}`` with the prompt token first and the top candidates."""
  return [None] + [_logprob_dict(e.token_id, e.logprob, e.rank, e.top, tokenizer) for e in entries]


def _logprob_dict(
  token_id: int, logprob: float, rank: int, top: list[tuple[int, float]], tokenizer: Tokenizer | None
) -> dict[int, Logprob]:
  """vLLM's order: the token itself (with its rank, in the top candidates or not), then the top."""

  def text(t):
    return None if tokenizer is None else tokenizer.decode([t], skip_special_tokens=False)

  out = {token_id: Logprob(logprob, rank, text(token_id))}
  for r, (t, lp) in enumerate(top, 1):
    out.setdefault(t, Logprob(lp, r, text(t)))
  return out


class SequenceState:
  """One sequence's output as the engine streams it."""

  def __init__(self, index: int, sampling: SamplingParams, tokenizer: Tokenizer | None):
    self.sampling = sampling
    self.tokenizer = tokenizer
    self.output = CompletionOutput(index, "", [], [] if sampling.logprobs else None)
    self._detok = tokenizer.detokenizer() if tokenizer is not None else None
    self._text = ""  # everything decoded (before a stop string's cut)
    self._sent = 0  # characters of output.text already streamed
    self._hold = max((len(s) for s in sampling.stop), default=1) - 1

  @property
  def finished(self) -> bool:
    return self.output.finish_reason is not None

  def add(self, step: StepOutput) -> tuple[str, list[int]]:
    """Takes a step's new tokens; returns the text and token ids to stream now. After a stop
    string the sequence is finished (the caller aborts the engine's request)."""
    if self.finished:
      return "", []
    out = self.output
    new_ids = []
    for i, token in enumerate(step.new_token_ids):
      new_ids.append(token)
      out.token_ids.append(token)
      if out.logprobs is not None and i < len(step.new_logprobs):
        lp, rank = step.new_token_logprobs[i]
        out.logprobs.append(_logprob_dict(token, lp, rank, step.new_logprobs[i], self.tokenizer))
      if self._detok is not None:
        start = max(len(self._text) - self._hold, 0)
        self._text += self._detok.step(token)
        hit = self._find_stop(start)
        if hit is not None:
          at, stop = hit
          self._text = self._text[:at]
          out.finish_reason, out.stop_reason = "stop", stop
          break
    if not self.finished and step.finished:
      out.finish_reason = step.finish_reason
      if step.finish_reason == "stop" and out.token_ids and out.token_ids[-1] in self.sampling.stop_token_ids:
        out.stop_reason = out.token_ids[-1]  # a stop id the user asked for (end of sequence: None)
    # While running, hold back what could be the start of a stop string.
    ready = len(self._text) if self.finished else max(len(self._text) - self._hold, self._sent)
    out.text = self._text[:ready]
    delta = out.text[self._sent :]
    self._sent = ready
    return delta, new_ids

  def _find_stop(self, start: int) -> tuple[int, str] | None:
    hits = [(at, s) for s in self.sampling.stop if (at := self._text.find(s, start)) >= 0]
    return min(hits) if hits else None
