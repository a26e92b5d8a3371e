"""The attention work of a prompt chunk, counted in query-key pairs, for the scheduler's budget.

A token budget sees a chunk of ``n`` prompt tokens as ``n``, whatever it attends to; but a chunk
over a long cached prefix costs the attention kernel far more than the same chunk at the start
of a prompt (a 1,024-row chunk over 32k cached keys does about 60x the attention work of the
first 1,024 rows of a prompt). The scheduler bounds this work, per step and while requests
decode, with :func:`max_rows_within`; it is Sarathi-Serve's chunk bound (Agrawal et al., "Taming
Throughput-Latency Tradeoff in LLM Inference with Sarathi-Serve", OSDI 2024) measured in the
quantity that grows with the context instead of in tokens.

Pure integer arithmetic, no torch.
"""

from __future__ import annotations

from math import isqrt

__all__ = ["causal_pairs", "max_rows_within"]


def causal_pairs(computed: int, n: int) -> int:
    """Query-key pairs of a causal chunk: rows ``computed .. computed + n - 1`` of a sequence,
    row ``j`` attending to keys ``0 .. j`` (the bottom-right aligned mask of
    :func:`kernels.prefill_attention.prefill_attention`).

    Args:
        computed: tokens already in the KV cache (cached prefix and earlier chunks), >= 0.
        n: rows of the chunk, >= 0.

    Returns:
        ``n * computed + n * (n + 1) / 2`` (an int). Raises nothing.
    """
    return n * computed + n * (n + 1) // 2


def max_rows_within(computed: int, pairs: int) -> int:
    """Most rows ``n`` of a chunk starting after ``computed`` cached tokens whose
    :func:`causal_pairs` fit in ``pairs``.

    Args:
        computed: tokens already in the KV cache, >= 0.
        pairs: query-key pairs left to the step; <= 0 gives 0.

    Returns:
        The largest ``n >= 0`` with ``causal_pairs(computed, n) <= pairs``. Raises nothing.
    """
    if pairs <= 0:
        return 0
    # n^2 + (2c + 1) n - 2 pairs <= 0  =>  n <= (sqrt((2c + 1)^2 + 8 pairs) - (2c + 1)) / 2
    b = 2 * computed + 1
    n = (isqrt(b * b + 8 * pairs) - b) // 2
    # isqrt rounds down: n is the answer or one below it
    while causal_pairs(computed, n + 1) <= pairs:
        n += 1
    return n
