"""The engine core in its own process: aborts cross to it, its death fails requests and the
node's health, and it never outlives the node agent that started it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from contextlib import aclosing
from pathlib import Path

import httpx
import psutil
import pytest
from node_helpers import (
    MODEL_NAME,
    BackgroundLoop,
    NodeHandle,
    engine_idle,
    free_port,
    is_ready_at,
    node_agent_command,
    start_engine,
    start_node,
    wait_until,
)

from engine.async_engine import AsyncEngine
from engine.core_client import EngineCoreClient
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

MAX_TOKENS = 600
LONG = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
WITHIN_S = 5.0
NODE_START_TIMEOUT_S = 300.0  # a model load in two processes, on a loaded machine


def test_closing_a_stream_aborts_the_request_inside_the_core(
    shared_llm: AsyncEngine, server_loop: BackgroundLoop, real_node: NodeHandle
) -> None:
    assert isinstance(shared_llm, EngineCoreClient)
    assert shared_llm.process.pid != os.getpid()
    assert wait_until(lambda: engine_idle(real_node))

    async def first_token_then_leave() -> int:
        async with aclosing(shared_llm.generate([1, 2, 3], LONG, "leaves-early")) as stream:
            async for output in stream:
                return len(output.outputs[0].token_ids)
        return 0

    assert server_loop.run(first_token_then_leave()) >= 1
    assert wait_until(lambda: engine_idle(real_node), timeout_s=WITHIN_S)


def test_an_abort_ends_the_stream_with_finish_reason_abort(
    shared_llm: AsyncEngine, server_loop: BackgroundLoop, real_node: NodeHandle
) -> None:
    async def abort_after_first_output() -> tuple[int, str | None, list[int]]:
        num_outputs, last = 0, None
        async for output in shared_llm.generate([4, 5, 6], LONG, "aborted"):
            num_outputs += 1
            last = output
            if num_outputs == 1:
                shared_llm.abort("aborted")
        assert last is not None
        return num_outputs, last.outputs[0].finish_reason, last.prompt_token_ids

    num_outputs, reason, prompt_ids = server_loop.run(abort_after_first_output())
    assert reason == "abort" and num_outputs < MAX_TOKENS
    assert prompt_ids == [4, 5, 6]  # the front restores what the core does not send back
    assert wait_until(lambda: engine_idle(real_node), timeout_s=WITHIN_S)


@pytest.fixture
def doomed_node(smollm2_gguf: Path, server_loop: BackgroundLoop) -> Iterator[NodeHandle]:
    """A node agent over an engine core of its own, which the test kills."""
    llm = start_engine(server_loop, smollm2_gguf)
    handle = start_node(server_loop, llm)
    yield handle
    handle.stop()
    server_loop.run(llm.shutdown())
    assert isinstance(llm, EngineCoreClient) and not llm.process.is_alive()


def test_a_killed_core_fails_streams_and_the_node_reports_unhealthy(
    doomed_node: NodeHandle,
) -> None:
    llm = doomed_node.runtime.llm
    assert isinstance(llm, EngineCoreClient)
    body = {
        "model": MODEL_NAME,
        "prompt": "Count: one, two,",
        "stream": True,
        "max_tokens": 600,
        "ignore_eos": True,
    }
    with doomed_node.client() as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = (line for line in response.iter_lines() if line)
            assert next(lines).startswith("data: {")
            assert llm.process.pid is not None
            os.kill(llm.process.pid, signal.SIGKILL)
            rest = list(lines)  # the stream must end, not hang
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2].removeprefix("data: "))["error"]
        assert "engine core process exited" in error["message"]
        assert error["code"] == "engine_dead"
        assert http.get("/health").status_code == 503
        assert http.get("/ready").json()["reason"] == "the engine has stopped"
        refused = http.post("/v1/completions", json=body | {"stream": False})
        assert refused.status_code == 503
    beat = doomed_node.runtime.heartbeat()
    assert beat is not None and beat.draining


def _descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def test_the_core_and_its_workers_exit_when_the_node_agent_is_killed(smollm2_gguf: Path) -> None:
    # Two pipeline stages: the core starts a parallel worker of its own, which must go too.
    port = free_port()
    command = node_agent_command(
        smollm2_gguf,
        port,
        *("--num-kv-blocks", "64", "--pipeline-parallel-size", "2", "--engine-process"),
        *("--log-level", "WARNING"),
    )
    env = os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    agent = subprocess.Popen(command, env=env)
    try:
        base_url = f"http://127.0.0.1:{port}"
        assert wait_until(
            lambda: agent.poll() is not None or is_ready_at(base_url),
            timeout_s=NODE_START_TIMEOUT_S,
            step_s=0.2,
        )
        assert agent.poll() is None, "the node agent exited before it was ready"
        body = {"model": MODEL_NAME, "prompt": "One, two,", "max_tokens": 4, "temperature": 0}
        served = httpx.post(base_url + "/v1/completions", json=body, timeout=120)
        assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 4
        children = _descendants(agent.pid)
        spawned = [p for p in children if "spawn_main" in " ".join(p.cmdline())]
        assert len(spawned) == 2  # the core, and the worker it started
        agent.send_signal(signal.SIGKILL)
        agent.wait(10)
        _, alive = psutil.wait_procs(children, timeout=WITHIN_S + 5.0)
        assert not alive, f"left behind: {[p.cmdline() for p in alive]}"
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
