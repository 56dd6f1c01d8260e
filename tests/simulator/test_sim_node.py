"""The node service model on small cases whose timing can be worked out by hand."""

from __future__ import annotations

import pytest

from simulator.calibration import ServiceCalibration
from simulator.events import EventLoop
from simulator.node import Job, Node

# Round numbers: a step costs 50 ms + 10 ms per extra sequence; prefill runs at 1,000 tokens/s.
CAL = ServiceCalibration(
    prefill_tokens_per_s=1000.0,
    step_base_s=0.05,
    step_per_seq_s=0.01,
    max_num_seqs=2,
    max_num_batched_tokens=512,
    kv_blocks=100,
    block_size=16,
    max_cached_prefixes=4,
    max_num_waiting_requests=3,
)


class Timeline:
    def __init__(self) -> None:
        self.first: dict[str, float] = {}
        self.done: dict[str, float] = {}
        self.loop = EventLoop()

    def node(self, calibration: ServiceCalibration = CAL) -> Node:
        return Node(
            "n0",
            "r",
            calibration,
            self.loop,
            lambda job: self.first.__setitem__(str(job.owner), self.loop.now_s),
            lambda job: self.done.__setitem__(str(job.owner), self.loop.now_s),
        )


def job(name: str, prompt: int, output: int, prefix: str | None = None, prefix_tokens: int = 0):
    return Job(name, prompt, output, prefix, prefix_tokens)


def test_step_time_grows_with_the_batch() -> None:
    assert CAL.step_s(1) == pytest.approx(0.05)
    assert CAL.step_s(2) == pytest.approx(0.06)
    assert CAL.step_s(33) == pytest.approx(0.37)


def test_one_request_prefills_then_decodes_at_batch_one() -> None:
    t = Timeline()
    t.node().submit(job("a", 100, 11), 0.0)
    t.loop.run()
    assert t.first["a"] == pytest.approx(0.05 + 0.1)  # one step carrying a 100-token prefill
    assert t.done["a"] == pytest.approx(0.15 + 10 * 0.05)  # 10 more tokens, one per step


def test_prefill_slows_decoding_and_a_bigger_batch_steps_slower() -> None:
    t = Timeline()
    node = t.node()
    node.submit(job("a", 100, 11), 0.0)
    node.submit(job("b", 100, 11), 0.0)
    t.loop.run()
    assert t.first["a"] == pytest.approx(0.15)
    # b prefills in steps of 50 ms (a decoding) + 100 ms (its prompt); a gains one token.
    assert t.first["b"] == pytest.approx(0.30)
    assert t.done["a"] == pytest.approx(0.30 + 9 * 0.06)  # then both at batch 2
    assert t.done["b"] == pytest.approx(0.84 + 0.05)  # its last token alone, at batch 1


def test_a_long_prompt_is_prefilled_in_chunks_of_the_token_budget() -> None:
    t = Timeline()
    t.node().submit(job("a", 1024, 1), 0.0)
    t.loop.run()
    assert t.first["a"] == pytest.approx(2 * (0.05 + 0.512))
    assert t.done["a"] == t.first["a"]  # one token: done with the first


def test_a_cached_system_prompt_is_not_prefilled_again() -> None:
    t = Timeline()
    node = t.node()
    node.submit(job("a", 164, 1, "tenant", 64), 0.0)
    t.loop.run()
    assert t.first["a"] == pytest.approx(0.05 + 0.164)
    node.submit(job("b", 164, 1, "tenant", 64), 1.0)
    t.loop.run()
    assert t.first["b"] == pytest.approx(1.0 + 0.05 + 0.100)  # 4 whole blocks were cached


def test_requests_wait_for_a_sequence_slot() -> None:
    t = Timeline()
    node = t.node()
    for name in "abc":
        node.submit(job(name, 100, 2), 0.0)
    assert len(node.waiting) == 1  # max_num_seqs = 2
    t.loop.run()
    assert t.first["c"] > min(t.done["a"], t.done["b"])


def test_the_waiting_queue_bound_is_the_agents_429() -> None:
    t = Timeline()
    node = t.node()
    for name in "abc":
        node.submit(job(name, 100, 50), 0.0)
    assert node.is_overloaded()  # 3 without a first token (max_num_waiting_requests)


def test_an_aborted_request_frees_its_slot_and_never_answers() -> None:
    t = Timeline()
    node = t.node()
    a = job("a", 100, 5)
    node.submit(a, 0.0)
    assert node.abort(a, 0.01)
    t.loop.run()
    assert "a" not in t.first and node.free_blocks == CAL.kv_blocks


def test_a_dying_node_hands_back_every_request_it_held_and_finishes_none() -> None:
    t = Timeline()
    node = t.node()
    node.submit(job("a", 100, 50), 0.0)
    node.submit(job("b", 100, 50), 0.0)
    node.submit(job("c", 100, 50), 0.0)
    t.loop.run(until_s=0.2)  # a decodes, b is in prefill, c waits for a slot
    held = {str(j.owner): j.num_generated for j in node.fail(0.2)}
    assert held == {"a": 1, "b": 0, "c": 0}
    t.loop.run()
    assert "a" not in t.done and "b" not in t.first and "c" not in t.first


def test_a_dying_node_reports_the_tokens_each_stream_had_produced() -> None:
    t = Timeline()
    node = t.node()
    node.submit(job("a", 100, 50), 0.0)
    node.submit(job("b", 100, 50), 0.0)
    # a: first token at 0.15 s (50 ms + 100 ms of prefill), one more during b's prefill step,
    # b's first at 0.30 s; then steps of 60 ms at batch 2: five more each by 0.6 s.
    t.loop.run(until_s=0.6)
    streaming = {str(j.owner): j.num_generated for j in node.fail(0.6)}
    assert streaming == {"a": 7, "b": 6}


def test_the_oracles_prediction_waits_for_kv_blocks_as_admission_does() -> None:
    # a holds all 100 blocks (800 + 800 tokens): b is admitted only when a finishes (its
    # prefill, then 799 steps of 50 ms), and prefills 100 tokens in 0.15 s.
    t = Timeline()
    node = t.node()
    node.submit(job("a", 800, 800), 0.0)
    t.loop.run(1.0)
    predicted_s = node.predict_ttft_s(100, None, 0, 1.0)
    node.submit(job("b", 100, 2), 1.0)
    t.loop.run()
    assert t.first["b"] > 40.0
    assert 1.0 + predicted_s == pytest.approx(t.first["b"])
