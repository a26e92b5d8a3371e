"""Random weights from a seed instead of a checkpoint (benchmarks)."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def init_random_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Fill every parameter with N(0, std) drawn on the CPU from ``seed``, and norms with ones.

    The draw does not depend on the device, so two runs with one seed hold the same weights.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)
