"""The URL this PoP sends each region's requests to, and with them its serving token and tenants'
cache salts: the ingress URL the region registered with the control plane, or this PoP's own path
to it (in `meridian up`, its own RTT-delaying proxy route, so that each PoP feels its own distance
to the region). Either must pass the rule of `wire/upstream_url.py` (`http(s)://HOST[:PORT]`, no
link-local or other never-ours address): a region whose URL does not (stored by an older control
plane, or a bad `--region-ingress`) is left without an ingress, so it is not routed to, and
logged once per URL. The request's path is joined to the URL (`wire.upstream_url.join_path`)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping

from wire.region_summary import RegionSummary, RegionSummaryIndex
from wire.upstream_url import url_problem

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=256)  # once per region and URL, not with every summary
def _log_refused(region: str, problem: str) -> None:
    logger.warning("region %s is not routed to: its ingress URL %s", region, problem)


def _ingress_of(summary: RegionSummary, ingress: Mapping[str, str]) -> str | None:
    if summary.ingress_url is None:
        return None  # no ingress registered: not routable, whatever this PoP would use
    url = ingress.get(summary.name, summary.ingress_url)
    problem = url_problem(url)
    if problem is None:
        return url
    _log_refused(summary.name, f"{url} {problem}")
    return None


def with_region_ingress(
    document: RegionSummaryIndex, ingress: Mapping[str, str]
) -> RegionSummaryIndex:
    """The document with each region's ingress URL as this PoP uses it (None: not routed to)."""
    regions = []
    for summary in document.regions:
        url = _ingress_of(summary, ingress)
        if url != summary.ingress_url:
            summary = summary.model_copy(update={"ingress_url": url})
        regions.append(summary)
    return document.model_copy(update={"regions": regions})
