"""An engine core process that stops answering (SIGSTOP: alive, its pipe open, silent) is noticed
within seconds: the requests under way fail, new ones get 503, `/health` and `/ready` answer
503 and the heartbeats say the engine is not alive; once it runs again, the node serves again."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fake_control_plane import TOKEN, FakeControlPlane
from node_helpers import (
    MAX_MODEL_LEN,
    MODEL_NAME,
    NUM_KV_BLOCKS,
    BackgroundLoop,
    NodeHandle,
    engine_idle,
    free_port,
    start_node,
    wait_until,
)

from engine.config import EngineConfig
from engine.core_client import EngineCoreClient
from engine.core_liveness import LivenessLimits
from node_agent.runtime import load_engine

pytestmark = pytest.mark.slow

MAX_SILENCE_S = 1.5
NOTICED_WITHIN_S = 15.0  # the silence limit, with room for a loaded machine
STREAM = {
    "model": MODEL_NAME,
    "messages": [{"role": "user", "content": "Count to a thousand."}],
    "stream": True,
    "max_tokens": 600,
    "ignore_eos": True,
}


@pytest.fixture
def control_plane(server_loop: BackgroundLoop) -> Iterator[FakeControlPlane]:
    cp = FakeControlPlane(free_port(), interval_s=0.1)
    server_loop.run(cp.start())
    yield cp
    server_loop.run(cp.stop())


@pytest.fixture
def node_and_core(
    smollm2_gguf: Path, server_loop: BackgroundLoop, control_plane: FakeControlPlane
) -> Iterator[tuple[NodeHandle, int]]:
    """A node agent reporting to `control_plane`, over an engine core of its own, whose pid the
    test may stop; it runs again (and is shut down) whatever the test did."""
    config = EngineConfig(
        model=str(smollm2_gguf), num_kv_blocks=NUM_KV_BLOCKS, max_model_len=MAX_MODEL_LEN
    )
    llm = load_engine(config, separate_process=True, liveness=LivenessLimits(MAX_SILENCE_S, 60.0))
    assert isinstance(llm, EngineCoreClient) and llm.process.pid is not None
    pid = llm.process.pid
    try:
        server_loop.call(llm.start)
        node = start_node(
            server_loop,
            llm,
            control_plane=control_plane.url,
            node_token=TOKEN,
            heartbeat_interval_s=0.1,
        )
        try:
            yield node, pid
        finally:
            os.kill(pid, signal.SIGCONT)
            node.stop()
    finally:
        os.kill(pid, signal.SIGCONT)
        server_loop.run(llm.shutdown())


def last_beat(cp: FakeControlPlane) -> dict[str, object]:
    return cp.beats[-1] if cp.beats else {}


def test_a_stopped_core_fails_its_requests_and_the_node_is_unhealthy_until_it_runs_again(
    node_and_core: tuple[NodeHandle, int], control_plane: FakeControlPlane
) -> None:
    node, core_pid = node_and_core
    assert wait_until(lambda: last_beat(control_plane).get("engine_alive") is True)
    with node.client() as http, http.stream("POST", "/v1/chat/completions", json=STREAM) as stream:
        assert stream.status_code == 200
        lines = (line for line in stream.iter_lines() if line)
        assert '"role"' in next(lines)
        assert '"content"' in next(lines)  # the engine is generating
        os.kill(core_pid, signal.SIGSTOP)
        stopped_s = time.monotonic()
        # A request that comes now waits for the verdict, or is refused after it: a 503.
        answers: list[httpx.Response] = []
        asking = threading.Thread(
            target=lambda: answers.append(
                http.post("/v1/chat/completions", json=STREAM | {"stream": False})
            )
        )
        asking.start()
        rest = list(lines)  # the stream ends, rather than hanging with the core
        took_s = time.monotonic() - stopped_s
        asking.join(NOTICED_WITHIN_S)
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2].removeprefix("data: "))["error"]
    assert error["code"] == "engine_dead"
    assert "the engine core does not answer" in error["message"]
    assert took_s < NOTICED_WITHIN_S
    [answer] = answers
    assert answer.status_code == 503
    assert answer.json()["error"]["type"] and answer.json()["error"]["message"]

    with node.client() as http:
        health, ready = http.get("/health"), http.get("/ready")
        assert health.status_code == ready.status_code == 503
        assert "the engine core does not answer" in ready.json()["reason"]
        refused = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi"})
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "not_ready"
    assert wait_until(lambda: last_beat(control_plane).get("engine_alive") is False)
    assert last_beat(control_plane)["draining"] is False  # it may come back: not a drain

    os.kill(core_pid, signal.SIGCONT)
    node.wait_ready(NOTICED_WITHIN_S)
    assert wait_until(lambda: last_beat(control_plane).get("engine_alive") is True)
    assert wait_until(lambda: engine_idle(node), timeout_s=NOTICED_WITHIN_S)  # aborts arrived
    with node.client() as http:
        served = http.post(
            "/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 3}
        )
        assert served.status_code == 200
