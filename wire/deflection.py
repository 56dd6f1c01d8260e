"""When a node agent turns a request away so that its region's Envoy tries another node.

A node prefills its admitted prompts one after another, so a request that lands on a node where
another is still waiting for its first token waits behind that prefill, while another node of
the region is often idle. Envoy's least-request balancing cannot see this: it counts open
streams, and decoding streams dominate the count. So a node with `deflect_at_waiting` requests
already waiting (but not a deep queue) answers an early attempt with 429 and
`DEFLECTED_HEADER`; the region's Envoy retries exactly those on a host it has not tried yet
(control_plane/xds/resources.py) and tells the node which attempt it is
(`ATTEMPT_COUNT_HEADER`). Attempts after `MAX_DEFLECTIONS` are always taken, so a deflection
never reaches the gateway. Without Envoy in front (no attempt header) a node never deflects.

A region's picker (region_picker/) deflects to the gateway instead: a request's first attempt
carries `ALTERNATIVE_HEADER`, what the gateway's plan costs the next-best region (seconds to a
first token from the PoP, gateway/routing.py), and the picker answers 429 with
`DEFLECTED_HEADER` when the node it would choose is further from a first token than that
(region_picker/scoring.py `deflects`). The gateway then tries that region, as after any 429,
but without counting a failure against this one. The gateway prices regions on their summaries
alone; the picker knows the region's nodes one by one (which are busy, which are slow), so the
two together choose a node across regions as neither could alone.
Shared by the node agent, the gateway, the picker and the simulator, which models both.
"""

from __future__ import annotations

import math
from typing import Final

ATTEMPT_COUNT_HEADER: Final = "x-envoy-attempt-count"  # Envoy's, 1 for the first attempt
DEFLECTED_HEADER: Final = "x-meridian-deflected"
ALTERNATIVE_HEADER: Final = "x-meridian-alternative-s"
# An alternative further off than this is no alternative (and no float overflows on the way).
MAX_ALTERNATIVE_S: Final = 3600.0
# Envoy attempts a node may deflect; later ones are taken (Envoy retries more than this often,
# so that a draining node's 503 is still retried after them). One: in the simulator a second
# took `stale` at seed 2 from 0.406 to 0.393 s but `surge` at seed 0 from 0.613 to 0.762 s.
MAX_DEFLECTIONS: Final = 1
# Requests without a first token (queued or in prefill) that make a node deflect; 0: never.
DEFAULT_DEFLECT_AT_WAITING: Final = 1
# A node deflects while it has at most this many more waiting than that. Envoy sends each request
# to its least-loaded node, so a deep queue there means its neighbours are as busy: deflecting
# would only move the request to a node with more streams (in the simulator, `nearest`, which
# overloads regions, went from a p99 of 2.58 s to 6.27 s without this bound, 2.66 s with it).
DEFLECT_WINDOW: Final = 1


def attempt_of(header: str | None) -> int | None:
    """Envoy's attempt number from its header; None when absent or not a positive integer."""
    if header is None or not header.isdigit():
        return None
    attempt = int(header)
    return attempt if attempt >= 1 else None


def should_deflect(num_waiting: int, attempt: int | None, deflect_at_waiting: int) -> bool:
    """Whether a node with `num_waiting` requests not started sends this attempt elsewhere."""
    if attempt is None or attempt > MAX_DEFLECTIONS or deflect_at_waiting <= 0:
        return False
    return deflect_at_waiting <= num_waiting <= deflect_at_waiting + DEFLECT_WINDOW


def alternative_header(cost_s: float) -> str:
    return f"{cost_s:.4f}"


def alternative_of(header: str | None) -> float | None:
    """The next-best region's cost from `ALTERNATIVE_HEADER`; None when absent or not a number
    of seconds in [0, MAX_ALTERNATIVE_S]."""
    if header is None or len(header) > 32:
        return None
    try:
        seconds = float(header)
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and 0.0 <= seconds <= MAX_ALTERNATIVE_S else None
