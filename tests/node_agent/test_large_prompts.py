"""A multi-megabyte prompt (text or token ids) to a live node agent: refused as too long, while
the event loop that answers probes and sends heartbeats keeps answering."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from node_helpers import MODEL_NAME, NodeHandle

# 4 MB, about 900,000 tokens: what stalled a node's loop for seconds when it was encoded there.
BIG_TEXT = " The quick brown fox jumps over the lazy dog." * 90_000
# 2 MB of token ids, which stalled it for a second while their text was checked for surrogates.
BIG_IDS = [5] * 600_000
# Under those stalls a probe waited a second or more; a loaded CI machine has taken 0.6 s for a
# probe that overlapped the body's own parse.
MAX_PROBE_S = 0.8


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": BIG_TEXT}, "prompt"),
        ("/v1/completions", {"prompt": BIG_IDS}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": BIG_TEXT}]}, "messages"),
    ],
)
def test_a_multi_megabyte_prompt_is_refused_while_health_keeps_answering(
    node: NodeHandle, path: str, body: dict[str, object], param: str
) -> None:
    probe_s: list[float] = []
    with ThreadPoolExecutor(1) as pool, node.client() as probe:
        big = pool.submit(
            httpx.post, node.base_url + path, json={"model": MODEL_NAME, **body}, timeout=60.0
        )
        while not probe_s or not big.done():
            started_s = time.monotonic()
            assert probe.get("/health").status_code == 200
            probe_s.append(time.monotonic() - started_s)
        response = big.result()
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", param)
    assert max(probe_s) < MAX_PROBE_S, f"/health took {max(probe_s):.2f} s at worst"
