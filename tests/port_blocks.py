"""Where the tests that start a whole stack put its ports, which a config fixes in advance: below
the kernel's ephemeral range. Ports other tests bind as port 0, and the source ports of their
connections, come from that range, so under xdist one of them could take a port of the block
between our check that it is free and the stack's bind."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

from stack.config import parse_config
from stack.errors import StackError
from stack.layout import StackLayout, check_ports_free, plan_layout

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


def free_stack_config(
    tmp_path: Path,
    text_at: Callable[[int], str],
    span: int,
    step: int = 10,
    use_envoy: bool = False,
    has_redis: bool = False,
) -> tuple[Path, StackLayout]:
    """A stack YAML, `text_at(base)` for a random block of `span` ports whose layout nothing
    holds now, written to `tmp_path/stack.yaml`, and that layout."""
    for _ in range(50):
        text = text_at(random_block_base(span, step))
        layout = plan_layout(parse_config(text), use_envoy=use_envoy, has_redis=has_redis)
        try:
            check_ports_free(layout)
        except StackError:
            continue
        path = tmp_path / "stack.yaml"
        path.write_text(text)
        return path, layout
    raise AssertionError("no free port range found")
