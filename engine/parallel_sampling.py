"""Several choices of one prompt (OpenAI's `n`): one engine request per choice, fanned out and
merged.

Choice i runs as request `{request_id}-{i}` with the seed `seed + i` (a seeded request's choices
are each reproducible and differ from one another). The prompt's KV is computed once: the
scheduler admits a request whose next blocks another request fills in the same step onto those
blocks, and later ones onto the cached blocks (engine/scheduler.py), so every choice after the
first computes only the prompt's last, partial block. Each output carries its choice's index in
`outputs[0].index`; closing the merged stream early aborts every choice still running.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import replace

from engine.async_engine import AsyncEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

# What a choice's pump hands the merge: an output, its failure, or None once it has finished.
_Item = RequestOutput | BaseException | None


def choice_request_id(request_id: str, index: int, num_choices: int) -> str:
    """The engine request id of one choice: the request's own when it is the only one."""
    return request_id if num_choices == 1 else f"{request_id}-{index}"


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index`'s sampling: its own seed stream, `seed + index`."""
    if params.seed is None or index == 0:
        return params
    return replace(params, seed=params.seed + index)


async def generate_choices(
    llm: AsyncEngine,
    prompt_token_ids: list[int],
    params: SamplingParams,
    request_id: str,
    num_choices: int,
    cache_salt: str | None = None,
    resumed_token_ids: list[int] | None = None,
) -> AsyncGenerator[RequestOutput, None]:
    """Every choice's outputs, interleaved as they come, each tagged with its index."""
    if num_choices == 1:
        stream = llm.generate(prompt_token_ids, params, request_id, cache_salt, resumed_token_ids)
        async with aclosing(stream) as outputs:
            async for output in outputs:
                yield output
        return
    queue: asyncio.Queue[_Item] = asyncio.Queue()

    async def pump(index: int) -> None:
        stream = llm.generate(
            prompt_token_ids,
            choice_params(params, index),
            choice_request_id(request_id, index, num_choices),
            cache_salt,
            resumed_token_ids,
        )
        try:
            async with aclosing(stream) as outputs:
                async for output in outputs:
                    output.outputs[0].index = index
                    queue.put_nowait(output)
        except Exception as exc:  # the merge raises it to the consumer
            queue.put_nowait(exc)
        queue.put_nowait(None)

    # Started in index order, so the first choice's request reaches the core first.
    tasks = [asyncio.create_task(pump(index)) for index in range(num_choices)]
    try:
        num_running = num_choices
        while num_running:
            item = await queue.get()
            if item is None:
                num_running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
