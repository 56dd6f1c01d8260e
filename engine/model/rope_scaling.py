"""RoPE frequency scaling: how a checkpoint trained for a short context stretches its rotary
frequencies to a longer one. Llama 3.1's scheme is the one implemented."""

from __future__ import annotations

import math

import torch

from engine.model_config import Llama3RopeScaling


def scale_inv_freq(inv_freq: torch.Tensor, scaling: Llama3RopeScaling | None) -> torch.Tensor:
    """inv_freq (D/2,) fp32 -> the frequencies the checkpoint was trained with (D/2,)."""
    if scaling is None:
        return inv_freq
    context = scaling.original_max_position_embeddings
    low, high, factor = scaling.low_freq_factor, scaling.high_freq_factor, scaling.factor
    wavelength = 2 * math.pi / inv_freq
    # 0 at the long-wavelength edge of the blended band, 1 at its short edge; the operation
    # order is transformers', so that the frequencies agree to the bit.
    smooth = (context / wavelength - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    slowed = torch.where(wavelength > context / low, inv_freq / factor, blended)
    return torch.where(wavelength < context / high, inv_freq, slowed)
