"""Activations of the MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU (Shazeer 2020): ``silu(gate) * up`` for ``x = [gate | up]`` ``[T, 2I]`` ->
    ``[T, I]``."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@torch.library.custom_op("qwen_serve::silu_and_mul", mutates_args=())
def silu_and_mul_triton_op(x: torch.Tensor) -> torch.Tensor:
    """:func:`kernels.swiglu.silu_and_mul` (the Triton kernel) as an op opaque to
    ``torch.compile``: ``x`` ``[T, 2I]`` -> ``[T, I]``, CUDA-graph capturable."""
    from kernels.swiglu import silu_and_mul as triton_silu_and_mul  # Triton: CUDA servers only

    return triton_silu_and_mul(x)


@silu_and_mul_triton_op.register_fake
def _silu_and_mul_fake(x):
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be [T, 2I], got {tuple(x.shape)}")
    return x.new_empty((x.shape[0], x.shape[1] // 2))


def takes_kernel(x: torch.Tensor) -> bool:
    """Whether ``x``'s device runs the Triton SwiGLU: CUDA (the CPU tests patch this to run the
    kernel under the interpreter)."""
    return x.is_cuda


def triton_or(fallback):
    """``silu_and_mul`` through the Triton kernel for a ``[T, 2I]`` tensor with an even,
    contiguous last dimension on a device :func:`takes_kernel` accepts, else ``fallback`` (the
    eager or compiled composition). The choice depends on the device, rank, shape and strides
    only, all static under ``torch.compile``."""

    def silu_and_mul_dispatch(x: torch.Tensor) -> torch.Tensor:
        if takes_kernel(x) and x.dim() == 2 and x.shape[1] % 2 == 0 and x.stride(1) == 1:
            return silu_and_mul_triton_op(x)
        return fallback(x)

    return silu_and_mul_dispatch
