"""The two shared bearer tokens (operator, gateways), and generating them on loopback.

Node agents have no shared token: each has its own credential, minted through the admin API
(`control_plane.fleet.credentials`). On a loopback-only control plane (a developer's laptop, a
test), missing tokens are generated and kept in a token file next to the database (`<db>.tokens`,
mode 0600, env-file syntax), so that `set -a; . meridian-control-plane.db.tokens; set +a` gives
operators and gateways on the same machine their tokens, and a restart with the same `--db`
keeps them. Tokens are never logged.
"""

from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from control_plane.settings import Settings

logger = logging.getLogger(__name__)


class TokenKind(StrEnum):
    ADMIN = "admin"
    NODE = "node"
    GATEWAY = "gateway"


ENV_NAMES: dict[TokenKind, str] = {
    TokenKind.ADMIN: "MERIDIAN_ADMIN_TOKEN",
    TokenKind.NODE: "MERIDIAN_NODE_TOKEN",  # each node agent's own credential
    TokenKind.GATEWAY: "MERIDIAN_GATEWAY_TOKEN",
}
SHARED_KINDS = (TokenKind.ADMIN, TokenKind.GATEWAY)


@dataclass(frozen=True, slots=True)
class TokenSet:
    admin: str
    gateway: str

    def items(self) -> list[tuple[TokenKind, str]]:
        return [(TokenKind.ADMIN, self.admin), (TokenKind.GATEWAY, self.gateway)]


def read_token_file(path: Path) -> dict[TokenKind, str]:
    """Parse `MERIDIAN_*_TOKEN=value` lines; other lines are ignored."""
    by_env = {ENV_NAMES[kind]: kind for kind in SHARED_KINDS}
    found: dict[TokenKind, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        name, sep, value = line.strip().removeprefix("export ").partition("=")
        if sep and name in by_env and value:
            found[by_env[name]] = value
    return found


def _write_token_file(path: Path, tokens: dict[TokenKind, str]) -> None:
    text = "".join(f"{ENV_NAMES[kind]}={value}\n" for kind, value in sorted(tokens.items()))
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def resolve_tokens(settings: Settings) -> TokenSet:
    """Tokens from settings; on loopback, missing ones come from (or go to) the token file."""
    given: dict[TokenKind, str] = {}
    for kind, secret in (
        (TokenKind.ADMIN, settings.admin_token),
        (TokenKind.GATEWAY, settings.gateway_token),
    ):
        if secret is not None:
            given[kind] = secret.get_secret_value()
    if len(given) < len(SHARED_KINDS):
        # Settings validation already refused this off loopback.
        given.update(
            _loopback_tokens(settings.resolved_token_file, missing=set(SHARED_KINDS) - set(given))
        )
    return TokenSet(admin=given[TokenKind.ADMIN], gateway=given[TokenKind.GATEWAY])


def _loopback_tokens(path: Path, missing: set[TokenKind]) -> dict[TokenKind, str]:
    stored = read_token_file(path) if path.exists() else {}
    generated = {kind: secrets.token_urlsafe(32) for kind in missing if kind not in stored}
    if generated:
        _write_token_file(path, stored | generated)
    names = ", ".join(ENV_NAMES[kind] for kind in sorted(missing))
    logger.warning(
        "%s not set; serving on loopback only with tokens from %s (%s). "
        "Read them with: set -a; . %s; set +a",
        names,
        path.resolve(),
        "newly generated" if generated else "kept from a previous run",
        path.resolve(),
    )
    return {kind: (stored | generated)[kind] for kind in missing}
