"""Shared fixtures: the real SmolLM2 GGUF, our checkpoint of it, and transformers' reference; and
the `--unit` guard that keeps `make test-fast` to unit tests (its hooks live in unit_guard.py)."""

from __future__ import annotations

import fcntl
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from suite_env import pin
from unit_guard import (
    pytest_addoption,
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_runtest_makereport,
    pytest_runtest_protocol,
)

from engine.loader import Checkpoint, load_checkpoint
from engine.model import dense_matmul
from engine.model_store import DEFAULT_MODEL, pull

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

pytest_plugins = ("suite_gc", "worker_groups")

# Every engine a test starts (here or in a process it spawns) takes the pinned matmul crossover
# instead of timing its matmuls (tests/suite_env.py). Set it empty to probe.
pin()


@pytest.fixture(scope="session")
def smollm2_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real SmolLM2-135M-Instruct GGUF from our model store, pulled on first use (by one
    xdist worker: the others wait on the lock, then find it pulled)."""
    lock_path = tmp_path_factory.getbasetemp().parent / "smollm2-pull.lock"
    with lock_path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return pull(DEFAULT_MODEL, progress=lambda done, total: None, say=lambda message: None)


@pytest.fixture(scope="session")
def smollm2_checkpoint(smollm2_gguf: Path) -> Checkpoint:
    """Our loader's view of the real GGUF (config, tokenizer, lazy tensors)."""
    return load_checkpoint(smollm2_gguf)


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_gguf: Path) -> PreTrainedTokenizerBase:
    """transformers' tokenizer for the same GGUF, splitting text as the model's own
    tokenizer.json does: the reference ours must match.

    transformers does not know the GGUF's `tokenizer.ggml.pre = smollm` and falls back to
    GPT-2's split, which keeps a space and a number other than 0-9 in one piece: " ²" becomes
    "ĠÂ" + "²" (ids 3351, 127). SmolLM2's tokenizer.json (and llama.cpp's `smollm`) first puts
    every number on its own, so " " + "²" (ids 216, 19133), which is what the model was trained
    on; the vocabulary, merges and special tokens stay transformers' own reading of the file."""
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return tokenizer


@pytest.fixture
def few_probe_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bf16 kernel's range is measured once per weight shape over copies of the weight
    cycled through 64 MB, so that each call reads it from memory as a step does; a test's weight
    of a few bytes would be copied a million times (seconds a shape, in every worker). Over 1 MB
    the probes still run and may find any range, which the tests using this must hold for."""
    monkeypatch.setattr(dense_matmul, "_COLD_BYTES", 2**20)


@pytest.fixture(scope="session")
def hf_smollm2_model(smollm2_gguf: Path) -> PreTrainedModel:
    """transformers' fp32 model for the same GGUF (about 20 s and 1 GB: load it once)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    )
    return model.eval()


__all__ = [
    "pytest_addoption",
    "pytest_collection_modifyitems",
    "pytest_configure",
    "pytest_runtest_makereport",
    "pytest_runtest_protocol",
]
