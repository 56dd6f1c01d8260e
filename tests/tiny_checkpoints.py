"""Tiny checkpoints written by the tests themselves: a byte-level tokenizer and small random
transformers models of each supported family."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors

if TYPE_CHECKING:
    from transformers import PreTrainedModel

TINY_VOCAB = 97  # 94 printable characters and three special tokens


def write_tiny_tokenizer(folder: Path, *, bos_by_post_processor: bool = False) -> None:
    """A byte-level BPE tokenizer.json plus tokenizer_config.json, without transformers."""
    vocab = {chr(c): i for i, c in enumerate(range(33, 127))}
    backend = RustTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<s>", "</s>"])
    if bos_by_post_processor:
        backend.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", 94)]
        )
    backend.save(str(folder / "tokenizer.json"))
    config: dict[str, object] = {
        "bos_token": "<s>",
        "eos_token": {"content": "</s>", "special": True},
        "chat_template": "{% for m in messages %}{{ bos_token }}{{ m.content }}{% endfor %}",
    }
    if not bos_by_post_processor:
        config["add_bos_token"] = False
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def save_tiny_transformers_model(
    folder: Path, family: str, max_shard_size: str = "5GB", **overrides: Any
) -> PreTrainedModel:
    """A random fp32 transformers model of `family` (llama, qwen2, mistral), saved as an HF
    folder with the tiny tokenizer; returns the model, the reference for that folder."""
    import transformers

    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[family]
    settings: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    settings |= {"qwen2": {"tie_word_embeddings": True}, "mistral": {"sliding_window": None}}.get(
        family, {}
    )
    settings |= overrides
    torch.manual_seed(0)
    model = model_class(config_class(**settings))
    with torch.no_grad():  # transformers starts biases at zero, which would hide a lost bias
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(std=0.5)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    write_tiny_tokenizer(folder)
    return model.eval()
