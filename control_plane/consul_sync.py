"""Consul discovery (`--consul ADDR`): node agents registered in Consul, merged into the registry.

Node agents register one service each (name `meridian-node` by default; service id = node id;
meta `region`, `model`, `url`, `tp_size`, `node_id`) with a TTL check they keep passing while
ready. We follow `GET /v1/health/service/<name>` with blocking queries (`index` + `wait`, as
Consul's own clients do), turn each answer into `ConsulEntry`s, and hand the whole view to the
registry, which merges it with heartbeats (the rule is in `control_plane.model`).

Failures back off (0.5 s doubling to 10 s). If Consul stays unreachable for `STALE_AFTER_S`, its
statuses become "unknown": it no longer vetoes nodes that heartbeat, and Consul-only nodes count
as unhealthy until it answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import warnings
from collections.abc import AsyncIterator, Callable
from typing import Any, Final
from urllib.parse import urlsplit

import aiohttp
import consul
import consul.aio
from pydantic import BaseModel, Field, ValidationError

from control_plane.model import ConsulEntry, ConsulStatus, NodeIdentity
from wire.heartbeat import HttpUrlStr, Name

logger = logging.getLogger(__name__)

BLOCKING_WAIT_S: Final = 30.0
MIN_BACKOFF_S: Final = 0.5
MAX_BACKOFF_S: Final = 10.0
STALE_AFTER_S: Final = 15.0
# Consul's advice: do not re-query faster than this even if answers come back at once.
MIN_QUERY_INTERVAL_S: Final = 0.05
_FAILURES = (consul.ConsulException, aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError)

Apply = Callable[[dict[str, ConsulEntry]], None]


class ServiceMeta(BaseModel):
    """What a node agent puts in its service's meta (and address), validated."""

    node_id: Name
    region: Name
    url: HttpUrlStr
    model: str = Field(min_length=1, max_length=256, pattern=r"^[^\x00-\x1f\x7f]+$")
    tp_size: int = Field(default=1, ge=1, le=1024)


def parse_consul_addr(addr: str) -> tuple[str, str, int]:
    """`HOST:PORT` or `http(s)://HOST:PORT` as (scheme, host, port); Consul's default port 8500."""
    parts = urlsplit(addr if "://" in addr else f"http://{addr}")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"Consul address {addr!r}: expected HOST:PORT or http(s)://HOST:PORT")
    return parts.scheme, parts.hostname, parts.port or 8500


def aggregate_status(checks: list[dict[str, Any]]) -> ConsulStatus:
    """Worst of the instance's checks (node checks included), as Consul's health filter does."""
    statuses = {str(check.get("Status", "critical")) for check in checks}
    if statuses - {"passing", "warning"}:
        return "critical"
    return "warning" if "warning" in statuses else "passing"


def service_id_of(item: dict[str, Any]) -> str:
    return str((item.get("Service") or {}).get("ID"))


def entry_of(item: dict[str, Any]) -> tuple[str, ConsulEntry]:
    """One `/v1/health/service` item as (node id, entry); ValueError if it is not a node agent."""
    service = item.get("Service") or {}
    meta = dict(service.get("Meta") or {})
    address = service.get("Address") or (item.get("Node") or {}).get("Address")
    if "url" not in meta and address and service.get("Port"):
        meta["url"] = f"http://{address}:{service['Port']}"
    meta.setdefault("node_id", service.get("ID"))
    try:
        fields = ServiceMeta.model_validate(meta)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"service {service.get('ID')!r}: {problems}") from exc
    identity = NodeIdentity(
        region=fields.region, url=fields.url, model=fields.model, tp_size=fields.tp_size
    )
    return fields.node_id, ConsulEntry(identity, aggregate_status(item.get("Checks") or []))


class ConsulSync:
    """Follows one Consul service with blocking queries and applies each view it reads."""

    def __init__(
        self,
        addr: str,
        service_name: str,
        apply: Apply,
        wait_s: float = BLOCKING_WAIT_S,
        stale_after_s: float = STALE_AFTER_S,
    ) -> None:
        self.scheme, self.host, self.port = parse_consul_addr(addr)
        self.service_name = service_name
        self.index = 0  # the last X-Consul-Index read; 0 before the first answer
        self._apply = apply
        self._wait_s = wait_s
        self._stale_after_s = stale_after_s
        self._entries: dict[str, ConsulEntry] = {}
        self._rejected: set[str] = set()  # service ids already warned about
        self.service_ids: dict[str, str] = {}  # node id → its Consul service id, as last read

    def _client(self) -> consul.aio.Consul:
        with warnings.catch_warnings():  # py-consul passes aiohttp a deprecated argument
            warnings.simplefilter("ignore", DeprecationWarning)
            return consul.aio.Consul(
                host=self.host,
                port=self.port,
                scheme=self.scheme,
                connections_timeout=self._wait_s + 10.0,
            )

    async def run(self) -> None:
        """Until cancelled."""
        client = self._client()
        failing_since: float | None = None
        backoff_s = MIN_BACKOFF_S
        try:
            while True:
                started = time.monotonic()
                try:
                    index, items = await client.health.service(
                        self.service_name, index=self.index, wait=f"{self._wait_s:g}s"
                    )
                except _FAILURES as exc:
                    is_first = failing_since is None
                    failing_since = failing_since or started
                    self._on_failure(exc, is_first, time.monotonic() - failing_since)
                    await asyncio.sleep(backoff_s)
                    backoff_s = min(2 * backoff_s, MAX_BACKOFF_S)
                    continue
                if failing_since is not None:
                    logger.info("Consul at %s:%d answers again", self.host, self.port)
                failing_since, backoff_s = None, MIN_BACKOFF_S
                self._on_answer(int(index), items or [])
                elapsed_s = time.monotonic() - started
                if elapsed_s < MIN_QUERY_INTERVAL_S:
                    await asyncio.sleep(MIN_QUERY_INTERVAL_S - elapsed_s)
        finally:
            await client.close()

    def _on_answer(self, index: int, items: list[dict[str, Any]]) -> None:
        # The next query blocks until the index passes this one. One that went backwards (Consul
        # restarted) is adopted as it is: we hold the data read at it, so nothing is missed.
        self.index = max(index, 0)
        entries: dict[str, ConsulEntry] = {}
        service_ids: dict[str, str] = {}
        for item in items:
            try:
                node_id, entry = entry_of(item)
            except ValueError as exc:
                service_id = service_id_of(item)
                if service_id not in self._rejected:
                    self._rejected.add(service_id)
                    logger.warning("Consul: ignoring %s", exc)
                continue
            entries[node_id] = entry
            service_ids[node_id] = service_id_of(item)
        self.service_ids = service_ids
        if entries != self._entries:
            self._entries = entries
            self._apply(entries)

    async def deregister(self, node_id: str) -> bool:
        """Deregister a node's service through the Consul agent API (the drain sequence does this
        for a node that cannot, or did not, deregister itself). True if Consul accepted it.

        The agent API acts on the agent the service was registered with: fine for one agent (the
        stand-in, a dev agent, or a control plane beside the nodes' agent); with many agents the
        node must deregister itself (the heartbeat reply's `consul_deregister`)."""
        service_id = self.service_ids.get(node_id, node_id)
        client = self._client()
        try:
            is_done = bool(await client.agent.service.deregister(service_id))
        except _FAILURES as exc:
            logger.warning(
                "Consul: could not deregister %s: %s: %s", service_id, type(exc).__name__, exc
            )
            return False
        finally:
            await client.close()
        logger.info("Consul: deregistered service %s (node %s) for its drain", service_id, node_id)
        return is_done

    def _on_failure(self, exc: BaseException, is_first: bool, failing_for_s: float) -> None:
        log = logger.warning if is_first else logger.debug
        log("Consul at %s:%d: %s: %s", self.host, self.port, type(exc).__name__, exc)
        if failing_for_s < self._stale_after_s:
            return
        unknown = {
            node_id: dataclasses.replace(entry, status="unknown")
            for node_id, entry in self._entries.items()
        }
        if unknown != self._entries:
            logger.warning(
                "Consul unreachable for %.0f s: its node statuses are unknown now", failing_for_s
            )
            self._entries = unknown
            self._apply(unknown)


@contextlib.asynccontextmanager
async def follow_consul(sync: ConsulSync | None) -> AsyncIterator[None]:
    """Run the sync for the app's lifetime (with `--consul`)."""
    if sync is None:
        yield
        return
    logger.info("Consul: following service %r at %s:%d", sync.service_name, sync.host, sync.port)
    task = asyncio.create_task(sync.run(), name="consul-sync")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
