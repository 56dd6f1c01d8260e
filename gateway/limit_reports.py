"""The usage report loop: every `limit_report_interval_s`, what each key asked of this PoP and its
buckets' levels go to the control plane (`POST /v1/limits/report`, wire/limit_shares.py); the
answer is this PoP's share of every key, and, when the buckets asked for them, the levels the
control plane last knew here (see `gateway/redis_limits.py`). Each report also carries what keys
spent per model (a batch: `gateway/spend.py`), and its answer what each key with a budget spent
in its current period.

A report that fails (the control plane away) keeps its counts for the next one, and the PoP
keeps the shares it has: while no PoP hears from the control plane, none changes its shares, and
they still add up to the key's limits. A replica that fails is left for the next one at once.
"""

from __future__ import annotations

import asyncio
import logging
import secrets

from gateway.control_plane_client import CALL_FAILURES, ControlPlaneClient
from gateway.limit_shares import Asked, PopLimiter
from wire.limit_shares import MAX_REPORTED_KEYS, KeyUse, ShareAnswer, UsageReport

logger = logging.getLogger(__name__)

PATH = "/v1/limits/report"
REPORT_TIMEOUT_S = 5.0


class UsageReporter:
    def __init__(
        self,
        client: ControlPlaneClient,
        pop: str,
        limiter: PopLimiter,
        interval_s: float,
    ) -> None:
        self._client = client
        self._urls = client.urls
        self._pop = pop
        # This process among the PoP's: the control plane tells its batch sent again from another
        # process's new one (control_plane/spend.py).
        self._reporter = secrets.token_hex(8)
        self._limiter = limiter
        self._interval_s = interval_s
        self.num_reports = 0
        self.num_failures = 0  # consecutive
        self.loaded = asyncio.Event()  # the first shares are in

    async def run(self) -> None:
        """Report until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            started_s = loop.time()
            try:
                await self.report_once()
            except CALL_FAILURES as exc:
                self._on_failure(exc)
            await asyncio.sleep(max(0.0, self._interval_s - (loop.time() - started_s)))

    async def report_once(self) -> None:
        meter, buckets = self._limiter.meter, self._limiter.buckets
        taken = meter.take()
        if len(taken) > MAX_REPORTED_KEYS:  # the rest go in the next report
            rest = list(taken)[MAX_REPORTED_KEYS:]
            meter.give_back({key_id: taken.pop(key_id) for key_id in rest})
        wants_levels = buckets.needs_levels
        batch = self._limiter.spend.take()  # kept for the next report until answered
        report = UsageReport(
            pop=self._pop,
            wants_levels=wants_levels,
            keys=self._uses(taken),
            spend=batch.spend() if batch is not None else [],
            spend_batch=batch.id if batch is not None else None,
            reporter=self._reporter,
        )
        try:
            answer = await self._post(report)
        except BaseException:
            meter.give_back(taken)
            raise
        self._limiter.shares.replace(answer)
        self._limiter.spend.answered(batch, answer.spent)
        if wants_levels:
            await buckets.seed(answer.levels)
        if self.num_failures:
            logger.info("usage reports are back after %d failures", self.num_failures)
        self.num_failures = 0
        self.num_reports += 1
        self.loaded.set()

    def _uses(self, taken: dict[str, Asked]) -> list[KeyUse]:
        uses = []
        for key_id, asked in taken.items():
            levels = self._limiter.buckets.levels_of(key_id)
            if levels is None:
                continue
            uses.append(
                KeyUse(
                    key_id=key_id,
                    request_level=levels.request_level,
                    token_level=levels.token_level,
                    num_requests=asked.num_requests,
                    num_tokens=asked.num_tokens,
                    largest_refused_tokens=asked.largest_refused_tokens,
                )
            )
        return uses

    async def _post(self, report: UsageReport) -> ShareAnswer:
        body = await self._client.call(
            "POST", PATH, REPORT_TIMEOUT_S, json_body=report.model_dump_json()
        )
        return ShareAnswer.model_validate_json(body)

    def _on_failure(self, exc: Exception) -> None:
        self.num_failures += 1
        failed = self._urls.current
        self._urls.rotate()
        log = logger.warning if self.num_failures in (1, 10) else logger.debug
        log("usage report to %s failed (%d in a row): %s", failed, self.num_failures, exc)
