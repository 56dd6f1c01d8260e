"""`python -m node_agent`: arguments → settings → logging → serve.

Exit status: 0 after a clean stop (SIGTERM drains first), 1 if the port is taken or the model
fails to load, 2 for bad flags or configuration (one line on stderr saying what is wrong).
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
from pathlib import Path

import yaml
from pydantic import ValidationError

from engine.errors import EngineError
from engine.model_store import resolve_model
from node_agent.app import create_app
from node_agent.consul import parse_consul_addr
from node_agent.server import NodeServer
from node_agent.settings import NodeAgentSettings, NodeConfigError
from wire import service_cli
from wire.connection_guard import bind_socket
from wire.validation import one_line

PROG = "node_agent"
logger = logging.getLogger(PROG)
_fail = functools.partial(service_cli.fail, PROG)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = service_cli.service_parser(
        PROG,
        "Meridian node agent: serves a model over the OpenAI API and reports its capacity to "
        "the control plane (token from MERIDIAN_NODE_TOKEN). With MERIDIAN_SERVING_TOKEN set, "
        "every /v1 request must carry it as `Authorization: Bearer`; a host other than "
        "loopback requires it.",
    )
    add = parser.add_argument
    add("--config", dest="config_file", type=Path, help="YAML file of settings (lowest priority)")
    add("--model", help="model name (see `python -m engine pull`) or path to a GGUF / HF folder")
    add("--served-model-name", help="the name clients use (default: the model name)")
    service_cli.add_listen_flags(parser, default_port=9001)
    add("--region", help="region this node serves in (default local)")
    add("--node-id", help="this node's id (default: host name and port)")
    add("--advertise-url", help="URL others reach this node at (default http://HOST:PORT)")
    service_cli.add_control_plane_flags(parser)
    add("--tensor-parallel-size", type=int, help="GPUs per pipeline stage (default 1)")
    add("--pipeline-parallel-size", type=int, help="pipeline stages per replica (default 1)")
    add("--picker-url", help="the region picker to stream prefix-cache events to (HOST:PORT URL)")
    add("--consul", help="Consul agent address (HOST:PORT) to register this node with")
    add("--heartbeat-interval", dest="heartbeat_interval_s", type=float, help="seconds (1)")
    add("--max-num-waiting-requests", type=int, help="waiting-queue bound before 429 (256)")
    add("--kv-cache-gib", type=float, help="KV cache size on CPU, in GiB (2)")
    add("--kv-cache-dtype", help="the KV cache's element type: auto (the model's dtype) or fp8")
    add("--num-kv-blocks", type=int, help="KV cache size in blocks (overrides the GiB)")
    add("--max-model-len", type=int, help="context length cap, in tokens")
    add("--max-num-seqs", type=int, help="most requests in one batch (64)")
    add("--max-num-batched-tokens", type=int, help="most tokens in one step (512)")
    add(
        "--max-num-prefill-only-tokens",
        type=int,
        help="most tokens in a step while no request decodes yet (2048)",
    )
    add("--dtype", help="auto, float32, bfloat16 or float16")
    add("--quantization", help="weights kept as the dtype (none), int8 or q4_1 (auto)")
    add(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        help="run the engine core in its own process (default; --no-engine-process: a thread)",
    )
    add("--drain-timeout", dest="drain_timeout_s", type=float, help="seconds to finish in flight")
    service_cli.add_log_level_flag(parser)
    return parser.parse_args(argv)


def load_settings(args: argparse.Namespace) -> NodeAgentSettings:
    return NodeAgentSettings(**vars(args))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        settings = load_settings(args)
        settings.engine_config()
        if settings.consul:
            parse_consul_addr(settings.consul)
        resolve_model(settings.model)
    except ValidationError as exc:
        return _fail(f"bad configuration: {one_line(exc)}", 2)
    except (NodeConfigError, EngineError, ValueError) as exc:
        return _fail(str(exc), 2)
    except yaml.YAMLError as exc:
        return _fail(f"--config: not valid YAML: {exc}", 2)
    try:
        sock = bind_socket(settings.host, settings.port)
    except OSError as exc:
        return _fail(service_cli.cannot_listen(settings.host, settings.port, exc), 1)
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    app = create_app(settings)
    server = NodeServer(app, settings)
    logger.info(
        "node %s (region %s) listening on %s; loading %s",
        app.state.runtime.node_id,
        settings.region,
        settings.url,
        settings.model,
    )
    server.run(sockets=[sock])
    if app.state.runtime.load_error is not None:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
