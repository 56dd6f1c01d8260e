"""The running picker: tokenizers loaded, the control plane followed, ext_proc and metrics
served."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from wsgiref.simple_server import WSGIServer

import aiohttp
import grpc
from prometheus_client import start_http_server
from websockets.asyncio.server import Server

from engine.model_store import resolve_model
from engine.tokenizer import Tokenizer
from region_picker.cache_index import CacheIndex, ExactOrGuessed
from region_picker.cache_metrics import CacheStreamCollector
from region_picker.cache_receiver import CacheEventReceiver
from region_picker.ext_proc import ExternalProcessor, serve
from region_picker.metrics import PickerMetrics
from region_picker.node_book import NodeBook
from region_picker.node_streams import NodeStreams
from region_picker.node_watch import NodeWatch
from region_picker.picker import Picker
from region_picker.prompt_hashes import PromptHasher
from region_picker.routed_prefixes import RoutedPrefixes
from region_picker.settings import PickerSettings

logger = logging.getLogger("region_picker")

DEFAULT_BLOCK_SIZE = 16  # the engine's, for a region with no node yet


def load_hashers(models: Mapping[str, str], block_size: int) -> dict[str, PromptHasher]:
    return {
        name: PromptHasher(checkpoint_tokenizer(resolve_model(source)), block_size)
        for name, source in models.items()
    }


def checkpoint_tokenizer(path: Path) -> Tokenizer:
    """A checkpoint's tokenizer alone (a .gguf file's, else a Hugging Face folder's): the
    engine's loader would open its weights too, and bring torch into the picker (1 s of its start,
    ~300 MB)."""
    if path.suffix.lower() == ".gguf":
        return Tokenizer.from_gguf(path)
    return Tokenizer.from_hf_folder(path)


@dataclass
class RunningPicker:
    server: grpc.aio.Server
    port: int  # ext_proc's
    metrics_server: WSGIServer
    session: aiohttp.ClientSession
    watcher: asyncio.Task[None]
    metrics: PickerMetrics
    cache_events: Server  # the nodes' streams into `cache_index`
    cache_index: CacheIndex

    @property
    def cache_events_port(self) -> int:
        return int(self.cache_events.sockets[0].getsockname()[1])

    @property
    def metrics_port(self) -> int:
        return int(self.metrics_server.server_address[1])

    async def stop(self) -> None:
        """Stop serving (again: a no-op)."""
        if self.watcher.done():
            return
        await self.server.stop(1.0)
        self.cache_events.close()
        await self.cache_events.wait_closed()
        self.watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.watcher
        await self.session.close()
        self.metrics_server.shutdown()
        self.metrics_server.server_close()


async def start(settings: PickerSettings) -> RunningPicker:
    """Follow the region's nodes (until the first answer), load the models' tokenizers, then
    serve ext_proc and metrics."""
    metrics = PickerMetrics()
    streams = NodeStreams()
    book, routed = NodeBook(streams), RoutedPrefixes(settings.routed_blocks)
    session = aiohttp.ClientSession()
    token = settings.gateway_token.get_secret_value()
    watch = NodeWatch(session, settings.control_plane, settings.region, token, book, routed)
    watcher = asyncio.create_task(watch.run())
    await watch.has_nodes.wait()
    sizes = {candidate.block_size for candidate in book.candidates(None)}
    block_size = min(sizes) if sizes else DEFAULT_BLOCK_SIZE
    hashers = await asyncio.to_thread(load_hashers, settings.models, block_size)
    cache_index = CacheIndex()
    serving_token = settings.serving_token
    receiver = CacheEventReceiver(
        cache_index, streams, None if serving_token is None else serving_token.get_secret_value()
    )
    cache_events = await receiver.serve(settings.host, settings.cache_events_port)
    metrics.registry.register(CacheStreamCollector(receiver.stats, cache_index))
    # Exact for the nodes that stream their caches' events, guessed from its own sends elsewhere.
    cache = ExactOrGuessed(cache_index, routed)
    picker = Picker(book, hashers, cache, routed, metrics, random.Random())
    server, port = await serve(ExternalProcessor(picker, metrics), settings.host, settings.port)
    metrics_server, _ = start_http_server(
        settings.metrics_port, settings.metrics_host, metrics.registry
    )
    running = RunningPicker(
        server, port, metrics_server, session, watcher, metrics, cache_events, cache_index
    )
    logger.info(
        "picker for %s: ext_proc on %s:%d, cache events on %d, metrics on http://%s:%d/metrics, "
        "models %s",
        settings.region,
        settings.host,
        port,
        running.cache_events_port,
        settings.metrics_host,
        running.metrics_port,
        ", ".join(hashers) or "none (load only)",
    )
    return running


async def run(settings: PickerSettings) -> None:
    running = await start(settings)
    try:
        await running.server.wait_for_termination()
    finally:
        await running.stop()
