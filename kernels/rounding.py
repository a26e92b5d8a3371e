"""Rounding of float32 kernel intermediates to the model dtype as torch rounds them, also under
the Triton CPU interpreter (whose float32 -> bfloat16 cast truncates)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, dtype: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """float32 ``x`` rounded to ``dtype`` to nearest, ties to even (as torch casts), returned in
    ``dtype``. ``EMULATE_RNE``: the Triton interpreter's float32 -> bfloat16 cast truncates, so
    round the float32 bits first (add ``0x7FFF`` plus the lowest kept bit, clear the low 16;
    then the cast is exact). On the GPU the cast itself rounds to nearest even."""
    if EMULATE_RNE:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)
