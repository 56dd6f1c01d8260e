"""How many CPU threads a step runs on, learned from the steps themselves.

A step of few tokens is a run of small matmuls, each a parallel region that ends when its
slowest thread does. On a machine whose cores are shared (other processes, a server's event
loop), a thread that loses its core makes every region wait for a scheduler time slice: here a
1 x 576 @ 576 x 3072 matmul took 0.9 ms on one thread and 8-12 ms on two under load, while on a
quiet machine two threads read the weights about 1.7x faster than one. Which wins changes with
the load, so no rule fixed at start-up holds: each bucket of step sizes keeps the recent step
times of one thread and of all of them, runs the faster, and now and then tries the other
(less often each time it loses, so that a losing choice costs little; soon again after a try
that beat the current choice, until its recent times outvote the old ones). Steps of more tokens
than the largest bucket are compute-bound enough to always use every thread.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

import torch

_BUCKET_MAX_TOKENS = (1, 4, 16, 64)
_WINDOW = 5  # recent step times kept per choice; their median resists one-off stalls
_MIN_TRY_INTERVAL = 4  # steps between tries of the other choice, doubling up to the max
_MAX_TRY_INTERVAL = 256


@dataclass(slots=True)
class _Bucket:
    current: int
    other: int
    try_interval: int = _MIN_TRY_INTERVAL
    steps_since_try: int = 0
    recent_s: dict[int, deque[float]] = field(default_factory=dict)

    def choose(self) -> int:
        if not self.recent_s.get(self.other) or self.steps_since_try >= self.try_interval:
            return self.other
        return self.current

    def record(self, threads: int, elapsed_s: float) -> None:
        self.recent_s.setdefault(threads, deque(maxlen=_WINDOW)).append(elapsed_s)
        if threads == self.current:
            self.steps_since_try += 1
            return
        self.steps_since_try = 0
        current_s = statistics.median(self.recent_s.get(self.current) or [float("inf")])
        if statistics.median(self.recent_s[threads]) < current_s:
            self.current, self.other = threads, self.current
            self.try_interval = _MIN_TRY_INTERVAL
        elif elapsed_s < current_s:  # old samples outvote a good try: try again soon
            self.try_interval = _MIN_TRY_INTERVAL
        else:
            self.try_interval = min(2 * self.try_interval, _MAX_TRY_INTERVAL)


@dataclass(slots=True)
class StepThreadPolicy:
    """Chooses torch's intra-op thread count for each step by its number of tokens."""

    max_threads: int
    buckets: dict[int, _Bucket] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.buckets = {n: _Bucket(self.max_threads, 1) for n in _BUCKET_MAX_TOKENS}

    def _bucket(self, num_tokens: int) -> _Bucket | None:
        return next((self.buckets[n] for n in _BUCKET_MAX_TOKENS if num_tokens <= n), None)

    def choose(self, num_tokens: int) -> int:
        bucket = self._bucket(num_tokens)
        return self.max_threads if bucket is None else bucket.choose()

    def record(self, num_tokens: int, threads: int, elapsed_s: float) -> None:
        bucket = self._bucket(num_tokens)
        if bucket is not None:
            bucket.record(threads, elapsed_s)

    def apply(self, num_tokens: int) -> int:
        """Set torch's thread count for a step of `num_tokens`; return it (for `record`)."""
        threads = self.choose(num_tokens)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        return threads

    @classmethod
    def for_this_process(cls) -> StepThreadPolicy | None:
        """A policy over torch's current thread count; None where there is nothing to choose."""
        max_threads = torch.get_num_threads()
        return cls(max_threads) if max_threads > 1 else None
