"""`python -m node_agent`: settings precedence, one-line start-up errors, and SIGTERM draining a
real process to exit 0."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from node_helpers import MODEL_NAME, free_port, is_ready_at, node_agent_command, wait_until
from suite_env import child_env

from node_agent.__main__ import load_settings, main, parse_args

REPO_ROOT = Path(__file__).resolve().parents[2]
TOKEN = "node-token-for-tests-0123456789"


def test_flags_beat_env_beat_yaml_beat_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "node.yaml"
    config.write_text("port: 9100\nregion: eu-west\nmax_num_waiting_requests: 7\nmodel: m1\n")
    monkeypatch.setenv("MERIDIAN_NODE_AGENT_PORT", "9200")
    monkeypatch.setenv("MERIDIAN_NODE_AGENT_MODEL", "m2")
    monkeypatch.setenv("MERIDIAN_NODE_TOKEN", TOKEN)
    args = parse_args(
        ["--config", str(config), "--model", "m3", "--control-plane", "http://127.0.0.1:8080"]
    )
    settings = load_settings(args)
    assert settings.model == "m3"  # flag over env and YAML
    assert settings.port == 9200  # env over YAML
    assert settings.region == "eu-west"  # YAML over the default
    assert settings.max_num_waiting_requests == 7
    assert settings.heartbeat_interval_s == 1.0  # default
    assert settings.node_token is not None and settings.node_token.get_secret_value() == TOKEN
    assert settings.url == "http://127.0.0.1:9200"


def test_parallel_sizes_reach_the_engine() -> None:
    argv = ["--tensor-parallel-size", "3", "--pipeline-parallel-size", "2"]
    config = load_settings(parse_args(argv)).engine_config()
    assert (config.tensor_parallel_size, config.pipeline_parallel_size) == (3, 2)


def test_the_token_budgets_reach_the_engine() -> None:
    config = load_settings(parse_args([])).engine_config()
    assert (config.max_num_batched_tokens, config.max_num_prefill_only_tokens) == (512, 2048)
    argv = ["--max-num-batched-tokens", "256", "--max-num-prefill-only-tokens", "1024"]
    config = load_settings(parse_args(argv)).engine_config()
    assert (config.max_num_batched_tokens, config.max_num_prefill_only_tokens) == (256, 1024)


def test_the_quantization_reaches_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_settings(parse_args([])).engine_config().quantization == "auto"
    config = load_settings(parse_args(["--quantization", "int8"])).engine_config()
    assert config.quantization == "int8"
    monkeypatch.setenv("MERIDIAN_NODE_AGENT_QUANTIZATION", "none")
    assert load_settings(parse_args([])).engine_config().quantization == "none"


def test_the_kv_cache_dtype_reaches_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_settings(parse_args([])).engine_config().kv_cache_dtype == "auto"
    config = load_settings(parse_args(["--kv-cache-dtype", "fp8"])).engine_config()
    assert config.kv_cache_dtype == "fp8"
    monkeypatch.setenv("MERIDIAN_NODE_AGENT_KV_CACHE_DTYPE", "fp8")
    assert load_settings(parse_args([])).engine_config().kv_cache_dtype == "fp8"


@pytest.mark.parametrize(
    ("argv", "status", "needle"),
    [
        (["--quantization", "q8"], 2, "quantization"),
        (["--kv-cache-dtype", "int4"], 2, "kv_cache_dtype"),
        (["--tensor-parallel-size", "0"], 2, "tensor"),
        (["--pipeline-parallel-size", "0"], 2, "pipeline"),
        (["--model", "no-such-model"], 2, "no-such-model"),
        (["--port", "70000"], 2, "port"),
        (["--region", "Not A Region"], 2, "region"),
        (["--control-plane", "http://127.0.0.1:8080"], 2, "MERIDIAN_NODE_TOKEN"),
        (["--config", "/nonexistent/node.yaml"], 2, "no such file"),
        (["--consul", "ftp://x"], 2, "--consul"),
        (["--host", "0.0.0.0"], 2, "MERIDIAN_SERVING_TOKEN"),
        (["--host", "::"], 2, "MERIDIAN_SERVING_TOKEN"),
        (["--host", "10.1.2.3"], 2, "MERIDIAN_SERVING_TOKEN"),
    ],
)
def test_bad_configuration_fails_with_one_line(
    argv: list[str], status: int, needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == status
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("node_agent: error:")
    assert needle in err


def test_a_serving_token_from_the_env_lets_the_node_listen_beyond_loopback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MERIDIAN_SERVING_TOKEN", TOKEN)
    settings = load_settings(parse_args(["--host", "0.0.0.0"]))
    assert settings.serving_token is not None
    assert settings.serving_token.get_secret_value() == TOKEN
    assert TOKEN not in repr(settings)


def test_unknown_yaml_key_fails_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "node.yaml"
    config.write_text("prot: 9100\n")
    assert main(["--config", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "prot" in err


def test_port_in_use_fails_before_loading_the_model(
    smollm2_gguf: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        assert main(["--model", str(smollm2_gguf), "--port", str(port)]) == 1
        assert time.monotonic() - started < 2.0
    err = capsys.readouterr().err.strip()
    assert err == f"node_agent: error: cannot listen on 127.0.0.1:{port}: Address already in use"


@pytest.mark.slow
def test_sigterm_drains_in_flight_work_then_exits_zero(smollm2_gguf: Path) -> None:
    port = free_port()
    env = child_env()
    command = node_agent_command(
        smollm2_gguf,
        port,
        *("--region", "us-east", "--num-kv-blocks", "256", "--max-model-len", "1024"),
    )
    proc = subprocess.Popen(
        command,
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        # Loading, and building the kernel once.
        is_up = wait_until(lambda: proc.poll() is not None or is_ready_at(base), timeout_s=180)
        assert proc.poll() is None, proc.communicate()[0]
        assert is_up, "the node agent did not become ready"
        with httpx.Client(base_url=base, timeout=30) as http:
            body = {
                "model": MODEL_NAME,
                "prompt": "Count: one, two,",
                "max_tokens": 60,
                "ignore_eos": True,
                "stream": True,
            }
            with http.stream("POST", "/v1/completions", json=body) as stream:
                lines = (line for line in stream.iter_lines() if line)
                assert next(lines).startswith("data: {")
                proc.send_signal(signal.SIGTERM)
                with httpx.Client(base_url=base, timeout=5) as other:
                    assert wait_until(lambda: other.get("/ready").status_code == 503)
                    refused = other.post(
                        "/v1/completions", json={"model": MODEL_NAME, "prompt": "x"}
                    )
                    assert refused.status_code == 503
                    assert refused.json()["error"]["code"] == "draining"
                rest = list(lines)
            assert rest[-1] == "data: [DONE]"
            assert '"finish_reason":"length"' in rest[-2]
        assert proc.wait(timeout=20) == 0
        output = proc.communicate()[0]
        assert "draining (SIGTERM)" in output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
