"""Rounding of float32 kernel intermediates to the model dtype as torch rounds them (to nearest,
ties to even), also under the Triton CPU interpreter (whose float32 -> bfloat16 cast truncates)
and where the GPU compiler would drop a cast round trip."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rounded(x, dtype: tl.constexpr):
    """float32 ``x`` rounded to ``dtype`` to nearest, ties to even, returned as float32: the
    value eager torch holds between two ops that each round to ``dtype``.

    For bfloat16 the rounding is integer arithmetic on the float32 bits (add ``0x7FFF`` plus the
    lowest kept bit, clear the low 16; NaN passes through), on every device: a plain
    ``x.to(bf16).to(float32)`` round trip may be folded away by the GPU compiler (an H100/H200 run
    found the q/k norm + rotary epilogue off eager's results by up to 60 bf16 ulps near cancellation
    with such round trips), and the interpreter's cast truncates. Integer work: keep it out of hot
    loops (in the GEMV prologues it cost an H100 11 % of a batch-1 decode step). float16 takes the
    cast round trip (float32: none)."""
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
    else by the plain cast round trip (cheaper; the GPU compiler may drop it, the interpreter
    truncates bfloat16)."""
    if EXACT:
        y = rounded(x, dtype)
    else:
        y = x.to(dtype).to(tl.float32)
    return y


@triton.jit
def round_to(x, dtype: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """float32 ``x`` rounded to nearest even and returned in ``dtype`` (as torch casts).
    ``EMULATE_RNE`` (the interpreter with bfloat16, whose cast truncates): through
    :func:`rounded` first; on the GPU the cast itself rounds to nearest even (but a following
    ``.to(float32)`` may be folded with it: :func:`rounded` where that matters)."""
    if EMULATE_RNE:
        x = rounded(x, dtype)
    return x.to(dtype)
