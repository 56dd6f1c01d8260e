"""Our GGUF header reader against gguf's own GGUFReader: the same values and tensor views."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from engine.errors import UnsupportedModelError
from engine.gguf_file import read_gguf


def write_every_kind(path: Path, alignment: int | None = None) -> None:
    writer = gguf.GGUFWriter(path, "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_uint8("u8", 250)
    writer.add_int8("i8", -7)
    writer.add_uint16("u16", 65_000)
    writer.add_int16("i16", -30_000)
    writer.add_uint32("u32", 4_000_000_000)
    writer.add_int32("i32", -2_000_000_000)
    writer.add_float32("f32", 1e-5)
    writer.add_uint64("u64", 2**63 + 5)
    writer.add_int64("i64", -(2**62))
    writer.add_float64("f64", 0.1)
    writer.add_bool("yes", True)
    writer.add_bool("no", False)
    writer.add_string("text", "Ġhello ✓")
    writer.add_array("words", ["a", "", "Ċ\n", "日本"])
    writer.add_array("ints", [1, -2, 3])
    writer.add_array("floats", [0.5, -1.25])
    writer.add_array("empty", [])
    rng = np.random.default_rng(0)
    writer.add_tensor("plain", rng.standard_normal((3, 64)).astype(np.float32))
    writer.add_tensor("half", rng.standard_normal((2, 32)).astype(np.float16))
    q4 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), QT.Q4_1)
    writer.add_tensor("blocks", q4, raw_dtype=QT.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_values_and_tensors_equal_gguf_s_reader(tmp_path: Path, alignment: int | None) -> None:
    path = tmp_path / "every.gguf"
    write_every_kind(path, alignment)
    ours, theirs = read_gguf(path), gguf.GGUFReader(path)
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]  # the reader's own entries
    assert sorted(ours.fields) == sorted(keys)
    for key in keys:
        expected = theirs.fields[key].contents()
        assert ours.fields[key] == expected and type(ours.fields[key]) is type(expected), key
    assert ours.fields["text"] == "Ġhello ✓" and ours.fields["u64"] == 2**63 + 5
    assert [t.name for t in ours.tensors] == ["plain", "half", "blocks"]
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.tensor_type == reference.tensor_type
        assert mine.shape == tuple(reference.shape.tolist())
        assert mine.data.dtype == reference.data.dtype and mine.data.shape == reference.data.shape
        assert np.array_equal(mine.data, reference.data), mine.name
    assert ours.tensors[2].data.shape == (4, 2 * 20)  # Q4_1: a row's blocks of 20 bytes


def test_a_file_that_is_not_gguf_or_is_cut_short_is_unsupported(tmp_path: Path) -> None:
    path = tmp_path / "every.gguf"
    write_every_kind(path)
    whole = path.read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + whole[4:])
    with pytest.raises(UnsupportedModelError, match="not a readable GGUF file: magic"):
        read_gguf(bad)
    for cut in (10, 200, len(whole) - 100):
        bad.write_bytes(whole[:cut])
        with pytest.raises(UnsupportedModelError, match="not a readable GGUF file"):
            read_gguf(bad)
