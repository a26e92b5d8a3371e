"""Candidate stage-1 tiles of the split-KV paged decode kernel that ``bench/kernels.py --sweep``
times and ``bench/decode_compile_check.py`` compiles for sm_90 offline (no torch import here, so
the compile check can import it without ``bench/kernels.py``'s switch to Triton's interpreter
on a machine without CUDA).

Each entry is a :func:`kernels.decode_attention.decode_config` override.
"""

from __future__ import annotations

DECODE_CONFIGS = [
    {"BLOCK_N": 128, "num_warps": 4, "num_stages": 3},
    {"BLOCK_N": 128, "num_warps": 4, "num_stages": 3, "BT_PREFETCH": True},
    {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "BT_PREFETCH": True},
    {"BLOCK_N": 64, "num_warps": 4, "num_stages": 4, "BT_PREFETCH": True},
    {"BLOCK_N": 32, "num_warps": 4, "num_stages": 4, "BT_PREFETCH": True},
    {"BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "BT_PREFETCH": True},
]
