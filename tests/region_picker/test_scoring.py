"""The picker's scoring, by known answers: cached prefix against load, near ties, and the
approximate cache view (what the picker routed where)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from region_picker.routed_prefixes import RoutedPrefixes
from region_picker.scoring import (
    RUNNING_REQUEST_TOKENS,
    WAITING_REQUEST_TOKENS,
    Candidate,
    deflects,
    pick,
    score,
)


def node(node_id: str, **load: float) -> Candidate:
    values = {"block_size": 16, "kv_blocks_total": 1000, "kv_blocks_free": 1000} | load
    return Candidate(node_id=node_id, address=f"127.0.0.1:{9000 + len(node_id)}", **values)


class Held:
    """A cache view by hand: node -> how many leading blocks it holds."""

    def __init__(self, **held: int) -> None:
        self.held = held

    def cached_prefix_blocks(self, node_id: str, block_hashes: Sequence[bytes]) -> int:
        return min(self.held.get(node_id, 0), len(block_hashes))


BLOCKS = [bytes([i]) * 16 for i in range(100)]  # a 1,600-token prompt


def test_cost_is_the_work_ahead_in_tokens_scaled_past_the_kv_knee() -> None:
    idle = node("a")
    assert score(idle, num_blocks=100, cached_blocks=0) == 1600
    assert score(idle, num_blocks=100, cached_blocks=90) == 160
    busy = node(
        "b",
        num_waiting=2,
        num_running=3,
        num_waiting_prefill_tokens=500,
        num_running_prefill_tokens=300,
        num_sent_prefill_tokens=1000,
        num_pending=1,
    )
    expected = 160 + 500 + 300 + 1000 + 3 * WAITING_REQUEST_TOKENS + 3 * RUNNING_REQUEST_TOKENS
    assert score(busy, 100, 90) == expected
    half_full = node("c", kv_blocks_free=500)  # below KV_KNEE: no cost
    assert score(half_full, 100, 90) == 160
    assert score(node("d", kv_blocks_free=100), 100, 90) == pytest.approx(160 * (1 + 0.2 / 0.3))
    assert score(node("e", kv_blocks_free=0), 100, 90) == 320


def test_a_measured_step_time_counts_a_step_for_its_own_token_and_each_request_ahead() -> None:
    # 2 waiting and 1 sent: 4 steps of 0.05 s at 1,000 tokens/s, 200 tokens; the 30 running
    # requests are in the step time, not counted again.
    busy = node(
        "a",
        prefill_tokens_per_s=1000.0,
        step_s=0.05,
        num_waiting=2,
        num_pending=1,
        num_running=30,
    )
    assert score(busy, 100, 90, mean_rate=1000.0, mean_step_s=0.05) == pytest.approx(160 + 200)
    # One that has measured no step yet is taken at the candidates' mean.
    unmeasured = node("b", prefill_tokens_per_s=1000.0, num_waiting=2, num_pending=1)
    assert score(unmeasured, 100, 90, mean_rate=1000.0, mean_step_s=0.1) == pytest.approx(560)


def test_an_idle_node_of_slow_steps_loses_a_short_prompt_to_a_busier_fast_one() -> None:
    short = BLOCKS[:4]  # 64 tokens: a step costs more than its prefill
    fast = {"prefill_tokens_per_s": 3000.0, "num_waiting": 1}
    slow = {"prefill_tokens_per_s": 1000.0}
    # At the mean of 2,000 tokens/s: a (2 steps of 0.05 s) (64 + 300) * 2/3, b (1 of 0.2 s)
    # (64 + 200) * 2.
    nodes = [node("a", step_s=0.05, **fast), node("b", step_s=0.2, **slow)]
    decision = pick(nodes, short, Held(), random.Random(0))
    assert decision is not None and decision.chosen.candidate.node_id == "a"
    assert [s.cost for s in decision.scored] == pytest.approx([364 * 2 / 3, 528])
    # Without step times the guess (a request's worth for the one waiting) sends it to b.
    blind = [node("a", **fast), node("b", **slow)]
    decision = pick(blind, short, Held(), random.Random(0))
    assert decision is not None and decision.chosen.candidate.node_id == "b"


def test_a_faster_node_costs_less_and_one_not_measured_is_taken_at_the_mean() -> None:
    # a prefills at 2,000 tokens/s, b at 1,000 with half a's queue, c has not measured yet.
    nodes = [
        node("a", prefill_tokens_per_s=2000.0, num_waiting_prefill_tokens=1200),
        node("b", prefill_tokens_per_s=1000.0, num_waiting_prefill_tokens=600),
        node("c", num_waiting_prefill_tokens=1000),
    ]
    decision = pick(nodes, BLOCKS, Held(), random.Random(0))
    assert decision is not None
    # At the mean of 1,500 tokens/s: a's 2,800 tokens of work cost 2,100, b's 2,200 cost 3,300,
    # c's 2,600 stay 2,600.
    assert [s.cost for s in decision.scored] == [2100, 3300, 2600]
    assert decision.chosen.candidate.node_id == "a"


def test_the_winners_wait_is_its_work_at_its_own_rate_and_a_sooner_alternative_takes_it() -> None:
    nodes = [
        node("a", prefill_tokens_per_s=2000.0, num_waiting_prefill_tokens=1200),
        node("b", prefill_tokens_per_s=1000.0, num_waiting_prefill_tokens=600),
    ]
    decision = pick(nodes, BLOCKS, Held(), random.Random(0))
    assert decision is not None and decision.chosen.candidate.node_id == "a"
    assert decision.wait_s == pytest.approx(2800 / 2000)  # its 2,800 tokens of work
    assert deflects(decision, 1.3) and not deflects(decision, 1.5)
    assert not deflects(decision, None)  # no gateway's alternative: the region keeps it
    # Nodes that have measured no rate cannot tell how long they would take: kept.
    busy = node("c", num_waiting_prefill_tokens=9000)
    unmeasured = pick([busy], BLOCKS, Held(), random.Random(0))
    assert unmeasured is not None and unmeasured.wait_s is None
    assert not deflects(unmeasured, 0.0)


def test_the_node_holding_the_prompt_wins_against_modest_load() -> None:
    nodes = [node("a"), node("b", num_running=4), node("c")]
    decision = pick(nodes, BLOCKS, Held(b=95), random.Random(0))
    assert decision is not None
    assert decision.chosen.candidate.node_id == "b"
    assert decision.chosen.cached_blocks == 95 and decision.cached_tokens == 1520
    assert [s.cost for s in decision.scored] == [1600, 80 + 4 * RUNNING_REQUEST_TOKENS, 1600]


def test_a_loaded_node_loses_its_cache_advantage() -> None:
    # b holds the prompt but has 8 requests queued (2,048 tokens of work): a is cheaper.
    nodes = [node("a"), node("b", num_waiting=8)]
    decision = pick(nodes, BLOCKS, Held(b=100), random.Random(0))
    assert decision is not None and decision.chosen.candidate.node_id == "a"


def test_near_ties_go_to_the_less_busy_of_two_drawn() -> None:
    # Both hold the prompt; b has one running request more: a tie on cost, b is busier.
    nodes = [node("a"), node("b", num_running=1)]
    for seed in range(20):
        decision = pick(nodes, BLOCKS, Held(a=100, b=100), random.Random(seed))
        assert decision is not None and decision.chosen.candidate.node_id == "a"
    # Among three equal idle nodes, the draw spreads the choice.
    trio = [node("a"), node("b"), node("c")]
    chosen = set()
    for seed in range(30):
        decision = pick(trio, [], Held(), random.Random(seed))
        assert decision is not None
        chosen.add(decision.chosen.candidate.node_id)
    assert chosen == {"a", "b", "c"}


def test_of_near_ties_a_node_holding_the_prompt_wins_over_one_that_would_prefill_it() -> None:
    # b holds it behind 1,500 tokens of another prefill; a is idle and would prefill all 1,600:
    # 1,500 against 1,600 is a near tie, as soon either way, and a would cost the region 1,600.
    nodes = [node("a"), node("b", num_sent_prefill_tokens=1500)]
    for seed in range(20):
        decision = pick(nodes, BLOCKS, Held(b=100), random.Random(seed))
        assert decision is not None and decision.chosen.candidate.node_id == "b"
        assert [s.cost for s in decision.scored] == [1600, 1500]


def test_no_candidate_no_decision() -> None:
    assert pick([], BLOCKS, Held(), random.Random(0)) is None


def test_routed_prefixes_remember_where_a_prompt_went() -> None:
    routed = RoutedPrefixes(capacity=10)
    routed.record("a", BLOCKS[:4])
    assert routed.cached_prefix_blocks("a", BLOCKS[:6]) == 4
    assert routed.cached_prefix_blocks("b", BLOCKS[:6]) == 0
    # Over capacity the least recently sent go first, a chain's tail before its head.
    routed.record("b", BLOCKS[10:18])
    assert len(routed) == 10
    assert routed.cached_prefix_blocks("a", BLOCKS[:4]) == 2
    routed.forget("b")
    assert routed.cached_prefix_blocks("b", BLOCKS[10:18]) == 0 and len(routed) == 2
