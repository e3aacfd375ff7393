"""Requests, sampling parameters and outputs of the engine."""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence

import numpy as np

__all__ = ["SamplingParams", "Request", "RequestStatus", "StepOutput", "PromptLogprob", "MAX_LOGPROBS"]

MAX_LOGPROBS = 20


@dataclasses.dataclass(frozen=True)
class PromptLogprob:
  """A prompt token's log-probability given the tokens before it, its rank among the vocabulary
  (1: most probable) and the ``prompt_logprobs`` most probable candidates as (id, log-prob)."""

  token_id: int
  logprob: float
  rank: int
  top: list[tuple[int, float]]


def is_int(value) -> bool:
  """A Python or NumPy integer, not a bool (``True`` is no token id)."""
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How a request samples, with vLLM's names.

  Attributes:
    max_tokens: tokens to generate at most.
    temperature: 0 for greedy (the default here; vLLM's is 1.0).
    top_p: nucleus sampling mass (1.0: off).
    top_k: sample among the ``top_k`` most probable tokens (0 or -1: off).
    seed: per-request seed; the token at output index ``i`` uses ``fold_in(key(seed), i)``, so
      results do not depend on batch composition. None: fresh entropy for each request.
    stop_token_ids: generation ends after emitting one of these (any sequence of ids).
    stop: strings that end generation, not included in the text (``jaxkv.LLM``: they need the
      tokenizer; the token-level engine refuses them).
    logprobs: top-k log-probabilities to return per generated token (None or 0 to 20).
    n: output sequences per prompt (``jaxkv.LLM`` runs them as requests seeded ``seed + i``).
    prompt_logprobs: top-k log-probabilities of each prompt token after the first, with the
      prompt token's own (None: off; 0 to 20). Such a request computes its whole prompt (no
      prefix-cache hit, as in vLLM) in steps that also run the LM head over every prompt token.
  """

  max_tokens: int = 16
  temperature: float = 0.0
  top_p: float = 1.0
  top_k: int = 0
  seed: int | None = None
  stop_token_ids: Sequence[int] = ()
  stop: str | Sequence[str] = ()
  logprobs: int | None = None
  n: int = 1
  prompt_logprobs: int | None = None

  def __post_init__(self):
    # Normalized forms: any sequence of ids or strings, None as "off".
    if isinstance(self.stop_token_ids, Sequence) and not isinstance(self.stop_token_ids, (str, bytes)):
      object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
    if isinstance(self.stop, str):
      object.__setattr__(self, "stop", (self.stop,))
    elif isinstance(self.stop, Sequence):
      object.__setattr__(self, "stop", tuple(self.stop))
    if self.logprobs is None:
      object.__setattr__(self, "logprobs", 0)
    if is_int(self.top_k) and self.top_k == -1:
      object.__setattr__(self, "top_k", 0)
    for name in ("max_tokens", "logprobs", "top_k", "n") + (
      ("prompt_logprobs",) if self.prompt_logprobs is not None else ()
    ):
      if not is_int(getattr(self, name)):
        raise ValueError(f"{name} must be an integer, got {getattr(self, name)!r}.")
    for name in ("temperature", "top_p"):
      value = getattr(self, name)
      if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number, got {value!r}.")
    if self.max_tokens < 1:
      raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}.")
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}.")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
    if self.top_k < 0:
      raise ValueError(f"top_k must be 0 or -1 (off) or a number of tokens >= 1, got {self.top_k}.")
    if self.n < 1:
      raise ValueError(f"n must be >= 1, got {self.n}.")
    if not 0 <= self.logprobs <= MAX_LOGPROBS:
      raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}.")
    if self.seed is not None and not (is_int(self.seed) and 0 <= self.seed < 2**31):  # an int32 key
      raise ValueError(f"seed must be None or an integer in [0, 2**31), got {self.seed!r}.")
    if not isinstance(self.stop_token_ids, tuple) or not all(is_int(t) for t in self.stop_token_ids):
      raise ValueError(f"stop_token_ids must be a sequence of integer token ids, got {self.stop_token_ids!r}.")
    if not isinstance(self.stop, tuple) or not all(isinstance(t, str) and t for t in self.stop):
      raise ValueError(f"stop must be a string or a sequence of non-empty strings, got {self.stop!r}.")
    if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
      raise ValueError(f"prompt_logprobs must be None or in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}.")


class RequestStatus(enum.Enum):
  WAITING = enum.auto()
  RUNNING = enum.auto()
  FINISHED = enum.auto()
  ABORTED = enum.auto()


@dataclasses.dataclass(eq=False)  # identity: two requests are never "equal"
class Request:
  """Host-side state of one request."""

  request_id: str
  prompt_token_ids: list[int]
  sampling: SamplingParams
  arrival: int
  seed: int = 0  # the sampling seed (``sampling.seed``, or fresh entropy when that is None)
  output_token_ids: list[int] = dataclasses.field(default_factory=list)
  output_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
  # Each output token's own (log-prob, rank), kept when ``sampling.logprobs`` asks for log-probs.
  output_token_logprobs: list[tuple[float, int]] = dataclasses.field(default_factory=list)
  # With ``sampling.prompt_logprobs``: per prompt position from 1, the prompt token's log-prob,
  # its rank (1: most probable) and the top candidates as (id, log-prob).
  prompt_logprobs: list[PromptLogprob] = dataclasses.field(default_factory=list)
  num_computed_tokens: int = 0
  num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when last admitted
  status: RequestStatus = RequestStatus.WAITING
  row: int = -1  # block-table row while running
  num_preemptions: int = 0
  finish_reason: str | None = None
  # Speculative decoding: drafts for the positions after the last token, verified next step, and
  # the KDA state slot the next step continues from (the last one unless drafts were rejected).
  spec_token_ids: list[int] = dataclasses.field(default_factory=list)
  state_slot: int = 0
  # Async scheduling: a token sampled by the step in flight (0 or 1), not read back yet, and the
  # block-table row that step sampled it in (where the next step reads it on the device).
  num_in_flight: int = 0
  in_flight_row: int = -1
  error: str | None = None  # why the request ended with finish reason "error"

  @property
  def all_token_ids(self) -> list[int]:
    """The known tokens: prompt and outputs read back."""
    return self.prompt_token_ids + self.output_token_ids

  def token_ids(self, start: int, stop: int) -> list[int]:
    """Tokens ``[start, stop)`` of prompt, outputs read back and drafts to verify, in that order
    (clipped to what exists), copying only those: a step's host work stays independent of the
    request's length."""
    parts = (self.prompt_token_ids, self.output_token_ids, self.spec_token_ids)
    if start >= stop or start >= len(parts[0]) + len(parts[1]) + len(parts[2]):
      return []  # a decode token in flight, every step of every request: no loop
    out, base = [], 0
    for part in parts:
      lo, hi = max(start - base, 0), min(stop - base, len(part))
      if lo < hi:
        out += part[lo:hi]
      base += len(part)
    return out

  @property
  def num_tokens(self) -> int:
    """Tokens the scheduler counts on, the one in flight included."""
    return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_in_flight

  @property
  def awaits_last_token(self) -> bool:
    """The token in flight is the last this request may emit: nothing more to schedule."""
    return self.num_in_flight > 0 and len(self.output_token_ids) + self.num_in_flight >= self.sampling.max_tokens


@dataclasses.dataclass(slots=True)
class StepOutput:
  """What a step streams for one request: its new tokens (and logprobs) and whether it finished
  (vLLM's ``EngineCoreOutput``; ``jaxkv.LLM`` gathers them into ``RequestOutput``s). Not frozen,
  as vLLM's is not: a frozen dataclass takes 1 us more to make, a request a step on the host."""

  request_id: str
  new_token_ids: list[int]
  new_logprobs: list[list[tuple[int, float]]]
  finished: bool
  finish_reason: str | None = None
  num_cached_tokens: int = 0  # of the prompt, from the prefix cache (vLLM's field)
  # With ``sampling.prompt_logprobs``, on the output with the first new token: every prompt
  # position's entry (``Request.prompt_logprobs``, position 0 has none).
  prompt_logprobs: list[PromptLogprob] | None = None
  # With ``sampling.logprobs``: each new token's own (log-prob, rank), in or out of its top-k.
  new_token_logprobs: list[tuple[float, int]] = dataclasses.field(default_factory=list)
