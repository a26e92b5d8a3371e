"""Process-wide off switches of the fused decode kernels, read once at import: for A/B runs of
one tree (``bench/latency_ab.sh``) and as an escape hatch should a kernel misbehave on a GPU.

* ``QWEN_SERVE_FUSED_QK_ROPE=0``: the model applies q/k RMSNorm and rotary itself and the
  attention op stores k/v (``kernels/qk_norm_rope.py`` not used);
* ``QWEN_SERVE_SMALL_M_GEMV=0``: every unquantized projection runs on cuBLAS
  (``kernels/gemv.py`` not used).

Both default to on; values 1/true/yes/on or 0/false/no/off, anything else is refused at
import with a ValueError naming the variable. Outputs are the same model's either way (within
bf16 rounding).
"""

from __future__ import annotations

import os


def _enabled(name: str) -> bool:
    value = os.environ.get(name, "1").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={value!r}: use 1/true/yes/on or 0/false/no/off")


FUSED_QK_ROPE = _enabled("QWEN_SERVE_FUSED_QK_ROPE")
SMALL_M_GEMV = _enabled("QWEN_SERVE_SMALL_M_GEMV")
