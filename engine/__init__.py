"""Meridian's inference engine: paged KV cache, prefix caching, continuous batching."""

from engine.llm import LLM, TextPrompt, TokensPrompt
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "TextPrompt",
    "TokensPrompt",
]
