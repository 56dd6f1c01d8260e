"""The table a run prints: one per scenario, policies as rows (with an edge tier or a placed
model, their columns too)."""

from __future__ import annotations

import math

from rich.table import Table

from simulator.compare import ScenarioResult

COLUMNS = (
    "policy", "TTFT p50 s", "p95 s", "p99 s", "e2e p99 s", "goodput", "failed", "retried",
    "resumed", "resume p99 s", "lost", "floor p99 s", "cached",
)  # fmt: skip


EDGE_COLUMNS = ("at edge", "auto p99 s")  # with an edge tier
# With a placed model: its requests' TTFT p99 (answered by it or a fallback), failed, and
# answered by a fallback.
PLACED_COLUMNS = ("placed p99 s", "placed failed", "by fallback")


def _s(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds:.3f}"


def table(result: ScenarioResult) -> Table:
    title = (
        f"{result.scenario}: {result.num_requests:,} requests, seed {result.seed}, "
        f"{result.wall_s:.1f} s"
    )
    placed = result.placed_model
    if placed is not None:
        title += f"; placed model: {placed}"
    title += "" if result.node_picker else "; picker off"
    bound = result.bound
    caption = None if bound is None else f"bound: p99 {bound[1]:.3f} s ({bound[0]})"
    out = Table(title=title, caption=caption)
    columns = COLUMNS + (EDGE_COLUMNS if result.has_edge else ())
    columns += PLACED_COLUMNS if placed is not None else ()
    for i, column in enumerate(columns):
        out.add_column(column, justify="left" if i == 0 else "right")
    for policy, stats in result.stats.items():
        extra = [f"{stats.edge_share:.1%}", _s(stats.auto_ttft_p99_s)] if result.has_edge else []
        if placed is not None:
            model = stats.models[placed]
            extra += [_s(model.ttft_p99_s), f"{model.failed:,}", f"{model.by_fallback:,}"]
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
            _s(stats.floor_p99_s),
            f"{stats.cache_share:.1%}",
            *extra,
        )
    return out
