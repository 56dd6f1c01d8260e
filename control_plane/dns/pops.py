"""The gateway PoPs as DNS targets: each one's health checked on its `/health` by a loop that the
DNS server owns. A PoP is up after one good check (200) and down after `pop_failures_down` bad
ones in a row (no answer within the timeout, or any other status: a gateway that is starting or
shutting down), so answers stop naming a dead or draining PoP within about a second, well within
one TTL. Until its first check a PoP counts as down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl

import aiohttp

from control_plane.dns.config import DnsConfig, PopEndpoint
from control_plane.dns.decision import Target
from wire.geo import locate

logger = logging.getLogger(__name__)


def pop_target(pop: PopEndpoint, is_up: bool) -> Target:
    place = locate(pop.name)
    return Target(
        name=pop.name,
        lat=place.lat,
        lon=place.lon,
        state="active" if is_up else "draining",
        num_healthy_nodes=1 if is_up else 0,
        kv_used_share=0.0,
        queue_delay_s=0.0,
        addresses=(pop.address,),
    )


class PopHealth:
    def __init__(self, config: DnsConfig) -> None:
        self._config = config
        self._num_failures = {pop.name: config.pop_failures_down for pop in config.pops}
        self._targets = self._build()

    def targets(self) -> tuple[Target, ...]:
        return self._targets

    def is_up(self, name: str) -> bool:
        return self._num_failures[name] < self._config.pop_failures_down

    def _build(self) -> tuple[Target, ...]:
        return tuple(pop_target(pop, self.is_up(pop.name)) for pop in self._config.pops)

    def record(self, name: str, is_ok: bool) -> None:
        was_up = self.is_up(name)
        self._num_failures[name] = 0 if is_ok else self._num_failures[name] + 1
        if self.is_up(name) != was_up:
            logger.warning("DNS: PoP %s is %s", name, "up" if self.is_up(name) else "down")
            self._targets = self._build()

    async def run(self) -> None:
        """Check every PoP each interval, until cancelled."""
        config = self._config
        context = ssl.create_default_context(cafile=config.pop_ca) if config.pop_ca else None
        timeout = aiohttp.ClientTimeout(total=config.pop_check_timeout_s)
        connector = aiohttp.TCPConnector(ssl=context if context is not None else True)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            while True:
                results = await asyncio.gather(*(self._check(session, pop) for pop in config.pops))
                for pop, is_ok in zip(config.pops, results, strict=True):
                    self.record(pop.name, is_ok)
                await asyncio.sleep(config.pop_check_interval_s)

    async def _check(self, session: aiohttp.ClientSession, pop: PopEndpoint) -> bool:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
            async with session.get(pop.health_url) as response:
                return response.status == 200
        return False
