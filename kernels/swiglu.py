"""Triton kernel: the SwiGLU activation of a prompt step, ``silu(gate) * up``.

The prefill path otherwise runs SwiGLU as the Inductor kernel of the compiled
``engine.layers.activation.silu_and_mul`` (``compile_mode="ops"``), compiled with dynamic shapes:
one flat index over ``T * I`` outputs split into a row and a column by division, which the
1k-token first-token profile of 2026-12-05 shows at ~1.4 TB/s (0.37 ms of the 3.2 ms step over
28 layers). Here a 2-D grid gives each program one row and one tile of columns: contiguous
loads of the gate and up halves and no index division (vLLM's ``silu_and_mul`` CUDA kernel has
the same one-row-per-block layout).

Rounding follows eager torch (the oracle, ``engine.layers.activation.silu_and_mul``): silu in
float32 rounded to the input dtype, then the product in float32 rounded again. For bf16/fp16
the GPU's approximate exp and division sit far inside the output's ulp; a float32 output takes
libdevice's ``expf`` and a correctly rounded division instead (the approximate pair was 4 ulps
off eager torch and more on the H200, 2026-12-05). Imports torch, triton and
:mod:`kernels.interpreter`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels.interpreter import interpreting

__all__ = ["silu_and_mul", "SWIGLU_BLOCK", "SWIGLU_WARPS"]

#: columns per program and warps per program (the GPU sweep in bench/swiglu.py times others)
SWIGLU_BLOCK = 1024
SWIGLU_WARPS = 4


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    inter,
    stride_xt,
    stride_ot,
    BLOCK: tl.constexpr,
    PRECISE: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    x_row = x_ptr + row * stride_xt
    gate = tl.load(x_row + cols, mask=mask, other=0.0)
    up = tl.load(x_row + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    if PRECISE:  # float32 output: libdevice's expf and an IEEE division, as torch's CUDA silu
        act = tl.math.div_rn(g, 1.0 + libdevice.exp(-g)).to(gate.dtype)
    else:  # ex2.approx and a fast division: far inside a bf16/fp16 ulp
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    y = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    tl.store(out_ptr + row * stride_ot + cols, y, mask=mask)


def silu_and_mul(
    x: torch.Tensor,
    out: torch.Tensor | None = None,
    block: int = SWIGLU_BLOCK,
    num_warps: int = SWIGLU_WARPS,
) -> torch.Tensor:
    """SwiGLU (Shazeer 2020) of ``x = [gate | up]``.

    Args:
        x: ``[T, 2I]``, float16/bfloat16/float32, last dimension contiguous (a rank's gate_up
            projection output).
        out: ``[T, I]`` of ``x``'s dtype and device, last dimension contiguous, to write into
            (None: a new tensor).
        block: columns per program (a power of two, at least 16); num_warps: per program.

    Returns:
        ``out``: ``silu(gate) * up`` ``[T, I]``, rounded as eager torch rounds it.

    Raises:
        ValueError: ``x`` not 2-D with an even, contiguous last dimension; ``out`` of another
            shape, dtype or device, or not contiguous in its last dimension; ``block`` not a
            power of two of at least 16.
    """
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two of at least 16, got {block}")
    if x.dim() != 2 or x.shape[1] % 2 or (x.shape[1] and x.stride(1) != 1):
        raise ValueError(
            f"x must be [T, 2I] with a contiguous last dimension, got {tuple(x.shape)} "
            f"strides {x.stride()}"
        )
    t, inter = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty((t, inter), dtype=x.dtype, device=x.device)
    elif (
        out.shape != (t, inter)
        or out.dtype != x.dtype
        or out.device != x.device
        or (inter and out.stride(1) != 1)
    ):
        raise ValueError(
            f"out must be [{t}, {inter}] {x.dtype} on {x.device} with a contiguous last "
            f"dimension, got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    if t == 0 or inter == 0:
        return out
    grid = (t, triton.cdiv(inter, block))
    # (the interpreter has no libdevice; its exp and division are numpy's, already exact)
    precise = x.dtype == torch.float32 and not interpreting()
    _silu_and_mul_kernel[grid](
        x, out, inter, x.stride(0), out.stride(0), BLOCK=block, PRECISE=precise,
        num_warps=num_warps,
    )  # fmt: skip
    return out
