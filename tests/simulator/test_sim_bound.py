"""The bound (issue 37): each request's TTFT floor, worked out offline, is never beaten by any
policy, and the clairvoyant policies' best p99 is what the others are measured against."""

from __future__ import annotations

import numpy as np
import pytest

from simulator.bound import floor_ttfts_s, prefill_floor_s
from simulator.calibration import ServiceCalibration
from simulator.compare import CLAIRVOYANT, run_scenario, world_spec
from simulator.control import PopWatch
from simulator.oracle import DirectOracleChooser
from simulator.policies import POLICIES
from simulator.results import Outcome
from simulator.run import World
from simulator.scenarios import SCENARIOS

pytestmark = pytest.mark.slow  # whole simulated runs

CAL = ServiceCalibration()


def test_an_idle_nodes_prefill_is_one_batch_one_step_per_chunk() -> None:
    rate, step, budget = CAL.prefill_tokens_per_s, CAL.step_base_s, CAL.max_num_batched_tokens
    assert prefill_floor_s(CAL, 100) == pytest.approx(100 / rate + step)
    assert prefill_floor_s(CAL, 2 * budget) == pytest.approx(2 * budget / rate + 2 * step)


@pytest.mark.parametrize("scenario", ["surge", "region_failure", "model_fallback"])
@pytest.mark.parametrize("policy", POLICIES)
def test_no_answered_request_beats_its_floor(scenario: str, policy: str) -> None:
    spec = world_spec(SCENARIOS[scenario], 1, 400, CAL)
    floors = floor_ttfts_s(spec)
    recorder = World(spec, policy).run()
    ok = recorder.outcome == Outcome.OK
    assert np.all(recorder.ttft_s[ok] >= floors[ok] - 1e-9)


def test_the_bound_is_the_best_clairvoyant_p99() -> None:
    result = run_scenario(SCENARIOS["steady"], 0, 300, CAL, ["meridian", *CLAIRVOYANT])
    bound = result.bound
    assert bound is not None
    policy, p99_s = bound
    assert policy in CLAIRVOYANT
    assert p99_s == min(result.stats[p].ttft_p99_s for p in CLAIRVOYANT)
    assert result.to_json()["bound"] == {"policy": policy, "ttft_p99_s": p99_s}
    for stats in result.stats.values():
        assert stats.floor_p99_s <= stats.ttft_p99_s
    assert run_scenario(SCENARIOS["steady"], 0, 50, CAL, ["meridian"]).bound is None


def test_the_direct_oracle_goes_to_the_region_the_client_s_own_path_reaches_soonest() -> None:
    spec = world_spec(SCENARIOS["steady"], 0, 50, CAL)
    geography, request = spec.geography, spec.requests[0]
    world = World(spec, "oracle_direct")
    oracle = world.chooser
    assert isinstance(oracle, DirectOracleChooser)
    assert not oracle.is_via_pop and oracle.has_gateway  # fallbacks and resumes, as a gateway
    city = geography.cities[request.city]
    public_s = {
        name: geography.true_rtt_ms(city, site.location, is_public=True) / 1000.0
        for name, site in world.sites.items()
    }
    ranked = sorted(public_s, key=public_s.__getitem__)
    picks = oracle.order("", request, 0.0, 3)
    assert [pick.region for pick in picks] == ranked[:3]
    assert all(pick.predicted_ttft_s == public_s[pick.region] for pick in picks)
    assert all(pick.node is None for pick in picks)  # the region's picker chooses the node
    world.sites[ranked[0]].is_up = False  # then one tried already
    assert [pick.region for pick in oracle.order("", request, 0.0, 3, {ranked[1]})] == ranked[2:5]


def received_summaries(world: World) -> list[tuple[float, float]]:
    """(published at, received at) of each summary document a PoP's watch took in, the watch
    replayed in steps of 10 ms over the world's run."""
    published_s = dict(
        zip(map(id, world.control.documents), world.control.published_s, strict=True)
    )
    received = []
    for watch in world.chooser.watches.values():  # type: ignore[attr-defined]
        replay = PopWatch(world.control, watch.delay_s, poll_at_cp_s=watch.delay_s)
        held = None
        for tick in range(int(world.loop.now_s / 0.01)):
            document = replay.read(tick * 0.01)
            if document is not held and document is not None:
                received.append((published_s[id(document)], tick * 0.01))
            held = document
    return received


def test_oracle_meridian_routes_on_the_state_of_the_last_50_ms() -> None:
    """`meridian`'s rule on the true state: its PoPs take in summaries of beats 50 ms apart,
    each as it is published, where `meridian`'s come from beats a second apart, a way to the
    control plane and back later."""
    spec = world_spec(SCENARIOS["steady"], 0, 300, CAL)
    received = {}
    for policy in ("meridian", "oracle_meridian"):
        world = World(spec, policy)
        world.run()
        received[policy] = np.array(received_summaries(world))
    fresh, meridian = received["oracle_meridian"], received["meridian"]
    assert len(fresh) >= 3 * len(
        meridian
    )  # beats 20 times as often; a summary unchanged is not sent
    assert np.max(fresh[:, 1] - fresh[:, 0]) <= 0.01  # the replay's own step
    assert np.median(meridian[:, 1] - meridian[:, 0]) >= 0.02
