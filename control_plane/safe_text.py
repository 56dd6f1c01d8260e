"""Names and labels that operators read: no character that hides or rearranges what is shown.

Control characters (Unicode category Cc), format characters (Cf: bidi overrides such as U+202E,
zero-width joiners) and line or paragraph separators (Zl U+2028, Zp U+2029) can make a key name,
a tenant or a node id look like another in a terminal, a log line or the audit log. They are
refused wherever the admin API takes a name or a label, in the body or the path, with a 400 in the
error shape (`control_plane.errors` turns the `unsafe_characters` validation error into it). The
check runs before a field's own pattern, so such a character gets this answer, not a pattern's.
"""

from __future__ import annotations

import unicodedata
from typing import Annotated, Final

from pydantic import BeforeValidator
from pydantic_core import PydanticCustomError

UNSAFE_CATEGORIES: Final = frozenset({"Cc", "Cf", "Zl", "Zp"})
ERROR_TYPE: Final = "unsafe_characters"


def first_unsafe(text: str) -> str | None:
    """The first character of `text` in an unsafe category, or None."""
    for char in text:
        if unicodedata.category(char) in UNSAFE_CATEGORIES:
            return char
    return None


def describe(char: str) -> str:
    """`U+202E (RIGHT-TO-LEFT OVERRIDE)`: the character named, never shown."""
    name = unicodedata.name(char, "")
    return f"U+{ord(char):04X}" + (f" ({name})" if name else "")


def refuse_unsafe(value: object) -> object:
    """A pydantic before-validator: non-strings pass on to the field's own checks."""
    if isinstance(value, str) and (char := first_unsafe(value)) is not None:
        raise PydanticCustomError(
            ERROR_TYPE,
            "must not contain control, format or separator characters; found {char}",
            {"char": describe(char)},
        )
    return value


# A path segment that names something (a region, a node, a key): looked up, so any other text is
# simply not found; only unsafe characters are refused outright.
SafePathName = Annotated[str, BeforeValidator(refuse_unsafe)]
