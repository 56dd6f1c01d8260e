"""The JSON files of a Hugging Face checkpoint folder (config.json, tokenizer_config.json, the
safetensors index): each must hold one object; anything else is an unsupported checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

from engine.errors import UnsupportedModelError


def read_json_object(path: Path, missing_ok: bool = False) -> dict[str, object]:
    """The object in `path`; with `missing_ok`, {} for a file that is not there."""
    if missing_ok and not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UnsupportedModelError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise UnsupportedModelError(f"{path} is not a JSON object")
    return data
