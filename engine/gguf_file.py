"""A GGUF file's header in one pass: its metadata as Python values, its tensors as views of the
memory-mapped file.

gguf's own `GGUFReader` makes a numpy view of every part of every value: for SmolLM2's 49,152
tokens and 48,900 merges that was 2.3 of the 2.6 CPU-s its tokenizer took to load, in every
process that opens the model (each node agent and engine worker, each region picker). Here a
string is a slice of the file's bytes and an array of numbers one `frombuffer`.

The layout (GGUF v2 and v3, little-endian): magic `GGUF`, version u32, tensor count u64,
metadata count u64; each metadata entry a key (string), a value type u32 and the value (a string
is its length u64 and UTF-8 bytes; an array its element type u32, count u64 and elements); each
tensor's info its name, dimension count u32, dimensions u64 (fastest-varying first), type u32 and
data offset u64; then the data, from the next multiple of `general.alignment` (32 by default).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

from engine.errors import UnsupportedModelError

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
# Value types by their number in the file: struct format (numbers), or a name.
_NUMBERS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 10: "Q", 11: "q", 12: "d"}
_BOOL, _STRING, _ARRAY = 7, 8, 9
# Tensor types whose data is read as numbers of this dtype; every other type as its blocks' bytes.
_PLAIN_TYPES = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # as the file lists it: fastest-varying first
    # Read-only view of the file: the numbers (plain types, rows first) or (rows, a row's bytes).
    data: np.ndarray


@dataclass(frozen=True, slots=True)
class GGUFFile:
    path: Path
    fields: dict[str, object]  # key -> value; an array is a list
    tensors: list[GGUFTensor]


class _Cursor:
    def __init__(self, buffer: np.memmap) -> None:
        self.buffer = buffer
        self.view = buffer.data
        self.at = 0

    def unpack(self, fmt: str) -> tuple[object, ...]:
        values = struct.unpack_from("<" + fmt, self.view, self.at)
        self.at += struct.calcsize("<" + fmt)
        return values

    def integer(self, fmt: str) -> int:
        (value,) = self.unpack(fmt)
        assert isinstance(value, int)
        return value

    def string(self) -> str:
        length = self.integer("Q")
        if self.at + length > len(self.view):
            raise ValueError("a string runs past the end of the file")
        text = bytes(self.view[self.at : self.at + length]).decode("utf-8")
        self.at += length
        return text

    def value(self, kind: int) -> object:
        if kind in _NUMBERS:
            (number,) = self.unpack(_NUMBERS[kind])
            return number
        if kind == _BOOL:
            return self.integer("B") != 0
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            return self.array()
        raise ValueError(f"unknown metadata value type {kind}")

    def array(self) -> list[object]:
        kind, count = self.integer("I"), self.integer("Q")
        if kind in _NUMBERS:
            dtype = np.dtype("<" + _NUMBERS[kind])
            if self.at + count * dtype.itemsize > len(self.view):
                raise ValueError("an array runs past the end of the file")
            numbers = np.frombuffer(self.buffer, dtype, count, self.at)
            self.at += count * dtype.itemsize
            values: list[object] = numbers.tolist()
            return values
        return [self.value(kind) for _ in range(count)]


def read_gguf(path: Path) -> GGUFFile:
    """Memory-map a GGUF file and read its header; a file that is not GGUF, or is cut short, is
    an unsupported checkpoint."""
    try:
        return _read(path, np.memmap(path, dtype=np.uint8, mode="r"))
    except (ValueError, OSError, struct.error) as exc:  # UnicodeDecodeError is a ValueError
        raise UnsupportedModelError(f"{path} is not a readable GGUF file: {exc}") from exc


def _read(path: Path, buffer: np.memmap) -> GGUFFile:
    cursor = _Cursor(buffer)
    magic = bytes(cursor.view[:4])
    cursor.at = 4
    version = cursor.integer("I")
    if magic != _MAGIC or version not in _VERSIONS:
        raise ValueError(f"magic {magic!r} version {version}: not GGUF v2 or v3")
    num_tensors, num_fields = cursor.integer("Q"), cursor.integer("Q")
    fields: dict[str, object] = {}
    for _ in range(num_fields):
        key = cursor.string()
        fields[key] = cursor.value(cursor.integer("I"))
    infos = []
    for _ in range(num_tensors):
        name = cursor.string()
        dims = tuple(cursor.integer("Q") for _ in range(cursor.integer("I")))
        infos.append((name, dims, GGMLQuantizationType(cursor.integer("I")), cursor.integer("Q")))
    alignment = fields.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0:
        raise ValueError(f"general.alignment {alignment!r} is not a positive integer")
    start = -(-cursor.at // alignment) * alignment
    names = [name for name, _, _, _ in infos]
    if len(set(names)) != len(names):
        twice = next(name for name in names if names.count(name) > 1)
        raise ValueError(f"tensor {twice} is listed twice")
    tensors = [
        GGUFTensor(name, kind, dims, _data(buffer, start + offset, dims, kind))
        for name, dims, kind, offset in infos
    ]
    return GGUFFile(path, fields, tensors)


def _data(
    buffer: np.memmap, offset: int, dims: tuple[int, ...], kind: GGMLQuantizationType
) -> np.ndarray:
    rows_first = tuple(reversed(dims))
    num_elements = int(np.prod(dims, dtype=np.int64))
    if kind in _PLAIN_TYPES:
        dtype = np.dtype(_PLAIN_TYPES[kind])
        count, shape = num_elements, rows_first
    else:
        block_size, type_size = GGML_QUANT_SIZES[kind]
        dtype, count = np.dtype(np.uint8), num_elements // block_size * type_size
        shape = quant_shape_to_byte_shape(rows_first, kind)
    if offset + count * dtype.itemsize > len(buffer):
        raise ValueError("a tensor's data runs past the end of the file")
    return np.frombuffer(buffer, dtype, count, offset).reshape(shape)
