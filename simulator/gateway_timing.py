"""The gateway's timeouts and limits as the simulator applies them: its default settings, read
from `GatewaySettings` so that the two cannot drift apart."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.attempts import ConnectTimeout
from gateway.settings import GatewaySettings


def _gateway_default(name: str) -> float:
    value = GatewaySettings.model_fields[name].default
    assert isinstance(value, int | float)
    return float(value)


DEFAULT_MAX_RESUMES = int(_gateway_default("max_resumes"))
DEFAULT_CONNECT_TIMEOUT = ConnectTimeout(
    _gateway_default("connect_timeout_rtts"),
    _gateway_default("min_connect_timeout_s"),
    _gateway_default("connect_timeout_s"),
)


@dataclass(frozen=True, slots=True)
class GatewayTiming:
    max_attempts: int = int(_gateway_default("max_attempts"))
    max_resumes: int = DEFAULT_MAX_RESUMES
    connect_timeout: ConnectTimeout = DEFAULT_CONNECT_TIMEOUT
    first_byte_timeout_s: float = _gateway_default("first_byte_timeout_s")
    request_deadline_s: float = _gateway_default("request_deadline_s")
    stream_idle_timeout_s: float = _gateway_default("stream_idle_timeout_s")
    unhealthy_node_silence_s: float = _gateway_default("unhealthy_node_silence_s")
