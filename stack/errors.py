"""The stack's errors: each one is a single line for the person at the terminal."""

from __future__ import annotations


class StackError(Exception):
    """Something `meridian up|status|down` cannot do; `status` is the exit status."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


class StackConfigError(StackError):
    """The stack YAML is missing, unreadable or invalid."""

    def __init__(self, message: str) -> None:
        super().__init__(message, status=2)
