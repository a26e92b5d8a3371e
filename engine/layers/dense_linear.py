"""The unquantized linear product of :class:`engine.layers.linear.LinearBase`: cuBLAS, or the
small-M Triton kernel (:mod:`kernels.gemv`) for decode-sized batches on CUDA.

The choice depends on the row count, which is dynamic inside a compiled (``torch.compile``) or
CUDA-graph-captured forward, so it is made inside one opaque custom op, ``qwen_serve::linear``
(as attention is, :mod:`engine.attention.custom_op`): Dynamo records one call with no guard on
the row count, and each captured graph holds whichever kernel its batch size got.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.layers.kernel_switches import SMALL_M_GEMV
from kernels.gemv import GEMV_MAX_M, gemv, gemv_config, triton_runs_on

_GEMV_DTYPES = (torch.bfloat16, torch.float16)


@torch.library.custom_op("qwen_serve::linear", mutates_args=())
def linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [M, K] @ weight[N, K]^T (+ bias)`` -> new ``[M, N]``: :func:`kernels.gemv.gemv` for
    ``M <= GEMV_MAX_M`` where the device's table (or heuristic) prefers it, else ``F.linear``."""
    m, k = x.shape
    if SMALL_M_GEMV and m <= GEMV_MAX_M and weight.is_contiguous() and triton_runs_on(x.device):
        cfg = gemv_config(m, weight.shape[0], k, x.device)
        if cfg is not None:
            return gemv(x, weight, bias, cfg)
    return F.linear(x, weight, bias)


@linear_op.register_fake
def _linear_fake(x, weight, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [..., K]`` -> ``[..., N]`` in x's dtype: :func:`linear_op` for bf16/fp16 on CUDA,
    ``F.linear`` elsewhere (CPU, float32, where the Triton kernel is not used)."""
    if x.device.type != "cuda" or x.dtype not in _GEMV_DTYPES or weight.dtype != x.dtype:
        return F.linear(x, weight, bias)
    lead = x.shape[:-1]
    y = linear_op(x.reshape(-1, x.shape[-1]), weight, bias)
    return y.reshape(*lead, weight.shape[0])
