"""Shapes and candidate tiles of the small-M GEMV sweeps (``bench/gemv.py``, plain and
``--fused``) that ``bench/gemv_compile_check.py`` also compiles for sm_90 offline (nothing here
switches the Triton interpreter on, unlike ``bench/kernels.py``, so the compile check can import
it).
"""

from __future__ import annotations

import itertools

from kernels.gemv import GemvConfig

SHAPES = {
    "0.6B qkv": (4096, 1024),
    "0.6B o": (1024, 2048),
    "0.6B gate_up": (6144, 1024),
    "0.6B down": (1024, 3072),
    "8B qkv": (6144, 4096),
    "8B o": (4096, 4096),
    "8B gate_up": (24576, 4096),
    "8B down": (4096, 12288),
}
#: the fused sweep's shapes: (kind, N, K); K is the product's inputs (I for SwiGLU, the query
#: heads times head_dim for the split merge)
FUSED_SHAPES = {
    "0.6B qkv+norm": ("rms_norm", 4096, 1024),
    "0.6B gate_up+norm": ("rms_norm", 6144, 1024),
    "0.6B down+swiglu": ("swiglu", 1024, 3072),
    "0.6B o+merge": ("attn_merge", 1024, 2048),
    "0.6B qkv+norm+rope": ("qkv_rope", 4096, 1024),
    "8B qkv+norm": ("rms_norm", 6144, 4096),
    "8B gate_up+norm": ("rms_norm", 24576, 4096),
    "8B down+swiglu": ("swiglu", 4096, 12288),
    "8B qkv+norm+rope": ("qkv_rope", 6144, 4096),
}
#: head size of the "qkv_rope" shapes (its N tiles are one head each); 8 KV heads in both
QKV_ROPE_HEAD_DIM = 128
QKV_ROPE_KV_HEADS = 8
TINY_SHAPES = {"tiny qkv": (96, 64), "tiny down": (64, 160)}
TINY_FUSED_SHAPES = {
    "tiny qkv+norm": ("rms_norm", 96, 64),
    "tiny down+swiglu": ("swiglu", 64, 160),
    "tiny o+merge": ("attn_merge", 64, 128),
    "tiny qkv+norm+rope": ("qkv_rope", 64, 64),  # head_dim 16: 2 q heads, 1 KV head
}
TINY_CONFIGS = [GemvConfig(16, 32, 1, 4, 1), GemvConfig(32, 32, 2, 4, 1)]


def candidates(n: int, k: int, sweep: bool, tiny: bool, m: int = 1) -> list[GemvConfig]:
    """The plain sweep's tiles for ``m`` rows: N tiles of 16-64 (32-128 past 16 rows, where
    each program's activation tile is 32 or 64 rows: wider N tiles read it fewer times), K
    tiles of 128/256, 1, 2 or 4 splits (none leaving a split under one K tile), three stages
    (two for a 128 x 256 weight tile with 64 rows: three exceed an sm_90 block's shared
    memory), four warps (eight for 128-wide N tiles)."""
    if tiny:
        return TINY_CONFIGS
    if not sweep:
        return [GemvConfig()]
    out = []
    widths = (16, 32, 64) if m <= 16 else (32, 64, 128)
    for bn, bk, split in itertools.product(widths, (128, 256), (1, 2, 4)):
        if k // split < bk:
            continue
        stages = 2 if (bn, bk) == (128, 256) else 3
        out.append(GemvConfig(bn, bk, split, 8 if bn == 128 else 4, stages))
    return out


def fused_candidates(kind: str, k: int, tiny: bool) -> list[GemvConfig]:
    """8 per kind: 32/64 wide N tiles, K tiles of 128/256, and the two split counts that suit
    its K (the norm's prologue re-reads the rows in every program: fewer splits; the split
    merge's K tiles are 64/128, inside a head, and 4 or 16 splits: each program's merges wait
    on L2 before its products, so fewer K tiles per program). q/k/v with the q/k norm +
    rotary (``qkv_rope``): N tiles of one head, K tiles of 128/256 (two stages for 256: three
    exceed an sm_90 block's shared memory), 1-8 splits, 8 warps too where unsplit."""
    if kind == "qkv_rope":  # one head per N tile; the norm prologue: few splits
        if tiny:
            return [GemvConfig(16, 32, 1, 4, 1), GemvConfig(16, 32, 2, 4, 1)]
        return [
            GemvConfig(QKV_ROPE_HEAD_DIM, bk, split, warps, 3 if bk == 128 else 2)
            for bk, split, warps in itertools.product((128, 256), (1, 2, 4, 8), (4, 8))
            if k // split >= bk and (warps == 4 or split == 1)
        ]
    if tiny:
        return TINY_CONFIGS
    if kind == "attn_merge":  # K tiles inside a head; more splits: fewer merges per program
        return [
            GemvConfig(bn, bk, split, 4, 3)
            for bn, bk, split in itertools.product((32, 64), (64, 128), (4, 16))
            if k // split >= bk
        ]
    splits = (1, 2) if kind == "rms_norm" else (2, 4)
    return [
        GemvConfig(bn, bk, split, 4, 3)
        for bn, bk, split in itertools.product((32, 64), (128, 256), splits)
        if k // split >= bk
    ]
