"""A host-side mirror of the requests' block tables in one numpy array, updated incrementally.

Building a step's ``[B, max_blocks]`` block table from Python lists costs a copy of every block
id of every request, every step (tens of thousands of ints at batch 256). Block tables only
grow while a request runs, so the mirror keeps one row per live request and writes only the
block ids each scheduled batch appended (``ScheduledBatch.new_block_ids``); a step's table is
then a row gather (vLLM's persistent ``BlockTable`` of its input batch does the same).
"""

from __future__ import annotations

import numpy as np

from engine.core.scheduler import ScheduledBatch


class PersistentBlockTables:
    """Rows of block ids per request id.

    Args:
        max_blocks_per_seq: row width (``ceil(max_model_len / block_size)``).
        initial_rows: starting capacity; the array doubles when full.
        record_changes: keep every write for :meth:`take_changes` (rank 0 of a tensor-parallel
            engine sends them to the other ranks' :class:`RowBlockTables`).

    Raises:
        ValueError: non-positive sizes.
    """

    def __init__(
        self, max_blocks_per_seq: int, initial_rows: int = 64, record_changes: bool = False
    ):
        if max_blocks_per_seq < 1 or initial_rows < 1:
            raise ValueError("need max_blocks_per_seq >= 1 and initial_rows >= 1")
        self.width = max_blocks_per_seq
        self.table = np.zeros((initial_rows, max_blocks_per_seq), dtype=np.int32)
        self._rows: dict[str, int] = {}
        self._lengths: dict[str, int] = {}  # request id -> block ids in its row
        self._free_rows = list(range(initial_rows - 1, -1, -1))
        # (row, first column, block ids) of every write since take_changes, or None
        self._changes: list[tuple[int, int, list[int]]] | None = [] if record_changes else None

    def __len__(self) -> int:
        return len(self._rows)

    def _row(self, request_id: str) -> int:
        row = self._rows.get(request_id)
        if row is None:
            if not self._free_rows:
                old = self.table.shape[0]
                self.table = np.concatenate([self.table, np.zeros_like(self.table)])
                self._free_rows = list(range(2 * old - 1, old - 1, -1))
            row = self._free_rows.pop()
            self._rows[request_id] = row
            self._lengths[request_id] = 0
        return row

    def append(self, request_id: str, block_ids: list[int], reset: bool = False) -> None:
        """Append block ids to the request's row (``reset``: the row starts over with them).

        Raises:
            ValueError: a row longer than ``max_blocks_per_seq``.
        """
        start = 0 if reset else self._lengths.get(request_id, 0)
        end = start + len(block_ids)
        if end > self.width:
            raise ValueError(
                f"request {request_id} has {end} blocks, more than {self.width} per sequence"
            )
        row = self._row(request_id)
        self.table[row, start:end] = block_ids
        self._lengths[request_id] = end
        if self._changes is not None and block_ids:
            self._changes.append((row, start, block_ids))

    def take_changes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The writes since the last call as int64 (rows, columns, block ids), one entry per
        block id written, in order (a later write to a cell wins). Needs ``record_changes``."""
        changes, self._changes = self._changes, []
        if not changes:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, empty
        lengths = np.fromiter((len(c[2]) for c in changes), dtype=np.int64, count=len(changes))
        rows = np.repeat(np.fromiter((c[0] for c in changes), dtype=np.int64), lengths)
        starts = np.repeat(np.fromiter((c[1] for c in changes), dtype=np.int64), lengths)
        offsets = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(
            np.cumsum(lengths) - lengths, lengths
        )
        ids = np.fromiter((b for c in changes for b in c[2]), dtype=np.int64)
        return rows, starts + offsets, ids

    def apply(self, batch: ScheduledBatch) -> np.ndarray:
        """Apply a scheduled batch's changes (finished requests released first) and return the
        row index of each of its requests, int64 ``[B]``."""
        for rid in batch.finished_request_ids:
            self.release(rid)
        rows = np.empty(len(batch.requests), dtype=np.int64)
        for i, req in enumerate(batch.requests):
            blocks = batch.new_block_ids[i]
            if blocks or batch.block_table_reset[i]:
                self.append(req.request_id, blocks, batch.block_table_reset[i])
            rows[i] = self._row(req.request_id)
        return rows

    def gather(self, rows: np.ndarray, num_blocks: int) -> np.ndarray:
        """The step's block table: int32 ``[B, num_blocks]`` (entries past a request's blocks are
        stale ids from earlier owners of the row, never read: kernels stop at ``seq_lens``)."""
        return self.table[rows, :num_blocks]  # a copy (about 3x faster than np.take of a view)

    def release(self, request_id: str) -> None:
        """Forget a finished request's row (idempotent)."""
        row = self._rows.pop(request_id, None)
        self._lengths.pop(request_id, None)
        if row is not None:
            self._free_rows.append(row)


class RowBlockTables:
    """The block tables of the other ranks of a tensor-parallel engine: rows indexed as rank 0's
    :class:`PersistentBlockTables` assigned them, written only through the changes rank 0 sends
    (vectorised, no per-request state on these ranks).

    Args:
        max_blocks_per_seq: row width; initial_rows: starting capacity (grows to fit a row).
    """

    def __init__(self, max_blocks_per_seq: int, initial_rows: int = 64):
        self.width = max_blocks_per_seq
        self.table = np.zeros((initial_rows, max_blocks_per_seq), dtype=np.int32)

    def apply(self, rows: np.ndarray, cols: np.ndarray, block_ids: np.ndarray) -> None:
        """Write ``block_ids`` at ``(rows, cols)`` (int64 ``[K]`` each, from
        :meth:`PersistentBlockTables.take_changes`); later entries win."""
        if not len(rows):
            return
        need = int(rows.max()) + 1
        if need > self.table.shape[0]:
            grown = np.zeros((max(need, 2 * self.table.shape[0]), self.width), dtype=np.int32)
            grown[: self.table.shape[0]] = self.table
            self.table = grown
        self.table[rows, cols] = block_ids

    def gather(self, rows: np.ndarray, num_blocks: int) -> np.ndarray:
        """int32 ``[B, num_blocks]``: the step's block table (as
        :meth:`PersistentBlockTables.gather`)."""
        return self.table[rows, :num_blocks]  # a copy (about 3x faster than np.take of a view)
