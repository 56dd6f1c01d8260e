"""The per-step thread policy, driven with step times as a loaded or a quiet machine gives them."""

from __future__ import annotations

import torch

from engine.step_threads import StepThreadPolicy


def run_steps(
    policy: StepThreadPolicy, num_tokens: int, step_s: dict[int, float], num_steps: int
) -> list[int]:
    """Step `num_steps` times, each taking step_s[threads]; the thread counts chosen."""
    chosen = []
    for _ in range(num_steps):
        threads = policy.choose(num_tokens)
        policy.record(num_tokens, threads, step_s[threads])
        chosen.append(threads)
    return chosen


def test_a_loaded_machine_settles_on_one_thread_and_rarely_tries_two() -> None:
    policy = StepThreadPolicy(max_threads=2)
    chosen = run_steps(policy, 1, {1: 0.2, 2: 2.0}, 300)
    assert chosen[-100:].count(2) <= 2  # tries back off as two threads keep losing
    assert chosen.count(1) > 280


def test_a_quiet_machine_keeps_every_thread() -> None:
    policy = StepThreadPolicy(max_threads=2)
    chosen = run_steps(policy, 1, {1: 0.035, 2: 0.020}, 200)
    assert chosen[-100:].count(2) >= 95


def test_the_choice_follows_the_load_when_it_moves() -> None:
    policy = StepThreadPolicy(max_threads=2)
    run_steps(policy, 1, {1: 0.2, 2: 2.0}, 300)  # loaded: one thread won, tries are rare
    quiet = run_steps(policy, 1, {1: 0.035, 2: 0.020}, 600)
    assert quiet[-50:] == [2] * 50


def test_each_bucket_of_step_sizes_learns_on_its_own() -> None:
    policy = StepThreadPolicy(max_threads=2)
    run_steps(policy, 1, {1: 0.1, 2: 1.0}, 100)  # single decodes: one thread wins
    run_steps(policy, 40, {1: 1.0, 2: 0.6}, 100)  # 40 tokens: two threads win
    assert policy.choose(1) == 1
    assert policy.choose(40) == 2


def test_big_steps_always_take_every_thread() -> None:
    policy = StepThreadPolicy(max_threads=4)
    chosen = run_steps(policy, 512, {1: 0.1, 4: 10.0}, 20)
    assert chosen == [4] * 20


def test_apply_sets_torchs_thread_count() -> None:
    before = torch.get_num_threads()
    try:
        policy = StepThreadPolicy(max_threads=2)
        run_steps(policy, 1, {1: 0.1, 2: 1.0}, 20)
        assert policy.apply(1) == 1 and torch.get_num_threads() == 1
        assert policy.apply(512) == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_one_thread_leaves_nothing_to_choose(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert StepThreadPolicy.for_this_process() is None
