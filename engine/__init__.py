"""Meridian's inference engine: paged KV cache, prefix caching, continuous batching.

The names below load on first use, so that a process needing only the engine's tokenizer and
prefix hashes (the region picker) does not import torch with them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.llm import LLM, TextPrompt, TokensPrompt
    from engine.outputs import CompletionOutput, RequestOutput
    from engine.sampling_params import RequestOutputKind, SamplingParams

_MODULE_OF = {
    "LLM": "engine.llm",
    "TextPrompt": "engine.llm",
    "TokensPrompt": "engine.llm",
    "CompletionOutput": "engine.outputs",
    "RequestOutput": "engine.outputs",
    "RequestOutputKind": "engine.sampling_params",
    "SamplingParams": "engine.sampling_params",
}

__all__ = [
    "LLM",
    "CompletionOutput",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "TextPrompt",
    "TokensPrompt",
]


def __getattr__(name: str) -> object:
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_MODULE_OF[name]), name)
