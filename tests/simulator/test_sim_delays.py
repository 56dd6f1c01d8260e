"""The two kinds of path (issue 37): PoP-region hops ride a steady private backbone; a
client's own hops ride the public internet, with seeded jitter and loss."""

from __future__ import annotations

from simulator.delays import LOSS_PENALTY_S, OneWayDelays
from simulator.world import build_geography
from wire.geo import CITIES, REGIONS

GEO = build_geography(0)
TOKYO, SAO_PAULO, US_EAST = CITIES["tokyo"], CITIES["sao-paulo"], REGIONS["us-east"]


def test_through_a_pop_a_region_hop_is_the_backbones_and_always_the_same() -> None:
    delays = OneWayDelays(GEO, None, is_via_pop=True)
    hops = {delays.between(TOKYO, US_EAST) for _ in range(100)}
    assert hops == {GEO.true_rtt_ms(TOKYO, US_EAST) / 2000.0}


def test_straight_to_a_region_a_hop_is_the_public_paths_with_jitter_and_loss() -> None:
    delays = OneWayDelays(GEO, None, is_via_pop=False)
    base_s = GEO.true_rtt_ms(SAO_PAULO, US_EAST, is_public=True) / 2000.0
    hops = [delays.between(SAO_PAULO, US_EAST) for _ in range(5000)]
    assert min(hops) >= base_s
    assert len(set(hops)) == len(hops)  # jitter: every hop its own
    num_lost = sum(hop >= base_s + LOSS_PENALTY_S for hop in hops)
    assert 0 < num_lost < 5000 * 0.05  # a loss rate of 0.2-2%, plus long jitter tails
    again = OneWayDelays(GEO, None, is_via_pop=False)
    assert [again.between(SAO_PAULO, US_EAST) for _ in range(5000)] == hops  # seeded


def test_a_clients_hop_to_its_pop_is_public_in_every_world() -> None:
    delays = OneWayDelays(GEO, None, is_via_pop=True)
    base_s = GEO.true_rtt_ms(SAO_PAULO, TOKYO, is_public=True) / 2000.0
    hops = [delays.between(SAO_PAULO, TOKYO) for _ in range(50)]
    assert min(hops) >= base_s and len(set(hops)) > 1


def test_the_backbone_runs_closer_to_the_great_circle_than_public_paths() -> None:
    pairs = [(CITIES[c], REGIONS[r]) for c in CITIES for r in REGIONS]
    backbone = sum(GEO.true_rtt_ms(a, b) for a, b in pairs)
    public = sum(GEO.true_rtt_ms(a, b, is_public=True) for a, b in pairs)
    assert backbone < 0.9 * public
