"""The client's verdict on an engine core's signs of life (engine/core_liveness.py), on plain
values and a clock of the test's: silence past its limit, a step past its limit, an idle loop,
and the watcher's own stalls."""

from __future__ import annotations

from engine.core_liveness import LivenessLimits, LivenessWatch

LIMITS = LivenessLimits(max_silence_s=5.0, max_step_s=60.0)
SAMPLE_S = 0.25


def watch_for(watch: LivenessWatch, signs: list[tuple[int, int, bool]], start_s: float) -> float:
    """Sample `signs` one per SAMPLE_S from `start_s`; the time after the last."""
    now_s = start_s
    for sign in signs:
        assert watch.check(sign, now_s) is None
        now_s += SAMPLE_S
    return now_s


def test_a_process_that_stops_ticking_does_not_answer_past_the_silence_limit() -> None:
    watch = LivenessWatch(LIMITS)
    now_s = watch_for(watch, [(t, 3, False) for t in range(10)], 100.0)
    frozen = (9, 3, False)
    last_tick_s = now_s - SAMPLE_S
    while now_s - last_tick_s <= LIMITS.max_silence_s:
        assert watch.check(frozen, now_s) is None
        now_s += SAMPLE_S
    reason = watch.check(frozen, now_s)
    assert reason is not None and "no sign of life for 5.2 s" in reason
    assert watch.check((10, 3, False), now_s + SAMPLE_S) is None  # it ticks again


def test_a_long_step_is_no_silence_but_a_step_past_its_limit_is() -> None:
    watch = LivenessWatch(LIMITS)
    # One turn under way while the ticks go on: a long prefill.
    num_samples = int(LIMITS.max_step_s / SAMPLE_S)
    now_s = watch_for(watch, [(t, 7, True) for t in range(num_samples)], 0.0)
    reason = watch.check((num_samples, 7, True), now_s + SAMPLE_S)
    assert reason is not None and "one step of its loop has run for 60.2 s" in reason
    assert watch.check((num_samples + 1, 8, True), now_s + 2 * SAMPLE_S) is None  # the next turn


def test_an_idle_loop_waits_as_long_as_it_likes() -> None:
    watch = LivenessWatch(LIMITS)
    num_samples = int(2 * LIMITS.max_step_s / SAMPLE_S)
    watch_for(watch, [(t, 7, False) for t in range(num_samples)], 0.0)


def test_silence_counts_only_while_the_watcher_watched() -> None:
    watch = LivenessWatch(LIMITS)
    now_s = watch_for(watch, [(t, 1, True) for t in range(4)], 0.0)
    # The watcher itself stalled for 20 s (its process starved, the machine suspended): the
    # core, silent as long, gets a fresh start rather than a verdict.
    now_s += 20.0
    assert watch.check((3, 1, True), now_s) is None
    # Watched from then on, the same silence is a verdict once it has lasted the limit.
    watched_from_s = now_s
    while watch.check((3, 1, True), now_s) is None:
        now_s += SAMPLE_S
        assert now_s - watched_from_s <= LIMITS.max_silence_s + SAMPLE_S
    assert now_s - watched_from_s > LIMITS.max_silence_s
