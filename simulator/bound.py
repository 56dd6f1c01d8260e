"""A lower bound on every request's TTFT, worked out offline from the trace: what no policy in this
world can beat, request by request.

For each request: the least, over the regions whose nodes serve its model (or one of its
fallbacks), of the network round trip to the region (straight over the client's public path, or
through any PoP and the backbone; jitter and loss left out) and the request's own prefill on the
fastest of the region's nodes, idle (its chunks' steps at batch 1, and its tenant's system
prompt taken as cached if an earlier request carried it). A region dark or hung when the request
arrives adds the wait until it is back. Queues, slots and KV are left out, so this bounds every
policy, each request's TTFT at least its floor; over the requests a policy answered, the floor's
p99 is at most the policy's. It is loose where queues dominate: the routing targets are measured
against the best of the clairvoyant policies (simulator/compare.py: `CLAIRVOYANT`) instead. Edge
nodes are not in it (a world with an edge tier has no floor).
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from simulator.calibration import ServiceCalibration
from simulator.run import WorldSpec


def prefill_floor_s(calibration: ServiceCalibration, tokens: int) -> float:
    """An idle node's time to a first token for `tokens` to prefill: a batch-1 step per chunk
    (in the node model's fluid steps: a share of one for the last, partial chunk)."""
    num_steps = max(1.0, tokens / calibration.max_num_batched_tokens)
    return tokens / calibration.prefill_tokens_per_s + num_steps * calibration.step_base_s


def _down_until_s(spec: WorldSpec) -> dict[str, tuple[float, float]]:
    """Regions out of service, as (from, until) in seconds (as World schedules them)."""
    requests = spec.requests
    first_s, last_s = requests[0].arrival_s, requests[-1].arrival_s
    scenario = spec.scenario
    outages = list(scenario.region_failures)
    if scenario.region_hang is not None:
        outages.append(scenario.region_hang)
    return {
        o.name: (first_s + o.start * (last_s - first_s), first_s + o.end * (last_s - first_s))
        for o in outages
    }


def floor_ttfts_s(spec: WorldSpec) -> npt.NDArray[np.float64]:
    geography = spec.geography
    placement = spec.scenario.placement
    calibrations = spec.scenario.calibrations(spec.calibration)
    down = _down_until_s(spec)
    rtt_s: dict[tuple[str, str], float] = {}
    pops = list(geography.pops.values())
    for city_name, city in geography.cities.items():
        to_pop_ms = [geography.true_rtt_ms(city, pop, is_public=True) for pop in pops]
        for name, place in geography.regions.items():
            via_pop_ms = min(
                ms + geography.true_rtt_ms(pop, place)
                for ms, pop in zip(to_pop_ms, pops, strict=True)
            )
            direct_ms = geography.true_rtt_ms(city, place, is_public=True)
            rtt_s[(city_name, name)] = min(via_pop_ms, direct_ms) / 1000.0
    fastest: dict[tuple[str, str], ServiceCalibration] = {}
    for region, models in placement.nodes.items():
        for model, calibration in zip(models, calibrations[region], strict=True):
            best = fastest.get((region, model))
            if best is None or calibration.prefill_tokens_per_s > best.prefill_tokens_per_s:
                fastest[(region, model)] = calibration
    tries_of = placement.tries_of()  # a model's fallbacks answer for it too
    seen: set[str] = set()
    floors = np.empty(len(spec.requests))
    for i, request in enumerate(spec.requests):
        key = request.affinity_key
        cached = 0
        if key is not None:
            if key in seen:
                cached = request.prefix_tokens
            seen.add(key)
        best_s = math.inf
        models = tries_of[request.model]
        for (region, model), calibration in fastest.items():
            if model not in models:
                continue
            block = calibration.block_size
            tokens = max(1, request.prompt_tokens - cached // block * block)
            floor_s = rtt_s[(request.city, region)] + prefill_floor_s(calibration, tokens)
            window = down.get(region)
            if window is not None and window[0] <= request.arrival_s < window[1]:
                floor_s += window[1] - request.arrival_s
            best_s = min(best_s, floor_s)
        floors[i] = best_s
    return floors
