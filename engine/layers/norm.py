"""RMSNorm (Zhang & Sennrich 2019) as in Hugging Face's Qwen3/Qwen2: statistics in float32,
residual adds in the model dtype."""

from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` with the statistics in float32; ``x`` ``[..., D]``."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """``residual + x`` (model dtype) and its RMSNorm: returns (normed, new residual)."""
    residual = residual + x
    return rms_norm(residual, weight, eps), residual


class RMSNorm(nn.Module):
    """Holds an RMSNorm weight ``[dim]`` and epsilon; the math is :func:`rms_norm` (run through
    :class:`engine.layers.pointwise.PointwiseOps`, compiled or not)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
