"""Optional Consul registration with `py-consul`: one service per node, with a TTL check.

The service carries the region and model in its meta. The heartbeat loop reports on every
tick: passing while the node is ready, critical (with the reason as the note) while it loads or
drains. If the agent forgets us (it restarted) or is away, we register again on a later tick.
When the control plane's drain sequence says `consul_deregister`, the service is withdrawn (and
not registered again until the drain is cancelled). It is deregistered on shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import math
import warnings
from urllib.parse import urlsplit

import aiohttp
import consul
import consul.aio

from node_agent.settings import NodeAgentSettings

logger = logging.getLogger(__name__)

# Consul refuses to reap critical services sooner than a minute.
DEREGISTER_CRITICAL_AFTER = "1m"
_FAILURES = (consul.ConsulException, aiohttp.ClientError, asyncio.TimeoutError, OSError)


def parse_consul_addr(addr: str) -> tuple[str, str, int]:
    """`HOST:PORT` or `http(s)://HOST:PORT` as (scheme, host, port); Consul's default port 8500."""
    parts = urlsplit(addr if "://" in addr else f"http://{addr}")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--consul {addr!r}: expected HOST:PORT or http(s)://HOST:PORT")
    return parts.scheme, parts.hostname, parts.port or 8500


def ttl_for(heartbeat_interval_s: float) -> str:
    return f"{max(5, math.ceil(5 * heartbeat_interval_s))}s"


class ConsulRegistration:
    def __init__(self, settings: NodeAgentSettings, node_id: str, model_name: str):
        self._settings = settings
        self.scheme, self.host, self.port = parse_consul_addr(settings.consul or "")
        self.service_id = node_id
        self.check_id = f"service:{node_id}"
        self._model_name = model_name
        self._client: consul.aio.Consul | None = None
        self.is_registered = False
        self.is_withdrawn = False
        self._num_failures = 0

    def _consul(self) -> consul.aio.Consul:
        if self._client is None:
            token = self._settings.consul_token
            with warnings.catch_warnings():  # py-consul passes aiohttp a deprecated argument
                warnings.simplefilter("ignore", DeprecationWarning)
                self._client = consul.aio.Consul(
                    host=self.host,
                    port=self.port,
                    scheme=self.scheme,
                    token=token.get_secret_value() if token else None,
                    connections_timeout=self._settings.heartbeat_timeout_s,
                )
        return self._client

    async def register(self) -> None:
        url = urlsplit(self._settings.url)
        meta = {
            "region": self._settings.region,
            "model": self._model_name,
            "node_id": self.service_id,
            "tp_size": str(self._settings.tensor_parallel_size),
            "url": self._settings.url,
        }
        check = {
            "CheckID": self.check_id,
            "Name": "meridian node agent heartbeat",
            "TTL": ttl_for(self._settings.heartbeat_interval_s),
            "DeregisterCriticalServiceAfter": DEREGISTER_CRITICAL_AFTER,
        }
        await self._consul().agent.service.register(
            self._settings.consul_service_name,
            service_id=self.service_id,
            address=url.hostname,
            port=url.port,
            tags=["meridian", f"region:{self._settings.region}"],
            meta=meta,
            check=check,
        )
        self.is_registered = True
        self.is_withdrawn = False
        logger.info("registered %s with Consul at %s:%d", self.service_id, self.host, self.port)

    async def report(self, is_ready: bool, note: str) -> None:
        """Register if needed, then pass (ready) or fail (not ready) the TTL check."""
        try:
            if not self.is_registered:
                await self.register()
            if not await self._update_check(is_ready, note):
                # The agent does not know the check (it restarted, or someone deregistered us).
                logger.info("Consul forgot %s; registering it again", self.service_id)
                await self.register()
                await self._update_check(is_ready, note)
        except _FAILURES as exc:
            self.is_registered = False
            self._num_failures += 1
            log = logger.warning if self._num_failures == 1 else logger.debug
            log("Consul at %s:%d: %s: %s", self.host, self.port, type(exc).__name__, exc)
            return
        if self._num_failures:
            logger.info("Consul at %s:%d is reachable again", self.host, self.port)
            self._num_failures = 0

    async def _update_check(self, is_ready: bool, note: str) -> bool:
        """Set the TTL check's status; False if the agent answered 404 (unknown check)."""
        checks = self._consul().agent.check
        if is_ready:
            return bool(await checks.ttl_pass(self.check_id, notes=note))
        return bool(await checks.ttl_fail(self.check_id, notes=note))

    async def withdraw(self) -> None:
        """Deregister the service for a drain (once; retried on a later tick if Consul is away)."""
        if self.is_withdrawn:
            return
        try:
            await self._consul().agent.service.deregister(self.service_id)
        except consul.NotFound:
            pass  # already gone (never registered, or the agent forgot it)
        except _FAILURES as exc:
            logger.warning("could not deregister from Consul, will retry: %s", exc)
            return
        self.is_withdrawn = True
        self.is_registered = False
        logger.info("deregistered %s from Consul for the drain", self.service_id)

    async def deregister(self) -> None:
        try:
            if self.is_registered:
                await self._consul().agent.service.deregister(self.service_id)
                logger.info("deregistered %s from Consul", self.service_id)
        except _FAILURES as exc:
            logger.warning("could not deregister from Consul: %s", exc)
        finally:
            self.is_registered = False
            if self._client is not None:
                await self._client.close()
                self._client = None
