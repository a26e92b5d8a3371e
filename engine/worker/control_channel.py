"""Rank 0 -> every other rank: one int64 message per step over the gloo control group.

A message travels in one broadcast of a fixed :data:`INLINE_VALUES`-value buffer (gloo needs
the same size on every rank, and one round trip is what a step can afford); a longer message
(a large prefill) sends the rest in a second broadcast whose size the first one's header gives
(``engine.worker.step_message``). A decode step of a few hundred sequences fits inline.

The broadcast is a TCP send on rank 0 (it returns once the bytes are written, so rank 0 never
waits for a busy rank) and a blocking receive elsewhere; a peer that dies closes its sockets,
and the call raises at once instead of hanging.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from engine.worker.step_message import HEADER, LENGTH

#: values (int64) of the buffer every message's first broadcast carries: 32 KiB
INLINE_VALUES = 4096


class ControlChannel:
    """Step messages from the group's rank 0 to its other ranks.

    Args:
        group: the gloo control group; rank: this rank in it.
        inline_values: size of the first broadcast (at least the header).

    Raises:
        ValueError: an inline size below the header.
    """

    def __init__(self, group: dist.ProcessGroup, rank: int, inline_values: int = INLINE_VALUES):
        if inline_values < HEADER:
            raise ValueError(f"inline_values must be >= {HEADER}")
        self.group, self.rank = group, rank
        self._src = dist.get_global_rank(group, 0)
        self._buf = torch.zeros(inline_values, dtype=torch.int64)
        self._view = self._buf.numpy()

    def send(self, msg: np.ndarray) -> None:
        """Broadcast an int64 message (rank 0 only).

        Raises:
            RuntimeError: a peer is gone (gloo's error).
        """
        n = len(msg)
        head = min(n, len(self._view))
        self._view[:head] = msg[:head]
        dist.broadcast(self._buf, src=self._src, group=self.group)
        if n > head:
            dist.broadcast(
                torch.from_numpy(np.ascontiguousarray(msg[head:])), self._src, self.group
            )

    def recv(self) -> np.ndarray:
        """The next message (ranks other than 0): a new int64 array; blocks until it comes.

        Raises:
            RuntimeError: rank 0 is gone (gloo's error).
        """
        dist.broadcast(self._buf, src=self._src, group=self.group)
        n = int(self._view[LENGTH])
        head = min(n, len(self._view))
        if n <= head:
            return self._view[:n].copy()
        rest = torch.empty(n - head, dtype=torch.int64)
        dist.broadcast(rest, src=self._src, group=self.group)
        return np.concatenate([self._view[:head], rest.numpy()])
