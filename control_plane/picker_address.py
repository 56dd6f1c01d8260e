"""A region's endpoint picker address, "IP:PORT" ("[v6]:PORT" for IPv6): what Envoy's ext_proc
cluster connects to (control_plane/xds/picker.py), from the `region_pickers` setting or a
region's `picker` field."""

from __future__ import annotations

import ipaddress
from typing import Annotated

from pydantic import AfterValidator, Field


def picker_address(text: str) -> tuple[str, int] | None:
    """(IP, port) of "IP:PORT" ("[v6]:PORT" for IPv6), or None."""
    host, _, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return None
    return (host, int(port)) if port.isdigit() and 0 < int(port) < 65536 else None


def _checked(text: str) -> str:
    if picker_address(text) is None:
        raise ValueError(f"a picker is IP:PORT ([IPv6]:PORT), not {text!r}")
    return text


PickerAddress = Annotated[str, Field(min_length=3, max_length=64), AfterValidator(_checked)]
