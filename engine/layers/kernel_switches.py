"""Process-wide off switches of the fused decode kernels, read once at import: for A/B runs of
one tree (``bench/latency_ab.sh``) and as an escape hatch should a kernel misbehave on a GPU.

* ``QWEN_SERVE_FUSED_QK_ROPE=0``: the model applies q/k RMSNorm and rotary itself and the
  attention op stores k/v (``kernels/qk_norm_rope.py`` not used);
* ``QWEN_SERVE_SMALL_M_GEMV=0``: every unquantized projection runs on cuBLAS
  (``kernels/gemv.py`` not used).

Both default to on. Outputs are the same model's either way (within bf16 rounding).
"""

from __future__ import annotations

import os


def _enabled(name: str) -> bool:
    return os.environ.get(name, "1").strip() != "0"


FUSED_QK_ROPE = _enabled("QWEN_SERVE_FUSED_QK_ROPE")
SMALL_M_GEMV = _enabled("QWEN_SERVE_SMALL_M_GEMV")
