"""Request ids, as every service takes them from `X-Request-Id`: the caller's, when it is safe to
echo in a header, write in a log line and forward to the next hop, else a new one.

Safe: 1 to 128 characters of [A-Za-z0-9._:-], which covers UUIDs, hex ids and the usual
`prefix:id` forms. Anything else (quotes, angle brackets, spaces, non-ASCII) is replaced, not
escaped: an id that was changed could not be found in the caller's own logs anyway.
"""

from __future__ import annotations

import re
import secrets
from typing import Final

HEADER: Final = "x-request-id"
MAX_REQUEST_ID_LEN: Final = 128
_SAFE = re.compile(rf"[A-Za-z0-9._:-]{{1,{MAX_REQUEST_ID_LEN}}}")


def is_safe_request_id(value: str) -> bool:
    return _SAFE.fullmatch(value) is not None


def request_id_from(given: str | None) -> str:
    """The caller's id if it is safe, else a new one (32 hex digits)."""
    if given is not None and is_safe_request_id(given):
        return given
    return secrets.token_hex(16)
