"""Every replica's Envoys count in a drain's `envoy` step (replicas on PostgreSQL).

An Envoy holds its ADS stream to one replica, and only that replica sees what it ACKed. So each
replica reports, for every node in the `envoy` step, how many of its Envoys route to the node's
region and which of them have not yet ACKed endpoints without it: one row per replica in
`xds_reports`, written when the report changes and every `REFRESH_S` (announced as `envoys`).
The leader's step then waits for its own Envoys and for every replica heard from within
`ALIVE_S` by the database's clock: a replica that has not yet reported the node (it has not
heard of the step) counts as lagging. A replica that died stops counting after `ALIVE_S`; its
Envoys reconnect to a living one, which reports them. The step's own timeout bounds the wait.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Final

from control_plane.model import Fleet
from control_plane.store.base import Connection, Store
from control_plane.xds.acks import lacks_endpoint
from control_plane.xds.server import XdsServer

REFRESH_S: Final = 1.0  # an unchanged report is written again this often: the replica lives
ALIVE_S: Final = 3.0  # a replica whose report is older counts no more
POLL_S: Final = 0.05  # how often a replica looks at its Envoys' ACKs while a node is in the step
KIND: Final = "envoys"  # the change kind a report is announced as


@dataclass(frozen=True, slots=True)
class EnvoyAcks:
    """One replica's Envoys for a node in the `envoy` step."""

    num_envoys: int  # connected, routing to the node's region
    lagging: tuple[str, ...]  # their node ids, not yet ACKed endpoints without it


Report = dict[str, EnvoyAcks]  # node id -> its Envoys' ACKs


def local_report(fleet: Fleet, xds: XdsServer) -> Report:
    """This replica's Envoys, for each node its fleet shows in the `envoy` step."""
    report: Report = {}
    for node in fleet.nodes.values():
        if node.drain_phase == "envoy":
            region = node.identity.region
            lagging = xds.lagging(region, lacks_endpoint(node.identity.url))
            report[node.node_id] = EnvoyAcks(xds.num_envoys_for(region), tuple(sorted(lagging)))
    return report


def _encode(report: Report) -> str:
    return json.dumps(
        {node_id: [acks.num_envoys, list(acks.lagging)] for node_id, acks in report.items()},
        sort_keys=True,
    )


def _decode(text: str) -> Report:
    return {
        node_id: EnvoyAcks(int(num), tuple(str(envoy) for envoy in lagging))
        for node_id, (num, lagging) in json.loads(text).items()
    }


def save_report(replica_id: str, report: Report, conn: Connection) -> None:
    # The database's clock stamps it, the same clock every reader measures its age by.
    conn.execute(
        "INSERT INTO xds_reports (replica_id, report, reported_at) "
        "VALUES (?, ?, extract(epoch FROM clock_timestamp())) "
        "ON CONFLICT (replica_id) DO UPDATE SET report = excluded.report, "
        "reported_at = excluded.reported_at",
        (replica_id, _encode(report)),
    )


def load_reports(replica_id: str, conn: Connection) -> list[tuple[str, Report, float]]:
    """The other replicas' reports, each with its age in seconds."""
    rows = conn.execute(
        "SELECT replica_id, report, extract(epoch FROM clock_timestamp()) - reported_at AS age_s "
        "FROM xds_reports WHERE replica_id <> ?",
        (replica_id,),
    ).fetchall()
    return [(row["replica_id"], _decode(row["report"]), float(row["age_s"])) for row in rows]


@dataclass(slots=True)
class _PeerReport:
    report: Report
    alive_until_mono: float


@dataclass(slots=True)
class PeerReports:
    """The other replicas' latest reports, as the leader's drain step reads them."""

    _peers: dict[str, _PeerReport] = field(default_factory=dict)

    def follow(self, rows: list[tuple[str, Report, float]]) -> None:
        now_mono = time.monotonic()
        self._peers = {
            replica_id: _PeerReport(report, now_mono + ALIVE_S - age_s)
            for replica_id, report, age_s in rows
        }

    def acks_for(self, node_id: str) -> EnvoyAcks:
        """The living replicas' Envoys for `node_id`; a replica without a report on it lags."""
        now_mono = time.monotonic()
        num_envoys, lagging = 0, []
        for replica_id, peer in sorted(self._peers.items()):
            if peer.alive_until_mono <= now_mono:
                continue
            acks = peer.report.get(node_id)
            if acks is None:
                lagging.append(f"replica {replica_id} (no report yet)")
                continue
            num_envoys += acks.num_envoys
            lagging.extend(f"{envoy} (at replica {replica_id})" for envoy in acks.lagging)
        return EnvoyAcks(num_envoys, tuple(lagging))


async def report_forever(store: Store, fleet: Fleet, xds: XdsServer, replica_id: str) -> None:
    """Until cancelled: keep this replica's row in `xds_reports` current."""
    written: Report | None = None
    written_mono = -math.inf
    while True:
        report = local_report(fleet, xds)
        if report != written or time.monotonic() - written_mono >= REFRESH_S:
            await store.write(partial(save_report, replica_id, report), changes=(KIND,))
            written, written_mono = report, time.monotonic()
        await asyncio.sleep(POLL_S if report else REFRESH_S / 4)
