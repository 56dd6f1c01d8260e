"""The leader lease between replicas on PostgreSQL (see `control_plane.leadership`).

`LeaderLease` holds a session advisory lock on a connection of its own, and renews a lease in the
table `leader_lease` every `lease_s / 4`. A replica leads only while both hold, and it stops acting
as leader, by its own monotonic clock, `LOCAL_SHARE` of a lease after its last renewal began,
before any other replica may take over: a leader paused (SIGSTOP, a stalled VM) past its lease
finds on resuming that it no longer leads, before it does anything. Another replica takes over a
lease not renewed for `lease_s` by database time: it ends the old holder's database session (which
frees the advisory lock) and takes the lock, bumping the lease's `epoch`. A leader that dies
outright frees the lock with its session at once. Writes that only the leader may make carry its
epoch and are refused in their own transaction if the lease has moved on
(`fleet_store.check_epoch`): a leader paused just after its check cannot commit after the takeover.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Final

import psycopg
from psycopg.rows import dict_row

logger = logging.getLogger(__name__)

LOCK_KEY: Final = 0x6D65726964696D32  # the same in every replica: "the leader"
LOCAL_SHARE: Final = 0.8  # of a lease: how long a leader trusts its last renewal
CONNECT_TIMEOUT_S: Final = 5


class LeaderLease:
    def __init__(
        self,
        url: str,
        replica_id: str,
        lease_s: float,
    ) -> None:
        self.replica_id = replica_id
        self.lease_s = lease_s
        self._url = url
        self._conn: psycopg.AsyncConnection[dict[str, object]] | None = None
        self._epoch: int | None = None
        self._valid_until_mono = 0.0

    @property
    def epoch(self) -> int | None:
        return self._epoch if self.is_leader else None

    @property
    def is_leader(self) -> bool:
        return self._epoch is not None and time.monotonic() < self._valid_until_mono

    async def run(self, on_elected: Callable[[], Awaitable[None]]) -> None:
        """Until cancelled: take the lead when it is free or stale (then await `on_elected`),
        renew it while held."""
        try:
            while True:
                try:
                    await self._round(on_elected)
                except (psycopg.Error, OSError) as exc:
                    self._step_down(f"its database session failed ({exc.__class__.__name__})")
                    await self._close()
                await asyncio.sleep(self.lease_s / 4)
        finally:
            await self._close()

    async def _round(self, on_elected: Callable[[], Awaitable[None]]) -> None:
        if self._epoch is not None and not self.is_leader:
            # Paused past our own share of the lease: another replica may lead by now.
            self._step_down("its lease ran out before it could renew it")
            await self._close()  # frees the advisory lock, if the session still lives
        conn = await self._connection()
        if self._epoch is None:
            await self._try_take(conn, on_elected)
        else:
            await self._renew(conn)

    async def _connection(self) -> psycopg.AsyncConnection[dict[str, object]]:
        if self._conn is None or self._conn.closed:
            self._conn = await psycopg.AsyncConnection.connect(
                self._url, autocommit=True, row_factory=dict_row, connect_timeout=CONNECT_TIMEOUT_S
            )
        return self._conn

    async def _try_take(
        self,
        conn: psycopg.AsyncConnection[dict[str, object]],
        on_elected: Callable[[], Awaitable[None]],
    ) -> None:
        cursor = await conn.execute("SELECT pg_try_advisory_lock(%s) AS got", (LOCK_KEY,))
        got = await cursor.fetchone()
        if got is None or not got["got"]:
            await self._end_stale_holder(conn)
            return
        started_mono = time.monotonic()
        cursor = await conn.execute(
            "INSERT INTO leader_lease (one, holder, epoch, backend_pid, renewed_at) "
            "VALUES (1, %s, 1, pg_backend_pid(), extract(epoch FROM clock_timestamp())) "
            "ON CONFLICT (one) DO UPDATE SET holder = excluded.holder, "
            "epoch = leader_lease.epoch + 1, backend_pid = excluded.backend_pid, "
            "renewed_at = excluded.renewed_at RETURNING epoch",
            (self.replica_id,),
        )
        row = await cursor.fetchone()
        assert row is not None
        self._epoch = int(str(row["epoch"]))
        self._valid_until_mono = started_mono + self.lease_s * LOCAL_SHARE
        logger.info("replica %s leads (epoch %d)", self.replica_id, self._epoch)
        await on_elected()

    async def _end_stale_holder(self, conn: psycopg.AsyncConnection[dict[str, object]]) -> None:
        """The lock is held: if its lease was not renewed in time, end the holder's session."""
        cursor = await conn.execute(
            "SELECT holder, backend_pid, extract(epoch FROM clock_timestamp()) - renewed_at "
            "AS age_s FROM leader_lease WHERE one = 1"
        )
        row = await cursor.fetchone()
        if row is None or float(str(row["age_s"])) <= self.lease_s:
            return
        logger.warning(
            "leader %s has not renewed its lease for %.1f s: ending its session",
            row["holder"],
            float(str(row["age_s"])),
        )
        await conn.execute("SELECT pg_terminate_backend(%s)", (row["backend_pid"],))

    async def _renew(self, conn: psycopg.AsyncConnection[dict[str, object]]) -> None:
        started_mono = time.monotonic()
        cursor = await conn.execute(
            "UPDATE leader_lease SET renewed_at = extract(epoch FROM clock_timestamp()) "
            "WHERE one = 1 AND epoch = %s AND backend_pid = pg_backend_pid()",
            (self._epoch,),
        )
        if cursor.rowcount != 1:
            self._step_down("another replica took the lease")
            await self._close()
            return
        self._valid_until_mono = started_mono + self.lease_s * LOCAL_SHARE

    def _step_down(self, why: str) -> None:
        if self._epoch is not None:
            logger.warning(
                "replica %s no longer leads (epoch %d): %s", self.replica_id, self._epoch, why
            )
        self._epoch = None

    async def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(psycopg.Error, OSError):
                await conn.close()
