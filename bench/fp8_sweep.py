"""Tile sweep of the block-FP8 linear kernels at Qwen3-8B's shapes for M = 1..4096 on one GPU;
writes the per-device table ``kernels/configs/fp8_gemm_<device>.json`` that
``kernels.fp8_configs.fp8_config`` reads.

Usage (one H200, from the repository root)::

    python3 bench/fp8_sweep.py --out $OUT [--write-table] [--budget-s 230] [--compile-budget-s 90]
        [--ms 1 16]   # only these M buckets; --write-table keeps the table's other buckets
    python3 bench/fp8_sweep.py --tiny --out /tmp/x   # CPU, Triton interpreter: the script's logic
    python3 bench/fp8_sweep.py --gemv-variants --out $OUT [--write-table]   # see below

Shapes (N, K): qkv 4096->6144, o 4096->4096, gate_up 4096->24576, down 12288->4096; M = each
table bucket (``kernels.fp8_configs.M_BUCKETS``, the largest M a bucket serves).

1. Candidates per (shape, M) (:func:`stage_a`, :func:`stage_b`): tile shapes and pipelines for
   the M regime (BLOCK_M 16..128, BLOCK_N 64..256, BLOCK_K 128, 4/8 warps, 2..5 stages), with and
   without the fused activation quantization, split-K where the tiles leave SMs idle, and the
   fused small-M kernel ("gemv", BLOCK_M 16..64) for M <= 64; at M = 1 (the batch-1 bucket)
   only the small-M kernel: what M = 1 runs before the sweep, its tensor-core tiles and its
   CUDA-core product (``fma``, one row) at 1-4 splits; then variants (split-K 1..8, GROUP_M
   1..64, fusion flipped) of the four fastest: at most 40 per (shape, M). Tiles whose
   estimated shared memory exceeds the H200's 227 KB are not tried; the built-in configuration
   (``default_fp8_config``) always is; from M = 64 on sm_90 also cuBLASLt's block-scaled GEMM
   (``kernels/fp8_cublas.py``, table kind "cublas"), checked like the others.
2. Compilation first, in parallel: every configuration any stage could try is launched once on
   small inputs with the same specialization (16-divisible sizes and strides) in a pool of
   spawned processes (at M = 16, and the small-M tiles also at M = 1: the JIT specializes an
   int argument equal to 1), which fills Triton's on-disk cache; the timing process then only
   loads kernels. Whatever has not compiled within ``--compile-budget-s`` is not timed.
3. Each candidate: two launches checked against the float32 product of the dequantized operands
   (``kernels.reference``: relative error <= ``TOL`` and bit-equal launches, split-K counters
   left zero), then the median of CUDA-graph replays over enough weight copies (>= 128 MB; one
   from M = 1024, where the product is compute bound) that no weight is still in L2 from the
   last call, as in a model whose layers each read their own weights; the same for bf16
   ``F.linear``. A configuration that fails to compile or to match is never picked.

``--gemv-variants`` (about a minute on the H200; default budgets 140 s, compile 50 s): M = 1 and 16
only, stage A replaced by :func:`variant_candidates` -- the table's choice today, the built-in
tiles, the plain small-M tiles and each option of ``kernels.fp8_gemm.fp8_gemv`` (``x_groups``
with ``block_k`` and ``prefetch``, ``scale_ahead``, ``fma`` with ``block_k`` and ``bit_cvt``),
split counts as launched -- and after the usual table one per M with the fastest configuration
of each option family per shape, their sum, TB/s and the sum's ratio to bf16's
(:func:`print_families`). ``--tiny`` runs it on the CPU as well.

Prints a markdown table (shape, M, best configuration, FP8 us, the built-in configuration's us,
bf16 us, FP8 / bf16 time, TFLOP/s, relative error) and the phases' wall times; writes all
timings (``fp8_sweep.json``) and the table to ``--out``, and with ``--write-table`` the table to
``kernels/configs/``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

if "--tiny" in sys.argv:  # before the kernels are imported (their @triton.jit reads it)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402

from kernels.fp8_configs import (  # noqa: E402
    CUBLAS_CONFIG,
    FP8_BLOCK,
    M_BUCKETS,
    Fp8Config,
    default_fp8_config,
    fp8_config,
    gemv_k_split,
    parse_table_entry,
)
from kernels.fp8_cublas import cublas_block_fp8_supported  # noqa: E402

SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288)]
TINY_SHAPES = [("tiny", 96, 320)]
TINY_MS = (1, 16, 32, 64)
#: relative error against the float32 product of the dequantized operands that a configuration
#: may have (the bf16 rounding of the output alone gives about 1.7e-3)
TOL = 5e-3
#: candidates per (shape, M) at most
MAX_CANDIDATES = 40
#: the H200's shared memory per block (227 KB)
SMEM_LIMIT = 227 * 1024
#: SMs a split-K choice aims to fill (H200: 132)
SMS = 132
#: weight bytes per timed graph, at least (the H200's L2 is 50 MB), for M below LARGE_M
COPY_BYTES = 128 << 20
LARGE_M = 1024
#: from this M the cuBLASLt block-scaled GEMM is timed too (on sm_90; kernels/fp8_cublas.py)
CUBLAS_MIN_M = 64

#: (block_m, block_n, num_warps, num_stages) tried first, by M regime. Left out: tiles whose
#: accumulator and dot result overflow 255 registers a thread and spill (sm_90, triton 3.9,
#: ``bench/fp8_compile_check.py``): 128x128 with 4 warps, 64x256 with 4 warps; 128x256 with 8
#: warps spills too and is kept once, as the largest tile.
TILES_SMALL = [  # M <= 128
    (16, 64, 4, 3), (16, 64, 4, 5), (16, 128, 4, 3), (16, 128, 4, 5), (32, 64, 4, 4),
    (32, 128, 4, 4), (64, 64, 4, 4), (64, 128, 4, 3), (64, 128, 4, 4), (64, 256, 8, 3),
]  # fmt: skip
TILES_MID = [  # M = 256, 512
    (32, 128, 4, 4), (64, 64, 4, 4), (64, 128, 4, 3), (64, 128, 4, 4), (64, 128, 4, 5),
    (64, 256, 8, 3), (128, 64, 4, 4), (128, 128, 8, 3), (128, 128, 8, 4), (128, 256, 8, 3),
]  # fmt: skip
TILES_LARGE = [  # M >= 1024
    (64, 128, 4, 3), (64, 128, 4, 4), (64, 128, 4, 5), (64, 128, 8, 4), (64, 256, 8, 3),
    (64, 256, 8, 4), (128, 64, 4, 3), (128, 64, 4, 4), (128, 128, 8, 3), (128, 128, 8, 4),
    (128, 128, 8, 5), (128, 256, 8, 3),
]  # fmt: skip
#: fused small-M kernel (block_n, num_warps, num_stages) x split-K, for M = 17..64
GEMV_TILES = [(64, 4, 4), (64, 4, 3), (128, 4, 3)]
GEMV_SPLITS = (1, 4)
#: the same for the decode bucket (M <= 16, weight-bandwidth bound: more bytes in flight per
#: SM from deeper pipelines, wider tiles or more K splits)
DECODE_GEMV_TILES = [(32, 4, 4), (64, 4, 4), (64, 4, 6), (64, 8, 4), (128, 4, 3), (128, 4, 4),
                     (128, 8, 4), (256, 8, 3)]  # fmt: skip
DECODE_GEMV_SPLITS = (1, 2, 4)
#: the decode bucket's rows (M = 2..16 run its entry)
DECODE_M = 16
#: the CUDA-core variant of the small-M kernel (``Fp8Config.fma``) for the batch-1 bucket:
#: (block_n, num_warps, num_stages) x split-K; the tensor-core candidates of the batch-1 bucket
#: are :data:`BATCH1_DOT_TILES` x :data:`BATCH1_DOT_SPLITS` and what M = 1 runs today (stage
#: B then tries other splits of the four fastest)
FMA_TILES = [(16, 2, 1), (32, 4, 1), (64, 4, 1), (64, 8, 1), (128, 8, 1), (32, 4, 3), (64, 4, 3)]
FMA_SPLITS = (1, 2, 4)
BATCH1_DOT_TILES = [(32, 4, 4), (64, 4, 4), (64, 8, 4), (128, 4, 4)]
BATCH1_DOT_SPLITS = (1, 4)
#: M of the warm-up launches: the JIT specializes an int argument equal to 1, so the batch-1
#: bucket's kernels are compiled at M = 1 as well
WARM_MS = (16, 1)
SPLITS = (1, 2, 4, 8)
GROUPS = (1, 8, 16, 32, 64)
TINY_TILES = [(16, 32, 4, 1), (32, 64, 4, 1)]
TINY_GEMV = [(32, 4, 1)]

# --gemv-variants: the small-M kernel's options (kernels/fp8_gemm.py, ``fp8_gemv``) against what
# the table runs today, at M = 1 and 16 (the candidates replace stage A's there)
#: the M buckets of the mode
VARIANT_MS = (1, DECODE_M)
#: candidates per (shape, M) at most in the mode (stage A + stage B)
VARIANT_MAX_CANDIDATES = 76
#: the plain tensor-core product with ``scale_ahead``: (block_n, num_warps, num_stages) x split-K
AHEAD_TILES = [(64, 4, 4), (128, 4, 4), (128, 8, 4)]
AHEAD_SPLITS = (1, 4)
#: the one-row CUDA-core product as it is (three of FMA_TILES) ...
VARIANT_FMA_TILES = [(16, 2, 1), (32, 4, 1), (64, 4, 1)]
#: ... and with ``block_k`` inputs an iteration: (block_n, num_warps, num_stages, block_k)
FMA_K_TILES = [(16, 2, 1, 512), (16, 4, 1, 512), (32, 4, 1, 256), (32, 4, 3, 256)]
#: ``bit_cvt`` (float8 -> float16 by shifts) on these of them
BIT_CVT_TILES = [(16, 4, 1, 512)]
VARIANT_FMA_SPLITS = (2, 4)
#: the block-diagonal operand (``x_groups``) at M = 1: (block_n, num_warps, num_stages,
#: x_groups, block_k), each at the splits of XG_SPLITS a launch really makes differently (at
#: least K / 128 / x_groups); with ``prefetch`` the tiles of XG1_PREFETCH too
XG1_TILES = [(64, 4, 4, 16, 128), (64, 4, 6, 16, 128), (128, 4, 4, 16, 128), (128, 8, 4, 16, 128),
             (64, 4, 4, 32, 256), (128, 4, 3, 32, 256), (64, 4, 3, 16, 512),
             (256, 8, 3, 16, 128)]  # fmt: skip
XG1_PREFETCH = [(128, 4, 4, 16, 128), (64, 4, 4, 32, 256)]
XG_SPLITS = (1, 2, 4, 8)
#: the same at the decode bucket (block_m 16: 2..8 groups in 32..128 columns)
XG16_TILES = [(64, 4, 4, 4, 128), (128, 8, 4, 4, 128), (64, 4, 4, 8, 128), (128, 8, 3, 4, 256)]
XG16_SPLITS = (1, 2)
#: the decode bucket's plain tiles in the mode (five of DECODE_GEMV_TILES)
VARIANT_DECODE_TILES = [(64, 4, 4), (128, 4, 4), (128, 8, 4), (64, 8, 4), (256, 8, 3)]
#: the mode under --tiny (the interpreter, one small shape): one tile of each option
TINY_VARIANTS = [
    Fp8Config("gemv", 1, 32, 4, 1, split_k=1, x_groups=16),
    Fp8Config("gemv", 1, 32, 4, 1, split_k=2, x_groups=16, block_k=256, prefetch=True),
    Fp8Config("gemv", 1, 16, 4, 1, split_k=2, fma=True, block_k=256),
    Fp8Config("gemv", 1, 16, 4, 1, split_k=1, fma=True, block_k=512, bit_cvt=True),
    Fp8Config("gemv", 16, 32, 4, 1, split_k=2, scale_ahead=True),
    Fp8Config("gemv", 16, 32, 4, 1, split_k=1, x_groups=2, block_k=256),
]
#: whether stage A and B make the mode's candidates (set by ``main`` from --gemv-variants)
GEMV_VARIANTS = {"on": False}


def log(msg: str = "") -> None:
    print(msg, flush=True)


# ----------------------------------------------------------------------------- candidates
def smem_bytes(cfg: Fp8Config) -> int:
    """Shared memory Triton's pipeline needs, estimated: ``num_stages`` buffers of both operand
    tiles (activations in bf16 where the kernel quantizes them itself)."""
    bk = FP8_BLOCK[1]
    if cfg.kind == "gemv":
        bk = cfg.block_k
        if cfg.x_groups:  # weight tiles, and one [block_k, block_m * x_groups] float8 operand
            return cfg.num_stages * cfg.block_n * bk + bk * cfg.block_m * cfg.x_groups
        return cfg.num_stages * (cfg.block_n * bk + bk * cfg.block_m * 2)  # fma: <= this
    a_bytes = 2 if cfg.fuse_quant else 1
    extra = cfg.block_m * bk if cfg.fuse_quant else 0  # the quantized tile for the MMA
    return cfg.num_stages * (cfg.block_m * bk * a_bytes + cfg.block_n * bk) + extra


def auto_split(m: int, n: int, k: int, cfg: Fp8Config) -> int:
    """The smallest split-K of :data:`SPLITS` that gives >= SMS programs, else the largest that
    leaves each split >= 2 K blocks; 1 for M > 256."""
    if m > 256:
        return 1
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    kb = triton.cdiv(k, FP8_BLOCK[1])
    allowed = [s for s in SPLITS if kb >= 2 * s] or [1]
    return next((s for s in allowed if tiles * s >= SMS), allowed[-1])


def _fits(m: int, cfg: Fp8Config) -> bool:
    return smem_bytes(cfg) <= SMEM_LIMIT and cfg.block_m <= max(16, triton.next_power_of_2(m))


def stage_a(m: int, n: int, k: int, tiny: bool = False) -> list[Fp8Config]:
    """First candidates for ``[M, K] x [K, N]``: the built-in configuration, the regime's tiles
    (with and without fused quantization for M = 17..512, only fused at decode sizes, split-K
    per :func:`auto_split`), and for M <= 64 the fused small-M kernel (more tiles and splits
    at decode sizes); at M = 1 (:func:`batch1_candidates`) the small-M kernel only, with its
    CUDA-core variant. With --gemv-variants (``GEMV_VARIANTS``) at M = 1 and 16: the mode's
    candidates (:func:`variant_candidates`)."""
    if GEMV_VARIANTS["on"] and m in VARIANT_MS:
        return variant_candidates(m, n, k, tiny)
    if m == 1:
        return batch1_candidates(n, k, tiny)
    out = [default_fp8_config(m, n, k)]
    tiles = (
        TINY_TILES if tiny else TILES_SMALL if m <= 128 else TILES_MID if m <= 512 else TILES_LARGE
    )
    # decode sizes: the GEMM only with its quantization fused (a second launch never pays there)
    fusions = (True,) if m <= DECODE_M else (False, True) if m <= 512 else (False,)
    for (bm, bn, warps, stages), fuse in ((t, f) for t in tiles for f in fusions):
        cfg = Fp8Config("gemm", bm, bn, warps, stages, group_m=8, fuse_quant=fuse)
        cfg = replace(cfg, split_k=auto_split(m, n, k, cfg))
        if _fits(m, cfg):
            out.append(cfg)
    if m <= 64:
        bm = max(16, triton.next_power_of_2(m))
        gemv_tiles, gemv_splits = (
            (TINY_GEMV, GEMV_SPLITS) if tiny
            else (DECODE_GEMV_TILES, DECODE_GEMV_SPLITS) if m <= DECODE_M
            else (GEMV_TILES, GEMV_SPLITS)
        )  # fmt: skip
        for (bn, warps, stages), split in ((t, s) for t in gemv_tiles for s in gemv_splits):
            cfg = Fp8Config("gemv", bm, bn, warps, stages, split_k=split)
            if _fits(m, cfg):
                out.append(cfg)
    return list(dict.fromkeys(out))


def batch1_candidates(n: int, k: int, tiny: bool = False) -> list[Fp8Config]:
    """The batch-1 bucket's candidates: the built-in configuration, what M = 1 runs on this
    device before the sweep (the decode bucket's entry), the small-M kernel's tensor-core tiles
    and its CUDA-core variant (``fma``, one row) at several K splits."""
    out = [default_fp8_config(1, n, k)]
    if not tiny and torch.cuda.is_available():
        out.append(fp8_config(1, n, k, device=torch.device("cuda")))
    dot_tiles = TINY_GEMV if tiny else BATCH1_DOT_TILES
    fma_tiles = TINY_GEMV if tiny else FMA_TILES
    for (bn, warps, stages), split in ((t, s) for t in dot_tiles for s in BATCH1_DOT_SPLITS):
        out.append(Fp8Config("gemv", 16, bn, warps, stages, split_k=split))
    for (bn, warps, stages), split in ((t, s) for t in fma_tiles for s in FMA_SPLITS):
        out.append(Fp8Config("gemv", 1, bn, warps, stages, split_k=split, fma=True))
    return [c for c in dict.fromkeys(out) if _fits(1, c)]


def table_choice(m: int, n: int, k: int) -> Fp8Config | None:
    """What ``fp8_linear`` runs for ``[M, K] x [K, N]`` on this GPU today (its table entry, or
    the built-in tiles); None without a GPU. A "cublas" entry is returned as such."""
    if not torch.cuda.is_available():
        return None
    return fp8_config(m, n, k, device=torch.device("cuda"), dtype=torch.bfloat16)


def as_launched(k: int, cfg: Fp8Config) -> Fp8Config:
    """``cfg`` with the split count its launch really makes over ``K`` (a small-M launch may
    make fewer splits than asked, none empty, or with ``x_groups`` more): equal launches get
    equal configurations, and ``split_k > 1`` says whether the kernel is compiled for splits
    (:func:`compile_key`)."""
    if cfg.kind != "gemv":
        return cfg
    return replace(cfg, split_k=gemv_k_split(k, cfg)[0])


def variant_candidates(m: int, n: int, k: int, tiny: bool = False) -> list[Fp8Config]:
    """--gemv-variants' candidates at M = 1 or 16: the table's choice today, the built-in
    configuration, the plain small-M kernel's tiles, and its options (``scale_ahead``;
    at M = 1 ``fma`` with ``block_k`` and ``bit_cvt``; ``x_groups``, with ``prefetch`` at
    M = 1). Every one fits the shared memory; split counts as launched (:func:`as_launched`),
    so no two candidates launch alike."""
    out = [default_fp8_config(m, n, k)]
    today = table_choice(m, n, k)
    if today is not None and today.kind != "cublas":
        out.append(today)
    if tiny:
        out += [c for c in TINY_VARIANTS if (m == 1) == (c.block_m == 1)]
        out.append(Fp8Config("gemv", 16, 32, 4, 1, split_k=2))
    elif m == 1:
        for (bn, w, st), sp in ((t, s) for t in BATCH1_DOT_TILES for s in BATCH1_DOT_SPLITS):
            out.append(Fp8Config("gemv", 16, bn, w, st, split_k=sp))
        for (bn, w, st), sp in ((t, s) for t in AHEAD_TILES for s in AHEAD_SPLITS):
            out.append(Fp8Config("gemv", 16, bn, w, st, split_k=sp, scale_ahead=True))
        for (bn, w, st), sp in ((t, s) for t in VARIANT_FMA_TILES for s in VARIANT_FMA_SPLITS):
            out.append(Fp8Config("gemv", 1, bn, w, st, split_k=sp, fma=True))
        for (bn, w, st, bk), sp in ((t, s) for t in FMA_K_TILES for s in VARIANT_FMA_SPLITS):
            out.append(Fp8Config("gemv", 1, bn, w, st, split_k=sp, fma=True, block_k=bk))
        for (bn, w, st, bk), sp in ((t, s) for t in BIT_CVT_TILES for s in VARIANT_FMA_SPLITS):
            cfg = Fp8Config("gemv", 1, bn, w, st, split_k=sp, fma=True, block_k=bk)
            out.append(replace(cfg, bit_cvt=True))
        tiles = [(t, False) for t in XG1_TILES] + [(t, True) for t in XG1_PREFETCH]
        for ((bn, w, st, g, bk), pf), sp in ((t, s) for t in tiles for s in XG_SPLITS):
            out.append(Fp8Config("gemv", 1, bn, w, st, sp, x_groups=g, block_k=bk, prefetch=pf))
    else:
        for (bn, w, st), sp in ((t, s) for t in VARIANT_DECODE_TILES for s in DECODE_GEMV_SPLITS):
            out.append(Fp8Config("gemv", 16, bn, w, st, split_k=sp))
        for (bn, w, st), sp in ((t, s) for t in AHEAD_TILES for s in AHEAD_SPLITS):
            out.append(Fp8Config("gemv", 16, bn, w, st, split_k=sp, scale_ahead=True))
        for (bn, w, st, g, bk), sp in ((t, s) for t in XG16_TILES for s in XG16_SPLITS):
            out.append(Fp8Config("gemv", 16, bn, w, st, split_k=sp, x_groups=g, block_k=bk))
    out = [out[0]] + [as_launched(k, c) for c in out[1:]]
    return [c for c in dict.fromkeys(out) if _fits(m, c)]


def _splits_used(k: int, cfg: Fp8Config) -> int:
    """The number of K splits a launch of ``cfg`` makes over ``K`` (no split empty;
    ``kernels.fp8_configs.gemv_k_split``, which is the GEMM's split too)."""
    return gemv_k_split(k, cfg)[0]


def variants(m: int, n: int, k: int, cfg: Fp8Config) -> list[Fp8Config]:
    """Neighbours of a good configuration: other split-K (M <= 256; only splits the launch
    would really make differently), GROUP_M (more than one M tile), the fusion flipped (gemm);
    for the fused small-M kernel, other splits (with --gemv-variants counted as launched)."""
    if cfg.kind == "cublas":
        return []  # cuBLASLt chooses its own tiles
    splits = (1, 2, 3, 4, 6, 8, 12, 16) if cfg.kind == "gemv" else SPLITS if m <= 256 else ()
    seen = {_splits_used(k, cfg)}
    out = []
    for s in splits:
        v = replace(cfg, split_k=s)
        if _splits_used(k, v) not in seen:
            seen.add(_splits_used(k, v))
            out.append(as_launched(k, v) if GEMV_VARIANTS["on"] else v)
    if cfg.kind == "gemm":
        if triton.cdiv(m, cfg.block_m) > 1:
            out += [replace(cfg, group_m=g) for g in GROUPS if g != cfg.group_m]
        out.append(replace(cfg, fuse_quant=not cfg.fuse_quant))
    return [c for c in out if _fits(m, c)]


def stage_b(
    m: int, n: int, k: int, ranked: list[Fp8Config], tried: set, room: int
) -> list[Fp8Config]:
    """Variants of the four fastest of ``ranked`` not yet ``tried``, at most ``room``."""
    out = []
    for cfg in ranked[:4]:
        for v in variants(m, n, k, cfg):
            if v not in tried and v not in out:
                out.append(v)
    return out[:room]


def compile_key(cfg: Fp8Config) -> tuple:
    """What makes Triton compile another kernel: tiles, warps, stages, the fused quantization,
    the small-M kernel's options and whether there are splits (GROUP_M and the split count are
    run-time arguments of the GEMM; the gemv's reduction kernel is small)."""
    return (cfg.kind, cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages,
            cfg.fuse_quant, cfg.fma, cfg.split_k > 1, cfg.block_k, cfg.x_groups,
            cfg.scale_ahead, cfg.prefetch, cfg.bit_cvt)  # fmt: skip


def compile_set(shapes, ms, tiny: bool = False) -> list[Fp8Config]:
    """One configuration per :func:`compile_key` that any stage may time over ``shapes`` x
    ``ms`` (stage B's variants of every stage-A candidate, since the fastest are not known
    before timing)."""
    keys: dict[tuple, Fp8Config] = {}
    for _, n, k in shapes:
        for m in ms:
            for cfg in stage_a(m, n, k, tiny):
                for c in [cfg, *variants(m, n, k, cfg)]:
                    keys.setdefault(compile_key(c), c)
    return list(keys.values())


# ----------------------------------------------------------------------------- compilation
_WARM: dict = {}
#: (M, N, K) of the warm-up launches: sizes and strides divisible by 16 as the timed ones are,
#: so the JIT specializes alike (tests/unit/test_bench_fp8_sweep.py checks it)
WARM_SHAPE = (16, 256, 2048)


def _warm_init(tiny: bool) -> None:
    if tiny:
        os.environ["TRITON_INTERPRET"] = "1"
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    m, n, k = (16, 64, 256) if tiny else WARM_SHAPE
    g = torch.Generator().manual_seed(0)
    _WARM["x"] = torch.randn(m, k, generator=g).to(dev, torch.bfloat16)
    _WARM["w"] = torch.randn(n, k, generator=g).to(dev, torch.float8_e4m3fn)
    _WARM["ws"] = (torch.rand(-(-n // 128), -(-k // 128), generator=g) + 1e-3).to(dev)


def _warm_one(cfg: Fp8Config) -> tuple[Fp8Config, str | None, float]:
    from kernels.fp8_gemm import fp8_linear

    t = time.perf_counter()
    try:
        for m in WARM_MS:  # every M the configuration may be timed at specializes alike
            if cfg.kind == "cublas" or (cfg.kind == "gemv" and m > cfg.block_m):
                continue
            if m == 1 and not (cfg.kind == "gemv" and cfg.block_m <= 16):
                continue  # M = 1 times only the small-M kernel's batch-1 tiles
            fp8_linear(_WARM["x"][:m], _WARM["w"], _WARM["ws"], config=cfg)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return cfg, None, time.perf_counter() - t
    except Exception as exc:  # noqa: BLE001 - a tile the compiler refuses (resources, ...)
        return cfg, f"{type(exc).__name__}: {str(exc)[:160]}", time.perf_counter() - t


def warm_compile(cfgs, workers: int, budget_s: float, tiny: bool) -> dict[tuple, str | None]:
    """Compile ``cfgs`` in ``workers`` spawned processes (Triton's disk cache is shared), for at
    most ``budget_s``; compile key -> None (compiled) or the error. Keys missing: not reached."""
    result: dict[tuple, str | None] = {}
    ctx = multiprocessing.get_context("spawn")
    deadline = time.perf_counter() + budget_s
    pool = ctx.Pool(workers, initializer=_warm_init, initargs=(tiny,))
    try:
        it = pool.imap_unordered(_warm_one, cfgs)
        for _ in cfgs:
            try:
                cfg, err, secs = it.next(timeout=max(0.0, deadline - time.perf_counter()))
            except multiprocessing.TimeoutError:
                log(
                    f"compile budget {budget_s:.0f} s spent: {len(cfgs) - len(result)} not compiled"
                )
                break
            result[compile_key(cfg)] = err
            if err:
                log(f"  compile failed {cfg_str(cfg)}: {err}")
    finally:
        pool.terminate()  # nothing of the pool runs on the GPU while the timing runs
        pool.join()
    return result


# ----------------------------------------------------------------------------- timing
#: first launches in the timing process that took over a second (compiled there, not loaded)
COLD = {"n": 0}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def time_us(fns, device) -> float:
    """us of one call: CUDA-graph replays of ``fns`` (bench.moe.graph_ms) on the GPU, one eager
    round on the CPU."""
    if device.type != "cuda":
        t = time.perf_counter()
        for f in fns:
            f()
        return 1e6 * (time.perf_counter() - t) / len(fns)
    from bench.moe import graph_ms

    ms = graph_ms(fns, reps=10, rounds=2)
    if ms is None:
        raise RuntimeError("not capturable in a CUDA graph")
    return 1e3 * ms


#: whether the cuBLASLt kind is timed in this run (set by :func:`cublas_probe` in ``main``)
CUBLAS = {"ok": False}

_PROBE = """
import sys
import torch
from kernels.fp8_cublas import probe_cublas
for shape in sys.argv[1:]:
    ok, why = probe_cublas(torch.device("cuda"), *map(int, shape.split(",")))
    if not ok:
        sys.exit(f"{shape}: {why}")
print("ok True")
"""


def cublas_probe(shapes) -> bool:
    """The engine's load-time probe (``kernels.fp8_cublas.probe_cublas``) of each ``(name, N,
    K)`` of ``shapes``, in a child process: a torch or cuBLASLt without the recipe refuses, and
    a launch that broke the CUDA context would end this process's sweep, so the kind is timed
    only when the child succeeds."""
    import subprocess

    args = [f"{n},{k}" for _, n, k in shapes]
    try:
        run = subprocess.run(
            [sys.executable, "-c", _PROBE, *args], capture_output=True, text=True, timeout=120,
            cwd=REPO,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        log("cublas probe: timed out; the cublas kind is not timed")
        return False
    ok = run.returncode == 0 and run.stdout.strip().endswith("ok True")
    reason = "" if ok else f": {(run.stderr.strip().splitlines() or ['?'])[-1][:200]}"
    log(f"cublas probe: {'ok, timed from M = ' + str(CUBLAS_MIN_M) if ok else 'failed'}{reason}")
    return ok


def cfg_str(cfg: Fp8Config) -> str:
    """``gemm 64x128 w4 s4 g8 split1 fused`` / ``gemv 1x16 w2 s1 split4 fma`` / ``gemv 1x128
    w4 s4 split2 bk256 xg16 prefetch``: kind, tiles, warps, stages, GROUP_M, split-K, options
    (``bk``: block_k, ``xg``: x_groups, ``ahead``: scale_ahead, ``bitcvt``: bit_cvt)."""
    if cfg.kind == "cublas":
        return "cublas (cuBLASLt block-scaled)"
    tiles = f"{cfg.kind} {cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}"
    if cfg.kind == "gemv":
        opts = [
            " fma" if cfg.fma else "",
            f" bk{cfg.block_k}" if cfg.block_k != FP8_BLOCK[1] else "",
            f" xg{cfg.x_groups}" if cfg.x_groups else "",
            " ahead" if cfg.scale_ahead else "",
            " prefetch" if cfg.prefetch else "",
            " bitcvt" if cfg.bit_cvt else "",
        ]
        return f"{tiles} split{cfg.split_k}{''.join(opts)}"
    return f"{tiles} g{cfg.group_m} split{cfg.split_k}{' fused' if cfg.fuse_quant else ''}"


def check_and_time(cfg, x, ref, wqs, wss, device, compiled) -> tuple[float | None, float, str]:
    """(us or None, relative error, why rejected or '') of one configuration."""
    from kernels.fp8_gemm import fp8_linear
    from kernels.gemv import gemv_counters

    triton_kernel = cfg.kind != "cublas"
    if triton_kernel and compiled is not None and compile_key(cfg) not in compiled:
        return None, float("nan"), "not compiled within the budget"
    if triton_kernel and compiled is not None and compiled[compile_key(cfg)] is not None:
        return None, float("nan"), "compile failed"
    try:
        t = time.perf_counter()
        a = fp8_linear(x, wqs[0], wss[0], config=cfg)
        if device.type == "cuda":
            torch.cuda.synchronize()
            if time.perf_counter() - t > 1.0:  # loading a cached kernel takes milliseconds
                COLD["n"] += 1
        b = fp8_linear(x, wqs[0], wss[0], config=cfg)
        err = rel(a, ref)
        if not err <= TOL:  # NaN too
            return None, err, f"relative error {err:.1e} > {TOL:.0e}"
        if not torch.equal(a, b):
            return None, err, "two launches differ"
        if cfg.split_k > 1 and int(gemv_counters(x.device).abs().sum()) != 0:
            gemv_counters(x.device).zero_()  # so that the next candidates start from zero
            return None, err, "split-K counters left non-zero"
        fns = [partial(fp8_linear, x, w, s, config=cfg) for w, s in zip(wqs, wss)]
        return time_us(fns, device), err, ""
    except Exception as exc:  # noqa: BLE001 - launch or capture failure: not picked
        if device.type == "cuda":
            torch.cuda.synchronize()
        gemv_counters(x.device).zero_()  # a failed split launch may have left counts behind
        return None, float("nan"), f"{type(exc).__name__}: {str(exc)[:120]}"


def sweep_shape(name, n, k, ms, device, compiled, deadline, tiny) -> list[dict]:
    """Rows (one per M) with the best configuration and all timings of one shape. Each M gets
    an equal share of the time left before ``deadline``: past its share stage B is skipped,
    past the deadline the M."""
    from engine.layers.quantization.fp8 import quantize_fp8_blocks
    from kernels.reference import fp8_block_dequant_ref, fp8_group_quant_ref

    g = torch.Generator(device="cpu").manual_seed(n * 7 + k)
    w = (torch.randn(n, k, generator=g) * 0.02).to(device, torch.bfloat16)
    wq, ws = quantize_fp8_blocks(w)
    w_deq = fp8_block_dequant_ref(wq, ws)
    copies = 1 if tiny else -(-COPY_BYTES // (n * k))
    wqs_all = [wq] + [wq.clone() for _ in range(copies - 1)]
    wss_all = [ws] + [ws.clone() for _ in range(copies - 1)]
    wbs_all = [w] + [w.clone() for _ in range(-(-copies // 2) - 1)]  # bf16: twice the bytes
    rows = []
    for i, m in enumerate(ms):
        now = time.perf_counter()
        if now > deadline:
            log(f"{name} M={m}: time budget spent, skipped")
            continue
        share = now + (deadline - now) / (len(ms) - i)
        # from M = LARGE_M the product is compute bound: one weight copy (L2 residency aside)
        c = copies if m < LARGE_M else 1
        wqs, wss, wbs = wqs_all[:c], wss_all[:c], wbs_all[: -(-c // 2)]
        x = torch.randn(m, k, generator=g).to(device, torch.bfloat16)
        xq, xs = fp8_group_quant_ref(x)
        ref = (xq.float() * xs.repeat_interleave(FP8_BLOCK[1], 1)[:, :k]) @ w_deq.t()
        bf16_us = time_us([partial(torch.nn.functional.linear, x, wb) for wb in wbs], device)
        bf16_err = rel(torch.nn.functional.linear(x, w), x.float() @ w.float().t())
        timed: dict[Fp8Config, tuple] = {}
        for cfg in stage_a(m, n, k, tiny):
            timed[cfg] = check_and_time(cfg, x, ref, wqs, wss, device, compiled)
        if m >= CUBLAS_MIN_M and CUBLAS["ok"]:
            timed[CUBLAS_CONFIG] = check_and_time(CUBLAS_CONFIG, x, ref, wqs, wss, device, None)
        ranked = sorted((c for c in timed if timed[c][0] is not None), key=lambda c: timed[c][0])
        if time.perf_counter() < share:
            cap = VARIANT_MAX_CANDIDATES if GEMV_VARIANTS["on"] else MAX_CANDIDATES
            room = max(0, cap - len(timed))
            for cfg in stage_b(m, n, k, ranked, set(timed), room):
                timed[cfg] = check_and_time(cfg, x, ref, wqs, wss, device, compiled)
        ok = {c: v for c, v in timed.items() if v[0] is not None}
        default = default_fp8_config(m, n, k)
        row = {"shape": name, "n": n, "k": k, "m": m, "bf16_us": bf16_us, "bf16_err": bf16_err,
               "default": asdict(default), "default_us": timed[default][0],
               "tried": len(timed), "passed": len(ok),
               "all": [{**asdict(c), "us": v[0], "err": v[1], "rejected": v[2]}
                       for c, v in timed.items()]}  # fmt: skip
        today = table_choice(m, n, k) if GEMV_VARIANTS["on"] and not tiny else None
        if today is not None:  # what fp8_linear runs today, as stage A timed it
            today = today if today.kind == "cublas" else as_launched(k, today)
            row.update(table=asdict(today), table_us=timed.get(today, (None,))[0])
        if ok:
            best = min(ok, key=lambda c: ok[c][0])
            row.update(best=asdict(best), fp8_us=ok[best][0], err=ok[best][1])
            row["tflops"] = 2 * m * n * k / (row["fp8_us"] * 1e-6) / 1e12
        rows.append(row)
        log(
            f"{name} {k}->{n} M={m}: {len(ok)}/{len(timed)} passed; best "
            f"{cfg_str(best) + f' {ok[best][0]:.1f} us' if ok else '-'}; bf16 {bf16_us:.1f} us"
        )
        del ref, xq, xs
    del w, wq, ws, w_deq, wqs_all, wss_all, wbs_all
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def table_of(rows) -> dict:
    """The kernels/configs table: ``"N,K" -> bucket -> best configuration + measurements``."""
    table: dict = {}
    for r in rows:
        if "best" not in r:
            continue
        best = r["best"] if r["best"]["kind"] != "cublas" else {"kind": "cublas"}
        if best["kind"] == "cublas":  # what the bucket runs where the load-time probe fails
            triton_ok = [a for a in r["all"] if a["us"] is not None and a["kind"] != "cublas"]
            if triton_ok:
                fast = min(triton_ok, key=lambda a: a["us"])
                fields = {f: fast[f] for f in Fp8Config.__dataclass_fields__}
                best = {**best, "fallback": {**fields, "fp8_us": round(fast["us"], 2)}}
        entry = {**best, "fp8_us": round(r["fp8_us"], 2), "bf16_us": round(r["bf16_us"], 2)}
        if r["default_us"] is not None:
            entry["default_us"] = round(r["default_us"], 2)
        parse_table_entry(entry, r["m"], "sweep output")  # what fp8_config will accept
        table.setdefault(f"{r['n']},{r['k']}", {})[str(r["m"])] = entry
    return table


def merge_tables(kept: dict, swept: dict) -> dict:
    """The device's table ``kept`` with the buckets of ``swept`` (a partial sweep, ``--ms``)
    replaced or added; every other shape and bucket as it was."""
    out = {shape: dict(buckets) for shape, buckets in kept.items()}
    for shape, buckets in swept.items():
        out.setdefault(shape, {}).update(buckets)
    return out


def _f(v, spec=".1f"):
    return "-" if v is None else format(v, spec)


def print_table(rows) -> None:
    log(
        "\n| shape | M | best config | FP8 us | built-in us | bf16 us | FP8 / bf16 time "
        "| FP8 TFLOP/s | bf16 TFLOP/s | rel err | passed / tried |"
    )
    log("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        best = cfg_str(Fp8Config(**r["best"])) if "best" in r else "-"
        ratio = r["fp8_us"] / r["bf16_us"] if "best" in r else None
        flop = 2 * r["m"] * r["n"] * r["k"]
        log(
            f"| {r['shape']} {r['k']}->{r['n']} | {r['m']} | {best} | {_f(r.get('fp8_us'))} "
            f"| {_f(r['default_us'])} | {_f(r['bf16_us'])} | {_f(ratio, '.2f')} "
            f"| {_f(r.get('tflops'), '.0f')} | {flop / (r['bf16_us'] * 1e-6) / 1e12:.0f} "
            f"| {_f(r.get('err'), '.1e')} | {r['passed']} / {r['tried']} |"
        )


def print_targets(rows) -> None:
    """The issue's targets: FP8 >= 1.5x bf16's TFLOP/s at M = 4096, FP8's time summed over the
    shapes at most 0.65x bf16's at M = 1 and 16; FP8 faster than bf16 at M = 64..256."""
    for m in (1, DECODE_M):
        decode = [r for r in rows if r["m"] == m and "best" in r]
        if decode:
            fp8 = sum(r["fp8_us"] for r in decode)
            bf16 = sum(r["bf16_us"] for r in decode)
            log(
                f"M={m} summed over {len(decode)} shapes: FP8 {fp8:.1f} us, bf16 "
                f"{bf16:.1f} us, FP8 / bf16 {fp8 / bf16:.2f} (target <= 0.65)"
            )
    for r in rows:
        if "best" not in r:
            continue
        speedup = r["bf16_us"] / r["fp8_us"]
        if r["m"] == 4096:
            log(f"M=4096 {r['shape']}: FP8 {speedup:.2f}x bf16's TFLOP/s (target 1.5x)")
        elif 64 <= r["m"] <= 256:
            verdict = "faster" if speedup > 1 else "SLOWER"
            log(f"M={r['m']} {r['shape']}: FP8 {verdict} than bf16 ({speedup:.2f}x)")


#: --gemv-variants' option families, in the order printed
FAMILIES = ("dot", "dot scale_ahead", "fma", "fma block_k", "fma bit_cvt", "x_groups",
            "x_groups prefetch", "gemm")  # fmt: skip


def family(cfg: dict) -> str:
    """The option family of a configuration (an ``asdict`` of :class:`Fp8Config`)."""
    if cfg["kind"] != "gemv":
        return cfg["kind"]
    if cfg.get("x_groups"):
        return "x_groups prefetch" if cfg.get("prefetch") else "x_groups"
    if cfg["fma"]:
        if cfg.get("bit_cvt"):
            return "fma bit_cvt"
        return "fma block_k" if cfg.get("block_k", FP8_BLOCK[1]) != FP8_BLOCK[1] else "fma"
    return "dot scale_ahead" if cfg.get("scale_ahead") else "dot"


def _config_of(timing: dict) -> dict:
    """The configuration fields of one entry of a row's ``all`` (its timing keys dropped)."""
    return {f: timing[f] for f in Fp8Config.__dataclass_fields__ if f in timing}


def _table_err(row: dict) -> float | None:
    """The relative error of the table's choice as timed in ``row`` (None: not timed)."""
    today = row.get("table")
    if not today:
        return None
    same = (a for a in row["all"] if all(a.get(f) == v for f, v in today.items()))
    return next((a["err"] for a in same), None)


def family_rows(rows) -> list[dict]:
    """Per M of ``rows`` and per line -- bf16 (``F.linear``), the table's choice today, each
    option family's fastest passed configuration, the best of all -- the us of each shape, the
    sum over the shapes (None where a shape has none), the weights' TB/s over that sum, the
    sum's ratio to bf16's and the largest relative error of the configurations summed."""
    out = []
    for m in sorted({r["m"] for r in rows}):
        at = [r for r in rows if r["m"] == m]
        lines: dict[str, list] = {"bf16 F.linear": [(r["bf16_us"], r["bf16_err"]) for r in at]}
        lines["table today"] = [(r.get("table_us"), _table_err(r)) for r in at]
        picks: dict[str, list] = {}
        for fam in FAMILIES:
            best, picks[fam] = [], []
            for r in at:
                ok = [a for a in r["all"] if a["us"] is not None and family(a) == fam]
                a = min(ok, key=lambda a: a["us"]) if ok else None
                best.append((a["us"], a["err"]) if a else (None, None))
                picks[fam].append(_config_of(a) if a else None)
            if any(us is not None for us, _ in best):
                lines[fam] = best
        lines["best"] = [(r.get("fp8_us"), r.get("err")) for r in at]
        picks["table today"] = [r.get("table") for r in at]
        picks["best"] = [r.get("best") for r in at]
        bf16 = sum(r["bf16_us"] for r in at)
        bf16_bytes = sum(2 * r["n"] * r["k"] for r in at)
        fp8_bytes = sum(r["n"] * r["k"] + 4 * -(-r["n"] // 128) * -(-r["k"] // 128) for r in at)
        for name, vals in lines.items():
            us = [v[0] for v in vals]
            total = None if any(u is None for u in us) else sum(us)
            errs = [v[1] for v in vals if v[1] is not None]
            out.append({
                "m": m, "line": name, "shapes": [r["shape"] for r in at], "us": us,
                "sum_us": total, "err": max(errs) if errs else None,
                "tbs": None if total is None else (
                    (bf16_bytes if name.startswith("bf16") else fp8_bytes) / (total * 1e-6) / 1e12),
                "ratio": None if total is None else total / bf16,
                "configs": picks.get(name, [None] * len(at)),
            })  # fmt: skip
    return out


def print_families(rows) -> None:
    """--gemv-variants' table: per M, a line per option family (its fastest configuration per
    shape), the table's choice today, bf16, the best; us per shape, summed, TB/s, FP8 / bf16
    (the issue's target: <= 0.65 summed), relative error."""
    for m in sorted({r["m"] for r in rows}):
        fr = [f for f in family_rows(rows) if f["m"] == m]
        shapes = fr[0]["shapes"]
        log(f"\nM = {m}: fastest of each option family per shape (us), CUDA-graph timed, weights "
            "not in L2")  # fmt: skip
        log("| line | " + " | ".join(shapes) + " | sum us | TB/s | sum / bf16 | max rel err |")
        log("|---" * (len(shapes) + 5) + "|")
        for f in fr:
            log(f"| {f['line']} | " + " | ".join(_f(u) for u in f["us"])
                + f" | {_f(f['sum_us'])} | {_f(f['tbs'], '.2f')} | {_f(f['ratio'], '.3f')} "
                f"| {_f(f['err'], '.1e')} |")  # fmt: skip
        log(f"M = {m}: the configuration behind each line, per shape")
        for f in fr:
            if any(f["configs"]):
                names = [cfg_str(Fp8Config(**c)) if c else "-" for c in f["configs"]]
                log(f"  {f['line']}: " + "; ".join(f"{s} {c}" for s, c in zip(shapes, names)))


def check_written(rows, device) -> None:
    """Reads the written table back through ``fp8_config``: each row's M gets its best
    configuration."""
    import kernels.configs
    import kernels.fp8_configs as fc

    kernels.configs.kernel_table.cache_clear()
    fc._table_entry.cache_clear()
    fc.table_fallback.cache_clear()
    for r in rows:
        if "best" in r:
            got = fc.fp8_config(r["m"], r["n"], r["k"], device=device)
            if got != Fp8Config(**r["best"]):
                raise RuntimeError(f"table read back {got} for {r['shape']} M={r['m']}")
    log("table read back through fp8_config: every bucket gives its best configuration")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp")
    ap.add_argument("--write-table", action="store_true")
    ap.add_argument(
        "--budget-s", type=float, default=None,
        help="wall time after the imports (default 230; 140 with --gemv-variants)",
    )  # fmt: skip
    ap.add_argument(
        "--compile-budget-s", type=float, default=None, help="default 90; 50 with --gemv-variants"
    )
    ap.add_argument(
        "--gemv-variants", action="store_true",
        help="M = 1 and 16 only (or those of --ms): the small-M kernel's options against the "
        "table's choice today and bf16; prints a table per option family",
    )  # fmt: skip
    ap.add_argument("--workers", type=int, default=0, help="compile processes (0: CPUs - 2)")
    ap.add_argument("--shapes", nargs="*", default=[s[0] for s in SHAPES])
    ap.add_argument("--tiny", action="store_true", help="CPU, interpreter, one small shape")
    ap.add_argument(
        "--ms", type=int, nargs="*", default=None,
        help="M buckets to sweep (default: all); --write-table then keeps the other buckets of "
        "the device's table as they are",
    )  # fmt: skip
    args = ap.parse_args()
    if args.ms and not set(args.ms) <= set(M_BUCKETS):
        ap.error(f"--ms takes buckets of {list(M_BUCKETS)}")
    if args.gemv_variants:
        if args.ms and not set(args.ms) <= set(VARIANT_MS):
            ap.error(f"--gemv-variants takes --ms of {list(VARIANT_MS)}")
        args.ms = list(args.ms or VARIANT_MS)  # --write-table keeps the other buckets
        GEMV_VARIANTS["on"] = True
    if args.budget_s is None:
        args.budget_s = 140.0 if args.gemv_variants else 230.0
    if args.compile_budget_s is None:
        args.compile_budget_s = 50.0 if args.gemv_variants else 90.0
    t0 = time.perf_counter()
    deadline = t0 + args.budget_s - 10  # room to write the results
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if device.type == "cpu" and not args.tiny:
        log("no CUDA device: run with --tiny for the interpreter check of this script")
        return 2
    if args.write_table and device.type != "cuda":
        log("--write-table needs the GPU the table is for")
        return 2
    shapes = TINY_SHAPES if args.tiny else [s for s in SHAPES if s[0] in args.shapes]
    ms = (
        tuple(args.ms)
        if args.gemv_variants
        else TINY_MS
        if args.tiny
        else tuple(args.ms or M_BUCKETS)
    )
    cfgs = compile_set(shapes, ms, args.tiny)
    workers = args.workers or max(1, min(len(cfgs), (os.cpu_count() or 4) - 2, 14))
    log(f"{len(cfgs)} kernels to compile in {workers} processes (budget {args.compile_budget_s} s)")
    tc = time.perf_counter()
    compiled = warm_compile(cfgs, workers, args.compile_budget_s, args.tiny)
    compile_s = time.perf_counter() - tc
    n_ok = sum(e is None for e in compiled.values())
    log(f"compiled {n_ok} ok, {len(compiled) - n_ok} failed, in {compile_s:.1f} s")
    # cuBLASLt is timed from M = CUBLAS_MIN_M only: no probe (a child process) below
    cublas_ms = max(ms) >= CUBLAS_MIN_M
    CUBLAS["ok"] = cublas_ms and cublas_block_fp8_supported(device) and cublas_probe(shapes)
    from kernels.configs import current_table, device_name, table_path

    dev_name = device_name(device)
    path = table_path("fp8_gemm", dev_name)
    # a partial sweep (--ms) merges into the table this device reads now: its own, or its
    # architecture's (an H100 without one reads the H200's), so the other buckets stay
    base = current_table("fp8_gemm", dev_name)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, blob = [], "{}\n"
    for i, (name, n, k) in enumerate(shapes):
        now = time.perf_counter()
        share = now + (deadline - now) / (len(shapes) - i)  # an equal share of the time left
        rows += sweep_shape(name, n, k, ms, device, compiled, share, args.tiny)
        (out / "fp8_sweep.json").write_text(json.dumps(rows))  # kept if a later shape fails
        table = table_of(rows)
        if args.ms and base:  # a partial sweep: the other buckets stay as they were
            table = merge_tables(base, table)
        blob = json.dumps(table, indent=1, sort_keys=True) + "\n"
        (out / path.name).write_text(blob)
    sweep_s = time.perf_counter() - tc - compile_s
    print_table(rows)
    print_targets(rows)
    if args.gemv_variants:
        print_families(rows)
    if args.write_table:
        path.write_text(blob)
        log(f"wrote {path}")
        check_written(rows, device)
    total = time.perf_counter() - t0
    log(
        f"\nwall time {total:.1f} s: compile {compile_s:.1f} s ({len(cfgs)} kernels, "
        f"{workers} processes), check + timing {sweep_s:.1f} s; kernels compiled by the timing "
        f"process itself (cache misses of the warm-up): {COLD['n']}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
