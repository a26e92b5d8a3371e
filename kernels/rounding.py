"""Rounding of float32 kernel intermediates to the model dtype as torch rounds them (to nearest,
ties to even), also under the Triton CPU interpreter (whose float32 -> bfloat16 cast truncates)
and where the GPU compile would contract a rounding into a fused multiply-add.

On the GPU a ``(a * b).to(bf16)`` of float32 values widened from bf16 becomes an exact bf16
multiply, and with FP fusion on (Triton's default) it is contracted with a following add or
subtract into ``fma.rn.bf16``: the product's rounding is skipped. In the q/k norm + rotary
(``x1 cos - x2 sin``) that put results up to 60 bf16 ulps off eager torch near cancellation
(H200 and H100, 2026-12-06). Either round by integer ops (:func:`rounded`) or launch the
kernel with ``enable_fp_fusion=False``."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rounded(x, dtype: tl.constexpr):
    """float32 ``x`` rounded to ``dtype`` to nearest, ties to even, returned as float32: the
    value eager torch holds between two ops that each round to ``dtype``.

    For bfloat16 the rounding is integer arithmetic on the float32 bits (add ``0x7FFF`` plus the
    lowest kept bit, clear the low 16; NaN passes through), on every device: no FMA contraction
    can skip it (module docstring), and no interpreter cast truncates it. Integer work: keep it
    out of hot loops (in the GEMV prologues it cost an H100 11 % of a batch-1 decode step).
    float16 takes the cast round trip, which FP fusion can still contract (float32: none)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        y = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    else:
        y = x.to(dtype).to(tl.float32)
    return y


@triton.jit
def round_as(x, dtype: tl.constexpr, EXACT: tl.constexpr):
    """float32 ``x`` rounded to ``dtype`` and returned as float32: ``EXACT`` by :func:`rounded`,
    else by the plain cast round trip (cheaper; exact on the GPU only with FP fusion off, and the
    interpreter truncates bfloat16)."""
    if EXACT:
        y = rounded(x, dtype)
    else:
        y = x.to(dtype).to(tl.float32)
    return y


@triton.jit
def round_to(x, dtype: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """float32 ``x`` rounded to nearest even and returned in ``dtype`` (as torch casts).
    ``EMULATE_RNE`` (the interpreter with bfloat16, whose cast truncates): through
    :func:`rounded` first; on the GPU the cast itself rounds to nearest even (but FP fusion may
    contract it into an FMA with what follows: module docstring)."""
    if EMULATE_RNE:
        x = rounded(x, dtype)
    return x.to(dtype)
