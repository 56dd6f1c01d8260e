"""The engine's exceptions: one tree, so that servers can map each kind to a status."""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class ModelNotFoundError(EngineError):
    """The model name is not pulled and the path does not exist."""


class UnsupportedModelError(EngineError):
    """The checkpoint has an architecture, quantisation or feature the engine does not support."""


class InvalidRequestError(EngineError, ValueError):
    """A request the engine cannot run: empty or too-long prompt, bad sampling values."""


class RequestRejected(InvalidRequestError):
    """A request refused by the check at the engine's front (engine/request_limits.py).

    `param` names the argument at fault as the engine calls it ("prompt", "max_tokens",
    "resumed_token_ids", "stop_token_ids", "cache_salt"), so that a server can name its own field
    without reading `message`; `exceeds_context` marks a request that does not fit the context.
    """

    def __init__(self, param: str, message: str, exceeds_context: bool = False):
        super().__init__(message)
        self.param = param
        self.message = message
        self.exceeds_context = exceeds_context

    def __reduce__(self) -> tuple[type[RequestRejected], tuple[str, str, bool]]:
        # Pickled (across a process's pipe), it is rebuilt from its fields, not from `args`.
        return type(self), (self.param, self.message, self.exceeds_context)


class EngineDeadError(EngineError):
    """The engine loop or one of its workers has failed; no request can complete."""


class WorkerStartupError(EngineDeadError):
    """A parallel worker died while starting, before it could join the others."""
