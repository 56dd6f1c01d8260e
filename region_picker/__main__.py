"""`python -m region_picker`: arguments → settings → logging → serve.

Exit status: 0 after SIGTERM or SIGINT, 2 for bad flags or configuration (one line on stderr).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import sys

from pydantic import ValidationError

from region_picker.service import run
from region_picker.settings import DEFAULT_PORT, PickerSettings
from wire import service_cli
from wire.validation import one_line

PROG = "region_picker"
_fail = functools.partial(service_cli.fail, PROG)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = service_cli.service_parser(
        PROG,
        "Meridian region picker: Envoy's ext_proc service that sends each request to the node "
        "of the region holding most of its prompt, against load. Its control-plane token "
        "comes from MERIDIAN_GATEWAY_TOKEN.",
    )
    parser.add_argument("--region", help="the region whose nodes it chooses among")
    service_cli.add_listen_flags(parser, default_port=DEFAULT_PORT)
    parser.add_argument("--metrics-host", help="address of /metrics (default 127.0.0.1)")
    parser.add_argument("--metrics-port", type=int, help="port of /metrics (default 9101)")
    parser.add_argument(
        "--cache-events-port", type=int, help="port of the nodes' cache event streams (9102)"
    )
    parser.add_argument("--control-plane", help="control plane URL, e.g. http://127.0.0.1:8080")
    parser.add_argument(
        "--model",
        action="append",
        dest="model_list",
        metavar="NAME[=CHECKPOINT]",
        help="a served model to tokenize prompts for (its checkpoint: a model store name or a "
        "path; default NAME); repeat for each",
    )
    service_cli.add_log_level_flag(parser)
    return parser.parse_args(argv)


def load_settings(args: argparse.Namespace) -> PickerSettings:
    values = vars(args)
    if "model_list" in values:
        pairs = [entry.partition("=") for entry in values.pop("model_list")]
        values["models"] = {name: source or name for name, _, source in pairs}
    return PickerSettings(**values)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        settings = load_settings(args)
    except ValidationError as exc:
        return _fail(f"bad configuration: {one_line(exc)}", 2)
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(name)s %(message)s")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
