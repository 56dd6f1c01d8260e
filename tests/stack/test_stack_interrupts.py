"""`meridian up`'s signals: Ctrl-C or SIGTERM raises Interrupted once (a second one during the
stop is ignored), and the previous handlers come back after either block."""

from __future__ import annotations

import os
import signal

import pytest

from stack.interrupts import Interrupted, no_interrupts, signals_interrupt


def test_sigterm_interrupts_once_then_is_ignored_and_handlers_come_back() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with signals_interrupt(), pytest.raises(Interrupted, match="SIGTERM"):
        os.kill(os.getpid(), signal.SIGTERM)
    # Inside the block, the first signal set both to ignored; leaving it restored them.
    assert signal.getsignal(signal.SIGTERM) == before


def test_no_interrupts_ignores_both_signals_inside_only() -> None:
    before = signal.getsignal(signal.SIGINT)
    with no_interrupts():
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGINT)  # ignored: nothing raised
    assert signal.getsignal(signal.SIGINT) == before
