"""Each PoP's share of a key's limits (control_plane/limit_shares.py): known answers."""

from __future__ import annotations

import pytest

from control_plane.limit_shares import (
    PopDemand,
    decayed,
    demand_of,
    desired_shares,
    need_of,
    next_share,
    share_for,
)


def test_without_demand_every_pop_gets_an_equal_part() -> None:
    shares = desired_shares({"a": 0.0, "b": 0.0, "c": 0.0, "d": 0.0}, {}, floor=0.05)
    assert shares == pytest.approx({"a": 0.25, "b": 0.25, "c": 0.25, "d": 0.25})


def test_the_floor_is_spread_evenly_and_the_rest_follows_demand() -> None:
    # floor 0.06 over three PoPs: 0.02 each; the other 0.94 split 3:1:0.
    shares = desired_shares({"a": 3.0, "b": 1.0, "c": 0.0}, {}, floor=0.06)
    assert shares == pytest.approx({"a": 0.725, "b": 0.255, "c": 0.02})
    assert sum(shares.values()) == pytest.approx(1.0)


def test_a_pop_that_refused_a_request_gets_its_size_from_the_others() -> None:
    # b needs half the key; a and c give up the difference in proportion to 0.725 : 0.02.
    shares = desired_shares({"a": 3.0, "b": 1.0, "c": 0.0}, {"b": 0.5}, floor=0.06)
    assert shares["b"] == pytest.approx(0.5)
    assert shares["a"] == pytest.approx(0.5 * 0.725 / 0.745)
    assert shares["c"] == pytest.approx(0.5 * 0.02 / 0.745)
    # A need below the share changes nothing; needs over the whole key split all of it.
    assert desired_shares({"a": 1.0, "b": 1.0}, {"a": 0.1}, 0.1) == pytest.approx(
        {"a": 0.5, "b": 0.5}
    )
    assert desired_shares({"a": 1.0, "b": 0.0, "c": 0.0}, {"b": 0.9, "c": 0.6}, 0.1) == (
        pytest.approx({"a": 0.0, "b": 0.6, "c": 0.4})
    )


def test_a_decrease_is_granted_at_once_an_increase_only_into_room() -> None:
    assert next_share(0.1, claim=0.6, others=0.4) == pytest.approx(0.1)
    # The others still hold 0.66: 0.34 is free, of the 0.725 wanted.
    assert next_share(0.725, claim=0.33, others=0.66) == pytest.approx(0.34)
    # No room: the claim stays; a PoP without a share (joining) gets what it wants.
    assert next_share(0.725, claim=0.33, others=0.9) == pytest.approx(0.33)
    assert next_share(0.25, claim=None, others=1.0) == pytest.approx(0.25)


def test_shares_move_to_demand_without_ever_adding_up_to_more_than_one() -> None:
    # Three PoPs at a third each; the key's clients all move to "a". Each PoP reports in turn
    # and is granted its share against what the others hold at that moment.
    claims = {"a": 1 / 3, "b": 1 / 3, "c": 1 / 3}
    demands = {"a": 10.0, "b": 0.0, "c": 0.0}
    history = []
    for _ in range(3):
        for pop in ("a", "b", "c"):
            standing = {p: PopDemand(demands[p], 0.0, claims[p]) for p in claims}
            claims[pop] = share_for(pop, standing, floor=0.06)
            assert sum(claims.values()) <= 1.0 + 1e-12
        history.append(dict(claims))
    # Round 1: a cannot grow yet; b and c shrink to the floor. Round 2: a takes the room.
    assert history[0] == pytest.approx({"a": 1 / 3, "b": 0.02, "c": 0.02})
    assert history[1] == pytest.approx({"a": 0.96, "b": 0.02, "c": 0.02})
    assert history[2] == history[1]


def test_demand_and_need_as_fractions_of_the_key() -> None:
    assert demand_of(num_requests=6, num_tokens=100, rpm=60, tpm=10_000) == pytest.approx(0.1)
    assert demand_of(num_requests=1, num_tokens=5_000, rpm=60, tpm=10_000) == pytest.approx(0.5)
    assert need_of(None, rpm=60, tpm=10_000) == 0.0
    assert need_of(2_500, rpm=60, tpm=10_000) == pytest.approx(0.25)
    assert need_of(10, rpm=4, tpm=10_000) == pytest.approx(0.25)  # one request of four
    assert decayed(8.0, elapsed_s=6.0, half_life_s=2.0) == pytest.approx(1.0)
