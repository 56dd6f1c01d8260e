"""The engine's exceptions: one tree, so that servers can map each kind to a status."""


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class ModelNotFoundError(EngineError):
    """The model name is not pulled and the path does not exist."""


class UnsupportedModelError(EngineError):
    """The checkpoint has an architecture, quantisation or feature the engine does not support."""


class InvalidRequestError(EngineError, ValueError):
    """A request the engine cannot run: empty or too-long prompt, bad sampling values."""


class EngineDeadError(EngineError):
    """The engine loop or one of its workers has failed; no request can complete."""


class WorkerStartupError(EngineDeadError):
    """A parallel worker died while starting, before it could join the others."""
