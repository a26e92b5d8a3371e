"""The message rank 0 of a tensor-parallel engine sends the other ranks for each step.

One flat int64 array: a header of :data:`HEADER` fields, then the step's index arrays. The
other ranks hold no request objects: everything they need to run the step's forward is here,
already flattened by rank 0's ``prepare_inputs`` (token ids, positions, slots, the sequences'
lengths, the rows that sample, the tokens still in flight) plus the block-table cells rank 0
wrote since the previous message (``PersistentBlockTables.take_changes``), which the receiver
applies to its :class:`~engine.worker.block_table.RowBlockTables` before gathering the step's
table. Block tables only grow while a request runs, so a decode step carries a few cells, not
``B x max_blocks`` ids.

Layout after the header (lengths in the header: ``T`` tokens, ``B`` sequences, ``N`` sample
rows, ``G`` tokens in flight, ``K`` block-table cells, ``R`` scored prompt positions)::

    input_ids[T] positions[T] slot_mapping[T] logits_indices[N] gather_dst[G] gather_src[G]
    table_rows[B] seq_lens[B] cu_seqlens_q[B + 1] cell_rows[K] cell_cols[K] cell_ids[K]
    prompt_rows[R] prompt_targets[R]

The prompt rows (prompt log-probabilities) make the other ranks take part in the same slices of
LM-head gathers as rank 0 (``engine.worker.prompt_logprobs``); only rank 0 scores them.
"""

from __future__ import annotations

import numpy as np

from engine.worker.block_table import RowBlockTables
from engine.worker.step_inputs import StepInputs

#: header fields (int64): kind, T, B, N, G, K, table width, max_query_len, max_seq_len, length,
#: R
HEADER = 11
(KIND, NUM_TOKENS, NUM_SEQS, NUM_SAMPLES, NUM_GATHER, NUM_CELLS) = range(6)
(TABLE_WIDTH, MAX_QUERY_LEN, MAX_SEQ_LEN, LENGTH, NUM_PROMPT_ROWS) = range(6, 11)

#: message kinds
STEP, SHUTDOWN = 1, 2


def encode_shutdown() -> np.ndarray:
    """The message that ends the other ranks' loops."""
    msg = np.zeros(HEADER, dtype=np.int64)
    msg[KIND], msg[LENGTH] = SHUTDOWN, HEADER
    return msg


def encode_step(inp: StepInputs, cells: tuple[np.ndarray, np.ndarray, np.ndarray]) -> np.ndarray:
    """One step's message.

    Args:
        inp: the step's host inputs on rank 0 (``table_rows`` set by ``prepare_inputs``).
        cells: (rows, cols, block ids) int64 written to rank 0's block tables since the last
            message.

    Returns:
        int64 ``[HEADER + 3T + N + 2G + 3B + 1 + 3K + 2R]``.
    """
    g = 0 if inp.gather_dst is None else len(inp.gather_dst)
    r = 0 if inp.prompt_rows is None else len(inp.prompt_rows)
    parts = [
        inp.input_ids,
        inp.positions,
        inp.slot_mapping,
        inp.logits_indices,
        *((inp.gather_dst, inp.gather_src) if g else ()),
        inp.table_rows,
        inp.seq_lens,
        inp.cu_seqlens_q,
        *cells,
        *((inp.prompt_rows, inp.prompt_targets) if r else ()),
    ]
    header = np.zeros(HEADER, dtype=np.int64)
    header[KIND] = STEP
    header[NUM_TOKENS] = len(inp.input_ids)
    header[NUM_SEQS] = len(inp.seq_lens)
    header[NUM_SAMPLES] = len(inp.logits_indices)
    header[NUM_GATHER] = g
    header[NUM_CELLS] = len(cells[0])
    header[TABLE_WIDTH] = inp.block_tables.shape[1]
    header[MAX_QUERY_LEN] = inp.max_query_len
    header[MAX_SEQ_LEN] = inp.max_seq_len
    header[NUM_PROMPT_ROWS] = r
    msg = np.concatenate([header, *parts], dtype=np.int64)
    msg[LENGTH] = len(msg)
    return msg


def decode_step(msg: np.ndarray, tables: RowBlockTables) -> StepInputs:
    """The step's :class:`StepInputs` on a rank other than 0 (no ``sample_requests``: this rank
    does not sample); applies the message's block-table cells to ``tables`` first.

    Raises:
        ValueError: not a step message, or a length that does not match its header.
    """
    if msg[KIND] != STEP:
        raise ValueError(f"not a step message (kind {int(msg[KIND])})")
    t, b, n, g, k, r = (
        int(msg[i])
        for i in (NUM_TOKENS, NUM_SEQS, NUM_SAMPLES, NUM_GATHER, NUM_CELLS, NUM_PROMPT_ROWS)
    )
    expected = HEADER + 3 * t + n + 2 * g + 3 * b + 1 + 3 * k + 2 * r
    if int(msg[LENGTH]) != expected or len(msg) != expected:
        raise ValueError(f"step message of {len(msg)} values, its header says {expected}")
    pos = HEADER

    def take(count: int) -> np.ndarray:
        nonlocal pos
        out = msg[pos : pos + count]
        pos += count
        return out

    input_ids, positions, slot_mapping, logits_indices = take(t), take(t), take(t), take(n)
    gather_dst, gather_src = (take(g), take(g)) if g else (None, None)
    rows = take(b)
    seq_lens, cu = take(b).astype(np.int32), take(b + 1).astype(np.int32)
    tables.apply(take(k), take(k), take(k))
    prompt_rows, prompt_targets = (take(r), take(r)) if r else (None, None)
    return StepInputs(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        block_tables=tables.gather(rows, int(msg[TABLE_WIDTH])),
        seq_lens=seq_lens,
        cu_seqlens_q=cu,
        logits_indices=logits_indices,
        sample_requests=[],
        max_query_len=int(msg[MAX_QUERY_LEN]),
        max_seq_len=int(msg[MAX_SEQ_LEN]),
        gather_dst=gather_dst,
        gather_src=gather_src,
        table_rows=rows,
        prompt_rows=prompt_rows,
        prompt_targets=prompt_targets,
    )
