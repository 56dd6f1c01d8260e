"""What a node's model is beyond the name it serves it under: the `ModelIdentity` its heartbeats
carry, so that the control plane and the gateways know which nodes write the same text.

The weights' id is a hash of the weights file(s) the engine loads (a GGUF file, or a Hugging Face
folder's *.safetensors in name order), so the same file under two names or paths is the same
weights. Hashing a ~100 MB GGUF takes a fraction of a second of a core: done once, at start, on
the thread that loads the engine, never on the event loop.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from engine.async_engine import AsyncEngine
from engine.model_store import resolve_model
from wire.heartbeat import ModelIdentity

CHUNK_BYTES = 1 << 20
WEIGHTS_ID_BYTES = 16


def weights_files(checkpoint: Path) -> list[Path]:
    """The files holding a checkpoint's weights, in the order they are hashed."""
    if checkpoint.is_dir():
        return sorted(checkpoint.glob("*.safetensors"))
    return [checkpoint]


def weights_id(files: list[Path]) -> str:
    """The first 16 bytes of the SHA-256 over `files`' bytes, one after another, in hex."""
    if not files:
        raise FileNotFoundError("no weights files to identify the model by")
    digest = hashlib.sha256()
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    for path in files:
        with path.open("rb") as f:
            while size := f.readinto(buffer):
                digest.update(view[:size])
    return digest.digest()[:WEIGHTS_ID_BYTES].hex()


def weights_id_of(model: str) -> str:
    """The weights id of a model name or path, as the engine would resolve it (blocking: reads
    every byte of the weights)."""
    return weights_id(weights_files(resolve_model(model)))


def model_identity(weights_id: str, llm: AsyncEngine) -> ModelIdentity:
    """The identity of the model `llm` has loaded from weights of `weights_id`: its context and
    how it keeps and computes the weights, as the engine resolved them."""
    return ModelIdentity(
        weights_id=weights_id,
        context_length=llm.max_model_len,
        dtype=llm.weights_format.dtype,
        quantization=llm.weights_format.reported_quantization,
    )
