"""The table a run prints: one per scenario, policies as rows."""

from __future__ import annotations

import math

from rich.table import Table

from simulator.compare import ScenarioResult

COLUMNS = (
    "policy", "TTFT p50 s", "p95 s", "p99 s", "e2e p99 s", "goodput", "failed", "retried",
    "resumed", "resume p99 s", "lost",
)  # fmt: skip


EDGE_COLUMNS = ("at edge", "auto p99 s")  # with an edge tier


def _s(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds:.3f}"


def table(result: ScenarioResult) -> Table:
    title = (
        f"{result.scenario}: {result.num_requests:,} requests, seed {result.seed}, "
        f"{result.wall_s:.1f} s"
    )
    out = Table(title=title)
    columns = COLUMNS + EDGE_COLUMNS if result.has_edge else COLUMNS
    for i, column in enumerate(columns):
        out.add_column(column, justify="left" if i == 0 else "right")
    for policy, stats in result.stats.items():
        edge = [f"{stats.edge_share:.1%}", _s(stats.auto_ttft_p99_s)] if result.has_edge else []
        out.add_row(
            policy,
            _s(stats.ttft_p50_s),
            _s(stats.ttft_p95_s),
            _s(stats.ttft_p99_s),
            _s(stats.e2e_p99_s),
            f"{stats.goodput:.1%}",
            f"{stats.failed:,}",
            f"{stats.retried:,}",
            f"{stats.resumed:,}",
            _s(stats.resume_p99_s),
            f"{stats.lost:,}",
            *edge,
        )
    return out
