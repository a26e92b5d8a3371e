"""Candidate tiles of the paged prefill kernel that ``bench/prefill_long.py --sweep`` times and
``bench/prefill_compile_check.py`` compiles for sm_90 offline (no torch import here, so the
compile check can import it before Triton's interpreter switch is read).

Each entry is a :func:`kernels.prefill_attention.prefill_config` override; the first of each list
is the configuration without a table row (issue 3's choice for bf16, D=128 on the H200).
"""

from __future__ import annotations


def tiles(
    bm: int,
    bn: int,
    warps: int,
    stages: int,
    prefetch: bool = True,
    pack: bool = False,
    tma: bool = False,
) -> dict:
    """One candidate; ``pack`` adds ``GQA_PACK: True`` (the G query heads of a KV head packed
    into the tile's BLOCK_M rows, BLOCK_M // G tokens each; the kernel falls back to unpacked
    where G or BLOCK_M // G does not allow it). Unpacked candidates carry no ``GQA_PACK`` key, as
    the configuration without a table row has none. ``tma`` adds ``KV_TMA: True`` (K/V tiles
    through tensor descriptors; the cache's pages must hold whole ``BLOCK_N`` tiles)."""
    cfg = {
        "BLOCK_M": bm,
        "BLOCK_N": bn,
        "num_warps": warps,
        "num_stages": stages,
        "BT_PREFETCH": prefetch,
    }
    if pack:
        cfg["GQA_PACK"] = True
    if tma:
        cfg["KV_TMA"] = True
    return cfg


#: single-pass launches (long causal prompts, chunks that fill the GPU): BLOCK_M 128 with 8 warps
#: (two Hopper warpgroups of 64 rows), BLOCK_M 64 with 4, 2-4 pipeline stages, block-id prefetch
UNSPLIT_CONFIGS = [
    tiles(128, 128, 8, 2),
    tiles(128, 128, 8, 3),
    tiles(128, 128, 8, 2, prefetch=False),
    tiles(128, 64, 8, 2),
    tiles(128, 64, 8, 3),
    tiles(128, 64, 8, 4),
    tiles(128, 64, 4, 3),
    tiles(64, 128, 4, 2),
    tiles(64, 128, 4, 3),
    tiles(64, 64, 4, 3),
    tiles(64, 64, 4, 4),
    # GQA-packed (Qwen3-0.6B's G = 2: BLOCK_M 128 holds 64 tokens x 2 heads, 64 holds 32 x 2)
    tiles(128, 128, 8, 2, pack=True),
    tiles(128, 64, 8, 3, pack=True),
    tiles(64, 128, 4, 2, pack=True),
    tiles(64, 64, 4, 3, pack=True),
]

#: split-KV launches (few query tiles over long keys): fewer rows per program fill more SMs
SPLIT_CONFIGS = [
    tiles(128, 128, 8, 2),
    tiles(128, 64, 8, 3),
    tiles(64, 128, 4, 2),
    tiles(64, 64, 4, 3),
    tiles(128, 128, 8, 2, pack=True),
    tiles(64, 128, 4, 2, pack=True),
    tiles(64, 64, 4, 3, pack=True),
]

#: the ``KV_TMA`` path's candidates (``--block-size`` 64 or more, Hopper): the first is its
#: default without a table row (``kernels.prefill_attention._default_tma_config``); from the
#: design study ``bench/prefill_variants.py`` (BLOCK_N 64 with 4 warps led on the H200)
TMA_UNSPLIT_CONFIGS = [
    tiles(128, 64, 4, 3, tma=True),
    tiles(128, 64, 4, 4, tma=True),
    tiles(128, 64, 4, 2, tma=True),
    tiles(128, 64, 8, 3, tma=True),
    tiles(128, 128, 8, 3, tma=True),
    tiles(128, 128, 8, 2, tma=True),
    tiles(64, 64, 4, 3, tma=True),
    tiles(128, 64, 4, 3, tma=True, pack=True),
]
TMA_SPLIT_CONFIGS = [
    tiles(128, 64, 4, 3, tma=True),
    tiles(128, 128, 8, 3, tma=True),
    tiles(64, 64, 4, 3, tma=True),
    tiles(64, 64, 4, 4, tma=True),
]
TINY_TMA_UNSPLIT_CONFIGS = [tiles(32, 16, 4, 1, tma=True), tiles(32, 32, 4, 1, tma=True)]
TINY_TMA_SPLIT_CONFIGS = [tiles(32, 16, 4, 1, tma=True)]

#: split policies (table keys of the split row): programs resident per SM in the wave model, and
#: the most splits; MAX_SPLITS 1 is the split mode off
POLICIES = [
    {"PROGRAMS_PER_SM": 1, "MAX_SPLITS": 16},
    {"PROGRAMS_PER_SM": 2, "MAX_SPLITS": 16},
    {"PROGRAMS_PER_SM": 1, "MAX_SPLITS": 1},
]

#: split counts timed for every chunk shape (plus every count a policy above would pick)
SPLIT_COUNTS = (2, 4, 8, 16)

#: the interpreter's (CPU, ``--tiny``) lists: small tiles so the smoke test runs in minutes
TINY_UNSPLIT_CONFIGS = [tiles(32, 32, 4, 1), tiles(16, 32, 4, 1), tiles(32, 32, 4, 1, pack=True)]
TINY_SPLIT_CONFIGS = [tiles(32, 32, 4, 1), tiles(16, 16, 4, 1), tiles(32, 16, 4, 1, pack=True)]
TINY_SPLIT_COUNTS = (2, 4)
