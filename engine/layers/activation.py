"""Activations of the MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU (Shazeer 2020): ``silu(gate) * up`` for ``x = [gate | up]`` ``[T, 2I]`` ->
    ``[T, I]``."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
