"""Native kernels, built on first use with the machine's C++ compiler and cached by torch.

Each has a portable PyTorch twin; when a kernel cannot be built (no compiler, say) the engine
logs why once and uses the twin, so the kernels only ever make things faster.
"""

from __future__ import annotations

import logging
import os
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

_SOURCE_DIR = Path(__file__).parent


@cache
def cpu_paged_attention() -> ModuleType | None:
    """The CPU decode-attention kernel module, or None where it is off or cannot be built.

    MERIDIAN_CPU_KERNELS=0 turns it off (for comparisons and for testing the twin)."""
    if os.environ.get("MERIDIAN_CPU_KERNELS", "1") == "0":
        return None
    from torch.utils.cpp_extension import load

    torch_lib = Path(torch.__file__).parent / "lib"
    logger.info("loading the CPU attention kernel (the first build takes about 30 s)")
    try:
        return load(
            name="meridian_paged_attention_cpu",
            sources=[str(_SOURCE_DIR / "paged_attention_cpu.cpp")],
            extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
            # Link torch's own OpenMP runtime: a second one would fight it for the cores.
            extra_ldflags=[f"-L{torch_lib}", "-l:libgomp.so.1"],
        )
    except Exception as exc:  # any build failure leaves the portable path in charge
        logger.warning("CPU attention kernel unavailable, using the PyTorch path: %s", exc)
        return None
