"""This PoP's own path to each region: the region summaries carry the ingress URL registered
with the control plane, but a PoP may reach a region another way (in `meridian up`, through its
own RTT-delaying proxy route, so that each PoP feels its own distance to the region). Regions
not named keep their registered URL."""

from __future__ import annotations

from collections.abc import Mapping

from wire.region_summary import RegionSummaryIndex


def with_region_ingress(
    document: RegionSummaryIndex, ingress: Mapping[str, str]
) -> RegionSummaryIndex:
    """The document with each named region's ingress URL replaced by this PoP's own."""
    if not ingress:
        return document
    regions = [
        summary.model_copy(update={"ingress_url": ingress[summary.name]})
        if summary.name in ingress and summary.ingress_url is not None
        else summary
        for summary in document.regions
    ]
    return document.model_copy(update={"regions": regions})
