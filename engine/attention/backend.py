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

    def forward_qk_rope(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        cos: torch.Tensor,
        sin: torch.Tensor,
        q_weight: torch.Tensor | None,
        k_weight: torch.Tensor | None,
        eps: float,
    ) -> torch.Tensor:
        """:meth:`forward` on the raw projections: per-head RMSNorm of q and k (skipped when
        the weights are None), rotary embedding (rotate-half) of both, k and v stored, then
        attention. Same results as ``kernels.reference.qk_norm_rope_store_ref`` followed by
        :meth:`forward`'s attention.

        Args:
            q: ``[T, H_q, D]``; k, v: ``[T, H_kv, D]`` in the cache dtype, any strides (views of
                the qkv projection output).
            k_cache, v_cache, meta, scale: as in :meth:`forward`.
            cos, sin: ``[T, 1, D]`` (or ``[T, D]``) in the cache dtype, the rotary table rows of
                the tokens' positions.
            q_weight, k_weight: ``[D]`` RMSNorm weights (Qwen3) or both None (Qwen2); eps: the
                RMSNorm epsilon.

        Returns:
            ``[T, H_q, D]`` attention output in ``q.dtype``.
        """
        ...
