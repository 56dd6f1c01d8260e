"""One request on its way, as its gateway (or, without a PoP, its client) keeps track of it:
the plan, the attempt under way, what has been relayed, and when."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from gateway.attempts import AttemptSequence, Try
from simulator.node import Job, Node
from simulator.policies import Pick
from simulator.site import Site
from simulator.workload import Request
from wire.geo import Location


@dataclass(slots=True)
class Flight:
    request: Request
    origin: Location  # where attempts leave from: the PoP, or the client itself
    pop: str  # "" when the client goes to a region directly
    client_delay_s: float  # client ↔ origin, one way
    # The models to try in order: the request's, then its fallbacks (none without a gateway).
    models: tuple[str, ...]
    model_turn: int = 0  # the one tried now
    num_turns: int = 0  # models taken from `turns` so far (the last one: no fallback after it)
    # The models left to try with their plans (gateway.model_routes.in_turn), once planned.
    turns: Iterator[tuple[str, list[Pick]]] | None = None
    picks: dict[str, Pick] = field(default_factory=dict)  # by region, the latest plan's
    is_edge: bool = False  # the attempts under way are the edge's
    attempts: AttemptSequence | None = None  # the gateway's sequencer over the plan
    attempt: int = -1  # the attempt under way: how many were made before it (for every model)
    sent_s: float = 0.0
    pick: Pick | None = None
    step: Try | None = None  # the attempt under way, as the gateway's attempt sequence gave it
    site: Site | None = None  # the pick's
    job: Job | None = None
    node: Node | None = None
    first_byte_s: float = 0.0  # at the origin: the client's first token
    observed_ttft_s: float = 0.0  # the first byte's, from its attempt's send (the router's)
    first_pick: Pick | None = None  # the region that sent the first byte
    num_attempts: int = 0
    num_sent: int = 0  # output tokens relayed by attempts before the one under way
    broken_s: float = 0.0  # when the last break's silence began at the origin
    longest_resume_s: float = 0.0  # from then to the continuation's first byte
    is_committed: bool = False  # the client has its first byte
    is_streaming: bool = False  # the attempt under way has sent its first byte
    is_ended: bool = False

    @property
    def model(self) -> str:
        return self.models[self.model_turn]

    @property
    def num_resumes(self) -> int:
        return self.attempts.num_resumes if self.attempts is not None else 0


AttemptEvent = tuple[Flight, int]  # a flight and its attempt an event is for (stale if newer)
