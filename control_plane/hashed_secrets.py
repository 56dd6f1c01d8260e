"""Secrets (API keys, node and Envoy credentials) are shown once and stored as their hash."""

from __future__ import annotations

import hashlib


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()
