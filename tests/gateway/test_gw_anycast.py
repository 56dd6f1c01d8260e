"""The Anycast simulation: nearest announcing PoP wins; withdrawn PoPs' clients move on."""

from __future__ import annotations

import pytest

from gateway.anycast import Anycast, NoRouteError, moved, pops_at
from wire.geo import CITIES, LOCATIONS, rtt_ms

POPS = pops_at(["new-york", "london", "tokyo"], LOCATIONS)
CLIENTS = {name: CITIES[name] for name in ("toronto", "paris", "seoul", "chicago", "madrid")}


def test_each_client_reaches_its_nearest_pop() -> None:
    anycast = Anycast(POPS)
    assert anycast.catchments(CLIENTS) == {
        "toronto": "new-york",
        "chicago": "new-york",
        "paris": "london",
        "madrid": "london",
        "seoul": "tokyo",
    }
    route = anycast.reach(CITIES["paris"])
    assert route.rtt_ms == pytest.approx(rtt_ms(CITIES["paris"], LOCATIONS["london"]))


def test_a_withdrawn_pop_s_clients_move_to_the_next_nearest_and_come_back() -> None:
    anycast = Anycast(POPS)
    before = anycast.catchments(CLIENTS)
    anycast.withdraw("london")
    after = anycast.catchments(CLIENTS)
    assert moved(before, after) == {
        "paris": ("london", "new-york"),
        "madrid": ("london", "new-york"),
    }
    assert "london" not in anycast.announcing
    anycast.announce("london")
    assert anycast.catchments(CLIENTS) == before


def test_routes_are_ordered_by_path_length() -> None:
    routes = Anycast(POPS).routes(CITIES["chicago"])
    assert [r.pop for r in routes] == ["new-york", "london", "tokyo"]
    assert routes[0].rtt_ms < routes[1].rtt_ms < routes[2].rtt_ms


def test_no_announcing_pop_means_no_route() -> None:
    anycast = Anycast(pops_at(["tokyo"], LOCATIONS))
    anycast.withdraw("tokyo")
    with pytest.raises(NoRouteError):
        anycast.reach(CITIES["seoul"])


def test_unknown_pops_are_refused() -> None:
    with pytest.raises(KeyError):
        Anycast(POPS).withdraw("atlantis")
    with pytest.raises(ValueError):
        Anycast({})


def test_ties_go_to_the_first_name() -> None:
    same_place = {"b-pop": CITIES["paris"], "a-pop": CITIES["paris"]}
    assert Anycast(same_place).reach(CITIES["madrid"]).pop == "a-pop"
