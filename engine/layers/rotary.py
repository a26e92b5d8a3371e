"""Rotary position embedding (Su et al. 2021) with the rotate-half (GPT-NeoX) layout of Hugging
Face's Qwen3/Qwen2, and Qwen3's q/k RMSNorm fused in front of it."""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.layers.norm import rms_norm
from kernels.reference import rope_ref


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate q ``[T, Hq, D]`` and k ``[T, Hkv, D]`` by cos/sin ``[T, 1, D]`` (the math is
    :func:`kernels.reference.rope_ref`)."""
    return rope_ref(q, k, cos, sin)


def qk_norm_rope(q, k, q_weight, k_weight, eps: float, cos, sin):
    """Qwen3's per-head RMSNorm of q and k followed by the rotary embedding."""
    return rope(rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps), cos, sin)


def yarn_frequencies(head_dim: int, theta: float, scaling) -> tuple[torch.Tensor, float]:
    """YaRN's inverse frequencies ``[head_dim / 2]`` (float32) and cos/sin scale.

    ``scaling``: an ``engine.core.config.RopeScaling``. Dimension pair ``i`` rotates
    ``L / (2 pi theta^(2i/d))`` times over the original window ``L``; pairs rotating more than
    ``beta_fast`` times keep their frequency (extrapolation), those rotating fewer than
    ``beta_slow`` times are divided by ``factor`` (interpolation), with a linear ramp over the
    pairs in between (Peng et al. 2023, section 3.2; the same boundaries as transformers'
    ``_compute_yarn_parameters``, truncated to whole pairs when ``truncate``).
    """
    factor, original = scaling.factor, scaling.original_max_position_embeddings

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.attention_factor
    if attention is None:
        if scaling.mscale and scaling.mscale_all_dim:
            attention = mscale(factor, scaling.mscale) / mscale(factor, scaling.mscale_all_dim)
        else:
            attention = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (high-frequency pairs), 0: interpolate
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, float(attention)


class RotaryEmbedding(nn.Module):
    """A precomputed float32 cos/sin table ``[max_positions, head_dim]`` (not a parameter).

    The table is float32 whatever the default dtype the model is built under; a later
    ``Module.to(dtype)`` would round it (build the model in its dtype instead).

    Args:
        head_dim: rotated size; max_positions: table length (the engine's max_model_len);
        theta: the base (``rope_theta``).
        scaling: an ``engine.core.config.RopeScaling`` (YaRN, :func:`yarn_frequencies`), or None.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling=None):
        super().__init__()
        scale = 1.0
        if scaling is None:
            inv_freq = 1.0 / (
                theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
            )
        else:
            inv_freq, scale = yarn_frequencies(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        self.register_buffer("sin", emb.sin() * scale, persistent=False)

    def lookup(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, 1, D]`` in ``dtype`` for int64 positions ``[T]`` (once per forward)."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(
            dtype
        )
