"""The region's routable nodes as the control plane last reported them, less those whose cache
stream just broke (region_picker/node_streams.py), and what the picker sent each that a report
up to a heartbeat and a sweep old cannot count yet: the requests whose response has not started,
and the prompt tokens it sent to be prefilled in the last REPORT_LAG_S (a stream's response
starts as soon as the node admits it, long before a long prompt is prefilled). Sends of the
prompt's own prefix do not count against it: the node computes that prefix once, and a send
that has finished left it cached."""

from __future__ import annotations

import time
import urllib.parse
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, TypeVar

from region_picker.node_streams import NodeStreams
from region_picker.scoring import Candidate
from wire.region_nodes import NodeLoad, RegionNodes


def envoy_address(url: str) -> str | None:
    """host:port of a plain-HTTP node URL, what Envoy's original-destination cluster takes."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or parts.hostname is None:
        return None
    host = "127.0.0.1" if parts.hostname == "localhost" else parts.hostname
    host = f"[{host}]" if ":" in host else host
    return f"{host}:{parts.port or 80}"


_Key = TypeVar("_Key")

# How long a send may be missing from its node's report: a heartbeat (1 s) and the control
# plane's sweep that publishes it. Counted twice for a while after that, rather than not at all.
REPORT_LAG_S: Final = 2.0


@dataclass(slots=True)
class NodeBook:
    streams: NodeStreams = field(default_factory=NodeStreams)
    index: int = 0
    _loads: dict[str, NodeLoad] = field(default_factory=dict)
    clock: Callable[[], float] = time.monotonic
    _pending: dict[str, int] = field(default_factory=dict)
    # when, node, tokens to prefill, the prompt's first block hash (None: not hashed); and the
    # totals of those in the deque, by node and by (node, first block), kept as it changes.
    _sent: deque[tuple[float, str, int, bytes | None]] = field(default_factory=deque)
    _sent_to: dict[str, int] = field(default_factory=dict)
    _sent_of: dict[tuple[str, bytes | None], int] = field(default_factory=dict)

    def adopt(self, document: RegionNodes) -> set[str]:
        """The control plane's new document; returns the node ids that left."""
        loads = {n.node_id: n for n in document.nodes if envoy_address(n.url) is not None}
        gone = set(self._loads) - set(loads)
        for node_id in gone:
            self.streams.forget(node_id)
        self._loads = loads
        self.index = document.index
        return gone

    def candidates(self, model: str | None, prefix: bytes | None = None) -> list[Candidate]:
        """The nodes serving `model` (None: every node) that are not held out, for a prompt
        whose first block hashes to `prefix`."""
        self._expire_sends()
        return [
            Candidate(
                node_id=load.node_id,
                address=envoy_address(load.url) or "",
                block_size=load.block_size,
                kv_blocks_total=load.kv_blocks_total,
                kv_blocks_free=load.kv_blocks_free,
                num_running=load.num_running,
                num_waiting=load.num_waiting,
                num_waiting_prefill_tokens=load.num_waiting_prefill_tokens,
                num_running_prefill_tokens=load.num_running_prefill_tokens,
                num_sent_prefill_tokens=self._sent_ahead(load.node_id, prefix),
                num_pending=self._pending.get(load.node_id, 0),
                prefill_tokens_per_s=load.prefill_tokens_per_s,
                step_s=load.step_s,
            )
            for load in self._loads.values()
            if (model is None or load.model == model) and not self.streams.is_held_out(load.node_id)
        ]

    def note_sent(self, node_id: str, prefill_tokens: int, prefix: bytes | None = None) -> None:
        """A request sent to `node_id`, with this many prompt tokens it has not cached and
        `prefix` its first block's hash."""
        self._pending[node_id] = self._pending.get(node_id, 0) + 1
        self._sent.append((self.clock(), node_id, prefill_tokens, prefix))
        _add(self._sent_to, node_id, prefill_tokens)
        _add(self._sent_of, (node_id, prefix), prefill_tokens)

    def _sent_ahead(self, node_id: str, prefix: bytes | None) -> int:
        own = self._sent_of.get((node_id, prefix), 0) if prefix is not None else 0
        return self._sent_to.get(node_id, 0) - own

    def _expire_sends(self) -> None:
        since, sent = self.clock() - REPORT_LAG_S, self._sent
        while sent and sent[0][0] < since:
            _, node_id, count, prefix = sent.popleft()
            _add(self._sent_to, node_id, -count)
            _add(self._sent_of, (node_id, prefix), -count)

    def note_started(self, node_id: str) -> None:
        """A request sent to `node_id` has its response started, or ended without one."""
        count = self._pending.get(node_id, 0) - 1
        if count > 0:
            self._pending[node_id] = count
        else:
            self._pending.pop(node_id, None)


def _add(totals: dict[_Key, int], key: _Key, count: int) -> None:
    total = totals.get(key, 0) + count
    if total:
        totals[key] = total
    else:
        totals.pop(key, None)
