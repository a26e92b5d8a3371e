"""Triton kernel that stores a step's new keys/values into the paged KV cache.

Layouts are those of :mod:`kernels.reference`: caches ``[num_blocks, block_size, H_kv, D]``,
new rows ``[T, H_kv, D]``, ``slot_mapping`` int64 ``[T]`` with ``slot = block * block_size +
offset`` and a negative slot meaning "skip" (padding). Imports only torch and triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["store_kv_cache"]


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_cb,  # cache strides (k_cache and v_cache are checked to share them)
    stride_co,
    stride_ch,
    stride_cd,
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per (token, tile of BLOCK_H kv heads): a [BLOCK_H, BLOCK_D] tile of k and v.
    tok = tl.program_id(0)
    h0 = tl.program_id(1) * BLOCK_H
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    offs_h = h0 + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_limit = tl.where(slot >= 0, num_kv_heads, 0)  # negative slot: store nothing
    mask = (offs_h[:, None] < h_limit) & (offs_d[None, :] < head_dim)
    safe_slot = tl.maximum(slot, 0)
    blk = safe_slot // BLOCK_SIZE
    off = safe_slot % BLOCK_SIZE
    tok64 = tok.to(tl.int64)
    k = tl.load(
        key_ptr + tok64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd,
        mask=mask,
    )
    v = tl.load(
        value_ptr + tok64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd,
        mask=mask,
    )
    dst = (
        blk * stride_cb
        + off * stride_co
        + offs_h[:, None] * stride_ch
        + offs_d[None, :] * stride_cd
    )
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new key/value rows into their paged-cache slots, in place (Triton).

    Same semantics as :func:`kernels.reference.store_kv_cache_ref`.

    Args:
        key, value: ``[T, H_kv, D]``, same dtype as the caches; any strides (e.g. views into a
            fused QKV projection output).
        k_cache, v_cache: ``[num_blocks, block_size, H_kv, D]`` with identical shapes and strides;
            the last dimension must be contiguous. Any ``block_size`` (not only powers of two).
        slot_mapping: int64 (int32 accepted) ``[T]``; ``slot = block * block_size + offset``.
            A negative slot means "do not store" (padding tokens).

    Raises:
        ValueError: on mismatched shapes, dtypes, devices or strides.

    Algorithm: a plain scatter, one program per (token, group of KV heads), as the
    ``reshape_and_cache`` kernel of vLLM (Kwon et al., SOSP 2023, PagedAttention). The launch
    reads no host values, so it can be captured in a CUDA graph.
    """
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(
            f"key/value must be [T, H_kv, D] of equal shape, got {tuple(key.shape)}, "
            f"{tuple(value.shape)}"
        )
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError("k_cache/v_cache must be [num_blocks, block_size, H_kv, D] of equal shape")
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have identical strides")
    t, h_kv, d = key.shape
    num_blocks, block_size, ch, cd = k_cache.shape
    if (ch, cd) != (h_kv, d):
        raise ValueError(f"cache heads/head_dim {(ch, cd)} do not match key {(h_kv, d)}")
    if not (key.dtype == value.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError("key, value, k_cache and v_cache must share one dtype")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != t:
        raise ValueError(f"slot_mapping must be [T={t}], got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"slot_mapping must be int64 or int32, got {slot_mapping.dtype}")
    devs = {key.device, value.device, k_cache.device, v_cache.device, slot_mapping.device}
    if len(devs) != 1:
        raise ValueError(f"all tensors must be on one device, got {devs}")
    if k_cache.stride(-1) != 1:
        raise ValueError("cache last dimension must be contiguous")
    if t == 0:
        return
    block_d = max(16, triton.next_power_of_2(d))
    block_h = 16  # tiles >= 16 in every dimension; rows past H_kv are masked
    grid = (t, triton.cdiv(h_kv, block_h))
    _store_kv_kernel[grid](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        key.stride(2),
        value.stride(0),
        value.stride(1),
        value.stride(2),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_cache.stride(3),
        h_kv,
        d,
        BLOCK_SIZE=block_size,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
    )
