"""Attention metadata of one engine step, passed explicitly to every layer (no global context)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Flat tensors describing the sequences of one step (all on the model's device).

    Attributes:
        slot_mapping: int64 ``[T]`` cache slot of every new token (``-1`` = padding, not stored).
        block_tables: int32 ``[B, max_blocks_per_seq]`` physical block ids per sequence.
        seq_lens: int32 ``[B]`` tokens in the cache per sequence after this step's store.
        cu_seqlens_q: int32 ``[B + 1]`` offsets of each sequence's new tokens in the packed batch.
        max_query_len: an upper bound of the new tokens of one sequence in this step (the
            padded token count inside a CUDA graph); no kernel reads it (the Triton kernels
            size their grids from tensor shapes), the runner uses it to tell decode steps apart.
        max_seq_len: an upper bound of the ``seq_lens`` entries (``max_model_len`` inside a
            CUDA graph); sizes the decode kernel's KV split count.
        is_decode: True when every sequence contributes exactly one new token; the backend may
            then use the paged-decode path (queries ``[B, H_q, D]``).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    max_query_len: int
    max_seq_len: int
    is_decode: bool
