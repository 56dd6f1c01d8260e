"""`meridian status`'s picker section: each region picker's decisions so far, read from its
/metrics (region_picker/metrics.py), or why they could not be had."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final

import httpx
from prometheus_client.parser import text_string_to_metric_families

from stack.state import ProcessRecord

TIMEOUT_S: Final = 5.0


def _metrics_text(url: str) -> str:
    with httpx.Client(timeout=TIMEOUT_S, trust_env=False) as client:
        response = client.get(url)
    response.raise_for_status()
    return response.text


def picker_totals(text: str) -> dict[str, float]:
    """Each sample name's total over its labels."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def picker_row(totals: Mapping[str, float]) -> list[str]:
    """Decisions, cache hits, the share of full-block prompt tokens predicted cached on the
    chosen node, fallbacks to Envoy's least request, and nodes whose cache it knows exactly."""
    decisions = totals.get("meridian_picker_decisions_total", 0.0)
    hits = totals.get("meridian_picker_cache_hits_total", 0.0)
    cached = totals.get("meridian_picker_predicted_cached_tokens_total", 0.0)
    blocks = totals.get("meridian_picker_prompt_block_tokens_total", 0.0)
    share = f"{100.0 * cached / blocks:.1f}%" if blocks else "-"
    return [
        f"{decisions:g}",
        f"{hits:g}",
        share,
        f"{totals.get('meridian_picker_fallbacks_total', 0.0):g}",
        f"{totals.get('meridian_picker_cache_nodes_known', 0.0):g}",
    ]


def picker_rows(records: Iterable[ProcessRecord]) -> list[list[str]]:
    """The table's rows (header first), one per recorded picker; [] without any."""
    rows = [["PICKER", "DECISIONS", "CACHE HITS", "PREDICTED CACHED", "FALLBACKS", "EXACT NODES"]]
    for record in records:
        if record.kind != "picker" or record.url is None:
            continue
        name = record.name.removeprefix("picker ")
        if not record.is_running():
            rows.append([name, "DOWN: Envoy balances by least request", "", "", "", ""])
            continue
        try:
            rows.append([name, *picker_row(picker_totals(_metrics_text(record.url)))])
        except (httpx.HTTPError, ValueError) as exc:
            rows.append([name, f"metrics not readable ({exc.__class__.__name__})", "", "", "", ""])
    return rows if len(rows) > 1 else []
