"""Heartbeats to a fake control plane: schema, backoff while it is away, resumption when it is
back; the control plane's drain sequence (drain, consul_deregister, may_exit) and SIGTERM. Over
the fake engine (fake_engine.py), held where a request must still run while the drain goes on."""

from __future__ import annotations

import itertools
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from consul_standin import ConsulStandIn
from fake_control_plane import TOKEN, FakeControlPlane
from fake_engine import FakeEngine
from node_helpers import (
    MAX_MODEL_LEN,
    MODEL_NAME,
    TINY_SERVED_NAME,
    BackgroundLoop,
    FakeNodes,
    NodeHandle,
    free_port,
    start_node,
    tiny_node,
    wait_until,
)

from wire.heartbeat import Heartbeat, ModelIdentity

INTERVAL_S = 0.1
MAX_BACKOFF_S = 0.8


@pytest.fixture
def control_plane(server_loop: BackgroundLoop) -> Iterator[FakeControlPlane]:
    cp = FakeControlPlane(free_port(), interval_s=INTERVAL_S)
    server_loop.run(cp.start())
    yield cp
    server_loop.run(cp.stop())


def reporting(cp: FakeControlPlane, **overrides: Any) -> dict[str, Any]:
    """Settings for a node that beats to `cp` on the tests' short interval."""
    return {
        "control_plane": cp.url,
        "node_token": TOKEN,
        "heartbeat_interval_s": INTERVAL_S,
        "max_heartbeat_backoff_s": MAX_BACKOFF_S,
        "heartbeat_timeout_s": 0.5,
        **overrides,
    }


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


@pytest.mark.slow  # seconds of waiting on timeouts
def test_heartbeats_match_the_schema_back_off_and_resume(
    server_loop: BackgroundLoop, fake_nodes: FakeNodes, control_plane: FakeControlPlane
) -> None:
    _, node = fake_nodes(**reporting(control_plane))
    assert wait_until(lambda: len(control_plane.beats) >= 5)
    for body in control_plane.beats:
        beat = Heartbeat.model_validate(body)
        assert (beat.node_id, beat.region, beat.url) == (
            node.settings.node_id,
            "us-east",
            node.base_url,
        )
        assert beat.model == MODEL_NAME and beat.tp_size == 1
        assert beat.kv_blocks_total == node.stats().kv_blocks_total
        assert beat.block_size == 16 and not beat.draining
        assert beat.num_in_flight == 0
        assert beat.model_identity is None  # attached without its weights' id
    assert control_plane.bad_auth == 0
    assert max(_gaps(control_plane.attempts)) < 5 * INTERVAL_S  # slack for a busy machine

    # The control plane fails: beats back off (with jitter) up to the cap; serving goes on.
    control_plane.status = 503
    failing_from = len(control_plane.attempts)
    with node.client() as http:
        reply = http.post(
            "/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}
        )
        assert reply.status_code == 200
    # Five failures in a row: from the third on, the backoff's ceiling is at its cap.
    assert wait_until(lambda: len(control_plane.attempts) >= failing_from + 6, timeout_s=10)
    gaps = _gaps(control_plane.attempts[failing_from:])
    assert min(gaps[2:]) > 3 * INTERVAL_S, gaps  # the cap with jitter: 0.4 s to 0.8 s
    assert max(gaps) <= MAX_BACKOFF_S + 0.5, gaps

    # It goes away entirely, then comes back on the same port: beats resume promptly.
    server_loop.run(control_plane.stop())
    num_failures = node.heartbeat.num_failures
    assert wait_until(lambda: node.heartbeat.num_failures >= num_failures + 2, timeout_s=5)
    control_plane.status = 200
    num_beats = len(control_plane.beats)
    server_loop.run(control_plane.start())
    assert wait_until(
        lambda: len(control_plane.beats) >= num_beats + 3, timeout_s=MAX_BACKOFF_S + 1.5
    )
    assert node.server.runtime is node.runtime


def test_heartbeats_carry_the_model_identity(
    fake_nodes: FakeNodes, control_plane: FakeControlPlane
) -> None:
    weights_id = "0123456789abcdef" * 2
    fake_nodes(weights_id=weights_id, **reporting(control_plane))
    assert wait_until(lambda: len(control_plane.beats) >= 1)
    beat = Heartbeat.model_validate(control_plane.beats[0])
    assert beat.model_identity == ModelIdentity(
        weights_id=weights_id, context_length=MAX_MODEL_LEN, dtype="fp32", quantization="none"
    )
    assert beat.model_identity.serving_key == f"{weights_id}:none:fp32"


@pytest.mark.slow  # seconds of waiting on timeouts
def test_heartbeats_fail_over_between_control_plane_replicas(
    server_loop: BackgroundLoop, fake_llm: FakeEngine, control_plane: FakeControlPlane
) -> None:
    other = FakeControlPlane(free_port(), interval_s=INTERVAL_S)
    server_loop.run(other.start())
    settings = reporting(control_plane, control_plane=f"{control_plane.url},{other.url}")
    node = start_node(server_loop, fake_llm, **settings)
    try:
        assert wait_until(lambda: len(control_plane.beats) >= 3)
        assert other.beats == []  # the first URL while it answers
        server_loop.run(control_plane.stop())
        stopped_at = len(other.attempts)
        assert wait_until(lambda: len(other.beats) >= stopped_at + 5)
        # The same beat went on to the other replica: no backoff between them.
        assert max(_gaps(other.attempts)) < 5 * INTERVAL_S
        assert node.runtime.control_plane_reachable
        # A refusal that is the control plane's own answer (a bad token) is not a reason to move.
        server_loop.run(control_plane.start())
        other.status = 401
        num_attempts = len(control_plane.attempts)
        assert wait_until(lambda: len(other.attempts) >= stopped_at + 10)
        assert len(control_plane.attempts) == num_attempts
    finally:
        node.stop()
        server_loop.run(other.stop())


def _stream_lines(response: httpx.Response) -> Iterator[str]:
    return (line for line in response.iter_lines() if line)


def test_control_plane_drain_refuses_new_work_finishes_old_and_undrains(
    fake_nodes: FakeNodes, control_plane: FakeControlPlane
) -> None:
    llm, node = fake_nodes(**reporting(control_plane))
    llm.hold(after_tokens=1)
    body = {
        "model": MODEL_NAME,
        "prompt": "Count: one, two,",
        "max_tokens": 30,
        "ignore_eos": True,
        "stream": True,
    }
    try:
        with node.client() as http, http.stream("POST", "/v1/completions", json=body) as stream:
            lines = _stream_lines(stream)
            assert next(lines).startswith("data: {")
            control_plane.drain = True
            assert wait_until(lambda: node.runtime.drain.is_draining, timeout_s=2.0)
            with node.client() as other:
                assert other.get("/ready").status_code == 503
                assert other.get("/health").status_code == 200
                refused = other.post(
                    "/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 1}
                )
                assert refused.status_code == 503
                assert refused.json()["error"]["code"] == "draining"
            assert wait_until(lambda: control_plane.beats[-1]["draining"] is True)
            # The stream admitted before the drain is reported in flight.
            assert wait_until(lambda: control_plane.beats[-1]["num_in_flight"] == 1)
            llm.release()
            rest = list(lines)  # the request admitted before the drain runs to its end
        assert rest[-1] == "data: [DONE]"
        assert '"finish_reason":"length"' in rest[-2]

        control_plane.drain = False
        assert wait_until(lambda: not node.runtime.drain.is_draining, timeout_s=2.0)
        assert wait_until(lambda: control_plane.beats[-1]["draining"] is False)
        with node.client() as http:
            assert http.get("/ready").status_code == 200
    finally:
        node.stop()


@pytest.fixture
def consul_standin(server_loop: BackgroundLoop) -> Iterator[ConsulStandIn]:
    standin = ConsulStandIn(free_port())
    server_loop.run(standin.start())
    yield standin
    server_loop.run(standin.stop())


def _consul_services(standin: ConsulStandIn) -> dict[str, Any]:
    services: dict[str, Any] = httpx.get(
        f"http://{standin.addr}/v1/agent/services", timeout=5
    ).json()
    return services


@pytest.mark.slow  # seconds of waiting on timeouts
def test_drain_sequence_deregisters_from_consul_and_exits_once_idle(
    fake_nodes: FakeNodes, control_plane: FakeControlPlane, consul_standin: ConsulStandIn
) -> None:
    llm, node = fake_nodes(**reporting(control_plane, consul=consul_standin.addr))
    service_id = node.settings.node_id
    assert wait_until(lambda: service_id in _consul_services(consul_standin))

    # drain → consul_deregister → drain: false: out of Consul while drained, back after.
    control_plane.drain = True
    assert wait_until(lambda: node.runtime.drain.is_draining, timeout_s=2.0)
    control_plane.consul_deregister = True
    assert wait_until(lambda: service_id not in _consul_services(consul_standin))
    # Several ticks on, it is not registered again while draining.
    num_beats = len(control_plane.beats)
    assert wait_until(lambda: len(control_plane.beats) >= num_beats + 5)
    assert service_id not in _consul_services(consul_standin)
    control_plane.drain = control_plane.consul_deregister = False
    assert wait_until(lambda: service_id in _consul_services(consul_standin))
    with node.client() as http:
        assert wait_until(lambda: http.get("/ready").status_code == 200)

    body = {
        "model": MODEL_NAME,
        "prompt": "Count: one, two,",
        "max_tokens": 40,
        "ignore_eos": True,
        "stream": True,
    }
    llm.hold(after_tokens=1)
    with node.client() as http, http.stream("POST", "/v1/completions", json=body) as stream:
        lines = _stream_lines(stream)
        assert next(lines).startswith("data: {")
        control_plane.drain = True
        assert wait_until(lambda: node.runtime.drain.is_draining, timeout_s=2.0)
        with node.client() as other:
            refused = other.post(
                "/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 1}
            )
            assert refused.status_code == 503
        control_plane.consul_deregister = True
        assert wait_until(lambda: service_id not in _consul_services(consul_standin))
        control_plane.may_exit = True
        assert wait_until(lambda: node.runtime.drain.may_exit, timeout_s=2.0)
        # Allowed to exit, but not before the stream it holds is done.
        assert node.runtime.admission.num_in_flight == 1 and not node.done.done()
        llm.release()
        rest = list(lines)
    assert rest[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in rest[-2]
    node.done.result(timeout=10)  # the server stopped by itself (exit 0 under __main__)
    assert control_plane.beats[-1]["draining"] is True
    assert control_plane.beats[-1]["num_in_flight"] == 0
    assert service_id not in _consul_services(consul_standin)


def _sigterm(loop: BackgroundLoop, node: NodeHandle) -> None:
    loop.call(lambda: node.server.handle_exit(signal.SIGTERM, None))


def test_sigterm_waits_for_may_exit_while_the_control_plane_is_reachable(
    server_loop: BackgroundLoop, fake_nodes: FakeNodes, control_plane: FakeControlPlane
) -> None:
    _, node = fake_nodes(**reporting(control_plane))
    assert wait_until(lambda: len(control_plane.beats) >= 1)
    _sigterm(server_loop, node)
    assert wait_until(lambda: control_plane.beats[-1]["draining"] is True)
    # Nothing in flight, but no may_exit yet: ten beats on, it is still up.
    num_beats = len(control_plane.beats)
    assert wait_until(lambda: len(control_plane.beats) >= num_beats + 10)
    assert not node.done.done()
    control_plane.drain = True
    control_plane.may_exit = True
    node.done.result(timeout=5)


def test_sigterm_exits_once_idle_when_the_control_plane_is_away(
    server_loop: BackgroundLoop, fake_nodes: FakeNodes, control_plane: FakeControlPlane
) -> None:
    _, node = fake_nodes(**reporting(control_plane))
    assert wait_until(lambda: len(control_plane.beats) >= 1)
    server_loop.run(control_plane.stop())
    assert wait_until(lambda: not node.runtime.control_plane_reachable)
    _sigterm(server_loop, node)
    node.done.result(timeout=5)


def test_sigterm_wait_for_may_exit_is_bounded_by_the_drain_timeout(
    server_loop: BackgroundLoop, fake_nodes: FakeNodes, control_plane: FakeControlPlane
) -> None:
    _, node = fake_nodes(**reporting(control_plane, drain_timeout_s=0.5))
    assert wait_until(lambda: len(control_plane.beats) >= 1)
    _sigterm(server_loop, node)
    node.done.result(timeout=5)
    assert control_plane.beats[-1]["draining"] is True


@pytest.mark.slow  # an engine core process
def test_heartbeats_carry_the_prefill_rate_once_the_engine_has_measured_one(
    server_loop: BackgroundLoop,
    control_plane: FakeControlPlane,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    folder = tmp_path_factory.mktemp("tiny") / "model"
    with tiny_node(server_loop, folder, **reporting(control_plane)) as node:
        assert wait_until(lambda: len(control_plane.beats) >= 1)
        assert Heartbeat.model_validate(control_plane.beats[-1]).prefill_tokens_per_s is None
        with node.client() as http:
            reply = http.post(
                "/v1/completions",
                json={
                    "model": TINY_SERVED_NAME,
                    "prompt": "a longer prompt " * 5,
                    "max_tokens": 2,
                    "ignore_eos": True,  # sampled, its first token may be EOS: no second step
                },
            )
            assert reply.status_code == 200, reply.text
        measured = node.stats().prefill_tokens_per_s
        assert measured is not None and measured > 0.0
        num_beats = len(control_plane.beats)
        assert wait_until(lambda: len(control_plane.beats) > num_beats + 1)
        beat = Heartbeat.model_validate(control_plane.beats[-1])
        assert beat.prefill_tokens_per_s == measured  # the only request: the rate stands
        # Its second token took a step with no prompt token: the fixed part it beats.
        assert beat.step_s is not None and beat.step_s == node.stats().step_s > 0.0
