"""A node's model identity: the weights' hash over the files the engine loads, and the context,
dtype and quantization as the loaded engine resolved them (tiny checkpoints, loaded for real)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Literal

import pytest
from node_helpers import BackgroundLoop
from tiny_checkpoints import save_tiny_transformers_model

from engine.config import EngineConfig, WeightsFormat
from node_agent.model_identity import CHUNK_BYTES, weights_files, weights_id, weights_id_of
from node_agent.runtime import NodeRuntime
from node_agent.settings import NodeAgentSettings


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama in several safetensors shards."""
    folder = tmp_path_factory.mktemp("tiny") / "llama"
    save_tiny_transformers_model(folder, "llama", max_shard_size="100KB")
    return folder


def test_the_weights_id_hashes_every_shard_in_name_order_wherever_they_lie(
    tiny_folder: Path, tmp_path: Path
) -> None:
    shards = sorted(tiny_folder.glob("*.safetensors"))
    assert len(shards) > 1 and weights_files(tiny_folder) == shards
    expected = hashlib.sha256(b"".join(p.read_bytes() for p in shards)).hexdigest()[:32]
    assert weights_id_of(str(tiny_folder)) == expected
    copy = tmp_path / "same-weights-elsewhere"
    shutil.copytree(tiny_folder, copy)
    assert weights_id_of(str(copy)) == expected
    (copy / "README.md").write_text("not weights")  # only the weights count
    assert weights_id_of(str(copy)) == expected


def test_a_single_file_is_hashed_whole_across_reads(tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    data = bytes(range(256)) * (CHUNK_BYTES // 256 * 2 + 3)  # two reads and a short third
    gguf.write_bytes(data)
    assert weights_files(gguf) == [gguf]
    assert weights_id([gguf]) == hashlib.sha256(data).hexdigest()[:32]
    with pytest.raises(FileNotFoundError):
        weights_id(weights_files(tmp_path / "empty-folder-as-checkpoint"))


@pytest.mark.parametrize(
    ("quantization", "engine_process"),
    # The engine core's own process is a process start: not for `make test-fast`.
    [("int8", False), pytest.param("auto", True, marks=pytest.mark.slow)],
)
def test_a_loaded_node_reports_the_identity_the_engine_resolved(
    tiny_folder: Path,
    server_loop: BackgroundLoop,
    quantization: Literal["int8", "auto"],
    engine_process: bool,
) -> None:
    """In this process, and from the engine core's own process (what it resolved there)."""
    settings = NodeAgentSettings(
        model=str(tiny_folder),
        served_model_name="tiny",
        quantization=quantization,
        engine_process=engine_process,
        num_kv_blocks=4,  # 64 tokens: the pool caps the model's 128-token context
        region="us-east",
        node_id="n1",
    )
    runtime = NodeRuntime(settings)
    server_loop.run(runtime.load(), timeout_s=120)
    assert runtime.load_error is None and runtime.llm is not None
    try:
        config = EngineConfig(model=str(tiny_folder), quantization=quantization)
        expected = WeightsFormat.of(config.torch_dtype(), config.weight_quantization())
        identity = runtime.model_identity
        assert identity is not None and identity.quantization != "auto"
        assert (identity.dtype, identity.quantization) == (
            expected.dtype,
            expected.quantization,
        )
        assert identity.weights_id == weights_id_of(str(tiny_folder))
        assert identity.context_length == runtime.llm.max_model_len == 64
        beat = server_loop.call(runtime.heartbeat)
        assert beat is not None and beat.model_identity == identity and beat.model == "tiny"
    finally:
        server_loop.run(runtime.llm.shutdown())
