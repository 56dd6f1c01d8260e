"""`python -m control_plane.admin_cli key ...` against a real control plane on loopback (called
in-process through `main`): a key's model access, limits per model and budget set from a script,
its spend read back, and each bad value refused in one line."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import pytest
from admin_cli_runner import Cli, cli_fixture
from conftest import ControlPlaneClient

from control_plane.limit_reports import LimitLedger
from control_plane.limit_shares import LimitSharesConfig
from wire.limit_shares import ModelSpend, UsageReport

SMALL, LARGE = "smollm2-135m-instruct", "org/large-v2"


cli = cli_fixture("key")


async def key_view(cp: ControlPlaneClient, key_id: str) -> dict[str, Any]:
    keys = (await cp.http.get("/v1/keys", headers=cp.admin)).json()["keys"]
    view: dict[str, Any] = next(key for key in keys if key["id"] == key_id)
    return view


def create(run: Cli, secret_file: Path, *access: str) -> str:
    """A new key's id (`access`: its access flags)."""
    status, out, err = run(
        "create", "team-a", "--rpm=60", "--tpm=10000", f"--secret-file={secret_file}", *access
    )
    assert (status, err) == (0, ""), err
    key_id, done = out.removeprefix("key ").split(": ")
    assert done == f"created, secret written to {secret_file}"
    return key_id


@pytest.mark.asyncio
async def test_a_keys_access_limits_and_budget_from_the_command_line(
    cli: Cli, live_cp: ControlPlaneClient, tmp_path: Path
) -> None:
    run, secret_file = cli, tmp_path / "team-a.key"
    key_id = create(
        run,
        secret_file,
        f"--model={SMALL}",
        "--model=chat-default",
        f"--model-limit={SMALL}:10:1000",
        "--model-limit=chat-default:2:500",
        "--max-budget-tokens=5000",
        "--budget-period=30d",
    )
    assert secret_file.read_text().strip()  # the secret, printed nowhere
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    view = await key_view(live_cp, key_id)
    assert view["models"] == [SMALL, "chat-default"]
    assert view["model_limits"] == {
        SMALL: {"rpm": 10, "tpm": 1000},
        "chat-default": {"rpm": 2, "tpm": 500},
    }
    assert (view["max_budget_tokens"], view["budget_period"]) == (5000, "30d")

    # Only what is given changes.
    assert run("update", key_id, f"--model-limit={LARGE}:5:50") == (0, f"key {key_id}: updated", "")
    view = await key_view(live_cp, key_id)
    assert view["model_limits"] == {LARGE: {"rpm": 5, "tpm": 50}}
    assert view["models"] == [SMALL, "chat-default"] and view["max_budget_tokens"] == 5000
    assert run("update", key_id, "--all-models", "--no-model-limits", "--no-budget")[0] == 0
    view = await key_view(live_cp, key_id)
    assert (view["models"], view["model_limits"], view["max_budget_tokens"]) == (None, {}, None)

    run("update", key_id, "--max-budget-tokens=1000", "--budget-period=1d")
    ledger = LimitLedger(live_cp.services.store, LimitSharesConfig())
    spend = [ModelSpend(key_id=key_id, model=m, num_tokens=n) for m, n in ((SMALL, 30), (LARGE, 7))]
    await ledger.report(UsageReport(pop="new-york", spend=spend, spend_batch="b1"))
    status, out, err = run("spend", key_id)
    assert (status, err) == (0, "")
    assert out.splitlines() == [
        f"key {key_id}  37 of 1000 (963 left) per 1d",
        f"    {LARGE}  7",
        f"    {SMALL}  30",
    ]


@pytest.mark.asyncio
async def test_each_bad_value_is_refused_in_one_line(cli: Cli, tmp_path: Path) -> None:
    run = cli
    key_id = create(run, tmp_path / "k.key")
    refusals = {
        ("--model-limit=small:10",): "argument --model-limit: 'small:10' is not NAME:RPM:TPM",
        ("--model-limit=small:0:10",): "'small:0:10': RPM must be a whole number from 1 to",
        ("--model-limit=small:5:x",): "'small:5:x': TPM must be a whole number from 1 to",
        ("--model-limit=bad name:1:1",): "'bad name' is not a model name",
        ("--budget-period=7w", "--max-budget-tokens=5"): "a period is a whole number and a unit",
        ("--max-budget-tokens=5",): "give --max-budget-tokens and --budget-period together",
        ("--no-budget", "--budget-period=1d"): "--no-budget: not with --max-budget-tokens",
        ("--model-limit=a:1:1", "--model-limit=a:2:2"): "--model-limit: a name is given twice",
        ("--model=a", "--all-models"): "argument --all-models: not allowed with argument --model",
        (): "key update: give at least one of the access flags",
    }
    for flags, message in refusals.items():
        status, out, err = run("update", key_id, *flags)
        assert (status, out) == (2, ""), flags
        assert err.startswith("admin_cli: error: ") and message in err, err
        assert len(err.splitlines()) == 1, err
    assert run("spend", "key_nope") == (
        1,
        "",
        "admin_cli: error: key spend key_nope: 404 key 'key_nope' not found",
    )
    assert run("update", "../x", "--all-models")[2] == (
        "admin_cli: error: argument key: '../x' is not a key id"
    )
