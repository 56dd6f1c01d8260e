"""Loading Hugging Face checkpoint folders: config.json -> ModelConfig, safetensors -> torch.

Tensors are read lazily with `safe_open`, one at a time, in the dtype they are stored in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path

from safetensors import safe_open

from engine.errors import UnsupportedModelError
from engine.hf_json import read_json_object
from engine.loader.checkpoint import Checkpoint, NamedTensors, check_shapes
from engine.model_config import Llama3RopeScaling, ModelConfig
from engine.tokenizer import Tokenizer

# `architectures[0]` -> our architecture name, which is also the expected `model_type`.
_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
# transformers' defaults for keys a config.json may leave out.
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "mistral": 4096 * 32, "qwen2": 32768}
# Buffers some older checkpoints saved; they are recomputed, never loaded.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def load_hf_folder(path: Path) -> Checkpoint:
    """Open a Hugging Face folder: read its config and tokenizer, index (not read) its tensors."""
    config = config_from_hf(read_json_object(path / "config.json"))
    files = _safetensors_files(path)
    shapes: dict[str, tuple[int, ...]] = {}
    names_by_file: list[tuple[Path, tuple[str, ...]]] = []
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            names = tuple(n for n in handle.keys() if _is_loaded(n, config))  # noqa: SIM118
            for name in names:
                shapes[name] = tuple(handle.get_slice(name).get_shape())
        names_by_file.append((file, names))
    check_shapes(shapes, config, path)
    tokenizer = Tokenizer.from_hf_folder(path)
    return Checkpoint(path, config, tokenizer, shapes, partial(_read_tensors, tuple(names_by_file)))


def config_from_hf(raw: Mapping[str, object]) -> ModelConfig:
    """ModelConfig from a config.json, refusing features the engine does not implement."""
    architectures = raw.get("architectures")
    declared = architectures[0] if isinstance(architectures, list) and architectures else None
    arch = _ARCHITECTURES.get(str(declared)) if declared else None
    model_type = raw.get("model_type", arch)
    if arch is None or model_type != arch:
        shown = repr(declared or model_type)
        if arch is not None:  # a known class name over another model type (qwen2_moe, ...)
            shown += f" with model_type {model_type!r}"
        raise UnsupportedModelError(
            f"architecture {shown} is not supported (supported: {', '.join(_ARCHITECTURES)})"
        )
    _refuse_unsupported(raw, arch)

    def integer(key: str, default: int | None = None) -> int:
        value = raw.get(key)
        if value is None and default is not None:
            return default
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise UnsupportedModelError(f"config.json: {key} must be a positive integer")
        return value

    hidden, num_heads = integer("hidden_size"), integer("num_attention_heads")
    max_positions = integer("max_position_embeddings", _DEFAULT_MAX_POSITIONS[arch])
    rope_theta, rope_scaling = _rope_settings(raw, max_positions)
    return ModelConfig(
        architecture=arch,
        vocab_size=integer("vocab_size"),
        hidden_size=hidden,
        intermediate_size=integer("intermediate_size"),
        num_layers=integer("num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=integer("num_key_value_heads", num_heads),
        head_dim=integer("head_dim", hidden // num_heads),
        rms_norm_eps=_number(raw.get("rms_norm_eps"), 1e-6),
        rope_theta=rope_theta,
        max_position_embeddings=max_positions,
        tie_word_embeddings=raw.get("tie_word_embeddings") is True,
        attention_bias=arch == "qwen2",
        rope_scaling=rope_scaling,
    )


def _rope_settings(
    raw: Mapping[str, object], max_positions: int
) -> tuple[float, Llama3RopeScaling | None]:
    """RoPE's theta and scaling. transformers 4 writes `rope_theta` and `rope_scaling`;
    transformers 5 writes both into `rope_parameters`."""
    tables: list[Mapping[str, object]] = []
    for key in ("rope_parameters", "rope_scaling"):
        table = raw.get(key)
        if table is None:
            continue
        if not isinstance(table, dict):
            raise UnsupportedModelError(f"config.json: {key} must be an object, got {table!r}")
        tables.append(table)
    # As in transformers 5, the theta inside `rope_parameters` wins over a top-level one.
    thetas = [t.get("rope_theta") for t in tables] + [raw.get("rope_theta")]
    theta = next((value for value in thetas if value is not None), None)
    scaled = [t for t in tables if t.get("rope_type", t.get("type", "default")) != "default"]
    if not scaled:
        return _number(theta, 10000.0), None
    kind = scaled[0].get("rope_type", scaled[0].get("type"))
    if kind != "llama3":
        raise UnsupportedModelError(
            f"RoPE scaling {kind!r} is not supported (supported: llama3, or none)"
        )
    return _number(theta, 10000.0), _llama3_scaling(scaled[0], max_positions)


def _llama3_scaling(table: Mapping[str, object], max_positions: int) -> Llama3RopeScaling:
    def positive(key: str, value: object) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise UnsupportedModelError(
                f"config.json: llama3 RoPE scaling needs {key}, a positive number, got {value!r}"
            )
        return float(value)

    # transformers falls back to max_position_embeddings; so do we, to match it.
    context = table.get("original_max_position_embeddings", max_positions)
    if isinstance(context, bool) or not isinstance(context, int) or context <= 0:
        raise UnsupportedModelError(
            "config.json: llama3 RoPE scaling needs original_max_position_embeddings, "
            f"a positive integer, got {context!r}"
        )
    low = positive("low_freq_factor", table.get("low_freq_factor"))
    high = positive("high_freq_factor", table.get("high_freq_factor"))
    if high <= low:
        raise UnsupportedModelError(
            f"config.json: llama3 RoPE scaling needs high_freq_factor ({high:g}) > "
            f"low_freq_factor ({low:g})"
        )
    return Llama3RopeScaling(positive("factor", table.get("factor")), low, high, context)


def _refuse_unsupported(raw: Mapping[str, object], arch: str) -> None:
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"activation {raw.get('hidden_act')!r} is not supported")
    if arch == "llama" and (raw.get("attention_bias") or raw.get("mlp_bias")):
        raise UnsupportedModelError("Llama with attention or MLP biases is not supported")
    window = raw.get("sliding_window")
    uses_window = arch == "mistral" or (arch == "qwen2" and raw.get("use_sliding_window") is True)
    max_positions = raw.get("max_position_embeddings", _DEFAULT_MAX_POSITIONS[arch])
    if uses_window and window is not None:
        if not isinstance(window, int) or not isinstance(max_positions, int):
            raise UnsupportedModelError(f"sliding_window {window!r} is not supported")
        if window < max_positions:
            raise UnsupportedModelError(
                f"sliding-window attention (window {window} < {max_positions} positions) "
                "is not supported"
            )


def _number(value: object, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UnsupportedModelError(f"config.json: expected a number, got {value!r}")
    return float(value)


def _is_loaded(name: str, config: ModelConfig) -> bool:
    if name.endswith(_IGNORED_SUFFIXES):
        return False
    # Some tied checkpoints still store the head; it is the embedding, so skip the copy.
    return not (config.tie_word_embeddings and name == "lm_head.weight")


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise UnsupportedModelError(f"{index} has no weight_map")
        files = [folder / str(name) for name in dict.fromkeys(weight_map.values())]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(f"{folder} has no *.safetensors weights")
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise UnsupportedModelError(f"{folder} lacks weight files {', '.join(missing)}")
    return files


def _read_tensors(
    names_by_file: tuple[tuple[Path, tuple[str, ...]], ...], wanted: Callable[[str], bool]
) -> NamedTensors:
    for file, names in names_by_file:
        with safe_open(str(file), framework="pt") as handle:
            for name in names:
                if wanted(name):
                    yield name, handle.get_tensor(name)
