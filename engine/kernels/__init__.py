"""Native kernels, built on first use with the machine's C++ compiler and cached by torch.

Each has a portable PyTorch twin; when a kernel cannot be built (no compiler, say) the engine
logs why once and uses the twin, so the kernels only ever make things faster.

They are built with `-march=native`, so an object built on one CPU may hold instructions another
lacks (AVX-512 on a machine without it: SIGILL). torch's build cache is keyed by the sources and
flags only, so the module's name carries a digest of the CPU's feature flags: a home directory
shared between machines (or a container image moved to another host) gets one build per CPU.
It also carries a digest of the sources, the flags and the torch version it builds against, so
that two versions of the engine (or two torch versions) on one machine do not rebuild the same
module in turn. A module of that name, once built, is imported as it is: torch's ninja file names
the sources and torch's own directories by their absolute paths, so asking torch to load it from
a second checkout or virtual environment would rebuild it, and the first would rebuild it back.
The module names torch's libraries without a path (the process importing it has loaded them), so
every checkout and environment with one torch version shares one build; torch compiles copies of
the sources kept in the build directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

_SOURCE_DIR = Path(__file__).parent

# No -ffast-math: it implies -ffinite-math-only, under which the kernels' -inf sentinels (the
# running maximum of an online softmax) are undefined behaviour. What it gave that is safe with
# infinities stays: reassociation (vectorized reductions), no errno, no traps. The kernels carry
# their own vectorizable exp, since glibc's vector exp is declared only under -ffast-math.
_SOURCES = [
    "paged_attention_cpu.cpp",
    "prefill_attention_cpu.cpp",
    "layer_ops_cpu.cpp",
    "gemv_cpu.cpp",
    "amx_cpu.cpp",
    "decode_layers_cpu.cpp",
    "bindings_cpu.cpp",
]
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-funsafe-math-optimizations"]
# Link torch's own OpenMP runtime: a second one would fight it for the cores.
_LDFLAGS = ["-l:libgomp.so.1"]


def cpu_feature_digest() -> str:
    """A short digest of what `-march=native` compiles for: the architecture and its flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: the processor's name is the best key there is
        text = platform.processor()
    # x86 calls the line "flags", ARM "Features"; every core has the same one.
    flags = next((ln for ln in text.splitlines() if ln.startswith(("flags", "Features"))), text)
    return hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:12]


def kernel_module_name(source_dir: Path) -> str:
    """The name the kernels built from `source_dir` have on this CPU with this torch.

    Checkouts of different versions (worktrees, upgrades) and different torch builds each keep
    their own build: torch rebuilds a module whose inputs changed, so sharing one name makes them
    rebuild in turn."""
    sources = sorted(source_dir.glob("*.[ch]*"))
    text = b"".join(path.read_bytes() for path in sources) + " ".join(_CFLAGS + _LDFLAGS).encode()
    text += f"{torch.__version__} {torch.version.git_version}".encode()
    return f"meridian_cpu_kernels_{cpu_feature_digest()}_{hashlib.sha256(text).hexdigest()[:8]}"


def _copy_sources(source_dir: Path, build_dir: Path) -> list[str]:
    """The sources copied into the build directory, rewritten only when they differ: ninja
    rebuilds whatever is newer than its objects."""
    copies = build_dir / "src"
    copies.mkdir(exist_ok=True)
    for source in sorted(source_dir.glob("*.[ch]*")):
        copy = copies / source.name
        if not copy.exists() or copy.read_bytes() != source.read_bytes():
            copy.write_bytes(source.read_bytes())
    return [str(copies / source) for source in _SOURCES]


@cache
def cpu_kernels() -> ModuleType | None:
    """The CPU kernels' module, or None where they are off or cannot be built.

    MERIDIAN_CPU_KERNELS=0 turns them off (for comparisons and for testing the twins)."""
    if os.environ.get("MERIDIAN_CPU_KERNELS", "1") == "0":
        return None
    return build_cpu_kernels(_SOURCE_DIR)


def build_cpu_kernels(source_dir: Path) -> ModuleType | None:
    """The kernels built from the sources in `source_dir` (this checkout's, or another
    revision's beside them for an A/B: bench/kernel_ab.py), or None if they cannot be built."""
    from torch.utils.cpp_extension import (
        LIB_EXT,
        _get_build_directory,
        _import_module_from_library,
        load,
    )

    name = kernel_module_name(source_dir)
    torch_lib = Path(torch.__file__).parent / "lib"
    logger.info("loading the CPU kernels (the first build on a CPU takes about 20 s on 2 cores)")
    try:
        build_dir = Path(_get_build_directory(name, verbose=False))
        with _only_builder(build_dir):
            built = build_dir / f"{name}{LIB_EXT}"
            if built.exists():  # these sources, flags and torch version (its name says so)
                try:
                    return _import_module_from_library(name, str(build_dir), True)
                except ImportError:  # cut short while linking (a killed build): build it again
                    built.unlink()
            return load(
                name=name,
                sources=_copy_sources(source_dir, build_dir),
                extra_cflags=_CFLAGS,
                extra_ldflags=[f"-L{torch_lib}", *_LDFLAGS],
                build_directory=str(build_dir),
            )
    except Exception as exc:  # any build failure leaves the portable path in charge
        logger.warning("CPU kernels unavailable, using the PyTorch path: %s", exc)
        return None


@contextlib.contextmanager
def _only_builder(build_dir: Path) -> Iterator[None]:
    """Hold the build directory alone while torch builds and loads there.

    torch marks a build in progress with a `lock` file that only its owner removes, so a process
    killed mid-build (a test's node agent, a Ctrl-C) leaves every later load waiting forever. Our
    lock is an flock, which the kernel drops when its holder dies; since every Meridian build
    takes it first, a torch `lock` file found while holding it is stale.
    """
    with (build_dir / "meridian.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
