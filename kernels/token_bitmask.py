"""Triton: apply packed token bitmasks to rows of logits (structured outputs).

Row ``rows[r]`` of ``logits`` ``[N, V]`` keeps token ``j`` where bit ``j % 32`` of word
``bitmask[r, j // 32]`` is set and gets ``-inf`` elsewhere -- the layout llguidance and
xgrammar fill (one bit per vocabulary entry, little-endian int32 words). Grid ``(R, cdiv(V,
BLOCK_V))``: one program per (masked row, vocabulary tile), reading the tile's words once and
writing only the disallowed entries. No host synchronisation; shapes only (graph-safe).
:func:`kernels.reference.apply_token_bitmask_ref` is the torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["apply_token_bitmask"]


@triton.jit
def _bitmask_kernel(
    logits_ptr,
    rows_ptr,
    mask_ptr,
    vocab,
    stride_lr,
    stride_mr,
    BLOCK_V: tl.constexpr,
):
    r = tl.program_id(0)
    tile = tl.program_id(1)
    row = tl.load(rows_ptr + r).to(tl.int64)
    cols = tile * BLOCK_V + tl.arange(0, BLOCK_V)
    in_vocab = cols < vocab
    words = tl.load(mask_ptr + r.to(tl.int64) * stride_mr + (cols >> 5), mask=in_vocab, other=0)
    allowed = ((words >> (cols & 31)) & 1) != 0
    ptrs = logits_ptr + row * stride_lr + cols
    tl.store(
        ptrs,
        tl.full([BLOCK_V], float("-inf"), logits_ptr.dtype.element_ty),
        mask=in_vocab & (~allowed),
    )


def apply_token_bitmask(
    logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor, block_v: int = 1024
) -> torch.Tensor:
    """Set the disallowed tokens of ``logits[rows]`` to ``-inf``, in place (Triton).

    Args:
        logits: float32 / bfloat16 / float16 ``[N, V]``, last dim contiguous.
        rows: int64 ``[R]`` row indices into ``logits`` (distinct).
        bitmask: int32 ``[R, W]`` with ``W >= ceil(V / 32)``: bit ``j % 32`` of word ``j // 32``
            set = token ``j`` allowed.
        block_v: vocabulary tile (a power of two >= 32).

    Returns:
        ``logits``.

    Raises:
        ValueError: wrong dims, dtypes, devices or a mask narrower than the vocabulary.
    """
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError("logits must be [N, V] with a contiguous last dim")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported logits dtype {logits.dtype}")
    r, vocab = rows.shape[0], logits.shape[1]
    if rows.dim() != 1 or rows.dtype != torch.int64:
        raise ValueError("rows must be int64 [R]")
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32 or bitmask.shape[0] != r:
        raise ValueError(
            f"bitmask must be int32 [R={r}, W], got {tuple(bitmask.shape)} {bitmask.dtype}"
        )
    if bitmask.shape[1] * 32 < vocab or bitmask.stride(1) != 1:
        raise ValueError(f"bitmask rows of {bitmask.shape[1]} words do not cover {vocab} tokens")
    if {rows.device, bitmask.device} != {logits.device}:
        raise ValueError("all tensors must be on the logits' device")
    if block_v < 32 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two >= 32, got {block_v}")
    if r == 0:
        return logits
    _bitmask_kernel[(r, triton.cdiv(vocab, block_v))](
        logits, rows, bitmask, vocab, logits.stride(0), bitmask.stride(0), BLOCK_V=block_v
    )
    return logits
