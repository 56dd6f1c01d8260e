"""Shared fixtures: the real SmolLM2 GGUF, our checkpoint of it, and transformers' reference."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from engine.loader import Checkpoint, load_checkpoint
from engine.model_store import DEFAULT_MODEL, pull

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real SmolLM2-135M-Instruct GGUF from our model store, pulled on first use."""
    return pull(DEFAULT_MODEL, progress=lambda done, total: None, say=lambda message: None)


@pytest.fixture(scope="session")
def smollm2_checkpoint(smollm2_gguf: Path) -> Checkpoint:
    """Our loader's view of the real GGUF (config, tokenizer, lazy tensors)."""
    return load_checkpoint(smollm2_gguf)


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_gguf: Path) -> PreTrainedTokenizerBase:
    """transformers' tokenizer for the same GGUF: the reference ours must match."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="session")
def hf_smollm2_model(smollm2_gguf: Path) -> PreTrainedModel:
    """transformers' fp32 model for the same GGUF (about 20 s and 1 GB: load it once)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    )
    return model.eval()
