"""RMSNorm (Zhang & Sennrich 2019) as in Hugging Face's Qwen3/Qwen2: statistics in float32,
residual adds in the model dtype."""

from __future__ import annotations

import torch
from torch import nn

from kernels.reference import rms_norm_ref


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` with the statistics in float32; ``x`` ``[..., D]``
    (the math is :func:`kernels.reference.rms_norm_ref`, shared with the attention backends'
    fused q/k norm)."""
    return rms_norm_ref(x, weight, eps)


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
