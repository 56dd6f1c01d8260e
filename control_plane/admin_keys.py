"""`admin_cli key ...`: API keys' model access, limits per model and budgets from scripts
(`control_plane.api.keys`).

key create NAME --rpm N --tpm N --secret-file FILE [--tenant T] [ACCESS]
key update KEY_ID ACCESS          only what is given changes
key spend KEY_ID                  the key's spend in its current period, per model

ACCESS: --model NAME (repeat: the models and aliases it may use; --all-models: every one),
--model-limit NAME:RPM:TPM (repeat: its limits on a model or an alias; --no-model-limits: none),
--max-budget-tokens N with --budget-period P (e.g. 1d, 30d, 12h, 3600s; --no-budget: none).

A new key's secret goes to FILE (mode 0600), never to the output, as node credentials do.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from control_plane.admin_client import AdminClient, AdminCliError, expect
from control_plane.admin_models import model_name
from control_plane.key_schemas import period_seconds
from wire.key_snapshot import MAX_RPM, MAX_TPM

PATH = "/v1/keys"
_KEY_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def key_id(value: str) -> str:
    """argparse type: a key id (also safe in a URL path)."""
    if not _KEY_ID.match(value):
        raise argparse.ArgumentTypeError(f"{value!r} is not a key id")
    return value


def _count(value: str, what: str, most: int) -> int:
    if not value.isdigit() or not 1 <= int(value) <= most:
        raise argparse.ArgumentTypeError(f"{what} must be a whole number from 1 to {most}")
    return int(value)


def model_limit(value: str) -> tuple[str, dict[str, int]]:
    """argparse type: `NAME:RPM:TPM` -> (NAME, {"rpm", "tpm"})."""
    name, sep, rest = value.rpartition(":")
    name, sep2, rpm = name.rpartition(":")
    if not (sep and sep2):
        raise argparse.ArgumentTypeError(f"{value!r} is not NAME:RPM:TPM")
    limits = {
        "rpm": _count(rpm, f"{value!r}: RPM", MAX_RPM),
        "tpm": _count(rest, f"{value!r}: TPM", MAX_TPM),
    }
    return model_name(name), limits


def budget_tokens(value: str) -> int:
    return _count(value, "--max-budget-tokens", 10**15)


def budget_period(value: str) -> str:
    """argparse type: a period as the control plane takes it (`1d`, `30d`, `12h`, `3600s`)."""
    try:
        period_seconds(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def add_parser(resources: Any) -> None:
    """The `key` resource and its actions, under the CLI's resources."""
    key = resources.add_parser("key", help="API keys: model access, limits per model, budgets")
    actions = key.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", help="create a key; its secret goes to a file")
    create.add_argument("name")
    create.add_argument("--rpm", type=lambda v: _count(v, "--rpm", MAX_RPM), required=True)
    create.add_argument("--tpm", type=lambda v: _count(v, "--tpm", MAX_TPM), required=True)
    create.add_argument("--tenant")
    create.add_argument(
        "--secret-file", type=Path, required=True, help="where the secret goes (mode 0600)"
    )
    _add_access(create)
    update = actions.add_parser("update", help="change a key's model access, limits or budget")
    update.add_argument("key", type=key_id)
    _add_access(update)
    spend = actions.add_parser("spend", help="a key's spend in its current period, per model")
    spend.add_argument("key", type=key_id)


# The repeatable access flags, each with the flag that clears what it sets: flag, dest, type,
# metavar, help; clearing flag, help.
_LISTS: tuple[tuple[str, str, Callable[[str], object], str, str, str, str], ...] = (
    (
        "--model", "models", model_name, "NAME",
        "a model or alias the key may use (repeat; default: every one)",
        "--all-models", "every model (clears the list)",
    ),
    (
        "--model-limit", "model_limits", model_limit, "NAME:RPM:TPM",
        "the key's limits on a model or alias, on top of its own (repeat)",
        "--no-model-limits", "no limits per model (clears them)",
    ),
)  # fmt: skip


def _add_access(parser: argparse.ArgumentParser) -> None:
    for flag, dest, kind, metavar, help_text, clear, clear_help in _LISTS:
        group = parser.add_mutually_exclusive_group()
        group.add_argument(
            flag, dest=dest, type=kind, action="append", metavar=metavar, help=help_text
        )
        group.add_argument(clear, action="store_true", help=clear_help)
    parser.add_argument("--max-budget-tokens", type=budget_tokens, help="tokens per period")
    parser.add_argument("--budget-period", type=budget_period, help="e.g. 1d, 30d, 12h, 3600s")
    parser.add_argument("--no-budget", action="store_true", help="clear the budget")


def access_of(args: argparse.Namespace) -> dict[str, Any]:
    """The key fields the access flags give (only those given)."""
    body: dict[str, Any] = {}
    if args.models is not None or args.all_models:
        body["models"] = args.models
    if args.model_limits is not None or args.no_model_limits:
        limits = dict(args.model_limits or [])
        if len(limits) != len(args.model_limits or []):
            raise AdminCliError("--model-limit: a name is given twice", 2)
        body["model_limits"] = limits if args.model_limits else None
    tokens, period = args.max_budget_tokens, args.budget_period
    if args.no_budget and (tokens is not None or period is not None):
        raise AdminCliError("--no-budget: not with --max-budget-tokens or --budget-period", 2)
    if (tokens is None) != (period is None):
        raise AdminCliError("give --max-budget-tokens and --budget-period together", 2)
    if tokens is not None or args.no_budget:
        body |= {"max_budget_tokens": tokens, "budget_period": period}
    return body


def run_key(client: AdminClient, args: argparse.Namespace) -> tuple[str, str | None]:
    """One `key` action: the lines to print, and for `create` the new key's secret."""
    if args.action == "spend":
        what = f"key spend {args.key}"
        spend = expect(client.call("GET", f"{PATH}/{args.key}/spend"), what, 200).json()
        return "\n".join(spend_lines(spend)), None
    access = access_of(args)
    if args.action == "update":
        if not access:
            raise AdminCliError("key update: give at least one of the access flags", 2)
        what = f"key update {args.key}"
        expect(client.call("PATCH", f"{PATH}/{args.key}", access), what, 200)
        return f"key {args.key}: updated", None
    body = {"name": args.name, "rpm": args.rpm, "tpm": args.tpm, **access}
    body |= {"tenant": args.tenant} if args.tenant else {}
    created = expect(client.call("POST", PATH, body), f"key create {args.name}", 201).json()
    return f"key {created['id']}: created, secret written to {args.secret_file}", created["secret"]


def spend_lines(spend: dict[str, Any]) -> list[str]:
    budget = spend["max_budget_tokens"]
    of = f" of {budget} ({spend['remaining_tokens']} left)" if budget is not None else ""
    lines = [f"key {spend['key']}  {spend['spent_tokens']}{of} per {spend['budget_period']}"]
    lines += [f"    {model}  {tokens}" for model, tokens in spend["models"].items()]
    return lines
