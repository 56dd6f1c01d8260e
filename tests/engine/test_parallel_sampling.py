"""Choice i of a request for `n` (engine/parallel_sampling.py): its own request id and seed
stream. Whether each choice's tokens come out as its own request's would depends on the
numerics of the steps it shares (tests/node_agent/test_choices.py checks them end to end)."""

from __future__ import annotations

from engine.parallel_sampling import choice_params, choice_request_id
from engine.sampling_params import SamplingParams


def test_choice_i_draws_from_seed_plus_i() -> None:
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=4)
    assert [choice_params(params, i).seed for i in range(3)] == [7, 8, 9]
    assert choice_params(params, 0) is params
    assert choice_params(params, 2).max_tokens == 4  # only the seed moves


def test_unseeded_choices_stay_unseeded() -> None:
    params = SamplingParams(temperature=1.0)
    assert all(choice_params(params, i).seed is None for i in range(3))


def test_a_lone_choice_keeps_the_request_s_id() -> None:
    assert choice_request_id("chat-1", 0, 1) == "chat-1"
    assert [choice_request_id("chat-1", i, 3) for i in range(3)] == [
        "chat-1-0",
        "chat-1-1",
        "chat-1-2",
    ]
