"""Typed access to a GGUF file's key/value metadata (shared by the tokenizer and the loader)."""

from __future__ import annotations

from pathlib import Path

from gguf import GGUFReader, GGUFValueType

from engine.errors import UnsupportedModelError


def open_gguf(path: Path) -> GGUFReader:
    """Memory-map a GGUF file; a file that is not GGUF is an unsupported checkpoint."""
    try:
        return GGUFReader(path)
    except (ValueError, OSError) as exc:
        raise UnsupportedModelError(f"{path} is not a readable GGUF file: {exc}") from exc


class GGUFMetadata:
    """Reads metadata values, checking each value's type, since the file is untrusted input."""

    def __init__(self, reader: GGUFReader) -> None:
        self.reader = reader

    def has(self, key: str) -> bool:
        return key in self.reader.fields

    def string(self, key: str) -> str | None:
        value = self._scalar(key)
        if value is not None and not isinstance(value, str):
            raise self._bad(key, "a string")
        return value

    def integer(self, key: str) -> int | None:
        value = self._scalar(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._bad(key, "an integer")
        return value

    def number(self, key: str) -> float | None:
        value = self._scalar(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self._bad(key, "a number")
        return float(value)

    def boolean(self, key: str) -> bool | None:
        value = self._scalar(key)
        if value is not None and not isinstance(value, bool):
            raise self._bad(key, "a boolean")
        return value

    def strings(self, key: str) -> list[str] | None:
        values = self._array(key)
        if values is None:
            return None
        checked = [v for v in values if isinstance(v, str)]
        if len(checked) != len(values):
            raise self._bad(key, "an array of strings")
        return checked

    def integers(self, key: str) -> list[int] | None:
        values = self._array(key)
        if values is None:
            return None
        checked = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
        if len(checked) != len(values):
            raise self._bad(key, "an array of integers")
        return checked

    def _scalar(self, key: str) -> object:
        field = self.reader.fields.get(key)
        if field is None:
            return None
        if field.types and field.types[0] == GGUFValueType.ARRAY:
            raise self._bad(key, "a single value")
        value: object = field.contents()
        return value

    def _array(self, key: str) -> list[object] | None:
        field = self.reader.fields.get(key)
        if field is None:
            return None
        if not field.types or field.types[0] != GGUFValueType.ARRAY:
            raise self._bad(key, "an array")
        values = field.contents()
        return list(values)

    def _bad(self, key: str, expected: str) -> UnsupportedModelError:
        return UnsupportedModelError(f"GGUF metadata {key!r} is not {expected}")
