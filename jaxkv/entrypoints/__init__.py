"""vLLM-shaped entry points: the offline ``LLM`` and the OpenAI-compatible server (``jaxkv serve``)."""

from jaxkv.entrypoints.llm import LLM

__all__ = ["LLM"]
