"""Liveness of a tensor-parallel engine's ranks: an engine that lost a rank cannot step.

* Ranks that rank 0 spawned on its host are its child processes: :class:`RankMonitor` waits on
  their process sentinels, so a death is seen within :data:`POLL_S`.
* Ranks started by torchrun (``env://``, maybe on other hosts) are not rank 0's children: every
  rank's :class:`Heartbeat` thread increments a counter in the rendezvous store each
  :data:`HEARTBEAT_S`; rank 0 declares a rank lost when its counter has not moved for
  :data:`STALE_S`, and the other ranks leave when rank 0's has not (a host that vanished sends
  no TCP reset). The counters are compared on each reader's own clock (hosts' clocks differ).

Collectives cannot be interrupted from another thread (NCCL may spin on the device for a dead
peer), so losing a rank ends the process holding rank 0 (the engine core): ``on_fault`` does
that, and the front end then treats it as any dead engine process (requests fail, /health 503).
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

log = logging.getLogger(__name__)

#: seconds between checks of the child processes and heartbeat counters
POLL_S = 0.25
#: seconds between a rank's heartbeats
HEARTBEAT_S = 1.0
#: a rank whose heartbeat counter did not move for this many seconds is lost
STALE_S = 10.0


def heartbeat_key(rank: int) -> str:
    """The store key of ``rank``'s heartbeat counter."""
    return f"qwen_serve/heartbeat/{rank}"


def connect_store(host: str, port: int) -> dist.TCPStore:
    """A new client connection to the rendezvous store (one per thread that uses it)."""
    return dist.TCPStore(
        host, port, is_master=False, timeout=timedelta(seconds=30), wait_for_workers=False
    )


class _Counters:
    """Last value and when (monotonic) it last changed, per watched rank."""

    def __init__(self, ranks: list[int]):
        now = time.monotonic()
        self.seen = {r: (-1, now) for r in ranks}

    def stale(self, store: dist.TCPStore, limit: float) -> list[tuple[int, float]]:
        """(rank, seconds since its counter moved) of the ranks stale beyond ``limit``."""
        now, out = time.monotonic(), []
        for rank, (value, since) in self.seen.items():
            current = store.add(heartbeat_key(rank), 0)
            if current != value:
                self.seen[rank] = (current, now)
            elif now - since > limit:
                out.append((rank, now - since))
        return out


class Heartbeat:
    """A daemon thread that beats for ``rank`` and, optionally, watches other ranks' beats.

    Args:
        store_address: (host, port) of the rendezvous store.
        rank: whose counter to increment; watch: ranks whose beats to check (workers: [0]).
        on_stale: called once with a message when a watched rank goes silent or the store is
            unreachable (rank 0's host hosts it, or torchrun's agent does).
    """

    def __init__(
        self,
        store_address: tuple[str, int],
        rank: int,
        watch: list[int] = (),
        on_stale: Callable[[str], None] | None = None,
    ):
        self._addr, self._rank = store_address, rank
        self._watch, self._on_stale = list(watch), on_stale
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{rank}", daemon=True)

    def start(self) -> Heartbeat:
        """Start the thread; returns self."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating and watching (the thread ends within :data:`HEARTBEAT_S`)."""
        self._stop.set()

    def _run(self) -> None:
        try:
            store = connect_store(*self._addr)
            counters = _Counters(self._watch)
            while not self._stop.wait(HEARTBEAT_S):
                store.add(heartbeat_key(self._rank), 1)
                lost = counters.stale(store, STALE_S) if self._watch else []
                if lost and self._on_stale is not None:
                    rank, quiet = lost[0]
                    self._on_stale(f"rank {rank} sent no heartbeat for {quiet:.0f}s")
                    return
        except Exception as exc:  # noqa: BLE001 - the store is gone: so is the engine
            if not self._stop.is_set() and self._on_stale is not None:
                self._on_stale(f"rendezvous store {self._addr[0]}:{self._addr[1]} lost: {exc}")


class RankMonitor:
    """Rank 0's watch over the other ranks, in a daemon thread.

    Args:
        processes: rank -> the child process running it (ranks rank 0 spawned).
        on_fault: called once, from the monitor thread, with a message naming the lost rank
            (it is expected not to return: it ends the process).
    """

    def __init__(
        self,
        processes: dict[int, multiprocessing.process.BaseProcess],
        on_fault: Callable[[str], None],
    ):
        self._processes = dict(processes)
        self._on_fault = on_fault
        self._stop = threading.Event()
        self._store_address: tuple[str, int] | None = None
        self._remote: list[int] = []
        self._thread = threading.Thread(target=self._run, name="rank-monitor", daemon=True)

    def start(self) -> RankMonitor:
        """Start the monitor thread; returns self."""
        self._thread.start()
        return self

    def watch_heartbeats(self, store_address: tuple[str, int], ranks: list[int]) -> None:
        """Also watch ``ranks``' heartbeats (ranks not spawned here), and beat for rank 0."""
        self._remote, self._store_address = list(ranks), store_address

    def stop(self) -> None:
        """Stop watching (before a deliberate shutdown: the ranks' exits are expected)."""
        self._stop.set()

    def _run(self) -> None:
        store = counters = None
        last_beat = 0.0
        while not self._stop.is_set():
            sentinels = {p.sentinel: r for r, p in self._processes.items()}
            if sentinels:
                ready = multiprocessing.connection.wait(list(sentinels), timeout=POLL_S)
            else:
                ready = []
                self._stop.wait(POLL_S)
            if self._stop.is_set():
                return
            for s in ready:
                rank = sentinels[s]
                proc = self._processes[rank]
                proc.join(0)
                self._fault(f"rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}")
                return
            if self._store_address is None or time.monotonic() - last_beat < HEARTBEAT_S:
                continue
            last_beat = time.monotonic()
            try:
                if store is None:
                    store = connect_store(*self._store_address)
                    counters = _Counters(self._remote)
                store.add(heartbeat_key(0), 1)
                lost = counters.stale(store, STALE_S)
            except Exception as exc:  # noqa: BLE001 - the store (torchrun's agent) is gone
                self._fault(f"rendezvous store lost: {exc}")
                return
            if lost:
                rank, quiet = lost[0]
                self._fault(f"rank {rank} sent no heartbeat for {quiet:.0f}s")
                return

    def _fault(self, message: str) -> None:
        if not self._stop.is_set():
            self._on_fault(message)
