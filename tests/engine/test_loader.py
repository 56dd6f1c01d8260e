"""Checkpoint loading from GGUF files and Hugging Face folders, checked against transformers."""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path
from typing import TYPE_CHECKING

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from safetensors.torch import save_file
from tiny_checkpoints import save_tiny_transformers_model, write_tiny_tokenizer

from engine.errors import ModelNotFoundError, UnsupportedModelError
from engine.loader import Checkpoint, expected_shapes, load_checkpoint
from engine.loader.hf_loader import config_from_hf
from engine.model.layer_ops import RotaryEmbedding
from engine.model_config import Llama3RopeScaling, ModelConfig
from engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# --- the real SmolLM2 GGUF against transformers ---


@pytest.mark.slow
def test_config_is_smollm2s(smollm2_checkpoint: Checkpoint) -> None:
    config = smollm2_checkpoint.config
    assert (config.architecture, config.num_layers, config.hidden_size) == ("llama", 30, 576)
    assert (config.intermediate_size, config.num_heads, config.num_kv_heads) == (1536, 9, 3)
    assert (config.head_dim, config.vocab_size, config.max_position_embeddings) == (64, 49152, 8192)
    assert config.rope_theta == 100000.0
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert config.tie_word_embeddings and not config.attention_bias
    assert len(smollm2_checkpoint.tensor_shapes) == 272


@pytest.mark.slow
def test_config_matches_transformers(
    smollm2_checkpoint: Checkpoint, hf_smollm2_model: PreTrainedModel
) -> None:
    ours, hf = smollm2_checkpoint.config, hf_smollm2_model.config
    assert ours.vocab_size == hf.vocab_size
    assert ours.hidden_size == hf.hidden_size
    assert ours.intermediate_size == hf.intermediate_size
    assert ours.num_layers == hf.num_hidden_layers
    assert ours.num_heads == hf.num_attention_heads
    assert ours.num_kv_heads == hf.num_key_value_heads
    assert ours.head_dim == hf.head_dim
    assert ours.rms_norm_eps == hf.rms_norm_eps
    assert ours.rope_theta == hf.rope_parameters["rope_theta"]
    assert ours.max_position_embeddings == hf.max_position_embeddings
    assert ours.tie_word_embeddings is bool(hf.tie_word_embeddings)


@pytest.mark.slow
def test_every_tensor_equals_transformers(
    smollm2_checkpoint: Checkpoint, hf_smollm2_model: PreTrainedModel
) -> None:
    reference = hf_smollm2_model.state_dict()
    assert inspect.isgenerator(smollm2_checkpoint.tensors())  # lazy: one tensor at a time
    seen: set[str] = set()
    num_params = 0
    for name, tensor in smollm2_checkpoint.tensors():
        assert tensor.dtype == torch.float32 and tensor.device.type == "cpu", name
        assert tensor.is_contiguous(), name
        assert torch.equal(tensor, reference[name]), name
        seen.add(name)
        num_params += tensor.numel()
    # Tied: transformers shows lm_head as an alias of the embedding; we do not yield it.
    assert seen == set(reference) - {"lm_head.weight"}
    assert round(num_params / 1e6, 1) == 134.5


@pytest.mark.parametrize("source", ["gguf", "safetensors"])
def test_a_pipeline_stage_reads_only_the_tensors_it_wants(
    smollm2_checkpoint: Checkpoint, tmp_path: Path, source: str
) -> None:
    checkpoint = smollm2_checkpoint
    if source == "safetensors":
        save_tiny_transformers_model(tmp_path, "llama")
        checkpoint = load_checkpoint(tmp_path)
    wanted = {"model.layers.1.mlp.up_proj.weight", "model.norm.weight"}
    assert [name for name, _ in checkpoint.tensors(wanted.__contains__)] == sorted(
        wanted, key=list(checkpoint.tensor_shapes).index
    )


# --- tiny GGUF files written here: quant types, Q/K permutation, errors ---

TINY = ModelConfig(
    architecture="llama", vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, max_position_embeddings=128,
    tie_word_embeddings=False,
    # GGUF stores it as float32, and the loader keeps that value (as transformers does).
    rms_norm_eps=float(np.float32(1e-5)),
)  # fmt: skip
# A type per tensor kind, so every accepted family (float, legacy quants) is read at least once.
GGUF_TYPES = {
    "token_embd": QT.Q8_0, "attn_q": QT.Q4_0, "attn_k": QT.Q4_1, "attn_v": QT.Q5_0,
    "attn_output": QT.Q5_1, "ffn_gate": QT.F16, "ffn_up": QT.BF16, "ffn_down": QT.Q8_0,
    "output": QT.F16,
}  # fmt: skip
HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}  # fmt: skip


def gguf_name(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        _, _, layer, *module, param = hf_name.split(".")
        return f"blk.{layer}.{HF_TO_GGUF['.'.join(module)]}.{param}"
    return {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }[hf_name]


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q and K rows (HF order -> interleaved pairs)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_tiny_gguf(
    path: Path, config: ModelConfig = TINY, *, arch: str | None = None,
    corrupt: dict[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:  # fmt: skip
    """Write random weights, quantized as llama.cpp would; return what loading must give back."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, arch or config.architecture)
    prefix = arch or config.architecture
    writer.add_uint32(f"{prefix}.vocab_size", config.vocab_size)
    writer.add_uint32(f"{prefix}.context_length", config.max_position_embeddings)
    writer.add_uint32(f"{prefix}.embedding_length", config.hidden_size)
    writer.add_uint32(f"{prefix}.feed_forward_length", config.intermediate_size)
    writer.add_uint32(f"{prefix}.block_count", config.num_layers)
    writer.add_uint32(f"{prefix}.attention.head_count", config.num_heads)
    writer.add_uint32(f"{prefix}.attention.head_count_kv", config.num_kv_heads)
    writer.add_float32(f"{prefix}.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    writer.add_float32(f"{prefix}.rope.freq_base", config.rope_theta)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(["<s>", "</s>", "Ġ", *[chr(c) for c in range(33, 33 + 94)]])
    writer.add_token_types([3, 3] + [1] * 95)
    writer.add_token_merges([])
    writer.add_eos_token_id(1)
    expected: dict[str, np.ndarray] = {}
    for name, shape in expected_shapes(config).items():
        weight = rng.standard_normal(shape).astype(np.float32)
        gname = gguf_name(name)
        kind = gname.split(".")[-2]
        qtype = GGUF_TYPES.get(kind, QT.F32)
        if name.endswith(".bias"):
            qtype = QT.F32
        stored = weight
        if config.architecture != "qwen2" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_heads if "q_proj" in name else config.num_kv_heads
            stored = llama_cpp_permute(weight, heads)
        if corrupt and gname in corrupt:
            writer.add_tensor(gname, corrupt[gname])
            continue
        if qtype == QT.F32:
            writer.add_tensor(gname, stored)
        else:
            writer.add_tensor(gname, gguf.quants.quantize(stored, qtype), raw_dtype=qtype)
        # Rows quantize independently, so permuting rows commutes with (de)quantizing.
        expected[name] = gguf.quants.dequantize(gguf.quants.quantize(weight, qtype), qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def assert_tensors_equal(checkpoint: Checkpoint, expected: dict[str, np.ndarray]) -> None:
    loaded = dict(checkpoint.tensors())
    assert set(loaded) == set(expected)
    for name, tensor in loaded.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, torch.from_numpy(np.ascontiguousarray(expected[name]))), name


def test_gguf_quantized_tensors_load_in_hf_order(tmp_path: Path) -> None:
    expected = write_tiny_gguf(tmp_path / "tiny.gguf")
    checkpoint = load_checkpoint(tmp_path / "tiny.gguf")
    assert checkpoint.config == TINY
    assert checkpoint.tokenizer.eos_token_id == 1
    assert_tensors_equal(checkpoint, expected)


def test_gguf_qwen2_keeps_qk_order_and_loads_biases(tmp_path: Path) -> None:
    config = dataclasses.replace(
        TINY, architecture="qwen2", attention_bias=True, tie_word_embeddings=True
    )
    expected = write_tiny_gguf(tmp_path / "qwen.gguf", config)
    checkpoint = load_checkpoint(tmp_path / "qwen.gguf")
    assert checkpoint.config == config
    assert "model.layers.1.self_attn.k_proj.bias" in checkpoint.tensor_shapes
    assert "lm_head.weight" not in checkpoint.tensor_shapes
    assert_tensors_equal(checkpoint, expected)


def test_gguf_unknown_architecture_is_named(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "f.gguf", arch="falcon")
    with pytest.raises(UnsupportedModelError, match="'falcon'"):
        load_checkpoint(tmp_path / "f.gguf")


def test_gguf_unsupported_tensor_type_names_type_and_tensor(tmp_path: Path) -> None:
    ints = np.zeros(TINY.hidden_size, dtype=np.int32)
    write_tiny_gguf(tmp_path / "i.gguf", corrupt={"blk.1.attn_norm.weight": ints})
    with pytest.raises(UnsupportedModelError, match=r"blk\.1\.attn_norm\.weight.*I32"):
        load_checkpoint(tmp_path / "i.gguf")


def test_gguf_tensor_with_the_wrong_shape_is_refused(tmp_path: Path) -> None:
    short = np.zeros(TINY.hidden_size - 1, dtype=np.float32)
    write_tiny_gguf(tmp_path / "s.gguf", corrupt={"output_norm.weight": short})
    with pytest.raises(UnsupportedModelError, match=r"model\.norm\.weight has shape \(63,\)"):
        load_checkpoint(tmp_path / "s.gguf")


def test_not_a_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "fake.gguf").write_bytes(b"not gguf at all")
    with pytest.raises(UnsupportedModelError, match="neither"):
        load_checkpoint(tmp_path / "notes.txt")
    with pytest.raises(UnsupportedModelError, match="GGUF"):
        load_checkpoint(tmp_path / "fake.gguf")
    with pytest.raises(UnsupportedModelError, match=r"config\.json"):
        load_checkpoint(tmp_path)
    with pytest.raises(ModelNotFoundError):
        load_checkpoint(tmp_path / "missing.gguf")


# --- Hugging Face folders ---

LLAMA_JSON: dict[str, object] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 97,
    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "max_position_embeddings": 128, "tie_word_embeddings": False,
    "hidden_act": "silu",
}  # fmt: skip


def write_hf_folder(
    folder: Path, raw: dict[str, object], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    config = config_from_hf(raw)
    generator = torch.Generator().manual_seed(0)
    tensors = {
        name: torch.randn(shape, generator=generator).to(dtype)
        for name, shape in expected_shapes(config).items()
    }
    write_tiny_tokenizer(folder)
    return tensors


def test_hf_folder_loads_lazily_in_source_dtype(tmp_path: Path) -> None:
    tensors = write_hf_folder(tmp_path, LLAMA_JSON, torch.bfloat16)
    # Old checkpoints carry a RoPE buffer; it is recomputed, never loaded.
    extra = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}
    save_file({**tensors, **extra}, str(tmp_path / "model.safetensors"))
    checkpoint = load_checkpoint(tmp_path)
    assert checkpoint.config == dataclasses.replace(TINY, rms_norm_eps=1e-5)
    assert inspect.isgenerator(checkpoint.tensors())
    loaded = dict(checkpoint.tensors())
    assert set(loaded) == set(tensors)
    for name, tensor in loaded.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, tensors[name]), name


def test_hf_folder_with_an_index_reads_every_shard(tmp_path: Path) -> None:
    tensors = write_hf_folder(tmp_path, LLAMA_JSON, torch.float16)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}  # fmt: skip
    weight_map = {}
    for file, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(tmp_path / file))
        weight_map.update(dict.fromkeys(shard_names, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded = dict(load_checkpoint(tmp_path).tensors())
    assert set(loaded) == set(tensors)
    assert all(torch.equal(loaded[n], tensors[n]) for n in names)


def test_hf_folder_missing_a_tensor_is_refused(tmp_path: Path) -> None:
    tensors = write_hf_folder(tmp_path, LLAMA_JSON, torch.float32)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match=r"missing model\.layers\.1\.mlp\.up_proj"):
        load_checkpoint(tmp_path)


def test_hf_folder_tokenizer_reads_its_config(tmp_path: Path) -> None:
    write_tiny_tokenizer(tmp_path, bos_by_post_processor=True)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [95, 7]}))
    tokenizer = Tokenizer.from_hf_folder(tmp_path)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (94, 95)
    assert tokenizer.stop_token_ids == frozenset({7, 95})
    # No add_bos_token in the config: tokenizer.json's post-processor decides, and it adds BOS.
    assert tokenizer.encode("ab</s>") == [94, ord("a") - 33, ord("b") - 33, 95]
    assert tokenizer.render_chat([{"role": "user", "content": "x"}]) == "<s>x"


def test_hf_config_maps_fields_and_defaults() -> None:
    raw = {**LLAMA_JSON, "head_dim": 32, "rope_theta": None,
           "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}  # fmt: skip
    del raw["num_key_value_heads"]
    config = config_from_hf(raw)
    assert (config.head_dim, config.num_kv_heads, config.rope_theta) == (32, 4, 5e5)
    qwen = config_from_hf({**LLAMA_JSON, "architectures": ["Qwen2ForCausalLM"],
                           "model_type": "qwen2", "sliding_window": 64,
                           "use_sliding_window": False})  # fmt: skip
    assert qwen.architecture == "qwen2" and qwen.attention_bias
    mistral = config_from_hf({**LLAMA_JSON, "architectures": ["MistralForCausalLM"],
                              "model_type": "mistral", "sliding_window": None})  # fmt: skip
    assert mistral.architecture == "mistral" and not mistral.attention_bias


LLAMA31_ROPE: dict[str, object] = {
    "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192, "rope_type": "llama3",
}  # fmt: skip
# The config.json files of Meta's and Qwen's releases, as transformers 4 wrote them (trimmed of
# keys the engine does not read).
LLAMA_3_2_1B_JSON: dict[str, object] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
    "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 8192,
    "max_position_embeddings": 131072, "mlp_bias": False, "num_attention_heads": 32,
    "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {**LLAMA31_ROPE, "factor": 32.0}, "rope_theta": 500000.0,
    "tie_word_embeddings": True, "vocab_size": 128256,
}  # fmt: skip
QWEN_2_5_7B_JSON: dict[str, object] = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
    "hidden_size": 3584, "intermediate_size": 18944, "max_position_embeddings": 32768,
    "max_window_layers": 28, "num_attention_heads": 28, "num_hidden_layers": 28,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 131072, "tie_word_embeddings": False, "use_sliding_window": False,
    "vocab_size": 152064,
}  # fmt: skip


def test_hf_config_reads_llama_3_2_and_qwen_2_5_releases() -> None:
    llama = config_from_hf(LLAMA_3_2_1B_JSON)
    assert (llama.architecture, llama.head_dim, llama.num_kv_heads) == ("llama", 64, 8)
    assert (llama.rope_theta, llama.max_position_embeddings) == (500000.0, 131072)
    assert llama.tie_word_embeddings and not llama.attention_bias
    assert llama.rope_scaling == Llama3RopeScaling(32.0, 1.0, 4.0, 8192)
    qwen = config_from_hf(QWEN_2_5_7B_JSON)
    assert (qwen.architecture, qwen.head_dim, qwen.rope_theta) == ("qwen2", 128, 1e6)
    assert qwen.attention_bias and not qwen.tie_word_embeddings and qwen.rope_scaling is None
    # Tied Qwen2.5 (0.5B to 3B): the flag is all that differs.
    assert config_from_hf({**QWEN_2_5_7B_JSON, "tie_word_embeddings": True}).tie_word_embeddings


def test_hf_config_reads_llama3_rope_in_every_spelling() -> None:
    """transformers 4 writes `rope_scaling` (`type` in older files), transformers 5 writes
    `rope_parameters` with the theta inside; each gives the same config."""
    legacy = {k: v for k, v in LLAMA31_ROPE.items() if k != "rope_type"} | {"type": "llama3"}
    v5 = {**LLAMA31_ROPE, "rope_theta": 5e5}
    spellings: list[dict[str, object]] = [
        {"rope_scaling": LLAMA31_ROPE, "rope_theta": 5e5},
        {"rope_scaling": legacy, "rope_theta": 5e5},
        {"rope_parameters": v5, "rope_theta": None},
        {
            "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
            "rope_scaling": LLAMA31_ROPE,
        },
    ]
    expected = Llama3RopeScaling(8.0, 1.0, 4.0, 8192)
    for changes in spellings:
        config = config_from_hf({**LLAMA_JSON, **changes})
        assert (config.rope_theta, config.rope_scaling) == (5e5, expected), changes
    # As in transformers, a missing pretraining length falls back to max_position_embeddings.
    short = {k: v for k, v in LLAMA31_ROPE.items() if k != "original_max_position_embeddings"}
    assert config_from_hf({**LLAMA_JSON, "rope_scaling": short}).rope_scaling == (
        Llama3RopeScaling(8.0, 1.0, 4.0, 128)
    )
    assert config_from_hf({**LLAMA_JSON, "rope_scaling": {"type": "default"}}).rope_scaling is None


def test_llama3_frequencies_equal_transformers() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw = {**LLAMA_3_2_1B_JSON, "rope_scaling": {**LLAMA31_ROPE, "factor": 32.0}}
    config = config_from_hf(raw)
    rope = RotaryEmbedding(64, config.rope_theta, 4096, torch.device("cpu"), config.rope_scaling)
    plain = RotaryEmbedding(64, config.rope_theta, 4096, torch.device("cpu"))
    hf_config = LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"})
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](hf_config, torch.device("cpu"))
    assert attention_factor == 1.0  # llama3 scales frequencies only, never the attention
    angles = torch.arange(4096, dtype=torch.float32)[:, None] * inv_freq
    assert torch.equal(rope.cos, torch.cat((angles, angles), dim=-1).cos())
    kept = int((rope.cos == plain.cos).all(dim=0).sum())
    assert 0 < kept < 64, "some frequencies are kept, the others slowed or blended"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "'GPT2LMHeadModel'"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "RoPE scaling 'yarn'"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "RoPE scaling 'dynamic'"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "RoPE scaling 'linear'"),
        ({"rope_scaling": "llama3"}, "rope_scaling must be an object"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "needs low_freq_factor"),
        ({"rope_scaling": {**LLAMA31_ROPE, "factor": 0}}, "needs factor"),
        ({"rope_scaling": {**LLAMA31_ROPE, "high_freq_factor": 1.0}}, r"high_freq_factor \(1\) >"),
        ({"rope_scaling": {**LLAMA31_ROPE, "original_max_position_embeddings": 8192.5}},
         "original_max_position_embeddings"),
        ({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}, "'Qwen3ForCausalLM'"),
        ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2_moe"},
         "'Qwen2ForCausalLM' with model_type 'qwen2_moe'"),
        ({"architectures": ["MistralForCausalLM"], "model_type": "mistral",
          "sliding_window": 64}, "sliding-window"),
        ({"hidden_act": "gelu"}, "'gelu'"),
        ({"attention_bias": True}, "biases"),
        ({"hidden_size": None}, "hidden_size"),
    ],
)  # fmt: skip
def test_hf_config_refuses_what_the_engine_does_not_implement(
    changes: dict[str, object], message: str
) -> None:
    with pytest.raises(UnsupportedModelError, match=message):
        config_from_hf({**LLAMA_JSON, **changes})


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "overrides"),
    [
        ("llama", {}),
        ("qwen2", {}),
        ("mistral", {}),
        ("llama", {"rope_scaling": {**LLAMA31_ROPE, "original_max_position_embeddings": 32}}),
        ("qwen2", {"tie_word_embeddings": False, "rope_theta": 1e6}),
    ],
)
def test_transformers_checkpoints_round_trip(
    tmp_path: Path, family: str, overrides: dict[str, object]
) -> None:
    # A small shard size makes transformers write several files and an index.
    model = save_tiny_transformers_model(tmp_path, family, max_shard_size="100KB", **overrides)
    assert (tmp_path / "model.safetensors.index.json").exists()
    checkpoint = load_checkpoint(tmp_path)
    hf = model.config
    tied = bool(hf.tie_word_embeddings)
    assert checkpoint.config == ModelConfig(
        architecture=family, vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=hf.rms_norm_eps,
        rope_theta=hf.rope_parameters["rope_theta"], max_position_embeddings=128,
        tie_word_embeddings=tied, attention_bias=family == "qwen2",
        rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 32) if "rope_scaling" in overrides else None,
    )  # fmt: skip
    assert tied is (family == "qwen2" and "tie_word_embeddings" not in overrides)
    reference = model.state_dict()
    loaded = dict(checkpoint.tensors())
    assert set(loaded) == set(reference) - ({"lm_head.weight"} if tied else set())
    for name, tensor in loaded.items():
        assert torch.equal(tensor, reference[name]), name
