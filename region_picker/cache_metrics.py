"""The cache event streams in the picker's metrics: how many nodes' caches it knows, how big,
and what the streams did (read when scraped, from the receiver's counts and the index)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from region_picker.cache_index import CacheIndex
from region_picker.cache_receiver import ReceiverStats


class CacheStreamCollector(Collector):
    def __init__(self, stats: ReceiverStats, index: CacheIndex) -> None:
        self._stats = stats
        self._index = index

    def collect(self) -> Iterator[Metric]:
        known = [node_id for node_id in self._index.node_ids if self._index.is_known(node_id)]
        yield GaugeMetricFamily(
            "meridian_picker_cache_nodes_known",
            "Nodes whose prefix cache the picker knows exactly from their event streams",
            value=len(known),
        )
        blocks = GaugeMetricFamily(
            "meridian_picker_cache_blocks",
            "Blocks a streaming node's prefix cache holds, as its events say",
            labels=["node"],
        )
        for node_id in known:
            blocks.add_metric([node_id], len(self._index.hashes_of(node_id)))
        yield blocks
        stats = self._stats
        for name, text, value in (
            ("connections", "Cache event streams accepted", stats.num_connections),
            ("snapshots", "Snapshots received", stats.num_snapshots),
            ("deltas", "Batches of changes received", stats.num_deltas),
            ("gaps", "Batches out of turn, each answered with a resync", stats.num_gaps),
            (
                "invalid",
                "Streams closed for a frame that was not a valid message",
                stats.num_invalid,
            ),
            ("refused", "Streams refused for want of the serving token", stats.num_refused),
        ):
            yield CounterMetricFamily(f"meridian_picker_cache_stream_{name}", text, value=value)
