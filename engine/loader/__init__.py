"""Checkpoint loading: `load_checkpoint(path)` for a GGUF file or a Hugging Face folder."""

from __future__ import annotations

from pathlib import Path

from engine.errors import ModelNotFoundError, UnsupportedModelError
from engine.loader.checkpoint import Checkpoint, NamedTensors, expected_shapes
from engine.loader.gguf_loader import load_gguf
from engine.loader.hf_loader import load_hf_folder

__all__ = ["Checkpoint", "NamedTensors", "expected_shapes", "load_checkpoint"]


def load_checkpoint(path: Path) -> Checkpoint:
    """Open the checkpoint at `path`; tensors are read later, lazily, by `Checkpoint.tensors()`."""
    path = Path(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return load_gguf(path)
    if path.is_dir() and (path / "config.json").is_file():
        return load_hf_folder(path)
    if not path.exists():
        raise ModelNotFoundError(f"no checkpoint at {path}")
    raise UnsupportedModelError(
        f"{path} is neither a .gguf file nor a Hugging Face folder with config.json"
    )
