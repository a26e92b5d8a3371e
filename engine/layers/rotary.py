"""Rotary position embedding (Su et al. 2021) with the rotate-half (GPT-NeoX) layout of Hugging
Face's Qwen3/Qwen2, and Qwen3's q/k RMSNorm fused in front of it."""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.norm import rms_norm


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate q ``[T, Hq, D]`` and k ``[T, Hkv, D]`` by cos/sin ``[T, 1, D]``."""
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def qk_norm_rope(q, k, q_weight, k_weight, eps: float, cos, sin):
    """Qwen3's per-head RMSNorm of q and k followed by the rotary embedding."""
    return rope(rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps), cos, sin)


class RotaryEmbedding(nn.Module):
    """A precomputed float32 cos/sin table ``[max_positions, head_dim]`` (not a parameter).

    The table is float32 whatever the default dtype the model is built under; a later
    ``Module.to(dtype)`` would round it (build the model in its dtype instead).

    Args:
        head_dim: rotated size; max_positions: table length (the engine's max_model_len);
        theta: the base (``rope_theta``).
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (
            theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        )
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def lookup(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, 1, D]`` in ``dtype`` for int64 positions ``[T]`` (once per forward)."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(
            dtype
        )
