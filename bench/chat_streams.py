"""Streamed chat completions read as a client sees them, for the benchmarks and tests that judge
a stream by its chunks: its text, its ids, the gaps between chunks and the resume marker."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

# What the long greedy streams write about: one essay prompt each, all different.
TOPICS = [
    "robots",
    "the sea",
    "a city",
    "winter",
    "music",
    "trains",
    "bees",
    "the moon",
    "a garden",
    "coffee",
    "mountains",
    "a library",
    "rain",
    "a bridge",
    "birds",
    "fire",
]


@dataclass
class StreamResult:
    region: str = ""  # where the stream began (`x-meridian-region`)
    text: str = ""
    ids: set[str] = field(default_factory=set)
    chunk_times_s: list[float] = field(default_factory=list)  # content chunks, monotonic
    num_resumes: int = 0  # the final chunk's `meridian_resumes`
    error: str | None = None  # an error event's message, or the refusal's status

    @property
    def max_gap_s(self) -> float:
        """The longest wait between two content chunks (the wait for the first one is TTFT)."""
        times = self.chunk_times_s
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)

    def gap_after_s(self, at_s: float) -> float | None:
        """From `at_s` to the first chunk after it (None if none came after)."""
        later = [t for t in self.chunk_times_s if t > at_s]
        return later[0] - at_s if later else None


async def read_stream(
    client: httpx.AsyncClient,
    body: dict[str, object],
    result: StreamResult,
    on_chunk: Callable[[], None] = lambda: None,
) -> None:
    """POST one streamed chat completion and record what arrives in `result`."""
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            result.error = f"HTTP {response.status_code}"
            return
        result.region = response.headers.get("x-meridian-region", "")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[6:])
            if "error" in payload:
                result.error = payload["error"]["message"]
                continue
            result.ids.add(payload["id"])
            result.num_resumes = max(result.num_resumes, payload.get("meridian_resumes", 0))
            text = "".join(c["delta"].get("content") or "" for c in payload["choices"])
            if text:
                result.chunk_times_s.append(time.monotonic())
                result.text += text
                on_chunk()


async def read_streams(
    client: httpx.AsyncClient,
    bodies: list[dict[str, object]],
    progress: tuple[int, Callable[[list[StreamResult]], None]] | None = None,
) -> list[StreamResult]:
    """Every stream at once; `progress` = (n, callback): the callback is called once, with the
    results so far, when each stream has had n content chunks (where a benchmark or test breaks
    something mid-stream)."""
    results = [StreamResult() for _ in bodies]
    called = False

    def check() -> None:
        nonlocal called
        if progress is None or called:
            return
        if all(len(r.chunk_times_s) >= progress[0] for r in results):
            called = True
            progress[1](results)

    await asyncio.gather(
        *(read_stream(client, b, r, check) for b, r in zip(bodies, results, strict=True))
    )
    return results
