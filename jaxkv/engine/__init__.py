"""The decode engine: continuous batching, chunked prefill, preemption, sampling, jitted steps."""

from jaxkv.engine.draft_proposer import DraftProposer, ModelDraftProposer
from jaxkv.engine.engine import EngineConfig, LLMEngine
from jaxkv.engine.model_runner import MODEL_REGISTRY, ModelFamily, ModelRunner, get_model_family, plan_for
from jaxkv.engine.parallel import make_mesh, replicated
from jaxkv.engine.request import MAX_LOGPROBS, PromptLogprob, Request, RequestStatus, SamplingParams, StepOutput
from jaxkv.engine.sampler import sample
from jaxkv.engine.scheduler import ScheduledChunk, Scheduler
from jaxkv.engine.step_executor import StepExecutor, lower_step

__all__ = [
  "EngineConfig",
  "LLMEngine",
  "StepExecutor",
  "lower_step",
  "DraftProposer",
  "ModelDraftProposer",
  "MODEL_REGISTRY",
  "ModelFamily",
  "ModelRunner",
  "get_model_family",
  "plan_for",
  "make_mesh",
  "replicated",
  "MAX_LOGPROBS",
  "Request",
  "StepOutput",
  "PromptLogprob",
  "RequestStatus",
  "SamplingParams",
  "ScheduledChunk",
  "Scheduler",
  "sample",
]
