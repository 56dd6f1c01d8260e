"""Where the tests that start a whole stack put its ports, which a config fixes in advance: below
the kernel's ephemeral range. Ports other tests bind as port 0, and the source ports of their
connections, come from that range, so under xdist one of them could take a port of the block
between our check that it is free and the stack's bind."""

from __future__ import annotations

import random
from pathlib import Path

LOWEST_BASE = 10_000


def ephemeral_low() -> int:
    """The lowest port the kernel hands out on its own (32768 where it does not say)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def random_block_base(span: int, step: int = 10) -> int:
    """A random first port of `span` consecutive ports, all below the ephemeral range."""
    return random.randrange(LOWEST_BASE, ephemeral_low() - span, step)
