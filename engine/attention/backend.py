"""The attention backend protocol: store a step's keys/values into the paged cache, then attend.

Implementations: :mod:`engine.attention.torch_backend` (the torch references, CPU and CUDA) and
:mod:`engine.attention.triton_backend` (the Triton kernels, the CUDA default); the registry
(:mod:`engine.attention.registry`) creates them by name. Tensor layouts are those of
``kernels/reference.py``.
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    """Stores k/v into the paged cache and attends.

    Attributes:
        name: the registry name ("torch", "triton"); what the custom op receives.
    """

    name: str

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Attention of one layer for one step.

        Args:
            q: ``[T, H_q, D]``; k, v: ``[T, H_kv, D]`` (this step's new tokens, packed).
            k_cache, v_cache: ``[num_blocks, block_size, H_kv, D]`` of this layer, updated in place.
            meta: the step's metadata; scale: softmax scale.

        Returns:
            ``[T, H_q, D]`` attention output in ``q.dtype``.
        """
        ...
