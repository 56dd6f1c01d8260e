"""The gateway's timeouts and limits as the simulator applies them: its default settings, read
from `GatewaySettings` so that the two cannot drift apart."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from gateway.attempts import ConnectTimeout
from gateway.settings import GatewaySettings
from wire.geo import Location, rtt_ms


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


def dark_connect_s(timing: GatewayTiming, pop: str, origin: Location, site: Location) -> float:
    """How long an attempt from `origin` waits to connect to a dark `site`: the gateway's
    timeout for the RTT its router expects (wire/geo.py; an edge node stands at its PoP: the
    floor); a client that goes to a region directly (no `pop`) waits the ceiling."""
    if not pop:
        return timing.connect_timeout.max_s
    return _timeout_s(timing.connect_timeout, origin, site)


@lru_cache(maxsize=4096)  # a few PoPs and regions, asked at every attempt at a dark one
def _timeout_s(timeout: ConnectTimeout, origin: Location, site: Location) -> float:
    return timeout.of(rtt_ms(origin, site))
