"""Query-key pair counting of the scheduler's attention budget, against a brute-force count."""

from __future__ import annotations

import random

import torch

from engine.core.attention_budget import causal_pairs, max_rows_within


def _pairs_by_mask(computed: int, n: int) -> int:
    """Pairs the causal mask lets through, counted on the mask itself."""
    rows = torch.arange(computed, computed + n)[:, None]
    keys = torch.arange(computed + n)[None, :]
    return int((keys <= rows).sum())


def test_causal_pairs_counts_the_mask():
    rng = random.Random(3)
    for _ in range(50):
        c, n = rng.randrange(0, 300), rng.randrange(0, 80)
        assert causal_pairs(c, n) == _pairs_by_mask(c, n)


def test_max_rows_within_is_the_largest_chunk_that_fits():
    rng = random.Random(4)
    cases = [(0, 0), (0, 1), (5, 5), (32000, 1 << 20), (0, 525_000), (10**6, 10**6 - 1)]
    cases += [(rng.randrange(0, 50_000), rng.randrange(-10, 5_000_000)) for _ in range(500)]
    for c, pairs in cases:
        n = max_rows_within(c, pairs)
        assert n >= 0
        if pairs <= 0:
            assert n == 0
            continue
        assert causal_pairs(c, n) <= pairs < causal_pairs(c, n + 1), (c, pairs, n)
