"""Ctrl-C and SIGTERM for `meridian up`: while it starts and runs the stack they raise
Interrupted; while it stops the stack they are ignored, so the bounded ordered stop is never cut
short by a second Ctrl-C."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator
from types import FrameType

Handler = Callable[[int, FrameType | None], object] | int | signal.Handlers | None

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """Ctrl-C or SIGTERM: stop what was started."""


@contextlib.contextmanager
def _handled_by(handler: Handler) -> Iterator[None]:
    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, before in previous.items():
            signal.signal(sig, before)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    raise Interrupted(signal.Signals(signum).name)


def signals_interrupt() -> contextlib.AbstractContextManager[None]:
    """SIGINT and SIGTERM raise Interrupted (once: a stop in progress is not interrupted)."""
    return _handled_by(_interrupt)


def no_interrupts() -> contextlib.AbstractContextManager[None]:
    """SIGINT and SIGTERM are ignored (the ordered stop is bounded)."""
    return _handled_by(signal.SIG_IGN)
