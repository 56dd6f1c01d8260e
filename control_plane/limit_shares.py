"""Each PoP's share of a key's limits, from where the key is asked for (pure).

A PoP admits from its own buckets, sized to its share (`share × rpm`, `share × tpm`, refilled at
`share` of the key's rate), so the fleet stays within the key's limits while the shares in force
add up to at most 1. Shares are worked out for one PoP at a time, as its report comes in:

- desired: `floor` of the key spread evenly over the live PoPs (so that a PoP where the key is
  quiet can still take a small request at once), the rest by recent demand (what was asked
  there, refused requests included, as a fraction of the key's limits, decayed with a
  half-life); with no demand anywhere, equal parts. A PoP that refused a request for want of
  room gets at least that request's part of the key (its `need`), taken from the others.
- granted: a decrease at once; an increase only into the room the other PoPs' shares leave, so
  that one PoP grows only once the others have shrunk (at their own reports).

A PoP without a share yet (one that joins) gets its desired share at once; until the others
shrink at their next reports, the shares in force may add up to more than 1 by that much.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field


class LimitSharesConfig(BaseModel):
    """Settings (`MERIDIAN_CP_LIMIT_SHARES='{"floor": 0.1}'`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # The part of every key spread evenly over the live PoPs whatever the demand: a PoP where
    # the key is quiet can still take a request of up to `floor / num_pops` of it at once.
    floor: float = Field(default=0.05, gt=0.0, le=1.0)
    # How fast a PoP's demand is forgotten: shares follow a key's clients within a few of these.
    demand_half_life_s: float = Field(default=2.0, gt=0.0, le=600.0)
    # A PoP not heard from for this long is left out (its shares go to the others): the time a
    # dead PoP's clients wait for its share at the PoP they fail over to; a PoP cut off from the
    # control plane for longer, still serving, may add its share on top.
    pop_ttl_s: float = Field(default=5.0, gt=0.0, le=3600.0)


# Below this much demand (a fraction of the key's limits, decayed) a key counts as unused.
MIN_DEMAND = 1e-9


@dataclass(frozen=True, slots=True)
class PopDemand:
    """One live PoP's standing for one key, as of now."""

    demand: float  # decayed asks, as a fraction of the key's limits
    need: float  # the largest request it refused lately, as a fraction (0: none)
    claim: float | None  # the share it holds (None: none yet)


def decayed(value: float, elapsed_s: float, half_life_s: float) -> float:
    return value * math.pow(0.5, max(0.0, elapsed_s) / half_life_s)


def demand_of(num_requests: int, num_tokens: int, rpm: int, tpm: int) -> float:
    """What was asked, as a fraction of the key's limits (its tighter one)."""
    return max(num_requests / rpm, num_tokens / tpm)


def need_of(largest_refused_tokens: int | None, rpm: int, tpm: int) -> float:
    """The share a PoP needs to hold the largest request it refused (0: none refused)."""
    if largest_refused_tokens is None:
        return 0.0
    return min(1.0, max(1.0 / rpm, largest_refused_tokens / tpm))


def desired_shares(
    demands: Mapping[str, float], needs: Mapping[str, float], floor: float
) -> dict[str, float]:
    """Every live PoP's desired share (they add up to 1)."""
    num_pops = len(demands)
    total = sum(demands.values())
    if total < MIN_DEMAND:
        shares = {pop: 1.0 / num_pops for pop in demands}
    else:
        shares = {pop: floor / num_pops + (1.0 - floor) * d / total for pop, d in demands.items()}
    return _with_needs(shares, needs)


def _with_needs(shares: dict[str, float], needs: Mapping[str, float]) -> dict[str, float]:
    """Raise each PoP to its need; the others give up the difference in proportion."""
    needy = {pop: need for pop, need in needs.items() if pop in shares and need > shares[pop]}
    if not needy:
        return shares
    needed = sum(needy.values())
    if needed >= 1.0:  # more needed than there is: the needy split all of it, the rest get none
        return {pop: needy.get(pop, 0.0) / needed for pop in shares}
    rest = sum(share for pop, share in shares.items() if pop not in needy)
    scale = (1.0 - needed) / rest if rest > 0.0 else 0.0
    return {pop: needy.get(pop, shares[pop] * scale) for pop in shares}


def next_share(desired: float, claim: float | None, others: float) -> float:
    """What a PoP is granted: `desired` if that is no increase on its `claim` (or it has none);
    else as much of it as the other PoPs' claims (`others`, their sum) leave room for."""
    if claim is None or desired <= claim:
        return desired
    return max(claim, min(desired, 1.0 - others))


def share_for(pop: str, standing: Mapping[str, PopDemand], floor: float) -> float:
    """`pop`'s next share of one key, given every live PoP's standing (`pop`'s included)."""
    desired = desired_shares(
        {p: s.demand for p, s in standing.items()},
        {p: s.need for p, s in standing.items()},
        floor,
    )
    others = sum(s.claim or 0.0 for p, s in standing.items() if p != pop)
    return next_share(desired[pop], standing[pop].claim, others)
