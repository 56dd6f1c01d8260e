"""`meridian`: the whole local fleet (`up`, `status`, `down`) and the model store (`pull`).

    meridian up [--config FILE] [--detach]   start the stack in stack/default.yaml (or FILE)
    meridian status                          the recorded processes and the fleet
    meridian down                            stop what `up` started, and nothing else
    meridian anycast [withdraw|announce POP] the Anycast front: PoPs announced, cities' routes
    meridian resolve --from CITY [--short]   the stack's DNS answer for a client in CITY
    meridian pull [NAME]                     fetch a model (default smollm2-135m-instruct)
    meridian chat|generate ...               the engine's own command line (python -m engine)

The state directory (PIDs, tokens, logs, TLS) is `--state-dir`, else $MERIDIAN_STACK_DIR, else
$MERIDIAN_HOME/stack (default ~/.cache/meridian/stack). Errors are one line on stderr; exit
status 0 done, 1 failed, 2 bad config or usage.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from stack.config import DEFAULT_MODEL
from stack.errors import StackError
from stack.state import default_state_dir

PROG = "meridian"
ENGINE_COMMANDS = ("chat", "generate")


def _say(message: str) -> None:
    """Progress for the person at the terminal; a closed stdout (`meridian up | head`) must not
    stop `up` halfway through starting or stopping the stack."""
    with contextlib.suppress(OSError):
        print(message, flush=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Meridian: a whole LLM serving fleet on this machine.",
        epilog="`meridian chat` and `meridian generate` run the engine's command line.",
    )
    state = argparse.ArgumentParser(add_help=False)
    state.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="where PIDs, tokens and logs are kept (default: $MERIDIAN_STACK_DIR, else "
        "$MERIDIAN_HOME/stack)",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", parents=[state], help="start the local fleet")
    up.add_argument("--config", type=Path, help="stack YAML (default: stack/default.yaml)")
    up.add_argument("--detach", action="store_true", help="return once ready; `down` stops it")
    commands.add_parser("status", parents=[state], help="show the processes and the fleet")
    commands.add_parser("down", parents=[state], help="stop what `up` started")
    anycast = commands.add_parser(
        "anycast", parents=[state], help="show, withdraw or announce PoPs on the Anycast front"
    )
    anycast.add_argument("action", nargs="?", choices=["withdraw", "announce"])
    anycast.add_argument("pop", nargs="?", help="the PoP to withdraw or announce")
    resolve = commands.add_parser(
        "resolve", parents=[state], help="the API name's DNS answer for a client city"
    )
    resolve.add_argument("--from", dest="city", required=True, help="a client city, e.g. tokyo")
    resolve.add_argument("--short", action="store_true", help="print the address only")
    pull = commands.add_parser("pull", help="fetch a model into the model store")
    pull.add_argument("name", nargs="?", default=DEFAULT_MODEL)
    return parser.parse_args(argv)


def _pull(name: str) -> int:
    from engine.errors import EngineError  # the engine loads torch: only for this command
    from engine.model_store import pull

    try:
        pull(name)
    except (EngineError, ValueError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in ENGINE_COMMANDS:
        from engine.__main__ import main as engine_main

        return engine_main(argv)
    args = parse_args(argv)
    if args.command == "pull":
        return _pull(args.name)
    if args.command == "anycast" and (args.action is None) != (args.pop is None):
        print(f"{PROG}: error: usage: meridian anycast [withdraw|announce POP]", file=sys.stderr)
        return 2
    state_dir = (args.state_dir or default_state_dir()).expanduser().absolute()
    try:
        if args.command == "up":
            from stack.up import UpOptions, up

            return up(UpOptions(args.config, state_dir, args.detach), _say)
        if args.command == "status":
            from stack.status import status

            return status(state_dir, _say)
        if args.command == "anycast":
            from stack.front_cli import anycast

            return anycast(state_dir, args.action, args.pop, _say)
        if args.command == "resolve":
            from stack.front_cli import resolve

            return resolve(state_dir, args.city, args.short, _say)
        from stack.down import down

        return down(state_dir, _say)
    except StackError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return exc.status


if __name__ == "__main__":
    sys.exit(main())
