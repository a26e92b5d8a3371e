"""The unquantized linear product of :class:`engine.layers.linear.LinearBase`: cuBLAS, or the
small-M Triton kernel (:mod:`kernels.gemv`) for decode-sized batches on CUDA.

The choice depends on the row count, which is dynamic inside a compiled (``torch.compile``)
forward, so there it is made inside one opaque custom op, ``qwen_serve::linear`` (as attention
is, :mod:`engine.attention.custom_op`): Dynamo records one call with no guard on the row count,
and each captured CUDA graph holds whichever kernel its batch size got. Outside a compiled
region (eager forwards) the same choice is made in Python directly, without the op's dispatch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.layers.kernel_switches import SMALL_M_GEMV

#: the dtypes whose decode-sized products go to the small-M kernel on CUDA
GEMV_DTYPES = (torch.bfloat16, torch.float16)


def _small_m_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """:func:`kernels.gemv.gemv` where it takes the operands and the device's table prefers
    it, else ``F.linear``; ``x`` 2-D. (:mod:`kernels.gemv` is imported here, not at module
    import: a CPU server never imports Triton.)"""
    from kernels.gemv import gemv, gemv_config, gemv_supports

    if gemv_supports(x, weight, bias):
        cfg = gemv_config(x.shape[0], weight.shape[0], x.shape[1], x.device)
        if cfg is not None:
            return gemv(x, weight, bias, cfg)
    return F.linear(x, weight, bias)


@torch.library.custom_op("qwen_serve::linear", mutates_args=())
def linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [M, K] @ weight[N, K]^T (+ bias)`` -> new ``[M, N]`` (``x`` 2-D): the small-M kernel
    for ``M <= GEMV_WIDE_MAX_M`` where it applies and the device's table prefers it, else
    ``F.linear``."""
    return _small_m_product(x, weight, bias)


@linear_op.register_fake
def _linear_fake(x, weight, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [..., K]`` -> ``[..., N]`` in x's dtype: the small-M choice for bf16/fp16 on CUDA
    (through :func:`linear_op` while compiling), ``F.linear`` elsewhere (CPU, float32, or
    ``QWEN_SERVE_SMALL_M_GEMV=0``)."""
    if (
        not SMALL_M_GEMV
        or x.device.type != "cuda"
        or x.dtype not in GEMV_DTYPES
        or weight.dtype != x.dtype
    ):
        return F.linear(x, weight, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if torch.compiler.is_compiling():
        y = linear_op(x2, weight, bias)
    else:
        y = _small_m_product(x2, weight, bias)
    return y.reshape(*lead, weight.shape[0])
