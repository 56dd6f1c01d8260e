"""The offline API: `LLM(model=...).generate(prompts, params)`, as vLLM users know it."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence as Seq
from typing import NotRequired, TypedDict, cast

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.tokenizer import ChatMessage, Tokenizer


class TextPrompt(TypedDict):
    prompt: str
    cache_salt: NotRequired[str]  # prefix-cache hits only among prompts of the same salt


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    cache_salt: NotRequired[str]


Prompt = str | TextPrompt | TokensPrompt


class LLM:
    """Runs batches of prompts to completion with continuous batching."""

    def __init__(
        self,
        model: str,
        *,
        dtype: str = "auto",
        quantization: str = "auto",
        device: str = "auto",
        block_size: int = 16,
        kv_cache_dtype: str = "auto",
        enable_prefix_caching: bool = True,
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        max_num_prefill_only_tokens: int | None = 2048,
        num_kv_blocks: int | None = None,
        cpu_kv_cache_gib: float = 2.0,
        gpu_memory_utilization: float = 0.9,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
    ):
        self.engine = LLMEngine(
            EngineConfig(
                model=model,
                dtype=dtype,
                quantization=quantization,
                device=device,
                block_size=block_size,
                kv_cache_dtype=kv_cache_dtype,
                enable_prefix_caching=enable_prefix_caching,
                max_model_len=max_model_len,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_prefill_only_tokens=max_num_prefill_only_tokens,
                num_kv_blocks=num_kv_blocks,
                cpu_kv_cache_gib=cpu_kv_cache_gib,
                gpu_memory_utilization=gpu_memory_utilization,
                tensor_parallel_size=tensor_parallel_size,
                pipeline_parallel_size=pipeline_parallel_size,
            )
        )
        self._request_ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the parallel workers now rather than at exit."""
        self.engine.shutdown()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One finished output per prompt, in the prompts' order. A bad prompt raises before
        any request runs."""
        prompt_list = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        params_list = _params_per_prompt(sampling_params, len(prompt_list))
        request_ids = [f"offline-{next(self._request_ids)}" for _ in prompt_list]
        try:
            for request_id, prompt, params in zip(
                request_ids, prompt_list, params_list, strict=True
            ):
                salt = None if isinstance(prompt, str) else prompt.get("cache_salt")
                self.engine.add_request(request_id, _prompt_input(prompt), params, cache_salt=salt)
            finished: dict[str, RequestOutput] = {}
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
        finally:
            self.engine.abort_request(request_ids)
        return [finished[request_id] for request_id in request_ids]

    def chat(
        self,
        messages: list[ChatMessage] | list[list[ChatMessage]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate."""
        conversations = cast(
            list[list[ChatMessage]],
            messages if messages and isinstance(messages[0], list) else [messages],
        )
        tokenizer = self.engine.tokenizer
        prompts: list[Prompt] = [
            tokenizer.render_chat(c, add_generation_prompt=add_generation_prompt)
            for c in conversations
        ]
        return self.generate(prompts, sampling_params)


def _prompt_input(prompt: Prompt) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if "prompt_token_ids" in prompt:
        return list(cast(TokensPrompt, prompt)["prompt_token_ids"])
    return cast(TextPrompt, prompt)["prompt"]


def _params_per_prompt(
    params: SamplingParams | Seq[SamplingParams] | None, num_prompts: int
) -> list[SamplingParams]:
    if params is None:
        params = SamplingParams()
    if isinstance(params, SamplingParams):
        params = [params] * num_prompts
    if len(params) != num_prompts:
        raise ValueError(f"{len(params)} sampling params for {num_prompts} prompts")
    # Offline callers want one output per request; copies leave the caller's objects as they were.
    return [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params]
