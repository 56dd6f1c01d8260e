"""How every Meridian CLI and config loader reports a pydantic validation error: one line."""

from __future__ import annotations

from pydantic import ValidationError


def one_line(exc: ValidationError) -> str:
    """`field.path: message; ...`, field names and messages only: input values may be tokens."""
    return "; ".join(
        f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" if err["loc"] else err["msg"]
        for err in exc.errors()
    )
