"""Capacity heartbeats to the control plane (`POST {control_plane}/v1/nodes/heartbeat`).

The loop ticks every heartbeat interval. Each tick keeps the Consul TTL check current (if Consul
is configured) and sends a beat unless it is backing off. While the control plane is away the
node keeps serving; beats back off exponentially with jitter (capped), and the first beat that
gets through registers the node again (a beat is the registration). The reply steers the drain
sequence (`drain`, `consul_deregister`, `may_exit`; see node_agent/drain.py): once told to leave
Consul, the tick deregisters the service instead of reporting it, until the drain is cancelled.
A control plane that judges health by a shorter interval shortens ours.
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
import time

import httpx
from pydantic import ValidationError

from node_agent.consul import ConsulRegistration
from node_agent.runtime import NodeRuntime
from node_agent.settings import NodeAgentSettings
from wire.control_plane_urls import ControlPlaneUrls, is_retryable_status
from wire.heartbeat import HeartbeatReply

logger = logging.getLogger(__name__)

PATH = "/v1/nodes/heartbeat"
MIN_INTERVAL_S = 0.05


def control_plane_client(settings: NodeAgentSettings) -> httpx.AsyncClient:
    """The client for the control plane, verifying an https:// one by its private CA if given."""
    verify: ssl.SSLContext | bool = True
    if settings.control_plane_ca is not None:
        verify = ssl.create_default_context(cafile=str(settings.control_plane_ca))
    return httpx.AsyncClient(timeout=settings.heartbeat_timeout_s, verify=verify)


class HeartbeatRejectedError(Exception):
    """The control plane answered, but not with a reply we can use."""

    def __init__(self, message: str, is_retryable: bool = True) -> None:
        super().__init__(message)
        self.is_retryable = is_retryable  # another replica may answer better (a 5xx)


class HeartbeatLoop:
    def __init__(
        self,
        runtime: NodeRuntime,
        client: httpx.AsyncClient,
        consul: ConsulRegistration | None = None,
        rng: random.Random | None = None,
    ):
        settings = runtime.settings
        self._runtime = runtime
        self._client = client
        self._consul = consul
        self._rng = rng or random.Random()
        self._urls = (
            ControlPlaneUrls.parse(settings.control_plane) if settings.control_plane else None
        )
        token = settings.node_token.get_secret_value() if settings.node_token else ""
        self._headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        self._timeout_s = settings.heartbeat_timeout_s
        self._max_backoff_s = settings.max_heartbeat_backoff_s
        self.interval_s = settings.heartbeat_interval_s
        self.num_sent = 0
        self.num_failures = 0  # consecutive
        self.last_reply: HeartbeatReply | None = None
        self._next_beat_at = 0.0

    async def run(self) -> None:
        next_tick = time.monotonic()
        while True:
            await self.tick()
            next_tick = max(next_tick + self.interval_s, time.monotonic())
            await asyncio.sleep(next_tick - time.monotonic())

    async def tick(self) -> None:
        if self._consul is not None:
            if self._runtime.consul_withdrawn:
                await self._consul.withdraw()
            else:
                reason = self._runtime.not_ready_reason()
                await self._consul.report(reason is None, reason or "ready")
        if self._urls is not None and time.monotonic() >= self._next_beat_at:
            await self.beat()

    async def beat(self) -> bool:
        """Send one beat now, to each replica in turn until one takes it (an unreachable or 5xx
        one is skipped at once); True if one did."""
        beat = self._runtime.heartbeat()
        if beat is None or self._urls is None:
            return False
        body = beat.model_dump_json()
        failure: Exception | None = None
        reply: HeartbeatReply | None = None
        for url in self._urls.in_turn():
            try:
                reply = await self._send(url, body)
            except (httpx.HTTPError, HeartbeatRejectedError, ValidationError) as exc:
                failure = exc
                if isinstance(exc, HeartbeatRejectedError) and not exc.is_retryable:
                    break  # the control plane's own answer (a bad credential): no other replica
                continue
            if url != self._urls.current:
                logger.warning("heartbeats fail over to %s (%s)", url, failure)
                self._urls.settle(url)
            break
        if reply is None:
            assert failure is not None
            self._on_failure(failure)
            return False
        self._on_success(reply)
        if self._consul is not None and self._runtime.consul_withdrawn:
            await self._consul.withdraw()  # at once: the control plane waits to see it gone
        return True

    async def _send(self, url: str, body: str) -> HeartbeatReply:
        response = await self._client.post(
            url + PATH, content=body, headers=self._headers, timeout=self._timeout_s
        )
        if response.status_code != 200:
            raise HeartbeatRejectedError(
                f"HTTP {response.status_code}: {response.text[:200]}",
                is_retryable=is_retryable_status(response.status_code),
            )
        return HeartbeatReply.model_validate_json(response.content)

    def _on_success(self, reply: HeartbeatReply) -> None:
        if self.num_failures:
            logger.info(
                "control plane %s is back after %d failed heartbeats",
                self._urls.current if self._urls else None,
                self.num_failures,
            )
        self.num_sent += 1
        self.num_failures = 0
        self._runtime.control_plane_reachable = True
        self._next_beat_at = 0.0
        self.last_reply = reply
        if not reply.region_registered and self.num_sent == 1:
            logger.warning(
                "region %r is not registered at the control plane: no traffic will be routed "
                "here until it is",
                self._runtime.settings.region,
            )
        wanted = min(self._runtime.settings.heartbeat_interval_s, reply.heartbeat_interval_s)
        self.interval_s = max(wanted, MIN_INTERVAL_S)
        self._runtime.on_heartbeat_reply(reply)

    def _on_failure(self, exc: Exception) -> None:
        self.num_failures += 1
        self._runtime.control_plane_reachable = False
        ceiling_s = min(self._max_backoff_s, self.interval_s * 2**self.num_failures)
        delay_s = ceiling_s * self._rng.uniform(0.5, 1.0)
        self._next_beat_at = time.monotonic() + delay_s
        log = logger.warning if self.num_failures == 1 else logger.debug
        log(
            "heartbeat to %s failed (%s: %s); still serving, next try in %.1f s",
            self._urls.current if self._urls else None,
            type(exc).__name__,
            exc,
            delay_s,
        )
