"""The decoder's elementwise functions, eager or each compiled separately (``compile_mode="ops"``).

In eager mode every RMSNorm, rotary embedding and SwiGLU is a chain of 5-10 tiny kernels;
compiling each function fuses it into one kernel (as nano-vllm and gpt-fast do), at the cost of
a Dynamo guard check and a Python wrapper on the host per call. ``compile_mode="model"``
compiles the whole forward as one graph instead (``engine.models.compile``); which is faster
where is measured in docs/benchmarks.md (second session).
"""

from __future__ import annotations

from engine.layers import kernel_switches
from engine.layers.activation import silu_and_mul, triton_or
from engine.layers.norm import add_rms_norm, rms_norm
from engine.layers.rotary import qk_norm_rope, rope


class PointwiseOps:
    """:func:`rms_norm`, :func:`add_rms_norm`, :func:`rope`, :func:`qk_norm_rope` and
    :func:`silu_and_mul`, each compiled with ``dynamic=True`` when ``compiled`` is set.

    Compilation happens on first call (tens of seconds for all of them); the engine's warm-up
    and CUDA-graph capture trigger it before serving. A compiler failure falls back to the
    eager function (``torch._dynamo.config.suppress_errors``) instead of failing the engine.
    """

    def __init__(self, compiled: bool):
        if compiled:
            import torch._dynamo

            torch._dynamo.config.suppress_errors = True

        def wrap(fn):
            return torch.compile(fn, dynamic=True, fullgraph=True) if compiled else fn

        self.compiled = compiled
        self.rms_norm = wrap(rms_norm)
        self.add_rms_norm = wrap(add_rms_norm)
        self.rope = wrap(rope)
        self.qk_norm_rope = wrap(qk_norm_rope)
        self.silu_and_mul = wrap(silu_and_mul)
        if kernel_switches.TRITON_SWIGLU:  # CUDA tensors take the Triton kernel
            self.silu_and_mul = triton_or(self.silu_and_mul)
