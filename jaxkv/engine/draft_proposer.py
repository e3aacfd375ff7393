"""Which drafts a speculative step verifies: the engine's draft strategy (vLLM's proposers).

Each step of a speculative engine runs the model's draft head (``ModelRunner.propose_drafts``,
GLM's MTP layer) on the device; the engine's ``DraftProposer`` then decides, per request, the
drafts its next step verifies. Verification accepts a draft only where the target model samples it,
so any proposer leaves greedy outputs unchanged: it only changes how many tokens a step emits.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from jaxkv.engine.request import Request

__all__ = ["DraftProposer", "ModelDraftProposer"]


@runtime_checkable
class DraftProposer(Protocol):
  def propose(self, request: Request, model_drafts: list[int], *, step: int) -> list[int]:
    """The drafts ``request`` verifies next, at most ``len(model_drafts)`` (the room it has left).

    Args:
      request: the request after this step's tokens (``output_token_ids`` includes them).
      model_drafts: the model's draft head's tokens continuing it.
      step: the engine's step count (``LLMEngine.num_steps``).
    """


class ModelDraftProposer:
  """The model's own drafts (the default)."""

  def propose(self, request: Request, model_drafts: list[int], *, step: int) -> list[int]:
    return model_drafts
