"""Elementwise pieces of the decoder: eager, or each compiled separately (``compile_mode="ops"``).

In eager mode every RMSNorm, rotary embedding and SwiGLU is a chain of 5-10 tiny kernels; at
batch 1 a Qwen3-0.6B decode step then runs about 1,700 kernels of 1-2 us each. Compiling these
functions fuses each into one kernel (as nano-vllm and gpt-fast do); but each compiled call
costs a Dynamo guard check and a Python wrapper on the host (about 100 us on an H200 host, 113
of them per forward). ``compile_mode="model"`` compiles the whole forward as one graph instead
(``engine.models.qwen3``); measured on an H200 it shortens a 1024-token prefill by ~5 ms but
slows decode under CUDA graphs (1.80 vs 1.56 ms/token) and compiles for minutes at start-up, so
the CUDA default stays ``"ops"`` (docs/benchmarks.md). The math is
the Hugging Face reference's: RMSNorm in float32, residual adds in the model dtype, rotate-half
rotary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` with the statistics in float32; ``x`` ``[..., D]``."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """``residual + x`` (model dtype) and its RMSNorm: returns (normed, new residual)."""
    residual = residual + x
    return rms_norm(residual, weight, eps), residual


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate q ``[T, Hq, D]`` and k ``[T, Hkv, D]`` by cos/sin ``[T, 1, D]`` (Su et al. 2021)."""
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def qk_norm_rope(q, k, q_weight, k_weight, eps: float, cos, sin):
    """Qwen3's per-head RMSNorm of q and k followed by the rotary embedding."""
    return rope(rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps), cos, sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU (Shazeer 2020): ``silu(gate) * up`` for ``x = [gate | up]`` ``[T, 2I]`` -> ``[T, I]``."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class PointwiseOps:
    """The functions above, each compiled with ``dynamic=True`` when ``compiled`` is set.

    Compilation happens on first call (tens of seconds for all four); the engine's warm-up and
    CUDA-graph capture trigger it before serving.
    """

    def __init__(self, compiled: bool):
        if compiled:
            import torch._dynamo

            # a compiler failure falls back to the eager function instead of failing the engine
            torch._dynamo.config.suppress_errors = True

        def wrap(fn):
            return torch.compile(fn, dynamic=True, fullgraph=True) if compiled else fn

        self.compiled = compiled
        self.rms_norm = wrap(rms_norm)
        self.add_rms_norm = wrap(add_rms_norm)
        self.rope = wrap(rope)
        self.qk_norm_rope = wrap(qk_norm_rope)
        self.silu_and_mul = wrap(silu_and_mul)
