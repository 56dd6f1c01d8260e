"""Typed access to a GGUF file's key/value metadata (shared by the tokenizer and the loader)."""

from __future__ import annotations

from typing import TypeGuard, TypeVar

from engine.errors import UnsupportedModelError
from engine.gguf_file import GGUFFile

T = TypeVar("T")


def _is_kind(value: object, kind: type[T]) -> TypeGuard[T]:
    # A bool is an int to Python, but never an integer or a number in the file.
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


class GGUFMetadata:
    """Reads metadata values, checking each value's type, since the file is untrusted input."""

    def __init__(self, gguf: GGUFFile) -> None:
        self.fields = gguf.fields

    def has(self, key: str) -> bool:
        return key in self.fields

    def string(self, key: str) -> str | None:
        return self._scalar_of(key, str, "a string")

    def integer(self, key: str) -> int | None:
        return self._scalar_of(key, int, "an integer")

    def number(self, key: str) -> float | None:
        value = self._scalar(key)
        if value is None:
            return None
        if not (_is_kind(value, int) or _is_kind(value, float)):
            raise self._bad(key, "a number")
        return float(value)

    def boolean(self, key: str) -> bool | None:
        return self._scalar_of(key, bool, "a boolean")

    def strings(self, key: str) -> list[str] | None:
        return self._array_of(key, str, "an array of strings")

    def integers(self, key: str) -> list[int] | None:
        return self._array_of(key, int, "an array of integers")

    def _scalar_of(self, key: str, kind: type[T], expected: str) -> T | None:
        value = self._scalar(key)
        if value is None:
            return None
        if not _is_kind(value, kind):
            raise self._bad(key, expected)
        return value

    def _array_of(self, key: str, kind: type[T], expected: str) -> list[T] | None:
        values = self._array(key)
        if values is None:
            return None
        checked = [v for v in values if _is_kind(v, kind)]
        if len(checked) != len(values):
            raise self._bad(key, expected)
        return checked

    def _scalar(self, key: str) -> object:
        value = self.fields.get(key)
        if isinstance(value, list):
            raise self._bad(key, "a single value")
        return value

    def _array(self, key: str) -> list[object] | None:
        value = self.fields.get(key)
        if value is None:
            return None
        if not isinstance(value, list):
            raise self._bad(key, "an array")
        return value

    def _bad(self, key: str, expected: str) -> UnsupportedModelError:
        return UnsupportedModelError(f"GGUF metadata {key!r} is not {expected}")
