"""A request's way through the world: client → PoP → region → node, with failover and resume.

Which region comes next is the gateway's own `AttemptSequence` (gateway/attempts.py), driven on the
simulated clock as `gateway/proxy.py` and `gateway/resume.py` drive it on the real one: the policy's
regions in order, at most `max_attempts` per opening, within the request's deadline. An attempt
fails over when a dark region does not connect (`gateway.attempts.ConnectTimeout`), answers 429 (its
node's waiting queue is full, or its picker sent the first attempt back to try the next-best region:
wire/deflection.py) or sends no first byte within `first_byte_timeout_s`, unless it is the
last place to ask (the last region of the last model) and the PoP's summaries show it a healthy node
(simulator/first_byte.py). Once the first byte has come the stream is committed. A dying node resets
its connections (the region's Envoy ends them), which reaches the gateway one way later: an attempt
still waiting for its first byte fails over then; a stream, if the sequence allows a resume,
continues in the next region not tried yet: the prompt plus the tokens already relayed, the output
less them, as `gateway.resume.continuation_of` builds it. A hung node's connections stay open
instead: its waiting attempts meet their first-byte timeout (the last region's once its summary
shows no healthy node), and its streams break when the gateway's relay would give up on their
silence, or when the node's restart resets them (simulator/hung_streams.py). The client keeps its
first token's time; the stream ends when the continuation's does. Timeouts and limits are the
gateway's default settings. Each outcome is reported to the policy (breakers, in-flight counts,
observed TTFT), which is where the real gateway code learns. With an edge tier (simulator/edge.py),
a light `auto` request first tries its PoP's edge node.

A request is for one model, and goes only to regions (and nodes) serving it. When the model has no
capacity (no region serving it in the plan, every one circuit-open or saturated, or every region
tried failed before a first byte), the gateway tries the next of its fallbacks the same way, within
the same deadline, in the turn `gateway.model_routes.in_turn` gives, as `gateway/dispatch.py` does;
the request ends in an error only when none has. A resume stays on the model the stream began on
(another model would write another text).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import replace
from functools import partial

from gateway.attempts import AttemptLimits, AttemptSequence, GiveUp
from gateway.model_routes import in_turn
from gateway.routing import Candidate
from simulator.access import Access, make_access
from simulator.control import PopWatch
from simulator.delays import OneWayDelays
from simulator.edge import EdgeTier
from simulator.events import EventLoop
from simulator.first_byte import FirstByteTimers, pop_views
from simulator.flight import AttemptEvent, Flight
from simulator.gateway_timing import GatewayTiming, dark_connect_s
from simulator.hung_streams import HungStreams
from simulator.node import Job
from simulator.policies import Chooser, Pick
from simulator.results import TIER_EDGE, TIER_NONE, TIER_REGION, Outcome, Recorder
from simulator.site import Refusal, Site
from simulator.workload import Request
from simulator.world import Geography

EDGE_LIMITS = AttemptLimits(max_attempts=1, max_resumes=0)  # the edge is one candidate


class Traffic:
    def __init__(
        self,
        loop: EventLoop,
        geography: Geography,
        sites: Mapping[str, Site],
        chooser: Chooser,
        recorder: Recorder,
        timing: GatewayTiming,
        watches: Mapping[str, PopWatch],
        access: Access = "anycast",
        edge: EdgeTier | None = None,
    ) -> None:
        self.loop = loop
        self.geography = geography
        self.sites = sites
        self.chooser = chooser
        self.recorder = recorder
        self.timing = timing
        self.max_attempts = chooser.max_attempts or timing.max_attempts
        # Clients that send once have no gateway to continue their streams.
        max_resumes = timing.max_resumes if chooser.has_gateway else 0
        self.limits = AttemptLimits(self.max_attempts, max_resumes)
        self.access = make_access(access, geography.pops, geography.cities)
        self.delays = OneWayDelays(geography, edge, chooser.is_via_pop)
        self.hung = HungStreams(loop, sites, self.delays, timing, watches, self._broken)
        self.first_byte = FirstByteTimers(loop, timing, pop_views(watches, loop), self._timed_out)
        self.edge = edge

    def withdraw(self, pop: str) -> None:
        self.access.withdraw(pop)

    def announce(self, pop: str) -> None:
        self.access.announce(pop)

    # Requests.

    def send(self, request: Request, models: tuple[str, ...]) -> None:
        """The client sends `request` now; `models`: its model, then the fallbacks a gateway
        would try (a client that sends once has no gateway to fall back)."""
        city = self.geography.cities[request.city]
        if self.chooser.is_via_pop:
            pop = self.access.pop_for(request.city, self.loop.now_s)
            origin = self.geography.pops[pop]
            delay_s = self.delays.between(city, origin)
            flight = Flight(request, origin, pop, delay_s, models)
            self.loop.at(self.loop.now_s + delay_s, self._at_origin, flight)
        else:
            tries = models if self.chooser.has_gateway else models[:1]
            self._at_origin(Flight(request, city, "", 0.0, tries))

    def _at_origin(self, flight: Flight) -> None:
        edge = self.edge
        if edge is not None:
            choice = edge.choose(flight.pop, flight.request)
            if choice is not None and choice.tier == "edge":
                flight.is_edge = True
                edge.in_flight[flight.pop] += 1
                self._open(flight, [Pick(edge.sites[flight.pop].name)], EDGE_LIMITS, False)
                return
        self._open_regions(flight)

    def _open_regions(self, flight: Flight, outcome: Outcome = Outcome.NO_CAPACITY) -> None:
        """The next of the flight's models in the gateway's turn (`in_turn`) that some region
        serves; `outcome`: how the flight ends when none is left."""
        if flight.turns is None:
            plan_of = partial(self._plan_for, flight)
            flight.turns = in_turn(flight.models, plan_of, _has_capacity)
        for model, picks in flight.turns:
            flight.num_turns += 1
            if picks:
                flight.model_turn = flight.models.index(model)
                self._open(flight, picks, self.limits, flight.num_turns == len(flight.models))
                return
        self._end(flight, outcome)

    def _plan_for(self, flight: Flight, model: str) -> list[Pick]:
        """The policy's order now for `model`: a fallback's planned for as if asked for."""
        request = flight.request
        if model != request.model:
            request = replace(request, model=model)
        return self.chooser.order(flight.pop, request, self.loop.now_s, self.max_attempts)

    def _open(
        self, flight: Flight, picks: list[Pick], limits: AttemptLimits, is_last_resort: bool
    ) -> None:
        candidates = self._candidates(flight, picks)
        started_s = flight.request.arrival_s + flight.client_delay_s
        deadline_s = started_s + self.timing.request_deadline_s
        flight.attempts = AttemptSequence(
            candidates, limits, deadline_s, is_last_resort, picks[0].alternative_s
        )
        self._try_next(flight)

    def _try_next(self, flight: Flight) -> None:
        now_s = self.loop.now_s
        assert flight.attempts is not None
        step = flight.attempts.next(now_s)
        if isinstance(step, GiveUp):
            if flight.is_edge:  # the edge failed it: the regions, within the same deadline
                self._leave_edge(flight)
                self._open_regions(flight)
                return
            if flight.is_committed:  # no continuation opened: the stream ends in an error
                self._observe_ttft(flight, 0)
                self._end(flight, Outcome.CUT)
            elif step.reason != "deadline":  # no capacity for this model: its next fallback
                self._open_regions(flight, Outcome.FAILED)
            else:
                self._end(flight, Outcome.FAILED)
            return
        # Counted over the flight, not the sequence: a fallback model's sequence starts afresh,
        # and an event for the last model's attempts must not pass for its attempts.
        flight.attempt = flight.num_attempts
        pick = flight.picks[step.candidate.region]
        flight.num_attempts += 1
        flight.pick, flight.sent_s, flight.job, flight.node = pick, now_s, None, None
        flight.step = step
        if flight.is_edge:
            assert self.edge is not None
            site = self.edge.sites[flight.pop]
        else:
            self.chooser.on_attempt(flight.pop, step, now_s)
            site = self.sites[pick.region]
        flight.site = site
        arrive_s = now_s + self.delays.between(flight.origin, site.location)
        self.loop.at(arrive_s, self._at_region, (flight, flight.attempt))

    def _at_region(self, event: AttemptEvent) -> None:
        flight = event[0]
        now_s = self.loop.now_s
        site, pick, step = flight.site, flight.pick, flight.step
        assert pick is not None and site is not None and step is not None
        request = flight.request
        sent = flight.num_sent  # a continuation: the prompt and the output relayed so far
        job = Job(
            flight, request.prompt_tokens + sent, request.output_tokens - sent,
            request.affinity_key, request.prefix_tokens,
        )  # fmt: skip
        node = site.take(flight.model, job, now_s, pick.node, step.alternative_s)
        if node is Refusal.DARK:
            waited_s = dark_connect_s(self.timing, flight.pop, flight.origin, site.location)
            self.loop.at(flight.sent_s + waited_s, self._failed, event)
            return
        if isinstance(node, Refusal):  # answered at once: 404, 429 or sent back (a 429 too)
            back_s = now_s + self.delays.between(site.location, flight.origin)
            deflected = node is Refusal.DEFLECTED
            self.loop.at(back_s, partial(self._failed, deflected=deflected), event)
            return
        flight.job, flight.node = job, node
        node.submit(job, now_s)
        self.first_byte.arm(event, flight.sent_s)

    def on_first_token(self, job: Job) -> None:
        flight = job.owner
        assert isinstance(flight, Flight)
        if flight.job is not job or flight.is_ended:
            return  # an attempt the gateway gave up on: the node worked for nobody
        self.recorder.note_prefill(flight.request.request_id, job.prompt_tokens, job.cached_tokens)
        assert flight.site is not None
        back_s = self.loop.now_s + self.delays.between(flight.site.location, flight.origin)
        self.loop.at(back_s, self._first_byte, (flight, flight.attempt))

    def _first_byte(self, event: AttemptEvent) -> None:
        flight, attempt = event
        if attempt != flight.attempt or flight.is_ended:
            return  # a newer attempt (a node that died after sending it still delivers it)
        assert flight.pick is not None and flight.step is not None
        self._stream_from(flight, self.loop.now_s)
        if not flight.is_edge:
            self.chooser.on_first_byte(flight.pop, flight.step, self.loop.now_s)

    def _stream_from(self, flight: Flight, first_byte_s: float) -> None:
        """The attempt under way sent its first byte, at the origin at `first_byte_s`."""
        flight.is_streaming = True
        if flight.num_resumes:
            wait_s = first_byte_s - flight.broken_s
            flight.longest_resume_s = max(flight.longest_resume_s, wait_s)
        if not flight.is_committed:
            flight.is_committed, flight.first_byte_s = True, first_byte_s
            flight.observed_ttft_s = first_byte_s - flight.sent_s
            flight.first_pick = flight.pick

    def on_finished(self, job: Job) -> None:
        flight = job.owner
        assert isinstance(flight, Flight)
        if flight.job is not job or flight.is_ended:
            return
        assert flight.pick is not None and flight.site is not None and flight.step is not None
        now_s = self.loop.now_s
        done_s = now_s + self.delays.between(flight.site.location, flight.origin)
        if not flight.is_streaming:  # the last token comes with the first (1-token answers)
            self._stream_from(flight, done_s)
            if not flight.is_edge:
                self.chooser.on_first_byte(flight.pop, flight.step, now_s)
        if not flight.is_edge:
            self.chooser.on_end(flight.pop, flight.pick.region, False, now_s)
            # As gateway/api.py: the first attempt's cache hits, where no resume happened.
            cached_tokens = job.prompt_tokens - job.prefill_tokens if not flight.num_resumes else 0
            self._observe_ttft(flight, cached_tokens)
        self._end(flight, Outcome.OK, done_s + flight.client_delay_s)

    def _observe_ttft(self, flight: Flight, cached_tokens: int) -> None:
        assert flight.first_pick is not None
        self.chooser.on_ttft(
            flight.pop, flight.first_pick, flight.observed_ttft_s, cached_tokens, self.loop.now_s
        )

    def _timed_out(self, event: AttemptEvent) -> None:
        """The attempt's first-byte timeout passed (simulator/first_byte.py): given up on."""
        flight = event[0]
        if flight.node is not None and flight.job is not None:
            flight.node.abort(flight.job, self.loop.now_s)
        self._failed(event)

    def _failed(self, event: AttemptEvent, deflected: bool = False) -> None:
        """No first byte from the attempt (`deflected`: its region's picker sent it back)."""
        flight, attempt = event
        if attempt != flight.attempt or flight.is_ended:
            return
        assert flight.step is not None and flight.attempts is not None
        if deflected:
            self.chooser.on_deflected(flight.pop, flight.step, self.loop.now_s)
            flight.attempts.deflected()
        elif not flight.is_edge:
            self.chooser.on_failure(flight.pop, flight.step, self.loop.now_s)
        self._try_next(flight)

    def reset(self, job: Job) -> None:
        """The node serving `job` died and its connection reset, which reaches the gateway one
        way later (after any byte the node had sent): an attempt without a first byte then fails
        over, a stream continues elsewhere if it may (else it ends in an error)."""
        flight = self._cut_off(job)
        if flight is None:
            return
        assert flight.site is not None
        back_s = self.loop.now_s + self.delays.between(flight.site.location, flight.origin)
        self.loop.at(back_s, self._broken, (flight, flight.attempt))

    def silence(self, job: Job) -> None:
        """The node serving `job` hung with its connection open: nothing more comes from it
        once the bytes on their way have arrived. An attempt without a first byte meets its
        first-byte timeout; a stream breaks once its silence passes the relay's limit."""
        flight = self._cut_off(job)
        if flight is not None:
            self.hung.hold(flight)

    def _cut_off(self, job: Job) -> Flight | None:
        """`job`'s flight, which has all it will get from that node; None if the flight is
        ended or no longer waits on `job`."""
        flight = job.owner
        assert isinstance(flight, Flight)
        if flight.job is not job or flight.is_ended:
            return None
        flight.job = None
        flight.num_sent += job.num_generated
        return flight

    def restarted(self, region: str, nodes: Collection[str]) -> None:
        self.hung.restarted(region, nodes)

    def _broken(self, event: AttemptEvent, silent_from_s: float | None = None) -> None:
        """The stream under way broke, as the origin sees it now (a reset arriving, or a silence
        since `silent_from_s` given up on)."""
        flight, attempt = event
        if attempt != flight.attempt or flight.is_ended:
            return
        if not flight.is_streaming:  # reset before its first byte: the next region, at once
            self._failed(event)
            return
        assert flight.pick is not None and flight.attempts is not None
        now_s = self.loop.now_s
        if not flight.is_edge:
            self.chooser.on_end(flight.pop, flight.pick.region, True, now_s)
        nothing_left = flight.num_sent >= flight.request.output_tokens
        replan = None if flight.is_edge else partial(self._replan, flight, now_s)
        if nothing_left or flight.attempts.resume(now_s, replan) is not None:
            if not flight.is_edge:
                self._observe_ttft(flight, 0)
            self._end(flight, Outcome.CUT)
            return
        flight.broken_s = now_s if silent_from_s is None else silent_from_s
        flight.is_streaming = False
        self._try_next(flight)

    def _replan(self, flight: Flight, now_s: float, tried: list[str]) -> list[Candidate]:
        """The policy's order now, among the regions not `tried`, for the continuation (its
        prompt holds the tokens sent)."""
        request = flight.request
        continuation = replace(
            request, prompt_tokens=request.prompt_tokens + flight.num_sent, model=flight.model
        )
        picks = self.chooser.order(flight.pop, continuation, now_s, self.max_attempts, tried)
        return self._candidates(flight, picks)

    @staticmethod
    def _candidates(flight: Flight, picks: list[Pick]) -> list[Candidate]:
        """The gateway's candidates for `picks`, whose details the flight keeps by region."""
        flight.picks.update((p.region, p) for p in picks)
        prompt_tokens = flight.request.prompt_tokens + flight.num_sent  # a continuation's too
        return [
            Candidate(p.region, "", 0.0, p.predicted_ttft_s, 0.0, prompt_tokens, p.cached_tokens)
            for p in picks
        ]

    def _leave_edge(self, flight: Flight) -> None:
        assert self.edge is not None
        flight.is_edge = False
        self.edge.in_flight[flight.pop] -= 1

    def _end(self, flight: Flight, outcome: Outcome, done_s: float = 0.0) -> None:
        flight.is_ended = True
        # Breaks the flight ↔ job and flight ↔ turns cycles: freed now, not by the collector.
        flight.job = flight.turns = None
        is_edge = flight.is_edge
        if is_edge:
            self._leave_edge(flight)
        request = flight.request
        ttft_s = e2e_s = nan = float("nan")
        if outcome is Outcome.OK:
            ttft_s = flight.first_byte_s + flight.client_delay_s - request.arrival_s
            e2e_s = done_s - request.arrival_s
        region = flight.pick.region if flight.pick is not None else ""
        tier = TIER_NONE
        if self.edge is not None and self.edge.is_auto(request):
            tier = TIER_EDGE if is_edge else TIER_REGION
        resume_s = flight.longest_resume_s if flight.is_streaming and flight.num_resumes else nan
        model = flight.model if outcome is Outcome.OK else None
        self.recorder.record(
            request, outcome, region, flight.num_attempts, flight.num_resumes, ttft_s, e2e_s,
            resume_s, tier, model,
        )  # fmt: skip


def _has_capacity(model: str, picks: list[Pick]) -> bool:
    return bool(picks) and picks[0].has_capacity
