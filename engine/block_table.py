"""A host-side mirror of the requests' block tables in one numpy array, updated incrementally.

Building a step's ``[B, max_blocks]`` block table from Python lists costs a copy of every block
id of every request, every step (tens of thousands of ints at batch 256). Block tables only
grow while a request runs, so the mirror keeps one row per live request and copies only the
ids appended since the last step; a step's table is then a row gather (vLLM's persistent
``BlockTable`` of its input batch does the same).
"""

from __future__ import annotations

import numpy as np

from engine.request import Request


class PersistentBlockTables:
    """Rows of block ids per request id.

    A row is resynchronised from scratch when the request's ``block_table`` list object changed
    (the block manager replaces the list when it frees a request, e.g. on preemption) or shrank;
    otherwise only the new tail is copied.

    Args:
        max_blocks_per_seq: row width (``ceil(max_model_len / block_size)``).
        initial_rows: starting capacity; the array doubles when full.
    """

    def __init__(self, max_blocks_per_seq: int, initial_rows: int = 64):
        if max_blocks_per_seq < 1 or initial_rows < 1:
            raise ValueError("need max_blocks_per_seq >= 1 and initial_rows >= 1")
        self.width = max_blocks_per_seq
        self.table = np.zeros((initial_rows, max_blocks_per_seq), dtype=np.int32)
        self._rows: dict[str, int] = {}
        self._synced: dict[str, tuple[list[int], int]] = {}  # request id -> (its list, entries copied)
        self._free_rows = list(range(initial_rows - 1, -1, -1))

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
        return row

    def rows_for(self, requests: list[Request]) -> np.ndarray:
        """Sync the requests' rows and return their row indices, int64 ``[B]``.

        Raises:
            ValueError: a block table longer than ``max_blocks_per_seq``.
        """
        rows = np.empty(len(requests), dtype=np.int64)
        for i, req in enumerate(requests):
            rid = req.request_id
            row = self._row(rid)
            rows[i] = row
            blocks = req.block_table
            n = len(blocks)
            synced, copied = self._synced.get(rid, (None, 0))
            if synced is not blocks or copied > n:  # the list itself is held, so identity is exact
                copied = 0
            if copied < n:
                if n > self.width:
                    raise ValueError(f"request {rid} has {n} blocks, more than {self.width} per sequence")
                self.table[row, copied:n] = blocks[copied:]
                self._synced[rid] = (blocks, n)
        return rows

    def gather(self, rows: np.ndarray, num_blocks: int) -> np.ndarray:
        """The step's block table: int32 ``[B, num_blocks]`` (entries past a request's blocks are
        stale ids from earlier owners of the row, never read: kernels stop at ``seq_lens``)."""
        return np.take(self.table[:, :num_blocks], rows, axis=0)

    def release(self, request_id: str) -> None:
        """Forget a finished request's row (idempotent)."""
        row = self._rows.pop(request_id, None)
        self._synced.pop(request_id, None)
        if row is not None:
            self._free_rows.append(row)
