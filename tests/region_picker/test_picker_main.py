"""`python -m region_picker`: flags to settings, and one line on stderr for a bad start."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from region_picker.__main__ import load_settings, main, parse_args


def test_flags_become_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MERIDIAN_GATEWAY_TOKEN", "gateway-secret")
    args = parse_args(
        [
            *("--region", "us-east", "--port", "9200", "--control-plane", "http://127.0.0.1:8080"),
            *("--model", "smollm2-135m-instruct", "--model", "big=/models/big.gguf"),
        ]
    )
    settings = load_settings(args)
    assert (settings.region, settings.port, settings.metrics_port) == ("us-east", 9200, 9101)
    assert settings.models == {
        "smollm2-135m-instruct": "smollm2-135m-instruct",
        "big": "/models/big.gguf",
    }
    assert settings.gateway_token.get_secret_value() == "gateway-secret"


def test_a_bad_configuration_exits_2_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("MERIDIAN_GATEWAY_TOKEN", raising=False)
    assert main(["--region", "us-east", "--control-plane", "http://127.0.0.1:8080"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert (
        line.startswith("region_picker: error: bad configuration:")
        and "MERIDIAN_GATEWAY_TOKEN" in line
    )
    monkeypatch.setenv("MERIDIAN_GATEWAY_TOKEN", "gateway-secret")
    assert main(["--region", "Not A Region", "--control-plane", "http://127.0.0.1:8080"]) == 2


def test_a_picker_listening_beyond_loopback_needs_the_serving_token(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("MERIDIAN_GATEWAY_TOKEN", "gateway-secret")
    monkeypatch.delenv("MERIDIAN_SERVING_TOKEN", raising=False)
    argv = ["--region", "us-east", "--host", "0.0.0.0", "--control-plane", "http://127.0.0.1:8080"]
    assert main(argv) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "MERIDIAN_SERVING_TOKEN" in line
    monkeypatch.setenv("MERIDIAN_SERVING_TOKEN", "serving-secret")
    token = load_settings(parse_args(argv)).serving_token
    assert token is not None and token.get_secret_value() == "serving-secret"


@pytest.mark.slow  # a fresh interpreter
def test_the_picker_loads_its_tokenizer_without_torch(smollm2_gguf: Path) -> None:
    # One picker a region: torch would add seconds to its start and ~300 MB to its memory.
    script = (
        "import sys; from region_picker.service import load_hashers; "
        f"hashers = load_hashers({{'m': {str(smollm2_gguf)!r}}}, 16); "
        "print(type(hashers['m']).__name__, 'torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    assert done.stdout.split() == ["PromptHasher", "False"]
