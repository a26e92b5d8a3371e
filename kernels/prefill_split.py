"""Host-side policy of the split-KV prefill (``prefill_attention(..., num_splits=S)``): how many
KV splits one launch gets, and the scratch its splits write.

A prompt chunk of few rows over a long cached prefix (a step that carries 256-2048 prompt tokens
while requests decode, each chunk attending to up to 32k cached keys) launches
``cdiv(rows, BLOCK_M) * H_q`` programs (GQA-packed, ``cdiv(rows, BLOCK_M // G) * H_kv``): 32 for
a 256-row chunk of a 16-head model, on a GPU of 132 SMs, each sweeping all the keys serially.
:func:`choose_prefill_splits` cuts the key range so that the programs fill the GPU, with a wave
model of the launch: ``P * S`` programs run in
``ceil(P * S / (num_sms * programs_per_sm))`` waves, each as long as one split's key tiles plus
a fixed per-program cost of the partial write and merge; the smallest ``S`` with the shortest
modelled time wins. Everything is computed from host ints (token count, heads, the step's
``max_seq_len`` bound, the SM count), never from device values, so a step captured in a CUDA
graph at a padded token count (where ``max_seq_len`` is the engine's ``max_model_len``) gets a
fixed split count and a fixed scratch, and the kernel itself splits a tile's range only as far
as its real length allows (``MIN_SPLIT_KEYS``). Imports only torch (and the kernel module).
"""

from __future__ import annotations

import torch

from kernels.prefill_attention import prefill_config, prefill_tiling

__all__ = [
    "choose_prefill_splits",
    "prefill_num_splits",
    "prefill_scratch",
    "scratch_numel",
    "MAX_PARTIAL_ROWS",
    "MAX_PREFILL_SPLITS",
]

#: most ``splits * T`` rows the split scratch holds (34 MB for 16 heads of 128 in fp32); a step
#: that would need more is split less (a 256-row chunk uses 1024 at 4 splits)
MAX_PARTIAL_ROWS = 4096
#: most splits of one launch
MAX_PREFILL_SPLITS = 16
#: a launch over more sequence slots than this whose keys all lie within
#: :data:`UNSPLIT_MAX_KEYS` runs unsplit (see :func:`prefill_num_splits`)
UNSPLIT_MIN_SLOTS = 16
UNSPLIT_MAX_KEYS = 4096
#: modelled cost of one split program beyond its key tiles (partial write, merge read), in
#: key tiles; keeps a split from being chosen for a gain of less than about two tiles
SPLIT_OVERHEAD_TILES = 2


def _cdiv(a: int, b: int) -> int:
    # plain ints: triton.cdiv is a constexpr function, ~8 us a call on the host (triton 3.9),
    # and this runs for every layer of every prefill step
    return -(-a // b)


def choose_prefill_splits(
    num_query_tiles: int,
    num_heads: int,
    max_seq_len: int,
    num_sms: int,
    *,
    block_n: int,
    programs_per_sm: int = 1,
    num_tokens: int = 0,
    max_partial_rows: int = MAX_PARTIAL_ROWS,
    max_splits: int = MAX_PREFILL_SPLITS,
    overhead_tiles: int = SPLIT_OVERHEAD_TILES,
) -> int:
    """KV splits for one prefill launch from host ints (no device access, no sync).

    Wave model: ``P = num_query_tiles * num_heads`` programs per split, ``slots = num_sms *
    programs_per_sm`` of them at once, ``K = cdiv(max_seq_len, block_n)`` key tiles per query
    tile at most; ``S`` splits take ``ceil(P * S / slots) * (ceil(K / S) + overhead)`` tile
    times (no overhead at ``S = 1``). Returns the smallest ``S`` of least modelled time, with
    ``S * num_tokens <= max_partial_rows`` (the scratch) and ``S <= max_splits``. A grid that
    already fills the GPU (``P >= slots``) or a short key range gets 1.

    Args:
        num_query_tiles: query tiles of the launch (e.g. ``cdiv(T, BLOCK_M)``, an upper bound
            for a packed batch; GQA-packed ``cdiv(T, BLOCK_M // G)``); num_heads: programs per
            query tile, H_q (GQA-packed: H_kv).
        max_seq_len: host bound of the longest key range (``AttentionMetadata.max_seq_len``).
        num_sms: multiprocessors of the GPU (132 on an H200).
        block_n: the split config's ``BLOCK_N`` (keys per tile).
        programs_per_sm: prefill programs one SM runs at once (table ``PROGRAMS_PER_SM``).
        num_tokens: rows of ``q`` (T) the scratch must hold per split; 0 skips that bound.
        max_partial_rows, max_splits, overhead_tiles: bounds and cost above.

    Returns:
        An int in ``[1, max_splits]``.

    Raises:
        ValueError: on a negative count, ``num_sms``, ``num_heads``, ``block_n`` or
            ``programs_per_sm`` below 1.
    """
    if (
        num_query_tiles < 0
        or max_seq_len < 0
        or num_tokens < 0
        or num_heads < 1
        or num_sms < 1
        or block_n < 1
        or programs_per_sm < 1
    ):
        raise ValueError("choose_prefill_splits: invalid arguments")
    programs = num_query_tiles * num_heads
    slots = num_sms * programs_per_sm
    key_tiles = _cdiv(max_seq_len, block_n)
    if programs == 0 or programs >= slots or key_tiles < 2:
        return 1
    cap = max_splits
    if num_tokens:
        cap = min(cap, max_partial_rows // num_tokens)
    cap = min(cap, key_tiles)
    best, best_cost = 1, key_tiles
    for s in range(2, cap + 1):
        cost = _cdiv(programs * s, slots) * (_cdiv(key_tiles, s) + overhead_tiles)
        if cost < best_cost:
            best, best_cost = s, cost
    return best


def prefill_num_splits(
    num_tokens: int,
    num_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    max_seq_len: int,
    num_sms: int,
    max_partial_rows: int = MAX_PARTIAL_ROWS,
    num_seqs: int = 1,
    num_kv_heads: int | None = None,
    page_size: int | None = None,
) -> int:
    """:func:`choose_prefill_splits` for a launch of ``num_tokens`` packed query rows, with the
    split config's tiles and policy (:func:`kernels.prefill_attention.prefill_config` with
    ``split=True``: ``BLOCK_M``, ``BLOCK_N``, ``GQA_PACK``, ``PROGRAMS_PER_SM``,
    ``MAX_SPLITS``). Host ints only.

    The wave model counts the launch's programs as the kernel's grid has them
    (:func:`kernels.prefill_attention.prefill_tiling`): ``cdiv(T, BLOCK_M) * H_q``, or
    ``cdiv(T, BLOCK_M // G) * H_kv`` when the split row packs GQA heads. ``num_kv_heads`` (H_kv)
    is needed for the packed count; without it (None) the heads count as ``H_q = H_kv``, which
    never packs. ``page_size`` (the cache's tokens per block) selects the same tiles as the
    launch does (the ``KV_TMA`` rows where the page admits them).

    ``num_seqs``: the launch's sequence slots (``block_tables.shape[0]``). More than
    :data:`UNSPLIT_MIN_SLOTS` with ``max_seq_len <= UNSPLIT_MAX_KEYS`` gives 1: every slot
    owns a query tile of the grid ``(H, T // BLOCK_M + B, splits)`` whether it has prompt rows
    or not (decode rows, padding), so a mixed step of 64 decodes and a 256-row chunk in a graph
    of 256 slots launches ~50k programs a layer at 12 splits, nearly all returning at once --
    on the H200 such steps took 11.8 ms against 4.1 ms for the same step in a 16-slot graph
    (docs/benchmarks.md, 2026-12-02, night) -- while a chunk over at most 4,096 keys needs no
    split.

    Returns:
        An int >= 1 (1: the plain launch).

    Raises:
        ValueError: as :func:`choose_prefill_splits`.
    """
    if num_seqs > UNSPLIT_MIN_SLOTS and max_seq_len <= UNSPLIT_MAX_KEYS:
        return 1
    cfg = prefill_config(head_dim, dtype, device, causal=True, split=True, page_size=page_size)
    _, tok, grid_heads = prefill_tiling(cfg, num_heads, num_kv_heads or num_heads)
    return choose_prefill_splits(
        _cdiv(num_tokens, tok),
        grid_heads,
        max_seq_len,
        num_sms,
        block_n=cfg["BLOCK_N"],
        programs_per_sm=int(cfg["PROGRAMS_PER_SM"]),
        num_tokens=num_tokens,
        max_partial_rows=max_partial_rows,
        max_splits=min(MAX_PREFILL_SPLITS, int(cfg["MAX_SPLITS"])),
    )


def prefill_scratch(
    buffer: torch.Tensor, num_splits: int, num_tokens: int, num_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of one flat float32 ``buffer`` as the split scratch of a launch.

    The buffer is allocated once per device (``torch.empty(scratch_numel(rows, H, D))``) and
    every launch takes views of it, so steps captured in CUDA graphs at different padded sizes
    share it (launches on one stream are ordered, and a launch's scratch is dead once its merge
    has run).

    Returns:
        ``(partial_out, partial_lse)``: float32 ``[num_splits, num_tokens, H, D]`` and
        ``[num_splits, num_tokens, H]``, contiguous, uninitialised.

    Raises:
        ValueError: when ``num_splits * num_tokens`` rows do not fit the buffer, or it is not a
            flat float32 tensor.
    """
    if buffer.dim() != 1 or buffer.dtype != torch.float32:
        raise ValueError("the split scratch buffer must be a flat float32 tensor")
    rows = num_splits * num_tokens
    capacity = buffer.numel() // (num_heads * (head_dim + 1))
    if rows > capacity:
        raise ValueError(f"{num_splits} splits x {num_tokens} rows exceed the scratch ({capacity})")
    n_out = capacity * num_heads * head_dim  # lse after the largest partial_out: no overlap
    po = buffer[: rows * num_heads * head_dim].view(num_splits, num_tokens, num_heads, head_dim)
    plse = buffer[n_out : n_out + rows * num_heads].view(num_splits, num_tokens, num_heads)
    return po, plse


def scratch_numel(max_rows: int, num_heads: int, head_dim: int) -> int:
    """float32 elements of a scratch buffer for ``max_rows`` split rows (partials and lse)."""
    return max_rows * num_heads * (head_dim + 1)
